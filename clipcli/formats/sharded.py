"""Sharded Hugging Face checkpoints: a model directory of safetensors shards plus an index.

A model directory holds either

- `model.safetensors.index.json` (`{"metadata": {"total_size": N, ...}, "weight_map":
  {tensor: shard}}`) and the shards `model-00001-of-0000K.safetensors` it names, or
- a single `model.safetensors` and no index,

next to config.json, tokenizer files and the like, which `clip` copies unchanged.

Choices made here (see FORMATS.md, "Sharded Hugging Face checkpoints"):

- The index must be complete: every tensor in a shard's header must be in the weight map.
  A tensor the index leaves out would be invisible to `transformers`, yet would still be
  read, clipped and counted in the global norm; refusing keeps both views equal.
- Each tensor lives in exactly one shard; a tensor stored in two shards is refused.
- `total_size` is not checked when reading: it is advisory, and loaders do not check it
  either. `validate_sharded` checks it, and the writer always writes it fresh.
- Files are read only inside the model directory. A symlink may point elsewhere only in a
  Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`), whose files all link into
  the repo's own `blobs/` store, and only when that `blobs/` is a real directory (a
  `blobs -> /` link would allow every file). Anything else could make `clip` copy a file
  such as ~/.ssh/id_rsa into an output that the user then publishes. Kernel and device
  files (/proc, /sys, /dev) and non-regular side files are refused.
- Shards are parsed once at start, then their descriptors are closed and reopened on
  demand, at most MAX_OPEN_SHARDS at a time.
- Copied unchanged: the regular files at the top level. Not copied: subdirectories
  (`original/`, `onnx/`, `.cache/`), other weight files (`pytorch_model*.bin`, `*.pth`,
  `consolidated.safetensors`, ...) and other indexes. Those hold the weights again in
  another form, unclipped; copying them would ship unclipped weights beside clipped ones.
  `skipped_files()` lists them so that the CLI can say so.
"""

from __future__ import annotations

import copy
import json
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from clipcli.errors import InputError
from clipcli.filecopy import copy_side_file
from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer
from clipcli.formats.safetensors import MAX_HEADER_BYTES, SafetensorsReader, SafetensorsWriter
from clipcli.inputs import is_pseudo_path, open_input, opened_path, read_input

FORMAT_NAME = "safetensors-sharded"
INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX_NAME = "model" + INDEX_SUFFIX
SHARD_SUFFIX = ".safetensors"
SINGLE_FILE_NAME = "model" + SHARD_SUFFIX
MAX_INDEX_BYTES = MAX_HEADER_BYTES  # an index is smaller than the headers it summarises
# Shard descriptors kept open at once; the others are reopened on demand (and checked to be
# the same file). Far below the usual `ulimit -n` of 1024, which 2,000 shards would exceed.
MAX_OPEN_SHARDS = 64

# Top-level files that hold the model's weights in another form (or index them).
OTHER_WEIGHT_SUFFIXES = frozenset(
    {
        SHARD_SUFFIX,
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".hdf5",
        ".msgpack",
        ".npz",
        ".onnx",
        ".onnx_data",
        ".gguf",
    }
)

# Folders that hold the weights again in another form, or version-control objects (a
# git-lfs clone keeps every weight file again under .git/lfs): never copied.
LEFT_OUT_FOLDERS = frozenset({"onnx", "openvino", ".git"})
MAX_SIDE_ENTRIES = 100_000  # files and folders beside the weights; real models hold dozens
MAX_SIDE_DEPTH = 16


# ---------------------------------------------------------------- finding a model directory


def resolve_sharded(path: Path) -> tuple[Path, Path | None] | None:
    """(directory, index) for a sharded checkpoint, (directory, None) for a single-file
    model directory, None when PATH is not a directory or an index (an ordinary file).

    A directory is always a model directory or an error: there is nothing else to read.
    """
    if path.is_dir():
        index = _find_index(path)
        if index is not None:
            return path, index
        _single_model_file(path)  # raises unless there is exactly one
        return path, None
    if path.name.endswith(INDEX_SUFFIX) and os.path.lexists(path):
        return path.parent, path  # a FIFO or device here is refused when it is opened
    return None


def _not_a_directory(path: Path) -> bool:
    """Files, FIFOs, devices, dangling links: entries that are refused by name when they
    are not regular files (is_file() would pass over them in silence)."""
    return os.path.lexists(path) and not path.is_dir()


def _find_index(directory: Path) -> Path | None:
    """model.safetensors.index.json, else the one *.safetensors.index.json present."""
    default = directory / DEFAULT_INDEX_NAME
    if os.path.lexists(default):
        return default
    found = sorted(p for p in directory.glob("*" + INDEX_SUFFIX) if _not_a_directory(p))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise InputError(directory, f"several safetensors indexes ({names}); pass the one to use")
    return found[0] if found else None


def _single_model_file(directory: Path) -> Path:
    """The directory's one *.safetensors file, for a model saved without shards."""
    found = sorted(p for p in directory.glob("*" + SHARD_SUFFIX) if _not_a_directory(p))
    if not found:
        raise InputError(directory, "no safetensors index or model file in this directory")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise InputError(
            directory, f"{len(found)} safetensors files ({names}) but no index to join them"
        )
    return found[0]


# ---------------------------------------------------------------- staying inside the directory


def _allowed_roots(directory: Path) -> list[Path]:
    """Where the directory's files may really live.

    - The model directory itself, as the user named it (symlinks in the name the user
      typed are the user's choice), resolved. Never `/`: that would allow every file.
    - For a Hugging Face hub cache snapshot (<entry>/snapshots/<revision>/, where <entry>
      is models--org--name), the entry's own blobs/ store, and only when blobs/ is a real
      directory: a blobs/ symlink (to `/`, to a home directory) is a link the user did not
      name, and following it would let the snapshot's files point anywhere.
    Nothing above the cache entry is ever a root.
    """
    real = directory.resolve()
    if real == Path(real.anchor):
        raise InputError(directory, "the filesystem root is not a model directory")
    if is_pseudo_path(real):
        raise InputError(directory, "is a kernel or device directory (/proc, /sys, /dev)")
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent != real.parent:
        entry = real.parent.parent
        blobs = entry / "blobs"
        if not blobs.is_symlink() and blobs.is_dir() and entry != Path(entry.anchor):
            roots.append(blobs)
    return roots


def _opened_inside(fd: int, entry: Path, roots: Iterable[Path]) -> None:
    """Refuse an opened file that does not lie inside `roots`, judged by the path the
    kernel gives for the descriptor itself (/proc/self/fd): checking a name and then
    opening it leaves a moment in which a link or a folder on the way can be swapped."""
    real = opened_path(fd)
    if real is None:
        return  # no /proc: the name-based check made before the open is what there is
    if is_pseudo_path(real) or not any(real.is_relative_to(root) for root in roots):
        raise InputError(
            entry,
            f"turned out to be {real}, outside the model directory "
            "(swapped while being opened); refusing it",
        )


def _real_path_inside(entry: Path, roots: Iterable[Path]) -> Path:
    """The file `entry` stands for, refusing dangling links, links out of `roots` and
    kernel or device files."""
    try:
        real = entry.resolve(strict=True)
    except FileNotFoundError:
        problem = "is a dangling symlink" if entry.is_symlink() else "does not exist"
        raise InputError(entry, problem) from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise InputError(entry, f"cannot resolve: {exc}") from None
    if is_pseudo_path(real):
        raise InputError(entry, f"links to {real}, a kernel or device file; refusing it")
    if not any(real.is_relative_to(root) for root in roots):
        raise InputError(entry, f"links to {real}, outside the model directory; refusing it")
    return real


def _check_shard_name(index_path: Path, tensor: str, shard: object) -> str:
    """A shard must be a plain *.safetensors file name: no path may leave the directory."""
    if not isinstance(shard, str):
        raise InputError(index_path, f"shard {shard!r} is not a string", tensor)
    plain = shard not in ("", ".", "..") and not any(c in shard for c in "/\\\0")
    if not plain or not shard.endswith(SHARD_SUFFIX):
        raise InputError(
            index_path, f"shard {shard!r} is not a plain *{SHARD_SUFFIX} file name", tensor
        )
    return shard


# ---------------------------------------------------------------- the index file


def _load_index(
    index_path: Path, real: Path | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The index document and its weight map, with every structural check done."""
    raw = read_input(index_path, MAX_INDEX_BYTES, real)
    document, duplicates = _parse_json_object(index_path, raw)
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise InputError(index_path, 'index has no "weight_map" object')
    for key, owner in duplicates:
        if owner is weight_map:
            raise InputError(index_path, "listed twice in the index", key)
        raise InputError(index_path, f"key {key!r} appears twice in the index")
    if not weight_map:
        raise InputError(index_path, "the index's weight_map lists no tensors")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise InputError(index_path, 'index "metadata" is not an object')
    checked = {tensor: _check_shard_name(index_path, tensor, s) for tensor, s in weight_map.items()}
    return document, checked


def _parse_json_object(
    index_path: Path, raw: bytes
) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """The JSON object, and each duplicate key with the object it was repeated in.

    json keeps the last of two equal keys silently; a tensor mapped to two shards must be
    an error instead, so duplicates are collected and judged once we know which object
    (the weight map or another one) holds them.
    """
    duplicates: list[tuple[str, dict[str, Any]]] = []

    def collect(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                duplicates.append((key, result))
            result[key] = value
        return result

    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=collect)
    except UnicodeDecodeError:
        raise InputError(index_path, "index is not valid UTF-8") from None
    except RecursionError:
        raise InputError(index_path, "index JSON is nested too deeply") from None
    except ValueError as exc:
        raise InputError(index_path, f"index is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InputError(index_path, "index is not a JSON object")
    return document, duplicates


def _flatten(metadata: Mapping[str, Any]) -> dict[str, str]:
    """String metadata as every format reports it: non-strings as their JSON text."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


# ---------------------------------------------------------------- reading


class ShardedReader(Reader):
    """All tensors of a model directory, as if it were one checkpoint.

    `infos` lists the shards in file-name order and each shard's tensors in file order;
    data is read through each shard's SafetensorsReader.
    """

    format_name = FORMAT_NAME

    def __init__(self, directory: Path, index_path: Path | None = None) -> None:
        super().__init__(directory)
        self.directory = directory
        self.index_path = index_path
        self._readers: dict[str, SafetensorsReader] = {}
        # Shards whose descriptor is open, least recently used first (at most MAX_OPEN_SHARDS).
        self._open_lru: OrderedDict[str, None] = OrderedDict()
        self._index: dict[str, Any] | None = None
        self._flat_metadata: dict[str, str] | None = None
        try:
            self._roots = _allowed_roots(directory)
            self._open(index_path)
        except BaseException:
            self.close()
            raise

    def _open(self, index_path: Path | None) -> None:
        weight_map: dict[str, str] | None = None
        if index_path is None:
            names = [_single_model_file(self.directory).name]
        else:
            real = _real_path_inside(index_path, self._roots)
            self._index, weight_map = _load_index(index_path, real)
            names = sorted(set(weight_map.values()))
        for name in names:
            self._readers[name] = self._open_shard(name)
            self._used(name)
        self._shard_of = self._tensor_owners(weight_map)
        self._infos = [info for name in names for info in self._readers[name].infos]
        self._other_files, self._side_folders, self._skipped_files = self._scan_directory()

    def _open_shard(self, name: str) -> SafetensorsReader:
        path = self.directory / name
        if not os.path.lexists(path):
            listed_in = self.index_path.name if self.index_path else "the directory"
            raise InputError(path, f"shard listed in {listed_in} does not exist")
        _real_path_inside(path, self._roots)
        try:
            reader = SafetensorsReader(path)
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc.strerror}") from None
        try:
            # The file opened must lie inside the roots: a link or folder swapped between
            # the check and the open is caught on the descriptor itself.
            _opened_inside(reader.fileno(), path, self._roots)
        except BaseException:
            reader.close()
            raise
        return reader

    def _tensor_owners(self, weight_map: Mapping[str, str] | None) -> dict[str, str]:
        """tensor -> shard, from the headers, checked against the index both ways."""
        owners: dict[str, str] = {}
        for shard, reader in self._readers.items():
            for info in reader.infos:
                if info.name in owners:
                    problem = f"stored in shard {owners[info.name]!r} and again in this shard"
                    raise InputError(reader.path, problem, info.name)
                owners[info.name] = shard
        if weight_map is None:
            return owners
        for tensor, shard in weight_map.items():
            stored_in = owners.get(tensor)
            if stored_in != shard:
                where = "" if stored_in is None else f" (it is in shard {stored_in!r})"
                raise InputError(self.index_path, f"not found in shard {shard!r}{where}", tensor)
        for tensor, shard in owners.items():
            if tensor not in weight_map:
                problem = "is in this shard but missing from the index (the index must be complete)"
                raise InputError(self.directory / shard, problem, tensor)
        return owners

    def _scan_directory(self) -> tuple[list[Path], list[Path], list[Path]]:
        """(files to copy unchanged, directories to recreate, entries left out), in walk
        order. Subdirectories are part of the model (sentence-transformers' 1_Pooling/ and
        2_Normalize/, which modules.json points at), so they are walked; weight files in
        other forms anywhere, weight folders (onnx/, openvino/) and .git/ are left out, as
        are symlinked directories (not followed). Bounded in entries and depth."""
        ours = set(self._readers)
        if self.index_path is not None:
            ours.add(self.index_path.name)
        copied: list[Path] = []
        folders: list[Path] = []
        skipped: list[Path] = []
        pending = [(self.directory, 0)]
        seen = 0
        while pending:
            folder, depth = pending.pop(0)
            try:
                listing = sorted(folder.iterdir())
            except OSError as exc:
                raise InputError(folder, f"cannot list: {exc.strerror}") from None
            seen += len(listing)
            if seen > MAX_SIDE_ENTRIES:
                raise InputError(
                    self.directory, f"holds more than {MAX_SIDE_ENTRIES} files and folders"
                )
            for entry in listing:
                if folder == self.directory and entry.name in ours:
                    continue
                if entry.is_dir():
                    if (
                        entry.is_symlink()
                        or entry.name in LEFT_OUT_FOLDERS
                        or depth + 1 > MAX_SIDE_DEPTH
                    ):
                        skipped.append(entry)
                    else:
                        folders.append(entry)
                        pending.append((entry, depth + 1))
                elif _holds_weights(entry.name):
                    skipped.append(entry)
                else:
                    self._check_side_file(entry)
                    copied.append(entry)
        return copied, folders, skipped

    def _check_side_file(self, entry: Path) -> Path:
        """A file to copy must be a regular file inside the allowed roots: a FIFO, device,
        socket or link to one is refused (exit 3), naming it, rather than left out in
        silence, since the copy would then lack a file the user expects in it."""
        real = _real_path_inside(entry, self._roots)
        mode = real.stat().st_mode
        if not stat.S_ISREG(mode):
            raise InputError(entry, "is not a regular file (FIFO, device or socket); not copied")
        return real

    def open_other_file(self, entry: Path) -> BinaryIO:
        """Open a file listed by other_files() for copying: its confinement is checked again
        and it is opened non-blocking and checked to be a regular file on the descriptor,
        so a name swapped for a FIFO or a link out since the listing is refused (exit 3)."""
        if entry not in self._other_files:
            raise ValueError(f"{entry} is not one of the files to copy")
        self._check_side_file(entry)
        handle = open_input(entry)
        try:
            _opened_inside(handle.fileno(), entry, self._roots)
        except BaseException:
            handle.close()
            raise
        return handle

    # -- the Reader interface

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        """The index's "metadata" object (total_size, ...); a single file's __metadata__."""
        if self._index is None:
            return self._readers[self.shard_names[0]].metadata
        if self._flat_metadata is None:  # flattened once: an index may hold a million keys
            self._flat_metadata = _flatten(self._index.get("metadata", {}))
        return self._flat_metadata

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        return self._reader_of(info).chunks(info, chunk_elems)

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
        return self._reader_of(info).chunk_loaders(info)

    def read(self, info: TensorInfo) -> np.ndarray:
        return self._reader_of(info).read(info)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._open_lru.clear()

    def _used(self, shard: str) -> None:
        """Mark a shard as just used; release the least recently used one past the cap."""
        self._open_lru[shard] = None
        self._open_lru.move_to_end(shard)
        while len(self._open_lru) > MAX_OPEN_SHARDS:
            oldest, _ = self._open_lru.popitem(last=False)
            self._readers[oldest].release()

    # -- the directory

    @property
    def shard_names(self) -> list[str]:
        """Shard file names in the order `infos` visits them."""
        return list(self._readers)

    def shard_of(self, name: str) -> str:
        return self._shard_of[name]

    def shard_reader(self, shard: str) -> SafetensorsReader:
        self._used(shard)
        return self._readers[shard]

    def common_shard_metadata(self) -> dict[str, str]:
        """The __metadata__ entries that every shard shares (typically {"format": "pt"}),
        for joining the shards into one file: `metadata` is the index's, and transformers
        refuses a safetensors file whose __metadata__ lacks "format"."""
        shared = dict(self._readers[self.shard_names[0]].metadata)
        for reader in self._readers.values():
            shared = {k: v for k, v in shared.items() if reader.metadata.get(k) == v}
        return shared

    def index_document(self) -> dict[str, Any] | None:
        """A copy of the parsed index (None without one), for writing the new index."""
        return copy.deepcopy(self._index)

    def other_files(self) -> list[Path]:
        """Files that are neither these weights nor the index, at any depth: config,
        tokenizer, 1_Pooling/config.json, ..."""
        return list(self._other_files)

    def side_folders(self) -> list[Path]:
        """Subdirectories to recreate (parents before children), empty ones included."""
        return list(self._side_folders)

    def skipped_files(self) -> list[Path]:
        """Entries that `clip` does not copy: weights in other forms, weight folders, .git/
        and symlinked directories."""
        return list(self._skipped_files)

    def left_out_reason(self, entry: Path) -> str:
        """Why an entry of skipped_files() is not copied, for the note clipcli prints."""
        if entry.is_dir():
            if entry.is_symlink():
                return "a symlinked folder, not followed"
            if entry.name == ".git":
                return "version-control data (git-lfs keeps the weights again there)"
            if entry.name in LEFT_OUT_FOLDERS:
                return "weights in another format, which clipcli does not clip"
            return f"nested deeper than {MAX_SIDE_DEPTH} folders"
        return "weights in another format, which clipcli does not clip"

    def source_files(self) -> list[Path]:
        index = [] if self.index_path is None else [self.index_path]
        return [*index, *(self.directory / name for name in self.shard_names), *self.side_files()]

    def side_files(self) -> list[Path]:
        return self.other_files()

    def _reader_of(self, info: TensorInfo) -> SafetensorsReader:
        return self.shard_reader(self._shard_of[info.name])


def _holds_weights(name: str) -> bool:
    return name.endswith(".index.json") or Path(name).suffix.lower() in OTHER_WEIGHT_SUFFIXES


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class _ShardPlan:
    name: str
    infos: list[TensorInfo]
    metadata: Mapping[str, str]


def _plan_shards(checkpoint: Checkpoint) -> list[_ShardPlan]:
    """The source's shards (names, tensors, __metadata__), or one model.safetensors."""
    source = checkpoint.source
    if not isinstance(source, ShardedReader):
        return [_ShardPlan(SINGLE_FILE_NAME, list(checkpoint.infos), checkpoint.metadata)]
    grouped: dict[str, list[TensorInfo]] = {}
    previous: str | None = None
    for info in checkpoint.infos:
        shard = source.shard_of(info.name)
        # Shards are written one after another, so their tensors must arrive together.
        if shard != previous and shard in grouped:
            raise ValueError(f"tensor {info.name!r}: tensors of shard {shard!r} are not adjacent")
        grouped.setdefault(shard, []).append(info)
        previous = shard
    return [
        _ShardPlan(shard, infos, source.shard_reader(shard).metadata)
        for shard, infos in grouped.items()
    ]


def output_names(source: Reader | None) -> frozenset[str]:
    """Every path (relative, '/'-separated) the writer puts into an output directory for
    this source: shards, index, side files and the folders that hold them."""
    checkpoint = Checkpoint(list(source.infos) if source else [], {}, source)
    names = {plan.name for plan in _plan_shards(checkpoint)}
    if isinstance(source, ShardedReader):
        if source.index_path is not None:
            names.add(source.index_path.name)
        for path in [*source.side_folders(), *source.side_files()]:
            names.add(path.relative_to(source.directory).as_posix())
    return frozenset(names)


class ShardedWriter(Writer):
    """Fills an existing empty directory: the source's shards, a fresh index, and the source
    directory's other files; or one model.safetensors when the source is a single file.

    Each shard is a SafetensorsWriter, opened when its first tensor arrives and closed when
    the next shard starts, so one output file is open at a time.
    """

    format_name = FORMAT_NAME

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        for info in checkpoint.infos:
            if (reason := self.check_dtype(info)) is not None:
                raise ValueError(reason)
        if not path.is_dir():
            raise ValueError(f"{path}: ShardedWriter needs an existing directory")
        self._plans = _plan_shards(checkpoint)
        self._shard_number = {
            info.name: number for number, plan in enumerate(self._plans) for info in plan.infos
        }
        self._order = [info for plan in self._plans for info in plan.infos]
        self._written = 0  # tensors done, in arrival order
        self._open_number = -1  # the shard being written
        self._current: SafetensorsWriter | None = None

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        return SafetensorsWriter.check_dtype(info)

    @classmethod
    def check_name(cls, name: str) -> str | None:
        return SafetensorsWriter.check_name(name)

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._shard_writer(info).write(info, chunks)
        self._written += 1

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:
        """Kernel copy from the source shard; False (the caller streams) for other formats."""
        writer = self._shard_writer(info)
        if isinstance(source, ShardedReader):
            source = source.shard_reader(source.shard_of(info.name))
        copied = writer.copy_unchanged(source, info)
        if copied:
            self._written += 1
        return copied

    def close(self) -> None:
        if self._written != len(self._order):
            raise ValueError(f"close() after {self._written} of {len(self._order)} tensors")
        while self._open_number < len(self._plans) - 1:  # a checkpoint without tensors
            self._start_shard(self._open_number + 1)
        self._finish_shard()
        source = self.checkpoint.source
        if isinstance(source, ShardedReader):
            if source.index_path is not None:
                self._write_index(source, source.index_path.name)
            for folder in source.side_folders():
                (self.path / folder.relative_to(source.directory)).mkdir(mode=0o755)
            for file in source.side_files():  # links followed (inside the roots): real files out
                with source.open_other_file(file) as handle:
                    destination = self.path / file.relative_to(source.directory)
                    copy_side_file(handle.fileno(), file, destination)

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None

    def _shard_writer(self, info: TensorInfo) -> SafetensorsWriter:
        """The writer of the shard that holds `info`, which must be the next tensor."""
        expected = self._order[self._written] if self._written < len(self._order) else None
        if expected is None or expected.name != info.name:
            wanted = "none" if expected is None else repr(expected.name)
            raise ValueError(f"tensor {info.name!r} arrived out of order; expected {wanted}")
        number = self._shard_number[info.name]
        if number != self._open_number:
            self._start_shard(number)
        assert self._current is not None
        return self._current

    def _start_shard(self, number: int) -> None:
        self._finish_shard()
        plan = self._plans[number]
        shard_checkpoint = Checkpoint(plan.infos, plan.metadata, self.checkpoint.source)
        self._current = SafetensorsWriter(self.path / plan.name, shard_checkpoint, self.durable)
        self._open_number = number

    def _finish_shard(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def _write_index(self, source: ShardedReader, index_name: str) -> None:
        """The source index with a recomputed total_size and this weight map, written the
        way transformers' save_pretrained does (indent 2, sorted keys)."""
        document = source.index_document() or {}
        metadata = dict(document.get("metadata", {}))
        metadata["total_size"] = sum(info.nbytes for info in self._order)
        document["metadata"] = metadata
        document["weight_map"] = {
            info.name: plan.name for plan in self._plans for info in plan.infos
        }
        text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (self.path / index_name).write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- validation


def validate_sharded(path: Path) -> None:
    """Check a model directory (or index) end to end; raise InputError on the first problem.

    Beyond what ShardedReader checks (shards exist, are plain names, each tensor in exactly
    its shard, the index complete), every shard must open with the official
    `safetensors.safe_open`, and the index's metadata.total_size must equal the sum of the
    tensors' byte sizes.
    """
    resolved = resolve_sharded(path)
    if resolved is None:
        raise InputError(path, "not a model directory or a safetensors index")
    reader = ShardedReader(*resolved)
    try:
        for shard in reader.shard_names:
            _check_with_safe_open(reader, shard)
        if reader.index_path is not None:
            _check_total_size(reader, reader.index_path)
    finally:
        reader.close()


def _check_with_safe_open(reader: ShardedReader, shard: str) -> None:
    from safetensors import safe_open

    path = reader.directory / shard
    try:
        with safe_open(str(path), framework="np") as handle:
            keys = set(handle.keys())
    except Exception as exc:  # SafetensorError has no importable base class
        raise InputError(path, f"safetensors cannot open this shard: {exc}") from None
    for info in reader.shard_reader(shard).infos:
        if info.name not in keys:
            raise InputError(path, "missing according to safetensors.safe_open", info.name)


def _check_total_size(reader: ShardedReader, index_path: Path) -> None:
    document = reader.index_document() or {}
    total = document.get("metadata", {}).get("total_size")
    actual = sum(info.nbytes for info in reader.infos)
    if not isinstance(total, int) or isinstance(total, bool):
        raise InputError(index_path, f"metadata.total_size is {total!r}, not an integer")
    if total != actual:
        raise InputError(
            index_path, f"metadata.total_size is {total} but the tensors hold {actual} bytes"
        )
