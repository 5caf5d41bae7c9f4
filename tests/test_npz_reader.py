"""The npz reader and writer: exact round trips, and refusals before any allocation."""

from __future__ import annotations

import io
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipcli.errors import InputError
from clipcli.formats.base import Checkpoint
from clipcli.formats.npz import NpzReader, NpzWriter
from clipcli.jobs.pipeline import write_tensors


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "big_endian": np.arange(5, dtype=">f8"),
        "fortran": np.asfortranarray(rng.standard_normal((3, 5))),
        "scalar": np.array(3.0),
        "empty": np.zeros((0, 3)),
        "mask": np.array([True, False]),
        "ints": np.arange(-3, 3, dtype=np.int16),
        "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
    }


def copy_through(src: Path, out: Path, chunk_elems: int | None = None) -> None:
    with NpzReader(src) as reader:
        writer = NpzWriter(out, Checkpoint(reader.infos, {}, reader))
        write_tensors(reader, writer, lambda info: reader.chunks(info, chunk_elems))


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
@pytest.mark.parametrize("chunk_elems", [None, 2])
def test_round_trip_is_exact(tmp_path: Path, save: object, chunk_elems: int | None) -> None:
    tensors = sample_tensors()
    src, out = tmp_path / "in.npz", tmp_path / "out.npz"
    save(src, **tensors)  # type: ignore[operator]
    copy_through(src, out, chunk_elems)
    with np.load(out, allow_pickle=False) as loaded:
        assert list(loaded.keys()) == list(tensors)
        for name, array in tensors.items():
            assert loaded[name].dtype == array.dtype
            assert loaded[name].shape == array.shape
            assert loaded[name].tobytes() == np.ascontiguousarray(array).tobytes()
    compressed = {i.compress_type for i in zipfile.ZipFile(out).infolist()}
    assert compressed == ({zipfile.ZIP_DEFLATED} if save is np.savez_compressed else {0})


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int32]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
    )
)
def test_write_then_read_is_identity(array: np.ndarray) -> None:
    with tempfile.TemporaryDirectory() as directory:
        src, out = Path(directory) / "in.npz", Path(directory) / "out.npz"
        np.savez(src, x=array)
        copy_through(src, out, chunk_elems=3)
        with np.load(out, allow_pickle=False) as loaded:
            assert loaded["x"].dtype == array.dtype
            assert loaded["x"].tobytes() == array.tobytes()


def write_members(path: Path, members: dict[str, bytes], deflate: bool = False) -> None:
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names
        with zipfile.ZipFile(path, "w", method) as archive:
            for name, data in members.items():
                archive.writestr(name.split("\0")[0], data)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def raw_npy(header: str) -> bytes:
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


def refused(path: Path, fragment: str) -> None:
    with pytest.raises(InputError, match=fragment), NpzReader(path) as reader:  # noqa: PT012
        for info in reader.infos:
            list(reader.chunks(info))


def test_object_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, a=np.array([{"x": 1}], dtype=object))
    refused(path, "Python objects")


def test_pickle_disguised_as_npz(tmp_path: Path) -> None:
    path = tmp_path / "evil.npz"
    path.write_bytes(pickle.dumps({"a": 1}))
    refused(path, "not a valid npz")


@pytest.mark.parametrize(
    ("members", "fragment"),
    [
        ({"a.txt": b"hello"}, "not a .npy array"),
        ({"a.npy": b"not numpy at all"}, "magic"),
        ({"a": b"x", "a.npy": b"y"}, "not a .npy"),
        ({"a.npy": npy_bytes(np.zeros(2)), "a.npy\0dup": npy_bytes(np.zeros(2))}, "duplicate"),
        ({"../evil.npy": npy_bytes(np.zeros(2))}, "escapes"),
        (
            {
                "a.npy": raw_npy(
                    "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"
                )
            },
            "needs",
        ),
        (
            {
                "a.npy": raw_npy(
                    "{'descr': '<f8', 'fortran_order': False, "
                    "'shape': (1099511627776, 1099511627776), }"
                )
            },
            "overflows",
        ),
        (
            {
                "a.npy": raw_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }")
                + b"\0" * 24
            },
            "needs 16 data bytes but the member holds 24",
        ),
        (
            {
                "a.npy": raw_npy(
                    "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), " + " " * 20000 + "}"
                )
            },
            "exceeds",
        ),
        (
            {
                "a.npy": raw_npy(
                    "{'descr': [('x', '<f4')], 'fortran_order': False, 'shape': (1,), }"
                )
            },
            "structured",
        ),
        ({"a.npy": npy_bytes(np.array(["2026-01-01"], dtype="datetime64[D]"))}, "not numeric"),
        ({"a.npy": npy_bytes(np.array(["hello"]))}, "not numeric"),
        ({"a.npy": raw_npy("__import__('os').system('true')")}, "not a valid Python literal"),
    ],
)
def test_malformed_members_are_refused(
    tmp_path: Path, members: dict[str, bytes], fragment: str
) -> None:
    path = tmp_path / "bad.npz"
    write_members(path, members)
    refused(path, fragment)


def test_truncated_and_corrupt_files(tmp_path: Path) -> None:
    good = tmp_path / "good.npz"
    np.savez(good, a=np.arange(1000.0))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    refused(truncated, "not a valid npz")
    corrupt = tmp_path / "crc.npz"
    flipped = bytearray(data)
    flipped[400] ^= 0xFF  # inside the stored array data
    corrupt.write_bytes(bytes(flipped))
    refused(corrupt, "CRC|cannot read")


def test_zip_bomb_is_refused_without_inflating(tmp_path: Path) -> None:
    path = tmp_path / "bomb.npz"
    size = 200 << 20
    header = raw_npy(f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({size},), }}")
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("a.npy", "w", force_zip64=True) as member,
    ):
        member.write(header)
        block = bytes(1 << 20)
        for _ in range(size >> 20):
            member.write(block)
    assert path.stat().st_size < 1 << 20
    refused(path, "zip bomb")


def test_bfloat16_cannot_be_written() -> None:
    import ml_dtypes

    from clipcli.formats.base import TensorInfo

    info = TensorInfo("x", np.dtype(ml_dtypes.bfloat16), (2,), 4)
    assert "npz cannot hold bfloat16" in (NpzWriter.check_dtype(info) or "")
