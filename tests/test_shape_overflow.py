"""Shapes whose size overflows (issue 18, item 15): [2**32, 2**32, 0] is refused by the
official safetensors reader ("overflow computing buffer size") and by numpy (np.load, h5py),
though it holds no element. Every reader applies its format's reference rule, and the
verdict is compared, shape by shape, with the reference reader's own."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from safetensors import safe_open

from clipcli.errors import InputError
from clipcli.formats.opening import open_reader

U64 = 2**64 - 1

# (shape, safetensors dtype): at and just past the u64 limit of the left-to-right product.
SAFETENSORS_SHAPES = [
    ([2**32, 2**32, 0], "F32"),  # the issue's example: overflows before the 0
    ([2**32, 2**32 - 1, 0], "F32"),  # the product just fits
    ([U64, 0], "F64"),
    ([U64, 1, 0], "F32"),  # at the limit
    ([U64, 2, 0], "F32"),  # one step past it
    ([0, U64, 2], "F32"),  # the 0 comes first: no overflow
    # The same limit with dimensions numpy can hold (each < 2**63):
    ([2**62, 3, 0], "F32"),  # the product just fits in u64
    ([2**62, 4, 0], "F32"),  # the product is 2**64: overflows
]


def safetensors_file(path: Path, shape: list[int], dtype: str) -> Path:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def official_safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="np") as f:
            list(f.keys())
    except Exception:  # SafetensorError has no importable base class
        return False
    return True


def clipcli_accepts(path: Path) -> bool:
    try:
        with open_reader(path) as reader:
            list(reader.infos)
    except InputError:
        return False
    return True


@pytest.mark.parametrize(("shape", "dtype"), SAFETENSORS_SHAPES)
def test_safetensors_shape_verdict_is_the_official_readers(
    tmp_path: Path, shape: list[int], dtype: str
) -> None:
    """The official verdict, except that a dimension of 2**63 or more, which safe_open lists
    but no numpy array can have, is refused on reading (issue 18, Open item 3)."""
    path = safetensors_file(tmp_path / "s.safetensors", shape, dtype)
    numpy_holds_every_dimension = all(d < 2**63 for d in shape)
    assert clipcli_accepts(path) == (
        official_safetensors_accepts(path) and numpy_holds_every_dimension
    )


def test_the_issue_example_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = safetensors_file(tmp_path / "s.safetensors", [2**32, 2**32, 0], "F32")
    with pytest.raises(InputError, match="overflows") as caught:
        open_reader(path)
    assert "'t'" in str(caught.value)


# (shape, dtype) around numpy's limit: itemsize x every dimension (0 as 1) < 2**63.
NUMPY_SHAPES = [
    ((2**32, 2**32, 0), "<f4"),
    ((2**63 - 1, 0), "|i1"),  # at the limit
    ((2**62, 2, 0), "|i1"),  # past it
    ((2**60 - 1, 0), "<f8"),  # at it for 8-byte items (less than 2**63 by 8 - 1)
    ((2**60, 0), "<f8"),  # past it
    ((0, 2**32, 2**32), "<f4"),  # numpy refuses the 0 first too
]


def numpy_accepts(shape: tuple[int, ...], descr: str) -> bool:
    try:
        np.empty(shape, np.dtype(descr))
    except ValueError:
        return False
    return True


def npz_with_shape(path: Path, shape: tuple[int, ...], descr: str) -> Path:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    member = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("t.npy", member)
    return path


def np_load_accepts(path: Path) -> bool:
    try:
        with np.load(path) as loaded:
            loaded["t"]
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("shape", "descr"), NUMPY_SHAPES)
def test_npz_shape_verdict_is_np_loads(tmp_path: Path, shape: tuple[int, ...], descr: str) -> None:
    path = npz_with_shape(tmp_path / "m.npz", shape, descr)
    assert clipcli_accepts(path) == np_load_accepts(path) == numpy_accepts(shape, descr)


@pytest.mark.parametrize(("shape", "descr"), NUMPY_SHAPES)
def test_hdf5_shape_verdict_is_h5pys(tmp_path: Path, shape: tuple[int, ...], descr: str) -> None:
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("t", shape=shape, dtype=np.dtype(descr))
    with h5py.File(path, "r") as f:
        try:
            f["t"][()]
            h5py_reads = True
        except ValueError:
            h5py_reads = False
    assert h5py_reads == numpy_accepts(shape, descr)
    assert clipcli_accepts(path) == h5py_reads


def test_a_shape_safetensors_holds_but_numpy_cannot_is_not_written_to_npz_or_hdf5(
    tmp_path: Path,
) -> None:
    """[2**62, 2, 0] reads as safetensors; np.load and h5py could not read it back.
    (The example was [2**64 - 1, 1, 0], which is now refused on reading: no numpy array has
    a dimension of 2**63 or more; tests/test_tensor_rank.py.)"""
    from clipcli import api
    from clipcli.errors import UsageError

    with pytest.raises(InputError, match="numpy's limit"):
        open_reader(safetensors_file(tmp_path / "u.safetensors", [U64, 1, 0], "F32"))
    src = safetensors_file(tmp_path / "s.safetensors", [2**62, 2, 0], "F32")
    assert official_safetensors_accepts(src)
    for suffix in (".npz", ".h5"):
        with pytest.raises(UsageError, match="numpy's size limit"):
            api.convert(src, tmp_path / f"out{suffix}")
        assert not (tmp_path / f"out{suffix}").exists()
    assert not numpy_accepts((2**62, 2, 0), "<f4")
