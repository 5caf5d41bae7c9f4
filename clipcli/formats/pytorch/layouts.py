"""The three layouts torch has saved in, each parsed to one object tree plus the byte
spans of its storages in the file (nothing is read of the storages here).

- zip (torch >= 1.6): `<root>/data.pkl`, `<root>/data/<key>`, `<root>/byteorder`; the
  records stored, their spans checked by the shared zip checks (zipcheck).
- legacy stream: pickles of the magic number, the protocol (1001), sys_info, the object
  and the storage keys; then per storage an 8-byte little-endian count and its bytes.
- legacy tar: members `sys_info`, `storages`, `tensors`, `pickle`.
"""

from __future__ import annotations

import os
import re
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

from clipcli.errors import InputError
from clipcli.formats.pytorch.unpickler import (
    Interpreter,
    PickleProblem,
    Storage,
    StorageClass,
    Tensor,
    storage_from_pid,
)
from clipcli.formats.registry import TAR_BLOCK, is_tar_header
from clipcli.formats.zipsafe import check_zip_layout, open_member, unix_file_type
from clipcli.system import interrupts

# The pickle that describes the checkpoint (data.pkl, the legacy object) is read whole:
# a state dict of 200,000 tensors pickles to about 30 MB.
MAX_PICKLE_BYTES = 64 << 20
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
# What a legacy stream starts with: PROTO 2, LONG1 of 10 bytes, the magic, STOP.
LEGACY_HEAD = b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + b"."
_STORAGE_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_TAR_MEMBERS = ("sys_info", "pickle", "tensors", "storages")
_TAR_HEADER_WINDOW = 1 << 20  # one storage's header pickle in the tar `storages` member


class Span(NamedTuple):
    """Where a storage's bytes lie in the file."""

    begin: int
    nbytes: int


class Parsed(NamedTuple):
    layout: str  # "zip", "legacy" or "tar"
    root: object  # the unpickled object tree (stand-ins and plain values)
    spans: dict[str, Span]  # storage key -> its bytes
    byteorder: str  # "little" or "big"
    extras: dict[str, str]  # facts for `ls` (the zip's root folder, sys_info)
    inflated: int = 0  # bytes the zip's compressed records inflate to beyond their size


def is_legacy_stream(head: bytes) -> bool:
    """A pickle (protocol 2 to 5): torch's legacy stream, or a pickle of something else,
    which parse_legacy tells apart by its first value (torch's magic number)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def is_tar(fd: int) -> bool:
    # the registry's recognition (ustar and V7 alike, by the header checksum)
    return is_tar_header(os.pread(fd, TAR_BLOCK, 0))


class _Storages:
    """The storages the pickle names, by key: one Storage per key (a tensor naming a key
    again gets the same one, so tied tensors share it); a key named twice with another
    dtype or size is refused."""

    def __init__(self, legacy: bool) -> None:
        self.legacy = legacy
        self.by_key: dict[str, Storage] = {}

    def load(self, pid: object) -> Storage:
        storage_class, key, location, numel, view = storage_from_pid(pid, self.legacy)
        if not _STORAGE_KEY.fullmatch(key):
            raise PickleProblem(f"storage key {key[:80]!r} is not a plain record name")
        root = self._root(storage_class, key, location, numel)
        if view is None:
            return root
        if type(view) is not tuple or len(view) != 3:
            raise PickleProblem("a storage's view metadata is not (key, offset, size)")
        view_key, offset, size = view
        if type(view_key) is not str or type(offset) is not int or type(size) is not int:
            raise PickleProblem("a storage's view metadata is not (key, offset, size)")
        if offset < 0 or size < 0 or offset + size > root.numel:
            raise PickleProblem(
                f"storage view {view_key[:40]!r} ({offset} + {size} elements) runs past "
                f"its storage of {root.numel}"
            )
        return root._replace(numel=size, view_offset=offset, view_key=view_key)

    def _root(self, storage_class: StorageClass, key: str, location: str, numel: int) -> Storage:
        known = self.by_key.get(key)
        if known is None:
            known = self.by_key[key] = Storage(key, storage_class.dtype, location, numel)
        elif known.dtype != storage_class.dtype or known.numel != numel:
            raise PickleProblem(f"storage {key!r} is named twice with another dtype or size")
        return known


def _unpickle(
    data: bytes, position: int = 0, storages: _Storages | None = None, file_size: int | None = None
) -> tuple[object, int]:
    """One pickle from `position`; its memory budget is measured against `file_size` where
    the pickle was inflated from a compressed record."""
    load = storages.load if storages is not None else None
    machine = Interpreter(data, position, load, file_size=file_size)
    value = machine.load()
    return value, machine.position


def _pickle_problem(path: Path, exc: PickleProblem) -> InputError:
    # A signal that arrived while the pickle was read ends the run as a signal does (143),
    # not as the refusal it may have cut short.
    interrupts.check()
    return InputError(path, str(exc))


# ------------------------------------------------------------------ zip


def parse_zip(path: Path, handle: BinaryIO) -> Parsed:
    fd = handle.fileno()
    try:
        archive = zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
        raise InputError(path, f"not a valid PyTorch zip: {exc}") from None
    with archive:
        check_zip_layout(path, fd, archive, fold_case=False)
        entries = {entry.filename: entry for entry in archive.infolist()}
        first = next(iter(entries))
        root = first.split("/", 1)[0]
        for name, record in entries.items():
            if not name.startswith(root + "/"):
                raise InputError(path, f"record {name!r} is outside the archive's folder {root!r}")
            kind = unix_file_type(record)  # as for .keras: what an unzip would not make a file
            if kind is not None:
                raise InputError(path, f"record {name!r} is a {kind}, not a file")
        if f"{root}/constants.pkl" in entries or any(
            name.startswith(f"{root}/code/") for name in entries
        ):
            # torch.jit.save's archive: its data.pkl names the module's own classes
            # (__torch__.*), which no allow-list can hold; say what the file is instead.
            raise InputError(
                path,
                "is a TorchScript module (torch.jit.save: a program with its code), "
                "not a checkpoint; save its state_dict() with torch.save to read it",
            )
        pickle_entry = entries.get(f"{root}/data.pkl")
        if pickle_entry is None:
            raise InputError(path, f"no {root}/data.pkl: not a PyTorch checkpoint")
        data = _read_record(path, archive, fd, pickle_entry, MAX_PICKLE_BYTES)
        byteorder = "little"
        order_entry = entries.get(f"{root}/byteorder")
        if order_entry is not None:
            text = _read_record(path, archive, fd, order_entry, 16)
            if text not in (b"little", b"big"):
                raise InputError(path, f"byteorder record says {text[:16]!r}")
            byteorder = text.decode()
        storages = _Storages(legacy=False)
        try:
            # Budgets are per file: a deflated pickle's memory is measured against the
            # file's size, not against what it inflated to.
            tree, _ = _unpickle(data, 0, storages, file_size=os.fstat(fd).st_size)
        except PickleProblem as exc:
            raise _pickle_problem(path, exc) from None
        spans = {}
        for key, storage in storages.by_key.items():
            entry = entries.get(f"{root}/data/{key}")
            if entry is None:
                raise InputError(path, f"storage {key!r} has no record {root}/data/{key}")
            if entry.compress_type != zipfile.ZIP_STORED:
                raise InputError(path, f"storage record {entry.filename!r} is compressed")
            if entry.file_size != storage.nbytes:
                raise InputError(
                    path,
                    f"storage {key!r} holds {entry.file_size} bytes; its tensors' "
                    f"storage declares {storage.nbytes}",
                )
            spans[key] = Span(_data_start(path, fd, entry), entry.file_size)
    inflated = sum(max(0, e.file_size - e.compress_size) for e in entries.values())
    extras = {"pytorch.layout": f"zip ({root}/)"}
    return Parsed("zip", tree, spans, byteorder, extras, inflated)


def _read_record(
    path: Path, archive: zipfile.ZipFile, fd: int, entry: zipfile.ZipInfo, limit: int
) -> bytes:
    if entry.file_size > limit:
        raise InputError(
            path, f"record {entry.filename!r} is {entry.file_size} bytes (limit {limit})"
        )
    try:
        with open_member(archive, fd, entry) as stream:
            data = stream.read(entry.file_size + 1)
    except (OSError, EOFError, zipfile.BadZipFile, ValueError, RuntimeError) as exc:
        raise InputError(path, f"cannot read record {entry.filename!r}: {exc}") from None
    if len(data) != entry.file_size:
        raise InputError(path, f"record {entry.filename!r} does not hold its declared size")
    return data


def _data_start(path: Path, fd: int, entry: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes begin (check_zip_layout checked its local header)."""
    local = os.pread(fd, _LOCAL_HEADER.size, entry.header_offset)
    if len(local) != _LOCAL_HEADER.size:
        raise InputError(path, f"record {entry.filename!r}: bad local header")
    name_len, extra_len = _LOCAL_HEADER.unpack(local)[-2:]
    return int(entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len)


# ------------------------------------------------------------------ legacy stream


def parse_legacy(path: Path, fd: int) -> Parsed:
    size = os.fstat(fd).st_size
    window = min(size, 1 << 20)  # the pickles come first: read more only while they go on
    while True:
        data = _pread(path, fd, window, 0)
        storages = _Storages(legacy=True)
        try:
            tree, keys, position = _legacy_pickles(data, storages)
            break
        except PickleProblem as exc:
            if "truncated" not in str(exc) or window == size:
                raise _pickle_problem(path, exc) from None
            if window >= MAX_PICKLE_BYTES:
                raise InputError(
                    path, f"its pickles run past {MAX_PICKLE_BYTES} bytes (limit)"
                ) from None
            window = min(size, window * 4, MAX_PICKLE_BYTES)
    if not isinstance(keys, list) or any(type(k) is not str for k in keys):
        raise InputError(path, "legacy storage keys are not a list of strings")
    if len(set(keys)) != len(keys):
        raise InputError(path, "legacy storage keys name a storage twice")
    missing = set(storages.by_key) - set(keys)
    if missing:
        raise InputError(path, f"storage {sorted(missing)[0]!r} is not among the stored keys")
    spans = {}
    for key in keys:
        storage = storages.by_key.get(key)
        if storage is None:
            raise InputError(path, f"stored storage {key[:80]!r} is named by no tensor")
        (count,) = struct.unpack("<q", _pread(path, fd, 8, position))
        if count != storage.numel:
            raise InputError(
                path, f"storage {key!r} holds {count} elements; its tensors declare {storage.numel}"
            )
        begin = position + 8
        if begin + storage.nbytes > size:
            raise InputError(path, f"storage {key!r} runs past the end of the file")
        spans[key] = Span(begin, storage.nbytes)
        position = begin + storage.nbytes
    if position != size:
        raise InputError(path, f"{size - position} bytes follow the last storage")
    # torch writes legacy storages little-endian on any machine.
    return Parsed("legacy", tree, spans, "little", {"pytorch.layout": "legacy pickle"})


def _legacy_pickles(data: bytes, storages: _Storages) -> tuple[object, object, int]:
    """The object and the storage keys of a legacy stream, and where its storages start."""
    magic, position = _unpickle(data, 0)
    if magic != LEGACY_MAGIC:
        raise PickleProblem(
            "is a pickle but not a PyTorch checkpoint (no torch magic number first); "
            "clipcli never runs a pickle"
        )
    protocol, position = _unpickle(data, position)
    if protocol != LEGACY_PROTOCOL:
        raise PickleProblem(f"legacy protocol {protocol!r} is not {LEGACY_PROTOCOL}")
    sys_info, position = _unpickle(data, position)
    if not isinstance(sys_info, dict):
        raise PickleProblem("legacy sys_info is not a dict")
    tree, position = _unpickle(data, position, storages)
    keys, position = _unpickle(data, position)
    return tree, keys, position


def _pread(path: Path, fd: int, count: int, offset: int) -> bytes:
    try:
        data = os.pread(fd, count, offset)
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror}") from None
    if len(data) != count:
        raise InputError(path, "file is truncated")
    return data


# ------------------------------------------------------------------ legacy tar


def parse_tar(path: Path, handle: BinaryIO) -> Parsed:
    fd = handle.fileno()
    size = os.fstat(fd).st_size
    try:
        with tarfile.open(fileobj=handle, mode="r:") as archive:
            members = archive.getmembers()
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        raise InputError(path, f"not a valid PyTorch tar: {exc}") from None
    found: dict[str, tuple[int, int]] = {}
    for member in members:
        if member.name not in _TAR_MEMBERS:
            raise InputError(path, f"tar member {member.name[:80]!r} is not one torch writes")
        if member.name in found or not member.isreg():
            raise InputError(path, f"tar member {member.name!r} is repeated or not a file")
        if member.offset_data + member.size > size:
            raise InputError(path, f"tar member {member.name!r} runs past the end")
        found[member.name] = (member.offset_data, member.size)
    for name in _TAR_MEMBERS:
        if name not in found:
            raise InputError(path, f"tar has no {name!r} member")
    try:
        storages, spans = _tar_storages(path, fd, *found["storages"])
        tensors = _tar_tensors(path, fd, storages, *found["tensors"])
        begin, length = found["pickle"]
        if length > MAX_PICKLE_BYTES:
            raise PickleProblem(f"the pickle member is {length} bytes (limit {MAX_PICKLE_BYTES})")
        data = _pread(path, fd, length, begin)

        def load(pid: object) -> object:
            if type(pid) not in (str, int) or str(pid) not in tensors:
                raise PickleProblem(f"persistent id {str(pid)[:40]!r} names no stored tensor")
            return tensors[str(pid)]

        machine = Interpreter(data, 0, load)
        tree = machine.load()
    except PickleProblem as exc:
        raise _pickle_problem(path, exc) from None
    return Parsed("tar", tree, spans, "little", {"pytorch.layout": "legacy tar"})


def _tar_pickle(
    path: Path, fd: int, position: int, end: int, load: Callable[[object], object] | None = None
) -> tuple[object, int]:
    window = _pread(path, fd, min(end - position, _TAR_HEADER_WINDOW), position)
    machine = Interpreter(window, 0, load)
    value = machine.load()
    return value, position + machine.position


def _tar_storages(
    path: Path, fd: int, begin: int, length: int
) -> tuple[dict[str, Storage], dict[str, Span]]:
    end = begin + length
    count, position = _tar_pickle(path, fd, begin, end)
    if type(count) is not int or not 0 <= count <= length // 8:
        raise PickleProblem("the tar's storage count is not a count")
    storages: dict[str, Storage] = {}
    spans: dict[str, Span] = {}
    for _ in range(count):
        header, position = _tar_pickle(path, fd, position, end)
        if type(header) is not tuple or len(header) != 3:
            raise PickleProblem("a tar storage header is not (key, location, type)")
        key, location, storage_class = header
        if type(key) not in (str, int) or type(location) is not str:
            raise PickleProblem("a tar storage key or location is malformed")
        if type(storage_class) is not StorageClass or storage_class.untyped:
            raise PickleProblem("a tar storage's type is not a typed storage class")
        key = str(key)
        if key in storages:
            raise PickleProblem(f"tar storage {key[:40]!r} is stored twice")
        (numel,) = struct.unpack("<q", _pread(path, fd, 8, position))
        nbytes = numel * storage_class.dtype.itemsize
        if numel < 0 or position + 8 + nbytes > end:
            raise PickleProblem(f"tar storage {key[:40]!r} runs past its member")
        storages[key] = Storage(key, storage_class.dtype, location, numel)
        spans[key] = Span(position + 8, nbytes)
        position += 8 + nbytes
    views, position = _tar_pickle(path, fd, position, end)
    if type(views) is not list:
        raise PickleProblem("the tar's storage views are not a list")
    for view in views:
        if type(view) is not tuple or len(view) != 4:
            raise PickleProblem("a tar storage view is not (target, root, offset, size)")
        target, root_key, offset, numel = view
        root = storages.get(str(root_key))
        if root is None or root.view_key is not None:
            raise PickleProblem("a tar storage view names no stored storage")
        if type(offset) is not int or type(numel) is not int or offset < 0 or numel < 0:
            raise PickleProblem("a tar storage view's offset or size is not a count")
        if offset + numel > root.numel:
            raise PickleProblem("a tar storage view runs past its storage")
        if str(target) in storages:
            raise PickleProblem("a tar storage view reuses a storage's key")
        storages[str(target)] = root._replace(numel=numel, view_offset=offset, view_key=str(target))
    return storages, spans


def _tar_tensors(
    path: Path, fd: int, storages: dict[str, Storage], begin: int, length: int
) -> dict[str, Tensor]:
    end = begin + length
    count, position = _tar_pickle(path, fd, begin, end)
    if type(count) is not int or not 0 <= count <= length // 24:
        raise PickleProblem("the tar's tensor count is not a count")
    tensors: dict[str, Tensor] = {}
    for _ in range(count):
        header, position = _tar_pickle(path, fd, position, end)
        if type(header) is not tuple or len(header) != 3:
            raise PickleProblem("a tar tensor header is not (key, storage, type)")
        key, storage_id = str(header[0]), str(header[1])
        storage = storages.get(storage_id)
        if storage is None:
            raise PickleProblem(f"tar tensor {key[:40]!r} names no stored storage")
        (ndim,) = struct.unpack("<i", _pread(path, fd, 4, position))
        if not 0 <= ndim <= 64:
            raise PickleProblem(f"tar tensor {key[:40]!r} has {ndim} dimensions")
        fields = _pread(path, fd, 4 + 16 * ndim + 8, position + 4)
        if position + 8 + 16 * ndim + 8 > end:
            raise PickleProblem(f"tar tensor {key[:40]!r} runs past its member")
        values = struct.unpack(f"<{2 * ndim + 1}q", fields[4:])
        shape, stride, offset = values[:ndim], values[ndim : 2 * ndim], values[-1]
        if min(values, default=0) < 0:
            raise PickleProblem(f"tar tensor {key[:40]!r} has a negative size, stride or offset")
        tensors[key] = Tensor(storage, offset, tuple(shape), tuple(stride), storage.dtype)
        position += 8 + 16 * ndim + 8
    return tensors
