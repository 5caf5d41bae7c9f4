"""PyTorchReader: a `.bin`/`.pt`/`.pth` read without torch and without running its pickle.

The pickle is interpreted by our own allow-list machine (unpickler.py); the layouts
(layouts.py) give the byte span of every storage. Each tensor is a strided view of a
storage: its offset, sizes and strides are checked (Python ints, no overflow) to lie
inside the storage before anything is read, and its values are read with pread
(contiguous views) or through a bounded mmap window (strided ones), never whole.
Several tensors may view one storage (tied weights): `shared_with` names the first
tensor an exactly identical view belongs to, so a global norm counts it once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from clipcli.errors import InputError
from clipcli.formats import expansion
from clipcli.formats.base import (
    FileRange,
    RangeLoader,
    Reader,
    StoredBytes,
    TensorInfo,
    default_chunk_elems,
    numpy_shape_problem,
)
from clipcli.formats.pytorch import layouts
from clipcli.formats.pytorch.inert import Described
from clipcli.formats.pytorch.unpickler import (
    Device,
    Storage,
    StorageClass,
    Tensor,
    TensorType,
    TorchDtype,
    _OrderedDict,
)
from clipcli.system.file_map import map_read_only
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import open_input, pread_into

if TYPE_CHECKING:
    import numpy as np

MAX_TENSORS = 200_000
MAX_DEPTH = 64  # nesting of dicts and lists in the object tree (a cycle is infinitely deep)
MAX_VISITS = 2_000_000  # values walked (a memo reference makes a tree a graph: bounded)
MAX_METADATA = 1_000  # non-tensor values listed; the rest counted
MAX_VALUE_TEXT = 200
# Tensor and metadata names together (a memo reference may repeat a long key under many
# tensors): 200,000 names of 300 characters.
MAX_NAME_CHARS = 64_000_000
# A strided view is read through maps of at most this much of the file, one at a time
# (its pages leave the resident set as each is unmapped), into blocks of this much output.
_WINDOW_BYTES = 16 << 20
_BLOCK_BYTES = 16 << 20
# The one expansion policy (formats.expansion) for what views generate: a stride of 0
# (torch's `expand`) or overlapping strides make more elements than the storage holds. Read
# at each call: a test moves the PyTorch limit here.
VIEW_RATIO = expansion.RATIO
VIEW_FREE_BYTES = expansion.FREE_BYTES


class _Located(NamedTuple):
    """A tensor, checked, with where its storage starts in the file."""

    tensor: Tensor
    begin: int  # file offset of the storage's element 0 (legacy views included)
    first: int  # byte offset of the tensor's first element from `begin`
    span: int  # bytes from `first` to just past its last element (0: empty)
    contiguous: bool


def _name(parts: tuple[str, ...]) -> str:
    return ".".join(parts)


def _key_text(key: object) -> str:
    """A dict key or list index as a name part: text as it is, anything else (an int, a
    tuple of atoms) by its repr, shortened (a memo reference may repeat a huge key)."""
    if isinstance(key, str):
        return key
    text = repr(key) if not isinstance(key, tuple) else repr(key[:8])
    return text if len(text) <= MAX_VALUE_TEXT else text[: MAX_VALUE_TEXT - 3] + "..."


def _value_text(value: object) -> str:
    if isinstance(value, Described):  # a numpy array or dtype, a date's parts (inert.py)
        text = value.text()
    elif isinstance(value, (list, tuple, set, frozenset)):
        # the first 8 items only: a set of a million is not copied to show 8
        shown = ", ".join(_value_text(v) for v in itertools.islice(value, 8))
        more = f", ... ({len(value)} items)" if len(value) > 8 else ""
        text = f"[{shown}{more}]"
    elif isinstance(value, TorchDtype):
        text = f"torch.{value.name}"
    elif isinstance(value, Device):
        text = f"device {value.text}"
    elif isinstance(value, (StorageClass, TensorType, Storage)):
        text = f"a {type(value).__name__}"
    elif isinstance(value, bytes):
        text = f"<{len(value)} bytes>"
    elif isinstance(value, str):
        text = value[: MAX_VALUE_TEXT + 1]  # shortened below, as before
    elif isinstance(value, (int, float, complex, bool, type(None))):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= MAX_VALUE_TEXT else text[: MAX_VALUE_TEXT - 3] + "..."


def _atomic(value: object) -> bool:
    return not isinstance(value, (dict, list, tuple, Tensor)) or (
        isinstance(value, (list, tuple))
        and not any(isinstance(v, (dict, list, tuple, Tensor)) for v in value)
    )


Children = Iterator[tuple[object, object]]  # (key or index, value) of one container


def flatten(path: Path, root: object) -> tuple[list[tuple[str, Tensor]], dict[str, str]]:
    """Tensors named by their path in the object tree (`state_dict.layer.weight`), and
    every other value as metadata text, in pickle order.

    Walked depth first with a stack of iterators, one per open container (at most
    MAX_DEPTH): memory is the depth, never a copy of a container's children. Work is
    counted per value and per item of every container looked into (a memo reference
    makes a tree a graph: one list of a million items, referenced a million times, is a
    trillion items to walk); names are counted by their characters."""
    tensors: list[tuple[str, Tensor]] = []
    metadata: dict[str, str] = {}
    omitted = 0
    work = 0
    name_chars = 0
    open_containers: list[tuple[tuple[str, ...], Children]] = []
    parts: tuple[str, ...] = ()
    value = root
    while True:
        work += 1 + (len(value) if isinstance(value, (dict, list, tuple)) else 0)
        if work > MAX_VISITS:
            raise InputError(path, f"its object tree has more than {MAX_VISITS} values (budget)")
        if len(parts) > MAX_DEPTH:
            raise InputError(
                path, f"its object tree nests deeper than {MAX_DEPTH} levels (or refers to itself)"
            )
        if isinstance(value, Tensor):
            name = _name(parts) if parts else "tensor"
            name_chars += len(name)
            tensors.append((name, value))
            if len(tensors) > MAX_TENSORS:
                raise InputError(path, f"holds more than {MAX_TENSORS} tensors")
        elif isinstance(value, dict) and (value or not parts):
            open_containers.append((parts, iter(value.items())))
        elif isinstance(value, (list, tuple)) and not _atomic(value):
            open_containers.append((parts, enumerate(value)))
        elif len(metadata) < MAX_METADATA:
            name = _name(parts) if parts else "value"
            name_chars += len(name)
            metadata[name] = _value_text({} if isinstance(value, _OrderedDict) else value)
        else:
            omitted += 1
        if name_chars > MAX_NAME_CHARS:
            raise InputError(
                path, f"its tensors' names take more than {MAX_NAME_CHARS} characters (budget)"
            )
        while open_containers:  # the next value: the next child of the innermost container
            base, children = open_containers[-1]
            child = next(children, None)
            if child is None:
                open_containers.pop()
                continue
            parts, value = (*base, _key_text(child[0])), child[1]
            break
        else:
            break
    if omitted:
        metadata["pytorch.more_values"] = f"{omitted} more values not listed"
    return tensors, metadata


def _first_nested(root: object, named: list[tuple[str, Tensor]]) -> str | None:
    """The first tensor that is not a value of the top-level dict (a state dict inside
    `{"state_dict": ...}`, a list, a bare tensor), or None: a file whose tree a flat dict
    of dotted names (what the .pt writer makes) would not give back."""
    if not isinstance(root, dict):
        return named[0][0] if named else None
    direct = {_key_text(key) for key, value in root.items() if isinstance(value, Tensor)}
    return next((name for name, _ in named if name not in direct), None)


class _Generated:
    """The bytes a file's tensors present beyond the bytes of the storages they view,
    charged, tensor by tensor, to the expansion budget of the file's size (plus what its
    compressed records inflated to): a 606-byte file may not present a 1 GiB tensor.

    A storage's bytes are free once, to the tensors that view it (a fused q/k/v storage
    split in three); every byte its views present beyond that is generated (an `expand`ed
    row, two tied names of one weight, overlapping windows), since each is produced and
    written as often as it is presented."""

    def __init__(self, path: Path, file_size: int, inflated: int) -> None:
        self.path = path
        self.file_size = file_size
        self.total = inflated
        self.presented: dict[str, int] = {}  # storage key -> bytes its views present so far

    def charge(self, name: str, key: str, nbytes: int, storage_bytes: int) -> None:
        before = self.presented.get(key, 0)
        after = self.presented[key] = before + nbytes
        self.total += max(0, after - storage_bytes) - max(0, before - storage_bytes)
        budget = expansion.budget(self.file_size, VIEW_RATIO, VIEW_FREE_BYTES)
        if self.total > budget:
            raise InputError(
                self.path,
                f"its views present {self.total} bytes more than their storages hold (a stride "
                f"of 0, overlapping strides, views repeated), more than {VIEW_RATIO} times the "
                f"{self.file_size}-byte file plus {VIEW_FREE_BYTES >> 20} MiB ({budget}); "
                "refusing what looks like an expansion bomb",
                name,
            )


class PyTorchReader(Reader):
    format_name = "pytorch"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle: BinaryIO | None = open_input(path)  # closed by close() or release()
        self._closed = False
        # Reads in progress (worker threads' loaders): release() waits for them to end.
        self._lock = threading.Lock()
        self._users = 0
        self._close_when_idle = False
        try:
            self._fd = self._handle.fileno()
            self._identity = FileIdentity.of_stat(os.fstat(self._fd))
            parsed = self._parse()
            self._big = parsed.byteorder == "big"
            self._setup(parsed)
        except BaseException:
            self._handle.close()
            raise

    def _descriptor(self) -> int:
        """The open descriptor, reopened (and checked to be the same file) after release():
        a directory of many shards keeps only some open (clipcli.formats.sharded)."""
        if self._handle is None:
            if self._closed:
                raise ValueError(f"{self.path}: reader is closed")
            handle = open_input(self.path)
            if FileIdentity.of_stat(os.fstat(handle.fileno())) != self._identity:
                handle.close()
                raise InputError(self.path, "file changed since it was opened")
            self._handle = handle
        return self._handle.fileno()

    def fileno(self) -> int:
        with self._lock:
            return self._descriptor()

    def release(self) -> None:
        """Close the descriptor until the next read needs it (once the reads in progress
        are done)."""
        with self._lock:
            if self._users:
                self._close_when_idle = True
            elif self._handle is not None:
                self._handle.close()
                self._handle = None

    @contextlib.contextmanager
    def _reading(self) -> Iterator[int]:
        """The descriptor, held open for one read."""
        with self._lock:
            self._close_when_idle = False
            fd = self._descriptor()
            self._users += 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users -= 1
                if not self._users and self._close_when_idle and self._handle is not None:
                    self._handle.close()
                    self._handle = None

    def _parse(self) -> layouts.Parsed:
        try:
            head = os.pread(self._fd, 16, 0)
        except OSError as exc:
            raise InputError(self.path, f"cannot read: {exc.strerror}") from None
        assert self._handle is not None
        if head.startswith(b"PK\x03\x04"):
            return layouts.parse_zip(self.path, self._handle)
        if layouts.is_legacy_stream(head):
            return layouts.parse_legacy(self.path, self._fd)
        if layouts.is_tar(self._fd):
            return layouts.parse_tar(self.path, self._handle)
        raise InputError(self.path, "not a PyTorch checkpoint (no zip, legacy or tar layout)")

    def _setup(self, parsed: layouts.Parsed) -> None:
        from clipcli.dtypes import dtype_named

        named, values = flatten(self.path, parsed.root)
        self._layout = parsed.layout
        self._infos: list[TensorInfo] = []
        self._located: dict[str, _Located] = {}
        self._shared: dict[str, str] = {}  # an exactly identical view -> the first name
        self._storage_mates: dict[str, list[str]] = {}  # storage key -> tensor names
        # An exactly identical view -> the first name, keyed by a digest of the view: the
        # view's own tuple hashes as the file chooses (shapes of ints j*(2**61-1) on an
        # empty tensor all hash alike: 16,000 tensors took 13 s, quadratic), bytes hash at
        # random. The view is kept beside its name and compared on a digest's match: two
        # views are one only if they are equal.
        first_of_view: dict[bytes, tuple[tuple[Any, ...], str]] = {}
        generated = _Generated(self.path, os.fstat(self._fd).st_size, parsed.inflated)
        for name, tensor in named:
            if not name or "\x00" in name:
                raise InputError(self.path, "a tensor's name is empty or holds a NUL byte")
            if name in self._located:
                raise InputError(self.path, "two tensors have one name", name)
            located = self._locate(name, tensor, parsed.spans)
            dtype = dtype_named(tensor.dtype.name)
            numel = math.prod(tensor.shape)
            span = parsed.spans[tensor.storage.key]
            generated.charge(name, tensor.storage.key, numel * dtype.itemsize, span.nbytes)
            self._infos.append(TensorInfo(name, dtype, tensor.shape, numel * dtype.itemsize))
            self._located[name] = located
            view = (
                tensor.storage.key,
                located.begin + located.first,
                tensor.shape,
                tensor.stride,
                tensor.dtype.name,
            )
            digest = hashlib.blake2b(repr(view).encode(), digest_size=16).digest()
            first = first_of_view.setdefault(digest, (view, name))
            if first[1] != name and first[0] == view:
                self._shared[name] = first[1]
            self._storage_mates.setdefault(tensor.storage.key, []).append(name)
        # The file's own values (what a writer carries) apart from what this reader says
        # about the file (its layout, byte order, ties: shown by `ls`, carried nowhere,
        # since they describe this file and not the checkpoint: a joined or converted
        # file would otherwise count them as metadata it cannot hold).
        self._values = dict(values)
        described = dict(parsed.extras)
        if self._big:
            described["pytorch.byteorder"] = "big"
        tied = [f"{name} = {first}" for name, first in self._shared.items()]
        if tied:
            described["pytorch.tied"] = _value_text("; ".join(tied))
        shared = [
            ", ".join(names)
            for names in self._storage_mates.values()
            if len({self._shared.get(n, n) for n in names}) > 1
        ]
        if shared:
            described["pytorch.shared_storage"] = _value_text("; ".join(shared))
        nested = _first_nested(parsed.root, named)
        if nested is not None:
            described["pytorch.nested"] = _value_text(
                f"tensors inside nested containers, e.g. {nested}"
            )
        self._metadata = {**self._values, **described}
        self._described = frozenset(described)
        self._overlapping = self._overlaps()

    def _overlaps(self) -> list[tuple[str, ...]]:
        """Groups of tensors (tied ones stand for their first) whose byte ranges in one
        storage intersect, found by a sweep over each storage's ranges sorted by start.
        Judged by ranges, not elements: two strided views that interleave (even and odd
        columns) count as overlapping, which errs on the side of refusing a clip."""
        groups: list[tuple[str, ...]] = []
        for names in self._storage_mates.values():
            ranges = sorted(
                (located.begin + located.first, located.begin + located.first + located.span, n)
                for n in names
                if n not in self._shared and (located := self._located[n]).span > 0
            )
            current: list[str] = []
            reach = -1
            for start, end, name in ranges:
                if current and start >= reach:
                    if len(current) > 1:
                        groups.append(tuple(current))
                    current = []
                current.append(name)
                reach = max(reach, end) if len(current) > 1 else end
            if len(current) > 1:
                groups.append(tuple(current))
        return groups

    def _locate(self, name: str, tensor: Tensor, spans: Mapping[str, layouts.Span]) -> _Located:
        storage = tensor.storage
        span = spans.get(storage.key)
        if span is None:
            raise InputError(self.path, f"its storage {storage.key!r} is not in the file", name)
        problem = numpy_shape_problem(tensor.shape)
        if problem is not None:
            raise InputError(self.path, problem, name)
        base = storage.view_offset * storage.dtype.itemsize
        if base + storage.nbytes > span.nbytes:
            raise InputError(self.path, "its storage view runs past the storage", name)
        itemsize = tensor.dtype.itemsize
        numel = math.prod(tensor.shape)
        first = tensor.offset * itemsize
        if numel == 0:
            return _Located(tensor, span.begin + base, 0, 0, True)
        last = tensor.offset + sum(
            (d - 1) * s for d, s in zip(tensor.shape, tensor.stride, strict=True)
        )
        end = (last + 1) * itemsize
        if end > storage.nbytes:
            raise InputError(
                self.path,
                f"its view (offset {tensor.offset}, sizes {list(tensor.shape)[:8]}, strides "
                f"{list(tensor.stride)[:8]}) ends at byte {end}, past its storage of "
                f"{storage.nbytes} bytes",
                name,
            )
        return _Located(tensor, span.begin + base, first, end - first, _c_contiguous(tensor))

    # ---- the Reader interface

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        """The file's non-tensor values, and what the reader found about the file
        (`pytorch.layout`, `pytorch.byteorder`, `pytorch.tied`, `pytorch.shared_storage`)."""
        return self._metadata

    def joined_metadata(self) -> dict[str, str]:
        """The file's own values only: the reader's descriptions of this file are no
        metadata of the checkpoint (a join of shards, a conversion, does not carry them)."""
        return dict(self._values)

    def descriptions(self) -> frozenset[str]:
        return self._described

    def shared_with(self, name: str) -> str | None:
        """The earlier tensor whose view `name` repeats exactly (tied weights), or None."""
        return self._shared.get(name)

    def tied(self) -> dict[str, str]:
        """Every tied tensor -> the first tensor of its identical view."""
        return dict(self._shared)

    def overlapping_views(self) -> list[tuple[str, ...]]:
        """Groups of tensors (not tied) whose bytes in one storage overlap in part."""
        return list(self._overlapping)

    def tensor_layout(self, name: str) -> tuple[str, int, tuple[int, ...], tuple[int, ...]]:
        """(storage key, storage offset, sizes, strides) of a tensor, as the pickle says."""
        tensor = self._located[name].tensor
        return tensor.storage.key, tensor.offset, tensor.shape, tensor.stride

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        located = self._located[info.name]
        elems = chunk_elems or default_chunk_elems(info.dtype)
        if located.span == 0:
            return
        if located.contiguous:
            yield from self._contiguous(info, located, elems)
        else:
            yield from self._strided(info, located, elems)

    def _file_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        import numpy as np

        if not self._big or dtype.itemsize == 1:
            return dtype
        if dtype.kind in "fciub" and dtype.type.__module__ == "numpy":
            return dtype.newbyteorder(">")
        return np.dtype(f">u{dtype.itemsize}")  # bfloat16: swapped as a 16-bit word

    def _native(self, array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
        if array.dtype == dtype:
            return array
        if array.dtype.kind == "u" and dtype.kind != "u":
            return array.byteswap().view(dtype)
        return array.astype(dtype)

    def _pread(self, count: int, offset: int) -> np.ndarray:
        """`count` bytes at `offset`, read with preadv into a fresh array (no bytes object
        to copy from, and the resident set stays bounded)."""
        import numpy as np

        raw = np.empty(count, dtype=np.uint8)
        view = memoryview(raw)  # type: ignore[arg-type]
        with self._reading() as fd:
            try:
                done = pread_into(fd, view, offset)
            except OSError as exc:
                raise InputError(self.path, f"cannot read: {exc.strerror}") from None
        if done < count:
            raise InputError(self.path, "file is truncated (it changed while being read?)")
        return raw

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]] | None:
        """Thread-safe loaders of a contiguous tensor's chunks (pread needs no shared file
        position); None for a strided view, read in order through its map."""
        located = self._located[info.name]
        if not located.contiguous or located.span == 0:
            return None
        return self._loaders(info, located, default_chunk_elems(info.dtype))

    def _loaders(
        self, info: TensorInfo, located: _Located, elems: int
    ) -> Iterator[Callable[[], np.ndarray]]:
        """pread loaders of the tensor's chunks: RangeLoaders where the stored bytes are the
        values (little-endian, or one byte each), which helper processes may then count
        from the file (system.counting), else loaders that swap the bytes read."""
        file_dtype = self._file_dtype(info.dtype)
        begin = located.begin + located.first
        end = begin + info.nbytes
        step = elems * info.dtype.itemsize
        as_stored = functools.partial(self._read_as_stored, info.dtype)
        for start in range(begin, end, step):
            stop = min(start + step, end)
            if file_dtype == info.dtype:
                yield RangeLoader(as_stored, info.dtype, FileRange(self._reading, start, stop))
            else:
                yield functools.partial(self._load, stop - start, start, file_dtype, info.dtype)

    def _read_as_stored(self, dtype: np.dtype[Any], start: int, stop: int) -> np.ndarray:
        return self._pread(stop - start, start).view(dtype)

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:
        """A contiguous tensor's bytes where they are the values (little-endian, or one
        byte each): a kernel copy may take them, and helpers count them in place."""
        located = self._located[info.name]
        if not located.contiguous or self._file_dtype(info.dtype) != info.dtype:
            return None
        begin = located.begin + located.first
        return StoredBytes(self.path, self._reading, begin, begin + info.nbytes)

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        """Elements [start, stop) of a contiguous tensor, one pread (a strided view: None,
        it is read in order through its maps)."""
        located = self._located[info.name]
        if not 0 <= start <= stop <= info.numel:
            raise ValueError(f"elements [{start}, {stop}) are not in tensor {info.name!r}")
        if not located.contiguous:
            return None
        itemsize = info.dtype.itemsize
        return functools.partial(
            self._load,
            (stop - start) * itemsize,
            located.begin + located.first + start * itemsize,
            self._file_dtype(info.dtype),
            info.dtype,
        )

    def _load(
        self, count: int, offset: int, file_dtype: np.dtype[Any], dtype: np.dtype[Any]
    ) -> np.ndarray:
        return self._native(self._pread(count, offset).view(file_dtype), dtype)

    def _contiguous(self, info: TensorInfo, located: _Located, elems: int) -> Iterator[np.ndarray]:
        for load in self._loaders(info, located, elems):
            yield load()

    def _strided(self, info: TensorInfo, located: _Located, elems: int) -> Iterator[np.ndarray]:
        """A strided view, copied out in C order a block of rows at a time; each block is
        gathered through maps of at most _WINDOW_BYTES of the file, each unmapped before
        the next (a transposed view's block touches its whole span: mapped a window at a
        time, never whole). The chunks are those _c_order_pieces gives the whole view."""
        import numpy as np

        tensor = located.tensor
        itemsize = info.dtype.itemsize
        file_dtype = self._file_dtype(info.dtype)
        start = located.begin + located.first
        block_elems = max(elems, _BLOCK_BYTES // itemsize)
        window_elems = max(1, _WINDOW_BYTES // itemsize)
        blocks = _c_order_blocks(0, tensor.shape, tensor.stride, elems, block_elems)
        for block_offset, shape, strides in blocks:
            block = np.empty(shape, dtype=file_dtype)
            for index, offset, sub_shape in _bounded_views(
                block_offset, shape, strides, window_elems
            ):
                self._copy_window(
                    info, block[index], start + offset * itemsize, sub_shape, strides, file_dtype
                )
            for piece in _c_order_pieces(block, elems):
                yield self._native(piece.reshape(-1), info.dtype)

    def _copy_window(
        self,
        info: TensorInfo,
        target: np.ndarray,
        position: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        file_dtype: np.dtype[Any],
    ) -> None:
        """Copy the view at file offset `position` into `target` through a map of just its
        span (unmapped on return, so its pages leave the resident set)."""
        import numpy as np

        itemsize = file_dtype.itemsize
        span = (1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))) * itemsize
        aligned = position - position % mmap.ALLOCATIONGRANULARITY
        try:
            with self._reading() as fd:  # the map holds its own reference to the file
                window = map_read_only(fd, position - aligned + span, aligned)
        except (OSError, ValueError) as exc:
            raise InputError(self.path, f"cannot map: {exc}", info.name) from None
        try:
            source = np.ndarray(
                shape,
                dtype=file_dtype,
                buffer=window,
                offset=position - aligned,
                strides=tuple(s * itemsize for s in strides),
            )
            target[...] = source
            del source  # no array may point into the map when it closes
        finally:
            window.close()

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}

    def close(self) -> None:
        self._closed = True
        self.release()


def _c_contiguous(tensor: Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


Strided = tuple[int, tuple[int, ...], tuple[int, ...]]  # offset, sizes, strides (elements)


def _c_order_blocks(
    offset: int, shape: tuple[int, ...], strides: tuple[int, ...], elems: int, block_elems: int
) -> Iterator[Strided]:
    """Sub-views that together are the view's elements in C order, each at most
    `block_elems` (>= `elems`) elements, cut where _c_order_pieces(view, elems) cuts: a
    block split by _c_order_pieces gives the pieces the whole view would."""
    size = math.prod(shape)
    if size <= block_elems or not shape:
        yield offset, shape, strides
        return
    row = size // shape[0]
    if row == 0:
        return
    if row > block_elems:  # one leading index is too large: _c_order_pieces goes into it
        for index in range(shape[0]):
            yield from _c_order_blocks(
                offset + index * strides[0], shape[1:], strides[1:], elems, block_elems
            )
        return
    rows = max(1, elems // row)  # what _c_order_pieces takes at once
    step = rows * max(1, block_elems // (rows * row))
    for first in range(0, shape[0], step):
        count = min(step, shape[0] - first)
        yield offset + first * strides[0], (count, *shape[1:]), strides


def _bounded_views(
    offset: int, shape: tuple[int, ...], strides: tuple[int, ...], limit: int
) -> Iterator[tuple[tuple[slice, ...], int, tuple[int, ...]]]:
    """Sub-views of a view (strides unchanged) whose spans are at most `limit` elements,
    with where each sits in the view: the axis that spans most is cut, into as few parts
    as fit (each axis is cut at most once, so the recursion is as deep as the view)."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if span <= limit:
        yield (slice(None),) * len(shape), offset, shape
        return
    axis = max(range(len(shape)), key=lambda a: (shape[a] - 1) * strides[a])
    rest = span - (shape[axis] - 1) * strides[axis]
    step = (limit - rest) // strides[axis] + 1 if rest <= limit else 1
    for first in range(0, shape[axis], step):
        count = min(step, shape[axis] - first)
        sub_shape = (*shape[:axis], count, *shape[axis + 1 :])
        for index, sub_offset, inner in _bounded_views(
            offset + first * strides[axis], sub_shape, strides, limit
        ):
            placed = (*index[:axis], slice(first, first + count), *index[axis + 1 :])
            yield placed, sub_offset, inner


def _c_order_pieces(array: np.ndarray, elems: int) -> Iterator[np.ndarray]:
    """Sub-arrays of `array` that together are its elements in C order, each at most
    `elems` elements (rows of the leading axis, split further where one is too large)."""
    if array.size <= elems or array.ndim == 0:
        yield array
        return
    row = array.size // array.shape[0]
    if row == 0:
        return
    rows = max(1, elems // row)
    for start in range(0, array.shape[0], rows):
        piece = array[start : start + rows]
        if piece.size <= elems:
            yield piece
        else:
            yield from _c_order_pieces(piece[0], elems)
