"""PyTorch checkpoints (.bin, .pt, .pth): zip, legacy pickle and legacy tar layouts, read
without torch; the pickle is interpreted over an allow-list, never executed."""

from clipcli.formats.pytorch.reader import PyTorchReader

__all__ = ["PyTorchReader"]
