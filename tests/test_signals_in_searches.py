"""Signals during the factor searches' own passes, acted on at the next piece or chunk.

1. --axes.
Where the boxes cut every slice (numerics.slices.streamed_axes_scales), the factors are
searched a piece of 2**18 slices at a time after one pass gathers a window's values, and no
box is read between two pieces: a window of float16 pairs is 64 pieces, ~9 s of searching
with no signal check (the box reads check, the search did not). Now the search checks
before each piece.

The child stops itself (SIGSTOP) inside the second piece's search; the test sends SIGTERM
there and lets it go on: it must end as SIGTERM (143, one line, no OUT) without searching a
third piece. Events, not time: the child counts the pieces it searched in a file.

2. --global over float64 checks TF's factor by a pass over the rounded output while
planning, which checked no signal until the write pass began.
"""

from __future__ import annotations

import signal
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from expect import one_error_line, signalled_where_it_stops
from handmade import write_safetensors

# The child: clipcli with module.function counting its calls (written to a file as the
# child exits) and stopping its own process (SIGSTOP) on call number `stop`; the test sends
# the signal there and lets it go on.
_STOPPED_ON_A_CALL = """
import atexit, importlib, os, signal, sys
module = importlib.import_module({module!r})
real = getattr(module, {function!r})
count = 0
def counting(*args, **kwargs):
    global count
    count += 1
    if count == {stop}:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(*args, **kwargs)
setattr(module, {function!r}, counting)
atexit.register(lambda: open({counts!r}, "w").write(str(count)))
from clipcli.cli.entry import main
sys.exit(main(sys.argv[1:]))
"""


def _stopped_on_call(module: str, function: str, stop: int, counts: Path) -> str:
    return _STOPPED_ON_A_CALL.format(
        module=module, function=function, stop=stop, counts=str(counts)
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_sigterm_during_the_slices_search_stops_at_the_next_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """On one thread no piece is searched after the second; on two, pieces are searched
    side by side, and none after those already handed to the workers (two per worker:
    up to the fifth)."""
    monkeypatch.setenv("CLIPCLI_THREADS", str(threads))
    src, out, counts = tmp_path / "pairs.safetensors", tmp_path / "out.safetensors", tmp_path / "n"
    rng = np.random.default_rng(2)
    columns = 4 << 18  # four pieces of 2**18 two-element slices, one window
    write_safetensors(src, {"w": (rng.standard_normal((2, columns)) * 3).astype(np.float16)})
    script = _stopped_on_call("clipcli.numerics.slices", "scales_from_sums", 2, counts)
    args = ["clip", "--norm", "1", "--axes", "0", "-q", "--no-fsync", str(src), str(out)]
    code, err = signalled_where_it_stops(script, args, signal.SIGTERM)
    assert code == 143, err
    assert "SIGTERM" in one_error_line(err)
    searched = int(counts.read_text())
    assert searched == 2 if threads == 1 else 2 <= searched <= 5, searched
    assert not out.exists()


@pytest.mark.parametrize("threads", [1, 2])
def test_sigterm_while_boxes_are_searched_stops_at_the_next_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """--axes 1 of a bfloat16 [1024, 16384]: 16 boxes of 64 whole rows (each cut in two
    parts of 32 rows for two threads), each box's factors searched as the box is
    written. Stopped in the third search, the run ends as SIGTERM and writes nothing; on
    one thread before a fourth box is searched, on two within the parts already handed
    to the workers (two per worker: up to the sixth search)."""
    monkeypatch.setenv("CLIPCLI_THREADS", str(threads))
    src, out, counts = tmp_path / "rows.safetensors", tmp_path / "out.safetensors", tmp_path / "n"
    rng = np.random.default_rng(5)
    write_safetensors(src, {"w": rng.standard_normal((1024, 16384)).astype(ml_dtypes.bfloat16)})
    script = _stopped_on_call("clipcli.numerics.slices", "box_axes_scales", 3, counts)
    args = ["clip", "--norm", "1", "--axes", "1", "-q", "--no-fsync", str(src), str(out)]
    code, err = signalled_where_it_stops(script, args, signal.SIGTERM)
    assert code == 143, err
    assert "SIGTERM" in one_error_line(err)
    searched = int(counts.read_text())
    assert searched == 3 if threads == 1 else 3 <= searched <= 6, searched
    assert not out.exists()


def test_sigterm_during_the_float64_checking_pass_stops_it(tmp_path: Path) -> None:
    """--global over float64 tensors checks TF's factor by a pass over the rounded output
    (numerics.scaling._verified_factor) while planning: a pass over the whole checkpoint,
    which checked no signal until the write pass began. 32 chunks; stopped in the second,
    the pass must end within the chunks already handed to the workers."""
    src, out, counts = tmp_path / "w.safetensors", tmp_path / "out.safetensors", tmp_path / "n"
    rng = np.random.default_rng(3)
    write_safetensors(src, {"w": rng.standard_normal(32 << 18)})  # 32 chunks of 2 MiB
    script = _stopped_on_call("clipcli.numerics.rounding", "scale_chunk", 2, counts)
    args = ["clip", "--global", "1", "-q", "--no-fsync", str(src), str(out)]
    code, err = signalled_where_it_stops(script, args, signal.SIGTERM)
    assert code == 143, err
    assert "SIGTERM" in one_error_line(err)
    assert int(counts.read_text()) <= 12
    assert not out.exists()


def test_sigterm_among_the_float16_searches_stops_at_the_next_part(tmp_path: Path) -> None:
    """Attack s38: --norm of 1,500 float16 tensors of 65,536 values (each searched on its
    histogram, 65,536 distinct values a part) held a SIGTERM for 20 s of searching. Now
    the searches look for a signal after each part (scaling.each_factor's `between`):
    stopped in the second of 40 parts, the run ends before a third."""
    src, out, counts = tmp_path / "h.safetensors", tmp_path / "out.safetensors", tmp_path / "n"
    rng = np.random.default_rng(4)
    tensors = {}
    for i in range(40):
        bits = rng.integers(0, 0x7C00, 65536).astype(np.uint16)  # finite, ~all magnitudes
        bits |= rng.integers(0, 2, 65536).astype(np.uint16) << 15
        tensors[f"t{i:02d}"] = bits.view(np.float16)
    write_safetensors(src, tensors)
    script = _stopped_on_call("clipcli.numerics.scaling", "_histogram_factors", 2, counts)
    args = ["clip", "--norm", "1", "-q", "--no-fsync", str(src), str(out)]
    code, err = signalled_where_it_stops(script, args, signal.SIGTERM)
    assert code == 143, err
    assert "SIGTERM" in one_error_line(err)
    assert counts.read_text() == "2"
    assert not out.exists()


def test_sigterm_among_a_records_strings_stops_at_the_next_check(tmp_path: Path) -> None:
    """Attack s33sig: a vocabulary of 2,000,000 variable-length strings is checked string by
    string (a record is checked by the rules it is read back by), seconds of Python with no
    look for a signal. Stopped at the 70,000th string, the run must end at the next check
    (every 65,536 strings), not after all 300,000."""
    import h5py

    src, out, counts = tmp_path / "v.h5", tmp_path / "out.safetensors", tmp_path / "n"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(4, np.float32)
        f.create_dataset(
            "vocab", data=[f"word{i}" for i in range(300_000)], dtype=h5py.string_dtype()
        )
    script = _stopped_on_call("clipcli.formats.hdf5.record_check", "_string_bytes", 70_000, counts)
    code, err = signalled_where_it_stops(
        script, ["convert", "-q", str(src), str(out)], signal.SIGTERM
    )
    assert code == 143, err
    assert "SIGTERM" in one_error_line(err)
    assert 70_000 <= int(counts.read_text()) <= 2 * 65_536
    assert not out.exists()
