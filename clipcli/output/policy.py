"""Output policy: what OUT must be before anything is written. The writer for OUT and its
limits, OUT against the input, a model directory's side files, what OUT cannot hold of
the input (refused unless --allow-lossy). No data is read here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from clipcli.errors import InputError, UsageError
from clipcli.formats.base import Reader, Writer

if TYPE_CHECKING:
    from clipcli.output.target import Target

Notify = Callable[[str, str], None]


def check_writable(reader: Reader, target: Target) -> type[Writer]:
    """The writer for OUT, once every limit of its format that is known before writing
    holds (names, dtypes, names together, metadata): a refusal is exit 2 naming the tensor
    or key, before anything is created."""
    cls = target.writer_class()
    for info, problem in cls.tensor_problems(reader.infos):
        raise UsageError(f"{target.out}: tensor {info.name!r}: {problem}")
    reason = cls.check_names([info.name for info in reader.infos]) or cls.check_metadata(
        output_metadata(reader, target.is_directory), reader
    )
    if reason is not None:
        raise UsageError(f"{target.out}: {reason}")
    return cls


def output_metadata(reader: Reader, to_directory: bool) -> dict[str, str]:
    return dict(reader.metadata) if to_directory else reader.joined_metadata()


SIDE_FILE_LIMIT = 1 << 30  # bytes: configs and tokenizers are far smaller
# All side files together (a model's configs and tokenizers are tens of files and MBs):
# the per-file limit alone lets 100,000 files of 1 GiB through.
SIDE_FILES_MAX_COUNT = 10_000
SIDE_FILES_MAX_BYTES = 4 << 30


def check_side_files(reader: Reader, allow_large: bool) -> None:
    """A model directory's other files are copied; one of absurd size is refused unless
    allowed, since a sparse 1 TB file would otherwise fill the disk; so are too many or too
    many bytes in all (exit 3), and a hard link with a name outside the directory (exit 3)."""
    if linked := reader.side_files_linked_elsewhere():
        path, links = linked[0]
        raise InputError(
            path,
            f"is a hard link with {links} names, some outside the model directory, so it may "
            "be any file of yours; not copied (copy the directory without hard links)",
        )
    opened = reader.source_identities()  # the files the copy will read, not the names now
    side_files = reader.side_files()
    if len(side_files) > SIDE_FILES_MAX_COUNT:
        raise InputError(
            reader.path,
            f"has {len(side_files)} other files to copy beside the weights; "
            f"at most {SIDE_FILES_MAX_COUNT} are copied",
        )
    if allow_large:
        return
    for path in side_files:
        size = opened[path].size
        if size > SIDE_FILE_LIMIT:
            raise UsageError(
                f"{path}: side file of {size} bytes is over the {SIDE_FILE_LIMIT >> 30} GiB "
                "limit for files copied beside the weights; pass --allow-large-side-files"
            )
    total = sum(opened[path].size for path in side_files)
    if total > SIDE_FILES_MAX_BYTES:  # a refusal the flag lifts, as for one large file
        raise UsageError(
            f"{reader.path}: its other files hold {total} bytes together, over the "
            f"{SIDE_FILES_MAX_BYTES >> 30} GiB copied beside the weights; "
            "pass --allow-large-side-files",
        )


def target_for(src: Path, out: str | Path, force: bool, durable: bool) -> Target:
    from clipcli.output.stream_target import STDOUT, StdoutTarget
    from clipcli.output.target import choose_target  # WRITING_MODULES

    if str(out) == STDOUT:  # safetensors streamed to standard output (stream_target)
        return StdoutTarget(force=force, durable=durable)
    is_directory = src.is_dir() or src.name.endswith(".index.json")
    return choose_target(out, input_is_directory=is_directory, force=force, durable=durable)


def check_target(
    reader: Reader, writer_cls: type[Writer], target: Target, allow_large_side_files: bool
) -> None:
    """Everything about OUT that is refused before any tensor data is read: OUT against
    the input (never IN, inside it or around it), what is in the way at OUT, side files."""
    from clipcli.system.footprint import InputFootprint  # WRITING_MODULES

    footprint = InputFootprint(reader.path, reader.source_files())
    target.check(footprint, writer_cls.output_names(reader))
    if target.is_directory:
        check_side_files(reader, allow_large_side_files)


def files_beside_weights(reader: Reader) -> list[str]:
    """A model directory's files that are neither its shards nor its index (config,
    tokenizer, weights in other forms), relative to it: none of them goes into one file."""
    directory = reader.model_directory
    if directory is None:
        return []
    copied = [path.relative_to(directory).as_posix() for path in reader.side_files()]
    return copied + [where for where, _ in reader.left_out_entries()]


def check_losses(losses: Sequence[str], allow_lossy: bool, notify: Notify, out: object) -> None:
    """What OUT cannot hold: refused (exit 2) unless --allow-lossy, then one warning line."""
    if not losses:
        return
    text = "; ".join(losses)
    if not allow_lossy:
        raise UsageError(f"{out}: cannot hold {text}; pass --allow-lossy to write it without them")
    notify("warning", f"dropped from {out}: {text}")
