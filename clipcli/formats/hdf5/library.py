"""The h5py library as clipcli uses it: imported lazily with filter plugins disabled, its
errors turned into InputError, and facts about HDF5 types and names."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clipcli.dtypes import is_numeric
from clipcli.errors import InputError
from clipcli.system import address_space
from clipcli.system.inputs import out_of_descriptors

# What h5py raises for malformed or unsupported content (UnicodeDecodeError is a ValueError).
H5PY_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError)

NodeKind = Literal["group", "dataset", "datatype"]


@functools.cache
def load_h5py() -> Any:
    """Import h5py on first use, with HDF5 filter plugins disabled.

    A plugin directory named by the environment (HDF5_PLUGIN_PATH) is code that HDF5
    dlopen()s when a file asks for a filter it does not know. The file comes from a
    stranger, so that is arbitrary code execution on their say-so. HDF5 reads
    HDF5_PLUGIN_PRELOAD once, when the library initialises at import; "::" is its
    documented value for "load no plugins", and any other value (an environment with
    hdf5plugin activated sets one) enables them, so it is overwritten, never kept. In case
    h5py was imported before this function ran, we also empty the plugin search path,
    which has the same effect.
    """
    os.environ["HDF5_PLUGIN_PRELOAD"] = "::"
    import h5py
    import h5py.h5pl

    while h5py.h5pl.size() > 0:
        h5py.h5pl.remove(0)
    return h5py


def reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# How the HDF5 library says an allocation failed ("memory allocation failed for chunk",
# H5E_CANTALLOC's "unable to allocate", H5E_NOSPACE's "no space available for allocation").
# Chunks are at most limits.MAX_CHUNK_BYTES before any read, so a file cannot make HDF5 ask
# for more than that: where it is still refused, the environment refused it (ulimit -v).
_REFUSED_MEMORY = re.compile(
    r"memory allocation failed|unable to allocate|can't allocate|"
    r"no space available for allocation|out of memory",
    re.IGNORECASE,
)


# How HDF5 says a filter (gzip, lzf, szip) gave up on a chunk. The words are the same for a
# corrupt chunk and for a filter whose buffer the environment refused (`ulimit -v`).
_FILTER_FAILED = re.compile(r"filter returned failure", re.IGNORECASE)


@contextlib.contextmanager
def input_errors(
    path: Path,
    doing: str,
    tensor: str | None = None,
    *,
    reading_data: bool = False,
    filter_room: int = 0,
) -> Iterator[None]:
    """Turn h5py's exceptions into an InputError that says what we were doing. While
    `reading_data` (chunks, whose errors name no object of the file), HDF5 failing to
    allocate memory is a MemoryError instead (exit 5: the environment, not the input);
    elsewhere a message may quote a name from the file, which must not decide that.
    `filter_room`: the bytes a filter needs to decode one chunk of the dataset; a filter
    that failed where the address-space limit leaves less than that is taken to have
    been refused its buffer (exit 5), else the chunk is blamed (exit 3)."""
    try:
        yield
    except H5PY_ERRORS as exc:
        refused = reading_data and (
            _REFUSED_MEMORY.search(reason(exc)) is not None
            or (
                filter_room > 0
                and _FILTER_FAILED.search(reason(exc)) is not None
                and not address_space.has_room(filter_room)
            )
        )
        if refused:
            where = f"{path}: {doing}" + (f" of tensor {tensor!r}" if tensor else "")
            raise MemoryError(f"{where}: {reason(exc)}") from None
        no_descriptor = out_of_descriptors(exc, path)  # HDF5 opening by name: ulimit -n
        raise no_descriptor or InputError(path, f"{doing}: {reason(exc)}", tensor) from None


def filter_room(dataset: Any, info: Any) -> int:
    """The bytes a filter needs to decode one chunk of `dataset` (a TensorInfo's): the
    stored chunk, and an output buffer that grows by doubling (gzip's) to up to twice the
    chunk. 0 for a dataset read without filters."""
    chunks: tuple[int, ...] | None = dataset.chunks
    if chunks is None or dataset.id.get_create_plist().get_nfilters() == 0:
        return 0
    return 3 * math.prod(chunks) * int(info.dtype.itemsize)


def unsupported_dtype(dtype: np.dtype[Any]) -> str | None:
    """What kind of non-tensor dtype this is, or None for a numeric one."""
    h5py = load_h5py()
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        kind = "variable-length" if string.length is None else "fixed-length"
        return f"a {kind} string dtype"
    if h5py.check_ref_dtype(dtype) is not None:
        return "a reference dtype"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "a variable-length dtype"
    if h5py.check_enum_dtype(dtype) is not None:  # h5py reports bool without enum metadata
        return "an enum dtype"
    if dtype.fields is not None:
        return f"a compound dtype ({len(dtype.fields)} fields)"
    if dtype.subdtype is not None:
        return f"an array dtype ({dtype})"
    if dtype.kind == "V" and not is_numeric(dtype):
        return "an opaque dtype"
    if not is_numeric(dtype):
        return f"dtype {dtype}"
    return None


def utf8_text(value: object) -> str | None:
    """value as a str if it is text that round-trips through UTF-8, else None."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # h5py smuggles invalid bytes in as lone surrogates
        except UnicodeEncodeError:
            return None
        return value
    return None


def holds_vlen(type_id: Any) -> bool:
    """True if an HDF5 type holds variable-length data (strings or sequences) anywhere."""
    h5t = load_h5py().h5t
    kind = type_id.get_class()
    if kind == h5t.VLEN or (kind == h5t.STRING and type_id.is_variable_str()):
        return True
    if kind == h5t.COMPOUND:
        return any(holds_vlen(type_id.get_member_type(i)) for i in range(type_id.get_nmembers()))
    if kind == h5t.ARRAY:
        return holds_vlen(type_id.get_super())
    return False


def holds_references(type_id: Any) -> bool:
    """True if an HDF5 type contains object or region references anywhere inside."""
    h5t = load_h5py().h5t
    kind = type_id.get_class()
    if kind == h5t.REFERENCE:
        return True
    if kind == h5t.COMPOUND:
        return any(
            holds_references(type_id.get_member_type(i)) for i in range(type_id.get_nmembers())
        )
    if kind in (h5t.ARRAY, h5t.VLEN):
        return holds_references(type_id.get_super())
    return False


def name_bytes(name: str | bytes) -> bytes:
    """h5py gives names as str, or as bytes when they are not UTF-8; HDF5 wants bytes."""
    return name if isinstance(name, bytes) else name.encode("utf-8")


def link_name_problem(name: str) -> str | None:
    """Why a stored link name cannot be used to open what it links to, or None.

    HDF5 never stores such a name, but a hand-made file can, and h5py and libhdf5 take
    every name they are given as a path: `e/x` is the link `x` reached through `e`, which
    the library follows (a soft link, or an external link whose file it opens by name)
    before the walk ever reaches `e` to refuse it; `.` is the group itself. So a name is
    used only when it is one plain path component. (An empty name the library refuses
    itself; a NUL ends the name in every API, which shows it as a repeated name.)"""
    if name == "":
        return "the name is empty"
    if name in (".", ".."):
        return f"{name!r} is not a plain name"
    if "/" in name:
        return "HDF5 reads a '/' in it as a path"
    if "\0" in name:
        return "it contains NUL"
    return None
