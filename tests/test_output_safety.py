"""The promises about OUT, under real faults: a second file system, races, changed inputs,
signals at the commit, dead runs' temps, and --force never reaching past what clipcli wrote.

Inputs are built by hand or with the official libraries and outputs read back with them.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import listing, one_error_line
from handmade import write_safetensors
from safetensors.numpy import load_file

from clipcli.cli.entry import main
from clipcli.formats.safetensors import SafetensorsWriter
from clipcli.output import fsops, policy
from clipcli.output import target as output
from clipcli.system import filecopy

FORMATS = (".safetensors", ".npz", ".h5")


def tensors(seed: int = 0, n: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": (rng.standard_normal(n) * 10).astype(np.float32),
        "b": np.arange(8.0),
        "step": np.array(7, dtype=np.int64),
    }


def make_input(path: Path, seed: int = 0, n: int = 4096) -> Path:
    data = tensors(seed, n)
    if path.suffix == ".safetensors":
        write_safetensors(path, data)
    elif path.suffix == ".npz":
        arrays: dict[str, Any] = dict(data)  # numpy types **kwds as bool | ArrayLike
        np.savez(path, **arrays)
    else:
        with h5py.File(path, "w") as handle:
            for name, array in data.items():
                handle.create_dataset(name, data=array)
    return path


def read_back(path: Path) -> dict[str, np.ndarray]:
    """With the official library of each format."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return {k: archive[k] for k in archive.files}
    with h5py.File(path, "r") as handle:
        return {k: handle[k][()] for k in handle}


def make_model(directory: Path, seed: int = 0) -> Path:
    """A two-shard Hugging Face model directory with config and tokenizer files."""
    directory.mkdir()
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    for number in (1, 2):
        shard = f"model-{number:05d}-of-00002.safetensors"
        names = [f"layers.{number}.w", f"layers.{number}.b"]
        data = {n: rng.standard_normal(64).astype(np.float32) for n in names}
        write_safetensors(directory / shard, data, {"format": "pt"})
        weight_map |= dict.fromkeys(names, shard)
    index = {"metadata": {"total_size": 4 * 64 * 4}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    return directory


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def start_clip(
    src: Path, out: str, *flags: str, stderr: Any = subprocess.PIPE
) -> subprocess.Popen[str]:
    """`clipcli clip --global 1 SRC OUT` in a child process (one thread, so that it lasts),
    returned once its temp entry beside OUT exists (or it has already ended)."""
    argv = [sys.executable, "-m", "clipcli", "clip", "--global", "1", *flags, str(src), out]
    env = dict(os.environ, CLIPCLI_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env)
    parent = Path(out.rstrip("/")).parent
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".clipcli-tmp") for p in parent.iterdir()):
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    return proc


# ---------------------------------------------------------------- a second file system


@pytest.mark.parametrize("out_ext", FORMATS)
@pytest.mark.parametrize("limit", ["1e30", "1"])  # nothing changes (kernel copies) / all
def test_output_on_another_file_system(
    tmp_path: Path, mount_tmpfs: Any, out_ext: str, limit: str
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    other = mount_tmpfs("other")
    out = other / f"out{out_ext}"
    assert main(["clip", "--global", limit, "-q", str(src), str(out)]) == 0
    written, original = read_back(out), read_back(src)
    assert sorted(written) == sorted(original)
    if limit == "1e30":
        for name in original:
            assert written[name].tobytes() == original[name].tobytes()
        if out_ext == ".safetensors":
            assert out.read_bytes() == src.read_bytes()
    assert listing(other) == [out.name]


def test_model_directory_onto_another_file_system(tmp_path: Path, mount_tmpfs: Any) -> None:
    model = make_model(tmp_path / "model")
    out = mount_tmpfs("other") / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    written, original = snapshot(out), snapshot(model)
    index = "model.safetensors.index.json"  # rewritten, as save_pretrained lays it out
    assert json.loads(written.pop(index)) == json.loads(original.pop(index))
    assert written == original


@pytest.mark.parametrize(
    "failure",
    [errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, "short", "nothing"],
)
def test_every_kernel_copy_failure_falls_back_to_a_plain_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: int | str
) -> None:
    src = make_input(tmp_path / "in.safetensors", n=300_000)
    calls = []
    real = filecopy.kernel_copy

    def failing(src_fd: int, out_fd: int, count: int, offset: int, position: int) -> int:
        calls.append(count)
        if failure == "short":  # copies a little each time: the rest must still arrive
            return real(src_fd, out_fd, min(count, 1000), offset, position)
        if failure == "nothing":
            return 0
        assert isinstance(failure, int)
        raise OSError(failure, os.strerror(failure))

    monkeypatch.setattr(filecopy, "kernel_copy", failing)
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e30", "-q", str(src), str(out)]) == 0
    assert calls, "the kernel copy was not even tried"
    assert out.read_bytes() == src.read_bytes()


def test_unchanged_tensors_are_kernel_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path is the one taken (same bytes either way, so only a spy can tell)."""
    src = make_input(tmp_path / "in.safetensors")
    copied: list[int] = []
    real = filecopy.kernel_copy

    def spy(src_fd: int, out_fd: int, count: int, offset: int, position: int) -> int:
        copied.append(count)
        return real(src_fd, out_fd, count, offset, position)

    monkeypatch.setattr(filecopy, "kernel_copy", spy)
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e30", "-q", str(src), str(out)]) == 0
    assert sum(copied) == sum(a.nbytes for a in tensors().values())


def test_full_disk_while_writing_compressed_hdf5(tmp_path: Path, mount_tmpfs: Any) -> None:
    """A real ENOSPC inside the HDF5 library: exit 5, one line, nothing left, no crash."""
    src = tmp_path / "in.h5"
    rng = np.random.default_rng(0)
    with h5py.File(src, "w") as handle:
        for i in range(4):
            handle.create_dataset(
                f"t{i}",
                data=rng.standard_normal((512, 512)).astype(np.float32),
                chunks=(64, 64),
                compression="gzip",
            )
    small = mount_tmpfs("small", size="1m")
    proc = subprocess.run(
        [sys.executable, "-m", "clipcli", "clip", "--global", "1", str(src), str(small / "o.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr
    assert "disk full" in one_error_line(proc.stderr)
    assert listing(small) == []


@pytest.mark.parametrize("out_name", ["o.safetensors", "o.npz", "clipped/"])
def test_full_disk_for_every_output_kind(tmp_path: Path, mount_tmpfs: Any, out_name: str) -> None:
    model = make_model(tmp_path / "model")
    big = model / "model-00002-of-00002.safetensors"
    rng = np.random.default_rng(1)
    names = ["layers.2.w", "layers.2.b"]
    write_safetensors(
        big, {n: rng.standard_normal(200_000).astype(np.float32) for n in names}, {"format": "pt"}
    )
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = 2 * 64 * 4 + 2 * 200_000 * 4
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    small = mount_tmpfs("small", size="1m")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipcli",
            "clip",
            "--global",
            "1",
            "--allow-lossy",  # npz holds no metadata: a refused loss otherwise
            str(model),
            f"{small}/{out_name}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr
    # The npz case's warning that the file metadata is dropped (--allow-lossy) is held
    # until the clip succeeds: a failed clip's stderr is its one error line.
    assert "disk full" in one_error_line(proc.stderr)
    assert listing(small) == []


# ---------------------------------------------------------------- never over or into IN


def test_force_never_writes_over_a_shard_or_into_the_input_directory(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    before = snapshot(model)
    shard = model / "model-00001-of-00002.safetensors"
    for out, force in [
        (shard, True),
        (model / "clipped.safetensors", False),
        (model / "clipped.safetensors", True),
        (model / "sub" / "x.safetensors", True),
        (model, True),
        (tmp_path, True),  # contains IN
    ]:
        argv = ["clip", "--global", "1", str(model), str(out)] + (["--force"] if force else [])
        assert main(argv) == 2, out
    assert snapshot(model) == before
    assert listing(tmp_path) == ["model"]


def test_one_file_model_directorys_own_file_is_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", tensors())
    before = snapshot(model)
    argv = ["clip", "--global", "1", "--force", str(model), str(model / "model.safetensors")]
    assert main(argv) == 2
    assert "is the input" in one_error_line(capsys.readouterr().err)
    assert snapshot(model) == before


def test_output_through_a_symlinked_directory_into_the_input(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    (tmp_path / "alias").symlink_to(model)
    before = snapshot(model)
    argv = ["clip", "--global", "1", "--force", str(model), str(tmp_path / "alias" / "o.npz")]
    assert main(argv) == 2
    assert snapshot(model) == before


def test_single_file_into_a_directory_that_contains_it(tmp_path: Path) -> None:
    src = make_input(tmp_path / "in.safetensors")
    assert main(["clip", "--global", "1", "--force", str(src), f"{tmp_path}/"]) == 2
    assert listing(tmp_path) == ["in.safetensors"]


# ---------------------------------------------------------------- --force and what is in the way


def test_force_on_a_directory_of_other_things_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_input(tmp_path / "m.safetensors")
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "run1").mkdir(parents=True)
    make_input(checkpoints / "old.safetensors")
    (checkpoints / "train.log").write_text("loss 1.0\n")
    before = snapshot(checkpoints)
    for out in (str(checkpoints), f"{checkpoints}/"):
        assert main(["clip", "--global", "5", str(src), out, "--force"]) == 2
        assert str(checkpoints) in one_error_line(capsys.readouterr().err)
    assert snapshot(checkpoints) == before
    assert sorted(p.name for p in checkpoints.iterdir()) == ["old.safetensors", "run1", "train.log"]


def test_force_replaces_a_previous_output_directory(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    assert main(["clip", "--global", "1", "-q", str(model), str(out)]) == 2
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 0
    assert listing(tmp_path) == ["clipped", "model"]
    (out / "notes.txt").write_text("mine")
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_single_file_to_an_existing_directory_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_input(tmp_path / "m.safetensors")
    target = tmp_path / "target"
    target.mkdir()
    (target / "x").write_text("x")
    assert main(["clip", "--global", "1", str(src), str(target)]) == 2
    assert "name the file to write inside it" in one_error_line(capsys.readouterr().err)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["clip", "--global", "1", "-q", str(src), str(empty)]) == 0
    assert listing(empty) == ["model.safetensors"]


@pytest.mark.parametrize("out_text", ["clipped"])  # '-' streams now: test_stream_out.py
def test_surprising_out_names_are_refused(
    tmp_path: Path,
    out_text: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = make_input(tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    assert main(["clip", "--global", "1", str(src), out_text]) == 2
    one_error_line(capsys.readouterr().err)
    assert listing(tmp_path) == ["m.safetensors"]


# ---------------------------------------------------------------- races for OUT


def _appear_before_commit(monkeypatch: pytest.MonkeyPatch, make: Callable[[], None]) -> None:
    real = output.Target._commit

    def commit(self: output.Target, staged: Path) -> None:
        make()
        real(self, staged)

    monkeypatch.setattr(output.Target, "_commit", commit)


@pytest.mark.parametrize("appears", ["file", "directory", "empty directory"])
@pytest.mark.parametrize("out_name", ["o.safetensors", "o.h5", "clipped/"])
def test_what_appears_at_out_during_the_run_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, appears: str, out_name: str
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / out_name.rstrip("/")

    def make() -> None:
        if appears == "file":
            out.write_text("someone else's")
        else:
            out.mkdir()
            if appears == "directory":
                (out / "theirs.txt").write_text("someone else's")

    _appear_before_commit(monkeypatch, make)
    assert main(["clip", "--global", "1", "-q", str(src), f"{tmp_path}/{out_name}"]) == 2
    if appears == "file":
        assert out.read_text() == "someone else's"
    elif appears == "directory":
        assert listing(out) == ["theirs.txt"]
    assert listing(tmp_path) == sorted(["in.safetensors", out.name])


@pytest.mark.parametrize("fallback", [False, True])
def test_no_clobber_fallbacks_without_renameat2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    if fallback:
        monkeypatch.setattr(fsops, "renameat2", None)
    src = make_input(tmp_path / "in.safetensors")
    model = make_model(tmp_path / "model")
    for out in ("o.safetensors", "dir/"):
        assert main(["clip", "--global", "1", "-q", str(model), str(tmp_path / out)]) == 0
    assert main(["clip", "--global", "1", "-q", str(src), str(tmp_path / "o.safetensors")]) == 2
    # --force swaps the directory (exchange, or two renames when that is missing)
    assert main(["clip", "--global", "2", "-q", "--force", str(model), str(tmp_path / "dir")]) == 0
    assert listing(tmp_path / "dir") == listing(model)
    assert listing(tmp_path) == ["dir", "in.safetensors", "model", "o.safetensors"]


def test_two_concurrent_runs_to_one_out(tmp_path: Path) -> None:
    src = make_input(tmp_path / "in.safetensors", n=2_000_000)
    out = tmp_path / "out.safetensors"
    argv = [sys.executable, "-m", "clipcli", "clip", "--global", "1", "-q", str(src), str(out)]
    procs = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 2], errors
    assert sorted(load_file(str(out))) == ["a", "b", "step"]
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


# ---------------------------------------------------------------- the input changes


@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("change", ["truncate", "rewrite"])
@pytest.mark.parametrize("when", ["between passes", "while writing"])
def test_input_changed_during_the_run_is_exit_3(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ext: str,
    change: str,
    when: str,
) -> None:
    src = make_input(tmp_path / f"in{ext}")
    larger = make_input(tmp_path / f"other{ext}", seed=5)
    replacement = larger.read_bytes()
    larger.unlink()

    def alter() -> None:
        if change == "truncate":
            os.truncate(src, src.stat().st_size // 2)
        else:  # same inode, rewritten in place
            with open(src, "r+b") as handle:
                handle.write(replacement)

    import clipcli.api as api
    import clipcli.jobs.execution as execution

    module: Any = execution if when == "while writing" else api
    hook = "execute" if when == "while writing" else "plan_clip"
    real = getattr(module, hook)
    done: list[bool] = []

    def altered(*args: Any, **kwargs: Any) -> Any:
        if when == "between passes":
            result = real(*args, **kwargs)
            alter()
            return result
        if not done:
            done.append(True)
            alter()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, hook, altered)
    code = main(["clip", "--global", "10", "-q", str(src), str(tmp_path / f"out{ext}")])
    err = capsys.readouterr().err
    assert code == 3, err
    one_error_line(err)
    assert listing(tmp_path) == [src.name]


def test_input_truncated_by_another_process_mid_clip(tmp_path: Path) -> None:
    """A real second process truncates the HDF5 input while clip writes its output."""
    src = tmp_path / "in.h5"
    rng = np.random.default_rng(0)
    with h5py.File(src, "w") as handle:
        for i in range(12):
            handle.create_dataset(
                f"t{i:02d}", data=rng.standard_normal(4_000_000).astype(np.float32)
            )
    proc = start_clip(src, str(tmp_path / "out.h5"), "--no-fsync")
    # Stopped the moment its temp entry is seen, so the truncation lands mid-run however
    # loaded the machine is (the child cannot commit while it is stopped).
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "finished before the temp file was seen"
    subprocess.run(["truncate", "-s", str(src.stat().st_size // 3), str(src)], check=True)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "no output written" in one_error_line(err)
    assert listing(tmp_path) == ["in.h5"]


# ---------------------------------------------------------------- signals at the commit


def _signal_self_inside(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, sig: int, times: int = 1
) -> list[int]:
    real = getattr(owner, name)
    sent: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if len(sent) < times:
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return sent


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_the_fsync_before_the_commit_leaves_the_old_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int, code: int
) -> None:
    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    sent = _signal_self_inside(monkeypatch, output.Target, "_sync", sig)
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(out)]) == code
    assert sent
    assert out.read_bytes() == b"old"
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


@pytest.mark.parametrize("fallback", [False, True])
def test_signal_during_the_directory_swap_completes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    """After the commit point a signal changes nothing: OUT is whole and the run succeeds.
    With RENAME_EXCHANGE missing, the signal lands between the two renames."""
    model = make_model(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    if fallback:
        monkeypatch.setattr(fsops, "renameat2", None)
        sent = _signal_self_inside(monkeypatch, os, "rename", signal.SIGTERM)
    else:
        sent = _signal_self_inside(monkeypatch, output, "exchange", signal.SIGTERM)
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 0
    assert sent
    assert listing(out) == listing(model)
    norm = np.sqrt(sum(float(np.sum(t.astype(np.float64) ** 2)) for t in _read_dir(out)))
    assert norm <= 1.0
    assert listing(tmp_path) == ["clipped", "model"]


def _read_dir(directory: Path) -> list[np.ndarray]:
    return [a for p in sorted(directory.glob("*.safetensors")) for a in load_file(str(p)).values()]


def test_second_interrupt_during_cleanup_does_not_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path / "model")
    _signal_self_inside(monkeypatch, output.DirectoryTarget, "_sync", signal.SIGINT)
    _signal_self_inside(monkeypatch, output, "remove_tree", signal.SIGINT, times=3)
    assert main(["clip", "--global", "1", "-q", str(model), str(tmp_path / "clipped")]) == 130
    assert listing(tmp_path) == ["model"]


@pytest.mark.slow  # 40 real processes of 100 MB each
@pytest.mark.parametrize("out_name", ["out.safetensors", "out.npz", "out.h5", "clipped/"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_real_signals_at_many_moments(tmp_path: Path, out_name: str, sig: int, code: int) -> None:
    """A real signal at spread-out moments after the output was begun (measuring, writing,
    syncing, renaming): either the run got past its commit point (exit 0, OUT whole) or it
    exits 130/143 with one line, OUT absent and nothing left. Never a traceback, never a
    stray or partial file."""
    src = tmp_path / "in.safetensors"
    rng = np.random.default_rng(2)
    write_safetensors(
        src, {f"t{i}": rng.standard_normal(2_000_000).astype(np.float32) for i in range(12)}
    )
    outcomes = set()
    path = tmp_path / out_name.rstrip("/")
    for delay in (0.0, 0.1, 0.25, 0.5, 0.8):
        proc = start_clip(src, f"{tmp_path}/{out_name}", "-q")
        time.sleep(delay)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        if proc.returncode in (0, -sig):  # -sig: after clip returned, on the way out
            assert not err.strip(), err
            if proc.returncode == 0 or path.exists():
                assert len(read_back(path) if path.is_file() else _read_dir(path)) == 12
            fsops.remove_tree(path)
        else:
            assert proc.returncode == code, err
            assert "no output written" in one_error_line(err)
        assert "Traceback" not in err
        outcomes.add(proc.returncode)
        assert listing(tmp_path) == ["in.safetensors"], (delay, err)
    assert code in outcomes  # at least one signal landed inside a run


# ---------------------------------------------------------------- dead runs' temps


@pytest.mark.slow  # a 64 MB input killed mid-write
def test_sigkill_leaves_a_named_temp_that_the_next_run_removes(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    rng = np.random.default_rng(3)
    write_safetensors(
        src, {f"t{i}": rng.standard_normal(2_000_000).astype(np.float32) for i in range(8)}
    )
    out = tmp_path / "out.safetensors"
    proc = start_clip(src, str(out), "--no-fsync", stderr=subprocess.DEVNULL)
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".clipcli-tmp")]
    assert proc.poll() is None, "finished before the temp file was seen"
    assert temps, "finished before the temp file was seen"
    proc.kill()
    proc.wait()
    assert temps[0].name.startswith(f".out.safetensors.{proc.pid}-")
    assert temps[0].exists()
    assert main(["clip", "--global", "1", "-q", "--no-fsync", str(src), str(out)]) == 0
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


def test_temps_of_live_processes_and_other_names_are_left_alone(tmp_path: Path) -> None:
    src = make_input(tmp_path / "in.safetensors")
    live = tmp_path / f".out.safetensors.{os.getppid()}-0123abcd.clipcli-tmp"
    other = tmp_path / ".other.safetensors.999999999-0123abcd.clipcli-tmp"
    lookalike = tmp_path / ".out.safetensors.notapid.clipcli-tmp"
    for path in (live, other, lookalike):
        path.write_text("x")
    assert main(["clip", "--global", "1", "-q", str(src), str(tmp_path / "out.safetensors")]) == 0
    assert all(p.exists() for p in (live, other, lookalike))


def test_a_stranded_aside_copy_is_put_back(tmp_path: Path) -> None:
    """A run killed between the two renames of the fallback swap left OUT absent and its
    old copy aside: the next run to OUT restores it before doing anything else."""
    model = make_model(tmp_path / "model")
    aside = tmp_path / ".clipped.999999999-0123abcd.clipcli-old"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(aside)]) == 0
    before = snapshot(aside)
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1", "-q", str(model), str(out)]) == 2  # it is back
    assert snapshot(out) == before
    assert listing(tmp_path) == ["clipped", "model"]


# ---------------------------------------------------------------- side files


def test_a_huge_sparse_side_file_is_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path / "model")
    sparse = model / "vocab.bin.txt"
    with open(sparse, "wb") as handle:
        handle.write(b"head")
        handle.seek(1 << 40)  # 1 TiB apparent, a few KiB on disk
        handle.write(b"tail")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1", "-q", str(model), str(out)]) == 2
    assert "vocab.bin.txt" in one_error_line(capsys.readouterr().err)
    assert listing(tmp_path) == ["model"]
    argv = ["clip", "--global", "1", "-q", "--allow-large-side-files", str(model), str(out)]
    assert main(argv) == 0
    copied = out / "vocab.bin.txt"
    assert copied.stat().st_size == sparse.stat().st_size
    assert copied.stat().st_blocks * 512 < 1 << 20  # holes stayed holes
    with open(copied, "rb") as handle:
        assert handle.read(4) == b"head"
        handle.seek(1 << 40)
        assert handle.read() == b"tail"


@pytest.mark.parametrize(("extra", "code"), [(0, 0), (1, 2)])
def test_side_file_limit_is_inclusive(tmp_path: Path, extra: int, code: int) -> None:

    model = make_model(tmp_path / "model")
    with open(model / "big.txt", "wb") as handle:
        handle.truncate(policy.SIDE_FILE_LIMIT + extra)
    assert main(["clip", "--global", "1", "-q", str(model), str(tmp_path / "out")]) == code


def test_every_file_of_a_directory_output_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path / "model")
    synced: set[tuple[int, int]] = set()
    real = os.fsync

    def spy(fd: int) -> None:
        info = os.fstat(fd)
        synced.add((info.st_dev, info.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1", "-q", str(model), str(out)]) == 0
    for path in [out, *out.iterdir()]:
        info = path.stat()
        assert (info.st_dev, info.st_ino) in synced, path
    parent = tmp_path.stat()
    assert (parent.st_dev, parent.st_ino) in synced


def test_writer_failure_midway_leaves_nothing_for_every_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path / "model")

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "write", full)
    for out in ("o.safetensors", "clipped/"):
        assert main(["clip", "--global", "1", "-q", str(model), str(tmp_path / out)]) == 5
    assert listing(tmp_path) == ["model"]


def test_a_missing_input_is_exit_3_even_when_out_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = make_input(tmp_path / "existing.safetensors")
    before = existing.read_bytes()
    missing = tmp_path / "missing.safetensors"
    for force in ([], ["--force"]):
        assert main(["clip", "--global", "1", *force, str(missing), str(existing)]) == 3
        assert "missing.safetensors" in one_error_line(capsys.readouterr().err)
    assert existing.read_bytes() == before


# ---------------------------------------------------------------- the rest of a model directory


def make_sentence_transformer(directory: Path) -> Path:
    """The layout of a sentence-transformers model: modules.json points at 1_Pooling/ and
    2_Normalize/ (empty), beside the same weights in other formats."""
    make_model(directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (directory / "2_Normalize").mkdir()
    (directory / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    for weights in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "model.gguf"):
        (directory / weights).write_bytes(b"unclipped weights")
    (directory / "onnx").mkdir()
    (directory / "onnx" / "model.onnx").write_bytes(b"unclipped weights")
    (directory / ".git" / "lfs").mkdir(parents=True)
    (directory / ".git" / "lfs" / "object").write_bytes(b"unclipped weights")
    return directory


def test_model_directory_keeps_every_other_file_and_names_what_it_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_sentence_transformer(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1", "-q", str(model), str(out)]) == 0
    kept = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert kept == [
        "1_Pooling",
        "1_Pooling/config.json",
        "2_Normalize",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
    ]
    for name in ("1_Pooling/config.json", "modules.json", "sentence_bert_config.json"):
        assert (out / name).read_bytes() == (model / name).read_bytes()
    notes = capsys.readouterr().err.strip().splitlines()
    left_out = sorted(line.split("left out ")[1].split(":")[0] for line in notes)
    assert left_out == [
        ".git",
        "flax_model.msgpack",
        "model.gguf",
        "onnx",
        "pytorch_model.bin",
        "tf_model.h5",
    ]
    assert all(line.startswith("clipcli: note: left out ") for line in notes)


def test_force_replaces_an_output_with_subfolders_but_not_a_strangers_file(
    tmp_path: Path,
) -> None:
    model = make_sentence_transformer(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 0
    (out / "1_Pooling" / "mine.txt").write_text("mine")
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 2
    assert (out / "1_Pooling" / "mine.txt").read_text() == "mine"


# ---------------------------------------------------------------- found by the attack


def _bind_mount(source: Path, target: Path) -> None:
    target.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")


def _unmount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_out_inside_the_input_through_a_bind_mount(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    before = snapshot(model)
    alias = tmp_path / "alias"
    _bind_mount(model, alias)
    try:
        for force in ([], ["--force"]):
            out = alias / "clipped.safetensors"
            assert main(["clip", "--global", "1", *force, str(model), str(out)]) == 2
    finally:
        _unmount(alias)
    assert snapshot(model) == before


def test_out_containing_the_input_through_a_bind_mount(tmp_path: Path) -> None:
    """--force on OUT = another path to the directory that holds IN: the swap would have
    deleted the input (it held only a name clipcli writes)."""
    (tmp_path / "x").mkdir()
    src = make_input(tmp_path / "x" / "model.safetensors")
    before = src.read_bytes()
    alias = tmp_path / "alias"
    _bind_mount(tmp_path, alias)
    try:
        argv = ["clip", "--global", "5", "--force", str(src), f"{alias}/x/"]
        assert main(argv) == 2
    finally:
        _unmount(alias)
    assert src.read_bytes() == before


def test_long_out_names_that_share_a_prefix_do_not_share_temps(tmp_path: Path) -> None:
    src = make_input(tmp_path / "in.safetensors")
    stem = "x" * 200
    a, b = tmp_path / f"{stem}A.safetensors", tmp_path / f"{stem}B.safetensors"
    aside_a = tmp_path / f"{fsops.temp_prefix(a)}999999999-deadbeef.clipcli-old"
    aside_a.write_text("precious old A")
    assert fsops.temp_prefix(a) != fsops.temp_prefix(b)
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(b)]) == 0
    assert aside_a.read_text() == "precious old A"
    assert not a.exists()


@pytest.mark.parametrize("name", ["😀" * 60 + ".npz", "y" * 250 + ".npz"])
def test_out_names_up_to_name_max_bytes(tmp_path: Path, name: str) -> None:
    src = make_input(tmp_path / "in.safetensors")
    assert len(os.fsencode(name)) <= 255
    assert main(["clip", "--global", "1", "-q", str(src), str(tmp_path / name)]) == 0
    assert listing(tmp_path) == sorted(["in.safetensors", name])


@pytest.mark.slow  # one full-disk run per moment of the write
def test_full_disk_at_every_moment_of_a_compressed_hdf5_write(
    tmp_path: Path, mount_tmpfs: Any
) -> None:
    """The disk fills at a different moment for each size: while writing chunks, at the
    final flush, at close. Every one is exit 5 with one line, never 70 or a crash."""
    src = tmp_path / "in.h5"
    rng = np.random.default_rng(0)
    with h5py.File(src, "w") as handle:
        for i in range(8):
            handle.create_dataset(
                f"t{i}",
                data=rng.standard_normal(100_000).astype(np.float32),
                chunks=(10_000,),
                compression="gzip",
            )
    codes = set()
    for kib in (64, 512, 1024, 1536, 2048, 2600, 2870, 2910):
        disk = mount_tmpfs(f"d{kib}", size=f"{kib}k")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "clipcli",
                "clip",
                "--global",
                "5",
                str(src),
                str(disk / "o.h5"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        codes.add(proc.returncode)
        if proc.returncode != 0:
            assert proc.returncode == 5, (kib, proc.stderr)
            assert "disk full" in one_error_line(proc.stderr)
            assert listing(disk) == []
    assert 5 in codes


def test_modes_inside_a_directory_output_follow_the_input(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    for path in model.iterdir():
        path.chmod(0o600)
    (model / "config.json").chmod(0o640)
    src = make_input(tmp_path / "private.safetensors")
    src.chmod(0o600)
    old = os.umask(0o022)
    try:
        assert main(["clip", "--global", "1", "-q", str(model), str(tmp_path / "o1")]) == 0
        assert main(["convert", "-q", str(src), f"{tmp_path}/o2/"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat_mode(p) for p in (tmp_path / "o1").iterdir()}
    assert modes.pop("config.json") == 0o640
    assert set(modes.values()) == {0o600}, modes
    assert stat_mode(tmp_path / "o2" / "model.safetensors") == 0o600


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_a_file_put_into_the_replaced_directory_at_the_last_moment_survives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    real = output.DirectoryTarget._remove_replaced

    def stranger_arrives(self: output.DirectoryTarget, old: Path) -> None:
        (old / "theirs.txt").write_text("not clipcli's")
        real(self, old)

    monkeypatch.setattr(output.DirectoryTarget, "_remove_replaced", stranger_arrives)
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(out)]) == 0
    kept = [p for p in tmp_path.iterdir() if p.name.endswith(".clipcli-kept")]
    assert len(kept) == 1
    assert (kept[0] / "theirs.txt").read_text() == "not clipcli's"
    assert "kept at" in capsys.readouterr().err
    # and a later run never removes a kept copy
    assert main(["clip", "--global", "2", "-q", "--force", str(model), str(out)]) == 0
    assert (kept[0] / "theirs.txt").exists()


def test_a_live_runs_temp_is_never_removed_whatever_its_pid(tmp_path: Path) -> None:
    """The pid in a temp name means nothing in another PID namespace: liveness is the
    run's flock on its work directory."""
    import fcntl

    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    live = tmp_path / f"{fsops.temp_prefix(out)}999999999-0123abcd.clipcli-tmp"
    live.mkdir()
    (live / "out.safetensors").write_bytes(b"partial")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
        assert (live / "out.safetensors").exists()
    finally:
        os.close(fd)  # the owner is gone now
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(out)]) == 0
    assert not live.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_after_the_commit_point_is_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int
) -> None:
    import clipcli.cli.commands.write as command  # clip's body prints the report from there

    src = make_input(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    _signal_self_inside(monkeypatch, command, "print_report", sig)
    assert main(["clip", "--global", "1", str(src), str(out)]) == 0
    assert sorted(load_file(str(out))) == ["a", "b", "step"]


def test_a_folder_swapped_between_the_check_and_the_open_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The side file is checked by name, then opened: a folder on its way swapped for a
    link out in between must not get an outside file copied into OUT (found by a racing
    attacker; made deterministic here by swapping inside the open)."""
    import clipcli.formats.sharded.reader as sharded

    model = make_model(tmp_path / "model")
    (model / "sub").mkdir()
    (model / "sub" / "passwd").write_text("harmless")
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "passwd").write_text("TOPSECRET")
    real_open = sharded.open_input  # type: ignore[attr-defined]  # imported there, patched here

    def swapping_open(path: Path) -> Any:
        if path.name != "passwd":
            return real_open(path)
        (model / "sub").rename(tmp_path / "sub-aside")  # swap the folder for a link out,
        (model / "sub").symlink_to(secrets_dir)
        try:
            return real_open(path)
        finally:  # and back, so that the input's identity looks unchanged afterwards
            (model / "sub").unlink()
            (tmp_path / "sub-aside").rename(model / "sub")

    monkeypatch.setattr(sharded, "open_input", swapping_open)
    out = tmp_path / "out"
    assert main(["clip", "--global", "5", "-q", str(model), str(out)]) == 3
    assert not out.exists()
    assert listing(tmp_path) == ["model", "secrets"]  # no temp, no OUT
