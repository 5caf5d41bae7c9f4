"""Issue 22 item 2: a file beside a model directory's weights that any reader of the
registry reads (a PyTorch legacy tar included) is weights: left out of a directory OUT with
a note, never copied unclipped beside the clipped weights. Recognised by content under a
name that says nothing, and by every suffix a registry reader claims."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import h5py
import numpy as np
import pytest
from conftest import MainRun
from expect import REPO_ROOT
from layouts import keras_archive
from safetensors.numpy import save_file

from clipcli.formats import registry
from clipcli.formats.opening import open_reader

PYTORCH = REPO_ROOT / "tests" / "data" / "pytorch"
WEIGHTS = np.arange(1, 17, dtype=np.float32) * 100


def _gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", WEIGHTS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _h5(path: Path) -> None:
    with h5py.File(path, "w") as h5:
        h5["w"] = WEIGHTS


def _npy(path: Path) -> None:
    with path.open("wb") as handle:  # np.save(name) would add '.npy' to the name
        np.save(handle, WEIGHTS)


# One sample of every file format the registry reads (tests below check the list is whole).
SAMPLES: dict[str, Callable[[Path], object]] = {
    "npz": lambda p: p.write_bytes(_npz_bytes(p)),
    "safetensors": lambda p: save_file({"w": WEIGHTS}, p),
    "hdf5": _h5,
    "keras": keras_archive,
    "npy": _npy,
    "pytorch zip": lambda p: shutil.copy(PYTORCH / "zip_v2.pt", p),
    "pytorch pickle": lambda p: shutil.copy(PYTORCH / "legacy.pt", p),
    "pytorch tar": lambda p: shutil.copy(PYTORCH / "legacy_tar.pt", p),
    "gguf": _gguf,
}


def _npz_bytes(path: Path) -> bytes:
    scratch = path.with_name("scratch.npz")
    np.savez(scratch, w=WEIGHTS)
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def _model_directory(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.ones(4, np.float32)}, model / "model.safetensors")
    (model / "config.json").write_text("{}")
    return model


def test_every_readable_format_has_a_sample() -> None:
    readable = {f.name for f in registry.FORMATS if f.readable}
    assert {name.split()[0] for name in SAMPLES} == readable


@pytest.mark.parametrize("name", ["checkpoint.pth.tar", "weights", "blob.dat"])
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_weights_beside_the_model_are_left_out_with_a_note(
    clipcli: Callable[..., MainRun], tmp_path: Path, sample: str, name: str
) -> None:
    model = _model_directory(tmp_path)
    side = model / name
    SAMPLES[sample](side)
    with open_reader(side) as reader:  # clipcli reads it
        assert reader.infos
    out = tmp_path / "out"
    run = clipcli("clip", "-q", "--global", "1", model, out)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    notes = [line for line in run.stderr.splitlines() if name in line]
    assert len(notes) == 1, run.stderr
    assert notes[0].startswith("clipcli: note: ")
    assert "weights in another format" in notes[0]


@pytest.mark.parametrize(
    "suffix", sorted({s for f in registry.FORMATS if f.readable for s in f.suffixes})
)
def test_every_suffix_a_reader_claims_is_weights_by_name(
    clipcli: Callable[..., MainRun], tmp_path: Path, suffix: str
) -> None:
    model = _model_directory(tmp_path)
    (model / "extra").mkdir()  # (a second .safetensors at the top would be a shard)
    (model / "extra" / f"other{suffix}").write_text("not even weights: the name says so")
    out = tmp_path / "out"
    run = clipcli("clip", "-q", "--global", "1", model, out)
    assert run.returncode == 0, run.stderr
    assert not (out / "extra" / f"other{suffix}").exists()
    assert f"other{suffix}" in run.stderr


def test_a_text_file_beside_the_model_is_still_copied(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    model = _model_directory(tmp_path)
    (model / "README").write_text("a model card\n" * 40)
    out = tmp_path / "out"
    run = clipcli("clip", "-q", "--global", "1", model, out)
    assert run.returncode == 0, run.stderr
    assert (out / "README").read_text() == (model / "README").read_text()
