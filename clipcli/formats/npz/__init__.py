""".npz: a zip of .npy members, read member by member without np.load and never unpickled.

Every member's .npy header is parsed and checked against the member's stored size before
any data is read, so a header declaring 10**12 elements over 8 bytes of data is refused
at once instead of allocating terabytes (np.load allocates the declared shape first).

Modules (zip safety is formats.zipsafe's, shared with .keras; re-exported below):
npyheader (.npy headers, parsed and built), fortran (column-major data put in C order on
disk), reader (NpzReader), writer (NpzWriter). The constants below are re-exported for
reading; to change one (a test's monkeypatch), set it on the module that defines it.
"""

from __future__ import annotations

from clipcli.formats.npz.fortran import FORTRAN_TILE_BYTES
from clipcli.formats.npz.npyheader import MAX_HEADER_BYTES, NPY_MAGIC, InputProblem
from clipcli.formats.npz.reader import FORTRAN_IN_MEMORY_BYTES, NpzReader
from clipcli.formats.npz.writer import ZIP_NAME_BYTES, NpzWriter
from clipcli.formats.zipsafe import (
    BOMB_MIN_BYTES,
    BOMB_RATIO,
    COMPRESSION_METHODS,
    check_zip_layout,
    expansion_budget,
)

__all__ = [
    "BOMB_MIN_BYTES",
    "BOMB_RATIO",
    "COMPRESSION_METHODS",
    "FORTRAN_IN_MEMORY_BYTES",
    "FORTRAN_TILE_BYTES",
    "MAX_HEADER_BYTES",
    "NPY_MAGIC",
    "InputProblem",
    "NpzReader",
    "NpzWriter",
    "ZIP_NAME_BYTES",
    "check_zip_layout",
    "expansion_budget",
]
