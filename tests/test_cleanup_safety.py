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
import subprocess
from collections.abc import Iterator
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
