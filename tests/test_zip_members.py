"""Zip members (issue 18, items 6 and 17): every zip clipcli reads (npz, .keras) names each
member's file once, however spelt, through one shared check; bzip2 and lzma npz members,
which np.load reads, are read under the same expansion budget, bounded while inflating.

References: `unzip` and zipfile's extractall (which file a member becomes), np.load (values)."""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import MainRun as Run

from clipcli.errors import InputError
from clipcli.formats.keras_archive import KerasArchiveReader
from clipcli.formats.npz import NpzReader

Cli = Callable[..., Run]


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array)
    return buffer.getvalue()


def write_zip(
    path: Path, members: list[tuple[str, bytes]], method: int = zipfile.ZIP_STORED
) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of an exact duplicate name
        with zipfile.ZipFile(path, "w", method) as archive:
            for name, data in members:
                archive.writestr(zipfile.ZipInfo(name), data, method)
    return path


def weights_h5(tmp_path: Path) -> bytes:
    import h5py

    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.ones(3, np.float32)
    data = path.read_bytes()
    path.unlink()
    return data


# Pairs of names that one file receives when extracted (and each alone reads fine).
SAME_FILE = {
    "dot_slash": ("t.npy", "./t.npy"),
    "double_slash": ("a/t.npy", "a//t.npy"),
    "dot_component": ("a/t.npy", "a/./t.npy"),
    "backslash": ("a/t.npy", "a\\t.npy"),
    "exact": ("t.npy", "t.npy"),
    "trailing_slash": ("t.npy", "t.npy/"),
}


@pytest.mark.parametrize("case", list(SAME_FILE))
def test_npz_members_naming_one_file_are_refused(clipcli: Cli, tmp_path: Path, case: str) -> None:
    first, second = SAME_FILE[case]
    path = write_zip(tmp_path / "m.npz", [(first, npy(np.ones(2))), (second, npy(np.full(2, 1e6)))])
    run = clipcli("norms", path)
    assert run.returncode == 3, run.stderr
    assert "duplicates" in run.stderr
    assert run.stderr.count("\n") == 1


@pytest.mark.parametrize("case", ["dot_slash", "double_slash", "dot_component", "exact"])
def test_unzip_extracts_such_pairs_to_one_file(tmp_path: Path, case: str) -> None:
    """The reference: what clipcli refuses above is indeed one file to unzip and zipfile."""
    first, second = SAME_FILE[case]
    path = write_zip(tmp_path / "m.zip", [(first, b"first"), (second, b"second")])
    extracted = tmp_path / "zipfile"
    with zipfile.ZipFile(path) as archive:
        archive.extractall(extracted)
    files = [p for p in extracted.rglob("*") if p.is_file()]
    assert len(files) == 1
    if shutil.which("unzip"):
        by_unzip = tmp_path / "unzip"
        subprocess.run(["unzip", "-o", "-q", path, "-d", by_unzip], check=False)
        assert len([p for p in by_unzip.rglob("*") if p.is_file()]) == 1


def test_npz_names_that_differ_in_case_are_two_tensors(tmp_path: Path) -> None:
    """np.load tells 'T' from 't' (tensor names are case-sensitive), so npz keeps both."""
    path = write_zip(tmp_path / "m.npz", [("T.npy", npy(np.ones(2))), ("t.npy", npy(np.zeros(3)))])
    with NpzReader(path) as reader:
        assert [info.name for info in reader.infos] == ["T", "t"]
    assert sorted(np.load(path).files) == ["T", "t"]


def test_single_odd_spellings_still_read(tmp_path: Path) -> None:
    path = write_zip(
        tmp_path / "m.npz", [("./t.npy", npy(np.ones(2))), ("a//u.npy", npy(np.ones(1)))]
    )
    with NpzReader(path) as reader:
        assert [info.name for info in reader.infos] == ["./t", "a//u"]


KERAS_SAME_FILE = [
    "./model.weights.h5",
    "model.weights.h5",
    ".//model.weights.h5",
    "Model.Weights.h5",  # one file on a case-insensitive filesystem
]


@pytest.mark.parametrize("hidden", KERAS_SAME_FILE)
def test_keras_hidden_second_weights_member_is_refused(
    clipcli: Cli, tmp_path: Path, hidden: str
) -> None:
    """The issue's example: clipcli measured one weights member, unzip extracted the other,
    and clip carried the hidden one unclipped."""
    weights = weights_h5(tmp_path)
    path = write_zip(
        tmp_path / "m.keras",
        [("config.json", b"{}"), ("model.weights.h5", weights), (hidden, weights)],
    )
    for command in (("ls", path), ("clip", "--global", "1", path, tmp_path / "out.keras")):
        run = clipcli(*command)
        assert run.returncode == 3, run.stderr
        assert "duplicates" in run.stderr
    assert not (tmp_path / "out.keras").exists()


def test_keras_assets_differing_in_case_are_refused(tmp_path: Path) -> None:
    weights = weights_h5(tmp_path)
    path = write_zip(
        tmp_path / "m.keras",
        [
            ("config.json", b"{}"),
            ("model.weights.h5", weights),
            ("assets/Vocab.txt", b"a"),
            ("assets/vocab.txt", b"b"),
        ],
    )
    with pytest.raises(InputError, match="duplicates"):
        KerasArchiveReader(path)


def _flip_local_utf8_flag(path: Path) -> None:
    data = bytearray(path.read_bytes())
    assert data[:4] == b"PK\x03\x04"
    (flags,) = struct.unpack_from("<H", data, 6)
    struct.pack_into("<H", data, 6, flags ^ 0x800)
    path.write_bytes(bytes(data))


def test_local_header_name_read_another_way_is_refused(tmp_path: Path) -> None:
    """Same bytes, but the local header drops the UTF-8 flag: a tool that reads local
    headers (streaming unzip) sees 'Ã©.npy' where the central directory says 'é.npy'."""
    path = write_zip(tmp_path / "m.npz", [("\u00e9.npy", npy(np.ones(2)))])
    with NpzReader(path) as reader:
        assert [info.name for info in reader.infos] == ["\u00e9"]
    _flip_local_utf8_flag(path)
    with pytest.raises(InputError, match="local header disagrees"):
        NpzReader(path)


def test_local_header_with_another_name_is_refused(tmp_path: Path) -> None:
    path = write_zip(tmp_path / "m.npz", [("t.npy", npy(np.ones(2)))])
    data = path.read_bytes()
    path.write_bytes(data[:30] + b"u" + data[31:])  # the local name only
    with pytest.raises(InputError, match="local header disagrees"):
        NpzReader(path)


# ------------------------------------------------------------------ bzip2 and lzma (item 17)


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_bzip2_and_lzma_members_read_as_np_load_reads_them(
    clipcli: Cli, tmp_path: Path, method: int
) -> None:
    rng = np.random.default_rng(3)
    arrays: dict[str, np.ndarray] = {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "f": np.asfortranarray(rng.standard_normal((5, 7))),
        "e": np.zeros(0, np.float16),
    }
    src = write_zip(tmp_path / "m.npz", [(f"{k}.npy", npy(v)) for k, v in arrays.items()], method)
    reference = np.load(src)
    with NpzReader(src) as reader:
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info), reference[info.name])
            pieces = [c.ravel() for c in reader.chunks(info, 100)]
            joined = np.concatenate(pieces) if pieces else np.zeros(0, info.dtype)
            np.testing.assert_array_equal(joined, reference[info.name].ravel())
    out = tmp_path / "out.npz"
    run = clipcli("clip", "--global", "1", "--quiet", src, out)
    assert run.returncode == 0, run.stderr
    clipped = np.load(out)
    total = sum(float(np.sum(clipped[k].astype(np.float64) ** 2)) for k in arrays)
    assert total <= 1.0


def read_everything(path: Path) -> None:
    with NpzReader(path) as reader:
        for info in reader.infos:
            for _ in reader.chunks(info):
                pass


def _declare_smaller(path: Path, size: int) -> None:
    """Patch the one member's uncompressed size, in its local header and central entry."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 22, size)
    central = data.rindex(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 24, size)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("method", "inflated"), [(zipfile.ZIP_BZIP2, 128 << 20), (zipfile.ZIP_LZMA, 48 << 20)]
)
def test_member_inflating_past_its_declared_size_is_stopped_while_inflating(
    tmp_path: Path, method: int, inflated: int
) -> None:
    """The member declares 1,000 data bytes and inflates to tens of MiB: refused, and no
    more than a bounded amount is ever inflated (zipfile hands all of the input to the
    decompressor at once and would hold the whole of it)."""
    header = npy(np.zeros(1000, np.uint8))[:-1000]
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", method) as archive, archive.open("t.npy", "w") as sink:
        sink.write(header)
        block = bytes(1 << 20)
        for _ in range(inflated >> 20):
            sink.write(block)
    assert path.stat().st_size < 64 << 10
    _declare_smaller(path, len(header) + 1000)
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="inflates past"):
            read_everything(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_truncated_bzip2_member_is_refused(tmp_path: Path) -> None:
    path = write_zip(tmp_path / "m.npz", [("t.npy", npy(np.arange(5000.0)))], zipfile.ZIP_BZIP2)
    data = bytearray(path.read_bytes())
    central = data.rindex(b"PK\x01\x02")
    (compressed,) = struct.unpack_from("<I", data, 18)
    name_len, extra_len = struct.unpack_from("<HH", data, 26)
    start = 30 + name_len + extra_len
    data[start + compressed // 2 : start + compressed] = bytes(compressed - compressed // 2)
    path.write_bytes(bytes(data))
    assert central == data.rindex(b"PK\x01\x02")
    with pytest.raises(InputError):
        read_everything(path)


def test_bzip2_bytes_past_the_budget_are_refused_before_reading(tmp_path: Path) -> None:
    """The budget on declared sizes holds for bzip2 as for deflate."""
    from clipcli.formats import zipsafe as zipcheck

    path = write_zip(tmp_path / "m.npz", [("t.npy", npy(np.zeros(1 << 16)))], zipfile.ZIP_BZIP2)
    size = os.path.getsize(path)
    inflated = zipfile.ZipFile(path).infolist()[0].file_size
    original = zipcheck.BOMB_MIN_BYTES
    try:
        zipcheck.BOMB_MIN_BYTES = inflated - zipcheck.BOMB_RATIO * size  # exactly at the limit
        with NpzReader(path) as reader:
            assert reader.infos[0].shape == (1 << 16,)
        zipcheck.BOMB_MIN_BYTES -= 1  # one byte past it
        with pytest.raises(InputError, match="zip bomb"):
            NpzReader(path)
    finally:
        zipcheck.BOMB_MIN_BYTES = original


def test_lzma_dictionary_asked_for_is_capped_by_the_member_size(tmp_path: Path) -> None:
    """An lzma member's header may ask for a 4 GiB dictionary, which the decoder allocates
    at once; the member's own declared size is dictionary enough for any valid stream."""
    array = np.arange(300, dtype=np.float64)
    path = write_zip(tmp_path / "m.npz", [("t.npy", npy(array))], zipfile.ZIP_LZMA)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, 26)
    properties = 30 + name_len + extra_len + 4
    data[properties + 1 : properties + 5] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        with NpzReader(path) as reader:
            np.testing.assert_array_equal(reader.read(reader.infos[0]), array)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
