"""What a reader says ABOUT a file (Reader.descriptions: a PyTorch file's `pytorch.layout`,
`pytorch.byteorder`, `pytorch.tied`; a GGUF header's `gguf.version`) describes that file,
not the checkpoint: `diff` does not compare it as metadata. Two torch.save of one dict
under other names (other zip folders), a file and its conversion, a `.bin` shard directory
and its join are identical for `diff --fail-above 0`; a value the file holds still counts.
The fixtures were written by torch (tests/data/pytorch/make_fixtures.py)."""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import MainRun
from expect import REPO_ROOT
from safetensors.numpy import save_file
from test_pytorch_hostile import integer, state, tensor, torch_zip

from clipcli.formats.opening import open_reader

PYTORCH = REPO_ROOT / "tests" / "data" / "pytorch"
FIXTURES = ["zip_v2.pt", "legacy.pt", "zip_big_endian.pt", "legacy_tar.pt"]


def _same(clipcli: Callable[..., MainRun], a: Path, b: Path) -> None:
    run = clipcli("diff", "--fail-above", "0", "--format", "json", a, b)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["metadata_changes"] == []


def _under_folder(source: Path, target: Path, folder: str) -> Path:
    """The zip's records under another top folder, as torch.save names it after the file."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            renamed = folder + "/" + info.filename.split("/", 1)[1]
            new.writestr(zipfile.ZipInfo(renamed, info.date_time), old.read(info))
    return target


def test_one_state_dict_saved_under_two_names_is_identical(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    a = _under_folder(PYTORCH / "zip_v2.pt", tmp_path / "a.pt", "a")
    b = _under_folder(PYTORCH / "zip_v2.pt", tmp_path / "b.pt", "b")
    with open_reader(a) as reader_a, open_reader(b) as reader_b:  # they do read differently
        assert reader_a.metadata["pytorch.layout"] == "zip (a/)"
        assert reader_b.metadata["pytorch.layout"] == "zip (b/)"
        assert "pytorch.tied" in reader_a.descriptions()
    _same(clipcli, a, b)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("name", FIXTURES)
def test_a_file_and_its_conversion_are_identical(
    clipcli: Callable[..., MainRun], tmp_path: Path, name: str, suffix: str
) -> None:
    out = tmp_path / f"out{suffix}"
    assert clipcli("convert", "-q", PYTORCH / name, out).returncode == 0
    _same(clipcli, PYTORCH / name, out)
    _same(clipcli, out, PYTORCH / name)


def test_a_bin_shard_directory_and_its_join_are_identical(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for number, name in enumerate(["x", "y"], 1):
        shard = f"pytorch_model-0000{number}-of-00002.bin"
        plain = tmp_path / f"{name}.safetensors"
        save_file({name: np.arange(6, dtype=np.float32) * number}, plain)
        assert clipcli("convert", "-q", plain, model / shard).returncode == 0
        weight_map[name] = shard
    (model / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    joined = tmp_path / "out.bin"
    assert clipcli("convert", "-q", model, joined).returncode == 0
    _same(clipcli, model, joined)
    _same(clipcli, joined, model)
    one = tmp_path / "one"  # a directory of one shard and no index: that shard's metadata
    one.mkdir()
    shutil.copy(model / "pytorch_model-00001-of-00002.bin", one / "pytorch_model.bin")
    single = tmp_path / "single.safetensors"
    assert clipcli("convert", "-q", one, single).returncode == 0
    _same(clipcli, one, single)


def test_a_value_the_file_holds_still_counts(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    weights = {"0": np.arange(1.0, 5.0).astype("<f4").tobytes()}
    a = torch_zip(tmp_path / "a.pt", state(w=tensor(), epoch=integer(1)), weights)
    b = torch_zip(tmp_path / "b.pt", state(w=tensor(), epoch=integer(2)), weights)
    run = clipcli("diff", "--fail-above", "0", "--format", "json", a, b)
    assert run.returncode == 1
    assert json.loads(run.stdout)["metadata_changes"] == [{"key": "epoch", "a": "1", "b": "2"}]


def _gguf(path: Path, version_key: str | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    if version_key is not None:
        writer.add_string(version_key, "mine")
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_headers_version_is_a_description(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    source = _gguf(tmp_path / "a.gguf")
    with open_reader(source) as reader:
        assert reader.descriptions() == {"gguf.version"}
        assert "gguf.version" not in reader.joined_metadata()
    out = tmp_path / "out.safetensors"
    assert clipcli("convert", "-q", source, out).returncode == 0
    _same(clipcli, source, out)


def test_a_key_of_the_file_named_like_a_description_is_metadata(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    source = _gguf(tmp_path / "a.gguf", version_key="gguf.version")
    with open_reader(source) as reader:
        assert reader.metadata["gguf.version"] == "mine"
        assert reader.descriptions() == frozenset()
    other = _gguf(tmp_path / "b.gguf")
    run = clipcli("diff", "--fail-above", "0", source, other)
    assert run.returncode == 1
    assert "gguf.version" in run.stdout
