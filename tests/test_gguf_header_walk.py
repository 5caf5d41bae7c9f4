"""The GGUF header walk's fast path over long string arrays (header._Cursor.skip_strings:
a vocabulary's lengths walked in one loop over the read window): it lands where the slow
walk did, across window boundaries, and refuses a length past the end exactly as before."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from test_gguf_hostile import ARRAY, STRING, gguf, kv, s, u32

from clipcli.formats.gguf.header import MalformedGGUF, read_header


def strings(items: list[bytes], count: int | None = None) -> bytes:
    n = len(items) if count is None else count
    return struct.pack("<IQ", STRING, n) + b"".join(s(item) for item in items)


def header_of(path: Path) -> object:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_strings_across_windows_leave_the_walk_where_the_next_key_starts(tmp_path: Path) -> None:
    """Short strings, strings of 0 bytes and strings longer than the 1 MiB window, in turn:
    the key after the array is read right, so every length was walked in order."""
    items = []
    for i in range(3000):
        items.append(b"x" * (0 if i % 7 == 0 else 1_300_000 if i % 1000 == 999 else i % 50))
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf([kv("tokens", ARRAY, strings(items)), u32("after", 7)], []))
    header = header_of(path)
    assert header.kvs["after"].value == 7  # type: ignore[attr-defined]
    assert header.kvs["tokens"].length == 3000  # type: ignore[attr-defined]


@pytest.mark.parametrize(("extra", "refused"), [(0, False), (1, True), (2**63, True)])
def test_a_late_string_may_end_exactly_at_the_end_of_the_file(
    tmp_path: Path, extra: int, refused: bool
) -> None:
    """The 20th string of an array claims exactly the bytes left (the file's last KV, no
    tensors: accepted), one more (refused), or 2**63 (refused, nothing allocated)."""
    items = [b"t%d" % i for i in range(19)]
    body = strings(items, 20)
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv("tokens", ARRAY, body)
    tail = b"z" * (32 * 4 + (-(len(head) + 8) % 32))  # the file ends at a padded end
    raw = head + struct.pack("<Q", len(tail) + extra) + tail
    path = tmp_path / "m.gguf"
    path.write_bytes(raw)
    if not refused:
        assert header_of(path).kvs["tokens"].length == 20  # type: ignore[attr-defined]
        return
    with pytest.raises(MalformedGGUF, match="claims"):
        header_of(path)
