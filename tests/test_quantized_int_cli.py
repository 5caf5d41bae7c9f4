"""The integer quantization schemes (GPTQ, AWQ, compressed-tensors pack-quantized,
bitsandbytes) through the command line: `norms` of the real weights against the exact
references of tests/quant_int_reference.py (Python integers and Fractions, no clipcli
code), `diff` against a plain file holding the real [out, in] weight (C order, though
GPTQ and AWQ store its transpose), and clip through the scales: codes byte for byte,
the bound checked exactly on the written bytes."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_int_reference import dense_stream, exact_sqrt
from safetensors.numpy import save_file
from test_quant_bnb import four_bit
from test_quant_gptq_awq import awq_arrays, gptq_arrays, gptq_reference
from test_quant_packed_int import config as packed_config
from test_quant_packed_int import layer

from clipcli.logical.quantized import view as view_module


def flat(reference: Any) -> list[Fraction]:
    return [Fraction(v) for v in np.array(reference, dtype=object).reshape(-1)]


def sumsq(values: list[Fraction]) -> Fraction:
    return sum((v * v for v in values), Fraction(0))


def save(path: Path, arrays: dict[str, np.ndarray], config: dict[str, Any] | None) -> Path:
    """One safetensors file, or a model directory with config.json's quantization_config."""
    if config is None:
        save_file(arrays, str(path))
        return path
    path.mkdir()
    save_file(arrays, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": config}))
    return path


def gptq_case() -> tuple[dict[str, np.ndarray], list[list[Fraction]], dict[str, Any] | None]:
    arrays, g_idx, q, z = gptq_arrays(96, 40, 4, 3, seed=4, act_order=True)
    return arrays, gptq_transposed(gptq_reference(arrays, g_idx, q, z, plus=1)), None


def gptq_transposed(reference: list[list[Fraction]]) -> list[list[Fraction]]:
    return [list(row) for row in zip(*reference, strict=True)]


def awq_case() -> tuple[dict[str, np.ndarray], list[list[Fraction]], dict[str, Any] | None]:
    arrays, reference = awq_arrays(64, 24, 16, seed=2)
    return arrays, gptq_transposed(reference), None


def packed_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    arrays, reference = layer((6, 40), 4, 3, dense_stream, group=16, seed=3)
    return arrays, reference[0], packed_config(4, group=16)  # one 2-D slice


def nf4_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    arrays, reference = four_bit((5, 13), 16, seed=5)
    return arrays, np.array(reference, dtype=object).reshape(5, 13).tolist(), None


def int8_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    rng = np.random.default_rng(6)
    q = rng.integers(-127, 128, (4, 6)).astype(np.int8)
    scb = rng.uniform(0.01, 9.0, 4).astype(np.float32)
    # W = q * SCB / 127, rounded once to float64 (bnb.py's one inexact value)
    reference = [
        [Fraction(float(q[i, j]) * float(scb[i]) / 127) for j in range(6)] for i in range(4)
    ]
    return {"m.weight": q, "m.SCB": scb}, reference, None


CASES = {
    "gptq-int4": gptq_case,
    "awq-int4": awq_case,
    "pack-quantized-int4": packed_case,
    "bnb-nf4": nf4_case,
    "bnb-int8": int8_case,
}


def norms_json(run_main: Any, path: Path, *options: str) -> dict[str, Any]:
    result = run_main("norms", path, "--format", "json", *options)
    assert result.code == 0, result.stderr
    assert not result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


@pytest.mark.parametrize("scheme", list(CASES))
def test_norms_of_the_real_weight(tmp_path: Path, run_main: Any, scheme: str) -> None:
    arrays, reference, config = CASES[scheme]()
    path = save(tmp_path / "m.safetensors" if config is None else tmp_path / "m", arrays, config)
    report = norms_json(run_main, path)
    rows = {row["name"]: row for row in report["tensors"]}
    row = rows["m.weight"]
    values = flat(reference)
    exact = exact_sqrt(sumsq(values))
    assert abs(row["norm"] - exact) <= math.ulp(exact), (row["norm"], exact)
    assert Fraction(row["max_abs"]) == max(abs(v) for v in values)
    assert row["shape"] == list(np.array(reference, dtype=object).shape)
    assert row["numel"] == len(values)
    assert row["quantization"]["scheme"] == scheme
    stored = row["quantization"]["stored"]
    assert stored[0] in arrays
    assert set(stored) <= set(arrays)
    for name in stored[1:]:  # scales, zero points, maps: listed apart, never in the norm
        assert not rows[name]["in_global"]
        assert rows[name]["role"] == "quantization"
    counted = {r["name"] for r in report["tensors"] if r["in_global"]}
    assert "m.weight" in counted
    assert not counted & set(stored[1:])


@pytest.mark.parametrize("scheme", list(CASES))
def test_diff_against_the_plain_weight_is_zero(tmp_path: Path, run_main: Any, scheme: str) -> None:
    """The plain file holds the real [out, in] weight: a diff of zero everywhere means
    the quantized weight's values come out in the same (C) order, transposed or not."""
    arrays, reference, config = CASES[scheme]()
    path = save(tmp_path / "q.safetensors" if config is None else tmp_path / "q", arrays, config)
    real = np.array([[float(v) for v in row] for row in reference], dtype=np.float64)
    pairs = zip(real.reshape(-1), flat(reference), strict=True)
    assert all(Fraction(float(x)) == v for x, v in pairs)
    plain = tmp_path / "plain.safetensors"
    save_file({"m.weight": real}, str(plain))
    result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
    assert result.code == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout)["tensors"] if r["name"] == "m.weight"]
    assert row["max_abs_diff"] == 0.0, row
    # and a diff that is not zero: one value moved by its own size
    real[0, 0] += 1.0
    save_file({"m.weight": real}, str(plain))
    result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
    (row,) = [r for r in json.loads(result.stdout)["tensors"] if r["name"] == "m.weight"]
    assert row["max_abs_diff"] == 1.0, row


def test_a_transposed_weight_larger_than_one_block_takes_several_passes(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPTQ's [in, out] codes put in C order of [out, in] a few real rows at a time
    (TRANSPOSE_ELEMENTS values held): the same order and values at 1, 2, 3 rows per pass."""
    arrays, reference, _ = gptq_case()
    path = save(tmp_path / "q.safetensors", arrays, None)
    real = np.array([[float(v) for v in row] for row in reference], dtype=np.float64)
    plain = tmp_path / "plain.safetensors"
    save_file({"m.weight": real}, str(plain))
    inputs = real.shape[1]
    for rows in (1, 2, 3, 40):
        monkeypatch.setattr(view_module, "TRANSPOSE_ELEMENTS", rows * inputs)
        result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
        assert result.code == 0, result.stderr
        (row,) = json.loads(result.stdout)["tensors"]
        assert row["max_abs_diff"] == 0.0, (rows, row)
