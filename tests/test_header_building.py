"""The safetensors writer's header (formats/safetensors/header.build_header, header_length):
each entry's text is formatted directly instead of dumped from a dict, and must be byte for
byte what json.dumps(separators=(",", ":"), ensure_ascii=False) makes of the dict (the
reference: Python's json module, which shares no code with the formatting), for names that
need escapes, non-ASCII names, shapes of any rank, with and without metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors.header import CODES, build_header, header_length

NAMES = [
    "w",
    'quote" backslash\\ newline\n tab\t',
    "\x00\x01\x1f\x7f control",
    "é 😀 \u2028 \u2029 wide 漢字",
    "</script>&<>",
    "x" * 1000,
    "__metadata__x",
]


def reference(infos: Sequence[TensorInfo], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for info in infos:
        header[info.name] = {
            "dtype": CODES[info.dtype_name],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return text + b" " * (-len(text) % 8)


def tensors(count: int, seed: int) -> list[TensorInfo]:
    rng = np.random.default_rng(seed)
    dtypes = [np.dtype(t) for t in ("<f4", "<f2", "<f8", "<i8", "u1", "?")]
    infos = []
    for i in range(count):
        shape = tuple(int(d) for d in rng.integers(0, 5, size=int(rng.integers(0, 5))))
        dtype = dtypes[i % len(dtypes)]
        name = f"{NAMES[i % len(NAMES)]}.{i}"
        infos.append(TensorInfo(name, dtype, shape, int(np.prod(shape)) * dtype.itemsize))
    return infos


@pytest.mark.parametrize("metadata", [{}, {"format": "pt", 'k"\n': "é\\ 😀"}])
@pytest.mark.parametrize("count", [0, 1, 7, 4095, 4096, 4097])
def test_header_is_what_json_dumps_makes(metadata: dict[str, str], count: int) -> None:
    infos = tensors(count, count)
    expected = reference(infos, metadata)
    header = build_header(infos, metadata)
    assert header[8:] == expected
    assert int.from_bytes(header[:8], "little") == len(expected)
    assert header_length(infos, metadata) == len(expected)
