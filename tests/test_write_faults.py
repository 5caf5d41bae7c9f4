"""The write path under faults: nothing partial is ever left behind, an existing OUT survives."""

from __future__ import annotations

import errno
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from expect import listing, one_error_line
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.formats.safetensors import SafetensorsWriter


def make_input(path: Path, elements: int = 4096, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    save_file(
        {"a": rng.standard_normal(elements, dtype=np.float32) * 10, "b": np.arange(8.0)},
        str(path),
    )
    return path


def test_disk_full_during_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    before = listing(tmp_path)

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "write", full)
    code = main(["clip", "--global", "1", str(src), str(tmp_path / "out.safetensors")])
    assert code == 5
    line = one_error_line(capsys.readouterr().err)
    assert "disk full" in line
    assert "out.safetensors" in line
    assert listing(tmp_path) == before


def test_disk_full_keeps_existing_out_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "write", full)
    assert main(["clip", "--global", "1", "--force", str(src), str(out)]) == 5
    one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == b"precious"
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


def test_file_size_limit_gives_exit_5(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes write() fail with EFBIG (Python ignores SIGXFSZ)."""
    src = make_input(tmp_path / "in.safetensors", elements=1 << 18)
    out = tmp_path / "out.safetensors"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = subprocess.run(
        [sys.executable, "-m", "clipcli", "clip", "--global", "1", str(src), str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=60,
    )
    assert proc.returncode == 5, proc.stderr
    one_error_line(proc.stderr)
    assert listing(tmp_path) == ["in.safetensors"]


# `python -m clipcli` with every chunk it writes held back 50 ms, so that the write pass
# lasts long enough to be interrupted on a small input, however fast or loaded the machine.
PACED_CLIPCLI = """
import sys, time
from clipcli.formats.safetensors import SafetensorsWriter

real_write = SafetensorsWriter.write

def paced_write(self, info, chunks):
    def paced():
        for chunk in chunks:
            time.sleep(0.05)
            yield chunk
    return real_write(self, info, paced())

SafetensorsWriter.write = paced_write
sys.argv[0] = "clipcli"
from clipcli.__main__ import run
run()
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_write_removes_temp_file(tmp_path: Path, sig: int, code: int) -> None:
    """A real signal into a real process while it writes OUT (it was an 800 MB input, to
    make the write last; a paced writer does that with 16 MB)."""
    src = tmp_path / "in.safetensors"
    rng = np.random.default_rng(1)
    save_file(
        {f"t{i}": rng.standard_normal(1_000_000, dtype=np.float32) for i in range(4)},
        str(src),
    )
    out = tmp_path / "out.safetensors"
    env = dict(os.environ, CLIPCLI_THREADS="1")
    argv = ["clip", "--global", "1", "--no-fsync", str(src), str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", PACED_CLIPCLI, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".clipcli-tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None, "finished before the temp file was seen"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(sig)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (err, stdout, listing(tmp_path))
    assert err.strip(), ("no message", stdout, listing(tmp_path))
    line = one_error_line(err)
    assert "no output written" in line
    assert listing(tmp_path) == ["in.safetensors"]


def test_missing_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_input(tmp_path / "in.safetensors")
    assert main(["clip", "--global", "1", str(src), str(tmp_path / "nope" / "o.safetensors")]) == 5
    assert "does not exist" in one_error_line(capsys.readouterr().err)


def test_unwritable_output_directory(
    tmp_path: Path, mount_tmpfs: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real read-only file system (root ignores permission bits, not a ro mount)."""
    src = make_input(tmp_path / "in.safetensors")
    readonly = mount_tmpfs("ro", size="1m", options="ro")
    assert main(["clip", "--global", "1", str(src), str(readonly / "o.safetensors")]) == 5
    assert "Read-only file system" in one_error_line(capsys.readouterr().err)
    assert listing(readonly) == []


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_out_linked_to_in_is_refused(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    original = src.read_bytes()
    out = tmp_path / "out.safetensors"
    if kind == "symlink":
        out.symlink_to(src)
    else:
        os.link(src, out)
    assert main(["clip", "--global", "1", "--force", str(src), str(out)]) == 2
    assert "is the input" in one_error_line(capsys.readouterr().err)
    assert src.read_bytes() == original


@pytest.mark.parametrize(
    ("in_mode", "umask", "expected"),
    [(0o644, 0o027, 0o640), (0o600, 0o022, 0o600), (0o666, 0o002, 0o664), (0o755, 0o022, 0o755)],
)
def test_new_output_gets_the_inputs_mode_masked_by_the_umask(
    tmp_path: Path, in_mode: int, umask: int, expected: int
) -> None:
    """cp's rule: a private checkpoint (0600) must not become a world-readable copy."""
    src = make_input(tmp_path / "in.safetensors")
    src.chmod(in_mode)
    old = os.umask(umask)
    try:
        for out in ("out.safetensors", "out.npz", "out.h5"):
            assert main(["clip", "--global", "1", "-q", str(src), str(tmp_path / out)]) == 0
            assert stat.S_IMODE((tmp_path / out).stat().st_mode) == expected, out
    finally:
        os.umask(old)


def test_force_keeps_the_old_outputs_mode(tmp_path: Path) -> None:
    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o604)
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o604
    assert set(load_file(str(out))) == {"a", "b"}


def test_output_and_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_input(tmp_path / "in.safetensors")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    assert main(["clip", "--global", "1", "-q", str(src), str(tmp_path / "o.safetensors")]) == 0
    assert any(".clipcli-tmp/o.safetensors" in name for name in synced)  # before the rename
    assert str(tmp_path) in synced  # the directory, after it


@pytest.mark.parametrize("durable", [True, False])
def test_early_writeback_leaves_the_output_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """Durable writes ask the kernel to start writeback every WRITEBACK_STEP bytes; with a
    step of 1 byte every chunk triggers it. The bytes written must not change."""
    import clipcli.formats.base as base

    calls: list[tuple[int, int]] = []
    original = base.WritebackStarter.advance

    def spy(self: base.WritebackStarter, written_to: int) -> None:
        calls.append((self._started, written_to))
        original(self, written_to)

    monkeypatch.setattr(base, "WRITEBACK_STEP", 1)
    monkeypatch.setattr(base.WritebackStarter, "advance", spy)
    src = make_input(tmp_path / "in.safetensors", elements=1 << 20)
    for limit, out in (("1e30", "same.safetensors"), ("1.0", "clipped.safetensors")):
        flags = [] if durable else ["--no-fsync"]
        code = main(["clip", "--global", limit, "-q", *flags, str(src), str(tmp_path / out)])
        assert code == 0
    assert (tmp_path / "same.safetensors").read_bytes() == src.read_bytes()
    clipped = load_file(str(tmp_path / "clipped.safetensors"))
    assert (
        float(np.linalg.norm(np.concatenate([clipped["a"], clipped["b"]]).astype(np.float64)))
        <= 1.0
    )
    if durable:
        assert len(calls) >= 4
        assert calls[-1][1] == os.path.getsize(tmp_path / "clipped.safetensors")
    else:
        assert calls == []


@pytest.mark.parametrize("limit", ["1e30", "1.0", "0.5"])
def test_the_writers_position_is_the_files_after_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    """The safetensors writer keeps where its next byte goes instead of asking the file
    (tell() is an lseek per tensor); after every write and every kernel copy, with early
    writeback on every chunk, the kept position is the file's."""
    import clipcli.formats.base as base

    checked: list[int] = []
    original = SafetensorsWriter._written

    def checking(self: SafetensorsWriter) -> None:
        assert self._position == self._file.tell()
        checked.append(self._position)
        original(self)

    monkeypatch.setattr(base, "WRITEBACK_STEP", 1)
    monkeypatch.setattr(SafetensorsWriter, "_written", checking)
    rng = np.random.default_rng(5)
    tensors = {f"small.{i}": rng.standard_normal(3).astype(np.float32) for i in range(300)}
    tensors["big"] = rng.standard_normal(1 << 19).astype(np.float32)  # copied, or in chunks
    tensors["zero"] = np.zeros(5, np.float32)
    tensors |= {f"late.{i}": np.full(2, i, np.float16) for i in range(50)}
    src = tmp_path / "in.safetensors"
    save_file(tensors, str(src))
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", limit, "-q", str(src), str(out)]) == 0
    assert checked
    assert checked[-1] == os.path.getsize(out)
    assert set(load_file(str(out))) == set(tensors)
