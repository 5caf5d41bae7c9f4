"""What a file really is, judged on the opened descriptor (threat model, open items 5, 7, 8).

A racing process swaps a name between clipcli's look at it and its use: a file renamed
over IN after the reader opened it, a folder or link swapped while a file is opened, a
link swapped to /proc/self/environ after the pseudo-file check. Each race is made
deterministic by a hook that performs the swap at the one moment it matters (in-process,
monkeypatched), or by a real environment: no /proc (a tmpfs over it in a mount namespace
of its own), a bind mount of /proc. References: h5py and safetensors' own readers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import REPO_ROOT, listing
from handmade import write_safetensors
from layouts import keras_archive

from clipcli import api
from clipcli.cli.entry import main
from clipcli.errors import InputError
from clipcli.output import policy
from clipcli.system import inputs
from clipcli.system.identity import InputGuard

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": (rng.standard_normal(4096) * 10).astype(np.float32), "b": np.arange(8.0)}


def make_input(path: Path, seed: int = 0) -> Path:
    if path.suffix == ".safetensors":
        write_safetensors(path, tensors(seed))
    elif path.suffix == ".npz":
        arrays: dict[str, Any] = tensors(seed)  # numpy types **kwds as bool | ArrayLike
        np.savez(path, **arrays)
    elif path.suffix == ".h5":
        with h5py.File(path, "w") as handle:
            for name, array in tensors(seed).items():
                handle.create_dataset(name, data=array)
    else:
        keras_archive(path)
    return path


def make_model(directory: Path) -> Path:
    """Two shards, their index and a side file (config.json), one subfolder with a file."""
    directory.mkdir()
    weight_map = {}
    for number, shard in enumerate(SHARDS):
        write_safetensors(directory / shard, {f"w{number}": np.full(64, number + 1.0, np.float32)})
        weight_map[f"w{number}"] = shard
    index = {"metadata": {"total_size": 2 * 64 * 4}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "sub").mkdir()
    (directory / "sub" / "passwd").write_text("harmless")
    return directory


def clip(src: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["clip", "--global", "1", "-q", "--no-fsync", str(src), str(out)])
    return code, capsys.readouterr().err


def the_error(err: str) -> str:
    """The one `clipcli: error:` line, last on stderr (notes may come before it)."""
    lines = err.strip().splitlines()
    assert lines, err
    assert lines[-1].startswith("clipcli: error: "), err
    assert not any("error" in line or "Traceback" in line for line in lines[:-1]), err
    return lines[-1]


# ---------------------------------------------------------------- 5: renamed over after the open


def rename_over_after_the_open(monkeypatch: pytest.MonkeyPatch, target: Path, new: Path) -> None:
    """The racer: right after the reader opened IN, `new` is renamed over `target` (the old
    file stays open in clipcli and is what its reader reads)."""
    real_open_reader = api.open_reader  # type: ignore[attr-defined]  # imported there, patched here

    def racing_open_reader(path: Path) -> Any:
        reader = real_open_reader(path)
        os.replace(new, target)
        return reader

    monkeypatch.setattr(api, "open_reader", racing_open_reader)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".h5", ".keras"])
def test_a_file_renamed_over_in_after_the_open_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """The guard watched the name from a stat taken after the open: the newcomer, not the
    file read. Before the fix every format ended 0."""
    src = make_input(tmp_path / f"in{suffix}")
    newcomer = tmp_path / f"newcomer{suffix}"
    shutil.copyfile(src, newcomer)  # same bytes, another file
    rename_over_after_the_open(monkeypatch, src, newcomer)
    code, err = clip(src, tmp_path / f"out{suffix}", capsys)
    assert code == 3, err
    assert "was replaced" in the_error(err)
    assert listing(tmp_path) == [src.name]


@pytest.mark.parametrize("which", [SHARDS[1], INDEX, "config.json"])
def test_a_file_renamed_over_in_a_model_directory_after_the_open_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    model = make_model(tmp_path / "model")
    newcomer = tmp_path / "newcomer"
    shutil.copyfile(model / which, newcomer)
    rename_over_after_the_open(monkeypatch, model / which, newcomer)
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 3, err
    assert which in the_error(err)
    assert listing(tmp_path) == ["model"]


def test_the_old_hdf5_rewritten_after_the_rename_never_reaches_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The harm: IN renamed over after the open, then the old file (still read by clipcli)
    rewritten between the measuring and the writing pass. Before the fix: exit 0 and an OUT
    whose tensor `a` was measured as one array and written from another."""
    src = make_input(tmp_path / "in.h5")
    with h5py.File(src, "r") as handle:  # where `a` lies, by the official reader
        offset = handle["a"].id.get_offset()
        size = handle["a"].id.get_storage_size()
    old = os.open(src, os.O_RDWR)  # the racer keeps the old file
    newcomer = tmp_path / "newcomer.h5"
    shutil.copyfile(src, newcomer)
    rename_over_after_the_open(monkeypatch, src, newcomer)
    real_check = InputGuard.check

    def rewrite_between_passes(guard: InputGuard, when: str) -> None:
        if "between" in when:
            os.pwrite(old, np.full(size // 4, 1e6, np.float32).tobytes(), offset)
        real_check(guard, when)

    monkeypatch.setattr(InputGuard, "check", rewrite_between_passes)
    try:
        code, err = clip(src, tmp_path / "out.h5", capsys)
    finally:
        os.close(old)
    assert code == 3, err
    assert "was replaced" in the_error(err)
    assert listing(tmp_path) == ["in.h5"]


def test_a_side_file_swapped_only_while_it_is_opened_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Swapped in for the copy's open and put back before the copy ends: the name looks
    unchanged to the guard afterwards, so the copy's own descriptor is checked against
    the file listed. Before the fix: exit 0 and the planted text in OUT."""
    import clipcli.formats.sharded.reader as sharded
    import clipcli.formats.sharded.writer as sharded_writer

    model = make_model(tmp_path / "model")
    config = model / "config.json"
    (tmp_path / "planted").write_text('{"planted": true}')
    real_open = sharded.open_input  # type: ignore[attr-defined]  # imported there, patched here
    real_copy = sharded_writer.copy_side_file  # type: ignore[attr-defined]  # as above

    real_open_other = sharded.ShardedReader.open_other_file
    copying: list[Path] = []

    def open_other_file(self: Any, entry: Path) -> Any:
        copying.append(entry)  # the copy's own open, not the listing's look at the content
        try:
            return real_open_other(self, entry)
        finally:
            copying.pop()

    def planting_open(path: Path) -> Any:
        if path == config and copying:  # moved aside, not hard-linked (see above)
            os.replace(config, tmp_path / "kept")
            os.replace(tmp_path / "planted", config)
        return real_open(path)

    def restoring_copy(fd: int, file: Path, destination: Path) -> Any:
        if file == config:
            os.replace(tmp_path / "kept", config)
        return real_copy(fd, file, destination)

    monkeypatch.setattr(sharded, "open_input", planting_open)
    monkeypatch.setattr(sharded.ShardedReader, "open_other_file", open_other_file)
    monkeypatch.setattr(sharded_writer, "copy_side_file", restoring_copy)
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 3, err
    assert "changed since the directory was listed" in the_error(err)
    assert listing(tmp_path) == ["kept", "model"]


def test_hdf5_opened_by_name_must_be_the_file_of_our_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without /proc/self/fd, h5py opens the name: swapped between our open and the
    library's, HDF5 would read one file and the heap scan and guard another."""
    import clipcli.formats.hdf5.reader as hdf5_reader

    src = make_input(tmp_path / "in.h5")
    other = make_input(tmp_path / "other.h5", seed=1)

    def no_proc_and_a_swap(_fd: int) -> None:
        os.replace(other, src)
        return None

    monkeypatch.setattr(hdf5_reader, "fd_path", no_proc_and_a_swap)
    assert main(["norms", str(src)]) == 3
    assert "was replaced while being opened" in the_error(capsys.readouterr().err)


# ---------------------------------------------------------------- 7: where an opened file lies


def swap_folder_while_opening(
    monkeypatch: pytest.MonkeyPatch, model: Path, outside: Path, after_open: Any = None
) -> None:
    """While sub/passwd is opened, `sub` is a link to `outside`; put back right after."""
    import clipcli.formats.sharded.reader as sharded

    real_open = sharded.open_input  # type: ignore[attr-defined]  # imported there, patched here
    aside = model.parent / "sub-aside"

    def swapping_open(path: Path) -> Any:
        if path.name != "passwd":
            return real_open(path)
        (model / "sub").rename(aside)
        (model / "sub").symlink_to(outside)
        try:
            return real_open(path)
        finally:
            if after_open is not None:
                after_open()
            (model / "sub").unlink()
            aside.rename(model / "sub")

    monkeypatch.setattr(sharded, "open_input", swapping_open)


def secrets(tmp_path: Path) -> Path:
    folder = tmp_path / "secrets"
    folder.mkdir()
    (folder / "passwd").write_text("TOPSECRET")
    return folder


def test_without_proc_a_folder_swapped_while_opening_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No kernel name for the descriptor (no /proc): the check used to be skipped and the
    outside file copied into OUT. Now the resolved name must be the very file opened."""
    model = make_model(tmp_path / "model")
    swap_folder_while_opening(monkeypatch, model, secrets(tmp_path))
    real_readlink = os.readlink

    def no_proc(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/proc/self/fd/"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", no_proc)
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 3, err
    assert "passwd" in the_error(err)
    assert listing(tmp_path) == ["model", "secrets"]


def test_an_opened_file_removed_at_once_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The racer opens the way to a hard link of the secret in a folder of its own and
    unlinks it once opened: the kernel's name ends " (deleted)", which used to skip the
    check. (Real kernel names: nothing patched but the moment of the swap.)"""
    model = make_model(tmp_path / "model")
    secret = secrets(tmp_path) / "passwd"
    evil = tmp_path / "evil"
    evil.mkdir()
    os.link(secret, evil / "passwd")
    swap_folder_while_opening(monkeypatch, model, evil, (evil / "passwd").unlink)
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 3, err
    assert "passwd" in the_error(err)
    assert listing(tmp_path) == ["evil", "model", "secrets"]


def test_a_file_whose_name_ends_like_a_removed_one_is_copied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other side of the " (deleted)" rule: a real name with that ending is tried and
    found to be the file opened, so it is copied like any other."""
    model = make_model(tmp_path / "model")
    (model / "notes (deleted)").write_text("kept")
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "notes (deleted)").read_text() == "kept"


# ---------------------------------------------------------------- 8: kernel files, by descriptor


@pytest.mark.parametrize(
    "kernel_file", ["/proc/self/environ", "/proc/self/maps", "/sys/kernel/notes"]
)
def test_a_link_swapped_to_a_kernel_file_after_the_name_check_is_not_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kernel_file: str,
) -> None:
    """The name is checked (a checkpoint), then the link is swapped to a kernel file before
    the open: procfs files are S_ISREG, so only the descriptor tells."""
    if not os.path.exists(kernel_file):
        pytest.skip(f"no {kernel_file} here")
    checkpoint = make_input(tmp_path / "real.safetensors")
    link = tmp_path / "model.safetensors"
    link.symlink_to(checkpoint)
    real_check = inputs.is_pseudo_path

    def swapped_after_the_check(path: Path) -> bool:
        answer = real_check(path)
        if path == link:
            link.unlink()
            link.symlink_to(kernel_file)
        return answer

    monkeypatch.setattr(inputs, "is_pseudo_path", swapped_after_the_check)
    with pytest.raises(InputError, match="kernel or device file"):
        inputs.open_input_fd(link)
    link.unlink()
    link.symlink_to(checkpoint)
    assert main(["norms", str(link)]) == 3
    assert "kernel or device file" in the_error(capsys.readouterr().err)


@pytest.fixture
def proc_bound_elsewhere(tmp_path: Path) -> Any:
    """/proc bind-mounted under tmp_path: its files are procfs by device, not by name."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    done = subprocess.run(
        ["mount", "--bind", "/proc", str(target)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount /proc here: {done.stderr.strip() or 'mount failed'}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


def test_procfs_under_another_name_is_not_read(
    tmp_path: Path, proc_bound_elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "model.safetensors"
    link.symlink_to(proc_bound_elsewhere / "self" / "environ")
    assert not inputs.is_pseudo_path(link)  # what the name check alone saw
    assert main(["norms", str(link)]) == 3
    assert "kernel or device file" in the_error(capsys.readouterr().err)


# ---------------------------------------------------------------- a real machine without /proc

NO_PROC_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    assert not os.path.exists("/proc/self"), "/proc is still there"
    from clipcli.cli.entry import main
    import clipcli.formats.sharded.reader as sharded

    work = Path(sys.argv[1])
    codes = {"h5": main(["norms", str(work / "in.h5")])}
    codes["plain"] = main(["clip", "--global", "1", "-q", str(work / "model"), str(work / "out")])
    real_open = sharded.open_input

    def swapping_open(path):
        if path.name != "passwd":
            return real_open(path)
        model = work / "model"
        (model / "sub").rename(work / "sub-aside")
        (model / "sub").symlink_to(work / "secrets")
        try:
            return real_open(path)
        finally:
            (model / "sub").unlink()
            (work / "sub-aside").rename(model / "sub")

    sharded.open_input = swapping_open
    out2 = str(work / "out2")
    codes["swapped"] = main(["clip", "--global", "1", "-q", str(work / "model"), out2])
    print(json.dumps(codes))
    """
)


def test_without_proc_for_real(tmp_path: Path) -> None:
    """In a mount namespace whose /proc is an empty tmpfs: the fallbacks let ordinary
    files through (HDF5 opened by name, side files copied) and catch the swap."""
    make_input(tmp_path / "in.h5")
    make_model(tmp_path / "model")
    secrets(tmp_path)
    command = (
        "mount -t tmpfs none /proc && exec "
        f"{sys.executable} -c {_quoted(NO_PROC_SCRIPT)} {_quoted(str(tmp_path))}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO_ROOT,
    )
    if done.returncode != 0 and not done.stdout:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()[-300:]}")
    codes = json.loads(done.stdout.strip().splitlines()[-1])  # after norms' report
    assert codes == {"h5": 0, "plain": 0, "swapped": 3}, done.stderr
    assert (tmp_path / "out" / "sub" / "passwd").read_text() == "harmless"
    assert not (tmp_path / "out2").exists()


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_the_side_file_size_limit_judges_the_file_that_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A small file is swapped in only while the 1 GiB limit is checked, by a name stat:
    the huge file listed (and copied) must be what the limit judges. Before the fix the
    1 TiB file was copied whole, refused only at the end by the ctime the swap changed."""
    model = make_model(tmp_path / "model")
    huge = model / "vocab.txt"
    with open(huge, "wb") as handle:
        handle.truncate(1 << 40)
    (tmp_path / "small").write_text("small")
    real_check = policy.check_side_files

    def small_while_checked(reader: Any, allow_large: bool) -> None:
        # Moved aside, not hard-linked: a side file with a name outside is refused.
        os.replace(huge, tmp_path / "kept")
        os.replace(tmp_path / "small", huge)
        try:
            real_check(reader, allow_large)
        finally:
            os.replace(tmp_path / "kept", huge)

    monkeypatch.setattr(policy, "check_side_files", small_while_checked)
    code, err = clip(model, tmp_path / "out", capsys)
    assert code == 2, err
    assert "vocab.txt: side file of 1099511627776 bytes" in the_error(err)
    assert listing(tmp_path) == ["model"]
