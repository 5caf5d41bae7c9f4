"""MXFP4 (gpt-oss and compressed-tensors mxfp4-pack) and NVFP4 through the quantized view.

Fixtures are packed by hand from the definitions (e2m1 from its bit fields, E8M0 as
2**(s - 127), low nibble = even element); norms against exact Fraction sums. The gguf
package's own numpy dequantizers (MXFP4, NVFP4) are a second reference where installed:
its blocks are repacked into GGUF's nibble order (low nibbles are elements 0-15)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import (
    Stats,
    close,
    e2m1_value,
    e4m3fn_value,
    e8m0_value,
    f32_payload,
    float32_bits,
    float32_value,
    write_model_directory,
    write_raw_safetensors,
)
from test_quantized_fp8_block import assert_exact, measured, refused

from clipcli.formats.opening import open_reader
from clipcli.logical.quantized.view import QuantizedView


def pack_low_first(codes: list[int]) -> bytes:
    return bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))


def gpt_oss_mxfp4(
    rng: np.random.Generator, lead: tuple[int, ...], blocks: int, exponents: list[int] | None = None
) -> tuple[
    dict[str, tuple[str, list[int], bytes]], list[list[int]], list[int], list[Fraction | None]
]:
    rows = int(np.prod(lead)) if lead else 1
    codes = [[int(c) for c in rng.integers(0, 16, blocks * 32)] for _ in range(rows)]
    codes[0][:16] = range(16)  # every code
    if exponents is None:
        exponents = [int(e) for e in rng.integers(100, 150, rows * blocks)]
    values: list[Fraction | None] = []
    for r in range(rows):
        for j in range(blocks * 32):
            scale = e8m0_value(exponents[r * blocks + j // 32])
            values.append(None if scale is None else e2m1_value(codes[r][j]) * scale)
    payload = b"".join(pack_low_first(row) for row in codes)
    stored = {
        "mlp.experts.down_proj_blocks": ("U8", [*lead, blocks, 16], payload),
        "mlp.experts.down_proj_scales": ("U8", [*lead, blocks], bytes(exponents)),
    }
    return stored, codes, exponents, values


@pytest.mark.parametrize("lead", [(3,), (2, 3)])
def test_gpt_oss_mxfp4_every_code(tmp_path: Path, lead: tuple[int, ...]) -> None:
    stored, _, exponents, values = gpt_oss_mxfp4(np.random.default_rng(1), lead, 3)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    for chunk in (None, 40, 1):
        stats = measured(path, chunk)
        assert list(stats) == ["mlp.experts.down_proj"]  # named after the weight
        assert_exact(stats["mlp.experts.down_proj"], values)
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        (weight,) = view.tensors()
        assert weight.info.shape == (*lead, 96)
        assert view.power_of_two_factors(weight)


def test_mxfp4_scale_0xff_is_nan(tmp_path: Path) -> None:
    stored, _, _, values = gpt_oss_mxfp4(np.random.default_rng(2), (1,), 2, exponents=[127, 255])
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    stats = measured(path)["mlp.experts.down_proj"]
    assert stats.nonfinite == 32 == Stats(values).nonfinite


@pytest.mark.parametrize(("scale_blocks", "fits"), [(3, True), (2, False), (4, False)])
def test_mxfp4_scales_at_and_past_their_shape(
    tmp_path: Path, scale_blocks: int, fits: bool
) -> None:
    stored, _, _, _ = gpt_oss_mxfp4(np.random.default_rng(3), (2,), 3)
    stored["mlp.experts.down_proj_scales"] = (
        "U8",
        [2, scale_blocks],
        bytes([127] * 2 * scale_blocks),
    )
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    if fits:
        assert measured(path)["mlp.experts.down_proj"].numel == 2 * 96
    else:
        assert "does not fit" in refused(path)


def test_mxfp4_against_gguf(tmp_path: Path) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    import gguf

    stored, codes, exponents, _ = gpt_oss_mxfp4(np.random.default_rng(4), (4,), 5)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    ggml_blocks = bytearray()
    for r, row in enumerate(codes):
        for b in range(5):
            block = row[b * 32 : (b + 1) * 32]
            ggml_blocks.append(exponents[r * 5 + b])
            ggml_blocks += bytes(block[i] | block[i + 16] << 4 for i in range(16))
    raw = np.frombuffer(bytes(ggml_blocks), np.uint8).reshape(4, 5 * 17)
    reference = gguf_quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float64)
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        (weight,) = view.tensors()
        ours = np.concatenate(list(view.chunks(reader, weight)))
    assert np.array_equal(ours, reference.reshape(-1))


def test_compressed_tensors_mxfp4_pack(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    rows, columns = 3, 64
    codes = [int(c) for c in rng.integers(0, 16, rows * columns)]
    exponents = [int(e) for e in rng.integers(110, 140, rows * 2)]
    values = [
        e2m1_value(codes[i]) * e8m0_value(exponents[(i // columns) * 2 + (i % columns) // 32])  # type: ignore[operator]
        for i in range(rows * columns)
    ]
    stored = {
        "layer.weight_packed": ("U8", [rows, columns // 2], pack_low_first(codes)),
        "layer.weight_scale": ("U8", [rows, 2], bytes(exponents)),
    }
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {},
        }
    }
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    assert_exact(measured(directory)["layer.weight"], values)


# ------------------------------------------------------------------ NVFP4


def nvfp4(
    rng: np.random.Generator, rows: int, columns: int, global_scale: float, positive: bool = False
) -> tuple[dict[str, tuple[str, list[int], bytes]], list[int], list[int], list[Fraction | None]]:
    codes = [int(c) for c in rng.integers(0, 16, rows * columns)]
    codes[:16] = range(16)
    groups = -(-columns // 16)
    top = 0x7F if positive else 0x100
    scale_codes = [int(c) for c in rng.integers(0, top, rows * groups)]
    if not positive:
        scale_codes[:2] = [0x7F, 0xFF]  # NaN scales
    (gbits,) = float32_bits([global_scale])
    g = float32_value(gbits)
    assert g is not None
    values: list[Fraction | None] = []
    for i in range(rows * columns):
        scale = e4m3fn_value(scale_codes[(i // columns) * groups + (i % columns) // 16])
        values.append(None if scale is None else e2m1_value(codes[i]) * scale / g)
    stored = {
        "layer.weight_packed": ("U8", [rows, columns // 2], pack_low_first(codes)),
        "layer.weight_scale": ("F8_E4M3", [rows, groups], bytes(scale_codes)),
        "layer.weight_global_scale": ("F32", [1], f32_payload([gbits])),
        "layer.input_global_scale": ("F32", [1], f32_payload([gbits])),
    }
    return stored, codes, scale_codes, values


NVFP4_CONFIG: dict[str, Any] = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {},
    }
}


@pytest.mark.parametrize("global_scale", [1.0, 3.0, 448.0 * 6 / 0.7])
def test_nvfp4_norm_within_an_ulp_of_the_exact_division(
    tmp_path: Path, global_scale: float
) -> None:
    """Each value is fp4 x scale (exact) / global_scale rounded once to float64: the norm
    stays within a couple of ulps of the exact Fraction one, max |x| within one rounding."""
    stored, _, _, values = nvfp4(np.random.default_rng(6), 5, 48, global_scale)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    acc = measured(directory)["layer.weight"]
    ref = Stats(values)
    assert acc.nonfinite == ref.nonfinite >= 16
    assert close(float(Fraction(acc.max_abs)), float(ref.max_abs), 1)
    assert close(acc.finite_norm, ref.norm, 4)
    with open_reader(directory) as reader:
        roles = {i.name: r for i, r in QuantizedView.of(reader).side_tensors()}
    assert roles == {
        "layer.weight_scale": "scale",
        "layer.weight_global_scale": "global_scale",
        "layer.input_global_scale": "input_scale",
    }


def test_nvfp4_against_gguf(tmp_path: Path) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    import gguf

    stored, codes, scale_codes, _ = nvfp4(np.random.default_rng(7), 2, 64, 1.0, positive=True)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    blocks = bytearray()
    for r in range(2):  # one GGUF super-block of 64 per row: 4 scales, then 4 x 8 bytes
        blocks += bytes(scale_codes[r * 4 : r * 4 + 4])
        for s in range(4):
            sub = codes[r * 64 + s * 16 : r * 64 + s * 16 + 16]
            blocks += bytes(sub[i] | sub[i + 8] << 4 for i in range(8))
    raw = np.frombuffer(bytes(blocks), np.uint8).reshape(2, 36)
    reference = gguf_quants.dequantize(raw, gguf.GGMLQuantizationType.NVFP4).astype(np.float64)
    with open_reader(directory) as reader:
        view = QuantizedView.of(reader)
        (weight,) = view.tensors()
        ours = np.concatenate(list(view.chunks(reader, weight)))
    assert np.array_equal(ours, reference.reshape(-1))


@pytest.mark.parametrize("shape", [[2], [1, 1]])
def test_nvfp4_global_scale_must_be_one_value(tmp_path: Path, shape: list[int]) -> None:
    stored, _, _, _ = nvfp4(np.random.default_rng(8), 2, 32, 1.0)
    count = int(np.prod(shape))
    stored["layer.weight_global_scale"] = ("F32", shape, f32_payload([0x3F800000] * count))
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    if count == 1:
        assert measured(directory)["layer.weight"].numel == 64
    else:
        assert "global scale of 2 elements" in refused(directory)
