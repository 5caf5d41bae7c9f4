"""Every command is a good citizen of its process environment (issue 18, items 10-14):
signals during read-only commands, locales that cannot encode a name, a full or missing
$TMPDIR, RLIMIT_NPROC and RLIMIT_AS all end in one stderr line and a documented exit code,
never 70, exit 1 or a traceback, and leave no temp behind.

Every fault is real: real signals to a real process stopped at a known point (it stops
itself with SIGSTOP right after its first write into the temp directory, or as the
measuring pass starts), real tmpfs mounts and read-only bind mounts, real rlimits
(`prlimit`, as an ordinary user for NPROC, which root ignores). Norms are checked against
numpy's float64 sums, not clipcli's own arithmetic.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import one_error_line
from layouts import write_keras
from safetensors.numpy import load_file, save_file

from clipcli.errors import WriteError
from clipcli.system import address_space, parallel, scratch

CLIPCLI = [sys.executable, "-m", "clipcli"]

# `python -m clipcli`, stopping itself (SIGSTOP) the first time STOP_AT (if set) is
# called, after the call returns: the parent then knows exactly where the run is when it
# signals. Column-major npz members of any size go through the temp directory (as those
# over 32 MiB do), so that small files show it.
STOPPING_CLIPCLI = """
import importlib, os, signal, sys
if os.environ.get("STOP_AT"):
    module_name, function = os.environ["STOP_AT"].split(":")
    module = importlib.import_module(module_name)
    real = getattr(module, function)

    def stopping(*args, **kwargs):
        setattr(module, function, real)
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGSTOP)
        return result

    setattr(module, function, stopping)
import clipcli.formats.npz.reader as npz_reader
npz_reader.FORTRAN_IN_MEMORY_BYTES = 0
sys.argv[0] = "clipcli"
from clipcli.__main__ import run
run()
"""


def _one_line(stderr: str, *fragments: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("clipcli: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _keras(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tensors = {f"layers/d{i}/vars/0": rng.standard_normal((256, 96), np.float32) for i in range(3)}
    weights = path.with_name("weights.h5")
    with h5py.File(weights, "w") as f:
        for name, array in tensors.items():
            f[name] = array
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", b"{}")
        archive.write(weights, "model.weights.h5", zipfile.ZIP_STORED)
    weights.unlink()
    return tensors


def _fortran_npz(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    tensors = {"w": np.asfortranarray(rng.standard_normal((256, 128), np.float32))}
    np.savez_compressed(path, w=tensors["w"])
    return tensors


def _safetensors(path: Path, name: str = "w", elements: int = 1 << 10) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    tensors = {name: rng.standard_normal(elements, np.float32), "b": np.arange(3, dtype=np.float32)}
    save_file(tensors, str(path))
    return tensors


def _exact_global_norm(tensors: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors.values()))


INPUTS: dict[str, Callable[[Path], dict[str, np.ndarray]]] = {
    "m.keras": _keras,
    "m.npz": _fortran_npz,
    "m.safetensors": _safetensors,
}


def _argv(command: str, src: Path, out_dir: Path) -> list[str]:
    if command == "diff":
        return ["diff", str(src), str(src)]
    if command == "clip":
        return ["clip", "--global", "1", "--no-fsync", str(src), str(out_dir / f"o{src.suffix}")]
    return [command, str(src)]


# ------------------------------------------------------------------ item 10: signals

SIGNALS = [(signal.SIGTERM, 143, "terminated by SIGTERM"), (signal.SIGHUP, 129,
           "terminated by SIGHUP"), (signal.SIGINT, 130, "interrupted")]  # fmt: skip


def _signalled_run(
    argv: list[str], stop_at: str, sig: int, env: dict[str, str]
) -> tuple[int, str, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPING_CLIPCLI, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env, STOP_AT=stop_at),
    )
    _, status = os.waitpid(child.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        child.kill()
        pytest.fail(f"the run ended before reaching {stop_at} (status {status})")
    child.send_signal(sig)
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=120)
    return child.returncode, out, err


@pytest.mark.parametrize(("sig", "code", "words"), SIGNALS)
@pytest.mark.parametrize("command", ["ls", "norms", "diff"])
@pytest.mark.parametrize("name", ["m.keras", "m.npz"])
def test_signal_while_unpacking_to_tmpdir_is_one_line_and_no_temp(
    tmp_path: Path, command: str, name: str, sig: int, code: int, words: str
) -> None:
    """The run stops itself right after its first write into a private $TMPDIR (a .keras
    archive's weights, a column-major npz member being reordered); the signal comes
    then. Before: SIGTERM/SIGHUP killed it with no line and left the unpacked weights."""
    if command == "ls" and name == "m.npz":
        pytest.skip("ls of an npz reads headers only: nothing goes to $TMPDIR")
    src = tmp_path / name
    INPUTS[name](src)
    scratch_dir = tmp_path / "tmp"
    scratch_dir.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch_dir), CLIPCLI_THREADS="1")
    returncode, out, err = _signalled_run(
        _argv(command, src, tmp_path), "clipcli.system.scratch:write_at", sig, env
    )
    assert returncode == code, (err, out)
    assert _one_line(err, words) == f"clipcli: error: {words}"
    assert out == ""
    assert os.listdir(scratch_dir) == []


@pytest.mark.parametrize(("sig", "code", "words"), SIGNALS)
@pytest.mark.parametrize("command", ["norms", "diff"])
def test_signal_while_measuring_any_input_is_one_line(
    tmp_path: Path, command: str, sig: int, code: int, words: str
) -> None:
    """No temp at all (safetensors): the signal still ends the run with its line and code
    at the next chunk, not silently (SIGTERM, SIGHUP) and not with a report."""
    src = tmp_path / "m.safetensors"
    _safetensors(src)
    returncode, out, err = _signalled_run(
        _argv(command, src, tmp_path), "clipcli.jobs.pipeline:reduce_stream", sig, dict(os.environ)
    )
    assert returncode == code, (err, out)
    _one_line(err, words)
    assert out == ""


@pytest.mark.parametrize(("sig", "code", "words"), SIGNALS[:2])
def test_signal_during_a_clip_of_a_keras_leaves_nothing(
    tmp_path: Path, sig: int, code: int, words: str
) -> None:
    src = tmp_path / "m.keras"
    _keras(src)
    scratch_dir, out_dir = tmp_path / "tmp", tmp_path / "out"
    scratch_dir.mkdir()
    out_dir.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch_dir))
    returncode, _, err = _signalled_run(
        _argv("clip", src, out_dir), "clipcli.system.scratch:write_at", sig, env
    )
    assert returncode == code
    _one_line(err, words, "no output written")
    assert os.listdir(scratch_dir) == []
    assert os.listdir(out_dir) == []


def test_norms_into_a_closed_pipe_is_quiet_and_removes_its_temps(tmp_path: Path) -> None:
    """`norms | head -1` (SIGPIPE is ignored by Python, so EPIPE): exit 0, nothing on
    stderr, as documented, and the .keras weights unpacked for it are gone."""
    src = tmp_path / "m.keras"
    _keras(src)
    scratch_dir = tmp_path / "tmp"
    scratch_dir.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch_dir))
    done = subprocess.run(
        f"set -o pipefail; {' '.join(CLIPCLI)} norms {src} | head -1",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(str(src))
    assert os.listdir(scratch_dir) == []


# ------------------------------------------------------------------ item 11: encodings

ENCODINGS = [
    {"LC_ALL": "C", "PYTHONUTF8": "0"},
    {"PYTHONIOENCODING": "ascii", "PYTHONUTF8": "0"},
]


def _ascii_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIO"))}
    env.pop("LANG", None)
    return dict(env, **extra)


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["LC_ALL=C", "PYTHONIOENCODING=ascii"])
@pytest.mark.parametrize(
    "options",
    [
        ["ls"],
        ["ls", "--format", "csv"],
        ["norms"],
        ["norms", "--format", "json"],
        ["norms", "--format", "csv"],
        ["norms", "--chart", "--limit", "1"],
    ],
    ids=" ".join,
)
def test_reports_escape_what_the_encoding_cannot_hold(
    tmp_path: Path, encoding: dict[str, str], options: list[str]
) -> None:
    """Before: ls exited 70 (UnicodeEncodeError) on the tensor name 'wé'."""
    src = tmp_path / "m.safetensors"
    tensors = _safetensors(src, name="wé")
    done = subprocess.run(
        [*CLIPCLI, *options, str(src)],
        capture_output=True,
        env=_ascii_env(encoding),
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    text = done.stdout.decode("ascii")  # every byte is ASCII
    if "json" in options:
        names = [row["name"] for row in json.loads(text)["tensors"]]
        assert sorted(names) == sorted(tensors)  # JSON escapes losslessly: \u00e9
    else:
        assert "w\\xe9" in text
    if options == ["ls"]:  # drawn in ASCII: the columns still line up
        widths = {len(line) for line in text.splitlines()[1:] if line.startswith(("+", "|"))}
        assert len(widths) == 1, text


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["LC_ALL=C", "PYTHONIOENCODING=ascii"])
def test_clip_reports_after_its_commit_instead_of_exit_70(
    tmp_path: Path, encoding: dict[str, str]
) -> None:
    """Before: clip committed OUT, then its report raised UnicodeEncodeError: exit 70."""
    src = tmp_path / "m.safetensors"
    tensors = _safetensors(src, name="wé")
    out = tmp_path / "out.safetensors"
    done = subprocess.run(
        [*CLIPCLI, "clip", "--global", "1", "--no-fsync", str(src), str(out)],
        capture_output=True,
        env=_ascii_env(encoding),
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    assert "w\\xe9" in done.stdout.decode("ascii")
    clipped = load_file(str(out))  # the official reader
    assert sorted(clipped) == sorted(tensors)
    assert _exact_global_norm(clipped) <= 1.0


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["LC_ALL=C", "PYTHONIOENCODING=ascii"])
def test_error_lines_notes_and_plot_names_are_escaped(
    tmp_path: Path, encoding: dict[str, str]
) -> None:
    src = tmp_path / "m.safetensors"
    _safetensors(src)
    env = _ascii_env(encoding)
    missing = subprocess.run(
        [*CLIPCLI, "ls", str(tmp_path / "é.safetensors")], capture_output=True, env=env
    )
    assert missing.returncode == 3
    _one_line(missing.stderr.decode("ascii"), "no such file")
    picture = tmp_path / "pé.png"
    picture.write_bytes(b"")
    plot = subprocess.run(
        [*CLIPCLI, "norms", "--plot", str(picture), str(src)], capture_output=True, env=env
    )
    assert plot.returncode == 2
    _one_line(plot.stderr.decode("ascii"), "exists")
    note = subprocess.run(
        [*CLIPCLI, "norms", "-i", "*", "-i", "é*", str(src)], capture_output=True, env=env
    )
    assert note.returncode == 0, note.stderr
    assert note.stderr.decode("ascii").startswith("clipcli: warning:"), note.stderr


# ------------------------------------------------------------------ item 12: $TMPDIR


@pytest.mark.parametrize("command", ["ls", "norms", "diff", "clip"])
@pytest.mark.parametrize("name", ["m.keras", "m.npz"])
def test_a_full_tmpdir_is_exit_5_naming_it(
    tmp_path: Path, mount_tmpfs: Any, command: str, name: str
) -> None:
    """Before: exit 3 blaming the input ("cannot read data: No space left on device")."""
    if command == "ls" and name == "m.npz":
        pytest.skip("ls of an npz reads headers only: nothing goes to $TMPDIR")
    src = tmp_path / name
    INPUTS[name](src)
    full = mount_tmpfs("tmp", size="64k")  # room for tempfile's probe, not for the data
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = _argv(command, src, out_dir)
    code = [sys.executable, "-c", STOPPING_CLIPCLI, *argv]  # any size through $TMPDIR
    env = dict(os.environ, TMPDIR=str(full), STOP_AT="")
    done = subprocess.run(code, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 5, done.stderr
    _one_line(done.stderr, f"temporary directory {full}", "disk full")
    assert os.listdir(full) == []
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("command", ["ls", "norms", "clip"])
def test_no_usable_tmpdir_is_exit_5(tmp_path: Path, command: str) -> None:
    """$TMPDIR missing, and every fallback (/tmp, /var/tmp, the current directory)
    read-only: real read-only bind mounts in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    src = tmp_path / "m.keras"
    _keras(src)
    readonly = " && ".join(
        f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"
        for d in ("/tmp", "/var/tmp", str(tmp_path))
        if os.path.isdir(d)
    )
    argv = " ".join(_argv(command, src, tmp_path))
    script = f"{readonly} && cd {tmp_path} && exec {' '.join(CLIPCLI)} {argv}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmp_path / "missing")),
        timeout=120,
    )
    if "mount" in done.stderr and "clipcli" not in done.stderr:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    assert done.returncode == 5, done.stderr
    _one_line(done.stderr, "no usable temporary directory", str(tmp_path / "missing"))


# ------------------------------------------------------------------ item 13: RLIMIT_NPROC

# An ordinary user, so that RLIMIT_NPROC applies, who can still read root's interpreter
# and the test's files (CAP_DAC_*, which leave the NPROC check in force).
AS_NOBODY = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=+dac_override,+dac_read_search",
    "--ambient-caps=+dac_override,+dac_read_search",
]


def _nobody_can_start_threads() -> bool:
    probe = subprocess.run(
        [*AS_NOBODY, sys.executable, "-c", "import threading; threading.Thread().start()"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.parametrize("nproc", [1, 2, 3])
@pytest.mark.parametrize("command", ["norms", "diff", "clip"])
def test_no_thread_to_start_falls_back_to_one(tmp_path: Path, command: str, nproc: int) -> None:
    """RLIMIT_NPROC reached: every thread, or all but a few, cannot start. Before: exit
    70 (RuntimeError: can't start new thread). 32 MiB: measured in worker threads."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not _nobody_can_start_threads():
        pytest.skip("needs root, setpriv and ambient capabilities")
    src = tmp_path / "m.safetensors"
    tensors = _safetensors(src, elements=8 << 20)
    argv = _argv(command, src, tmp_path)
    if command != "diff":
        argv.insert(1, "--format=json")
    done = subprocess.run(
        [*AS_NOBODY, "prlimit", f"--nproc={nproc}", *CLIPCLI, *argv],
        capture_output=True,
        text=True,
        env=dict(os.environ, CLIPCLI_THREADS="4"),
        timeout=300,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    reference = _exact_global_norm(tensors)
    if command == "norms":
        assert json.loads(done.stdout)["global_norm"] == pytest.approx(reference, rel=1e-12)
    if command == "clip":
        assert json.loads(done.stdout)["global_norm_before"] == pytest.approx(reference, rel=1e-12)
        assert _exact_global_norm(load_file(str(tmp_path / "o.safetensors"))) <= 1.0


def test_ordered_map_runs_inline_when_no_thread_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(_self: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(parallel, "_POOLS", {})
    assert list(parallel.ordered_map(lambda x: x * x, range(100), workers=7)) == [
        x * x for x in range(100)
    ]
    assert parallel._POOLS == {}  # not kept: a later call tries again


# ------------------------------------------------------------------ item 14: RLIMIT_AS


_RUN_TO_RUN_MIB = 4


def _limited(
    mib: int, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["prlimit", f"--as={mib << 20}", *CLIPCLI, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _check_limited(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode in (0, 5), (done.returncode, done.stderr)
    if done.returncode == 5:
        _one_line(done.stderr, "out of memory")
    else:
        assert done.stderr == ""


# A module compiled at start-up under an address-space limit (no bytecode cached) may fail
# in compile() with CPython's SystemError instead of a MemoryError: made to happen here
# at a known point, the first import of the command's modules.
COMPILE_FAILS = """
import builtins, resource, sys
import clipcli.__main__ as entry
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (1 << 40, hard))  # a limit is set, far above use
real_import = builtins.__import__
failing, error = sys.argv[-2:]
memory_gone = False
def failing_import(name, *args, **kwargs):
    # Once memory has run out, no import succeeds: not the handler's, not `resource`.
    global memory_gone
    if memory_gone:
        raise MemoryError()
    if name == failing:
        memory_gone = True
        raise eval(error)
    return real_import(name, *args, **kwargs)
builtins.__import__ = failing_import
sys.argv = ["clipcli", *sys.argv[1:-2]]
entry.run()
"""
COMPILE_ERRORS = [
    'SystemError("<built-in function compile> returned NULL without setting an exception")',
    "ValueError(\"field 'target' is required for AnnAssign\")",
    "OSError(12, 'Cannot allocate memory', '/tmp')",  # importlib listing a folder
]


@pytest.mark.parametrize("error", COMPILE_ERRORS)
@pytest.mark.parametrize("module", ["clipcli.jobs.execution", "clipcli.api"])
def test_a_compile_refused_at_start_up_is_out_of_memory(
    tmp_path: Path, module: str, error: str
) -> None:
    """Before: a traceback and exit 1 (seen at `prlimit --as` 16 MiB, and at 15 MiB as the
    compiler's ValueError, with no bytecode cached), and nothing written. Every import
    after the failure fails too, as when memory is gone: the handler must need none (it
    imported its classifier, which imported `resource`: a chained traceback, or a failed
    `import resource` read as "no limit set", at 16,000 KiB; an ENOMEM was exit 70)."""
    src = tmp_path / "m.safetensors"
    INPUTS["m.safetensors"](src)
    argv = ["clip", "--global", "1", str(src), str(tmp_path / "out.safetensors"), module, error]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FAILS, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 5, done.stderr
    _one_line(done.stderr, "out of memory")
    assert "required" not in done.stderr
    assert "NULL" not in done.stderr
    assert "Errno" not in done.stderr
    assert not (tmp_path / "out.safetensors").exists()


FINALIZATION_FAILS = """
import sys
import clipcli.__main__ as entry
import clipcli.cli.entry

class FailsWhenFinalized:  # as an object does when memory is short at exit
    def __del__(self):
        raise MemoryError()

sys.modules["clipcli"].held_until_exit = FailsWhenFinalized()
clipcli.cli.entry.main = lambda: int(sys.argv.pop())  # the command's exit code
sys.argv = ["clipcli", "ls", *sys.argv[1:]]
entry.run()
"""


@pytest.mark.parametrize("code", [5, 0, 3])
def test_out_of_memory_leaves_without_the_interpreters_finalization(code: int) -> None:
    """Exit 5 ends the process at once (its one line said, output flushed): the
    interpreter's finalization, short of memory too, printed "MemoryError: " lines after
    it (attack s38, `prlimit --as` 19,250 KiB). Other exits finalize as before."""
    done = subprocess.run(
        [sys.executable, "-c", FINALIZATION_FAILS, "m.safetensors", str(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    assert ("MemoryError" in done.stderr) is (code != 5), done.stderr


def test_only_the_compilers_lost_node_under_a_limit_is_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiler's ValueError is out of memory only in its own words and only while an
    address-space limit is set (without one, an allocation does not fail); any other
    ValueError is a bug (exit 70 at the boundary)."""
    lost = ValueError("field 'target' is required for AnnAssign")
    monkeypatch.setattr(address_space, "_limited", lambda: True)
    assert address_space.refused_memory(lost)
    assert not address_space.refused_memory(ValueError("field 'target' is required"))
    assert not address_space.refused_memory(ValueError("field 'a b' is required for AnnAssign"))
    assert not address_space.refused_memory(ValueError("could not convert string to float: 'x'"))
    monkeypatch.setattr(address_space, "_limited", lambda: False)
    assert not address_space.refused_memory(lost)


def test_an_enomem_is_out_of_memory_and_no_other_errno() -> None:
    """A system call's ENOMEM is memory refused, limit or not (importlib listing a folder at
    `prlimit --as` 13 MiB was exit 70); EIO, ENOSPC and an errno-less OSError are not."""
    assert address_space.refused_memory(OSError(errno.ENOMEM, "Cannot allocate memory", "/tmp"))
    for other in (errno.EIO, errno.ENOSPC, errno.EMFILE):
        assert not address_space.refused_memory(OSError(other, os.strerror(other)))
    assert not address_space.refused_memory(OSError("no errno"))
    assert address_space.memory_detail(OSError(errno.ENOMEM, "Cannot allocate memory")) == ""
    assert address_space.memory_detail(MemoryError("the limit leaves 3 MiB")) == (
        ": the limit leaves 3 MiB"
    )
    assert address_space.memory_detail(MemoryError()) == ""


@pytest.mark.parametrize("mib", [16, 32, 48, 64, 96, 128, 160, 192])
@pytest.mark.parametrize("command", ["ls", "norms", "clip", "diff"])
@pytest.mark.parametrize("name", ["m.safetensors", "m.keras", "m.npz"])
def test_an_address_space_limit_is_one_line_and_exit_5(
    tmp_path: Path, command: str, name: str, mib: int
) -> None:
    """Before: a traceback and exit 1 (--fail-above's code), or OpenBLAS's exit(1)."""
    src = tmp_path / name
    INPUTS[name](src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = _limited(mib, _argv(command, src, out_dir))
    _check_limited(done)
    written = command == "clip" and done.returncode == 0
    assert os.listdir(out_dir) == ([f"o{src.suffix}"] if written else [])  # no temp left


@pytest.mark.slow  # several seconds: many processes or files
@pytest.mark.parametrize("command", ["ls", "norms", "clip", "diff"])
def test_just_above_and_below_what_a_run_needs(tmp_path: Path, command: str) -> None:
    """The smallest limit (in MiB) at which the run succeeds, found by bisection; that
    limit and the one below it: success, and one line with exit 5."""
    src = tmp_path / "m.keras"
    _keras(src)
    argv = _argv(command, src, tmp_path)
    # One worker: a thread that cannot start is left out (system.parallel), so with two
    # the need is not monotonic in the limit: just at the edge the second worker's stack
    # does not fit, it never starts and the run needs less than a few MiB above it, where
    # it starts (diff of a .keras: 134 MiB ran, 136 ran out). Every limit with the default
    # workers is test_an_address_space_limit_is_one_line_and_exit_5's.
    env = dict(os.environ, CLIPCLI_THREADS="1")
    low, high = 8, 512  # fails at low, succeeds at high
    done = _limited(high, argv, env)
    assert done.returncode == 0, done.stderr
    while high - low > 1:
        middle = (low + high) // 2
        (tmp_path / "o.keras").unlink(missing_ok=True)
        done = _limited(middle, argv, env)
        _check_limited(done)
        low, high = (low, middle) if done.returncode == 0 else (middle, high)
    (tmp_path / "o.keras").unlink(missing_ok=True)
    _check_limited(_limited(low, argv, env))
    # What a run maps varies by a MiB or so from run to run (address-space layout, the
    # allocator): the edge the bisection found is not exact, one MiB below it is judged by
    # _check_limited like any other, and a few MiB above it the run must succeed.
    _check_limited(_limited(high, argv, env))
    (tmp_path / "o.keras").unlink(missing_ok=True)
    done = _limited(high + _RUN_TO_RUN_MIB, argv, env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("left", "fails"), [(100 << 20, False), ((100 << 20) - 1, True), (0, True)]
)
def test_room_exactly_at_the_need_is_enough(left: int, fails: bool) -> None:
    used = 40 << 20
    problem = address_space.room_problem(used + left, used, 100 << 20, "loading numpy")
    assert (problem is not None) == fails
    if fails:
        assert problem is not None
        assert "loading numpy needs about 100 MiB" in problem


def test_a_memory_error_in_a_command_is_exit_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipcli.cli.entry import main
    from clipcli.jobs import pipeline

    src = tmp_path / "m.safetensors"
    _safetensors(src)

    def no_memory(*_args: object, **_kwargs: object) -> None:
        raise MemoryError("Unable to allocate 8.00 MiB")

    monkeypatch.setattr(pipeline, "reduce_stream", no_memory)
    assert main(["norms", str(src)]) == 5
    _one_line(capsys.readouterr().err, "out of memory: Unable to allocate 8.00 MiB")


def test_our_own_symbols_are_spelt_in_ascii_where_the_stream_cannot_hold_them(
    tmp_path: Path,
) -> None:
    """`‖A−B‖` in diff's titles and footer was written as `\\u2016A\\u2212B\\u2016`, wider than
    its column (found by the newcomer). Every table line is then as wide as the others."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(a))
    save_file({"w": np.array([1, 2, 3], np.float32)}, str(b))
    env = dict(os.environ, PYTHONIOENCODING="ascii", COLUMNS="120")
    done = subprocess.run(
        [*CLIPCLI, "diff", str(a), str(b)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "\\u" not in done.stdout
    assert "||A-B||/||A||" in done.stdout
    assert "||A-B|| 2.23607" in done.stdout
    table = [line for line in done.stdout.splitlines() if line[:1] in "+|"]
    assert len({len(line) for line in table}) == 1, table


# ----------------------------------------- issue 18's cleanup attack, item 5: $TMPDIR
# A missing or read-only $TMPDIR fell back to /tmp, /var/tmp and then the working
# directory: TMPDIR, where set, is the only candidate; else /tmp, /var/tmp, /usr/tmp.


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
