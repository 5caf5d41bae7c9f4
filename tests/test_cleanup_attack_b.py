"""Cleanup and the process environment, as an independent attack broke them (issue 18).

1. The `$TMPDIR/clipcli-keras-*` sweep removed user folders, the other input of `diff`
   and OUT's folder included: it now removes a folder only when it holds nothing but the
   file clipcli puts there, and nothing any input or OUT resolves to.
2. A live run's temp directory was swept between its `mkdir` and its `flock`: a run is
   stopped there for real (strace's syscall fault injection) while another one runs.
3. and 4. A stranded `.clipcli-old` that was a link (to IN, say), a plain file, or a
   directory where OUT is a file, was renamed to OUT: only a real directory, for a
   directory OUT, is put back; anything else is left alone.
5. A missing or read-only `$TMPDIR` fell back to /tmp, /var/tmp and then the working
   directory: TMPDIR, where set, is the only candidate; else /tmp, /var/tmp, /usr/tmp.
6. The sweep entered a bind mount of the same file system inside a stale temp: real
   `mount --bind`, the kernel's list of mount points decides.

Inputs are written with the official libraries (safetensors, numpy, h5py); OUT is read
back with them and its global norm checked in float64 against the limit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import one_error_line, tree
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.errors import WriteError
from clipcli.formats.keras_archive import SCRATCH_PREFIX, WEIGHTS_MEMBER
from clipcli.output import fsops
from clipcli.system import scratch
from clipcli.system.footprint import holds_a_mount, mount_points

DEAD_PID = 999_999_999  # no such process
CLIPCLI = [sys.executable, "-m", "clipcli"]


# ------------------------------------------------------------------ inputs and views


def write_safetensors(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((8, 8)).astype(np.float32)}, str(path))
    return path


def write_h5(path: Path) -> Path:
    with h5py.File(path, "w") as handle:
        handle["dense/kernel"] = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
    return path


def write_keras(path: Path) -> Path:
    weights = path.with_name(path.name + ".weights.h5")
    write_h5(weights)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.0.0"}))
        archive.writestr("config.json", json.dumps({"class_name": "Sequential"}))
        archive.write(weights, WEIGHTS_MEMBER)
    weights.unlink()
    return path


def write_model(directory: Path) -> Path:
    directory.mkdir()
    save_file({"l.w": np.full(8, 3, dtype=np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


def global_norm(path: Path) -> float:
    """The global norm of a safetensors OUT, read by the official reader, in float64."""
    tensors = load_file(str(path))
    return float(np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in tensors.values())))


def stale(out: Path, kind: str, pid: int = DEAD_PID) -> Path:
    return out.parent / f"{fsops.temp_prefix(out)}{pid}-0123abcd{kind}"


def keras_dir(where: Path, pid: int = DEAD_PID) -> Path:
    return where / f"{SCRATCH_PREFIX}{pid}-deadbeef"


def run_cli(argv: list[str], where: Path) -> subprocess.CompletedProcess[str]:
    """clipcli in a process of its own with $TMPDIR at `where` (in-process, tempfile
    would keep the directory it chose first)."""
    env = dict(os.environ, TMPDIR=str(where))
    return subprocess.run(
        [*CLIPCLI, *argv, "-q"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> Path:
    where = tmp_path / "tmp"
    where.mkdir()
    return where


# ------------------------------------------------------------------ 1: the keras sweep


def _attack_arguments(k: Path, src: Path, out_dir: Path) -> list[list[str]]:
    """The attacker's command lines: B (in the swept-looking folder) as either input of
    diff beside a .keras, and OUT's folder beside a .keras IN (these four broke); B as
    the only input, where no .keras is read (these three did not: kept as controls)."""
    return [
        ["diff", str(src), str(k / "b.safetensors")],
        ["diff", str(k / "b.safetensors"), str(src)],
        ["diff", str(k / "b.keras"), str(src)],
        ["clip", "--global", "1", str(src), str(k / "out.keras")],
        ["clip", "--global", "1", str(k / "b.safetensors"), str(out_dir / "o.safetensors")],
        ["norms", str(k / "b.safetensors")],
        ["diff", str(k / "b.safetensors"), str(k / "b.safetensors")],
    ]


@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("name", ["clipcli-keras-abcd1234", f"clipcli-keras-{DEAD_PID}-deadbeef"])
def test_the_keras_sweep_leaves_a_folder_of_user_files_alone(
    tmp_path: Path, tmpdir_env: Path, case: int, name: str
) -> None:
    """Before: `diff B m.keras` deleted B, its folder and the notes beside it, exit 0."""
    src = write_keras(tmp_path / "m.keras")
    k = tmpdir_env / name
    k.mkdir()
    (k / "notes.txt").write_text("user data")
    write_safetensors(k / "b.safetensors")
    shutil.copy(src, k / "b.keras")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = tree(k)
    done = run_cli(_attack_arguments(k, src, out_dir)[case], tmpdir_env)
    assert done.returncode == 0, done.stderr
    after = tree(k)
    after.pop("out.keras", None)  # the clip's own OUT
    assert after == before


def test_an_input_named_like_the_unpacked_weights_is_not_swept(
    tmp_path: Path, tmpdir_env: Path
) -> None:
    """The folder holds exactly what clipcli puts there (model.weights.h5, one link), but
    that file is diff's other input: left alone."""
    src = write_keras(tmp_path / "m.keras")
    k = keras_dir(tmpdir_env)
    k.mkdir()
    other = write_h5(k / WEIGHTS_MEMBER)
    before = tree(k)
    for argv in (["diff", str(src), str(other)], ["diff", str(other), str(src)]):
        done = run_cli(argv, tmpdir_env)
        assert done.returncode == 0, done.stderr
        assert tree(k) == before


def test_outs_folder_is_not_swept(tmp_path: Path, tmpdir_env: Path) -> None:
    """An empty dead run's folder is what the sweep removes, unless OUT is to go in it.
    Before: exit 5, "directory ... does not exist"."""
    src = write_keras(tmp_path / "m.keras")
    k = keras_dir(tmpdir_env)
    k.mkdir()
    out = k / "o.h5"
    done = run_cli(["clip", "--global", "1", "--allow-lossy", str(src), str(out)], tmpdir_env)
    assert done.returncode == 0, done.stderr
    with h5py.File(out) as handle:
        kernel = handle["dense/kernel"][()].astype(np.float64)
    assert np.sqrt(np.sum(kernel**2)) <= 1.0


def test_a_scratch_folder_inside_an_input_directory_is_not_swept(tmp_path: Path) -> None:
    """$TMPDIR inside a model directory being read: a dead run's folder there is the
    input's, whatever it holds."""
    model = write_model(tmp_path / "model")
    k = keras_dir(model)
    k.mkdir()
    (k / WEIGHTS_MEMBER).write_bytes(b"x")
    with scratch.keeping_clear_of([model]):
        scratch.sweep_abandoned(str(model), SCRATCH_PREFIX, (WEIGHTS_MEMBER,))
    assert (k / WEIGHTS_MEMBER).read_bytes() == b"x"
    scratch.sweep_abandoned(str(model), SCRATCH_PREFIX, (WEIGHTS_MEMBER,))  # no job: swept
    assert not k.exists()


def _fill(k: Path, variant: str) -> None:
    k.mkdir()
    if variant == "empty":
        return
    (k / WEIGHTS_MEMBER).write_bytes(b"weights")
    if variant == "another file":
        (k / "notes.txt").write_text("mine")
    elif variant == "two links":
        os.link(k / WEIGHTS_MEMBER, k.parent / "second-name")
    elif variant == "a folder":
        (k / "sub").mkdir()
    elif variant == "a link":
        (k / WEIGHTS_MEMBER).unlink()
        (k / WEIGHTS_MEMBER).symlink_to(k.parent / "elsewhere")


@pytest.mark.parametrize(
    ("variant", "swept"),
    [
        ("empty", True),
        ("only the weights", True),  # at the limit: exactly what clipcli puts there
        ("another file", False),  # one past: anything else
        ("two links", False),
        ("a folder", False),
        ("a link", False),
    ],
)
def test_the_keras_sweep_removes_only_what_clipcli_puts_there(
    tmp_path: Path, variant: str, swept: bool
) -> None:
    (tmp_path / "elsewhere").write_text("keep me")
    k = keras_dir(tmp_path)
    _fill(k, variant)
    scratch.sweep_abandoned(str(tmp_path), SCRATCH_PREFIX, (WEIGHTS_MEMBER,))
    assert k.exists() is not swept
    assert (tmp_path / "elsewhere").read_text() == "keep me"


@pytest.mark.parametrize(
    ("name", "swept"),
    [
        (f"{DEAD_PID}-deadbeef", True),
        (f"{os.getpid()}-deadbeef", False),  # a live pid: its run may not have locked yet
        ("deadbeef", False),  # no pid to ask
        (f"{DEAD_PID}-deadbeef0", False),  # one character past the name clipcli makes
    ],
)
def test_the_keras_sweep_needs_a_dead_pid_in_the_name(
    tmp_path: Path, name: str, swept: bool
) -> None:
    k = tmp_path / f"{SCRATCH_PREFIX}{name}"
    k.mkdir()
    scratch.sweep_abandoned(str(tmp_path), SCRATCH_PREFIX, (WEIGHTS_MEMBER,))
    assert k.exists() is not swept


# ------------------------------------------------------------------ 2: live runs' temps


def _tracee(strace: subprocess.Popen[bytes]) -> int | None:
    """The pid of the process strace started (its child), once there is one."""
    children = Path(f"/proc/{strace.pid}/task/{strace.pid}/children")
    with_children = children.read_text().split() if children.exists() else []
    return int(with_children[0]) if with_children else None


def _stopped(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1] in ("t", "T")
    return False


class Traced:
    """clipcli under strace, stopped (SIGSTOP, injected by strace) right after its first
    call of one syscall: a known point, not a moment in time."""

    def __init__(self) -> None:
        self.strace: subprocess.Popen[bytes] | None = None
        self.pid = -1

    def start(
        self, syscall: str, argv: list[str], env: dict[str, str], made: Callable[[], bool]
    ) -> int:
        """Start it; once it has stopped and `made()` holds, its pid."""
        inject = f"inject={syscall}:signal=SIGSTOP:when=1"
        self.strace = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}", "-e", inject,
             *CLIPCLI, *argv],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 120  # a bound on a broken run, not a timing
        while time.monotonic() < deadline:
            assert self.strace.poll() is None, self.strace.communicate()
            pid = _tracee(self.strace)
            if pid is not None and _stopped(pid) and made():
                self.pid = pid
                return pid
            time.sleep(0.01)
        pytest.fail("the traced run never stopped")

    def finish(self) -> tuple[int, str]:
        """Resume it; its exit code and stderr."""
        assert self.strace is not None
        os.kill(self.pid, signal.SIGCONT)
        _, err = self.strace.communicate(timeout=120)
        return self.strace.returncode, err.decode()

    def stop(self) -> None:
        if self.strace is not None and self.strace.poll() is None:
            if self.pid > 0:
                os.kill(self.pid, signal.SIGCONT)
            self.strace.kill()
            self.strace.wait()


@pytest.fixture
def traced() -> Iterator[Traced]:
    if shutil.which("strace") is None:
        pytest.skip("no strace")
    control = Traced()
    yield control
    control.stop()


def test_a_live_runs_work_directory_is_not_swept_before_its_lock(
    tmp_path: Path, traced: Traced
) -> None:
    """Run A stops right after it made its work directory beside OUT, before its flock;
    run B to the same OUT sweeps meanwhile. Before: B removed A's directory and A failed
    with exit 5 ("No such file or directory")."""
    src = write_safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")

    def made() -> bool:
        return any(p.name.endswith(".clipcli-tmp") for p in tmp_path.iterdir())

    argv = ["clip", "--global", "1", "-q", "--force", "--no-fsync", str(src), str(out)]
    pid = traced.start("mkdirat", argv, env, made)
    (work,) = [p for p in tmp_path.iterdir() if p.name.endswith(".clipcli-tmp")]
    assert work.name.startswith(f".out.safetensors.{pid}-")
    b = subprocess.run([*CLIPCLI, "clip", "--global", "2", "-q", str(src), str(out)], env=env)
    assert b.returncode == 0
    assert work.is_dir()  # A's, left alone
    code, err = traced.finish()
    assert (code, err) == (0, "")
    assert global_norm(out) <= 1.0  # A's clip (--force over B's)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "out.safetensors"]


def test_a_live_runs_keras_directory_is_not_swept_before_its_lock(
    tmp_path: Path, traced: Traced
) -> None:
    """Run A (norms of a .keras) stops right after it made its $TMPDIR/clipcli-keras-*
    directory; run B sweeps. Before: A failed with exit 5."""
    src = write_keras(tmp_path / "m.keras")
    where = tmp_path / "tmp"
    where.mkdir()
    env = dict(os.environ, TMPDIR=str(where), PYTHONDONTWRITEBYTECODE="1")
    argv = ["norms", "--format", "json", str(src)]
    pid = traced.start("mkdir", argv, env, lambda: any(where.iterdir()))
    (held,) = os.listdir(where)
    assert held.startswith(f"{SCRATCH_PREFIX}{pid}-")  # the pid is in the name
    b = subprocess.run([*CLIPCLI, *argv], env=env, capture_output=True)
    assert b.returncode == 0, b.stderr
    assert os.listdir(where) == [held]
    code, err = traced.finish()
    assert (code, err) == (0, "")
    assert os.listdir(where) == []


@pytest.mark.parametrize(("alive", "swept"), [(False, True), (True, False)])
def test_an_unlocked_work_directory_of_a_live_pid_is_left(
    tmp_path: Path, alive: bool, swept: bool
) -> None:
    """Lock free, pid alive (a run between its mkdir and its flock): left; pid dead: swept."""
    src = write_safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    work = stale(out, ".clipcli-tmp", os.getppid() if alive else DEAD_PID)
    work.mkdir()
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    assert work.exists() is not swept


# ------------------------------------------------------------------ 3, 4: the aside copy


def _aside(kind: str, aside: Path, src: Path, tmp_path: Path) -> None:
    if kind == "link to IN":
        aside.symlink_to(src.name)
    elif kind == "link elsewhere":
        (tmp_path / "secret").write_text("not yours")
        aside.symlink_to(tmp_path / "secret")
    elif kind == "file":
        aside.write_text("my notes")
    elif kind == "directory":
        aside.mkdir()
        (aside / "z").write_text("z")
    elif kind == "link to a directory":
        (tmp_path / "folder").mkdir()
        (tmp_path / "folder" / "z").write_text("z")
        aside.symlink_to("folder")


@pytest.mark.parametrize(
    "kind", ["link to IN", "link elsewhere", "file", "directory", "link to a directory"]
)
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_aside_name_where_out_is_a_file_is_left_alone(
    tmp_path: Path, kind: str, force: list[str]
) -> None:
    """clipcli sets aside only a directory OUT. Before: a link to IN became OUT (exit 2,
    OUT left a link to IN); a file or folder became OUT, then "appeared while clipcli was
    writing" (exit 2)."""
    src = write_safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    _aside(kind, stale(out, ".clipcli-old"), src, tmp_path)
    before = tree(tmp_path)
    assert main(["clip", "--global", "1", "-q", *force, str(src), str(out)]) == 0
    after = tree(tmp_path)
    assert after.pop("out.safetensors") != "dir"
    assert after == before  # IN and the aside entry untouched, nothing else
    assert not out.is_symlink()
    assert global_norm(out) <= 1.0


@pytest.mark.parametrize("kind", ["link to IN", "link elsewhere", "file", "link to a directory"])
def test_an_aside_name_that_is_no_real_directory_is_left_alone(tmp_path: Path, kind: str) -> None:
    """A directory OUT: only a real directory is put back (the attack's link to the model
    directory IN was renamed to OUT, then refused as "OUT is the input")."""
    src = write_model(tmp_path / "m")
    out = tmp_path / "outmd"
    _aside(kind, stale(out, ".clipcli-old"), src, tmp_path)
    before = tree(tmp_path)
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("outmd")} == before
    assert out.is_dir()
    assert not out.is_symlink()
    assert global_norm(out / "model.safetensors") <= 1.0


def test_a_real_aside_directory_is_put_back_and_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At the limit of the rule: a real directory of this user, OUT a directory target."""
    src = write_model(tmp_path / "m")
    out = tmp_path / "outmd"
    aside = stale(out, ".clipcli-old")
    write_model(aside)
    before = tree(aside)
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "moved it aside; it is back in place" in line
    assert tree(out) == before
    assert not aside.exists()


def test_an_input_that_is_an_aside_file_is_refused_and_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Left alone or not, an input in a stale entry is exit 2, as for the other entries."""
    out = tmp_path / "out.safetensors"
    src = write_safetensors(stale(out, ".clipcli-old"))
    before = tree(tmp_path)
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 2
    assert "the input lies in" in one_error_line(capsys.readouterr().err)
    assert tree(tmp_path) == before


# ------------------------------------------------------------------ 5: $TMPDIR


def test_a_set_tmpdir_is_the_only_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usable = tmp_path / "usable"
    usable.mkdir()
    monkeypatch.setattr(scratch, "FALLBACK_DIRECTORIES", (str(usable),))
    monkeypatch.setenv("TMPDIR", str(usable))
    assert scratch.directory() == str(usable)
    (tmp_path / "file").write_text("x")
    for chosen, problem in [("missing", "does not exist"), ("file", "is not a directory")]:
        monkeypatch.setenv("TMPDIR", str(tmp_path / chosen))
        with pytest.raises(WriteError) as raised:
            scratch.directory()
        assert f"TMPDIR {tmp_path / chosen} {problem}" in str(raised.value)


def test_without_tmpdir_the_first_usable_fallback_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = (str(tmp_path / name) for name in ("a", "b", "c"))
    os.mkdir(second)
    os.mkdir(third)
    monkeypatch.setattr(scratch, "FALLBACK_DIRECTORIES", (first, second, third))
    for unset in ("", None):  # an empty TMPDIR is no TMPDIR
        if unset is None:
            monkeypatch.delenv("TMPDIR", raising=False)
        else:
            monkeypatch.setenv("TMPDIR", unset)
        assert scratch.directory() == second
    os.rmdir(second)
    os.rmdir(third)
    with pytest.raises(WriteError) as raised:
        scratch.directory()
    assert f"TMPDIR is not set and {first} does not exist, {second}" in str(raised.value)


FORTRAN_SPILLING = """
import sys
import clipcli.formats.npz.reader as npz_reader
npz_reader.FORTRAN_IN_MEMORY_BYTES = 0  # any column-major member goes through $TMPDIR
sys.argv[0] = "clipcli"
from clipcli.__main__ import run
run()
"""


def _inputs_through_tmpdir(folder: Path) -> list[Path]:
    """A .keras (unpacked into $TMPDIR) and a compressed column-major npz (spilled)."""
    npz = folder / "f.npz"
    np.savez_compressed(npz, w=np.asfortranarray(np.ones((64, 32), np.float32)))
    return [write_keras(folder / "m.keras"), npz]


def _run_in(folder: Path, src: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FORTRAN_SPILLING, "norms", "-q", src.name],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_or_file_tmpdir_is_exit_5_and_nothing_in_the_working_directory(
    tmp_path: Path,
) -> None:
    """Before: exit 0, with the temps in /tmp (or, /tmp being read-only, in the working
    directory, which was the input's folder)."""
    folder = tmp_path / "work"
    folder.mkdir()
    (tmp_path / "a-file").write_text("x")
    for src in _inputs_through_tmpdir(folder):
        before = sorted(os.listdir(folder))
        for chosen, problem in [("missing", "does not exist"), ("a-file", "is not a directory")]:
            env = dict(os.environ, TMPDIR=str(tmp_path / chosen))
            done = _run_in(folder, src, env)
            assert done.returncode == 5, done.stderr
            line = one_error_line(done.stderr)
            assert f"TMPDIR {tmp_path / chosen} {problem}" in line
            assert sorted(os.listdir(folder)) == before


def test_a_read_only_tmpdir_is_exit_5(tmp_path: Path, mount_tmpfs: Any) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    read_only = mount_tmpfs("ro", size="1m", options="ro")
    for src in _inputs_through_tmpdir(folder):
        before = sorted(os.listdir(folder))
        done = _run_in(folder, src, dict(os.environ, TMPDIR=str(read_only)))
        assert done.returncode == 5, done.stderr
        assert f"TMPDIR {read_only} is on a read-only file system" in one_error_line(done.stderr)
        assert sorted(os.listdir(folder)) == before


def test_a_tmpdir_the_user_cannot_write_is_exit_5(tmp_path: Path) -> None:
    """As an ordinary user (who may read root's test files, CAP_DAC_READ_SEARCH, but not
    write where it may not), a 0555 directory of its own; at the limit, 0755 works."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    folder = tmp_path / "work"
    folder.mkdir()
    src = _inputs_through_tmpdir(folder)[0]
    for mode, code in [(0o555, 5), (0o755, 0)]:
        where = tmp_path / f"tmp{mode:o}"
        where.mkdir(mode=mode)
        where.chmod(mode)
        os.chown(where, 65534, 65534)
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
             sys.executable, "-m", "clipcli", "norms", "-q", str(src)],
            env=dict(os.environ, TMPDIR=str(where)), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        if "Permission denied" in done.stderr and "clipcli: error" not in done.stderr:
            pytest.skip(f"the interpreter is out of reach as nobody: {done.stderr.strip()}")
        assert done.returncode == code, done.stderr
        if code:
            assert f"TMPDIR {where} is not writable" in one_error_line(done.stderr)


def test_without_tmpdir_no_fallback_is_the_working_directory(tmp_path: Path) -> None:
    """TMPDIR unset and /tmp, /var/tmp (and /usr/tmp) read-only, in a private mount
    namespace: exit 5 naming them. Before: exit 0, the temps made in the working
    directory."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    folder = tmp_path / "work"
    folder.mkdir()
    readonly = " && ".join(
        f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"
        for d in scratch.FALLBACK_DIRECTORIES
        if os.path.isdir(d)
    )
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    for src in _inputs_through_tmpdir(folder):
        before = sorted(os.listdir(folder))
        script = (
            f"{readonly} && cd {folder} && exec {sys.executable} -c '{FORTRAN_SPILLING}' "
            f"norms -q {src.name}"
        )
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        if "mount" in done.stderr and "clipcli" not in done.stderr:
            pytest.skip(f"cannot mount here: {done.stderr.strip()}")
        assert done.returncode == 5, done.stderr
        line = one_error_line(done.stderr)
        assert "TMPDIR is not set and /tmp is on a read-only file system" in line
        assert sorted(os.listdir(folder)) == before


# ------------------------------------------------------------------ 6: bind mounts


Bind = Callable[[Path, Path], None]


@pytest.fixture
def bind(tmp_path: Path) -> Iterator[Bind]:
    """`bind(source, target)`: a real bind mount; skips where mounting is not allowed. At
    the end every mount under tmp_path is undone, wherever a rename moved it."""

    def mount(source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")

    yield mount
    inside = str(tmp_path.resolve()) + "/"
    for point in reversed(mount_points() or []):
        if point.startswith(inside):
            subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.mark.parametrize("below", ["", "m nt", "a/b\tc"])  # at the entry, one and two down
def test_the_sweep_does_not_enter_a_bind_mount_in_a_stale_temp(
    tmp_path: Path, bind: Bind, below: str
) -> None:
    """Before: data/keep.txt, bind-mounted inside a stale .clipcli-tmp, was deleted. The
    names hold a space and a tab, which the kernel's list of mounts escapes."""
    src = write_safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("precious")
    entry = stale(out, ".clipcli-tmp")
    entry.mkdir()
    (entry / "ours").write_text("a dead run's")
    bind(data, entry / below)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert holds_a_mount(fd, entry.name)
    finally:
        os.close(fd)
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    assert (data / "keep.txt").read_text() == "precious"
    assert entry.exists()  # the whole entry is left


def test_a_stale_temp_without_a_mount_is_still_swept(tmp_path: Path) -> None:
    """One past the rule: nothing mounted, so the dead run's entry goes."""
    src = write_safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    entry = stale(out, ".clipcli-tmp")
    (entry / "m nt").mkdir(parents=True)
    (entry / "m nt" / "x").write_text("a dead run's")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert not holds_a_mount(fd, entry.name)
    finally:
        os.close(fd)
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    assert not entry.exists()


def test_the_keras_sweep_does_not_enter_a_bind_mount(tmp_path: Path, bind: Bind) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / WEIGHTS_MEMBER).write_text("precious")
    where = tmp_path / "tmp"
    where.mkdir()
    bind(data, keras_dir(where))
    scratch.sweep_abandoned(str(where), SCRATCH_PREFIX, (WEIGHTS_MEMBER,))
    assert (data / WEIGHTS_MEMBER).read_text() == "precious"


def test_a_replaced_out_directory_holding_a_bind_mount_is_kept(
    tmp_path: Path, bind: Bind, capsys: pytest.CaptureFixture[str]
) -> None:
    """--force replaces a directory OUT by the names clipcli writes: a folder of those
    names that is a bind mount is not entered; the old directory is kept aside."""
    src = write_model(tmp_path / "m")
    (src / "sub").mkdir()
    (src / "sub" / "config.json").write_text("{}")
    out = tmp_path / "outmd"
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text("precious")
    shutil.rmtree(out / "sub")
    bind(data, out / "sub")
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(out)]) == 0
    assert (data / "config.json").read_text() == "precious"
    assert "kept at" in capsys.readouterr().err
