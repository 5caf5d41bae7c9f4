"""Format detection and reader/writer lookup (OUT itself is clipcli.output.target's job)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO

from clipcli.errors import InputError, UsageError
from clipcli.formats.base import Reader, Writer
from clipcli.system.inputs import open_input

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
EXTENSIONS = {
    ".npz": "npz",
    ".safetensors": "safetensors",
    ".h5": "hdf5",
    ".hdf5": "hdf5",
    ".keras": "keras",
}


ACCEPTED_EXTENSIONS = ".npz, .safetensors, .h5, .hdf5 or .keras"
# What reads as a file extension: a letter first, so that a version in a directory's name
# (llama-3.2-1b, Qwen2.5-0.5B) is no extension and such an OUT may still be a directory.
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9_]*")


def format_from_extension(path: Path) -> str | None:
    return EXTENSIONS.get(path.suffix.lower())


def has_extension(path: Path) -> bool:
    """Whether OUT's name ends in something that reads as a file extension, known or not."""
    return _EXTENSION.fullmatch(path.suffix) is not None


def sniff_format(path: Path) -> str:
    """The format named by the file's first bytes; refuses anything that is not a regular file
    (checked on the opened descriptor, opened without blocking: a FIFO never hangs us)."""
    with open_input(path) as handle:
        try:
            head = handle.read(16)
            if head.startswith(HDF5_MAGIC):
                return "hdf5"
            if head.startswith(ZIP_MAGICS):
                return _zip_format(handle)
            # safetensors before the foreign magics: its 8-byte header length may itself
            # begin 80 02..80 05 (640, 896, ... bytes), which looks like a pickle's opening.
            if len(head) >= 9 and head[8:9] == b"{":
                return "safetensors"
            _refuse_foreign_magic(path, head)
            # PyTorch: a legacy pickle stream or tar (the zip layout is told by _zip_format)
            if head.startswith(PICKLE_PROTOCOLS) or os.pread(handle.fileno(), 5, 257) == b"ustar":
                return "pytorch"
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


NPY_MAGIC = b"\x93NUMPY"
PICKLE_PROTOCOLS = tuple(bytes([0x80, n]) for n in range(2, 6))


def _refuse_foreign_magic(path: Path, head: bytes) -> None:
    """Checkpoints of other tools, named for what they are, instead of 'unknown bytes'."""
    if head.startswith(b"GGUF"):
        raise InputError(
            path,
            "is a GGUF file (llama.cpp), which clipcli does not read; "
            "clip the safetensors weights it was made from instead",
        )
    if head.startswith(NPY_MAGIC):
        # One array, no names: not a checkpoint. (Reading it is a format of its own, to come.)
        raise InputError(
            path,
            "is a single .npy array, not a checkpoint; clipcli reads .npz: save it as one "
            f"with numpy, e.g. np.savez({path.stem + '.npz'!r}, weight=np.load({str(path)!r}))",
        )


def _zip_format(handle: BinaryIO) -> str:
    """npz, a Keras 3 .keras archive (config.json, metadata.json, model.weights.h5) or a
    PyTorch >= 1.6 checkpoint (<top>/data.pkl). Only the central directory is
    read; a zip it cannot parse is left to the npz reader to refuse."""
    import zipfile  # only for zips: 4 ms (with shutil, bz2, lzma) a safetensors run never needs

    try:
        with zipfile.ZipFile(handle) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError):
        return "npz"  # RuntimeError: NotImplementedError for an unknown zip version
    if any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        return "pytorch"
    if "model.weights.h5" in names and "config.json" in names:
        return "keras"
    return "npz"


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
    if str(path) == "-":  # a pipe into `norms -` would otherwise be "no such file"
        raise UsageError(
            "-: reading a checkpoint from standard input is not supported ('-' is only OUT, "
            "for clip and convert); write it to a file first and name that file"
        )
    try:
        is_directory = path.is_dir()
    except OSError as exc:  # pathlib passes on EACCES (a parent not to be entered), ENAMETOOLONG
        raise InputError(path, f"cannot read: {exc.strerror}") from None
    if is_directory or path.name.endswith(".index.json"):
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
    if fmt == "keras":
        from clipcli.formats.keras_archive import KerasArchiveReader

        return KerasArchiveReader
    if fmt == "pytorch":  # read only, its pickle interpreted over an allow-list
        from clipcli.formats.pytorch import PyTorchReader

        return PyTorchReader
    from clipcli.formats.hdf5 import Hdf5Reader

    return Hdf5Reader


def writer_class(out: Path, is_directory: bool = False) -> type[Writer]:
    """The writer for OUT: a model directory, else by OUT's extension."""
    if is_directory:
        from clipcli.formats.sharded import ShardedWriter

        return ShardedWriter
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
    if fmt == "keras":
        from clipcli.formats.keras_archive import KerasArchiveWriter

        return KerasArchiveWriter
    raise UsageError(f"{out}: unknown output extension; use {ACCEPTED_EXTENSIONS}")
