"""Which view a checkpoint is read through: the first factory that claims it, else the
identity view (every stored tensor is its own logical tensor, and the stored reader is
used as it is: plain checkpoints go through exactly the code they always did)."""

from __future__ import annotations

from collections.abc import Callable

from clipcli.formats.base import Reader
from clipcli.logical.view import View

# Each factory looks at a stored reader's names, dtypes and config and returns its view,
# or None when the checkpoint holds nothing it maps. Refusals (ambiguity) raise.
ViewFactory = Callable[[Reader], View | None]


def _quantized(reader: Reader) -> View | None:
    from clipcli.logical.quantized.markers import may_be_quantized

    if not may_be_quantized(reader):
        return None  # no scheme can claim a weight: none of them is even imported
    from clipcli.logical.quantized.view import quantized_view  # with data, not for ls

    return quantized_view(reader)


def _storages(reader: Reader) -> View | None:
    if not reader.format_name.startswith("pytorch"):  # a file or a directory of PyTorch shards
        return None  # (other formats never import the PyTorch reader)
    from clipcli.logical.pytorch import storage_view  # PyTorch tensors sharing storages

    return storage_view(reader)


def _gguf(reader: Reader) -> View | None:
    if reader.format_name != "gguf":
        return None
    from clipcli.logical.gguf import gguf_view  # with data, not for ls

    return gguf_view(reader)


VIEW_FACTORIES: list[ViewFactory] = [_gguf, _quantized, _storages]


def view_for(reader: Reader) -> View | None:
    """The view `reader`'s tensors need, None when the identity view serves."""
    for factory in VIEW_FACTORIES:
        view = factory(reader)
        if view is not None:
            return view
    return None


def logical(reader: Reader) -> Reader:
    """The reader jobs measure, plan and compare through: `reader` itself under the
    identity view, else a LogicalReader over it."""
    view = view_for(reader)
    if view is None:
        return reader
    from clipcli.logical.reader import LogicalReader

    return LogicalReader(reader, view)
