"""`convert --dtype` of float64 values past the target's range (issue 21, second attack):
each value rounded once from float64, a finite value that becomes infinite is refused
(exit 4, naming the tensor) or written as +-inf with one warning under --allow-lossy, never
NaN; and numpy's RuntimeWarnings never reach stderr beside the one line.

The reference is numpy's own float64 -> float16/float32 cast (a single rounding, straight
from the float64 bits: no code shared with clipcli's cut-to-float32 path)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from clipcli.numerics.casting import cast_chunk

F32_MAX = float(np.finfo(np.float32).max)  # 3.4028234663852886e38
F32_HALFWAY = 2.0**128 * (1 - 2.0**-25)  # float32's largest + half its step: rounds to inf
F16_HALFWAY = 65520.0  # float16's largest (65504) + half its step (16): a tie, to inf


def up(x: float) -> float:
    return math.nextafter(x, math.inf)


def down(x: float) -> float:
    return math.nextafter(x, -math.inf)


# value, float16 result (0: finite), float32 result
EDGES = [
    (down(F16_HALFWAY), 65504.0, 65520.0),  # the largest float64 that gives 65504
    (F16_HALFWAY, math.inf, 65520.0),  # the next float64 and every one above: inf
    (F32_MAX, math.inf, F32_MAX),
    (up(F32_MAX), math.inf, F32_MAX),  # past float32's max, its sticky bit must not make NaN
    (down(F32_HALFWAY), math.inf, F32_MAX),
    (F32_HALFWAY, math.inf, math.inf),
    (2.0**128, math.inf, math.inf),  # past float32's range: the cut itself is inf
    (1e300, math.inf, math.inf),
    (float(np.finfo(np.float64).max), math.inf, math.inf),
]


def reference(values: np.ndarray, target: type) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(target)


@pytest.mark.parametrize(("value", "as_f16", "as_f32"), EDGES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_each_edge_rounds_once_and_overflow_is_inf_never_nan(
    value: float, as_f16: float, as_f32: float, sign: float
) -> None:
    values = np.array([sign * value, 1.0], np.float64)
    for target, expected in ((np.float16, as_f16), (np.float32, as_f32)):
        cast = cast_chunk(values, np.dtype(target))
        got = float(cast.values[0])
        assert got == sign * expected, (target, value)
        assert cast.values.tobytes() == reference(values, target).tobytes()
        assert cast.overflowed == (1 if math.isinf(expected) else 0)


def test_inf_and_nan_pass_through_with_their_payloads() -> None:
    # NaNs whose payload sits only in the bits the float16 path cuts (low 29): still NaN
    payloads = np.array([0x7FF0000000000001, 0xFFF0000010000000, 0x7FF8000000000000], np.uint64)
    values = np.concatenate(
        [np.array([math.inf, -math.inf], np.float64), payloads.view(np.float64)]
    )
    for target in (np.float16, np.float32, ml_dtypes.bfloat16):
        cast = cast_chunk(values, np.dtype(target))
        back = cast.values.astype(np.float64)
        assert back[0] == math.inf
        assert back[1] == -math.inf
        assert np.isnan(back[2:]).all(), target
        assert cast.overflowed == 0


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize("target", ["float16", "float32", "bfloat16"])
def test_cli_refuses_overflow_in_one_line_and_writes_inf_when_lossy(
    tmp_path: Path, target: str
) -> None:
    source = tmp_path / "m.npz"
    np.savez(source, w=np.array([1e300, 1.0, -1e300]))
    out = tmp_path / "o.safetensors"
    refused = cli("convert", "--dtype", target, source, out)
    assert refused.returncode == 4, refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr  # no numpy RuntimeWarning lines
    assert refused.stderr.startswith("clipcli: error: w: 2 values overflow")
    assert not out.exists()
    lossy = cli("convert", "--dtype", target, "--allow-lossy", source, out)
    assert lossy.returncode == 0, lossy.stderr
    assert lossy.stderr.count("\n") == 1, lossy.stderr  # the one warning
    assert "overflowed" in lossy.stderr
    written = load_file(str(out))["w"].astype(np.float64)
    assert written.tolist() == [math.inf, 1.0, -math.inf]
