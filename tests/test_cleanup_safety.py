"""The stale-temp sweep and every other removal: never what IN resolves to.

Before a run writes OUT it removes the temp entries that killed clipcli runs left beside
OUT (and puts a stranded `.clipcli-old` copy back). A user may read such an entry back
as IN; then the run is refused (exit 2) and nothing is touched, whether IN lies inside
the entry, is a link into it, a shard or side file of a model directory under it, a hard
link to a file in it, reached through it as a symlink or through a bind mount of it.
Removal itself works relative to opened directories without following links, so an
entry swapped for a link between the check and the removal is never followed.

Inputs and references are written with the official libraries (safetensors, numpy,
h5py) and compared byte for byte with the file system as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import listing, one_error_line, tree
from layouts import write_h5, write_keras
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.formats.keras_archive import SCRATCH_PREFIX, WEIGHTS_MEMBER
from clipcli.output import fsops
from clipcli.output import target as output
from clipcli.system import scratch
from clipcli.system.footprint import holds_a_mount, mount_points

STALE_PID = 999_999_999  # no such process: its entries are abandoned


def stale_name(out: Path, kind: str = ".clipcli-tmp") -> str:
    return f"{fsops.temp_prefix(out)}{STALE_PID}-0123abcd{kind}"


def write_input(path: Path) -> Path:
    """A small checkpoint in the format of path's extension, by the official writer."""
    data = {"w": np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)}
    if path.suffix == ".safetensors":
        save_file(data, str(path))
    elif path.suffix == ".npz":
        np.savez(path, w=data["w"])
    else:
        with h5py.File(path, "w") as handle:
            handle.create_dataset("w", data=data["w"])
    return path


def write_model(directory: Path) -> Path:
    """A two-shard model directory with an index, a config and a side folder."""
    directory.mkdir()
    weight_map = {}
    for number in (1, 2):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({f"l{number}.w": np.full(8, number, dtype=np.float32)}, str(directory / shard))
        weight_map[f"l{number}.w"] = shard
    index = {"metadata": {"total_size": 64}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text('{"pooling": "mean"}')
    return directory


def clip(src: Path | str, out: Path | str, *flags: str) -> int:
    return main(["clip", "--global", "1", "-q", *flags, str(src), str(out)])


def refused(capsys: pytest.CaptureFixture[str], stale: Path) -> None:
    line = one_error_line(capsys.readouterr().err)
    assert f"the input lies in {stale}" in line, line


# ---------------------------------------------------------------- IN inside a stale temp


@pytest.mark.parametrize("ext", [".safetensors", ".npz", ".h5"])
def test_in_inside_a_stale_work_directory_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ext: str
) -> None:
    """A killed run's partial OUT, read back as IN to the same OUT: the sweep used to
    remove it, then the run failed with exit 3 ("disappeared")."""
    out = tmp_path / f"out{ext}"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    src = write_input(stale / out.name)
    before = tree(tmp_path)
    assert clip(src, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


def test_in_as_a_symlink_into_a_stale_temp_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.safetensors"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    write_input(stale / "partial.safetensors")
    elsewhere = tmp_path / "links"
    elsewhere.mkdir()
    link = elsewhere / "in.safetensors"
    link.symlink_to(stale / "partial.safetensors")
    before = tree(tmp_path)
    assert clip(link, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


def test_a_stale_model_directory_read_back_whole_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "clipped"
    stale = write_model(tmp_path / stale_name(out))
    before = tree(tmp_path)
    assert clip(stale, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("member", ["model.safetensors.index.json", "1_Pooling"])
def test_a_model_directory_under_a_stale_temp_by_its_index_or_nested(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], member: str
) -> None:
    """IN is the index of a model directory inside the stale entry, or the model lies one
    level further down (the stale entry holds the model's parent)."""
    out = tmp_path / "clipped"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    model = write_model(stale / "model")
    src = model / "model.safetensors.index.json" if member.endswith(".json") else model
    before = tree(tmp_path)
    assert clip(src, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


def test_a_side_file_linked_into_a_stale_temp_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model lies elsewhere, but the folder holding one of its side files is a link
    that passes through the stale entry: removing the entry would break the input."""
    out = tmp_path / "clipped"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    model = write_model(tmp_path / "model")
    real_extra = model / "extra"
    real_extra.mkdir()
    (real_extra / "notes.txt").write_text("kept")
    hop = stale / "hop"
    hop.symlink_to(real_extra)
    (model / "notes.txt").symlink_to(hop / "notes.txt")  # model/notes.txt -> stale/hop/...
    before = tree(tmp_path)
    assert clip(model, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


def test_a_stale_temp_that_is_a_symlink_on_ins_path_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stale entry may be a symlink (a --force run killed after swapping a linked OUT
    aside): IN named through it must not lose its path."""
    out = tmp_path / "clipped"
    model = write_model(tmp_path / "model")
    stale = tmp_path / stale_name(out)
    stale.symlink_to(model)
    before = tree(tmp_path)
    assert clip(stale, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


def test_a_stranded_aside_copy_read_back_is_refused_not_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sweep used to move IN to OUT, then say "no output written"."""
    out = tmp_path / "clipped"
    aside = write_model(tmp_path / stale_name(out, ".clipcli-old"))
    before = tree(tmp_path)
    assert clip(aside, out) == 2
    refused(capsys, aside)
    assert tree(tmp_path) == before


def test_a_hard_link_of_in_inside_a_stale_temp_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unlinking the other name would change IN (its link count and ctime): the run then
    failed with exit 3, "changed"."""
    out = tmp_path / "out.safetensors"
    src = write_input(tmp_path / "in.safetensors")
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    os.link(src, stale / "out.safetensors")
    before = tree(tmp_path)
    assert clip(src, out) == 2
    refused(capsys, stale)
    assert tree(tmp_path) == before


@pytest.fixture
def bind_mount() -> Iterator[Any]:
    mounted: list[Path] = []

    def mount(source: Path, target: Path) -> None:
        target.mkdir()
        done = subprocess.run(
            ["mount", "--bind", str(source), str(target)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {done.stderr.strip() or 'mount failed'}")
        mounted.append(target)

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_in_through_a_bind_mount_of_a_stale_temp_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bind_mount: Any
) -> None:
    out = tmp_path / "out.safetensors"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    write_input(stale / "out.safetensors")
    view = tmp_path / "view"
    bind_mount(stale, view)
    assert clip(view / "out.safetensors", out) == 2
    refused(capsys, stale)
    assert (stale / "out.safetensors").exists()
    assert not out.exists()


@pytest.mark.parametrize(("links", "code"), [(40, 2), (41, 3)])
def test_links_followed_up_to_the_kernels_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], links: int, code: int
) -> None:
    """IN reached through a chain of 40 symlinks (the kernel's limit, MAXSYMLINKS) whose
    last one leads into the stale entry is seen; one more and the kernel itself cannot
    open IN (exit 3). Either way the stale entry stays."""
    out = tmp_path / "out.safetensors"
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    write_input(stale / "partial.safetensors")
    chain = tmp_path / "chain"
    chain.mkdir()
    target: Path = stale / "partial.safetensors"
    for number in range(links, 0, -1):
        link = chain / f"l{number}.safetensors"
        link.symlink_to(target)
        target = link
    before = tree(tmp_path)
    assert clip(chain / "l1.safetensors", out) == code
    line = one_error_line(capsys.readouterr().err)
    if code == 2:
        assert f"the input lies in {stale}" in line
    else:
        assert "Too many levels of symbolic links" in line, line
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- what the sweep still removes


def test_stale_temps_that_do_not_hold_in_are_still_removed(tmp_path: Path) -> None:
    """Links inside a stale entry are removed as links, their targets kept; a stale entry
    that is itself a link goes, its target stays; an aside copy is put back at OUT."""
    out = tmp_path / "clipped"
    src = write_model(tmp_path / "model")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    work = tmp_path / stale_name(out)
    (work / "deep" / "deeper").mkdir(parents=True)
    (work / "deep" / "deeper" / "part").write_bytes(b"partial")
    (work / "deep" / "to-precious").symlink_to(precious)
    (work / "to-file").symlink_to(precious / "keep.txt")
    linked = tmp_path / f"{fsops.temp_prefix(out)}{STALE_PID}-0123abce.clipcli-tmp"
    linked.symlink_to(precious)
    assert clip(src, out) == 0
    assert listing(tmp_path) == ["clipped", "model", "precious"]
    assert tree(precious) == {"keep.txt": b"mine"}
    assert sorted(load_file(str(out / "model-00001-of-00002.safetensors"))) == ["l1.w"]


@pytest.mark.parametrize(("depth", "removed"), [(63, True), (64, False)])
def test_a_stale_tree_is_removed_down_to_the_depth_limit(
    tmp_path: Path, depth: int, removed: bool
) -> None:
    """Folders down to depth 63 below the stale entry are emptied; one deeper is left
    (nothing clipcli writes comes near: side folders stop at 16), and with it the entry."""
    out = tmp_path / "out.safetensors"
    src = write_input(tmp_path / "in.safetensors")
    stale = tmp_path / stale_name(out)
    deepest = stale.joinpath(*["d"] * depth)
    deepest.mkdir(parents=True)
    (deepest / "f").write_bytes(b"x")
    assert clip(src, out) == 0
    assert stale.exists() is not removed
    if not removed:
        assert (deepest / "f").read_bytes() == b"x"


def test_a_file_system_mounted_inside_a_stale_temp_is_not_entered(
    tmp_path: Path, mount_tmpfs: Any
) -> None:
    out = tmp_path / "out.safetensors"
    src = write_input(tmp_path / "in.safetensors")
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    mounted = mount_tmpfs(f"{stale.name}/mnt", size="1m")
    (mounted / "theirs.txt").write_text("another file system")
    assert clip(src, out) == 0
    assert (mounted / "theirs.txt").read_text() == "another file system"


# ---------------------------------------------------------------- races: swapped for a link


def test_a_file_swapped_for_a_link_after_the_check_is_unlinked_as_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the check and the removal another process replaces a file and a folder of
    the stale entry with links to the user's data: the links go, the data stays."""
    out = tmp_path / "out.safetensors"
    src = write_input(tmp_path / "in.safetensors")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "part").write_text("mine")
    (precious / "sub").mkdir()
    (precious / "sub" / "part").write_text("mine too")
    stale = tmp_path / stale_name(out)
    (stale / "sub").mkdir(parents=True)
    (stale / "part").write_bytes(b"partial")
    (stale / "sub" / "part").write_bytes(b"partial")
    real_remove = fsops.remove_entry_at

    def swap_then_remove(*args: Any) -> None:  # after the check, before the removal
        (stale / "part").unlink()
        (stale / "part").symlink_to(precious / "part")
        (stale / "sub" / "part").unlink()
        (stale / "sub").rmdir()
        (stale / "sub").symlink_to(precious / "sub")
        real_remove(*args)

    monkeypatch.setattr(fsops, "remove_entry_at", swap_then_remove)
    assert clip(src, out) == 0
    assert tree(precious) == {"part": b"mine", "sub": "dir", "sub/part": b"mine too"}
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors", "precious"]


def test_a_stale_entry_swapped_for_a_link_to_in_after_the_check_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry checked is gone and a link to IN's folder sits at its name: the sweep
    sees another entry than the one it checked and leaves it."""
    out = tmp_path / "clipped"
    model = write_model(tmp_path / "model")
    stale = tmp_path / stale_name(out)
    stale.mkdir()
    real_check = fsops._holds_any_at

    def swap_after_check(*args: Any) -> bool:  # the entry is empty: called once
        verdict = real_check(*args)
        stale.rmdir()
        stale.symlink_to(model)
        return verdict

    monkeypatch.setattr(fsops, "_holds_any_at", swap_after_check)
    before = tree(model)
    assert clip(model, out) == 0
    assert tree(model) == before
    assert stale.is_symlink()


def test_a_replaced_outs_folder_swapped_for_a_link_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--force replaces an earlier output directory, deleting the names clipcli writes;
    a folder of the old OUT swapped meanwhile for a link to a folder of IN (which holds
    a file by the same name) is not entered: IN's file stays."""
    model = write_model(tmp_path / "model")
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1e30", "-q", str(model), str(out)]) == 0
    real = output.DirectoryTarget._remove_replaced

    def swap_then_remove(self: output.DirectoryTarget, old: Path) -> None:
        for name in (old / "1_Pooling").iterdir():
            name.unlink()
        (old / "1_Pooling").rmdir()
        (old / "1_Pooling").symlink_to(model / "1_Pooling")
        real(self, old)

    monkeypatch.setattr(output.DirectoryTarget, "_remove_replaced", swap_then_remove)
    before = tree(model)
    assert clip(model, out, "--force") == 0
    assert tree(model) == before


# ------------------------------------------------------------------ issue 18's cleanup attack
# Cleanup as an independent attack broke it (issue 18):
# 1. The `$TMPDIR/clipcli-keras-*` sweep removed user folders, the other input of `diff`
#    and OUT's folder included: it now removes a folder only when it holds nothing but the
#    file clipcli puts there, and nothing any input or OUT resolves to.
# 2. A live run's temp directory was swept between its `mkdir` and its `flock`: a run is
#    stopped there for real (strace's syscall fault injection) while another one runs.
# 3. and 4. A stranded `.clipcli-old` that was a link (to IN, say), a plain file, or a
#    directory where OUT is a file, was renamed to OUT: only a real directory, for a
#    directory OUT, is put back; anything else is left alone.
# 5. ($TMPDIR: tests/test_process_environment.py)
# 6. The sweep entered a bind mount of the same file system inside a stale temp: real
#    `mount --bind`, the kernel's list of mount points decides.
# OUT is read back with the official libraries and its global norm checked in float64.

DEAD_PID = 999_999_999  # no such process
CLIPCLI = [sys.executable, "-m", "clipcli"]


# ------------------------------------------------------------------ inputs and views


def write_safetensors(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((8, 8)).astype(np.float32)}, str(path))
    return path


def write_one_file_model(directory: Path) -> Path:
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


# --------------------------------- issue 18's cleanup attack, item 1: the keras sweep


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
    model = write_one_file_model(tmp_path / "model")
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


# -------------------------------- issue 18's cleanup attack, item 2: live runs' temps


def _tracee(strace: subprocess.Popen[bytes]) -> int | None:
    """The pid of the process strace started (its child), once there is one."""
    children = Path(f"/proc/{strace.pid}/task/{strace.pid}/children")
    with_children = children.read_text().split() if children.exists() else []
    return int(with_children[0]) if with_children else None


def _stopped(pid: int) -> bool:
    """Whether the process is stopped; a child that has already exited (strace's first
    child can be a short-lived one under load) is not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    for line in status.splitlines():
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


# ------------------------------- issue 18's cleanup attack, item 3, 4: the aside copy


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
    src = write_one_file_model(tmp_path / "m")
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
    src = write_one_file_model(tmp_path / "m")
    out = tmp_path / "outmd"
    aside = stale(out, ".clipcli-old")
    write_one_file_model(aside)
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


# ------------------------------------- issue 18's cleanup attack, item 6: bind mounts


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
    src = write_one_file_model(tmp_path / "m")
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
