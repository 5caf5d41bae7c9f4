"""GGUF's logical tensors as a View (clipcli.logical.view): a block-quantized tensor is a
view over its blocks (one stored uint8 tensor of rows of blocks, role "blocks"), its real
values float32 from gguf.quants, streamed a bounded run of blocks at a time
(clipcli.formats.gguf.blocks). Plain tensors are their own logical tensors.

Until the GGUF reader's stored tensors are its `stored_infos` for every job (it presents
the dequantized values itself today, so that `convert` writes them dequantized), this view
is the same mapping for the LogicalReader: registered, it replaces that presentation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from clipcli.formats.base import Reader
from clipcli.formats.gguf import GgufReader
from clipcli.logical.view import LogicalTensor, Part, View

if TYPE_CHECKING:
    import numpy as np


class GGUFView(View):
    """The logical tensors of one GGUF file, in file order."""

    def __init__(self, reader: GgufReader) -> None:
        self._reader = reader
        self._tensors = [
            LogicalTensor(
                tensor.info,
                (Part(tensor.stored.name, "values" if tensor.scheme is None else "blocks"),),
                tensor.scheme,
            )
            for tensor in reader.blocks.tensors()
        ]

    def tensors(self) -> list[LogicalTensor]:
        return self._tensors

    def chunks(
        self,
        reader: Reader,  # noqa: ARG002 - the GGUF reader it was made for dequantizes
        tensor: LogicalTensor,
        chunk_elems: int | None = None,
    ) -> Iterator[np.ndarray]:
        return self._reader.chunks(tensor.info, chunk_elems)

    def warnings(self) -> list[str]:
        return self._reader.blocks.warnings()

    def lowerable(self, tensor: LogicalTensor) -> str | None:
        if tensor.plain:
            return None
        return (
            f"{tensor.info.name}: clipping GGUF {tensor.scheme} blocks (rescaling their "
            "scales) is not supported yet"
        )


def gguf_view(reader: Reader) -> View | None:
    """The VIEW_FACTORIES entry: a GGUFView for a GGUF file with block-quantized tensors."""
    if not isinstance(reader, GgufReader):
        return None
    view = GGUFView(reader)
    return None if all(t.plain for t in view.tensors()) else view
