"""The one expansion-budget policy: how many bytes a file's compressed or unallocated
contents may expand to, together, before clipcli calls it a bomb.

Real tensors compress ~1.1:1; all-zero ones ~1000:1 but are rarely large, and gzip of
zeros would take minutes to decode. So everything a file of N bytes holds may expand to at
most RATIO * N + FREE_BYTES (the free bytes let a small file of all-zero tensors read).
The npz and .keras members (formats.zipsafe) and HDF5 datasets (formats.hdf5.limits) both
take their budget from budget(); each keeps its own names for the two figures so that a
test can move one format's limit without touching the other's.
"""

from __future__ import annotations

RATIO = 200
FREE_BYTES = 64 << 20


def budget(file_size: int, ratio: int = RATIO, free_bytes: int = FREE_BYTES) -> int:
    """The most bytes all of a file's contents may expand to, together."""
    return ratio * file_size + free_bytes
