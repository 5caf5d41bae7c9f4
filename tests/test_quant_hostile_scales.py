"""Quantized weights whose scales are inf or NaN, or whose parts have a zero dimension
(issue 21, second attack): every command answers with its report or one line, never a
numpy RuntimeWarning on stderr (inf * 0 is NaN: a non-finite value, counted) and never an
internal error (a group count of 0 divided nothing: exit 3 before any size is derived).

Run as real processes: a RuntimeWarning printed by numpy is what a user sees, and
pytest's filterwarnings=error would turn it into something else in-process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_quant_bnb import four_bit
from test_quant_gptq_awq import awq_arrays, gptq_arrays


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def gptq() -> tuple[dict[str, np.ndarray], str]:
    return gptq_arrays(32, 16, 4, 2)[0], "m.scales"


def awq() -> tuple[dict[str, np.ndarray], str]:
    return awq_arrays(32, 16, 16)[0], "m.scales"


def bnb() -> tuple[dict[str, np.ndarray], str]:
    return four_bit((16, 64), 64)[0], "m.weight.absmax"


def fp8_block() -> tuple[dict[str, np.ndarray], str]:
    codes = np.ones((4, 8), np.float32).astype(ml_dtypes.float8_e4m3fn)
    return {"m.weight": codes, "m.weight_scale_inv": np.ones((1, 1), np.float32)}, (
        "m.weight_scale_inv"
    )


SCHEMES: dict[str, Callable[[], tuple[dict[str, np.ndarray], str]]] = {
    "gptq": gptq,
    "awq": awq,
    "bnb": bnb,
    "fp8_block": fp8_block,
}


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_non_finite_scale_is_counted_never_warned(
    tmp_path: Path, scheme: str, bad: float
) -> None:
    arrays, scale_name = SCHEMES[scheme]()
    scales = arrays[scale_name].copy()
    scales.reshape(-1)[0] = bad
    arrays[scale_name] = scales
    path = tmp_path / "m.safetensors"
    save_file(arrays, str(path))
    norms = cli("norms", "--format", "json", path)
    assert norms.returncode == 0, norms.stderr
    assert norms.stderr == "", norms.stderr
    (row,) = [t for t in json.loads(norms.stdout)["tensors"] if t["name"] == "m.weight"]
    assert row["nonfinite"] > 0
    clip = cli("clip", "--global", "1", path, tmp_path / "o.safetensors")
    assert clip.returncode == 4, clip.stderr
    assert clip.stderr.count("\n") == 1, clip.stderr
    assert "m.weight" in clip.stderr
    convert = cli("convert", "--dtype", "float32", path, tmp_path / "c.safetensors")
    assert convert.returncode == 0, convert.stderr
    assert "RuntimeWarning" not in convert.stderr, convert.stderr


# Every scheme's parts with the dimension that counts inputs, rows or blocks set to 0,
# consistently (each shape fits the others).
EMPTY: dict[str, dict[str, np.ndarray]] = {
    "gptq": {
        "l.qweight": np.zeros((0, 32), np.int32),
        "l.qzeros": np.zeros((0, 4), np.int32),
        "l.scales": np.zeros((0, 32), np.float16),
        "l.g_idx": np.zeros(0, np.int32),
    },
    "gptq-no-g_idx": {
        "l.qweight": np.zeros((0, 32), np.int32),
        "l.qzeros": np.zeros((1, 4), np.int32),
        "l.scales": np.zeros((1, 32), np.float16),
    },
    "awq": {
        "l.qweight": np.zeros((0, 4), np.int32),
        "l.qzeros": np.zeros((0, 4), np.int32),
        "l.scales": np.zeros((0, 32), np.float16),
    },
    "fp8_block": {
        "l.weight": np.zeros((0, 8), ml_dtypes.float8_e4m3fn),
        "l.weight_scale_inv": np.zeros((0, 1), np.float32),
    },
    "mxfp4": {
        "l_blocks": np.zeros((0, 1, 16), np.uint8),
        "l_scales": np.zeros((0, 1), np.uint8),
    },
}


@pytest.mark.parametrize("scheme", EMPTY)
@pytest.mark.parametrize("command", ["ls", "norms", "clip", "convert"])
def test_zero_size_parts_are_refused_in_one_line(tmp_path: Path, scheme: str, command: str) -> None:
    path = tmp_path / "m.safetensors"
    save_file(EMPTY[scheme], str(path))
    commands: dict[str, list[str | Path]] = {
        "ls": ["ls", path],
        "norms": ["norms", path],
        "clip": ["clip", "--global", "1", path, tmp_path / "o.safetensors"],
        "convert": ["convert", "--dtype", "float16", path, tmp_path / "o.safetensors"],
    }
    run = cli(*commands[command])
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("clipcli: error: l")
    assert "empty" in run.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_a_bnb_quant_state_shape_with_a_zero_is_refused(tmp_path: Path) -> None:
    arrays = four_bit((16, 64), 64)[0]
    state_name = "m.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(arrays[state_name].tobytes())
    state["shape"] = [0, 64]
    arrays[state_name] = np.frombuffer(json.dumps(state).encode(), np.uint8)
    path = tmp_path / "m.safetensors"
    save_file(arrays, str(path))
    run = cli("norms", path)
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
