"""`clipcli ls` (issue 12, item 5): long metadata values shortened in the table only, the
shard of each tensor in a model directory, --include/--exclude and --sort, and the total
parameter count. Expected values come from the files as written with h5py/safetensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from expect import one_error_line
from rich.cells import cell_len
from safetensors.numpy import save_file

from clipcli.cli.entry import main

SHARDS: dict[str, dict[str, np.ndarray]] = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": np.ones((8, 4), np.float32),
        "model.layers.0.mlp.up_proj.weight": np.ones((4, 4), np.float32),
    },
    "model-00002-of-00002.safetensors": {
        "model.layers.1.mlp.up_proj.weight": np.ones((4, 6), np.float16),
        "lm_head.weight": np.ones((8, 4), np.float32),
    },
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    weight_map = {}
    for shard, tensors in SHARDS.items():
        save_file(tensors, str(directory / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    total = sum(a.nbytes for tensors in SHARDS.values() for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_shard_column_in_table_and_json(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = {name: shard for shard, tensors in SHARDS.items() for name in tensors}
    code, out, _ = _run(capsys, "ls", model_dir, "--format", "json")
    assert code == 0
    assert {t["name"]: t["shard"] for t in json.loads(out)["tensors"]} == expected
    code, out, _ = _run(capsys, "ls", model_dir)
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    assert {row[1].strip(): row[-2].strip() for row in rows} == expected


def test_single_file_has_no_shard_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(path))
    _, out, _ = _run(capsys, "ls", path, "--format", "json")
    assert "shard" not in json.loads(out)["tensors"][0]


def test_total_parameters(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    total = sum(math.prod(a.shape) for tensors in SHARDS.values() for a in tensors.values())
    _, out, _ = _run(capsys, "ls", model_dir, "--format", "json")
    assert json.loads(out)["total_parameters"] == total
    _, out, _ = _run(capsys, "ls", model_dir)
    assert f"4 tensors, {total:,} parameters" in out


def test_include_exclude_and_sort(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(
        capsys, "ls", model_dir, "-i", "model.*", "-x", "*embed*", "--sort", "name", "-f", "json"
    )
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    _, out, _ = _run(capsys, "ls", model_dir, "--sort", "size", "-f", "json")
    sizes = [t["bytes"] for t in json.loads(out)["tensors"]]
    assert sizes == sorted(sizes, reverse=True)
    _, out, _ = _run(capsys, "ls", model_dir, "-i", "lm_head.weight")
    assert "1 of 4 tensors" in out


def test_sort_by_norm_is_refused_by_ls(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "ls", model_dir, "--sort", "norm")
    assert code == 2
    assert out == ""
    assert "norms --sort norm" in one_error_line(err)


def test_keras_model_config_is_shortened_in_the_table_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.dumps(
        {"layers": [{"class_name": "Dense", "config": {"name": f"dense_{i}"}} for i in range(800)]}
    )
    assert len(config) > 24_000
    path = tmp_path / "keras.h5"
    with h5py.File(path, "w") as f:
        f.attrs["model_config"] = config
        f.attrs["keras_version"] = "2.15.0"
        f.create_group("model_weights/dense_0/dense_0")["kernel:0"] = np.ones((4, 4), np.float32)
    monkeypatch.setenv("COLUMNS", "80")
    _, out, _ = _run(capsys, "ls", path)
    assert len(out) < 2000
    assert all(cell_len(line) <= 80 for line in out.splitlines() if "model_config" in line)
    assert f"({len(config):,} characters; --format json has all)" in out
    _, out, _ = _run(capsys, "ls", path, "--format", "json")
    with h5py.File(path) as f:
        assert json.loads(out)["metadata"]["model_config"] == f.attrs["model_config"]


def test_training_state_is_not_counted_as_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Keras full model with Adam: 110 weights, two slots per weight and the step counter
    (221 numbers of training state). ls counts what norms counts as model weights."""
    path = tmp_path / "adam.h5"
    with h5py.File(path, "w") as f:
        f["model_weights/dense/dense/kernel:0"] = np.ones((10, 10), np.float32)
        f["model_weights/dense/dense/bias:0"] = np.ones(10, np.float32)
        f["optimizer_weights/Adam/iterations:0"] = np.array(7, np.int64)
        for slot in ("m", "v"):
            f[f"optimizer_weights/Adam/dense/kernel/{slot}:0"] = np.ones((10, 10), np.float32)
            f[f"optimizer_weights/Adam/dense/bias/{slot}:0"] = np.ones(10, np.float32)
    code, out, _ = _run(capsys, "ls", path)
    assert code == 0
    assert "7 tensors, 110 parameters (+221 in training state)" in out
    _, out, _ = _run(capsys, "ls", path, "--format", "json")
    document = json.loads(out)
    assert document["total_parameters"] == 110
    assert document["training_state_parameters"] == 221
    assert isinstance(document["total_bytes"], int)


def test_counts_meet_their_nouns_in_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "one.safetensors"
    save_file({"w": np.ones((), np.int8)}, str(path))
    _, out, _ = _run(capsys, "ls", path)
    # An int8 tensor is no parameter (issue 23 item 9: counted as `norms` counts them).
    assert "1 tensor, 0 parameters (+1 non-float), 1 byte" in out
    save_file({"w": np.ones((), np.float16)}, str(path))
    _, out, _ = _run(capsys, "ls", path)
    assert "1 tensor, 1 parameter, 2 bytes" in out
