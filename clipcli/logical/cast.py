"""CastReader: what `convert --dtype` writes, served as a Reader to the ordinary write path.

Its tensors are the logical tensors of the reader it wraps (a LogicalReader: quantized
weights as the weights they stand for, `X.weight`, their real values; or a plain reader's
own tensors), each real float tensor in the target dtype, rounded once
(clipcli.numerics.casting). A quantized weight's scales, zero points and activation
scales are not values of their own: they are not written. Integer, bool and complex
tensors, and float ones already of the target dtype, pass through as stored (a kernel copy
where the writer can). convert writes it with a copy plan, as any other convert: the cast
happens as the write pass pulls each chunk, in bounded memory.

A narrowing cast that makes a finite value infinite (float32 1e6 to float16) is refused,
exit 4, naming the tensor, unless allowed (--allow-lossy): the write pass then stops and
OUT is not left behind. A model directory's config.json is written without its
`quantization_config` (the weights it described are gone); every other file as stored.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from clipcli.errors import DataRefusedError, InputError
from clipcli.formats.base import DirectoryLayout, Reader, Shard, StoredBytes, TensorInfo
from clipcli.logical.reader import LogicalReader

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import Listed, NonTensorInfo
    from clipcli.formats.structure_record import Structure
    from clipcli.system.identity import FileIdentity

CONFIG_NAME = "config.json"
CONFIG_LIMIT = 16 << 20  # bytes, as the quantized view reads it: a config is a few KB


class _Output(NamedTuple):
    info: TensorInfo  # as written
    source: TensorInfo  # as the wrapped reader serves it
    stored: str | None  # the one stored tensor it is as stored (pass-through), else None
    anchor: str  # the stored tensor it is written beside (a quantized weight: its codes)


class Overflow(NamedTuple):
    name: str
    values: int  # how many overflowed
    largest: float


class CastReader(Reader):
    def __init__(self, source: Reader, target: np.dtype[Any], allow_overflow: bool) -> None:
        super().__init__(source.path)
        self.source = source
        self.target = target
        self.allow_overflow = allow_overflow
        self.overflows: list[Overflow] = []
        self.format_name = source.format_name  # type: ignore[misc]  # per instance, on purpose
        self._stored = source.stored if isinstance(source, LogicalReader) else source
        self._outputs = self._plan_outputs()
        self._by_name: dict[str, _Output] = {}
        for output in self._outputs:
            if self._by_name.setdefault(output.info.name, output) is not output:
                raise InputError(
                    source.path, f"two tensors would be written as {output.info.name!r}"
                )
        self._config: bytes | None | bool = False  # False: not looked at yet

    def _plan_outputs(self) -> list[_Output]:
        from clipcli.numerics.casting import castable

        stored_position = {info.name: i for i, info in enumerate(self._stored.infos)}
        outputs = []
        if isinstance(self.source, LogicalReader):
            items = [
                (t.info, t.parts[0].name, t.plain and len(t.parts) == 1)
                for t in self.source.logical
            ]
        else:
            items = [(info, info.name, True) for info in self.source.infos]
        for info, anchor, as_stored in items:
            # A tensor of parts (GGUF blocks, a quantized weight) is decoded and cast even
            # when its values are already the target dtype: its stored bytes are not them.
            if castable(info.dtype) and (info.dtype != self.target or not as_stored):
                size = info.numel * self.target.itemsize
                written = TensorInfo(info.name, self.target, info.shape, size)
                outputs.append(_Output(written, info, None, anchor))
            elif as_stored:
                outputs.append(_Output(info, info, anchor, anchor))
            else:  # a logical tensor of parts whose values are not floats: no view makes one
                raise AssertionError(f"{info.name}: a {info.dtype} logical tensor of parts")
        # Each in the place of the stored tensor it is written beside: a quantized weight
        # whose scale sits in an earlier shard is still written with its codes' shard.
        outputs.sort(key=lambda o: stored_position[o.anchor])
        return outputs

    # ------------------------------------------------------------ tensors

    @property
    def infos(self) -> list[TensorInfo]:
        return [o.info for o in self._outputs]

    @property
    def listing(self) -> list[Listed]:
        from clipcli.formats.base import Listed

        return [Listed(i.name, i.dtype_name, i.shape, i.nbytes) for i in self.infos]

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        output = self._by_name[info.name]
        if output.stored is not None:
            return self.source.chunks(output.source, chunk_elems)
        return self._cast(output, chunk_elems)

    def _cast(self, output: _Output, chunk_elems: int | None) -> Iterator[np.ndarray]:
        from clipcli.numerics.casting import cast_chunk

        source = self.source
        if isinstance(source, LogicalReader) and not source.stored_as_is(output.source):
            logical = source.by_name[output.info.name]
            casts = source.view.cast_chunks(source.stored, logical, self.target)
        else:
            chunks = source.chunks(output.source, chunk_elems)
            casts = (cast_chunk(chunk, self.target) for chunk in chunks)
        count, largest = 0, 0.0
        for cast in casts:
            if cast.overflowed:
                if not self.allow_overflow:
                    raise DataRefusedError(
                        f"{output.info.name}: {cast.overflowed} values overflow "
                        f"{self.target.name} (|x| up to {cast.largest:.6g}); nothing written. "
                        "--allow-lossy writes them as +-inf"
                    )
                count += cast.overflowed
                largest = max(largest, cast.largest)
            yield cast.values
        if count:
            self.overflows.append(Overflow(output.info.name, count, largest))

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]] | None:
        output = self._by_name[info.name]
        return None if output.stored is None else self.source.chunk_loaders(output.source)

    def constant(self, info: TensorInfo) -> np.ndarray | None:
        output = self._by_name[info.name]
        return None if output.stored is None else self.source.constant(output.source)

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:
        """A pass-through tensor's stored bytes (a kernel copy); a cast one has none."""
        output = self._by_name[info.name]
        if output.stored is None:
            return None
        stored = {i.name: i for i in self._stored.infos}[output.stored]
        return self._stored.stored_bytes(stored)

    def expect_all_elements(self) -> None:
        self._stored.expect_all_elements()

    def warnings(self) -> list[str]:
        return self.source.warnings()

    # ------------------------------------------------------------ the directory

    def directory_layout(self) -> DirectoryLayout | None:
        """The source directory's layout with these tensors: each in the shard of the
        stored tensor it is written beside; config.json without quantization_config."""
        layout = self._stored.directory_layout()
        if layout is None:
            return None
        shard_of = {info.name: shard.name for shard in layout.shards for info in shard.infos}
        grouped: dict[str, list[TensorInfo]] = {shard.name: [] for shard in layout.shards}
        for output in self._outputs:
            grouped[shard_of[output.anchor]].append(output.info)
        shards = [Shard(s.name, grouped[s.name], s.metadata) for s in layout.shards]
        config = layout.root / CONFIG_NAME
        opened = layout.open_side_file

        def open_side_file(path: Path) -> BinaryIO:
            if path == config and self.rewritten_config() is not None:
                return self._rewritten_config_file(path)
            return opened(path)

        return layout._replace(shards=shards, open_side_file=open_side_file)

    def rewritten_config(self) -> bytes | None:
        """config.json without its quantization_config, None when there is nothing to
        drop (no model directory, no config.json among its files, or no such key)."""
        if self._config is False:
            self._config = self._read_config()
        assert not isinstance(self._config, bool)
        return self._config

    def _read_config(self) -> bytes | None:
        layout = self._stored.directory_layout()
        if layout is None:
            return None
        config = layout.root / CONFIG_NAME
        if config not in layout.side_files:
            return None
        with layout.open_side_file(config) as handle:
            raw = handle.read(CONFIG_LIMIT + 1)
        if len(raw) > CONFIG_LIMIT:
            raise InputError(config, f"is over {CONFIG_LIMIT} bytes")
        try:
            document = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise InputError(config, f"is not readable JSON ({type(exc).__name__})") from None
        if not isinstance(document, dict) or "quantization_config" not in document:
            return None
        del document["quantization_config"]
        return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    def _rewritten_config_file(self, path: Path) -> BinaryIO:
        """The rewritten config as an unnamed file with the source's permission bits
        (the writer copies a side file from a descriptor, bits and times included)."""
        from clipcli.system import scratch

        content = self.rewritten_config()
        assert content is not None
        with self._stored.directory_layout().open_side_file(path) as original:  # type: ignore[union-attr]
            mode = stat.S_IMODE(os.fstat(original.fileno()).st_mode) & 0o777
        fd, _ = scratch.unnamed_file("clipcli-config-")
        try:
            scratch.write_at(fd, content, 0)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    # ------------------------------------------------------------ the files': as stored

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._stored.metadata

    def joined_metadata(self) -> dict[str, str]:
        return self._stored.joined_metadata()

    def descriptions(self) -> frozenset[str]:
        return self._stored.descriptions()

    def join_losses(self) -> list[str]:
        return self._stored.join_losses()

    def source_files(self) -> list[Path]:
        return self._stored.source_files()

    def source_identities(self) -> dict[Path, FileIdentity]:
        return self._stored.source_identities()

    def archive_members(self) -> dict[str, str]:
        return self._stored.archive_members()

    def structure(self) -> Structure | None:
        """The stored structure while it still describes the tensors; a cast that changes
        a dtype leaves it behind (it records each dataset's dtype: an HDF5 replica would
        write the old one), said by losses()."""
        return None if self._casts_any() else self._stored.structure()

    @property
    def non_tensors(self) -> list[NonTensorInfo]:
        return [] if self._casts_any() else self._stored.non_tensors

    def _casts_any(self) -> bool:
        return any(o.stored is None for o in self._outputs)

    def losses(self) -> list[str]:
        """What the cast leaves behind of the file beyond its tensors (--allow-lossy)."""
        if self._casts_any() and (self._stored.structure() or self._stored.non_tensors):
            return ["the HDF5 structure (groups, attributes, datasets) through a --dtype cast"]
        return []

    def side_files(self) -> list[Path]:
        return self._stored.side_files()

    def side_files_linked_elsewhere(self) -> list[tuple[Path, int]]:
        return self._stored.side_files_linked_elsewhere()

    @property
    def compressed(self) -> bool:
        return self._stored.compressed

    @property
    def model_directory(self) -> Path | None:
        return self._stored.model_directory

    def left_out_entries(self) -> list[tuple[str, str]]:
        return self._stored.left_out_entries()

    def close(self) -> None:
        self.source.close()
