"""FP8 weights with a weight_scale: compressed-tensors float-quantized (tensor, channel,
group, block), fbgemm per-row, ComfyUI's scale_weight. Encoded from the definitions in
tests/quant_reference.py; norms checked against exact Fraction sums."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import (
    Stats,
    bf16_payload,
    bfloat16_value,
    e4m3fn_value,
    f32_payload,
    float32_value,
    random_float32_bits,
    write_model_directory,
    write_raw_safetensors,
)
from test_quantized_fp8_block import assert_exact, ceil_div, measured, refused

from clipcli.formats.opening import open_reader
from clipcli.logical.quantized.view import QuantizedView


def tiled_fp8(
    rng: np.random.Generator,
    rows: int,
    columns: int,
    tile: tuple[int, int],
    scale_shape: list[int],
    scale_name: str = "layer.weight_scale",
    bf16: bool = False,
) -> tuple[dict[str, tuple[str, list[int], bytes]], list[Fraction | None]]:
    """weight[i, j] = code x scale[i // tile rows, j // tile columns] (scale flat, row-major
    over [ceil(rows/th), ceil(columns/tw)])."""
    codes = [int(c) for c in rng.integers(0, 256, rows * columns)]
    codes[: min(256, len(codes))] = range(min(256, len(codes)))
    count = 1
    for d in scale_shape:
        count *= d
    bits = random_float32_bits(rng, count)
    if bf16:
        scale_bits = [b >> 16 for b in bits]
        scales = [bfloat16_value(b) for b in scale_bits]
        payload = ("BF16", scale_shape, bf16_payload(scale_bits))
    else:
        scales = [float32_value(b) for b in bits]
        payload = ("F32", scale_shape, f32_payload(bits))
    per_row = ceil_div(columns, tile[1])
    values: list[Fraction | None] = []
    for i in range(rows):
        for j in range(columns):
            code, scale = (
                e4m3fn_value(codes[i * columns + j]),
                scales[(i // tile[0]) * per_row + j // tile[1]],
            )
            values.append(None if code is None or scale is None else code * scale)
    return {"layer.weight": ("F8_E4M3", [rows, columns], bytes(codes)), scale_name: payload}, values


def ct_config(**weights: Any) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    }


INPUT_SCALE = ("F32", [1], f32_payload([0x3DCCCCCD]))


@pytest.mark.parametrize(
    ("weights", "tile", "scale_shape"),
    [
        ({"strategy": "tensor"}, (21, 40), [1]),
        ({"strategy": "channel"}, (1, 40), [21, 1]),
        ({"strategy": "group", "group_size": 16}, (1, 16), [21, 3]),  # 40 = 16 + 16 + 8
        ({"strategy": "block", "block_structure": [8, 16]}, (8, 16), [3, 3]),
    ],
    ids=["tensor", "channel", "group", "block"],
)
@pytest.mark.parametrize("bf16", [False, True], ids=["f32-scale", "bf16-scale"])
def test_compressed_tensors_float_quantized(
    tmp_path: Path,
    weights: dict[str, Any],
    tile: tuple[int, int],
    scale_shape: list[int],
    bf16: bool,
) -> None:
    stored, values = tiled_fp8(np.random.default_rng(3), 21, 40, tile, scale_shape, bf16=bf16)
    stored["layer.input_scale"] = INPUT_SCALE
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, ct_config(**weights)
    )
    stats = measured(directory, chunk_elems=50)
    assert list(stats) == ["layer.weight"]
    assert_exact(stats["layer.weight"], values)
    with open_reader(directory) as reader:
        view = QuantizedView.of(reader)
        assert sorted((i.name, r) for i, r in view.side_tensors()) == [
            ("layer.input_scale", "input_scale"),
            ("layer.weight_scale", "scale"),
        ]
        (weight,) = view.tensors()
        assert view.scaled_parts(weight) == ["layer.weight_scale"]  # never the input scale


def test_fbgemm_per_row(tmp_path: Path) -> None:
    stored, values = tiled_fp8(np.random.default_rng(4), 9, 33, (1, 33), [9, 1])
    stored["layer.input_scale_ub"] = INPUT_SCALE
    config = {"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200}}
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    assert_exact(measured(directory)["layer.weight"], values)


@pytest.mark.parametrize(
    ("scale_name", "tile", "scale_shape"),
    [
        ("layer.scale_weight", (5, 7), []),  # ComfyUI: one scalar
        ("layer.weight_scale", (5, 7), [1]),
        ("layer.weight_scale", (1, 7), [5, 1]),
    ],
)
def test_names_alone_read_what_shapes_tell(
    tmp_path: Path, scale_name: str, tile: tuple[int, int], scale_shape: list[int]
) -> None:
    stored, values = tiled_fp8(np.random.default_rng(5), 5, 7, tile, scale_shape, scale_name)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    assert_exact(measured(path)["layer.weight"], values)


def test_names_alone_cannot_tell_a_group_size(tmp_path: Path) -> None:
    stored, _ = tiled_fp8(np.random.default_rng(6), 4, 64, (1, 32), [4, 2])
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    assert "does not fit layer.weight" in refused(path)


@pytest.mark.parametrize(("scale_columns", "fits"), [(3, True), (2, False), (4, False)])
def test_group_scale_at_and_past_its_shape(tmp_path: Path, scale_columns: int, fits: bool) -> None:
    stored, values = tiled_fp8(np.random.default_rng(7), 3, 40, (1, 16), [3, 3])
    stored["layer.weight_scale"] = (
        ("F32", [3, scale_columns], f32_payload([0x3F800000] * 3 * scale_columns))
        if not fits
        else stored["layer.weight_scale"]
    )
    config = ct_config(strategy="group", group_size=16)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    if fits:
        assert_exact(measured(directory)["layer.weight"], values)
    else:
        assert "does not fit layer.weight" in refused(directory)


@pytest.mark.parametrize("size", [0, -16, True, None, 1.0, 2**24 + 1])
def test_group_size_checked_before_use(tmp_path: Path, size: Any) -> None:
    stored, _ = tiled_fp8(np.random.default_rng(8), 2, 4, (1, 4), [2, 1])
    config = ct_config(strategy="group", group_size=size)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    assert "group_size" in refused(directory)


def test_two_groups_that_both_fit_are_ambiguous(tmp_path: Path) -> None:
    stored, _ = tiled_fp8(np.random.default_rng(9), 2, 256, (1, 128), [2, 2])
    config = ct_config(strategy="group", group_size=128)
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = {  # both groups target the module (Linear): ambiguous
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 200},
    }
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    assert "ambiguous" in refused(directory)


def test_declared_codes_without_scale_are_refused(tmp_path: Path) -> None:
    stored, _ = tiled_fp8(np.random.default_rng(10), 2, 4, (1, 4), [2, 1])
    del stored["layer.weight_scale"]
    config = ct_config(strategy="channel")
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    assert "without their layer.weight_scale" in refused(directory)


def test_block_and_channel_names_together_are_ambiguous(tmp_path: Path) -> None:
    """X.weight with both a weight_scale_inv (block fp8) and a weight_scale: two schemes
    claim one tensor, refused."""
    stored, _ = tiled_fp8(np.random.default_rng(11), 2, 4, (1, 4), [2, 1])
    stored["layer.weight_scale_inv"] = ("F32", [1, 1], f32_payload([0x3F800000]))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    assert "ambiguous" in refused(path)


def test_exact_stats_reference_counts_nan_codes() -> None:
    assert Stats([e4m3fn_value(c) for c in range(256)]).nonfinite == 2
