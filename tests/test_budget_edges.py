"""Every budget and limit of the readers tested exactly at its constant and one step past
it, with the real values (no limit shrunk by monkeypatch): a mutant that doubles a budget,
or turns `>=` into `>`, fails here. Files are built with h5py, numpy and by hand; what is
expected comes from integer arithmetic and the official readers, not from clipcli."""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from expect import listing, one_error_line
from handmade import read_safetensors, write_safetensors

from clipcli.errors import InputError
from clipcli.formats.hdf5 import Hdf5Reader, limits
from clipcli.formats.safetensors import MAX_HEADER_BYTES, SafetensorsReader

Cli = Callable[..., Any]

MIB = 1 << 20
TIB = 1 << 40


# ------------------------------------------------------------------ numerics: e8m0 floor

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E8M0_SMALLEST = Fraction(1, 2**127)  # no zero: every value is at least this


def _clip_e8m0(tmp_path: Path, count: int, limit: float) -> tuple[int, Path]:
    from clipcli.cli.entry import main

    src = write_safetensors(tmp_path / "in.safetensors", {"e": np.ones(count, E8M0)})
    out = tmp_path / "out.safetensors"
    code = main(["clip", "--norm", repr(limit), "-q", str(src), str(out)])
    return code, out


def test_e8m0_refusal_names_the_limit_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A limit exactly at the least norm sqrt(n) * 2**-127 is refused naming that limit
    (without the margin the search ran, found no factor and refused 'a norm of 0')."""
    limit = 2 * 2.0**-127  # 4 values: the least norm is exactly 2 * 2**-127
    code, out = _clip_e8m0(tmp_path, 4, limit)
    assert code == 4
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot be scaled to a norm of {limit:g}:" in line
    assert not out.exists()


def test_e8m0_refusal_names_the_smallest_of_the_dtype_without_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group of a float16 tensor (listed first) and an e8m0 one: the refusal names the
    smallest e8m0 value (2**-127), not the first member's dtype's (which has a zero: the
    message said "0"). Found by the session-34 attack."""
    from clipcli.cli.entry import main

    tensors = {"a": np.ones(3, np.float16), "e": np.ones(4, E8M0)}
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e-40", "-q", str(src), str(out)]) == 4
    line = one_error_line(capsys.readouterr().err)
    assert f"every value at least its smallest, {2.0**-127:g})" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("limit_squared_over_floor", "code"), [(1 + 2**-21, 4), (1 + 2**-19, 0)], ids=["in", "above"]
)
def test_e8m0_limit_within_the_margin_above_the_floor_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit_squared_over_floor: float, code: int
) -> None:
    """Limits whose square is within a factor 1 + 2**-20 of the floor's are refused (the
    search has no room there); a little above that margin the output is written."""
    floor = 4 * E8M0_SMALLEST**2
    limit = math.sqrt(float(floor * Fraction(limit_squared_over_floor)))
    assert (floor * (1 + Fraction(1, 2**20)) >= Fraction(limit) ** 2) == (code == 4)
    assert _clip_e8m0(tmp_path, 4, limit)[0] == code
    if code == 4:
        assert "without zero" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("past", [0, 1])
def test_e8m0_margin_exactly_at_its_constant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], past: int
) -> None:
    """n = 2**20 + 1 values make the margin's edge a double: limit**2 == floor * (1 +
    2**-20) exactly for limit = (2**20 + 1) * 2**-137. There it is refused (exit 4); at
    the next double above it the output is written, every value at the smallest (2**-127),
    its norm (exact, as a fraction) within the limit."""
    count = 2**20 + 1
    edge = (2**20 + 1) * 2.0**-137
    assert Fraction(edge) ** 2 == count * E8M0_SMALLEST**2 * (1 + Fraction(1, 2**20))
    limit = math.nextafter(edge, math.inf) if past else edge
    code, out = _clip_e8m0(tmp_path, count, limit)
    if not past:
        assert code == 4
        assert f"norm of {limit:g}" in one_error_line(capsys.readouterr().err)
        assert not out.exists()
        return
    assert code == 0
    written = read_safetensors(out)["e"]
    assert written.dtype == E8M0
    assert written.shape == (count,)
    assert set(written.view(np.uint8).tolist()) == {0}  # exponent byte 0: 2**-127
    assert count * E8M0_SMALLEST**2 <= Fraction(limit) ** 2


# ------------------------------------------------------------------ HDF5: expansion budget


def _same_size_h5(path: Path, build: Callable[[h5py.File], None]) -> int:
    path.unlink(missing_ok=True)
    with h5py.File(path, "w") as f:
        build(f)
    return path.stat().st_size


def test_hdf5_expansion_budget_is_200_times_the_file_plus_64_mib() -> None:
    for size in (0, 1, 2064, 10**9):
        assert limits.expansion_budget(size) == 200 * size + 64 * MIB


@pytest.mark.parametrize("over", [0, 1])
def test_hdf5_declared_bytes_exactly_at_the_real_expansion_budget(
    tmp_path: Path, over: int
) -> None:
    """Two unallocated fixed-string datasets (not tensors: counted when the file opens)
    declaring 200 x the file + 64 MiB in all open; one byte more is refused. The file's
    size does not depend on the declared shapes (8 bytes a dimension), checked."""
    src = tmp_path / "declared.h5"

    def build(first: int, second: int) -> int:
        def datasets(f: h5py.File) -> None:
            f["stored"] = np.arange(4, dtype=np.float32)
            f.create_dataset("a", shape=(first,), dtype="S1")
            f.create_dataset("b", shape=(second,), dtype="S1")

        return _same_size_h5(src, datasets)

    size = build(1, 1)
    budget = 200 * size + 64 * MIB
    first = (budget - 16) // 2
    assert build(first, budget - 16 - first + over) == size
    if over:
        with pytest.raises(InputError, match=f"declare {budget + 1} bytes in all"):
            Hdf5Reader(src)
        return
    with Hdf5Reader(src) as reader:
        assert sum(item.nbytes for item in reader.non_tensors) + 16 == budget


@pytest.mark.parametrize("over", [0, 1])
def test_hdf5_unallocated_tensors_expand_exactly_to_the_real_budget(
    clipcli: Cli, tmp_path: Path, over: int
) -> None:
    """Unallocated tensors (fill values) are charged when their elements are asked for:
    16 stored bytes + 1,000 + over (uint8) + the rest (float32) = the budget (+ over).
    At it every element may be produced; one byte more is refused, and `convert` (which
    needs them all) exits 3 before OUT exists."""
    src = tmp_path / "fills.h5"

    def build(small: int, large: int) -> int:
        def datasets(f: h5py.File) -> None:
            f["stored"] = np.arange(4, dtype=np.float32)
            f.create_dataset("a", shape=(small,), dtype="u1", fillvalue=7)
            f.create_dataset("b", shape=(large,), dtype="<f4", fillvalue=0.5)

        return _same_size_h5(src, datasets)

    size = build(1, 1)
    budget = 200 * size + 64 * MIB
    large = (budget - 16 - 1000) // 4
    small = budget - 16 - 4 * large
    assert build(small + over, large) == size
    with Hdf5Reader(src) as reader:
        assert sum(info.nbytes for info in reader.infos) == budget + over
        if over:
            with pytest.raises(InputError, match=f"more than {budget} bytes in all"):
                reader.expect_all_elements()
        else:
            reader.expect_all_elements()
    if over:
        out = tmp_path / "out.safetensors"
        run = clipcli("convert", src, out)
        assert run.returncode == 3, run
        assert "refusing to expand" in one_error_line(run.stderr)
        assert listing(tmp_path) == ["fills.h5"]


# ------------------------------------------------------------------ HDF5: declared size


@pytest.mark.parametrize(
    ("dtype", "elements"),
    [("<f8", TIB // 8), ("u1", TIB), ("u1", TIB + 1), ("<f8", TIB // 8 + 1)],
)
def test_hdf5_dataset_declaring_exactly_one_tib(
    clipcli: Cli, tmp_path: Path, dtype: str, elements: int
) -> None:
    """A dataset may declare 1 TiB (2**40 bytes: an unallocated one, measured from its
    fill value); 2**40 + 1 (one byte more) or + 8 (one float64 more) is refused."""
    src = tmp_path / "huge.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("t", shape=(elements,), dtype=dtype, fillvalue=3)
    declared = elements * np.dtype(dtype).itemsize
    run = clipcli("norms", "--format", "json", src)
    if declared > TIB:
        assert run.returncode == 3, run
        assert f"declares {declared} bytes, over the {TIB}-byte (1 TiB) limit" in (
            one_error_line(run.stderr)
        )
        return
    assert run.returncode == 0, run
    if dtype == "<f8":  # integer tensors are listed, not measured
        expected = math.sqrt(Fraction(elements * 9))  # every element is 3
        assert json.loads(run.stdout)["global_norm"] == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ HDF5: group depth


@pytest.mark.parametrize("depth", [limits.MAX_DEPTH - 1, limits.MAX_DEPTH])
def test_hdf5_groups_nest_exactly_as_deep_as_the_reader_reads(
    clipcli: Cli, tmp_path: Path, depth: int
) -> None:
    """63 groups below the root (64 levels with it) are read, the dataset at the bottom
    measured; 64 below it are refused (h5py writes and reads both)."""
    src = tmp_path / "deep.h5"
    groups = "/".join(["g"] * depth)
    with h5py.File(src, "w") as f:
        f.create_group(groups)["w"] = np.array([3.0, 4.0])
    with h5py.File(src, "r") as f:
        assert float(np.linalg.norm(f[groups + "/w"][()])) == 5.0
    run = clipcli("norms", "--format", "json", src)
    if depth >= limits.MAX_DEPTH:
        assert run.returncode == 3, run
        assert f"groups nest deeper than {limits.MAX_DEPTH} levels" in one_error_line(run.stderr)
        return
    assert run.returncode == 0, run
    assert json.loads(run.stdout)["global_norm"] == 5.0


# ------------------------------------------------------------------ npz: overlapping members


def _npy(values: np.ndarray) -> bytes:
    text = repr({"descr": values.dtype.str, "fortran_order": False, "shape": values.shape})
    raw = text.encode()
    raw += b" " * (-(10 + len(raw) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + values.tobytes()


def _stored_local(name: str, body: bytes) -> bytes:
    crc = zlib.crc32(body)
    encoded = name.encode()
    header = struct.pack(
        "<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(body), len(body), len(encoded), 0
    )
    return header + encoded + body


def _central(name: str, body: bytes, offset: int) -> bytes:
    encoded = name.encode()
    crc, size = zlib.crc32(body), len(body)
    fields = (b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, size, size, len(encoded), 0, 0, 0, 0, 0)
    return struct.pack("<4s6H3I5H2I", *fields, offset) + encoded


def _two_members(path: Path, overlap: int) -> None:
    """Two stored members, the second's local header beginning `overlap` bytes before the
    first's data ends. The first member's last byte is 'P' (its last float32 is
    0x50000000), so with overlap 1 it is also the first byte of the second's signature:
    both members read whole, from one shared byte."""
    first = _npy(np.array([1.0, np.frombuffer(b"\0\0\0P", "<f4")[0]], np.float32))
    second = _npy(np.array([3.0, 4.0], np.float32))
    assert first.endswith(b"P")
    local_first = _stored_local("a.npy", first)
    local_second = _stored_local("b.npy", second)
    start = len(local_first) - overlap
    blob = local_first[:start] + local_second
    central = _central("a.npy", first, 0) + _central("b.npy", second, start)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 2, 2, len(central), len(blob), 0)
    path.write_bytes(blob + central + end)


@pytest.mark.parametrize("overlap", [0, 1])
def test_zip_members_adjacent_or_sharing_one_byte(
    clipcli: Cli, tmp_path: Path, overlap: int
) -> None:
    """Members that touch (one ends where the next begins) are read; sharing one byte is
    refused (exit 3). numpy reads both files whole: the overlap is the only fault."""
    src = tmp_path / "two.npz"
    _two_members(src, overlap)
    with np.load(src) as archive:
        assert archive["b"].tolist() == [3.0, 4.0]
        assert archive["a"][1] == np.frombuffer(b"\0\0\0P", "<f4")[0]
    run = clipcli("ls", src)
    if overlap:
        assert run.returncode == 3, run
        assert "members 'a' and 'b' overlap" in one_error_line(run.stderr)
        return
    assert run.returncode == 0, run


# ------------------------------------------------------------------ safetensors: header size


def _sparse_safetensors(path: Path, header_len: int) -> Path:
    """A file whose length field says `header_len` and that really is 8 + header_len
    bytes long: zeros after the field, written as a hole (nothing on disk)."""
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", header_len))
        handle.truncate(8 + header_len)
    assert path.stat().st_size == 8 + header_len
    return path


def test_safetensors_header_one_byte_over_the_limit_is_refused_for_its_length(
    tmp_path: Path,
) -> None:
    assert MAX_HEADER_BYTES == 100_000_000  # the official reader's MAX_HEADER_SIZE
    src = _sparse_safetensors(tmp_path / "over.safetensors", MAX_HEADER_BYTES + 1)
    with pytest.raises(InputError, match=f"header length {MAX_HEADER_BYTES + 1} exceeds the"):
        SafetensorsReader(src)


def test_safetensors_header_exactly_at_the_limit_passes_the_length_check(
    tmp_path: Path,
) -> None:
    """100,000,000 bytes of header (zeros here) are read and parsed: refused as JSON."""
    src = _sparse_safetensors(tmp_path / "at.safetensors", MAX_HEADER_BYTES)
    with pytest.raises(InputError, match="header is not valid JSON") as refused:
        SafetensorsReader(src)
    assert "exceeds" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("over", [0, 1])
def test_safetensors_valid_header_of_exactly_the_limit(
    clipcli: Cli, tmp_path: Path, over: int
) -> None:
    """A real header padded with spaces to exactly 100,000,000 bytes (+ over) and one
    tensor: the official reader and clipcli both read it; one byte more both refuse."""
    from safetensors import SafetensorError, safe_open

    header = json.dumps({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    src = tmp_path / "padded.safetensors"
    length = MAX_HEADER_BYTES + over
    with open(src, "wb") as handle:
        handle.write(struct.pack("<Q", length) + header)
        handle.write(b" " * (length - len(header)))
        handle.write(np.array([3.0, 4.0], np.float32).tobytes())
    run = clipcli("norms", "--format", "json", src)
    if over:
        with pytest.raises(SafetensorError):
            safe_open(str(src), "np")
        assert run.returncode == 3, run
        assert f"header length {length} exceeds the" in one_error_line(run.stderr)
        return
    with safe_open(str(src), "np") as official:
        assert official.get_tensor("t").tolist() == [3.0, 4.0]
    assert run.returncode == 0, run
    assert json.loads(run.stdout)["global_norm"] == 5.0


# ------------------------------------------------------------------ npz: .npy header size


def _npy_with_header_length(length: int) -> bytes:
    """A version 1.0 .npy of two float32, its header padded with spaces to `length`."""
    text = repr({"descr": "<f4", "fortran_order": False, "shape": (2,)})
    raw = text.encode().ljust(length - 1) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", length) + raw + b"\0\0@@\0\0\x80@"


@pytest.mark.parametrize("over", [0, 1])
def test_npy_header_exactly_at_numpys_cap(clipcli: Cli, tmp_path: Path, over: int) -> None:
    """A member's .npy header of 10,000 bytes (numpy's max_header_size) is read; 10,001 is
    refused, as np.load refuses it."""
    import zipfile

    length = 10_000 + over
    src = tmp_path / "m.npz"
    with zipfile.ZipFile(src, "w") as archive:
        archive.writestr("w.npy", _npy_with_header_length(length))
    run = clipcli("norms", "--format", "json", src)
    if over:
        with pytest.raises(ValueError, match="max_header_size"), np.load(src) as archive:
            archive["w"]
        assert run.returncode == 3, run
        assert f".npy header of {length} bytes exceeds the 10000 cap" in one_error_line(run.stderr)
        return
    with np.load(src) as archive:
        assert archive["w"].tolist() == [3.0, 4.0]
    assert run.returncode == 0, run
    assert json.loads(run.stdout)["global_norm"] == 5.0
