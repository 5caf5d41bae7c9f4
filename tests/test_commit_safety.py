"""The commit never re-resolves OUT's path (threat model, open item 6).

A process that can rename a folder on OUT's path (OUT under a directory it owns) swaps
it, after clipcli checked OUT, for a symlink into IN's folder: `mv d d2; ln -s IN_DIR d`.
If any later step looked OUT's directory up by name again, --force would replace IN (or
a file of an input model directory) with the clipped copy. clipcli opens OUT's directory
once, when it checks OUT, and does the sweep, the work directory, the writer's files, the
commit and the --force swap relative to that descriptor; the input footprint is checked
against it again before the commit. So after such a swap IN is byte-identical and the
run either wrote into the directory it checked (the original `d`, now at `d2`) or was
refused with one line.

The swaps are real renames and symlinks, made at known points: in-process, from inside a
function that runs between the check and the commit; and to a real child process stopped
with SIGSTOP once its temp entry appears. Inputs are written and outputs read back with
the official libraries (safetensors, numpy, h5py), and compared with IN's bytes as they
were before the run.
"""

from __future__ import annotations

import json
import os
import shutil
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
from expect import listing, one_error_line, tree
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.output import fsops
from clipcli.output import target as output

FILE_NAMES = ("model.safetensors", "model.npz", "model.h5")


def weights(seed: int = 0, n: int = 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": (rng.standard_normal(n) * 10).astype(np.float32),
        "b": np.arange(8.0, dtype=np.float32),
    }


def write_input(path: Path, seed: int = 0, n: int = 256) -> Path:
    """A checkpoint in the format of path's extension, by the format's official writer."""
    data = weights(seed, n)
    if path.suffix == ".safetensors":
        save_file(data, str(path))
    elif path.suffix == ".npz":
        np.savez(path, w=data["w"], b=data["b"])
    else:
        with h5py.File(path, "w") as handle:
            for name, array in data.items():
                handle.create_dataset(name, data=array)
    return path


def read_back(path: Path) -> dict[str, np.ndarray]:
    """With the format's official reader."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return {k: archive[k] for k in archive.files}
    with h5py.File(path, "r") as handle:
        return {k: handle[k][()] for k in handle}


def global_norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays.values())))


def write_model(directory: Path, seed: int = 0) -> Path:
    """A two-shard model directory with an index and a config, by safetensors' writer."""
    directory.mkdir()
    rng = np.random.default_rng(seed)
    weight_map = {}
    for number in (1, 2):
        shard = f"model-{number:05d}-of-00002.safetensors"
        name = f"layers.{number}.w"
        save_file({name: rng.standard_normal(64).astype(np.float32)}, str(directory / shard))
        weight_map[name] = shard
    index = {"metadata": {"total_size": 512}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


def swap_for_link(folder: Path, target: Path) -> Path:
    """The attack: `mv folder folder2; ln -s target folder`. Returns where it went."""
    moved = folder.with_name(folder.name + "2")
    folder.rename(moved)
    folder.symlink_to(target, target_is_directory=True)
    return moved


def run_swapping_inside(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, swap: Callable[[], object]
) -> list[bool]:
    """Patch owner.name to make the swap once, then do its work."""
    real = getattr(owner, name)
    done: list[bool] = []

    def swapping(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            swap()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, swapping)
    return done


# Between the check and the commit: as the sweep of dead runs' temps starts (nothing of
# this run exists yet), and just before the commit (OUT has been written).
MOMENTS = [(output, "remove_stale_temps"), (output.Target, "_commit")]


@pytest.mark.parametrize("name", FILE_NAMES)
@pytest.mark.parametrize("moment", MOMENTS, ids=["before staging", "before the commit"])
@pytest.mark.parametrize("fallback", ["", "no renameat2", "no /proc"])
def test_force_into_a_folder_swapped_for_a_link_to_ins_folder_never_replaces_in(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    moment: tuple[Any, str],
    fallback: str,
) -> None:
    """OUT (--force) has IN's name in a folder the attacker swaps for a link to IN's
    folder: by name, OUT is then IN. The run writes into the folder it checked."""
    if fallback == "no renameat2":
        monkeypatch.setattr(fsops, "renameat2", None)
    elif fallback == "no /proc":  # the writer's paths go by name; the commit does not
        monkeypatch.setattr(output, "fd_path", lambda _fd: None)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    src = write_input(in_dir / name)
    before = tree(in_dir)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    write_input(d / name, seed=1)  # an earlier output: what --force means to replace
    moved: list[Path] = []
    swapped = run_swapping_inside(
        monkeypatch, *moment, lambda: moved.append(swap_for_link(d, in_dir))
    )
    code = main(["clip", "--global", "1", "-q", "--force", str(src), str(d / name)])
    assert swapped
    assert tree(in_dir) == before  # IN byte-identical, nothing beside it
    assert listing(moved[0]) == [name]  # no temp left where it was checked
    err = capsys.readouterr().err
    if fallback == "no /proc":
        # Without /proc the writer (and the fsync and chmod before the commit) reach the
        # staged file by name, through the link, where this run's work directory does not
        # exist: writing fails, the earlier output stays.
        assert code == 5
        assert "no output written" in one_error_line(err)
        assert global_norm(read_back(moved[0] / name)) == global_norm(weights(seed=1))
    else:  # written into the folder it checked
        assert (code, err) == (0, "")
        assert global_norm(read_back(moved[0] / name)) <= 1.0
    assert d.is_symlink()


@pytest.mark.parametrize("moment", MOMENTS, ids=["before staging", "before the commit"])
@pytest.mark.parametrize("fallback", ["", "no renameat2"])
def test_force_over_a_model_directory_swapped_for_a_link_never_touches_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: tuple[Any, str], fallback: str
) -> None:
    """The --force swap of a directory OUT (exchange, or two renames) named as the input
    model directory: by name after the swap, OUT is IN."""
    if fallback:
        monkeypatch.setattr(fsops, "renameat2", None)
    src_root = tmp_path / "src"
    src_root.mkdir()
    model = write_model(src_root / "model")
    before = tree(src_root)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    assert main(["clip", "--global", "1e30", "-q", str(model), str(d / "model")]) == 0
    moved: list[Path] = []
    swapped = run_swapping_inside(
        monkeypatch, *moment, lambda: moved.append(swap_for_link(d, src_root))
    )
    assert main(["clip", "--global", "1", "-q", "--force", str(model), str(d / "model")]) == 0
    assert swapped
    assert tree(src_root) == before
    written = moved[0] / "model"
    assert listing(moved[0]) == ["model"]
    assert sorted(p.name for p in written.iterdir()) == listing(model)
    shards = [load_file(str(p)) for p in sorted(written.glob("*.safetensors"))]
    assert global_norm({f"{i}{k}": v for i, s in enumerate(shards) for k, v in s.items()}) <= 1.0


@pytest.mark.parametrize("moment", MOMENTS, ids=["before staging", "before the commit"])
def test_plot_into_a_folder_swapped_for_a_link_into_the_input_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: tuple[Any, str]
) -> None:
    """`norms --plot FILE --force` goes through the same target: a picture named as a
    file of the input model directory never replaces it."""
    pytest.importorskip("matplotlib")
    model = write_model(tmp_path / "model")
    (model / "norms.png").write_bytes(b"the model's own picture")
    before = tree(model)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    (d / "norms.png").write_bytes(b"an earlier plot")
    moved: list[Path] = []
    swapped = run_swapping_inside(
        monkeypatch, *moment, lambda: moved.append(swap_for_link(d, model))
    )
    argv = ["norms", "--plot", str(d / "norms.png"), "--force", str(model)]
    assert main(argv) == 0
    assert swapped
    assert tree(model) == before
    assert listing(moved[0]) == ["norms.png"]
    assert (moved[0] / "norms.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- the check itself


@pytest.mark.parametrize("kind", ["file", "model directory"])
def test_a_folder_swapped_between_the_path_check_and_the_open_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    """The names were checked, then OUT's directory is opened: a swap in between gets the
    opened directory judged, which is IN's folder (or the input directory): exit 2."""
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    if kind == "file":
        src = write_input(in_dir / "model.safetensors")
        out_name, link_to = "model.safetensors", in_dir
    else:
        src = write_model(in_dir / "model")
        out_name, link_to = "clipped", src
    before = tree(in_dir)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    swapped = run_swapping_inside(
        monkeypatch, output, "_open_directory", lambda: swap_for_link(d, link_to)
    )
    assert main(["clip", "--global", "1", "-q", "--force", str(src), str(d / out_name)]) == 2
    assert swapped
    assert "input" in one_error_line(capsys.readouterr().err)
    assert tree(in_dir) == before
    assert listing(tmp_path / "evil") == ["d", "d2"]
    assert listing(tmp_path / "evil" / "d2") == []


def test_outs_directory_moved_into_the_input_directory_is_refused_at_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The footprint is checked again on the opened directory just before the commit: a
    directory moved meanwhile into the input model directory is refused, nothing left."""
    model = write_model(tmp_path / "model")
    d = tmp_path / "d"
    d.mkdir()
    swapped = run_swapping_inside(  # the last step before the check and the commit
        monkeypatch, output.DirectoryTarget, "_set_mode", lambda: d.rename(model / "d")
    )
    assert main(["clip", "--global", "1", "-q", str(model), str(d / "clipped")]) == 2
    assert swapped
    assert "inside the input directory" in one_error_line(capsys.readouterr().err)
    assert listing(model / "d") == []  # no OUT, no temp


@pytest.mark.parametrize("out_text", [".", "..", "sub/.."])
def test_out_named_dot_or_dot_dot_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    out_text: str,
) -> None:
    """'.' and '..' are no entry of a directory to create or rename onto (relative to an
    opened directory, '..' would be its parent): refused before anything is made."""
    (tmp_path / "in").mkdir()
    model = write_model(tmp_path / "in" / "model")
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work / "sub")
    if out_text == "sub/..":
        monkeypatch.chdir(work)
    before = tree(tmp_path)
    assert main(["clip", "--global", "1", "-q", "--force", str(model), out_text]) == 2
    one_error_line(capsys.readouterr().err)
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- a real racing process


# The child stops itself (SIGSTOP) as its commit begins: OUT's file is written and synced.
_STOP_AT_COMMIT = """
import os, signal, sys
from clipcli.output import target as output
from clipcli.cli.entry import main
real = output.Target._commit
def stopped_first(self, staged):
    os.kill(os.getpid(), signal.SIGSTOP)
    real(self, staged)
output.Target._commit = stopped_first
sys.exit(main(sys.argv[1:]))
"""


def start_stopped_clip(src: Path, out: Path, stop_at: str) -> subprocess.Popen[str]:
    """`clipcli clip --force` in a child process, returned stopped between its check and
    its commit, however loaded the machine is (it cannot commit while it is stopped):
    by SIGSTOP the moment its temp entry appears beside OUT, or by its own SIGSTOP as its
    commit begins."""
    args = ["clip", "--global", "1", "-q", "--force", str(src), str(out)]
    if stop_at == "temp entry":
        argv = [sys.executable, "-m", "clipcli", *args]
    else:
        argv = [sys.executable, "-c", _STOP_AT_COMMIT, *args]
    env = dict(os.environ, CLIPCLI_THREADS="1")
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    if stop_at == "temp entry":
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".clipcli-tmp") for p in out.parent.iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        proc.send_signal(signal.SIGSTOP)
    # Wait for the stop itself (without reaping: communicate() does that later).
    state = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    assert state is not None
    assert state.si_code == os.CLD_STOPPED, proc.communicate()
    return proc


STOPS = ["temp entry", "commit"]


@pytest.mark.parametrize("stop_at", STOPS)
@pytest.mark.parametrize("name", ["model.safetensors", "model.h5"])
def test_a_real_process_swaps_outs_folder_while_clip_is_stopped(
    tmp_path: Path, name: str, stop_at: str
) -> None:
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    src = write_input(in_dir / name, n=4_000_000)  # 16 MB: still measuring when stopped
    before = tree(in_dir)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    write_input(d / name, seed=1)
    proc = start_stopped_clip(src, d / name, stop_at)
    try:
        moved = swap_for_link(d, in_dir)
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert tree(in_dir) == before
    assert (proc.returncode, err) == (0, "")  # written into the folder it checked
    assert listing(moved) == [name]
    assert global_norm(read_back(moved / name)) <= 1.0


@pytest.mark.parametrize("stop_at", STOPS)
def test_a_real_process_swaps_a_model_directory_outs_folder(tmp_path: Path, stop_at: str) -> None:
    src_root = tmp_path / "src"
    src_root.mkdir()
    model = src_root / "model"
    model.mkdir()
    rng = np.random.default_rng(3)
    for number in (1, 2):  # 2 x 8 MB shards: still measuring when stopped
        tensor = {f"l{number}.w": rng.standard_normal(2_000_000).astype(np.float32)}
        save_file(tensor, str(model / f"model-{number:05d}-of-00002.safetensors"))
    weight_map = {f"l{n}.w": f"model-{n:05d}-of-00002.safetensors" for n in (1, 2)}
    index = {"metadata": {"total_size": 16_000_000}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    before = tree(src_root)
    d = tmp_path / "evil" / "d"
    d.mkdir(parents=True)
    assert main(["clip", "--global", "1e30", "-q", "--no-fsync", str(model), str(d / "model")]) == 0
    proc = start_stopped_clip(model, d / "model", stop_at)
    try:
        moved = swap_for_link(d, src_root)
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert tree(src_root) == before
    assert (proc.returncode, err) == (0, "")  # written into the folder it checked
    assert listing(moved) == ["model"]
    written = moved / "model"
    assert listing(written) == listing(model)
    arrays = {k: v for p in written.glob("*.safetensors") for k, v in load_file(str(p)).items()}
    assert global_norm(arrays) <= 1.0


# ---------------------------------------------------------------- a directory it cannot list


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs root and setpriv")
@pytest.mark.parametrize("out_name", ["clipped.safetensors", "clipped/"])
def test_out_in_a_directory_that_may_be_written_but_not_listed(
    tmp_path: Path, out_name: str
) -> None:
    """OUT's directory is opened for reading where allowed; one with write and search
    permission only (0300) is opened O_PATH, enough to create, rename and remove in it:
    the run succeeds as it did when every step went by name (the sweep, which must list
    the directory, is skipped). Run with every capability dropped, so that modes apply."""
    assert SETPRIV is not None
    tmp_path.chmod(0o755)
    src = write_input(tmp_path / "m.safetensors")
    shut = tmp_path / "shut"
    shut.mkdir()
    shut.chmod(0o300)
    drop = [SETPRIV, "--inh-caps=-all", "--bounding-set=-all"]
    argv = [sys.executable, "-m", "clipcli", "clip", "--global", "1", "-q", src.name]
    done = subprocess.run(
        [*drop, *argv, f"shut/{out_name}"], cwd=tmp_path, capture_output=True, text=True
    )
    assert (done.returncode, done.stderr) == (0, "")
    out = shut / out_name.rstrip("/")
    written = out / "model.safetensors" if out_name.endswith("/") else out
    assert global_norm(load_file(str(written))) <= 1.0
    assert listing(shut) == [out.name]  # no temp left
