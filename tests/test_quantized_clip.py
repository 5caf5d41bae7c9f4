"""clip through the scales of a quantized weight: the codes stay byte for byte, the scales
are rescaled (each rounded once in its own dtype), and the dequantized result never
exceeds the limit, checked with exact Fraction arithmetic on the written bytes."""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import (
    Stats,
    bfloat16_value,
    e4m3fn_value,
    float32_value,
    read_raw_safetensors,
    write_model_directory,
    write_raw_safetensors,
)
from test_quantized_cli import finite_fp8_weight
from test_quantized_fp8_block import fp8_config
from test_quantized_fp8_scaled import ct_config, tiled_fp8


def scale_values(code: str, payload: bytes) -> list[Fraction | None]:
    if code == "F32":
        return [float32_value(b) for (b,) in struct.iter_unpack("<I", payload)]
    assert code == "BF16"
    return [bfloat16_value(b) for (b,) in struct.iter_unpack("<H", payload)]


def dequantized(
    tensors: dict[str, tuple[str, list[int], bytes]], scale_name: str, tile: tuple[int, int]
) -> list[Fraction | None]:
    """weight = code x scale of its tile, from the written bytes (reference decoder)."""
    _, (rows, columns), codes = tensors["layer.weight"]
    code, _, payload = tensors[scale_name]
    scales = scale_values(code, payload)
    per_row = -(-columns // tile[1])
    out: list[Fraction | None] = []
    for i in range(rows):
        for j in range(columns):
            v, s = (
                e4m3fn_value(codes[i * columns + j]),
                scales[(i // tile[0]) * per_row + j // tile[1]],
            )
            out.append(None if v is None or s is None else v * s)
    return out


def next_down(x: float) -> float:
    return math.nextafter(x, 0.0)


def clip(run_main: Any, src: Path, out: Path, *mode: str) -> None:
    result = run_main("clip", *mode, src, out, "-q")
    assert result.code == 0, result.stderr


@pytest.mark.parametrize("where", ["above", "at", "just-below", "far-below"])
def test_block_fp8_global_clip_through_the_scales(
    tmp_path: Path, run_main: Any, where: str
) -> None:
    stored, values = finite_fp8_weight(1, 130, 260, (128, 128))
    # issue 21: [2, 3] scales fit other blocks than 128 x 128 too: the config says which
    src = write_model_directory(
        tmp_path / "in", {"model.safetensors": stored}, fp8_config([128, 128])
    )
    exact = Stats(values).sumsq
    norm_up = math.nextafter(Stats(values).norm, math.inf)
    while Fraction(norm_up) ** 2 < exact:  # the least float64 at or above the exact norm
        norm_up = math.nextafter(norm_up, math.inf)
    limit = {
        "above": norm_up * 2,
        "at": norm_up,
        "just-below": next_down(next_down(norm_up)),
        "far-below": norm_up / 1000,
    }[where]
    out = tmp_path / "out"
    clip(run_main, src, out, "--global", repr(limit))
    written = read_raw_safetensors(out / "model.safetensors")
    assert written["layer.weight"] == stored["layer.weight"]  # the codes, byte for byte
    after = Stats(dequantized(written, "layer.weight_scale_inv", (128, 128))).sumsq
    assert after <= Fraction(limit) ** 2  # the promise, exactly
    if where in ("above", "at"):
        assert written == stored  # unchanged: every stored tensor bit-identical
    else:
        assert written["layer.weight_scale_inv"] != stored["layer.weight_scale_inv"]
        # as tight as float32 scales allow: within a few float32 roundings of the limit
        assert after >= Fraction(limit) ** 2 * (1 - Fraction(1, 2**20))


@pytest.mark.parametrize("bf16", [False, True], ids=["f32-scale", "bf16-scale"])
def test_compressed_tensors_norm_clip_keeps_the_bound(
    tmp_path: Path, run_main: Any, bf16: bool
) -> None:
    """--norm per tensor, channel scales in bfloat16: each scale rounds to 8 bits, rounded
    so that the dequantized norm stays under the limit; the input scale is never touched."""
    stored, values = tiled_fp8(np.random.default_rng(2), 6, 40, (1, 40), [6, 1], bf16=bf16)
    codes = list(stored["layer.weight"][2])
    stored["layer.weight"] = (
        "F8_E4M3",
        [6, 40],
        bytes(0 if c in (0x7F, 0xFF) else c for c in codes),
    )
    stored["layer.input_scale"] = ("F32", [1], struct.pack("<f", 0.25))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, ct_config(strategy="channel")
    )
    out = tmp_path / "out"
    limit = 0.5
    clip(run_main, directory, out, "--norm", repr(limit))
    written = read_raw_safetensors(out / "model.safetensors")
    assert written["layer.weight"] == stored["layer.weight"]
    assert written["layer.input_scale"] == stored["layer.input_scale"]
    after = Stats(dequantized(written, "layer.weight_scale", (1, 40))).sumsq
    assert after <= Fraction(limit) ** 2
    slack = Fraction(1, 2**6) if bf16 else Fraction(1, 2**20)
    assert after >= Fraction(limit) ** 2 * (1 - slack)


def test_mxfp4_clip_takes_a_power_of_two_through_its_e8m0_scales(
    tmp_path: Path, run_main: Any
) -> None:
    """Was refused (exit 4) until E8M0 scales took a power of two (issue 21): the norm
    sqrt(137) over a limit of 1 takes 2**-4, the scale byte 127 -> 123, the codes kept.
    More cases: tests/test_quant_mxfp4_clip.py."""
    stored = {
        "mlp.experts.down_proj_blocks": ("U8", [1, 1, 16], bytes(range(16))),
        "mlp.experts.down_proj_scales": ("U8", [1, 1], bytes([127])),
    }
    src = write_raw_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    result = run_main("clip", "--global", "1", src, out)
    assert result.code == 0, result.stderr
    written = read_raw_safetensors(out)
    assert written["mlp.experts.down_proj_blocks"] == stored["mlp.experts.down_proj_blocks"]
    assert written["mlp.experts.down_proj_scales"] == ("U8", [1, 1], bytes([123]))


def test_clip_report_says_the_scale_was_rescaled(tmp_path: Path, run_main: Any) -> None:
    stored, _ = finite_fp8_weight(3, 8, 8, (128, 128))
    src = write_raw_safetensors(tmp_path / "in.safetensors", stored)
    result = run_main(
        "clip", "--global", "0.001", src, tmp_path / "o.safetensors", "--format", "json"
    )
    assert result.code == 0, result.stderr
    import json

    rows = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}
    assert rows["layer.weight"]["changed"]
    assert rows["layer.weight_scale_inv"]["changed"]
    assert "rescaled with its weight" in rows["layer.weight_scale_inv"]["note"]


def test_nvfp4_clip_rescales_block_scales_never_the_global_scale(
    tmp_path: Path, run_main: Any
) -> None:
    """The fp8 block scales take the factor (each rounded once in e4m3, the bound checked);
    the global scale, which fused q/k/v may share, and the codes stay byte for byte."""
    from quant_reference import e2m1_value
    from test_quantized_fp4 import NVFP4_CONFIG, nvfp4

    stored, _, _, _ = nvfp4(np.random.default_rng(9), 4, 32, 3.0, positive=True)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    out = tmp_path / "out"
    limit = 0.75
    clip(run_main, directory, out, "--global", repr(limit))
    written = read_raw_safetensors(out / "model.safetensors")
    for name in ("layer.weight_packed", "layer.weight_global_scale", "layer.input_global_scale"):
        assert written[name] == stored[name]
    assert written["layer.weight_scale"] != stored["layer.weight_scale"]  # it was over
    packed, scales = written["layer.weight_packed"][2], written["layer.weight_scale"][2]
    codes = [n for b in packed for n in (b & 0xF, b >> 4)]
    after = Fraction(0)
    for i, code in enumerate(codes):
        scale = e4m3fn_value(scales[(i // 32) * 2 + (i % 32) // 16])
        assert scale is not None
        after += (e2m1_value(code) * scale / 3) ** 2
    assert 0 < after <= Fraction(limit) ** 2
