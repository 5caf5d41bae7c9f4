"""Writing a model directory: the source's shards, a fresh index and its other files."""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from clipcli.formats.base import Checkpoint, Reader, Shard, TensorInfo, Writer
from clipcli.formats.safetensors.header import header_problem
from clipcli.formats.safetensors.writer import SafetensorsWriter, with_structure
from clipcli.formats.sharded.layout import (
    FORMAT_NAME,
    MAX_INDEX_BYTES,
    SHARD_FORMAT,
    SHARD_SUFFIX,
    SINGLE_FILE_NAME,
    as_safetensors_name,
)
from clipcli.system.filecopy import copy_side_file

# The shards' writer, as the registry names it (its header and structure helpers above are
# the safetensors writer's own: the type says so).
_SHARD_WRITER = cast("type[SafetensorsWriter]", SHARD_FORMAT.writer_class())


def plan_shards(checkpoint: Checkpoint) -> list[Shard]:
    """The source directory's shards (names, tensors, __metadata__), or one
    model.safetensors when the source is a single file."""
    layout = checkpoint.layout
    if layout is None:
        return [Shard(SINGLE_FILE_NAME, list(checkpoint.infos), checkpoint.metadata)]
    shard_of = {info.name: shard.name for shard in layout.shards for info in shard.infos}
    metadata = {shard.name: shard.metadata for shard in layout.shards}
    grouped: dict[str, list[TensorInfo]] = {}
    previous: str | None = None
    for info in checkpoint.infos:
        shard = shard_of[info.name]
        # Shards are written one after another, so their tensors must arrive together.
        if shard != previous and shard in grouped:
            raise ValueError(f"tensor {info.name!r}: tensors of shard {shard!r} are not adjacent")
        grouped.setdefault(shard, []).append(info)
        previous = shard
    # PyTorch shards are written as safetensors, under transformers' names for them.
    return [
        Shard(as_safetensors_name(shard), infos, metadata[shard])
        for shard, infos in grouped.items()
    ]


def output_names(source: Reader | None) -> frozenset[str]:
    """Every path (relative, '/'-separated) the writer puts into an output directory for
    this source: shards, index, side files and the folders that hold them."""
    checkpoint = Checkpoint(list(source.infos) if source else [], {}, source)
    names = {shard.name for shard in plan_shards(checkpoint)}
    layout = checkpoint.layout
    if layout is None:
        return frozenset(names)
    if layout.index_name is not None:
        names.add(as_safetensors_name(layout.index_name))
    for path in [*layout.side_folders, *layout.side_files]:
        names.add(path.relative_to(layout.root).as_posix())
    return frozenset(names)


class ShardedWriter(Writer):
    """Fills an existing empty directory: the source's shards, a fresh index, and the source
    directory's other files; or one model.safetensors when the source is a single file.

    Each shard is a SafetensorsWriter, opened when its first tensor arrives and closed when
    the next shard starts, so one output file is open at a time; or, through parts(), the
    shards are written apart, several at once, each by its own writer (one per thread).
    """

    format_name = FORMAT_NAME

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        self.check_tensors(checkpoint.infos)
        if not path.is_dir():
            raise ValueError(f"{path}: ShardedWriter needs an existing directory")
        self._plans = plan_shards(checkpoint)
        self._shard_number = {
            info.name: number for number, plan in enumerate(self._plans) for info in plan.infos
        }
        self._order = [info for plan in self._plans for info in plan.infos]
        self._written = 0  # tensors done, in arrival order
        self._open_number = -1  # the shard being written
        self._current: SafetensorsWriter | None = None
        # Shards written apart (parts()): those open, and how many were finished.
        self._apart: dict[int, SafetensorsWriter] = {}
        self._parts_finished = 0
        self._parts_lock = threading.Lock()

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        return _SHARD_WRITER.check_dtype(info)

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        return _SHARD_WRITER.check_shape(info)

    @classmethod
    def check_name(cls, name: str) -> str | None:
        return _SHARD_WRITER.check_name(name)

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        """Each shard must read back as the safetensors file it is (header_problem), under a
        plain *.safetensors name, and the fresh index within the size the reader allows."""
        checkpoint = Checkpoint(list(source.infos), metadata, source)
        plans = plan_shards(checkpoint)
        for plan in plans:
            name = plan.name
            if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
                return f"shard {name!r} is not a plain file name"
            if not name.endswith(SHARD_SUFFIX):
                return f"shard {name!r} does not end in {SHARD_SUFFIX}"
            problem = header_problem(
                plan.infos, with_structure(Checkpoint(plan.infos, plan.metadata, source))
            )
            if problem is not None:
                return f"shard {name!r}: {problem}"
        layout = checkpoint.layout
        if layout is not None and layout.index_name is not None:
            size = len(index_text(layout.index_document or {}, plans).encode("utf-8"))
            if size > MAX_INDEX_BYTES:
                return (
                    f"the index {layout.index_name!r} would be {size} bytes, over the "
                    f"{MAX_INDEX_BYTES} that clipcli reads"
                )
        return None

    @classmethod
    def output_names(cls, source: Reader) -> frozenset[str]:
        return output_names(source)

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._shard_writer(info).write(info, chunks)
        self._written += 1

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:
        """Kernel copy from the source's stored bytes; False (the caller streams) where the
        source does not store them as safetensors does."""
        copied = self._shard_writer(info).copy_unchanged(source, info)
        if copied:
            self._written += 1
        return copied

    def parts(self) -> list[list[TensorInfo]] | None:
        """The shards' tensors, shard by shard, before any tensor was written in order."""
        if self._written or self._current is not None:
            return None
        return [list(plan.infos) for plan in self._plans]

    def part_writer(self, number: int) -> Writer:
        """Shard `number`'s own writer: the file that writing in order would make, with the
        same bytes (the same header and tensors), written by one thread."""
        plan = self._plans[number]
        shard_checkpoint = Checkpoint(plan.infos, plan.metadata, self.checkpoint.source)
        writer = _SHARD_WRITER(self.path / plan.name, shard_checkpoint, self.durable)
        with self._parts_lock:
            self._apart[number] = writer
        return writer

    def close_part(self, number: int) -> None:
        with self._parts_lock:
            writer = self._apart[number]
        writer.close()
        with self._parts_lock:
            del self._apart[number]
            self._parts_finished += 1
            self._written += len(self._plans[number].infos)

    def close(self) -> None:
        if self._written != len(self._order):
            raise ValueError(f"close() after {self._written} of {len(self._order)} tensors")
        if self._parts_finished:  # written apart: every shard is done
            if self._parts_finished != len(self._plans):
                shards = f"{self._parts_finished} of {len(self._plans)} shards"
                raise ValueError(f"close() after {shards}")
        else:
            while self._open_number < len(self._plans) - 1:  # a checkpoint without tensors
                self._start_shard(self._open_number + 1)
            self._finish_shard()
        layout = self.checkpoint.layout
        if layout is not None:
            if layout.index_name is not None:
                index_name = as_safetensors_name(layout.index_name)
                self._write_index(layout.index_document or {}, index_name)
            for folder in layout.side_folders:
                # cp -r: the source folder's bits (owner rwx to fill it), umask and the
                # setgid a setgid parent passes on applied by mkdir, never setuid/setgid
                mode = (stat.S_IMODE(folder.lstat().st_mode) | stat.S_IRWXU) & 0o1777
                (self.path / folder.relative_to(layout.root)).mkdir(mode=mode)
            for file in layout.side_files:  # links followed (inside the roots): real files out
                with layout.open_side_file(file) as handle:
                    destination = self.path / file.relative_to(layout.root)
                    copy_side_file(handle.fileno(), file, destination)

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None
        with self._parts_lock:
            apart, self._apart = list(self._apart.values()), {}
        for writer in apart:
            writer.abort()

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
        self._current = _SHARD_WRITER(self.path / plan.name, shard_checkpoint, self.durable)
        self._open_number = number

    def _finish_shard(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def _write_index(self, document: dict[str, Any], index_name: str) -> None:
        text = index_text(document, self._plans)
        (self.path / index_name).write_text(text, encoding="utf-8")


def index_text(document: Mapping[str, Any], plans: list[Shard]) -> str:
    """The source index with a recomputed total_size and this weight map, written the way
    transformers' save_pretrained does (indent 2, sorted keys)."""
    written = dict(document)
    metadata = dict(written.get("metadata", {}))
    metadata["total_size"] = sum(info.nbytes for plan in plans for info in plan.infos)
    written["metadata"] = metadata
    written["weight_map"] = {info.name: plan.name for plan in plans for info in plan.infos}
    return json.dumps(written, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
