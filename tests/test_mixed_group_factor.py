"""A factor shared by plain tensors and logical ones whose rounding happens in their stored
scales (a quantized weight, a GGUF block tensor): the search must check every factor by
a pass over the output. Before, a group that mixed them with an 8/16-bit plain tensor was
searched through the plain tensors' histograms and a float rounding bound that does not
hold for the scales' rounding (bfloat16, float16), and overshot the limit."""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import Stats, read_raw_safetensors, write_model_directory
from test_quantized_clip import dequantized
from test_quantized_fp8_scaled import ct_config, tiled_fp8


def f16_values(payload: bytes) -> list[Fraction]:
    return [Fraction(float(v)) for v in np.frombuffer(payload, "<f2")]


@pytest.mark.parametrize("ratio", [0.9, 0.5, 0.01])
def test_a_global_clip_of_bf16_scaled_fp8_and_float16_stays_within_the_limit(
    tmp_path: Path, run_main: Any, ratio: float
) -> None:
    rng = np.random.default_rng(3)
    stored, values = tiled_fp8(rng, 6, 40, (1, 40), [6, 1], bf16=True)
    codes = list(stored["layer.weight"][2])
    stored["layer.weight"] = (
        "F8_E4M3",
        [6, 40],
        bytes(0 if c in (0x7F, 0xFF) else c for c in codes),
    )
    stored["layer.input_scale"] = ("F32", [1], struct.pack("<f", 0.25))
    plain = (rng.standard_normal(64) * 3).astype("<f2")
    stored["norm.weight"] = ("F16", [64], plain.tobytes())
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, ct_config(strategy="channel")
    )
    before = read_raw_safetensors(directory / "model.safetensors")
    total = (
        Stats(dequantized(before, "layer.weight_scale", (1, 40))).sumsq
        + Stats(f16_values(plain.tobytes())).sumsq
    )
    limit = math.sqrt(total) * ratio
    out = tmp_path / "out"
    result = run_main("clip", "--global", repr(limit), directory, out, "-q")
    assert result.code == 0, result.stderr
    written = read_raw_safetensors(out / "model.safetensors")
    assert written["layer.weight"] == stored["layer.weight"]
    after = (
        Stats(dequantized(written, "layer.weight_scale", (1, 40))).sumsq
        + Stats(f16_values(written["norm.weight"][2])).sumsq
    )
    assert after <= Fraction(limit) ** 2
    assert after >= Fraction(limit) ** 2 * Fraction(9, 10)
