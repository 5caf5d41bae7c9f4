"""Keras 3 `.keras` archives: a zip of `config.json`, `metadata.json`, `model.weights.h5`
and, for some models, assets.

The weights are an ordinary HDF5 file inside the zip. The reader checks the zip with the
npz reader's rules (every member's bytes its own and inside the file, local headers agreeing
with the central directory, all members together inflating to at most 200 x the archive's
size + 64 MiB, names that escape or name one file however spelt, here letter case included:
formats.zipsafe), refuses backslashes in member names, unpacks `model.weights.h5` into a
temp file that has no name (its CRC checked as it streams) and reads that with the HDF5
reader and all of its rules; messages name it `ARCHIVE[model.weights.h5]`. A file with no
name is gone with the last descriptor, however the process ends: SIGKILL, SIGQUIT or a
power cut cannot leave up to 200 x the archive in $TMPDIR, where nothing would sweep it.

The writer writes a new archive with the same members in the same order, each with the same
name, date, permissions, comment and compression method; every member but the weights has
the same content byte for byte (deflated members are compressed again, so their compressed
bytes may differ), and the weights are the clipped HDF5 file, with its whole structure.
A `.keras` OUT needs a `.keras` IN: its other members cannot be made up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np

from clipcli.errors import InputError
from clipcli.formats.base import (
    Checkpoint,
    NonTensorInfo,
    Reader,
    TensorInfo,
    Writer,
)
from clipcli.formats.hdf5 import Hdf5Reader, Hdf5Writer
from clipcli.formats.structure_record import Structure
from clipcli.formats.zipsafe import BoundedMember, check_zip_layout, open_member, unix_file_type
from clipcli.system import interrupts, scratch
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import fd_path, open_input

WEIGHTS_MEMBER = "model.weights.h5"
COPY_BLOCK = 1 << 20
MAX_MEMBERS = 10_000  # config, metadata, weights and a few assets
SCRATCH_PREFIX = "clipcli-keras-"


def is_keras_archive(names: Iterable[str]) -> bool:
    members = set(names)
    return WEIGHTS_MEMBER in members and "config.json" in members


class KerasArchiveReader(Reader):
    format_name = "keras"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle: BinaryIO = open_input(path)
        self._scratch: scratch.PrivateDirectory | None = None
        self.inner: Hdf5Reader | None = None
        try:
            self._identity = FileIdentity.of_stat(os.fstat(self._handle.fileno()))
            try:
                self.archive = zipfile.ZipFile(self._handle)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
                raise InputError(path, f"not a valid .keras (zip) archive: {exc}") from None
            self.members = self._check_members()
            self.inner = self._unpack_weights()
        except BaseException:
            self.close()
            raise

    @property
    def weights_name(self) -> Path:
        return Path(f"{self.path}[{WEIGHTS_MEMBER}]")

    def _check_members(self) -> list[zipfile.ZipInfo]:
        entries = self.archive.infolist()
        if len(entries) > MAX_MEMBERS:
            raise InputError(self.path, f"holds {len(entries)} members, over {MAX_MEMBERS}")
        # Names (duplicates however spelt, case too: these members are files that tools
        # extract), layout and budget: the zip rules shared with npz.
        check_zip_layout(self.path, self._handle.fileno(), self.archive, fold_case=True)
        for entry in entries:
            name = entry.filename
            if "\\" in name:  # a separator to Windows tools, a plain character to others
                raise InputError(
                    self.path, f"member name {name!r} holds a backslash (a path separator)"
                )
            kind = unix_file_type(entry)
            if kind is not None:
                raise InputError(self.path, f"member {name!r} is a {kind}, not a file")
        if WEIGHTS_MEMBER not in {entry.orig_filename for entry in entries}:
            raise InputError(self.path, f"holds no {WEIGHTS_MEMBER}")
        return entries

    def _unpack_weights(self) -> Hdf5Reader:
        """model.weights.h5 unpacked into an unnamed temp file, which HDF5 opens through
        /proc/self/fd. Without /proc (no name reopens an unnamed file) it goes to a private
        temp directory, removed by close(). A temp directory that is missing or full is
        exit 5 naming it (clipcli.system.scratch), not a fault of the archive."""
        # The HDF5 budgets are the archive's: the zip rules let the member unpack to 200
        # times the archive, and budgets taken from the member would allow 200 times that
        # again (THREAT_MODEL item 17: a 61 KB archive's gzip chunk inflated to 1 GiB).
        archive_size = os.fstat(self._handle.fileno()).st_size
        fd, nameable = scratch.unnamed_file(SCRATCH_PREFIX)
        if not nameable or fd_path(fd) is None:  # no O_TMPFILE, or no /proc to name it by
            os.close(fd)
            target = self._private_directory() / WEIGHTS_MEMBER
            fd = scratch.open_new(target)
            try:
                self._unpack_into(fd)
            finally:
                os.close(fd)
            return Hdf5Reader(target, shown_as=self.weights_name, budget_size=archive_size)
        try:
            self._unpack_into(fd)
            # HDF5 opens files by name only (and not /proc/self/fd/N of an unnamed file:
            # it resolves the link and finds no path), so the file gets a name for as long
            # as HDF5 takes to open and check it, then loses it again.
            self._private_directory()
            assert self._scratch is not None
            target = scratch.name_unnamed(fd, self._scratch, WEIGHTS_MEMBER)
            reader = Hdf5Reader(target, shown_as=self.weights_name, budget_size=archive_size)
        finally:
            os.close(fd)
        self._remove_scratch()  # HDF5 reads through its own descriptor from here on
        return reader

    def _private_directory(self) -> Path:
        """A locked private directory (clipcli.system.scratch.PrivateDirectory): one that a dead
        run left is removed by the next run, unless the archive being read lies in it."""
        self._scratch = scratch.PrivateDirectory(
            SCRATCH_PREFIX, (WEIGHTS_MEMBER,), keep=os.fstat(self._handle.fileno())
        )
        return self._scratch.path

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def _unpack_into(self, fd: int) -> None:
        entry = self.archive.getinfo(WEIGHTS_MEMBER)
        sink = _ScratchSink(fd)
        try:
            with self._open(entry) as source:
                copied = _copy_stream(source, sink, entry.file_size)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
            raise InputError(self.weights_name, f"cannot unpack: {exc}") from None
        if copied != entry.file_size:
            raise InputError(self.weights_name, "holds another size than the zip declares")

    def _open(
        self, entry: zipfile.ZipInfo
    ) -> contextlib.AbstractContextManager[BoundedMember | IO[bytes]]:
        return open_member(self.archive, self._handle.fileno(), entry)

    def _weights(self) -> Hdf5Reader:
        assert self.inner is not None
        return self.inner

    @property
    def infos(self) -> list[TensorInfo]:
        return self._weights().infos

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._weights().metadata

    @property
    def non_tensors(self) -> list[NonTensorInfo]:
        return self._weights().non_tensors

    def structure(self) -> Structure | None:
        return self._weights().structure()

    def archive_members(self) -> dict[str, str]:
        return {
            entry.filename: (
                "directory" if entry.is_dir() else f"{entry.file_size} bytes, CRC32 {entry.CRC:08x}"
            )
            for entry in self.members
            if entry.filename != WEIGHTS_MEMBER
        }

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        return self._weights().chunks(info, chunk_elems)

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]] | None:
        return self._weights().chunk_loaders(info)

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        return self._weights().elements_loader(info, start, stop)

    def read(self, info: TensorInfo) -> np.ndarray:
        return self._weights().read(info)

    def constant(self, info: TensorInfo) -> np.ndarray | None:
        return self._weights().constant(info)

    def expect_all_elements(self) -> None:
        self._weights().expect_all_elements()

    def copy_member(self, entry: zipfile.ZipInfo, sink: IO[bytes]) -> None:
        """One member's content, streamed (its CRC checked by zipfile at the end)."""
        try:
            with self._open(entry) as source:
                copied = _copy_stream(source, sink, entry.file_size)
        except (zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as exc:
            raise InputError(self.path, f"cannot read member {entry.filename!r}: {exc}") from None
        if copied != entry.file_size:
            raise InputError(self.path, f"member {entry.filename!r} has another size")

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}  # the unpacked weights are our own private copy

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None
        self._remove_scratch()
        with contextlib.suppress(AttributeError):
            self.archive.close()
        self._handle.close()


SPECIAL_MODE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


class _ScratchSink:
    """A file in the temp directory, written through clipcli.system.scratch: a failing write is
    exit 5 naming the directory, told apart from a failing read of the archive."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.position = 0

    def write(self, data: bytes) -> None:
        scratch.write_at(self.fd, data, self.position)
        self.position += len(data)


def _copy_stream(
    source: BoundedMember | IO[bytes], sink: IO[bytes] | _ScratchSink, limit: int
) -> int:
    """Copy at most limit + 1 bytes (one more shows a member longer than declared)."""
    copied = 0
    while copied <= limit:
        interrupts.check()  # a block at a time: a signal must not wait for the whole member
        block = source.read(min(COPY_BLOCK, limit + 1 - copied))
        if not block:
            break
        sink.write(block)
        copied += len(block)
    return copied


class KerasArchiveWriter(Writer):
    """The clipped weights go to a temp HDF5 file beside OUT (in the run's private work
    directory); close() then writes the archive, member by member, in the source's order."""

    format_name = "keras"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        source = checkpoint.source
        if not isinstance(source, KerasArchiveReader) or source.inner is None:
            raise ValueError("a .keras archive is written from a .keras source only")
        self._source = source
        self._weights_path = path.with_name(path.name + ".weights.h5")
        inner = Checkpoint(checkpoint.infos, checkpoint.metadata, source.inner)
        self._weights = Hdf5Writer(self._weights_path, inner, durable)

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:  # noqa: ARG003
        if source.format_name != "keras":
            return (
                f"a .keras archive is written from a .keras IN only (its config.json and "
                f"metadata.json are kept), and IN is {source.format_name}; write .h5 instead"
            )
        return None

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        return Hdf5Writer.check_dtype(info)

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        return Hdf5Writer.check_shape(info)

    @classmethod
    def check_name(cls, name: str) -> str | None:
        return Hdf5Writer.check_name(name)  # the weights are an HDF5 file

    @classmethod
    def check_names(cls, names: Sequence[str]) -> str | None:
        return Hdf5Writer.check_names(names)

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:  # noqa: ARG003
        return []  # the weights file is replicated as HDF5, object by object

    @classmethod
    def copies_constants(cls, source: Reader) -> bool:  # noqa: ARG003
        return True  # the weights file is replicated as HDF5 (Hdf5Writer.copy_unchanged)

    @classmethod
    def structure_notes(cls, source: Reader) -> list[str]:
        inner = source.inner if isinstance(source, KerasArchiveReader) else None
        return Hdf5Writer.structure_notes(inner) if inner is not None else []

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._weights.write(info, chunks)

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:  # noqa: ARG002
        inner = self._source.inner
        return inner is not None and self._weights.copy_unchanged(inner, info)

    def close(self) -> None:
        self._weights.close()
        try:
            with zipfile.ZipFile(self.path, "x", allowZip64=True) as archive:
                for entry in self._source.members:
                    self._add(archive, entry)
            if self.durable:
                with open(self.path, "rb") as written:
                    os.fsync(written.fileno())
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._weights_path)

    def _add(self, archive: zipfile.ZipFile, entry: zipfile.ZipInfo) -> None:
        copy = zipfile.ZipInfo(entry.filename, entry.date_time)
        copy.compress_type = entry.compress_type
        # A member's Unix mode without setuid, setgid and sticky (cp's rule), which
        # `unzip -K` would restore on extraction.
        copy.external_attr = entry.external_attr & ~(SPECIAL_MODE_BITS << 16)
        copy.create_system = entry.create_system
        copy.comment = entry.comment
        if entry.is_dir():
            archive.writestr(copy, b"")
            return
        size = (
            self._weights_path.stat().st_size
            if entry.filename == WEIGHTS_MEMBER
            else entry.file_size
        )
        with archive.open(copy, "w", force_zip64=size >= 0x7FFFFFFF) as sink:
            if entry.filename == WEIGHTS_MEMBER:
                with open(self._weights_path, "rb") as weights:
                    shutil.copyfileobj(weights, sink, COPY_BLOCK)
            else:
                self._source.copy_member(entry, sink)

    def abort(self) -> None:
        self._weights.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._weights_path)
