"""Reading a model directory as one checkpoint (ShardedReader), and checking one end to
end with the official safetensors library (validate_sharded)."""

from __future__ import annotations

import copy
import os
import stat
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from clipcli.errors import InputError
from clipcli.formats.base import (
    DirectoryLayout,
    ListedTensor,
    Reader,
    Shard,
    StoredBytes,
    TensorInfo,
)
from clipcli.formats.safetensors import SafetensorsReader  # the shards' interface
from clipcli.formats.sharded.layout import (
    DERIVED_INDEX_KEYS,
    FORMAT_NAME,
    LEFT_OUT_FOLDERS,
    MAX_SIDE_DEPTH,
    MAX_SIDE_ENTRIES,
    PYTORCH_NAMES,
    SAFETENSORS_NAMES,
    DirectoryNames,
    allowed_roots,
    flatten,
    holds_weights,
    load_index,
    opened_inside,
    real_path_inside,
    resolve_sharded,
    single_model_file,
    weights_by_content,
)
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import open_input, out_of_descriptors

if TYPE_CHECKING:
    import numpy as np


def _shard_reader_class(names: DirectoryNames) -> type[SafetensorsReader]:
    """The shards' reader, as the registry names it. The shards' interface beyond Reader
    (fileno, release) is the safetensors reader's, which the PyTorch reader has too: the
    type says so."""
    return cast("type[SafetensorsReader]", names.shard_format.reader_class())


# Shard descriptors kept open at once; the others are reopened on demand (and checked to be
# the same file). Far below the usual `ulimit -n` of 1024, which 2,000 shards would exceed.
MAX_OPEN_SHARDS = 64


class ShardedReader(Reader):
    """All tensors of a model directory, as if it were one checkpoint.

    `infos` lists the shards in file-name order and each shard's tensors in file order;
    data is read through each shard's SafetensorsReader.
    """

    format_name = FORMAT_NAME

    def __init__(
        self,
        directory: Path,
        index_path: Path | None = None,
        names: DirectoryNames = SAFETENSORS_NAMES,
    ) -> None:
        super().__init__(directory)
        self.directory = directory
        self.index_path = index_path
        self.names = names
        self.format_name = names.format.name  # type: ignore[misc]  # per instance, on purpose
        self._shard_class = _shard_reader_class(names)
        self._readers: dict[str, SafetensorsReader] = {}
        # Shards whose descriptor is open, least recently used first (at most MAX_OPEN_SHARDS).
        self._open_lru: OrderedDict[str, None] = OrderedDict()
        self._lru_lock = threading.Lock()  # shards are read from several threads at once
        self._index: dict[str, Any] | None = None
        # Identities of the files read or to be copied, as first seen (clipcli.system.identity).
        self._identities: dict[Path, FileIdentity] = {}
        # Hard links: each side file's inode and link count, and how many names the walk
        # found for each inode inside the directory (side_files_linked_elsewhere).
        self._side_inodes: dict[Path, tuple[tuple[int, int], int]] = {}
        self._names_inside: Counter[tuple[int, int]] = Counter()
        self._flat_metadata: dict[str, str] | None = None
        try:
            self._roots = allowed_roots(directory)
            self._open(index_path)
        except BaseException:
            self.close()
            raise

    def _open(self, index_path: Path | None) -> None:
        weight_map: dict[str, str] | None = None
        if index_path is None:
            single = single_model_file(self.directory, self.names)
            assert single is not None  # required: raised otherwise
            names = [single.name]
        else:
            real = real_path_inside(index_path, self._roots)
            self._index, weight_map, self._identities[index_path] = load_index(
                index_path, real, self.names
            )
            names = sorted(set(weight_map.values()))
        for name in names:
            self._readers[name] = self._open_shard(name)
            self._used(name)
        self._shard_of = self._tensor_owners(weight_map)
        # Listed from the headers alone (no numpy: `ls model_dir/`); `infos` on first use.
        self._listing = [t for name in names for t in self._readers[name].listing]
        self._infos: list[TensorInfo] | None = None
        self._infos_made = threading.Lock()
        self._content_kinds: dict[Path, str] = {}  # files left out for their content
        self._other_files, self._side_folders, self._skipped_files = self._scan_directory()

    def _open_shard(self, name: str) -> SafetensorsReader:
        path = self.directory / name
        if not os.path.lexists(path):
            listed_in = self.index_path.name if self.index_path else "the directory"
            raise InputError(path, f"shard listed in {listed_in} does not exist")
        real_path_inside(path, self._roots)
        try:
            reader = self._shard_class(path)
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc.strerror}") from None
        try:
            # The file opened must lie inside the roots: a link or folder swapped between
            # the check and the open is caught on the descriptor itself.
            opened_inside(reader.fileno(), path, self._roots)
        except BaseException:
            reader.close()
            raise
        return reader

    def _tensor_owners(self, weight_map: Mapping[str, str] | None) -> dict[str, str]:
        """tensor -> shard, from the headers, checked against the index both ways."""
        owners: dict[str, str] = {}
        for shard, reader in self._readers.items():
            for info in reader.listing:
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
                no_descriptor = out_of_descriptors(exc, folder)
                raise no_descriptor or InputError(folder, f"cannot list: {exc.strerror}") from None
            seen += len(listing)
            if seen > MAX_SIDE_ENTRIES:
                raise InputError(
                    self.directory, f"holds more than {MAX_SIDE_ENTRIES} files and folders"
                )
            for entry in listing:
                try:
                    own = entry.lstat()
                    is_directory = entry.is_dir()
                except OSError as exc:  # in a folder that may be listed but not entered
                    raise InputError(entry, f"cannot read: {exc.strerror}") from None
                if not stat.S_ISDIR(own.st_mode):
                    self._names_inside[(own.st_dev, own.st_ino)] += 1
                if folder == self.directory and entry.name in ours:
                    continue
                if is_directory:
                    if (
                        entry.is_symlink()
                        or entry.name in LEFT_OUT_FOLDERS
                        or depth + 1 > MAX_SIDE_DEPTH
                    ):
                        skipped.append(entry)
                    else:
                        folders.append(entry)
                        pending.append((entry, depth + 1))
                elif holds_weights(entry.name):
                    skipped.append(entry)
                else:
                    self._check_side_file(entry)
                    kind = self._weights_inside(entry)
                    if kind is None:
                        copied.append(entry)
                    else:
                        self._content_kinds[entry] = kind
                        skipped.append(entry)
        return copied, folders, skipped

    def _weights_inside(self, entry: Path) -> str | None:
        """The weight format the file's content shows (weights_by_content), or None. A file
        that cannot be opened here is judged when it is copied (which reports why)."""
        try:
            handle = open_input(entry)
        except (OSError, InputError):
            return None
        with handle:
            # Outside the roots is a refusal here as at the copy: the content of a file
            # that was not given is not even looked at.
            opened_inside(handle.fileno(), entry, self._roots)
            try:
                return weights_by_content(handle.fileno(), os.fstat(handle.fileno()).st_size)
            except OSError:
                return None

    def _check_side_file(self, entry: Path) -> Path:
        """A file to copy must be a regular file inside the allowed roots: a FIFO, device,
        socket or link to one is refused (exit 3), naming it, rather than left out in
        silence, since the copy would then lack a file the user expects in it."""
        real = real_path_inside(entry, self._roots)
        try:
            info = real.stat()
        except OSError as exc:
            raise InputError(entry, f"cannot read: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise InputError(entry, "is not a regular file (FIFO, device or socket); not copied")
        # The first sight of the file is the identity that counts (the input guard, and
        # the copy's open): a later look would accept a file renamed over it meanwhile.
        self._identities.setdefault(entry, FileIdentity.of_stat(info))
        self._side_inodes.setdefault(entry, ((info.st_dev, info.st_ino), info.st_nlink))
        return real

    def side_files_linked_elsewhere(self) -> list[tuple[Path, int]]:
        """Side files whose inode has more hard links than the names found for it inside
        the directory, with their link count: another name lies outside, and the content
        may be any file of the user's (a tar extracted without filters links
        `config.json` to `../../.ssh/id_ed25519`). The path confines symlinks, not these.
        A symlink into the Hub cache's blobs/ counts its blob, which has one link."""
        linked = []
        for entry in self._other_files:
            inode, links = self._side_inodes[entry]
            if links > max(1, self._names_inside[inode]):
                linked.append((entry, links))
        return linked

    def open_other_file(self, entry: Path) -> BinaryIO:
        """Open a file listed by other_files() for copying: its confinement is checked again
        and it is opened non-blocking and checked to be a regular file on the descriptor,
        so a name swapped for a FIFO or a link out since the listing is refused (exit 3)."""
        if entry not in self._other_files:
            raise ValueError(f"{entry} is not one of the files to copy")
        self._check_side_file(entry)
        try:
            handle = open_input(entry)
        except OSError as exc:  # gone or unreadable since the listing: the input's fault
            raise InputError(entry, f"cannot read: {exc.strerror}; no output written") from None
        try:
            opened_inside(handle.fileno(), entry, self._roots)
            if FileIdentity.of_stat(os.fstat(handle.fileno())) != self._identities[entry]:
                raise InputError(entry, "changed since the directory was listed; no output written")
        except BaseException:
            handle.close()
            raise
        return handle

    def warnings(self) -> list[str]:
        """Which weights were read, where a directory holds the model in safetensors and
        as PyTorch `.bin` files too (the safetensors are read, the others left out)."""
        if self.names is not SAFETENSORS_NAMES:
            return []
        other = PYTORCH_NAMES
        beside = [
            p.name
            for p in (self.directory / other.default_index, self.directory / other.single_file)
            if os.path.lexists(p)
        ] or sorted(p.name for p in self.directory.glob("pytorch_model-*" + other.shard_suffix))
        if not beside:
            return []
        shown = ", ".join(beside[:3]) + (f" and {len(beside) - 3} more" if len(beside) > 3 else "")
        read = self.index_path.name if self.index_path is not None else self.shard_names[0]
        return [f"read {read}; the PyTorch weights beside it ({shown}) are left out"]

    def shard_readers(self) -> list[Reader]:
        """The shards' readers, in file-name order (what a view of their tensors needs)."""
        return list(self._readers.values())

    # -- the Reader interface

    @property
    def listing(self) -> Sequence[ListedTensor]:
        # The infos once they exist, as a shard's own listing is (one record of each); the
        # listing read first, as the infos are set before it is let go.
        listing, infos = self._listing, self._infos
        return listing if infos is None else infos

    @property
    def infos(self) -> list[TensorInfo]:
        if self._infos is None:
            with self._infos_made:  # two threads asking first get the same infos
                if self._infos is None:
                    readers = self._readers.values()
                    self._infos = [info for reader in readers for info in reader.infos]
                    self._listing = []
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        """The index's "metadata" object (total_size, ...); a single file's __metadata__."""
        if self._index is None:
            return self._readers[self.shard_names[0]].metadata
        if self._flat_metadata is None:  # flattened once: an index may hold a million keys
            self._flat_metadata = flatten(self._index.get("metadata", {}))
        return self._flat_metadata

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        return self._reader_of(info).chunks(info, chunk_elems)

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
        return self._reader_of(info).chunk_loaders(info)

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        return self._reader_of(info).elements_loader(info, start, stop)

    def read(self, info: TensorInfo) -> np.ndarray:
        return self._reader_of(info).read(info)

    def loader_of_many(self, infos: Sequence[TensorInfo]) -> Callable[[], list[np.ndarray]] | None:
        """Tensors of one shard together, as that shard's reader reads them."""
        shard = self._shard_of[infos[0].name]
        if any(self._shard_of[info.name] != shard for info in infos):
            return None
        return self.shard_reader(shard).loader_of_many(infos)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._open_lru.clear()

    def _used(self, shard: str) -> None:
        """Mark a shard as just used; release the least recently used one past the cap."""
        with self._lru_lock:
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
        # Each shard's joined_metadata: its own metadata, not what its reader found about
        # the file (a PyTorch shard's `pytorch.layout`), which no joined file carries.
        joined = {name: reader.joined_metadata() for name, reader in self._readers.items()}
        shared = joined[self.shard_names[0]]
        for metadata in joined.values():
            shared = {k: v for k, v in shared.items() if metadata.get(k) == v}
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
        kind = self._content_kinds.get(entry)
        if kind is not None:
            return f"{kind}: weights in another format, which clipcli does not clip"
        return "weights in another format, which clipcli does not clip"

    def source_files(self) -> list[Path]:
        index = [] if self.index_path is None else [self.index_path]
        return [*index, *(self.directory / name for name in self.shard_names), *self.side_files()]

    def side_files(self) -> list[Path]:
        return self.other_files()

    def source_identities(self) -> dict[Path, FileIdentity]:
        known = dict(self._identities)  # the index and the side files
        for reader in self._readers.values():  # each shard, from its own descriptor
            known.update(reader.source_identities())
        return {path: known[path] for path in self.source_files()}

    # -- format extras (clipcli.formats.base.Reader)

    @property
    def model_directory(self) -> Path | None:
        return self.directory

    def joined_metadata(self) -> dict[str, str]:
        return self.common_shard_metadata()

    def descriptions(self) -> frozenset[str]:
        """Without an index, `metadata` is the one shard's, descriptions included."""
        if self._index is None:
            return self._readers[self.shard_names[0]].descriptions()
        return frozenset()

    def join_losses(self) -> list[str]:
        """The index's metadata (but DERIVED_INDEX_KEYS, which the one file does not need)
        and the shard __metadata__ entries that not every shard shares with the same value."""
        joined = self.common_shard_metadata()
        index = [
            k for k in self.metadata if k not in DERIVED_INDEX_KEYS and self.index_path is not None
        ]
        index = [k for k in index if joined.get(k) != self.metadata[k]]
        shards = sorted(
            {
                k
                for reader in self._readers.values()
                for k in reader.joined_metadata()
                if k not in joined
            }
        )
        losses = []
        if index:
            losses.append(f"the index's metadata {_listed(index)}")
        if shards:
            losses.append(f"shard __metadata__ the shards do not share {_listed(shards)}")
        return losses

    def stored_bytes(self, info: TensorInfo) -> StoredBytes:
        return self._reader_of(info).stored_bytes(info)

    def left_out_entries(self) -> list[tuple[str, str]]:
        return [
            (entry.relative_to(self.directory).as_posix(), self.left_out_reason(entry))
            for entry in self.skipped_files()
        ]

    def directory_layout(self) -> DirectoryLayout:
        """The shards in `infos` order, each with its tensors and __metadata__."""
        grouped: dict[str, list[TensorInfo]] = {}
        for info in self.infos:
            grouped.setdefault(self._shard_of[info.name], []).append(info)
        shards = [Shard(name, infos, self._shard_metadata(name)) for name, infos in grouped.items()]
        return DirectoryLayout(
            root=self.directory,
            shards=shards,
            index_name=None if self.index_path is None else self.index_path.name,
            index_document=self.index_document(),
            side_folders=self.side_folders(),
            side_files=self.side_files(),
            open_side_file=self.open_other_file,
        )

    def _shard_metadata(self, shard: str) -> Mapping[str, str]:
        """A shard's __metadata__ as it is written out (as safetensors): its own, or for a
        PyTorch shard the tag transformers looks for (what the PyTorch reader derived of
        the file, its layout and ties, describes the .bin, not the copy)."""
        if self.names is PYTORCH_NAMES:
            return {"format": "pt"}
        return self._readers[shard].metadata

    def _reader_of(self, info: TensorInfo) -> SafetensorsReader:
        return self.shard_reader(self._shard_of[info.name])


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


def _listed(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"({shown}{f' and {len(keys) - limit} more' if len(keys) > limit else ''})"
