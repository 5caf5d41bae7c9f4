"""Opening a checkpoint: the reader chosen by the file's content (formats.registry
recognises it), checked against what its suffix claims; the writer chosen by OUT's suffix.
Choosing OUT itself (file or directory) is clipcli.output's job."""

from __future__ import annotations

import re
from pathlib import Path

from clipcli.errors import InputError, UsageError
from clipcli.formats import registry
from clipcli.formats.base import Reader, Writer
from clipcli.formats.registry import Format, Probe
from clipcli.system.heap import give_back_freed_memory
from clipcli.system.inputs import open_input

# What reads as a file extension: a letter first, so that a version in a directory's name
# (llama-3.2-1b, Qwen2.5-0.5B) is no extension and such an OUT may still be a directory.
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9_]*")


def format_from_extension(path: Path) -> str | None:
    """The readable format PATH's suffix claims (its name), or None."""
    found = registry.by_suffix(path.name)
    return found.name if found is not None else None


def has_extension(path: Path) -> bool:
    """Whether OUT's name ends in something that reads as a file extension, known or not."""
    return _EXTENSION.fullmatch(path.suffix) is not None


def sniff_format(path: Path) -> str:
    """The format named by the file's content (registry.FORMATS, in order); refuses a
    foreign format with its own line, and anything that is not a regular file (checked on
    the opened descriptor, opened without blocking: a FIFO never hangs us)."""
    return _recognise(path).name


def _recognise(path: Path) -> Format:
    with open_input(path) as handle:
        try:
            probe = Probe(handle)
            found = registry.recognised(probe)
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc.strerror}") from None
    if probe.zip_problem is not None:  # which format it is depends on whom one asks
        raise InputError(path, probe.zip_problem)
    if found is not None:
        if found.refusal is not None:
            npz = path.stem + ".npz"
            raise InputError(path, found.refusal.format(path=str(path), npz=npz))
        return found
    claimed = registry.by_suffix(path.name)
    if claimed is not None and claimed.claims_without_magic:
        return claimed
    if len(probe.head) < 8:
        raise InputError(path, f"file is too short ({len(probe.head)} bytes) to be a checkpoint")
    raise InputError(path, f"not an {registry.readable_labels()} file (unknown leading bytes)")


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
    reader = _opened(path, is_directory)
    # The header's temporaries (200,000 entries: ~47 MB) are freed by now; the heap keeps
    # freed memory for chunk buffers (system.heap), so give this one-off peak back.
    give_back_freed_memory()
    return reader


def _opened(path: Path, is_directory: bool) -> Reader:
    if is_directory or path.name.endswith(".index.json"):
        from clipcli.formats.sharded import ShardedReader, resolve_sharded

        resolved = resolve_sharded(path)
        if resolved is not None:
            return ShardedReader(*resolved)
    detected = _recognise(path)
    claimed = registry.by_suffix(path.name)
    if claimed is not None and claimed is not detected:
        raise InputError(path, f"extension says {claimed.name} but the content is {detected.name}")
    return detected.reader_class()(path)


def writer_class(out: Path, is_directory: bool = False) -> type[Writer]:
    """The writer for OUT: a model directory, else by OUT's extension."""
    if is_directory:
        return registry.MODEL_DIRECTORY.writer_class()
    fmt = registry.output_format(out.name)
    if fmt is None:
        raise UsageError(f"{out}: unknown output extension; use {registry.accepted_extensions()}")
    return fmt.writer_class()
