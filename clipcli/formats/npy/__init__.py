""".npy: one array per file, numpy's own format, read without np.load and never unpickled.

The header is parsed by the npz reader's parser (formats.npz.npyheader: a size cap,
`ast.literal_eval`, numeric dtypes only) and checked against the file's size before any
data is read; column-major data is put in C order as npz does (formats.npz.fortran).
The file names no tensor: its one tensor is called TENSOR_NAME ("array", numpy's word),
whatever the file is called, so that `diff a.npy b.npy` pairs the two and a clip or a
round trip through another format keeps the name. Writing takes exactly one tensor.

Modules: reader (NpyReader), writer (NpyWriter).
"""

from __future__ import annotations

from clipcli.formats.npy.reader import TENSOR_NAME, NpyReader
from clipcli.formats.npy.writer import NpyWriter

__all__ = ["TENSOR_NAME", "NpyReader", "NpyWriter"]
