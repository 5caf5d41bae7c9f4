"""Quantized weights through the command line: `norms` rows of the real weights (exact
against Fraction references, tests/quant_reference.py), their scales listed apart, and
clip's refusals (exit 4, one line) where it cannot act through the scales."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from quant_reference import Stats, close, f32_payload, write_model_directory, write_raw_safetensors
from test_quantized_fp8_block import block_fp8, fp8_config


def finite_fp8_weight(seed: int, rows: int, columns: int, block: tuple[int, int]) -> Any:
    rng = np.random.default_rng(seed)
    codes = [int(c) for c in rng.integers(0, 256, rows * columns)]
    codes = [0 if c in (0x7F, 0xFF) else c for c in codes]  # no NaN: a finite norm
    return block_fp8(rng, rows, columns, block, codes=codes)


def test_norms_rows_are_the_real_weights(tmp_path: Path, run_main: Any) -> None:
    stored, values = finite_fp8_weight(1, 130, 260, (128, 128))
    plain = [Fraction(1), Fraction(2), Fraction(-3)]
    stored["norm.weight"] = ("F32", [3], f32_payload([0x3F800000, 0x40000000, 0xC0400000]))
    # issue 21: [2, 3] scales fit other blocks than 128 x 128 too: the config says which
    path = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([128, 128])
    )
    result = run_main("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    assert not result.stderr
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["tensors"]}
    assert list(rows) == ["layer.weight", "layer.weight_scale_inv", "norm.weight"]
    weight = rows["layer.weight"]
    ref = Stats(values)
    assert weight["shape"] == [130, 260]
    assert weight["numel"] == 130 * 260
    assert weight["nonfinite"] == 0
    assert Fraction(weight["max_abs"]) == ref.max_abs
    assert close(weight["norm"], ref.norm)
    assert weight["in_global"]
    scale = rows["layer.weight_scale_inv"]
    assert scale["role"] == "quantization"
    assert not scale["in_global"]
    assert close(report["global_norm"], Stats([*values, *plain]).norm)


def test_nan_codes_are_counted_non_finite(tmp_path: Path, run_main: Any) -> None:
    stored, values = block_fp8(np.random.default_rng(2), 16, 16, (128, 128))  # all 256 codes
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    result = run_main("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    (row, _) = json.loads(result.stdout)["tensors"]
    assert row["nonfinite"] == Stats(values).nonfinite == 2
    assert row["norm"] is None  # NaN, as for any tensor holding a NaN


def test_model_directory_with_scale_in_another_shard(tmp_path: Path, run_main: Any) -> None:
    stored, values = finite_fp8_weight(3, 50, 70, (16, 32))
    shards = {
        "model-00001-of-00002.safetensors": {"layer.weight": stored["layer.weight"]},
        "model-00002-of-00002.safetensors": {
            "layer.weight_scale_inv": stored["layer.weight_scale_inv"]
        },
    }
    directory = write_model_directory(tmp_path / "model", shards, fp8_config([16, 32]))
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    assert not result.stderr  # config.json's fp8 is understood: no "stored codes" warning
    report = json.loads(result.stdout)
    assert close(report["global_norm"], Stats(values).norm)


def test_clip_value_on_a_quantized_weight_is_refused(tmp_path: Path, run_main: Any) -> None:
    stored, _ = finite_fp8_weight(4, 8, 8, (128, 128))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    out = tmp_path / "o.safetensors"
    for mode in (["--value", "1"], ["--min", "-1", "--max", "1"]):
        result = run_main("clip", *mode, path, out)
        assert result.code == 4, (mode, result.stderr)
        (line,) = result.stderr.splitlines()
        assert line.startswith("clipcli: error: layer.weight: ")
        assert "fp8-block" in line
        assert "--exclude" in line
        assert not out.exists()
    (line,) = run_main("clip", "--value", "1", path, out).stderr.splitlines()
    assert "not linear" in line


def test_clip_leaving_the_quantized_weight_out_keeps_it_byte_for_byte(
    tmp_path: Path, run_main: Any
) -> None:
    stored, _ = finite_fp8_weight(5, 8, 8, (128, 128))
    stored["norm.weight"] = ("F32", [2], f32_payload([0x40400000, 0x40800000]))  # 3, 4
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    out = tmp_path / "o.safetensors"
    result = run_main("clip", "--norm", "1", "-x", "layer.*", path, out, "-q")
    assert result.code == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        assert (
            f.get_tensor("layer.weight_scale_inv").tobytes() == stored["layer.weight_scale_inv"][2]
        )
        clipped = [Fraction(float(v)) for v in f.get_tensor("norm.weight")]
    assert sum(v * v for v in clipped) <= 1  # the plain tensor is clipped, never above
    raw = out.read_bytes()
    assert stored["layer.weight"][2] in raw  # the codes, byte for byte
