"""A model directory's side files: hard links and the budget for all of them together
(issue 18, threat model Open item 11).

A side file whose inode has a name outside the model directory (a tar extracted without
filters leaves `config.json` hard-linked to `../../.ssh/id_ed25519`) passes the path
confinement; copying it would put any file of the user's into OUT. It is refused (exit 3)
when OUT is a directory; hard links among the directory's own files are copied. All side
files together are bounded in count and bytes (exit 3).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.output import policy

Runner = Callable[..., Any]


def make_model(directory: Path) -> Path:
    """A one-shard model directory with an index, a config and a tokenizer."""
    directory.mkdir(parents=True)
    save_file({"w": np.arange(8, dtype=np.float32)}, str(directory / "model.safetensors"))
    index = {"metadata": {"total_size": 32}, "weight_map": {"w": "model.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    return directory


def clip_to_directory(clipcli: Runner, model: Path, out: Path, *flags: str) -> Any:
    return clipcli("clip", "--global", "1", "-q", *flags, model, out)


# ------------------------------------------------------------------------- hard links


def test_a_side_file_hard_linked_outside_is_refused_and_nothing_written(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    secret = tmp_path / "home" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY")
    model = make_model(tmp_path / "model")
    os.link(secret, model / "vocab.txt")  # what `tar x` of a hostile archive leaves
    out = tmp_path / "out"
    run = clip_to_directory(clipcli, model, out)
    assert run.returncode == 3
    assert_one_error_line(run.stderr, "vocab.txt", "hard link with 2 names", "not copied")
    assert "PRIVATE KEY" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "model"]


def test_reading_a_directory_with_such_a_link_still_works(tmp_path: Path, clipcli: Runner) -> None:
    """Only copying is refused: ls, norms and a one-file OUT copy no side file."""
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("x")
    model = make_model(tmp_path / "model")
    os.link(outside, model / "notes.txt")
    assert clipcli("ls", model).returncode == 0
    assert clipcli("norms", model).returncode == 0
    run = clipcli("clip", "--global", "1", "-q", model, tmp_path / "one.safetensors")
    assert run.returncode == 0, run.stderr


def test_hard_links_among_the_directorys_own_files_are_copied(
    tmp_path: Path, clipcli: Runner
) -> None:
    """Every name of the inode is inside (a dedup tool linked two copies): copied, both."""
    model = make_model(tmp_path / "model")
    (model / "1_Pooling").mkdir()
    os.link(model / "config.json", model / "1_Pooling" / "config.json")
    os.link(model / "tokenizer.json", model / "tokenizer_copy.json")
    out = tmp_path / "out"
    run = clip_to_directory(clipcli, model, out)
    assert run.returncode == 0, run.stderr
    assert (out / "1_Pooling" / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert (out / "tokenizer_copy.json").read_bytes() == (model / "tokenizer.json").read_bytes()


def test_a_side_file_linked_to_a_shard_is_copied(tmp_path: Path, clipcli: Runner) -> None:
    """The shards and the index are names inside the directory too."""
    model = make_model(tmp_path / "model")
    os.link(model / "model.safetensors.index.json", model / "index_copy.txt")
    run = clip_to_directory(clipcli, model, tmp_path / "out")
    assert run.returncode == 0, run.stderr


def test_one_name_more_outside_than_inside_is_refused(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    """At the limit (every name inside) copied; one name more, outside, refused."""
    model = make_model(tmp_path / "model")
    os.link(model / "config.json", model / "config_copy.json")
    assert clip_to_directory(clipcli, model, tmp_path / "out1").returncode == 0
    os.link(model / "config.json", tmp_path / "outside.json")
    run = clip_to_directory(clipcli, model, tmp_path / "out2")
    assert run.returncode == 3
    assert_one_error_line(run.stderr, "config", "hard link with 3 names")
    assert not (tmp_path / "out2").exists()


def hub_snapshot(root: Path) -> tuple[Path, Path]:
    """models--org--name/{blobs/<sha>, snapshots/v1/* -> ../../blobs/<sha>}."""
    entry = root / "hub" / "models--org--name"
    blobs = entry / "blobs"
    snapshot = entry / "snapshots" / "v1"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file({"w": np.ones(4, np.float32)}, str(blobs / "a"))
    (blobs / "b").write_text('{"model_type": "llama"}')
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/a"))
    (snapshot / "config.json").symlink_to(Path("../../blobs/b"))
    return snapshot, blobs


def test_a_hub_cache_snapshot_of_symlinks_to_blobs_is_copied(
    tmp_path: Path, clipcli: Runner
) -> None:
    """The Hub cache links snapshots to blobs by symlink: one name per blob, copied."""
    snapshot, _ = hub_snapshot(tmp_path)
    out = tmp_path / "out"
    run = clip_to_directory(clipcli, snapshot, out)
    assert run.returncode == 0, run.stderr
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_blob_hard_linked_elsewhere_is_refused(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    snapshot, blobs = hub_snapshot(tmp_path)
    os.link(blobs / "b", tmp_path / "elsewhere")
    run = clip_to_directory(clipcli, snapshot, tmp_path / "out")
    assert run.returncode == 3
    assert_one_error_line(run.stderr, "config.json", "hard link with 2 names")


# ------------------------------------------------------------------------- the budget


@pytest.mark.parametrize(("count", "code"), [(3, 0), (4, 3)])
def test_side_file_count_at_the_limit_and_one_past(
    tmp_path: Path, clipcli: Runner, monkeypatch: pytest.MonkeyPatch, count: int, code: int
) -> None:
    monkeypatch.setattr(policy, "SIDE_FILES_MAX_COUNT", 3)
    model = make_model(tmp_path / "model")  # config.json and tokenizer.json
    for number in range(count - 2):
        (model / f"extra{number}.txt").write_text("x")
    out = tmp_path / "out"
    run = clip_to_directory(clipcli, model, out)
    assert run.returncode == code, run.stderr
    if code:
        assert "has 4 other files to copy" in run.stderr
        assert not out.exists()
    else:
        assert sorted(p.name for p in out.iterdir() if p.suffix == ".txt") == ["extra0.txt"]


@pytest.mark.parametrize(("extra", "code"), [(0, 0), (1, 2)])
def test_side_file_bytes_at_the_limit_and_one_past(
    tmp_path: Path, clipcli: Runner, monkeypatch: pytest.MonkeyPatch, extra: int, code: int
) -> None:
    model = make_model(tmp_path / "model")
    already = sum(len((model / n).read_bytes()) for n in ("config.json", "tokenizer.json"))
    monkeypatch.setattr(policy, "SIDE_FILES_MAX_BYTES", already + 1000)
    (model / "vocab.txt").write_bytes(b"v" * (1000 + extra))
    run = clip_to_directory(clipcli, model, tmp_path / "out")
    assert run.returncode == code, run.stderr
    if code:
        assert f"hold {already + 1001} bytes together" in run.stderr
        assert "--allow-large-side-files" in run.stderr
        assert not (tmp_path / "out").exists()
        run = clip_to_directory(clipcli, model, tmp_path / "out", "--allow-large-side-files")
        assert run.returncode == 0, run.stderr


@pytest.mark.slow  # several seconds: many processes or files
def test_many_side_files_at_the_real_count_limit_are_refused_before_copying(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    """10,001 empty side files (the per-file and entry limits pass): exit 3, nothing made."""
    model = make_model(tmp_path / "model")
    extra = policy.SIDE_FILES_MAX_COUNT + 1 - 2
    for number in range(extra):
        (model / f"f{number:05d}").touch()
    run = clip_to_directory(clipcli, model, tmp_path / "out")
    assert run.returncode == 3
    assert_one_error_line(run.stderr, f"has {policy.SIDE_FILES_MAX_COUNT + 1} other files")
    assert not (tmp_path / "out").exists()


def test_side_files_over_the_real_byte_budget_are_refused_before_copying(
    tmp_path: Path, clipcli: Runner, assert_one_error_line: Callable[..., str]
) -> None:
    """Five sparse files of exactly 1 GiB each (each at the per-file limit, allowed):
    5 GiB together is over the 4 GiB budget."""
    model = make_model(tmp_path / "model")
    for number in range(5):
        with open(model / f"big{number}.txt", "wb") as handle:
            handle.truncate(policy.SIDE_FILE_LIMIT)
    run = clip_to_directory(clipcli, model, tmp_path / "out")
    assert run.returncode == 2
    assert_one_error_line(run.stderr, "bytes together", "4 GiB")
    assert not (tmp_path / "out").exists()
