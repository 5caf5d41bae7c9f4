"""Model directories of PyTorch weights: `pytorch_model.bin`, or sharded
`pytorch_model-0000N-of-0000M.bin` with `pytorch_model.bin.index.json`, read as one
checkpoint (the sharded layer asks the registry for its shards' format); converted to
safetensors shards and index under transformers' names, other files kept; a directory that
holds `model.safetensors` too is read from the safetensors, and says so.

The `.bin` files are written by clipcli's own PyTorch writer (torch-free; that torch loads
them is tests/test_pytorch_writer.py); the reference values are the numpy arrays they were
made from, and what is written is read back with the official safetensors reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.formats.opening import open_reader
from clipcli.formats.sharded import validate_sharded

SHARD_NAMES = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]


def arrays() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        {
            "embed.weight": rng.standard_normal((4, 3)).astype(np.float32),
            "layer.0.weight": rng.standard_normal((3, 3)).astype(np.float32),
        },
        {
            "layer.1.weight": (rng.standard_normal((3, 3)) * 9).astype(np.float16),
            "layer.1.bias": rng.standard_normal(3).astype(np.float32),
        },
    ]


def write_bin(tmp: Path, path: Path, tensors: dict[str, np.ndarray]) -> None:
    source = tmp / (path.stem + ".safetensors")
    save_file(tensors, source)
    assert main(["convert", "-q", str(source), str(path)]) == 0
    source.unlink()


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for name, tensors in zip(SHARD_NAMES, arrays(), strict=True):
        write_bin(tmp_path, model / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (model / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (model / "config.json").write_text('{"model_type": "tiny"}')
    return model


@pytest.fixture
def single(tmp_path: Path) -> Path:
    model = tmp_path / "single"
    model.mkdir()
    write_bin(tmp_path, model / "pytorch_model.bin", {**arrays()[0], **arrays()[1]})
    (model / "config.json").write_text('{"model_type": "tiny"}')
    return model


def everything() -> dict[str, np.ndarray]:
    return {**arrays()[0], **arrays()[1]}


def test_a_sharded_pytorch_directory_is_one_checkpoint(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_reader(sharded) as reader:
        assert reader.format_name == "pytorch-sharded"
        assert {i.name: reader.shard_of(i.name) for i in reader.infos} == {
            name: shard
            for shard, tensors in zip(SHARD_NAMES, arrays(), strict=True)
            for name in tensors
        }
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info), everything()[info.name])
    assert main(["norms", "--format", "json", str(sharded)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["format"] == "pytorch-sharded"
    want = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in everything().values()))
    assert document["global_norm"] == pytest.approx(float(want), rel=1e-12)


def test_the_index_names_the_directory_too(sharded: Path) -> None:
    with open_reader(sharded / "pytorch_model.bin.index.json") as reader:
        assert reader.format_name == "pytorch-sharded"
        assert len(reader.infos) == 4


def test_converting_writes_safetensors_shards_and_index(sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["convert", "-q", str(sharded), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        name: f"model-0000{n}-of-00002.safetensors"
        for n, tensors in enumerate(arrays(), 1)
        for name in tensors
    }
    validate_sharded(out)  # every shard opens with safe_open, total_size adds up
    for n, tensors in enumerate(arrays(), 1):
        written = load_file(out / f"model-0000{n}-of-00002.safetensors")
        assert sorted(written) == sorted(tensors)
        for name, values in tensors.items():
            np.testing.assert_array_equal(written[name], values)
    from safetensors import safe_open

    with safe_open(str(out / "model-00001-of-00002.safetensors"), framework="np") as handle:
        assert handle.metadata() == {"format": "pt"}  # what transformers looks for
    assert (out / "config.json").read_text() == '{"model_type": "tiny"}'


def test_clip_of_a_pytorch_directory_writes_safetensors(sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "1", "-q", str(sharded), str(out)]) == 0
    written = {**load_file(out / "model-00001-of-00002.safetensors")}
    written.update(load_file(out / "model-00002-of-00002.safetensors"))
    total = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in written.values()))
    assert total <= 1


def test_a_single_pytorch_model_bin(single: Path, tmp_path: Path) -> None:
    (single / "training_args.bin").write_bytes(b"\x80\x02not weights")  # a .bin beside it
    with open_reader(single) as reader:
        assert reader.format_name == "pytorch-sharded"
        assert sorted(i.name for i in reader.infos) == sorted(everything())
    out = tmp_path / "out"
    assert main(["convert", "-q", str(single), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    written = load_file(out / "model.safetensors")
    for name, values in everything().items():
        np.testing.assert_array_equal(written[name], values)


def test_a_bin_index_naming_a_path_is_refused(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = json.loads((sharded / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["embed.weight"] = "../pytorch_model-00001-of-00002.bin"
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert main(["norms", str(sharded)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "is not a plain *.bin file name" in line


def test_a_bin_index_naming_a_safetensors_shard_is_refused(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = json.loads((sharded / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["embed.weight"] = "model.safetensors"
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert main(["norms", str(sharded)]) == 3
    assert "is not a plain *.bin file name" in one_error_line(capsys.readouterr().err)


def test_safetensors_beside_bin_are_preferred_and_said(
    single: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safe = {"only.in.safetensors": np.ones(2, np.float32)}
    save_file(safe, single / "model.safetensors")
    with open_reader(single) as reader:
        assert reader.format_name == "safetensors-sharded"
        assert [i.name for i in reader.infos] == ["only.in.safetensors"]
    assert main(["norms", "--format", "json", str(single)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["format"] == "safetensors-sharded"
    assert (
        "clipcli: warning: read model.safetensors; the PyTorch weights beside it "
        "(pytorch_model.bin) are left out"
    ) in captured.err


def test_an_empty_directory_names_both_kinds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["norms", str(tmp_path / "empty")]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "no safetensors index or model file in this directory" in line
    assert "pytorch_model.bin" in line


def test_tied_tensors_in_a_pytorch_shard_count_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from expect import REPO_ROOT

    model = tmp_path / "tied"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(
        (REPO_ROOT / "tests" / "data" / "pytorch" / "zip_v2.pt").read_bytes()
    )
    assert main(["norms", "--format", "json", str(model)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["lm_head.weight"]["role"] == "tied to 0.weight"
    assert rows["lm_head.weight"]["in_global"] is False


def test_loaders_and_release_read_the_same_values(tmp_path: Path) -> None:
    """Contiguous tensors have thread-safe loaders (strided views do not); a released
    descriptor is reopened for the next read, and a file swapped meanwhile is refused."""
    from expect import REPO_ROOT

    from clipcli.errors import InputError
    from clipcli.formats.pytorch import PyTorchReader

    source = REPO_ROOT / "tests" / "data" / "pytorch" / "zip_v2.pt"
    with np.load(source.with_name("zip_v2.expected.npz")) as archive:
        want = {key: archive[key] for key in archive.files}
    copy = tmp_path / "copy.pt"
    copy.write_bytes(source.read_bytes())
    with PyTorchReader(copy) as reader:
        infos = {i.name: i for i in reader.infos}
        assert reader.chunk_loaders(infos["transposed"]) is None
        loaders = reader.chunk_loaders(infos["1.weight"])
        assert loaders is not None
        joined = np.concatenate([load() for load in loaders]).astype(np.float64)
        np.testing.assert_array_equal(joined, want["1.weight"].ravel())
        reader.release()
        np.testing.assert_array_equal(reader.read(infos["half"]).astype(np.float64), want["half"])
        reader.release()
        copy.unlink()
        copy.write_bytes(source.read_bytes())  # another file under the name
        with pytest.raises(InputError, match="changed since it was opened"):
            reader.read(infos["half"])
