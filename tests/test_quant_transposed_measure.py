"""Weights stored transposed (GPTQ, AWQ) are measured as their codes hold them (issue 20).

Their values in C order take a pass over the codes per TRANSPOSE_ELEMENTS values (the
view gathers columns of the transpose), so measuring a 28672 x 8192 weight that way read
and decoded its codes 56 times. Statistics do not depend on the order: `norms` and a
clip's measuring pass now decode each run of rows of the transpose once. References: the
exact norm from Fraction sums (tests/quant_int_reference.py, no clipcli code) and the
values in C order, still what `convert --dtype` writes.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import write_safetensors
from quant_int_reference import exact_sqrt
from test_quant_gptq_awq import awq_arrays, gptq_arrays, gptq_reference

from clipcli.logical.quantized import awq, gptq
from clipcli.logical.quantized import view as view_module


def decode_calls(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    calls: list[int] = []
    real = module.decode_rows

    def spy(*args: Any) -> Any:
        calls.append(args[3] - args[2])  # rows decoded
        return real(*args)

    monkeypatch.setattr(module, "decode_rows", spy)
    return calls


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_a_transposed_weight_is_decoded_once_for_its_norm(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """With room for 64 values at a time in C order (48 gathering passes of the 256 x 48
    transpose), `norms` decodes the 256 inputs once; the norm is the exact one to an ulp."""
    if kind == "gptq":
        arrays, g_idx, q, z = gptq_arrays(256, 48, 4, 8, seed=5, act_order=True)
        reference = gptq_reference(arrays, g_idx, q, z, 1)
        module: Any = gptq
    else:
        arrays, reference = awq_arrays(256, 48, 32, seed=5)
        module = awq
    path = write_safetensors(tmp_path / "m.safetensors", arrays)
    monkeypatch.setattr(view_module, "TRANSPOSE_ELEMENTS", 64)
    calls = decode_calls(monkeypatch, module)
    result = run_main("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    assert sum(calls) == 256  # every input row once
    (row,) = [t for t in json.loads(result.stdout)["tensors"] if t["name"] == "m.weight"]
    exact = exact_sqrt(sum((v * v for r in reference for v in r), Fraction(0)))
    assert abs(row["norm"] - exact) <= math.ulp(exact)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_values_in_c_order_decode_each_value_once(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """convert --dtype writes the real [out, in] weight in C order, gathered a block of
    outputs at a time: each block's pass decodes its own outputs only (decode_columns),
    so the values decoded add up to the weight's size, not to size x passes; the values
    are the reference's, transposed."""
    if kind == "gptq":
        arrays, g_idx, q, z = gptq_arrays(64, 16, 4, 4, seed=2, act_order=True)
        reference = gptq_reference(arrays, g_idx, q, z, 1)  # [in, out]
        module: Any = gptq
    else:
        arrays, reference = awq_arrays(64, 16, 16, seed=2)
        module = awq
    path = write_safetensors(tmp_path / "m.safetensors", arrays)
    monkeypatch.setattr(view_module, "TRANSPOSE_ELEMENTS", 256)  # 4 outputs a pass
    decoded: list[int] = []
    real = module.decode_columns

    def spy(*args: Any) -> Any:
        values = real(*args)
        decoded.append(values.size)
        return values

    monkeypatch.setattr(module, "decode_columns", spy)
    out = tmp_path / "out.safetensors"
    result = run_main("convert", "--dtype", "float32", path, out)
    assert result.code == 0, result.stderr
    assert len(decoded) == 4  # one pass per block of 4 outputs
    assert sum(decoded) == 64 * 16  # every value once
    from safetensors.numpy import load_file

    written = load_file(str(out))["m.weight"]
    want = np.array([[float(v) for v in row] for row in reference], dtype=np.float32).T
    assert np.array_equal(written, want)  # (a zero's sign aside: 0 x -s is -0.0)
