"""Permission bits of what clipcli writes, against `cp`, `cp -r` and `mkdir` as reference.

Untrusted input must not give a setuid file when root runs clipcli: a new OUT gets IN's
bits as `cp` (without -p) gives them (no setuid, setgid or sticky on a file; a directory
keeps sticky and gets setgid only from a setgid parent), a replaced file drops setuid and
setgid (what writing into it does for an ordinary user), and a model directory made in a
setgid parent keeps the setgid bit that `mkdir` and `cp -r` give it, also for a user
outside the parent's group, for whom a chmod would silently drop it.

Both clipcli and the reference tools run in a child process with the same umask, as root
and as an ordinary user (`setpriv --reuid=65534 --regid=65534 --clear-groups`).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

SETPRIV = shutil.which("setpriv")
NOBODY = 65534
needs_root = pytest.mark.skipif(
    SETPRIV is None or os.geteuid() != 0, reason="needs root and util-linux setpriv"
)
pytestmark = needs_root


def run(
    argv: list[str], cwd: Path, umask: int = 0o022, user: bool = False
) -> subprocess.CompletedProcess[str]:
    """argv in a child with this umask, as root or as the ordinary user nobody."""
    prefix = [SETPRIV or "", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if argv[0] == sys.executable:  # set by Python itself: a shell may not reach the venv's
        argv = [sys.executable, "-c", LAUNCH, f"{umask:o}", *argv[3:]]
    else:
        argv = ["sh", "-c", f'umask {umask:03o}; exec "$@"', "sh", *argv]
    done = subprocess.run(
        [*(prefix if user else []), *argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (argv, done.stderr)
    return done


LAUNCH = (
    "import os, runpy, sys; os.umask(int(sys.argv[1], 8)); "
    "sys.argv = ['clipcli', *sys.argv[2:]]; runpy.run_module('clipcli', run_name='__main__')"
)


def clipcli(*args: str) -> list[str]:
    return [sys.executable, "-m", "clipcli", *args]


@pytest.fixture
def place() -> Iterator[Path]:
    """A folder that the ordinary user may enter and write (pytest's own is root's 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="clipcli-modes-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def modes(root: Path) -> dict[str, int]:
    """The permission bits of root and everything under it, by relative path."""
    found = {".": mode(root)}
    for path in root.rglob("*"):
        found[path.relative_to(root).as_posix()] = mode(path)
    return found


def write_input(path: Path) -> Path:
    data = np.linspace(-4, 4, 12, dtype=np.float32)
    if path.suffix == ".safetensors":
        save_file({"w": data}, str(path))
    elif path.suffix == ".npz":
        np.savez(path, w=data)
    else:
        with h5py.File(path, "w") as handle:
            handle.create_dataset("w", data=data)
    return path


def hand_over(path: Path, user: bool) -> None:
    """Everything under path to the ordinary user (chown clears setuid, so modes are set
    after it)."""
    if user:
        for item in [path, *path.rglob("*")]:
            os.lchown(item, NOBODY, NOBODY)


# ---------------------------------------------------------------- a file OUT


@pytest.mark.parametrize(
    ("ext", "in_mode", "umask", "user"),
    [
        (".safetensors", 0o6755, 0o022, False),
        (".safetensors", 0o4700, 0o022, False),
        (".safetensors", 0o2750, 0o077, False),
        (".safetensors", 0o1755, 0o022, False),
        (".safetensors", 0o640, 0o022, False),
        (".safetensors", 0o6755, 0o022, True),
        (".npz", 0o6755, 0o022, False),
        (".h5", 0o6755, 0o022, False),
    ],
)
def test_a_new_file_out_gets_the_mode_cp_gives(
    place: Path, ext: str, in_mode: int, umask: int, user: bool
) -> None:
    src = write_input(place / f"in{ext}")
    hand_over(src, user)
    src.chmod(in_mode)
    run(["cp", src.name, f"ref{ext}"], place, umask, user)
    run(clipcli("clip", "--global", "1", "-q", src.name, f"out{ext}"), place, umask, user)
    assert mode(place / f"out{ext}") == mode(place / f"ref{ext}")
    assert mode(place / f"out{ext}") & 0o7000 == 0


@pytest.mark.parametrize("existing", [0o6755, 0o1755, 0o2710])
def test_a_replaced_file_drops_setuid_and_setgid_as_cp_over_it_by_a_user(
    place: Path, existing: int
) -> None:
    """cp over a file as an ordinary user keeps the file's mode but the kernel clears
    setuid and setgid on the write; clipcli does so for root too."""
    src = write_input(place / "in.safetensors")
    hand_over(place, True)
    for name in ("ref.safetensors", "mine.safetensors", "root.safetensors"):
        write_input(place / name)
        hand_over(place / name, True)
        (place / name).chmod(existing)
    run(["cp", src.name, "ref.safetensors"], place, user=True)
    flags = ["--global", "1", "-q", "--force", src.name]
    run(clipcli("clip", *flags, "mine.safetensors"), place, user=True)
    run(clipcli("clip", *flags, "root.safetensors"), place)
    expected = mode(place / "ref.safetensors")
    assert expected == existing & ~0o6000  # the reference behaves as described
    assert mode(place / "mine.safetensors") == expected
    assert mode(place / "root.safetensors") == expected
    assert sorted(load_file(str(place / "root.safetensors"))) == ["w"]


# ---------------------------------------------------------------- a model-directory OUT


def write_model(directory: Path) -> Path:
    """Shards, index, a config, a side folder with a file and an empty side folder."""
    directory.mkdir()
    weight_map = {}
    for number in (1, 2):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({f"l{number}.w": np.full(4, number, np.float32)}, str(directory / shard))
        weight_map[f"l{number}.w"] = shard
    index = {"metadata": {"total_size": 32}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text("{}")
    (directory / "2_Empty").mkdir()
    return directory


MODEL_MODES = {
    ".": 0o2775,
    "model-00001-of-00002.safetensors": 0o6755,
    "model-00002-of-00002.safetensors": 0o640,
    "model.safetensors.index.json": 0o4644,
    "config.json": 0o4755,
    "1_Pooling": 0o3750,
    "1_Pooling/config.json": 0o2740,
    "2_Empty": 0o1700,
}


def shared_parent(place: Path, setgid: bool) -> Path:
    """The folder OUT is made in: setgid (owned by root's group, which the ordinary user
    is not in) or plain; anyone may write into it."""
    parent = place / "shared"
    parent.mkdir()
    parent.chmod(0o2777 if setgid else 0o777)
    return parent


@pytest.mark.parametrize("user", [False, True], ids=["root", "user"])
@pytest.mark.parametrize("setgid", [False, True], ids=["plain", "setgid-parent"])
def test_a_model_directory_out_gets_the_modes_cp_r_gives(
    place: Path, setgid: bool, user: bool
) -> None:
    model = write_model(place / "model")
    hand_over(model, user)
    for relative, bits in MODEL_MODES.items():
        (model / relative).chmod(bits)
    parent = shared_parent(place, setgid)
    run(["cp", "-r", str(model), "ref"], parent, user=user)
    run(clipcli("clip", "--global", "1e30", "-q", str(model), "out"), parent, user=user)
    reference = modes(parent / "ref")
    assert modes(parent / "out") == reference
    assert (reference["."] & stat.S_ISGID != 0) is setgid  # the reference really differs
    assert all(bits & stat.S_ISUID == 0 for bits in reference.values())
    assert (parent / "out").stat().st_gid == (parent / "ref").stat().st_gid


@pytest.mark.parametrize("user", [False, True], ids=["root", "user"])
def test_a_one_file_model_directory_in_a_setgid_parent_is_made_as_mkdir_makes_it(
    place: Path, user: bool
) -> None:
    src = write_input(place / "in.safetensors")
    hand_over(src, user)
    src.chmod(0o6750)
    parent = shared_parent(place, setgid=True)
    run(["mkdir", "ref"], parent, user=user)
    run(["cp", str(src), "ref/model.safetensors"], parent, user=user)
    run(clipcli("convert", "-q", str(src), "out/"), parent, user=user)
    assert modes(parent / "out") == modes(parent / "ref")
    assert mode(parent / "out") & stat.S_ISGID


# ---------------------------------------------------------------- .keras members


@pytest.mark.skipif(shutil.which("unzip") is None, reason="needs Info-ZIP unzip")
def test_keras_members_lose_setuid_setgid_and_sticky(place: Path) -> None:
    """Info-ZIP `unzip -K` restores a member's setuid and setgid bits: extracted from
    IN, config.json is 6755; from OUT, 0755 (what cp gives)."""
    weights = place / "w.h5"
    with h5py.File(weights, "w") as handle:
        handle.create_dataset("dense/kernel", data=np.arange(6, dtype=np.float32))
    src = place / "in.keras"
    with zipfile.ZipFile(src, "w") as archive:
        config = zipfile.ZipInfo("config.json")
        config.create_system = 3
        config.external_attr = (stat.S_IFREG | 0o6755) << 16
        archive.writestr(config, "{}")
        sticky = zipfile.ZipInfo("assets/")
        sticky.create_system = 3
        sticky.external_attr = (stat.S_IFDIR | 0o1777) << 16 | 0x10
        archive.writestr(sticky, b"")
        archive.write(weights, "model.weights.h5")
    run(clipcli("clip", "--global", "1", "-q", "in.keras", "out.keras"), place)
    with zipfile.ZipFile(place / "out.keras") as archive:
        assert archive.namelist() == ["config.json", "assets/", "model.weights.h5"]
        attrs = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
    assert attrs["config.json"] == stat.S_IFREG | 0o755
    assert attrs["assets/"] == stat.S_IFDIR | 0o777
    for name in ("in", "out"):
        run(["unzip", "-q", "-K", f"{name}.keras", "config.json", "-d", name], place)
    assert mode(place / "in" / "config.json") == 0o6755
    assert mode(place / "out" / "config.json") == 0o755
