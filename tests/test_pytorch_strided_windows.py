"""A strided PyTorch view (a transposed weight: every output chunk touches its whole span)
is read through maps of a bounded window of the file, one at a time, so that the resident
set and the address space stay bounded whatever the span (THREAT_MODEL); a map the address
space refuses (mmap ENOMEM) is out of memory, exit 5, not an unreadable input.

Files are built by hand (tests/test_pytorch_hostile.py's pickle helpers) in torch's legacy
stream layout, whose storage bytes end the file: a large storage is a hole (sparse, no
disk). Values are checked against numpy's as_strided over the storage's own bytes; limits
are real `prlimit --as` runs and the child's own peak resident set, no timing."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from test_pytorch_hostile import EMPTY_DICT, SETITEM, STOP, legacy, tensor, text

from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import reader as pytorch_reader

MIB = 1 << 20


def strided_file(
    path: Path,
    head: np.ndarray,
    numel: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int = 0,
) -> Path:
    """A float32 storage of `numel` elements beginning with `head` (the rest a hole),
    viewed as `w` with these sizes and strides."""
    obj = (
        b"\x80\x02"
        + EMPTY_DICT
        + text("w")
        + tensor(offset=offset, size=size, stride=stride, numel=numel, legacy=True)
        + SETITEM
        + STOP
    )
    legacy(path, obj, ["0"], struct.pack("<q", numel) + head.astype("<f4").tobytes())
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size + (numel - head.size) * 4)
    return path


def reference(
    values: np.ndarray, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0
) -> np.ndarray:
    base = values.astype(np.float32)[offset:]
    return np.lib.stride_tricks.as_strided(base, size, tuple(s * 4 for s in stride)).copy()


VIEWS = {  # (numel, sizes, strides, storage offset)
    "transposed": (12 * 10, (10, 12), (1, 10), 0),
    "permuted_3d": (4 * 5 * 6, (6, 4, 5), (1, 30, 6), 0),
    "every_other_column": (8 * 9, (8, 4), (9, 2), 1),
    "expanded": (7, (5, 7), (0, 1), 0),
    "one_column": (40 * 3, (40,), (3,), 2),
}


@pytest.mark.parametrize("window", [4, 16, 64, 1 << 20])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_values_in_windows_smaller_than_the_span(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, view: str, window: int
) -> None:
    """Windows of a few elements (every view cut along its widest axis, once or twice),
    blocks of a few rows: the values are numpy's, and the chunks the same pieces (rows of
    the leading axis) the whole view cut by _c_order_pieces gives."""
    numel, size, stride, offset = VIEWS[view]
    values = np.arange(numel, dtype=np.float32) * 3 - 7
    path = strided_file(tmp_path / "w.pt", values, numel, size, stride, offset)
    want = reference(values, size, stride, offset)
    monkeypatch.setattr(pytorch_reader, "_WINDOW_BYTES", window)
    monkeypatch.setattr(pytorch_reader, "_BLOCK_BYTES", 48)
    for elems in (1, 5, 13, math.prod(size)):
        with open_reader(path) as reader:
            (info,) = reader.infos
            chunks = list(reader.chunks(info, elems))
        pieces = pytorch_reader._c_order_pieces(want, elems)
        assert [c.size for c in chunks] == [p.size for p in pieces]
        np.testing.assert_array_equal(np.concatenate(chunks), want.ravel())


def test_bounded_views_fit_their_window_and_cover_the_view_once() -> None:
    shape, strides = (6, 4, 5), (1, 30, 6)
    seen = np.zeros(shape, dtype=int)
    for limit in (1, 2, 7, 30, 31, 120, 143, 144):
        seen[...] = 0
        for index, offset, sub_shape in pytorch_reader._bounded_views(0, shape, strides, limit):
            span = 1 + sum((n - 1) * s for n, s in zip(sub_shape, strides, strict=True))
            assert span <= limit
            assert seen[index].shape == sub_shape
            assert offset == sum(
                sl.start * s for sl, s in zip(index, strides, strict=True) if sl.start
            )
            seen[index] += 1
        assert (seen == 1).all()


def test_a_view_whose_span_is_the_window_is_one_map_and_one_more_element_splits() -> None:
    shape, strides = (6, 4, 5), (1, 30, 6)
    span = 1 + 5 * 1 + 3 * 30 + 4 * 6  # 120 elements
    assert len(list(pytorch_reader._bounded_views(0, shape, strides, span))) == 1
    assert len(list(pytorch_reader._bounded_views(0, shape, strides, span - 1))) > 1


def test_a_view_of_the_block_size_is_one_block_and_one_element_more_is_two() -> None:
    shape, strides = (3, 4), (1, 3)  # a transposed 4 x 3
    one = list(pytorch_reader._c_order_blocks(0, shape, strides, 4, 12))
    assert one == [(0, shape, strides)]
    two = list(pytorch_reader._c_order_blocks(0, shape, strides, 4, 11))
    assert two == [(0, (2, 4), strides), (2, (1, 4), strides)]


# ------------------------------------------------------------------ real limits

ROWS, COLUMNS = 8192, 16384  # a 512 MiB storage, all but its first row a hole
SPAN_BYTES = ROWS * COLUMNS * 4
LIMIT = 350 * MIB  # the address space a contiguous read of it fits in


def _big(tmp_path: Path, transposed: bool) -> tuple[Path, np.ndarray]:
    first_row = np.arange(COLUMNS, dtype=np.float32) / 64
    size, stride = (
        ((COLUMNS, ROWS), (1, COLUMNS)) if transposed else ((ROWS, COLUMNS), (COLUMNS, 1))
    )
    path = strided_file(tmp_path / "big.pt", first_row, ROWS * COLUMNS, size, stride)
    return path, first_row


def _run_measured(
    *argv: str, limit: int | None = None
) -> tuple[subprocess.CompletedProcess[str], int]:
    """clipcli in a child of a fresh interpreter (whose only child it is): its result and
    its peak resident set (bytes: anonymous and file pages alike)."""
    command = [sys.executable, "-m", "clipcli", *argv]
    if limit is not None:
        command = ["prlimit", f"--as={limit}", *command]
    probe = (
        "import json, resource, subprocess, sys\n"
        "done = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps([done.returncode, done.stdout, done.stderr, peak]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(command)],
        capture_output=True,
        text=True,
        check=True,
    )
    code, stdout, stderr, peak_kib = json.loads(out.stdout)
    return subprocess.CompletedProcess(command, code, stdout, stderr), peak_kib * 1024


@pytest.mark.parametrize("transposed", [False, True])
def test_a_transposed_view_of_a_512_mib_storage_reads_under_350_mib(
    tmp_path: Path, transposed: bool
) -> None:
    """The contiguous file is the control: both read under the same real address-space
    limit (the whole span mapped at once could not), and the strided one's peak resident
    set stays far below its span (the maps' pages leave as each is unmapped)."""
    path, first_row = _big(tmp_path, transposed)
    run, peak = _run_measured("norms", str(path), "--format", "json", limit=LIMIT)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(run.stdout)["tensors"]
    exact = math.sqrt(math.fsum(float(v) ** 2 for v in first_row.astype(np.float64)))
    assert row["norm"] == pytest.approx(exact, rel=1e-12)
    assert peak < SPAN_BYTES // 3, peak


def test_a_map_the_address_space_refuses_is_out_of_memory(tmp_path: Path) -> None:
    """Under a limit that leaves room for everything but one window's map (64 MiB here),
    the read ends with exit 5 and one line (mmap's ENOMEM), as an allocation would, not
    exit 3."""
    path, _ = _big(tmp_path, transposed=True)
    script = (
        "import os, resource, sys\n"
        "import numpy\n"
        "from clipcli.cli.entry import main\n"
        "from clipcli.formats.pytorch import reader\n"
        "status = open(f'/proc/{os.getpid()}/status').read()\n"
        "used = int(status.split('VmSize:')[1].split()[0]) * 1024\n"
        "reader._WINDOW_BYTES = 64 * 2**20  # a window larger than the room left\n"
        "room = reader._BLOCK_BYTES + 24 * 2**20  # one block, not one window\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + room, resource.RLIM_INFINITY))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "norms", str(path), "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert run.returncode == 5, run.stderr
    assert "out of memory" in one_error_line(run.stderr)
    assert "cannot map" in run.stderr


def test_every_map_goes_through_the_one_rule() -> None:
    """mmap is called in one place (clipcli/system/file_map.py), which makes ENOMEM exit 5."""
    root = Path(pytorch_reader.__file__).parents[3]
    calls = [
        path.relative_to(root).as_posix()
        for path in (root / "clipcli").rglob("*.py")
        if "mmap.mmap(" in path.read_text(encoding="utf-8")
    ]
    assert calls == ["clipcli/system/file_map.py"]
