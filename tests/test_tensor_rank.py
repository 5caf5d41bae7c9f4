"""Tensor rank and huge dimensions (issue 18, threat model Open items 2 and 3).

Every reader refuses a shape numpy cannot make whatever the dtype (more than 64
dimensions, or a dimension of 2**63 or more, even beside a 0) with exit 3 naming the
tensor; every writer refuses, before writing (exit 2), a shape its format's official
reader would not read back: npz 64 dimensions (np.load), HDF5 32 (H5S_MAX_RANK),
safetensors 64 (safe_open takes any rank, but makes numpy arrays). Verdicts are compared
with numpy, np.load, safe_open and h5py, at each limit and one past it.
"""

from __future__ import annotations

import json
import struct
import warnings
import zipfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from safetensors import safe_open

from clipcli.formats.base import NUMPY_MAX_RANK, TensorInfo, Writer
from clipcli.formats.hdf5.writer import Hdf5Writer
from clipcli.formats.keras_archive import KerasArchiveWriter
from clipcli.formats.npz.writer import NpzWriter
from clipcli.formats.safetensors.stream import SafetensorsStreamWriter
from clipcli.formats.safetensors.writer import SafetensorsWriter
from clipcli.formats.sharded.writer import ShardedWriter

Runner = Callable[..., Any]
HDF5_MAX_RANK = 32  # H5S_MAX_RANK


def safetensors_file(
    path: Path, shape: list[int], dtype: str = "F32", data: bytes = b"\0\0\0\0"
) -> Path:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def npz_file(path: Path, shape: tuple[int, ...], descr: str = "<f4", data: bytes = b"") -> Path:
    """A one-member npz with a hand-written .npy header (np.save cannot write past 64)."""
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    member = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("t.npy", member)
    return path


def safe_open_reads(path: Path) -> bool:
    """The official reader, all the way to the array (framework='np')."""
    try:
        with safe_open(str(path), framework="np") as f:
            f.get_tensor("t")
    except Exception:  # SafetensorError and numpy's ValueError share no base but Exception
        return False
    return True


def np_load_reads(path: Path) -> bool:
    try:
        # np.load multiplies the shape in int64 first: a dimension past it only warns there.
        with warnings.catch_warnings(), np.load(path) as loaded:
            warnings.simplefilter("ignore", RuntimeWarning)
            loaded["t"]
    except ValueError:
        return False
    return True


def h5py_reads(path: Path) -> bool:
    try:
        with h5py.File(path, "r") as f:
            f["t"][()]
    except (KeyError, ValueError, OSError):
        return False
    return True


def numpy_makes(shape: tuple[int, ...]) -> bool:
    try:
        np.empty(shape, np.int8)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- readers


@pytest.mark.parametrize("rank", [NUMPY_MAX_RANK, NUMPY_MAX_RANK + 1])
def test_safetensors_rank_at_the_limit_and_one_past(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str], rank: int
) -> None:
    path = safetensors_file(tmp_path / "m.safetensors", [1] * rank)
    run = clipcli("ls", path)
    assert safe_open_reads(path) == numpy_makes((1,) * rank) == (rank <= 64)
    if rank <= NUMPY_MAX_RANK:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 3
        assert_one_error_line(run.stderr, "'t'", f"{rank} dimensions", "at most 64")


@pytest.mark.parametrize("rank", [NUMPY_MAX_RANK, NUMPY_MAX_RANK + 1])
def test_npz_rank_at_the_limit_and_one_past(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str], rank: int
) -> None:
    path = npz_file(tmp_path / "m.npz", (1,) * rank, data=b"\0\0\0\0")
    run = clipcli("ls", path)
    assert np_load_reads(path) == (rank <= NUMPY_MAX_RANK)
    if rank <= NUMPY_MAX_RANK:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 3
        assert_one_error_line(run.stderr, "'t'", f"{rank} dimensions", "at most 64")


def hdf5_of_rank(path: Path, rank: int) -> Path:
    """h5py writes at most 32 dimensions: rank 33 is a rank-32 file whose dataspace message
    (version 1: version, rank, flags, 5 reserved bytes, then the dimensions) is patched."""
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("t", data=np.ones((1,) * HDF5_MAX_RANK, "f4"))
    if rank == HDF5_MAX_RANK:
        return path
    raw = bytearray(path.read_bytes())
    at = raw.find(struct.pack("<Q", 1) * HDF5_MAX_RANK)
    assert raw[at - 8 : at - 6] == bytes([1, HDF5_MAX_RANK]), "not a version-1 dataspace"
    raw[at - 7] = rank
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("rank", [HDF5_MAX_RANK, HDF5_MAX_RANK + 1])
def test_hdf5_rank_at_the_limit_and_one_past(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str], rank: int
) -> None:
    """The library itself holds 32: a file claiming 33 is refused by h5py and by us."""
    path = hdf5_of_rank(tmp_path / "m.h5", rank)
    run = clipcli("norms", path)
    assert h5py_reads(path) == (rank <= HDF5_MAX_RANK)
    if rank <= HDF5_MAX_RANK:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 3
        assert_one_error_line(run.stderr, "'/t'", "dimensionality is too large")


def test_a_header_of_five_million_dimensions_is_refused_in_one_short_line(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    """The audit's case: a 10 MB header made `ls` print 110 MB and use 470 MB."""
    path = safetensors_file(tmp_path / "m.safetensors", [1] * 5_000_000)
    run = clipcli("ls", path)
    assert run.returncode == 3
    assert run.stdout == ""
    line = assert_one_error_line(run.stderr, "'t'", "5000000 dimensions")
    assert len(line) < 300


def test_a_rejected_shape_is_not_printed_whole(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    """A shape that is no list of integers may be megabytes long: the message is short."""
    header = {"t": {"dtype": "F32", "shape": "x" * 1_000_000, "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    run = clipcli("ls", path)
    assert run.returncode == 3
    assert len(assert_one_error_line(run.stderr, "'t'", "not a list")) < 400


# Dimensions beside a 0 (the audit's [0, 2**63 + 5]): numpy's np.intp is the limit.
HUGE_DIMENSIONS = [2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1]


@pytest.mark.parametrize("dim", HUGE_DIMENSIONS)
def test_safetensors_dimension_beside_a_zero(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str], dim: int
) -> None:
    """safe_open lists any dimension below 2**64 (its u64 product is 0), but no numpy
    array has one of 2**63 or more: clipcli refuses it on reading, naming the tensor."""
    path = safetensors_file(tmp_path / "m.safetensors", [0, dim], "I8", b"")
    run = clipcli("ls", path)
    assert numpy_makes((0, dim)) == (dim < 2**63)
    if dim < 2**63:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 3
        assert_one_error_line(run.stderr, "'t'", str(dim), "numpy's limit")


@pytest.mark.parametrize("dim", HUGE_DIMENSIONS)
def test_npz_dimension_beside_a_zero(tmp_path: Path, clipcli: Runner, dim: int) -> None:
    path = npz_file(tmp_path / "m.npz", (0, dim), "|i1")
    run = clipcli("ls", path)
    assert np_load_reads(path) == numpy_makes((0, dim)) == (dim < 2**63)
    assert run.returncode == (0 if dim < 2**63 else 3), run.stderr


def test_hdf5_dimension_at_the_limit_beside_a_zero(tmp_path: Path, clipcli: Runner) -> None:
    """The library creates no dimension of 2**63 or more ('unable to get the next power of
    2'); one below is read by h5py and by clipcli."""
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        space = h5py.h5s.create_simple((0, 2**63 - 1))
        h5py.h5d.create(f.id, b"t", h5py.h5t.STD_I8LE, space)
        with pytest.raises(ValueError, match="power of 2"):
            h5py.h5d.create(f.id, b"u", h5py.h5t.STD_I8LE, h5py.h5s.create_simple((0, 2**63)))
    assert h5py_reads(path)
    assert clipcli("ls", path).returncode == 0


@pytest.mark.parametrize("out", ["o.npz", "o.h5", "o.safetensors"])
def test_a_huge_dimension_beside_a_zero_converts_as_the_official_reader_reads_it(
    tmp_path: Path, clipcli: Runner, out: str
) -> None:
    """[0, 2**63 - 1] of int8 (numpy's largest): read and written; each official reader
    reads back exactly that shape."""
    src = safetensors_file(tmp_path / "m.safetensors", [0, 2**63 - 1], "I8", b"")
    run = clipcli("convert", src, tmp_path / out)
    assert run.returncode == 0, run.stderr
    target = tmp_path / out
    if out.endswith(".npz"):
        with np.load(target) as loaded:
            assert loaded["t"].shape == (0, 2**63 - 1)
    elif out.endswith(".h5"):
        with h5py.File(target, "r") as f:
            assert f["t"][()].shape == (0, 2**63 - 1)
    else:
        with safe_open(str(target), framework="np") as f:
            assert f.get_tensor("t").shape == (0, 2**63 - 1)


# ---------------------------------------------------------------------------- writers


def test_rank_64_norm_clip_with_axes_is_exact(tmp_path: Path, clipcli: Runner) -> None:
    """The audit's rank-70 `clip --norm --axes` was exit 70; at the limit it works: the
    slice [3, 4] along axis 0 has norm 5 and is scaled to norm 1 (exact: 3/5, 4/5)."""
    data = np.array([3, 4], "<f4").tobytes()
    src = safetensors_file(tmp_path / "m.safetensors", [2] + [1] * 63, "F32", data)
    out = tmp_path / "o.safetensors"
    run = clipcli("clip", src, out, "--norm", "1", "--axes", "0")
    assert run.returncode == 0, run.stderr
    with safe_open(str(out), framework="np") as f:
        got = f.get_tensor("t")
    assert got.ndim == 64
    first, second = (Fraction(float(v)) for v in got.ravel())
    assert first**2 + second**2 <= 1  # exact: never over the limit
    ulp = Fraction(float(np.spacing(np.float32(0.8))))
    assert abs(first - Fraction(3, 5)) <= ulp
    assert abs(second - Fraction(4, 5)) <= ulp


# (OUT, rank, written): rank 65 is read by no reader, so the npz and safetensors writers'
# limit is checked directly below; HDF5's 32 is reached through the readers.
WRITER_CASES = [
    ("o.npz", 64, True),
    ("o.safetensors", 64, True),
    ("o.h5", 32, True),
    ("o.h5", 33, False),
]


@pytest.mark.parametrize(("out", "rank", "written"), WRITER_CASES)
def test_each_writer_at_its_rank_limit_and_one_past(
    tmp_path: Path,
    clipcli: Runner,
    assert_one_error_line: Callable[..., str],
    out: str,
    rank: int,
    written: bool,
) -> None:
    src = npz_file(tmp_path / "m.npz", (1,) * rank, data=b"\0\0\0\0")
    target = tmp_path / out
    run = clipcli("convert", src, target)
    if not written:
        assert run.returncode == 2
        assert_one_error_line(run.stderr, "'t'", f"{rank} dimensions", "HDF5 holds at most 32")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]
        return
    assert run.returncode == 0, run.stderr
    if out.endswith(".npz"):
        assert np_load_reads(target)
    elif out.endswith(".h5"):
        assert h5py_reads(target)
    else:
        assert safe_open_reads(target)


WRITER_RANK_LIMITS: list[tuple[type[Writer], int]] = [
    (NpzWriter, 64),
    (SafetensorsWriter, 64),
    (SafetensorsStreamWriter, 64),
    (ShardedWriter, 64),
    (Hdf5Writer, 32),
    (KerasArchiveWriter, 32),
]


@pytest.mark.parametrize(("writer", "limit"), WRITER_RANK_LIMITS)
def test_every_writer_refuses_one_dimension_past_its_format(
    writer: type[Writer], limit: int
) -> None:
    at = TensorInfo("t", np.dtype("<f4"), (1,) * limit, 4)
    past = TensorInfo("t", np.dtype("<f4"), (1,) * (limit + 1), 4)
    assert writer.check_shape(at) is None
    assert f"{limit + 1} dimensions" in (writer.check_shape(past) or "")


def test_the_writers_limits_are_the_official_libraries(tmp_path: Path) -> None:
    """numpy (np.load, safe_open's arrays) holds 64 dimensions, HDF5 32."""
    assert numpy_makes((1,) * 64)
    assert not numpy_makes((1,) * 65)
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f.create_dataset("t", shape=(1,) * 32, dtype="f4")
        with pytest.raises(ValueError, match="too large"):
            f.create_dataset("u", shape=(1,) * 33, dtype="f4")


@pytest.mark.parametrize("writer", [SafetensorsWriter, ShardedWriter])
def test_safetensors_writers_refuse_what_the_official_u64_product_refuses(
    writer: type[Writer],
) -> None:
    """The reader's rule (tensor.rs), on the writer's side: [2**32, 2**32, 0] overflows."""
    assert writer.check_shape(TensorInfo("t", np.dtype("<f4"), (2**32, 2**32 - 1, 0), 0)) is None
    assert "overflows" in (
        writer.check_shape(TensorInfo("t", np.dtype("<f4"), (2**32, 2**32, 0), 0)) or ""
    )
