"""A refused clip prints exactly one stderr line, its error: the lines the job would say
on success (the note on training state left unchanged, a pattern's warning, --skip-low-rank's
note) are held until it succeeds, whichever check refuses it (overlapping views under
--global, NaN/Inf where a norm is needed, --axes out of range), real run or dry run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MainRun
from safetensors.numpy import save_file
from test_pytorch_hostile import state, tensor, torch_zip

TRAINING_STATE = {"bn.running_mean": np.array([0.5, -2.0, 3.0], dtype=np.float32)}


def _safetensors(path: Path, **tensors: np.ndarray) -> Path:
    save_file({**tensors, **TRAINING_STATE}, path)
    return path


def _overlapping(path: Path) -> Path:
    """`w` and `w_row` = w[1] view overlapping bytes of one storage (torch's `e[1]`)."""
    pickled = state(
        w=tensor("0", size=(4, 3), stride=(3, 1), numel=12),
        w_row=tensor("0", offset=3, size=(3,), stride=(1,), numel=12),
        **{"bn.running_mean": tensor("1", size=(3,), numel=3)},
    )
    storages = {
        "0": (np.arange(12, dtype="<f4") + 1).tobytes(),
        "1": np.array([0.5, -2.0, 3.0], dtype="<f4").tobytes(),
    }
    return torch_zip(path, pickled, storages)


NAN = np.array([[1.0, np.nan], [2.0, 3.0]], dtype=np.float32)
MATRIX = np.arange(12, dtype=np.float32).reshape(3, 4)
VECTOR = np.arange(5, dtype=np.float32)

# refusal kind -> (make IN, clip arguments, words of the error)
REFUSALS: dict[str, tuple[Callable[[Path], Path], tuple[str, ...], str]] = {
    "overlapping views, --global": (
        lambda d: _overlapping(d / "in.pt"),
        ("--global", "1"),
        "view overlapping parts of one storage",
    ),
    "NaN, --global": (
        lambda d: _safetensors(d / "in.safetensors", w=NAN),
        ("--global", "1"),
        "NaN/Inf values where a norm is needed",
    ),
    "NaN, --norm": (
        lambda d: _safetensors(d / "in.safetensors", w=NAN),
        ("--norm", "1"),
        "NaN/Inf values where a norm is needed",
    ),
    "NaN, --norm --axes": (
        lambda d: _safetensors(d / "in.safetensors", w=NAN),
        ("--norm", "1", "--axes", "1"),
        "NaN/Inf values where a norm is needed",
    ),
    "--axes out of range": (
        lambda d: _safetensors(d / "in.safetensors", w=MATRIX),
        ("--norm", "1", "--axes", "5"),
        "too few dimensions for --axes 5",
    ),
    "--skip-low-rank leaves nothing": (
        lambda d: _safetensors(d / "in.safetensors", v=VECTOR),
        ("--norm", "1", "--axes", "1", "--skip-low-rank"),
        "leaves no selected tensor to clip",
    ),
    "a pattern matching nothing, then NaN": (
        lambda d: _safetensors(d / "in.safetensors", w=NAN),
        ("--global", "1", "--include", "w", "--include", "nothing*"),
        "NaN/Inf values where a norm is needed",
    ),
    "--skip-low-rank's note, then NaN": (
        lambda d: _safetensors(d / "in.safetensors", w=NAN, v=VECTOR),
        ("--norm", "1", "--axes", "1", "--skip-low-rank"),
        "NaN/Inf values where a norm is needed",
    ),
}


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_refused_clip_prints_one_line(
    clipcli: Callable[..., MainRun], tmp_path: Path, kind: str, dry_run: bool
) -> None:
    make, arguments, words = REFUSALS[kind]
    source = make(tmp_path)
    out = tmp_path / f"out{source.suffix}"
    run = clipcli("clip", *arguments, *(["--dry-run"] if dry_run else []), source, out)
    assert run.returncode == 4, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("clipcli: error: ")
    assert words in run.stderr
    assert not out.exists()


def test_the_held_lines_are_said_once_the_clip_succeeds(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    source = _safetensors(tmp_path / "in.safetensors", w=MATRIX, v=VECTOR)
    out = tmp_path / "out.safetensors"
    run = clipcli(
        "clip", "-q", "--norm", "1", "--axes", "1", "--skip-low-rank", "--include", "nothing*",
        "--include", "*", source, out,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert any("training state left unchanged" in line for line in lines), run.stderr
    assert any("nothing*" in line for line in lines), run.stderr
    assert out.exists()


@pytest.mark.parametrize("command", ["clip", "convert"])
def test_a_full_disk_after_a_note_or_warning_is_one_line(
    clipcli: Callable[..., MainRun], tmp_path: Path, mount_tmpfs: Any, command: str
) -> None:
    """A write that fails (exit 5) after the job had a line to say (clip's note on training
    state; convert's warning for metadata --allow-lossy drops) prints only its error."""
    source = tmp_path / "in.safetensors"
    weights = {"w": np.ones((1024, 1024), np.float32), **TRAINING_STATE}
    save_file(weights, source, metadata={"author": "someone"})
    full = mount_tmpfs("full", size="1m")
    if command == "clip":
        run = clipcli("clip", "--global", "1", source, full / "out.npz", "--allow-lossy")
    else:
        run = clipcli("convert", "--allow-lossy", source, full / "out.npz")
    assert run.returncode == 5, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert "disk full" in run.stderr
    assert list(full.iterdir()) == []
