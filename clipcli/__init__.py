"""clipcli: inspect L2 norms of checkpoint tensors and write clipped copies."""

__version__ = "0.1.0"
