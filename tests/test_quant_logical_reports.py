"""Issue 21, break 6: what diff and the clip report say about a quantized weight.

(a) A logical tensor has no bits of its own: diff compares it by value (its -0.0 codes
    times a scale equal an exact dequantization's 0.0), and its parts (scales) are listed
    apart, out of the counts, `identical`, --fail-above and the global figures.
(b) A part kept byte for byte is reported with its measured norm before and after, never
    with an empty measurement (norm 0.0).

References: values decoded from the format's definition as Fractions
(tests/quant_reference.py), written as float64 bytes by struct; norms of stored scales
from their bytes.
"""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from quant_reference import (
    e2m1_value,
    e8m0_value,
    float32_value,
    read_raw_safetensors,
    sqrt_fraction,
    write_model_directory,
)
from test_quant_config_disagreement import BLOCK_FP8

MXFP4_CONFIG = {"quantization_config": {"quant_method": "mxfp4"}}


def mxfp4(seed: int) -> tuple[dict[str, Any], list[Fraction]]:
    """p_blocks [4, 2, 16] and p_scales [4, 2] with every e2m1 code (-0.0 included), and
    the weight p [4, 64] they stand for, as exact values."""
    rng = np.random.default_rng(seed)
    blocks = bytes(int(b) for b in rng.integers(0, 256, 128))
    blocks = bytes(range(0x80, 0x90)) + blocks[16:]  # low nibbles 0..15: -0.0 among them
    scales = bytes(int(s) for s in rng.integers(120, 131, 8))
    values = []
    for row in range(4):
        for block in range(2):
            scale = e8m0_value(scales[row * 2 + block])
            assert scale is not None
            for byte in blocks[(row * 2 + block) * 16 : (row * 2 + block + 1) * 16]:
                values += [e2m1_value(byte & 0xF) * scale, e2m1_value(byte >> 4) * scale]
    stored = {"p_blocks": ("U8", [4, 2, 16], blocks), "p_scales": ("U8", [4, 2], scales)}
    return stored, values


def float64_tensor(values: list[Fraction], shape: list[int]) -> tuple[str, list[int], bytes]:
    return ("F64", shape, struct.pack(f"<{len(values)}d", *(float(v) for v in values)))


def diff_json(run_main: Any, a: Path, b: Path, *extra: str) -> dict[str, Any]:
    result = run_main("diff", a, b, "--format", "json", *extra)
    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_quantized_weight_against_its_exact_dequantization_is_the_same(
    tmp_path: Path, run_main: Any
) -> None:
    stored, values = mxfp4(11)
    assert any(v == 0 for v in values)
    a = write_model_directory(tmp_path / "a", {"model.safetensors": stored}, MXFP4_CONFIG)
    # float32, the dtype MXFP4's row shows: float64 would be a dtype change, as between two
    # plain tensors (tests/test_quant_diff_dtypes.py)
    exact32 = ("F32", [4, 64], struct.pack(f"<{len(values)}f", *(float(v) for v in values)))
    b = write_model_directory(tmp_path / "b", {"model.safetensors": {"p": exact32}}, None)
    document = diff_json(run_main, a, b)
    rows = {row["name"]: row for row in document["tensors"]}
    assert rows["p"]["status"] == "same"
    assert rows["p"]["rel_change"] == 0.0
    assert rows["p"]["diff_norm"] == 0.0
    assert rows["p_scales"]["status"] == "only in A"  # listed, apart
    assert document["identical"]
    assert document["parts"] == 1
    assert document["counts"]["same"] == 1
    assert document["counts"]["only in A"] == 0
    assert document["max_rel_change"] == 0.0
    exact = sqrt_fraction(sum((v * v for v in values), Fraction(0)))
    assert abs(document["global_norm_a"] - exact) <= 2 * math.ulp(exact)
    gate = run_main("diff", a, b, "--fail-above", "0", "-q")
    assert gate.code == 0, gate.stderr
    table = run_main("diff", a, b)
    assert "1 quantization part (scales, zero points) listed apart" in table.stdout
    assert "over the tensors both hold" not in table.stdout


def test_a_changed_value_is_still_seen_by_value(tmp_path: Path, run_main: Any) -> None:
    stored, values = mxfp4(12)
    a = write_model_directory(tmp_path / "a", {"model.safetensors": stored}, MXFP4_CONFIG)
    moved = list(values)
    moved[5] += Fraction(1, 2**10)
    b = write_model_directory(
        tmp_path / "b", {"model.safetensors": {"p": float64_tensor(moved, [4, 64])}}, None
    )
    document = diff_json(run_main, a, b)
    (row,) = [r for r in document["tensors"] if r["name"] == "p"]
    # A's row shows the dtype MXFP4 dequantizes to (float32), B's float64: a change shows so
    assert (row["status"], row["dtype_a"], row["dtype_b"]) == (
        "dtype changed",
        "float32",
        "float64",
    )
    assert row["diff_norm"] == 2.0**-10
    exact = float(Fraction(1, 2**10) / sum((v * v for v in values), Fraction(0)) ** 0.5)
    assert math.isclose(row["rel_change"], exact, rel_tol=1e-12)
    assert not document["identical"]
    gate = run_main("diff", a, b, "--fail-above", "0", "-q")
    assert gate.code == 1


def test_float_scales_stay_out_of_the_global_diff(tmp_path: Path, run_main: Any) -> None:
    """A clipped copy against its source: the weight changed, its float32 scale too, but
    only the weight's ‖A−B‖ is in the global figures and the counts."""
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    a = write_model_directory(tmp_path / "a", {"model.safetensors": BLOCK_FP8}, config)
    out = tmp_path / "o"
    assert run_main("clip", "--global", "0.01", a, out, "-q").code == 0
    document = diff_json(run_main, a, out)
    rows = {row["name"]: row for row in document["tensors"]}
    assert rows["l.weight_scale_inv"]["status"] == "changed"
    assert document["parts"] == 1
    assert document["counts"]["changed"] == 2  # l.weight and n.weight
    weights = [rows["l.weight"]["diff_norm"], rows["n.weight"]["diff_norm"]]
    assert math.isclose(document["global_diff_norm"], math.hypot(*weights), rel_tol=1e-15)


def scale_norm(code: str, payload: bytes) -> float:
    if code == "U8":
        return sqrt_fraction(sum((Fraction(b) ** 2 for b in payload), Fraction(0)))
    assert code == "F32"
    values = [float32_value(b) for (b,) in struct.iter_unpack("<I", payload)]
    return sqrt_fraction(sum((v * v for v in values if v is not None), Fraction(0)))


def clip_rows(run_main: Any, *args: Any) -> dict[str, Any]:
    result = run_main("clip", *args, "--format", "json")
    assert result.code == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)["tensors"]}


def test_an_excluded_weights_scale_is_reported_with_its_norm(tmp_path: Path, run_main: Any) -> None:
    stored, _ = mxfp4(13)
    stored["b.weight"] = ("F32", [2], struct.pack("<2f", 3.0, 4.0))
    a = write_model_directory(tmp_path / "a", {"model.safetensors": stored}, MXFP4_CONFIG)
    out = tmp_path / "o"
    rows = clip_rows(run_main, "--global", "1", "--exclude", "p", a, out)
    scale = rows["p_scales"]
    expected = scale_norm(*stored["p_scales"][::2])
    assert scale["norm_before"] == scale["norm_after"] == expected
    assert not scale["changed"]
    assert read_raw_safetensors(out / "model.safetensors")["p_scales"] == stored["p_scales"]


def test_a_rescaled_scale_is_reported_with_its_written_norm(tmp_path: Path, run_main: Any) -> None:
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    a = write_model_directory(tmp_path / "a", {"model.safetensors": BLOCK_FP8}, config)
    out = tmp_path / "o"
    rows = clip_rows(run_main, "--global", "0.01", a, out)
    written = read_raw_safetensors(out / "model.safetensors")["l.weight_scale_inv"]
    scale = rows["l.weight_scale_inv"]
    assert scale["changed"]
    assert scale["norm_before"] == scale_norm("F32", BLOCK_FP8["l.weight_scale_inv"][2])
    assert scale["norm_after"] == scale_norm("F32", written[2])
