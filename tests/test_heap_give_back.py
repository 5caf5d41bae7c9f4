"""A checkpoint's header is a one-off peak of temporaries (its bytes, its text, the fields
split out of it); clipcli keeps freed heap memory for its chunk buffers (cli/entry.py's
mallopt settings), so opening a reader gives the freed memory back to the kernel
(system/heap.give_back_freed_memory). Measured in a child process with clipcli's own
malloc settings: after opening a header of 100,000 entries, the resident set is well
below its high-water mark, and without the give-back it is not (the control)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clipcli.system import heap

pytestmark = pytest.mark.skipif(heap._malloc_trim() is None, reason="glibc only (malloc_trim)")

CHILD = r"""
import sys
from pathlib import Path
from clipcli.cli.entry import _keep_chunk_buffers
_keep_chunk_buffers()
import numpy  # as a run has it: the heap's state before the header
from clipcli.system import heap
if sys.argv[2] == "without":
    heap.give_back_freed_memory = lambda: None
    import clipcli.formats.opening as opening
    opening.give_back_freed_memory = lambda: None
from clipcli.formats.opening import open_reader
reader = open_reader(Path(sys.argv[1]))
assert len(reader.listing) == 100_000
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]) - int(status["VmRSS"].split()[0]))
"""


def _many_entries(path: Path, count: int) -> Path:
    header = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(count)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(4 * count))
    return path


def _given_back_kib(path: Path, mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_opening_a_big_header_gives_its_temporaries_back(tmp_path: Path) -> None:
    path = _many_entries(tmp_path / "many.safetensors", 100_000)
    with_trim = _given_back_kib(path, "with")
    without = _given_back_kib(path, "without")
    assert with_trim >= 10 * 1024, (with_trim, without)  # >= 10 MiB below the high-water mark
    assert without < with_trim / 2, (with_trim, without)  # and it is the give-back that did it


def test_giving_back_leaves_live_memory_alone() -> None:
    """malloc_trim(0) only returns free pages: what is alive keeps its values."""
    kept = [bytes([i % 256]) * 4096 for i in range(2000)]
    scratch = [bytearray(1 << 16) for _ in range(200)]
    del scratch
    heap.give_back_freed_memory()
    assert all(block == bytes([i % 256]) * 4096 for i, block in enumerate(kept))
