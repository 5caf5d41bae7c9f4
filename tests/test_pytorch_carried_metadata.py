"""Issue 22 item 6: what the PyTorch reader says ABOUT a file (`pytorch.layout`,
`pytorch.byteorder`, `pytorch.tied`, `pytorch.shared_storage`) is shown by `ls` but is no
metadata of the checkpoint: a sharded `pytorch_model-0000N-of-0000M.bin` directory joins
into one file, and a `.pt` converts to `.npz` without --allow-lossy and to `.gguf` or
`.safetensors` without those keys. The file's own non-tensor values still count."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import MainRun
from expect import REPO_ROOT, one_error_line
from safetensors import safe_open
from safetensors.numpy import load_file
from test_pytorch_hostile import integer, state, tensor, torch_zip

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
VALUES = np.arange(1.0, 5.0)


def _tied(path: Path) -> Path:
    """Two names of one storage view: `pytorch.tied` (and a little-endian zip)."""
    pickled = state(**{"embed.weight": tensor(), "lm_head.weight": tensor()})
    return torch_zip(path, pickled, {"0": VALUES.astype("<f4").tobytes()})


def _big_endian(path: Path) -> Path:
    """A zip whose `byteorder` record says big: `pytorch.byteorder`."""
    pickled = state(w=tensor())
    return torch_zip(path, pickled, {"0": VALUES.astype(">f4").tobytes()}, byteorder=b"big")


def _legacy_tar(path: Path) -> Path:
    return Path(shutil.copy(DATA / "legacy_tar.pt", path))  # made by torch: float32 only


# Files with no non-tensor values, each described otherwise by the reader.
PLAIN: dict[str, Callable[[Path], Path]] = {
    "tied": _tied,
    "big_endian": _big_endian,
    "legacy_tar": _legacy_tar,
}


def _bin(path: Path, name: str, values: np.ndarray, **extra: bytes) -> Path:
    """A torch zip of {name: values} (float32), written by zipfile and a hand-made pickle."""
    pickled = state(**{name: tensor(numel=values.size, size=values.shape)}, **extra)
    return torch_zip(path, pickled, {"0": values.astype("<f4").tobytes()})


def _sharded(directory: Path) -> dict[str, np.ndarray]:
    directory.mkdir()
    want = {"a.weight": np.arange(4, dtype=np.float32), "b.weight": -np.arange(4.0, 8.0)}
    names = [f"pytorch_model-0000{i}-of-00002.bin" for i in (1, 2)]
    for (name, values), shard in zip(want.items(), names, strict=True):
        _bin(directory / shard, name, values)
    index = {
        "metadata": {"total_size": 32},
        "weight_map": dict(zip(want, names, strict=True)),
    }
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return {k: v.astype(np.float32) for k, v in want.items()}


def test_a_sharded_bin_directory_joins_into_one_file(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    want = _sharded(tmp_path / "d")
    out = tmp_path / "d.safetensors"
    run = clipcli("convert", "-q", tmp_path / "d", out)
    assert run.returncode == 0, run.stderr
    got = load_file(out)
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        np.testing.assert_array_equal(got[name], values)
    with safe_open(out, "np") as opened:
        assert not any(k.startswith("pytorch.") for k in opened.metadata() or {})


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_plain_checkpoint_converts_to_npz_without_allow_lossy(
    clipcli: Callable[..., MainRun], tmp_path: Path, name: str
) -> None:
    source = PLAIN[name](tmp_path / f"{name}.pt")
    assert any(k.startswith("pytorch.") for k in clipcli("ls", source).stdout.split())
    run = clipcli("convert", "-q", source, tmp_path / "o.npz")
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_no_description_of_the_source_is_written_as_metadata(
    clipcli: Callable[..., MainRun], tmp_path: Path, name: str
) -> None:
    source = PLAIN[name](tmp_path / f"{name}.pt")
    safetensors_out = tmp_path / "o.safetensors"
    assert clipcli("convert", "-q", source, safetensors_out).returncode == 0
    with safe_open(safetensors_out, "np") as opened:
        assert not any(k.startswith("pytorch.") for k in opened.metadata() or {})
    gguf_out = tmp_path / "o.gguf"
    run = clipcli("convert", "-q", source, gguf_out)
    assert run.returncode == 0, run.stderr
    assert not any(k.startswith("pytorch.") for k in gguf.GGUFReader(gguf_out).fields)


def test_ls_still_describes_the_file(clipcli: Callable[..., MainRun], tmp_path: Path) -> None:
    run = clipcli("ls", _big_endian(tmp_path / "big.pt"))
    assert "pytorch.layout" in run.stdout
    assert "pytorch.byteorder" in run.stdout


def test_the_files_own_values_still_count_as_a_loss(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    source = _bin(tmp_path / "with_epoch.pt", "w", np.ones(4), epoch=integer(3))
    run = clipcli("convert", source, tmp_path / "o.npz")
    assert run.returncode == 2, run.stderr
    assert "epoch" in one_error_line(run.stderr)
