"""Item 2 of issue 9: confinement of every file read or copied from a model directory laid
out like the Hugging Face cache; item 18: shards opened on demand under a low `ulimit -n`."""

from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hostile_cli import assert_refused, run_clipcli
from safetensors import safe_open
from safetensors.numpy import save_file

SECRET = "ssh-ed25519 PRIVATE KEY MATERIAL"


def hf_cache(root: Path) -> tuple[Path, Path]:
    """<root>/hub/models--org--name/{blobs/<sha>, snapshots/v1/* -> ../../blobs/<sha>}, the
    layout huggingface_hub writes; returns (snapshot, blobs)."""
    entry = root / "hub" / "models--org--name"
    blobs = entry / "blobs"
    snapshot = entry / "snapshots" / "v1"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    files = {
        "model.safetensors": None,
        "config.json": b'{"model_type": "toy"}',
        "tokenizer.json": b"{}",
    }
    for number, (name, content) in enumerate(files.items()):
        blob = blobs / f"{number:040x}"
        if content is None:
            save_file({"w": np.array([3.0, 4.0], np.float32)}, str(blob))
        else:
            blob.write_bytes(content)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot, blobs


def secret_outside(root: Path) -> Path:
    secret = root / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text(SECRET)
    return secret


def assert_no_secret_anywhere(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def test_healthy_hf_cache_snapshot_is_read_and_copied(tmp_path: Path) -> None:
    snapshot, _ = hf_cache(tmp_path)
    out = tmp_path / "out"
    run_norms, run_clip = run_clipcli(
        ["norms", "--format", "json", str(snapshot)],
        ["clip", "--global", "1", str(snapshot), str(out)],
        cwd=tmp_path,
    )
    assert run_norms.returncode == 0, run_norms.describe()
    assert json.loads(run_norms.stdout)["global_norm"] == 5.0
    assert run_clip.returncode == 0, run_clip.describe()
    assert (out / "config.json").read_bytes() == b'{"model_type": "toy"}'
    assert not (out / "config.json").is_symlink()
    with safe_open(str(out / "model.safetensors"), framework="np") as handle:
        assert float(np.linalg.norm(handle.get_tensor("w"))) <= 1.0


def _blobs_to_root(snapshot: Path, blobs: Path) -> None:
    """The reported layout: x/blobs is a symlink to `/`, the snapshot's files are real."""
    for entry in snapshot.iterdir():
        content = entry.read_bytes()
        entry.unlink()
        entry.write_bytes(content)
    shutil.rmtree(blobs)
    blobs.symlink_to("/")


def _attack_blobs_to_root(snapshot: Path, blobs: Path, secret: Path) -> Path:
    """blobs -> / and config.json -> ../../blobs/<the secret's path>: the reported escape."""
    _blobs_to_root(snapshot, blobs)
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to(Path("../../blobs") / str(secret).lstrip("/"))
    assert config.read_text() == SECRET  # the link really reaches the secret
    return config


def _attack_blobs_to_root_absolute_link(snapshot: Path, blobs: Path, secret: Path) -> Path:
    """blobs -> / makes `/` an allowed root, so any absolute link would pass."""
    _blobs_to_root(snapshot, blobs)
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to(secret)
    return config


def _attack_blobs_to_root_proc_environ(snapshot: Path, blobs: Path, _secret: Path) -> Path:
    _blobs_to_root(snapshot, blobs)
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to("/proc/self/environ")
    return config


def _attack_config_to_secret(snapshot: Path, _blobs: Path, secret: Path) -> Path:
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to(secret)
    return config


def _attack_config_to_etc_passwd(snapshot: Path, _blobs: Path, _secret: Path) -> Path:
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to("/etc/passwd")
    return config


def _attack_config_to_proc_environ(snapshot: Path, _blobs: Path, _secret: Path) -> Path:
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to("/proc/self/environ")
    return config


def _attack_blob_links_out(snapshot: Path, blobs: Path, secret: Path) -> Path:
    """The blob itself is a link out of blobs/."""
    config = snapshot / "config.json"
    blob = blobs / os.path.basename(os.readlink(config))
    blob.unlink()
    blob.symlink_to(secret)
    return config


def _attack_fifo_side_file(snapshot: Path, blobs: Path, _secret: Path) -> Path:
    fifo = blobs / "fifo"
    os.mkfifo(fifo)
    config = snapshot / "generation_config.json"
    config.symlink_to("../../blobs/fifo")
    return config


def _attack_device_side_file(snapshot: Path, _blobs: Path, _secret: Path) -> Path:
    config = snapshot / "special_tokens_map.json"
    config.symlink_to("/dev/zero")
    return config


def _attack_shard_to_proc(snapshot: Path, _blobs: Path, _secret: Path) -> Path:
    model = snapshot / "model.safetensors"
    model.unlink()
    model.symlink_to("/proc/self/environ")
    return model


def _attack_blobs_to_secret_directory(snapshot: Path, blobs: Path, secret: Path) -> Path:
    """blobs/ is a link to the directory that holds the secret."""
    _blobs_to_root(snapshot, blobs)
    blobs.unlink()
    blobs.symlink_to(secret.parent)
    config = snapshot / "config.json"
    config.unlink()
    config.symlink_to(Path("../../blobs") / secret.name)
    assert config.read_text() == SECRET
    return config


ATTACKS = [
    _attack_blobs_to_root,
    _attack_blobs_to_root_absolute_link,
    _attack_blobs_to_root_proc_environ,
    _attack_blobs_to_secret_directory,
    _attack_config_to_secret,
    _attack_config_to_etc_passwd,
    _attack_config_to_proc_environ,
    _attack_blob_links_out,
    _attack_fifo_side_file,
    _attack_device_side_file,
    _attack_shard_to_proc,
]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__[len("_attack_") :])
def test_hf_cache_attacks_are_refused(tmp_path: Path, attack) -> None:  # type: ignore[no-untyped-def]
    snapshot, blobs = hf_cache(tmp_path)
    secret = secret_outside(tmp_path)
    named = attack(snapshot, blobs, secret)
    out = tmp_path / "out"
    merged = tmp_path / "merged.safetensors"
    assert_refused(
        [
            ["clip", "--global", "1", str(snapshot), str(out)],
            ["clip", "--global", "1", str(snapshot), str(merged)],
        ],
        3,
        [named.name],
        watch=tmp_path,
        timeout=20,
    )
    assert_no_secret_anywhere(tmp_path / "hub")


def test_filesystem_root_is_never_a_model_directory(tmp_path: Path) -> None:
    assert_refused(["ls", "/"], 3, [], watch=tmp_path)


def test_user_named_symlink_to_a_model_directory_is_followed(tmp_path: Path) -> None:
    """A symlink the user names is the user's choice: only links found inside are judged."""
    snapshot, _ = hf_cache(tmp_path)
    link = tmp_path / "my-model"
    link.symlink_to(snapshot)
    (run,) = run_clipcli(["norms", "--format", "json", str(link)], cwd=tmp_path)
    assert run.returncode == 0, run.describe()


# ------------------------------------------------------------------ item 18: open files

SHARDS = 2_000
FD_LIMIT = 256


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.mark.slow  # 2,000 shard files and a fresh interpreter
def test_two_thousand_shards_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    expected = 0.0
    for number in range(SHARDS):
        name = f"model-{number + 1:05d}-of-{SHARDS:05d}.safetensors"
        value = float(number % 7)
        save_file({f"t{number}": np.array([value], np.float32)}, str(model / name))
        weight_map[f"t{number}"] = name
        expected += value * value
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 4 * SHARDS}, "weight_map": weight_map})
    )
    out = tmp_path / "out"
    for args in (
        ["norms", "--format", "json", str(model)],
        ["clip", "--global", "1e9", "--quiet", str(model), str(out)],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "clipcli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_low_fd_limit,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        if args[0] == "norms":
            assert json.loads(proc.stdout)["global_norm"] == pytest.approx(expected**0.5)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) == SHARDS
    with safe_open(str(out / shards[-1]), framework="np") as handle:
        assert handle.get_tensor(f"t{SHARDS - 1}")[0] == float((SHARDS - 1) % 7)
    assert stat.S_ISREG((out / "model.safetensors.index.json").stat().st_mode)


def test_shards_beyond_the_open_limit_are_reopened_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one descriptor allowed, every shard is closed and reopened as it is read; a shard
    replaced by another file in between is refused, not read."""
    from clipcli.errors import InputError
    from clipcli.formats.sharded import reader as sharded

    monkeypatch.setattr(sharded, "MAX_OPEN_SHARDS", 1)
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for number in range(3):
        name = f"model-{number + 1:05d}-of-00003.safetensors"
        save_file({f"t{number}": np.full(3, number + 1.0, np.float32)}, str(model / name))
        weight_map[f"t{number}"] = name
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reader = sharded.ShardedReader(model, model / "model.safetensors.index.json")
    with reader:
        for info in reader.infos:  # every shard reopened in turn
            assert float(reader.read(info)[0]) == float(info.name[1:]) + 1
            open_now = [reader.shard_reader(s).is_open for s in reader.shard_names]
            assert sum(open_now) <= 1
        first = reader.infos[0]
        path = model / reader.shard_of(first.name)
        path.unlink()
        save_file({first.name: np.full(3, 99.0, np.float32)}, str(path))  # a new inode
        with pytest.raises(InputError, match="changed"):
            reader.read(first)
