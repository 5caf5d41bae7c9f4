"""PyTorch tensors as logical tensors: each tensor is its own stored tensor (a strided
view of a storage, which the reader already serves as values), and the view says which
tensors are the *same* view of one storage (tied weights, `lm_head.weight` saved as
`embed.weight`) and which views overlap in part.

- Tied: `shared_with` names the first tensor of an identical view (same storage, offset,
  sizes, strides, dtype). Jobs count it once in a global norm, give the second the first
  one's action (so a clip writes both names with the same bytes) and report it as "tied
  to" the first.
- Partly overlapping views (a tensor and its transpose's slice, rows of one buffer): each
  is its own tensor with its own norm, and a global norm counts their shared values once
  per view; a clip by one factor over several tensors (`--global`) is refused for them
  (clipcli.api.check_clip_scope), since no per-storage answer would agree with the
  per-tensor norms the report shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from clipcli.formats.base import Reader
from clipcli.formats.pytorch import PyTorchReader
from clipcli.logical.view import LogicalTensor, Part, View

if TYPE_CHECKING:
    import numpy as np


class StorageView(View):
    """The tensors of a PyTorch checkpoint (or of a directory of PyTorch shards), with the
    storages they share."""

    def __init__(
        self, reader: Reader, tied: dict[str, str], overlapping: list[tuple[str, ...]]
    ) -> None:
        self._tensors = [LogicalTensor(info, (Part(info.name, "values"),)) for info in reader.infos]
        self._tied = tied
        self._overlapping = overlapping

    def tensors(self) -> list[LogicalTensor]:
        return self._tensors

    def chunks(
        self, reader: Reader, tensor: LogicalTensor, chunk_elems: int | None = None
    ) -> Iterator[np.ndarray]:
        return reader.chunks(tensor.info, chunk_elems)  # a plain tensor: its stored values

    def shared_with(self, tensor: LogicalTensor) -> str | None:
        return self._tied.get(tensor.info.name)

    def overlapping(self) -> list[tuple[str, ...]]:
        return list(self._overlapping)


def _pytorch_readers(reader: Reader) -> list[PyTorchReader]:
    """The PyTorch files behind `reader`: itself, or a model directory's PyTorch shards."""
    if isinstance(reader, PyTorchReader):
        return [reader]
    shard_readers = getattr(reader, "shard_readers", None)
    if shard_readers is None:
        return []
    return [r for r in shard_readers() if isinstance(r, PyTorchReader)]


def storage_view(reader: Reader) -> View | None:
    """The VIEW_FACTORIES entry: a StorageView where PyTorch tensors share storages (tied
    or overlapping); None where every tensor has a storage of its own (the identity view
    serves)."""
    tied: dict[str, str] = {}
    overlapping: list[tuple[str, ...]] = []
    for stored in _pytorch_readers(reader):
        tied.update(stored.tied())
        overlapping.extend(stored.overlapping_views())
    if not tied and not overlapping:
        return None
    return StorageView(reader, tied, overlapping)
