"""PyTorch checkpoints (.bin, .pt, .pth): zip, legacy pickle and legacy tar layouts, read
without torch; the pickle is interpreted over an allow-list, never executed."""

from typing import TYPE_CHECKING, Any

from clipcli.formats.pytorch.reader import PyTorchReader

if TYPE_CHECKING:
    from clipcli.formats.pytorch.writer import PyTorchWriter


def __getattr__(name: str) -> Any:
    if name == "PyTorchWriter":  # imported on first use: `ls` and `norms` never write
        from clipcli.formats.pytorch import writer

        return writer.PyTorchWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PyTorchReader", "PyTorchWriter"]
