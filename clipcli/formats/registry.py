"""The one table of the formats clipcli knows, read and written or refused.

Each entry says how a file of the format is recognised (its leading bytes, or a test on
them), its suffixes, whether OUT may be one (a file, or a model directory), its reader and
writer classes by dotted name (imported on first use: start-up imports none of them), the
modules `__main__` imports up front for it, and its capabilities. A foreign format that is
refused is an entry too, with its one refusal line: a reader for it replaces that entry.

Everything that names formats derives from this table: which reader opens a file
(formats.opening), OUT's accepted extensions and the line that lists them (output), the
start-up preload (__main__), the help text (typer_app) and tests/test_startup.py.

This module is imported at start-up, before the reader: it imports nothing but the
standard library's os, and no reader, writer or numpy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO, cast

if TYPE_CHECKING:
    from clipcli.formats.base import Reader, Writer

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
NPY_MAGIC = b"\x93NUMPY"
GGUF_MAGIC = b"GGUF"
PICKLE_PROTOCOLS = tuple(bytes([0x80, n]) for n in range(2, 6))
HEAD_BYTES = 16  # what sniffing reads of every file

# Capabilities (Format.capabilities): what a format can carry, for callers and tests that
# must treat formats alike without naming them.
METADATA = "metadata"  # file-level string metadata
STREAMS = "streams"  # OUT '-' (standard output)
ONE_TENSOR = "one tensor"  # holds exactly one tensor, and no name for it
STRUCTURE = "structure"  # HDF5 groups, attributes, non-tensor datasets
ARCHIVE_MEMBERS = "archive members"  # other members of a container, kept by its own writer


class Probe:
    """What recognising a file may look at: its first HEAD_BYTES bytes, and on demand the
    member names of a zip (central directory only) or an HDF5 signature after a user block.
    Each is read once, whichever entries ask."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.head = handle.read(HEAD_BYTES)
        self._zip_names: list[str] | None = None
        self._zip_read = False
        self.zip_problem: str | None = None  # why the zip cannot be told apart, if it cannot

    @property
    def is_zip(self) -> bool:
        return self.head.startswith(ZIP_MAGICS)

    def zip_names(self) -> list[str]:
        """The zip's member names; empty when zipfile cannot parse it (the npz reader then
        says what is wrong)."""
        if not self._zip_read:
            self._zip_read = True
            import zipfile  # only for zips: 4 ms (with shutil, bz2, lzma) safetensors never needs

            from clipcli.formats.zipsafe import end_record_problem

            try:
                with zipfile.ZipFile(self.handle) as archive:
                    self._zip_names = archive.namelist()
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError):
                self._zip_names = None  # RuntimeError: NotImplementedError, unknown zip version
            try:  # two end records: zipfile's member list (or failure) is one reading of two
                self.zip_problem = end_record_problem(self.handle.fileno())
            except OSError:
                self.zip_problem = None  # the reader says what cannot be read
        return self._zip_names or []

    def hdf5_after_user_block(self) -> bool:
        """Whether the HDF5 signature sits at 512, 1024, 2048, ... bytes, where the library
        looks for it after a user block (the file's own size bounds the search)."""
        fd = self.handle.fileno()
        size = os.fstat(fd).st_size
        offset = 512
        while offset + len(HDF5_MAGIC) <= size:
            if os.pread(fd, len(HDF5_MAGIC), offset) == HDF5_MAGIC:
                return True
            offset *= 2
        return False


Recognise = Callable[[Probe], bool]


class Format:
    """One entry of the table. (A plain class: dataclasses would import inspect, ~4 ms of
    every start-up.)"""

    __slots__ = (
        "capabilities",
        "claims_without_magic",
        "directory",
        "label",
        "late",
        "name",
        "output",
        "preload",
        "reader",
        "recognise",
        "refusal",
        "shards",
        "suffixes",
        "writer",
    )

    def __init__(
        self,
        name: str,
        *,
        label: str,
        suffixes: tuple[str, ...] = (),
        recognise: Recognise | None = None,
        late: Recognise | None = None,
        claims_without_magic: bool = False,
        reader: str | None = None,
        writer: str | None = None,
        output: bool = False,
        directory: bool = False,
        preload: tuple[str, ...] = (),
        capabilities: frozenset[str] = frozenset(),
        refusal: str | None = None,
        shards: str | None = None,
    ) -> None:
        self.name = name  # Reader.format_name / Writer.format_name
        self.label = label  # how messages name it
        self.suffixes = suffixes  # lower case, with the dot; the first is the usual one
        self.recognise = recognise  # from the leading bytes (and zip member names)
        self.late = late  # costlier tests, tried only when no entry's `recognise` matched
        # A file of this suffix that no entry recognises goes to this reader anyway: the
        # format has no magic, and its own parser says precisely what is wrong.
        self.claims_without_magic = claims_without_magic
        self.reader = reader  # "package.module:Class", imported on first use
        self.writer = writer
        self.output = output  # OUT may be a file of this format (by its suffix)
        self.directory = directory  # a model directory, not a file
        self.preload = preload  # imported by __main__ before the command, for such a path
        self.capabilities = capabilities
        # A foreign format: why clipcli refuses it, and what to do; {path} and {npz} (the
        # file's name with .npz for its suffix) are filled in.
        self.refusal = refusal
        self.shards = shards  # a directory format: the name of its shards' file format

    @property
    def readable(self) -> bool:
        return self.reader is not None

    def reader_class(self) -> type[Reader]:
        assert self.reader is not None, f"{self.name} has no reader"
        return cast("type[Reader]", _load(self.reader))

    def writer_class(self) -> type[Writer]:
        assert self.writer is not None, f"{self.name} has no writer"
        return cast("type[Writer]", _load(self.writer))

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


def _load(dotted: str) -> Any:
    module, _, attribute = dotted.partition(":")
    return getattr(__import__(module, fromlist=[attribute]), attribute)


# ---------------------------------------------------------------- recognising


def _pytorch_zip(probe: Probe) -> bool:
    """torch.save since 1.6: a zip with <top folder>/data.pkl."""
    return probe.is_zip and any(
        n == "data.pkl" or n.endswith("/data.pkl") for n in probe.zip_names()
    )


def _keras_zip(probe: Probe) -> bool:
    """Keras 3: config.json, metadata.json and model.weights.h5 in a zip."""
    if not probe.is_zip or _pytorch_zip(probe):
        return False
    names = probe.zip_names()
    return "model.weights.h5" in names and "config.json" in names


def _npz_zip(probe: Probe) -> bool:
    """Any other zip, one zipfile cannot parse included (the npz reader says why)."""
    return probe.is_zip and not _pytorch_zip(probe) and not _keras_zip(probe)


def _safetensors_head(probe: Probe) -> bool:
    # An 8-byte header length, then the JSON header's '{'. (The .npy magic read as a length
    # is ~10**14 bytes: never a safetensors file, so a .npy header of 123 bytes is a .npy.)
    head = probe.head
    return len(head) >= 9 and head[8:9] == b"{" and not head.startswith(NPY_MAGIC)


def _starts(*magics: bytes) -> Recognise:
    return lambda probe: probe.head.startswith(magics)


TAR_BLOCK = 512
_TAR_CHECKSUM = slice(148, 156)


def is_tar_header(block: bytes) -> bool:
    """A tar's first header block, ustar or the older V7 (torch's legacy tar layout; V7 has
    no 'ustar' magic at 257, and Python's tarfile and torch.load read it): recognised by
    its checksum, the octal number at 148..156 that equals the sum of the block's bytes
    with those 8 counted as spaces, as unsigned or as signed bytes (tarfile accepts both)."""
    if len(block) < TAR_BLOCK:
        return False
    field = block[_TAR_CHECKSUM].split(b"\0", 1)[0].strip(b" ")
    if not field or any(digit not in b"01234567" for digit in field):
        return False
    stored = int(field, 8)
    header = bytearray(block[:TAR_BLOCK])
    header[_TAR_CHECKSUM] = b" " * 8
    unsigned = sum(header)
    signed = unsigned - 256 * sum(1 for byte in header if byte >= 0x80)
    return stored in (unsigned, signed)


def _tar(probe: Probe) -> bool:
    return is_tar_header(os.pread(probe.handle.fileno(), TAR_BLOCK, 0))


def _hdf5_user_block(probe: Probe) -> bool:
    return probe.hdf5_after_user_block()


# ---------------------------------------------------------------- the table

# Recognition tries the entries in this order and the first match wins; it matters only
# where tests overlap: safetensors before the pickle and GGUF entries (a header length may
# begin 80 02..80 05, which looks like a pickle's opening). Messages list formats in it.
FORMATS: tuple[Format, ...] = (
    Format(
        "npz",
        label="npz",
        suffixes=(".npz",),
        recognise=_npz_zip,
        reader="clipcli.formats.npz:NpzReader",
        writer="clipcli.formats.npz:NpzWriter",
        output=True,
        preload=("clipcli.formats.npz",),
    ),
    Format(
        "safetensors",
        label="safetensors",
        suffixes=(".safetensors",),
        recognise=_safetensors_head,
        claims_without_magic=True,
        reader="clipcli.formats.safetensors:SafetensorsReader",
        writer="clipcli.formats.safetensors:SafetensorsWriter",
        output=True,
        preload=("clipcli.formats.safetensors",),
        capabilities=frozenset({METADATA, STREAMS}),
    ),
    Format(
        "hdf5",
        label="HDF5",
        suffixes=(".h5", ".hdf5"),
        recognise=_starts(HDF5_MAGIC),
        late=_hdf5_user_block,
        reader="clipcli.formats.hdf5:Hdf5Reader",
        writer="clipcli.formats.hdf5:Hdf5Writer",
        output=True,
        preload=("clipcli.formats.hdf5",),
        capabilities=frozenset({METADATA, STRUCTURE}),
    ),
    Format(
        "keras",
        label=".keras",
        suffixes=(".keras",),
        recognise=_keras_zip,
        reader="clipcli.formats.keras_archive:KerasArchiveReader",
        writer="clipcli.formats.keras_archive:KerasArchiveWriter",
        output=True,
        preload=("clipcli.formats.hdf5",),
        capabilities=frozenset({METADATA, STRUCTURE, ARCHIVE_MEMBERS}),
    ),
    Format(
        "npy",
        label=".npy",
        suffixes=(".npy",),
        recognise=_starts(NPY_MAGIC),
        reader="clipcli.formats.npy:NpyReader",
        writer="clipcli.formats.npy:NpyWriter",
        output=True,
        preload=("clipcli.formats.npy",),
        capabilities=frozenset({ONE_TENSOR}),
    ),
    Format(
        "pytorch",
        label="PyTorch",
        suffixes=(".pt", ".pth", ".bin"),
        # The zip layout (torch >= 1.6) and the legacy pickle stream by their first bytes;
        # the legacy tar only when nothing else matched. Read with an allow-list, never
        # unpickled (formats/pytorch/unpickler.py).
        recognise=lambda probe: _pytorch_zip(probe) or probe.head.startswith(PICKLE_PROTOCOLS),
        late=_tar,
        reader="clipcli.formats.pytorch:PyTorchReader",
        # A state dict in the zip layout, as torch.save writes it (the pickle written by
        # us over the same globals): torch.load(weights_only=True) accepts it.
        writer="clipcli.formats.pytorch:PyTorchWriter",
        output=True,
        preload=("clipcli.formats.pytorch",),
    ),
    Format(
        "gguf",
        label="GGUF",
        suffixes=(".gguf",),
        recognise=_starts(GGUF_MAGIC),
        reader="clipcli.formats.gguf:GgufReader",
        writer="clipcli.formats.gguf.writer:GgufWriter",
        output=True,
        preload=("clipcli.formats.gguf",),
    ),
)

# A Hugging Face model directory: safetensors shards and an index, read as one checkpoint.
MODEL_DIRECTORY = Format(
    "safetensors-sharded",
    label="model directory",
    reader="clipcli.formats.sharded:ShardedReader",
    writer="clipcli.formats.sharded:ShardedWriter",
    output=True,
    directory=True,
    preload=("clipcli.formats.sharded", "clipcli.formats.safetensors"),
    capabilities=frozenset({METADATA}),
    shards="safetensors",
)

# A model directory of PyTorch shards (pytorch_model.bin, or pytorch_model-0000N-of-0000M.bin
# and pytorch_model.bin.index.json), read as one checkpoint; written as MODEL_DIRECTORY
# (safetensors shards and index). Where both are present, MODEL_DIRECTORY's files are read.
PYTORCH_DIRECTORY = Format(
    "pytorch-sharded",
    label="model directory of PyTorch shards",
    reader="clipcli.formats.sharded:ShardedReader",
    directory=True,
    preload=("clipcli.formats.sharded", "clipcli.formats.pytorch"),
    shards="pytorch",
)

BY_NAME = {f.name: f for f in (*FORMATS, MODEL_DIRECTORY, PYTORCH_DIRECTORY)}
# The readable formats by suffix (a refused one's suffixes decide nothing: a `.bin` that
# holds safetensors is read as safetensors).
BY_SUFFIX = {suffix: f for f in FORMATS if f.readable for suffix in f.suffixes}
OUTPUT_SUFFIXES = {suffix: f for f in FORMATS if f.output for suffix in f.suffixes}


def by_suffix(name: str) -> Format | None:
    """The readable format a file name's suffix claims, or None."""
    return BY_SUFFIX.get(os.path.splitext(name)[1].lower())


def recognised(probe: Probe) -> Format | None:
    """The entry the file's content names: the first whose `recognise` matches, else the
    first whose costlier `late` test does (a refused format's entry included)."""
    found = next((f for f in FORMATS if f.recognise and f.recognise(probe)), None)
    if found is None:
        found = next((f for f in FORMATS if f.late and f.late(probe)), None)
    return found


def output_format(name: str) -> Format | None:
    """The format of an OUT file of this name (by its suffix), or None."""
    return OUTPUT_SUFFIXES.get(os.path.splitext(name)[1].lower())


def shard_format(directory_format: Format = MODEL_DIRECTORY) -> Format:
    """The file format of a directory format's shards."""
    assert directory_format.shards is not None
    return BY_NAME[directory_format.shards]


def _listed(items: list[str], last: str = "or") -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def accepted_extensions() -> str:
    """OUT's accepted file extensions, as the line that refuses another one lists them."""
    return _listed(list(OUTPUT_SUFFIXES))


def readable_labels() -> str:
    """The file formats clipcli reads, for the line that refuses unknown bytes."""
    return _listed([f.label for f in FORMATS if f.readable])


def readable_suffixes_text() -> str:
    """The file suffixes clipcli reads, for the help text: '.h5/.hdf5' for one format."""
    return ", ".join("/".join(f.suffixes) for f in FORMATS if f.readable)


def preload_for_path(name: str) -> tuple[str, ...]:
    """The modules a path of this name needs at start-up, by suffix; every format's for an
    unknown one (the content decides)."""
    found = by_suffix(name)
    return found.preload if found is not None else every_preload()


def every_preload() -> tuple[str, ...]:
    """Every readable format's modules, the model directory's too, each once."""
    modules = [m for f in (*FORMATS, MODEL_DIRECTORY) if f.readable for m in f.preload]
    return tuple(dict.fromkeys(modules))
