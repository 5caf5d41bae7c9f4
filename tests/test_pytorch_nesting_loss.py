"""A nested PyTorch checkpoint written as .pt: the .pt writer makes one flat dict of
dotted names, so `{"state_dict": {"layer.weight": t}}` would come back as
`{"state_dict.layer.weight": t}` and `ckpt["state_dict"]` would fail in the user's
loader. That is a loss of structure: refused (exit 2) unless --allow-lossy, named in one
line; a flat state dict, and OUT safetensors (flat by nature, named by path as the
README says), are not a loss.

Files are written by hand (test_pytorch_hostile's opcodes); OUT is checked by its zip
records only: no clipcli code is trusted."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import MainRun
from expect import one_error_line
from test_pytorch_hostile import EMPTY_DICT, MARK, SETITEMS, STOP, state, tensor, text, torch_zip

VALUES = np.array([1.0, 2.0, 3.0, 4.0], "<f4").tobytes()


def _nested(path: Path) -> Path:
    inner = EMPTY_DICT + MARK + text("layer.weight") + tensor() + SETITEMS
    pickled = b"\x80\x02" + EMPTY_DICT + MARK + text("state_dict") + inner + SETITEMS + STOP
    return torch_zip(path, pickled, {"0": VALUES})


def _flat(path: Path) -> Path:
    return torch_zip(path, state(**{"layer.weight": tensor()}), {"0": VALUES})


@pytest.mark.parametrize("mode", [["clip", "--global", "1"], ["convert"]])
def test_a_nested_checkpoint_into_pt_is_a_loss_refused_in_one_line(
    tmp_path: Path, clipcli: Callable[..., MainRun], mode: list[str]
) -> None:
    src = _nested(tmp_path / "n.pt")
    out = tmp_path / "o.pt"
    run = clipcli(mode[0], *mode[1:], src, out)
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr)
    for fragment in ("nesting", "state_dict.layer.weight", "--allow-lossy"):
        assert fragment in line
    assert not out.exists()


def test_with_allow_lossy_it_is_written_flat_and_said(
    tmp_path: Path, clipcli: Callable[..., MainRun]
) -> None:
    out = tmp_path / "o.pt"
    run = clipcli("convert", _nested(tmp_path / "n.pt"), out, "--allow-lossy")
    assert run.returncode == 0, run.stderr
    assert "nesting" in run.stderr
    with zipfile.ZipFile(out) as archive:
        pickled = next(archive.read(n) for n in archive.namelist() if n.endswith("data.pkl"))
    assert b"state_dict.layer.weight" in pickled


def test_a_flat_state_dict_into_pt_and_a_nested_one_into_safetensors_lose_nothing(
    tmp_path: Path, clipcli: Callable[..., MainRun]
) -> None:
    flat = clipcli("convert", _flat(tmp_path / "f.pt"), tmp_path / "f2.pt")
    assert flat.returncode == 0, flat.stderr
    assert "nesting" not in flat.stderr
    nested = clipcli("convert", _nested(tmp_path / "n.pt"), tmp_path / "n.safetensors")
    assert nested.returncode == 0, nested.stderr


def test_ls_says_the_file_is_nested(tmp_path: Path, clipcli: Callable[..., MainRun]) -> None:
    run = clipcli("ls", _nested(tmp_path / "n.pt"))
    assert run.returncode == 0, run.stderr
    assert "pytorch.nested" in run.stdout
    assert "pytorch.nested" not in clipcli("ls", _flat(tmp_path / "f.pt")).stdout
