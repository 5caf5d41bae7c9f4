"""Issue 22 item 3: a deflated `data.pkl` in a PyTorch zip is budgeted by the FILE's size.

The pickle interpreter's memory budget (MEMORY_RATIO bytes per byte plus
MEMORY_FREE_BYTES) was measured against the pickle's inflated length: a 13.6 KB file whose
data.pkl inflates to 26 MB of empty-set opcodes took 355 MB (40 KB: 1 GB) before it was
refused. Measured against the file's size, it is refused (exit 3) within 300 MiB of peak
resident memory; a real checkpoint whose data.pkl is deflated still reads."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line

from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import unpickler

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
RSS_BUDGET = 300 << 20  # bytes of peak resident memory (as tests/test_pytorch_budgets.py)
EMPTY_SET, STOP = b"\x8f", b"."
# Runs the command as its only child and writes that child's peak RSS (KiB) to argv[1].
_PEAK_PROBE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL)\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(done.returncode)\n"
)


def _deflated_bomb(path: Path, sets: int, pad: int) -> Path:
    """The attack's file: a list of `sets` empty sets, each followed by `pad` PROTO
    opcodes (no-ops that make no object), in a deflated data.pkl."""
    unit = EMPTY_SET + b"\x80\x02" * pad
    body = b"\x80\x02}(X\x04\x00\x00\x00meta](" + unit * sets + b"eu."
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", body, zipfile.ZIP_DEFLATED, compresslevel=9)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize("command", ["ls", "norms"])
@pytest.mark.parametrize(("sets", "pad"), [(3_500_000, 3), (3_700_000, 0)])
def test_a_deflated_pickle_bomb_is_refused_within_300_mib(
    tmp_path: Path, command: str, sets: int, pad: int
) -> None:
    path = _deflated_bomb(tmp_path / "bomb.pt", sets, pad)
    assert path.stat().st_size < 64 << 10  # a small file ...
    with zipfile.ZipFile(path) as archive:  # ... whose pickle inflates past 3.5 MB
        assert archive.getinfo("archive/data.pkl").file_size > 3_500_000
    peak = tmp_path / "peak"
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, str(peak), sys.executable, "-m", "clipcli"]
        + [command, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr
    line = one_error_line(done.stderr)
    assert "bytes of memory" in line
    assert f"{path.stat().st_size} bytes in the file" in line
    assert int(peak.read_text()) << 10 < RSS_BUDGET


def test_a_real_checkpoint_with_a_deflated_pickle_still_reads(tmp_path: Path) -> None:
    """zip_v2.pt (made by torch.save) with its data.pkl deflated: torch reads such zips."""
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(DATA / "zip_v2.pt") as source, zipfile.ZipFile(path, "w") as out:
        for entry in source.infolist():
            deflate = entry.filename.endswith("data.pkl")
            method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            out.writestr(entry.filename, source.read(entry), method)
    with np.load(DATA / "zip_v2.expected.npz") as archive:
        want = {key: archive[key] for key in archive.files}
    with open_reader(path) as reader:
        assert sorted(i.name for i in reader.infos) == sorted(want)
        for info in reader.infos:
            got = reader.read(info)
            widened = got.astype(np.float64) if got.dtype.kind not in "biu" else got
            np.testing.assert_array_equal(widened, want[info.name])


@pytest.mark.parametrize("past", [0, 1])
def test_the_budget_is_measured_against_the_file_at_the_limit_and_one_past(
    past: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two bytes of budget per byte of the FILE (here 5, fewer than the pickle's bytes):
    the free bytes set so that the budget is exactly one empty set's charge, or one short."""
    data = b"\x80\x02" * 10 + EMPTY_SET + STOP  # PROTO repeated: no objects
    file_size = 5
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 2)
    monkeypatch.setattr(
        unpickler, "MEMORY_FREE_BYTES", 8 + sys.getsizeof(set()) - 2 * file_size - past
    )
    machine = unpickler.Interpreter(data, file_size=file_size)
    if past:
        with pytest.raises(unpickler.PickleProblem, match="its 5 bytes in the file"):
            machine.load()
    else:
        assert machine.load() == set()


def test_a_file_larger_than_its_pickle_gives_no_more_than_the_pickles_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stored pickle in a large file (the tensors' bytes) keeps its own budget."""
    data = b"\x80\x04" + EMPTY_SET + STOP
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 2)
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", 8 + sys.getsizeof(set()) - 2 * len(data))
    assert unpickler.Interpreter(data, file_size=10**9).load() == set()
    monkeypatch.setattr(
        unpickler, "MEMORY_FREE_BYTES", 8 + sys.getsizeof(set()) - 2 * len(data) - 1
    )
    with pytest.raises(unpickler.PickleProblem, match="bytes of memory"):
        unpickler.Interpreter(data, file_size=10**9).load()
