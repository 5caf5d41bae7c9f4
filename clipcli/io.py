"""Format detection, reader/writer lookup, and atomic output files."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import BinaryIO

from clipcli.errors import ExitCode, InputError, Interrupted, UsageError, WriteError
from clipcli.formats.base import Reader, Writer
from clipcli.inputs import open_input

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
EXTENSIONS = {".npz": "npz", ".safetensors": "safetensors", ".h5": "hdf5", ".hdf5": "hdf5"}


def format_from_extension(path: Path) -> str | None:
    return EXTENSIONS.get(path.suffix.lower())


def sniff_format(path: Path) -> str:
    """The format named by the file's first bytes; refuses anything that is not a regular file
    (checked on the opened descriptor, opened without blocking: a FIFO never hangs us)."""
    with open_input(path) as handle:
        try:
            head = handle.read(16)
            if head.startswith(HDF5_MAGIC):
                return "hdf5"
            if head.startswith(ZIP_MAGICS):
                return "npz"
            if len(head) >= 9 and head[8:9] == b"{":
                return "safetensors"
            # HDF5 allows a user block of 512, 1024, 2048, ... bytes before the superblock.
            if _hdf5_after_user_block(handle):
                return "hdf5"
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc.strerror}") from None
    if format_from_extension(path) == "safetensors":
        # safetensors has no magic; its own parser says precisely what is wrong.
        return "safetensors"
    if len(head) < 8:
        raise InputError(path, f"file is too short ({len(head)} bytes) to be a checkpoint")
    raise InputError(path, "not an npz, safetensors or HDF5 file (unknown leading bytes)")


def _hdf5_after_user_block(handle: BinaryIO) -> bool:
    """Whether the HDF5 signature sits at 512, 1024, 2048, ... bytes, where the library looks
    for it after a user block (the file's own size bounds the search)."""
    size = os.fstat(handle.fileno()).st_size
    offset = 512
    while offset + len(HDF5_MAGIC) <= size:
        if os.pread(handle.fileno(), len(HDF5_MAGIC), offset) == HDF5_MAGIC:
            return True
        offset *= 2
    return False


def open_reader(path: Path) -> Reader:
    """Open a checkpoint by its content; an extension that disagrees with it is an error.

    A directory (or a *.safetensors.index.json) is a Hugging Face model directory."""
    if path.is_dir() or path.name.endswith(".index.json"):
        from clipcli.formats.sharded import ShardedReader, resolve_sharded

        resolved = resolve_sharded(path)
        if resolved is not None:
            return ShardedReader(*resolved)
    detected = sniff_format(path)
    claimed = format_from_extension(path)
    if claimed is not None and claimed != detected:
        raise InputError(path, f"extension says {claimed} but the content is {detected}")
    return reader_class(detected)(path)


def reader_class(fmt: str) -> type[Reader]:
    # Imported on demand so that `clipcli --help` does not load h5py or safetensors.
    if fmt == "safetensors":
        from clipcli.formats.safetensors import SafetensorsReader

        return SafetensorsReader
    if fmt == "npz":
        from clipcli.formats.npz import NpzReader

        return NpzReader
    from clipcli.formats.hdf5 import Hdf5Reader

    return Hdf5Reader


def writer_class(out: Path) -> type[Writer]:
    fmt = format_from_extension(out)
    if fmt == "safetensors":
        from clipcli.formats.safetensors import SafetensorsWriter

        return SafetensorsWriter
    if fmt == "npz":
        from clipcli.formats.npz import NpzWriter

        return NpzWriter
    if fmt == "hdf5":
        from clipcli.formats.hdf5 import Hdf5Writer

        return Hdf5Writer
    raise UsageError(f"{out}: unknown output extension; use .npz, .safetensors, .h5 or .hdf5")


def check_output_path(src: Path, out: Path, force: bool) -> None:
    """Refuse OUT == IN (by path, symlink or hard link) and an existing OUT without --force."""
    if out.is_dir():
        raise UsageError(f"{out}: is a directory")
    try:
        out_stat = out.stat()
    except FileNotFoundError:
        out_stat = None
    except OSError as exc:
        raise UsageError(f"{out}: cannot check output path: {exc.strerror}") from None
    if out_stat is not None:
        src_stat = src.stat()
        if (out_stat.st_dev, out_stat.st_ino) == (src_stat.st_dev, src_stat.st_ino):
            raise UsageError(f"{out}: output is the input file; choose another OUT")
        if not force:
            raise UsageError(f"{out}: already exists; pass --force to replace it")
    if out.is_symlink() and not force:
        raise UsageError(f"{out}: already exists (dangling symlink); pass --force to replace it")
    if not out.parent.is_dir():
        raise WriteError(f"{out}: directory {out.parent} does not exist")


def _new_file_mode(existing: Path) -> int:
    """Keep an existing OUT's mode; a new file gets 0o666 & ~umask like any shell redirect."""
    try:
        return stat.S_IMODE(existing.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM into an exception so that the temp file is removed, as for Ctrl-C."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted("terminated by SIGTERM; no output written", ExitCode.TERMINATED)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged_output(
    out: Path, tmp: Path, finish: Callable[[], None], discard: Callable[[], None]
) -> Iterator[Path]:
    """Run the body on `tmp`, then `finish()` it into place as OUT.

    On any exception (Ctrl-C and SIGTERM included) `discard()` removes what was staged and
    OUT is left as it was; OSErrors become WriteError (exit 5), interrupts Interrupted.
    """
    try:
        with signals_raise():
            yield tmp
            finish()
    except KeyboardInterrupt:
        discard()
        raise Interrupted("interrupted; no output written") from None
    except OSError as exc:
        discard()
        reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise WriteError(f"{out}: writing failed: {reason}; no output written") from None
    except BaseException:
        discard()
        raise


@contextlib.contextmanager
def atomic_output(out: Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temp path beside OUT; on success fsync it and rename it over OUT.

    durable=False skips the fsyncs (the rename stays atomic, but a power cut soon after
    may leave an empty OUT); it is for scratch outputs where speed matters more.
    """
    directory = out.parent if str(out.parent) else Path(".")
    mode = _new_file_mode(out)
    try:
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{out.name}.", suffix=".clipcli-tmp", dir=directory
        )
    except OSError as exc:
        raise WriteError(f"{out}: cannot create a file in {directory}: {exc.strerror}") from None
    tmp = Path(tmp_name)

    def finish() -> None:
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, out)
        if durable:
            fsync_dir(directory)

    try:
        os.close(fd)
        with staged_output(out, tmp, finish, lambda: _remove(tmp)) as path:
            yield path
    except KeyboardInterrupt:  # arrived between mkstemp and the staged write
        _remove(tmp)
        raise Interrupted("interrupted; no output written") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
