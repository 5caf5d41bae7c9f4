"""Reading and writing the datasets that are not tensors (a vocabulary of strings, a
compound table), a slice of rows at a time, with their exact HDF5 types.

Fixed-size types are moved as raw bytes, with the file's own type as the memory type, so
no conversion happens (compound, enum, opaque, array and fixed-length string types alike).
Variable-length types (strings, sequences) are read through h5py's object types; each
element then reads one global heap object, so a slice holds at most
NON_TENSOR_SLICE_BYTES / (largest heap object) elements, and the bytes all the elements of
a file read together are capped by the file's expansion budget: a small file whose many
elements all name one large heap object is refused rather than expanded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError
from clipcli.formats.base import NonTensorInfo
from clipcli.formats.hdf5.library import load_h5py


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, start + len) of a dataset (the whole of a scalar), as read."""

    start: int
    values: np.ndarray  # raw bytes (fixed-size types) or objects (variable-length types)
    memory_type: Any
    raw: bool  # values has a last axis of the element's bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:-1] if self.raw else self.values.shape)


class VlenBudget:
    """Bytes that the variable-length elements of one file may still expand to."""

    def __init__(self, path: Path, file_size: int) -> None:
        self.path = path
        self.remaining = limits.expansion_budget(file_size)

    def spend(self, values: np.ndarray, name: str) -> None:
        self.remaining -= sum(_element_bytes(value) for value in values.reshape(-1))
        if self.remaining < 0:
            raise InputError(
                self.path,
                "variable-length elements expand to more than the file's budget "
                f"({limits.MAX_EXPANSION} times its size plus "
                f"{limits.SPARSE_CHECK_BYTES >> 20} MiB); refusing to expand it",
                name,
            )


def _element_bytes(value: object) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return 16


def read_rows(
    dataset: Any,
    item: NonTensorInfo,
    largest_heap_object: int,
    budget: VlenBudget,
) -> Iterator[RowSlice]:
    """The dataset's values in slices of whole rows (first axis), each within the
    memory bound; nothing for an empty dataspace."""
    h5s = load_h5py().h5s
    if item.shape is None:
        return
    type_id = dataset.id.get_type()
    if item.variable_length:
        memory_type = load_h5py().h5t.py_create(dataset.dtype)
        element = max(16, largest_heap_object)
    else:
        memory_type = type_id.copy()
        element = max(1, int(type_id.get_size()))
    if item.shape == ():
        yield _read(dataset, item, memory_type, h5s.create(h5s.SCALAR), None, 0, budget)
        return
    rows, *rest = item.shape
    row_elements = int(np.prod(rest, dtype=np.int64)) if rest else 1
    per_slice = max(1, limits.NON_TENSOR_SLICE_BYTES // max(1, row_elements * element))
    for start in range(0, rows, per_slice):
        count = min(per_slice, rows - start)
        shape = (count, *rest)
        file_space = dataset.id.get_space()
        if count and row_elements:
            file_space.select_hyperslab((start, *[0] * len(rest)), shape)
        else:
            file_space.select_none()
        yield _read(dataset, item, memory_type, h5s.create_simple(shape), file_space, start, budget)


def _read(
    dataset: Any,
    item: NonTensorInfo,
    memory_type: Any,
    memory_space: Any,
    file_space: Any,
    start: int,
    budget: VlenBudget,
) -> RowSlice:
    shape = memory_space.shape
    if item.variable_length:
        values = np.empty(shape, dtype=dataset.dtype)
    else:
        values = np.zeros((*shape, int(memory_type.get_size())), dtype=np.uint8)
    if values.size:
        space = file_space if file_space is not None else dataset.id.get_space()
        dataset.id.read(memory_space, space, values, memory_type)
    if item.variable_length:
        budget.spend(values, item.name)
    return RowSlice(start, values, memory_type, raw=not item.variable_length)


def write_rows(dataset_id: Any, piece: RowSlice, rank: int) -> None:
    """Write one slice read by read_rows into a dataset of the same type and shape."""
    h5s = load_h5py().h5s
    values, shape = piece.values, piece.shape
    if not values.size:
        return
    if rank == 0:
        dataset_id.write(h5s.create(h5s.SCALAR), dataset_id.get_space(), values, piece.memory_type)
        return
    file_space = dataset_id.get_space()
    file_space.select_hyperslab((piece.start, *[0] * (rank - 1)), shape)
    dataset_id.write(h5s.create_simple(shape), file_space, values, piece.memory_type)
