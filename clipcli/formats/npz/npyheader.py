""".npy headers: parsed from a member with a size cap and no code run, and built for the writer."""

from __future__ import annotations

import ast
from typing import Any, Protocol

import numpy as np

from clipcli.dtypes import is_numeric
from clipcli.formats.base import TensorInfo, numpy_shape_problem

NPY_MAGIC = b"\x93NUMPY"
MAX_HEADER_BYTES = 10_000  # numpy's own default cap for np.load


class Readable(Protocol):
    """A member being read (zipfile's stream, or zipsafe.BoundedMember), or a .npy file."""

    def read(self, size: int = -1, /) -> bytes: ...


class InputProblem(ValueError):
    """A malformed .npy member; the reader adds the file and tensor."""


def _read_exactly(stream: Readable, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise InputProblem(f"truncated member: expected {size} more bytes, got {len(data)}")
    return data


def _read_npy_header(stream: Readable) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, header length) of a .npy stream, parsed with a size cap
    and `ast.literal_eval` (no code runs, no pickle)."""
    prefix = stream.read(8)
    if len(prefix) < 8 or not prefix.startswith(NPY_MAGIC):
        raise InputProblem("member does not start with the .npy magic")
    major = prefix[6]
    if major == 1:
        size_bytes = 2
    elif major in (2, 3):
        size_bytes = 4
    else:
        raise InputProblem(f"unsupported .npy format version {major}.{prefix[7]}")
    header_len = int.from_bytes(_read_exactly(stream, size_bytes), "little")
    if header_len > MAX_HEADER_BYTES:
        raise InputProblem(f".npy header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} cap")
    raw = _read_exactly(stream, header_len)
    try:
        text = raw.decode("utf-8" if major == 3 else "latin1")
        header = ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, SyntaxError, MemoryError, RecursionError):
        raise InputProblem(".npy header is not a valid Python literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise InputProblem(".npy header must hold exactly descr, fortran_order and shape")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InputProblem(f".npy shape {shape!r} is not a tuple of non-negative integers")
    # np.load's own limits: at most 64 dimensions, each below 2**63 (np.intp).
    if (problem := numpy_shape_problem(shape)) is not None:
        raise InputProblem(problem)
    if not isinstance(header["fortran_order"], bool):
        raise InputProblem(".npy fortran_order is not a bool")
    descr = header["descr"]
    if not isinstance(descr, str):
        # Lists describe structured dtypes: never tensors.
        raise InputProblem(f"dtype {descr!r} is not numeric (structured)")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise InputProblem(f"unknown dtype {descr!r}") from None
    if dtype.hasobject:
        raise InputProblem(f"dtype {descr!r} holds Python objects; refusing to unpickle")
    if not is_numeric(dtype):
        raise InputProblem(f"dtype {descr!r} is not numeric")
    return dtype, shape, header["fortran_order"], 8 + size_bytes + header_len


def _npy_header(info: TensorInfo) -> bytes:
    header = {
        "descr": np.lib.format.dtype_to_descr(info.dtype),
        "fortran_order": False,
        "shape": info.shape,
    }
    text = repr(header).encode("latin1")
    # numpy pads header + newline so the data starts on a 64-byte boundary.
    for version, size_bytes in ((1, 2), (2, 4)):
        fixed = 8 + size_bytes
        padded = text + b" " * (-(fixed + len(text) + 1) % 64) + b"\n"
        if len(padded) < 2 ** (8 * size_bytes):
            return (
                NPY_MAGIC
                + bytes([version, 0])
                + len(padded).to_bytes(size_bytes, "little")
                + padded
            )
    raise ValueError("npy header too large")
