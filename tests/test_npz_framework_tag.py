"""A framework tag alone is no loss worth exit 2 (issue 23, item 7).

`convert minilm.safetensors m.npz` was refused over `__metadata__ = {"format": "pt"}`: a key
that only says which framework wrote the file. npz holds no metadata, so that key is now
dropped with one note line, said once OUT is written; real metadata (any other key, or
`format` with another value) is still refused without --allow-lossy. The sibling: a model
directory's index `total_size` (which joining into one file never keeps) was counted as
npz's loss too. Values are checked against numpy's own `np.load`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.formats.npz.metadata import FRAMEWORK_TAGS, metadata_loss, metadata_loss_text

NOTE = (
    "clipcli: note: npz holds no file metadata: format='pt', which only names the framework "
    "that wrote the file, is left out\n"
)


def _minilm_like(path: Path, metadata: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """all-MiniLM-L6-v2's layout in small: float32 weights, an int64 position_ids buffer,
    and `{"format": "pt"}` as its only metadata (written by safetensors itself)."""
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": rng.standard_normal((30, 8)).astype(np.float32),
        "embeddings.position_ids": np.arange(16, dtype=np.int64)[None],
        "encoder.layer.0.attention.self.query.weight": rng.standard_normal((8, 8)).astype(
            np.float32
        ),
    }
    save_file(tensors, str(path), metadata={"format": "pt"} if metadata is None else metadata)
    return tensors


def _assert_same_npz(out: Path, tensors: dict[str, np.ndarray]) -> None:
    with np.load(out) as loaded:
        assert sorted(loaded.files) == sorted(tensors)
        for name, array in tensors.items():
            assert loaded[name].dtype == array.dtype
            assert loaded[name].tobytes() == array.tobytes()


def test_convert_minilm_to_npz_drops_the_tag_with_a_note(run_main: Any, tmp_path: Path) -> None:
    src, out = tmp_path / "minilm.safetensors", tmp_path / "m.npz"
    tensors = _minilm_like(src)
    result = run_main("convert", src, out)
    assert result.code == 0, result.stderr
    assert result.stderr == NOTE
    _assert_same_npz(out, tensors)


def test_clip_into_npz_drops_the_tag_with_a_note(run_main: Any, tmp_path: Path) -> None:
    src, out = tmp_path / "minilm.safetensors", tmp_path / "m.npz"
    _minilm_like(src)
    result = run_main("clip", "--global", "1", "-q", src, out)
    assert result.code == 0, result.stderr
    assert result.stderr == NOTE
    dry = run_main("clip", "--global", "1", "-q", "--dry-run", src, tmp_path / "dry.npz")
    assert (dry.code, dry.stderr) == (0, NOTE)


@pytest.mark.parametrize("tag", sorted(FRAMEWORK_TAGS))
def test_every_framework_tag_is_no_loss(run_main: Any, tmp_path: Path, tag: str) -> None:
    src = tmp_path / "m.safetensors"
    _minilm_like(src, {"format": tag})
    result = run_main("convert", src, tmp_path / "m.npz")
    assert result.code == 0, result.stderr
    assert f"format={tag!r}" in result.stderr


@pytest.mark.parametrize(
    ("metadata", "lost"),
    [
        ({"format": "gguf"}, "file metadata (1 key: 'format')"),
        ({"format": "PT"}, "file metadata (1 key: 'format')"),
        ({"format": "pt "}, "file metadata (1 key: 'format')"),
        ({"framework": "pt"}, "file metadata (1 key: 'framework')"),
        ({"format": "pt", "license": "mit"}, "file metadata (2 keys: 'format', 'license')"),
    ],
)
def test_real_metadata_is_still_refused(
    run_main: Any, tmp_path: Path, metadata: dict[str, str], lost: str
) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "m.npz"
    tensors = _minilm_like(src, metadata)
    refused = run_main("convert", src, out)
    assert refused.code == 2
    assert refused.stderr == (
        f"clipcli: error: {out}: cannot hold {lost}; pass --allow-lossy to write it without them\n"
    )
    assert not out.exists()
    allowed = run_main("convert", "--allow-lossy", src, out)
    assert allowed.code == 0
    assert allowed.stderr == f"clipcli: warning: dropped from {out}: {lost}\n"
    _assert_same_npz(out, tensors)


def test_key_lists_at_three_names_and_past_them() -> None:
    assert metadata_loss_text(["a", "b", "c"]) == "file metadata (3 keys: 'a', 'b', 'c')"
    assert metadata_loss_text(["d", "c", "b", "a"]) == (
        "file metadata (4 keys: 'a', 'b', 'c' and 1 more)"
    )
    assert metadata_loss({"format": "pt"}) == ([], "pt")
    assert metadata_loss({}) == ([], None)
    assert metadata_loss({"format": "pt", "x": "1"}) == (["format", "x"], None)


def test_hdf5_root_attribute_tag_is_no_loss(run_main: Any, tmp_path: Path) -> None:
    src, out = tmp_path / "m.h5", tmp_path / "m.npz"
    with h5py.File(src, "w") as f:
        f["w"] = np.arange(4, dtype=np.float32)
        f.attrs["format"] = "pt"
    result = run_main("convert", src, out)
    assert (result.code, result.stderr) == (0, NOTE)
    _assert_same_npz(out, {"w": np.arange(4, dtype=np.float32)})


def _model_directory(directory: Path, index_metadata: dict[str, Any]) -> dict[str, np.ndarray]:
    directory.mkdir()
    shards: dict[str, dict[str, np.ndarray]] = {
        "model-00001-of-00002.safetensors": {"a.weight": np.ones((4, 4), np.float32)},
        "model-00002-of-00002.safetensors": {"b.weight": np.full(4, 2.0, np.float32)},
    }
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": index_metadata, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return {name: a for tensors in shards.values() for name, a in tensors.items()}


def test_model_directory_total_size_and_tag_are_no_loss(run_main: Any, tmp_path: Path) -> None:
    tensors = _model_directory(tmp_path / "model", {"total_size": 80})
    out = tmp_path / "m.npz"
    result = run_main("convert", tmp_path / "model", out)
    assert result.code == 0, result.stderr
    assert NOTE in result.stderr
    _assert_same_npz(out, tensors)


def test_model_directory_index_metadata_is_still_a_loss(run_main: Any, tmp_path: Path) -> None:
    _model_directory(tmp_path / "model", {"total_size": 80, "author": "someone"})
    refused = run_main("convert", tmp_path / "model", tmp_path / "m.npz")
    assert refused.code == 2
    assert "the index's metadata" in refused.stderr
    assert "author" in refused.stderr


def test_a_failed_write_says_one_error_line_and_no_note(tmp_path: Path, mount_tmpfs: Any) -> None:
    """The note comes once OUT is written: a full disk (a real 1 MiB tmpfs) ends in the one
    error line (exit 5), nothing left behind."""
    src = tmp_path / "big.safetensors"
    rng = np.random.default_rng(2)
    save_file(
        {"w": rng.standard_normal(600_000).astype(np.float32)}, str(src), metadata={"format": "pt"}
    )
    small = mount_tmpfs("small", size="1m")
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", "convert", str(src), str(small / "m.npz")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 5, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("clipcli: error:"), lines
    assert list(small.iterdir()) == []
