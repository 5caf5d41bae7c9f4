"""Issue 12 item 6: clipping a small float tensor can flush values to zero or leave them
subnormal; the report counts them (table footer and JSON), never silent.

The expected counts come from the written file, read back with safetensors and judged in
float64 against the dtype's smallest normal (ml_dtypes.finfo), sharing nothing with
clipcli's bit-level counter."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from handmade import read_safetensors
from safetensors.numpy import save_file

from clipcli.cli.entry import main
from clipcli.numerics.rounding import flushes


def _expected(before: np.ndarray, after: np.ndarray) -> tuple[int, int]:
    # The smallest normal value of the dtype.
    tiny = float(ml_dtypes.finfo(before.dtype).tiny)  # type: ignore[no-untyped-call]
    old = np.abs(before.astype(np.float64))
    new = np.abs(after.astype(np.float64))
    to_zero = int(np.count_nonzero((new == 0) & (old != 0)))
    old_sub = (old != 0) & (old < tiny)
    new_sub = (new != 0) & (new < tiny)
    return to_zero, int(np.count_nonzero(new_sub & ~old_sub))


def _spread(dtype: type) -> np.ndarray:
    """Magnitudes from 1 down to the smallest subnormal, both signs, seeded."""
    rng = np.random.default_rng(12)
    real = np.float32 if np.dtype(dtype) == np.complex64 else dtype
    lowest = np.log2(float(ml_dtypes.finfo(real).smallest_subnormal))  # type: ignore[no-untyped-call]
    exponents = rng.uniform(lowest, 0, 4096)
    signs = rng.choice([-1.0, 1.0], 4096)
    return (signs * 2.0**exponents).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_clip_reports_values_flushed_to_zero_and_made_subnormal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: type
) -> None:
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    tensor = _spread(dtype)
    save_file({"w": tensor}, str(src))
    capsys.readouterr()
    assert main(["clip", "--global", "0.01", str(src), str(out), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = _expected(tensor, read_safetensors(out)["w"])
    assert expected[0] + expected[1] > 0  # the case really flushes something
    assert (report["flushed_to_zero"], report["made_subnormal"]) == expected


def test_table_footer_names_the_flushes_and_says_nothing_when_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.safetensors"
    save_file({"w": _spread(np.float16)}, str(src))
    capsys.readouterr()
    assert main(["clip", "--global", "0.01", str(src), str(tmp_path / "a.safetensors")]) == 0
    assert "to zero and made" in capsys.readouterr().out
    save_file({"w": np.array([3.0, 4.0], np.float16)}, str(src))
    assert main(["clip", "--global", "4", str(src), str(tmp_path / "b.safetensors")]) == 0
    assert "flush" not in capsys.readouterr().out  # 3,4 -> 2.4,3.2: nothing flushed


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.complex64, ml_dtypes.bfloat16, ml_dtypes.float8_e5m2],
)
def test_the_bit_level_counter_agrees_with_float64_judgement(dtype: type) -> None:
    """Every 16-bit pattern (or a seeded sample) against the float64 reference above."""
    if np.dtype(dtype).itemsize == 2:
        before: np.ndarray = np.arange(1 << 16, dtype=np.uint16).view(dtype)
        with np.errstate(invalid="ignore"):  # NaN patterns, dropped here
            before = before[np.isfinite(before.astype(np.float64))]
    else:
        before = _spread(dtype)
    after = before.astype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64) * 2.0**-9
    after = after.astype(dtype)
    if np.dtype(dtype).kind == "c":
        pairs = before.view(np.float32), after.view(np.float32)
        assert flushes(before, after) == _expected(*pairs)
    else:
        assert flushes(before, after) == _expected(before, after)


def test_a_dtype_without_zero_has_no_flushes() -> None:
    values = np.array([1.0, 2.0**-120], ml_dtypes.float8_e8m0fnu)
    assert flushes(values, values) == (0, 0)
