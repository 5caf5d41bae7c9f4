"""Issue 21, third attack round, break 3: diff of a quantized weight against a plain tensor
holding exactly its dequantized values.

A quantized weight is compared by value (README, diff): against a plain float32 tensor of
the same values it is `same` and the diff `identical` (NaN where NaN, -0.0 equal to 0.0),
in either order, whatever the plain side's dtype is compared in. A dtype change is
reported as for plain tensors: the dtype the quantized row shows (float32 here) against
another stored dtype (float64) is `dtype changed`, as float32 against float64 is for two
plain tensors with equal values.

References: values decoded from the formats' definitions as Fractions
(tests/quant_reference.py), written as float32/float64 bytes by struct.
"""

from __future__ import annotations

import json
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from quant_reference import (
    e2m1_value,
    e4m3fn_value,
    e8m0_value,
    float32_value,
    write_model_directory,
    write_raw_safetensors,
)

NAME = "model.layers.0.mlp.experts.down_proj"


def mxfp4(byte: int, scale: int) -> tuple[dict[str, Any], list[Fraction | None]]:
    """One block of 32 equal-byte e2m1 codes under one E8M0 scale, and its values."""
    value = e8m0_value(scale)
    low = e2m1_value(byte & 0xF)
    high = e2m1_value(byte >> 4)
    values: list[Fraction | None] = (
        [None] * 32 if value is None else [low * value, high * value] * 16
    )
    stored = {
        NAME + "_blocks": ("U8", [1, 1, 16], bytes([byte]) * 16),
        NAME + "_scales": ("U8", [1, 1], bytes([scale])),
    }
    return stored, values


def floats(code: str, values: list[Fraction | None], negative_zero: bool = False) -> bytes:
    fmt = {"F32": "<f", "F64": "<d"}[code]
    out = b""
    for v in values:
        x = float("nan") if v is None else float(v)
        if negative_zero and x == 0.0:
            x = -0.0
        out += struct.pack(fmt, x)
    return out


def diff_json(run_main: Any, a: Path, b: Path) -> dict[str, Any]:
    result = run_main("diff", a, b, "--format", "json")
    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def row(document: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [r for r in document["tensors"] if r["name"] == name]
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize(
    ("byte", "scale", "negative_zero"),
    [
        (0x21, 127, False),  # 0.5 and 1.0
        (0x28, 127, False),  # -0.0 codes against a plain +0.0
        (0x80, 130, True),  # +0.0 codes against a plain -0.0
        (0x2A, 120, False),  # negative values
        (0x21, 0xFF, False),  # a NaN scale: NaN against NaN
    ],
)
@pytest.mark.parametrize("quantized_first", [True, False])
def test_mxfp4_against_its_float32_values_is_the_same(
    tmp_path: Path, run_main: Any, byte: int, scale: int, negative_zero: bool, quantized_first: bool
) -> None:
    stored, values = mxfp4(byte, scale)
    quantized = write_raw_safetensors(tmp_path / "q.safetensors", stored)
    plain = write_raw_safetensors(
        tmp_path / "p.safetensors", {NAME: ("F32", [1, 32], floats("F32", values, negative_zero))}
    )
    a, b = (quantized, plain) if quantized_first else (plain, quantized)
    document = diff_json(run_main, a, b)
    found = row(document, NAME)
    assert (found["status"], found["dtype_a"], found["dtype_b"]) == ("same", "float32", "float32")
    assert found["diff_norm"] == 0.0
    assert found["max_abs_diff"] == 0.0
    assert document["identical"] is True
    assert document["counts"]["same"] == 1
    assert document["counts"]["changed"] == 0
    assert run_main("diff", a, b, "--fail-above", "0", "-q").code == 0


def test_one_value_apart_is_changed(tmp_path: Path, run_main: Any) -> None:
    stored, values = mxfp4(0x21, 127)
    moved = list(values)
    first = moved[0]
    assert first is not None
    moved[0] = first + Fraction(1, 2**20)
    quantized = write_raw_safetensors(tmp_path / "q.safetensors", stored)
    plain = write_raw_safetensors(
        tmp_path / "p.safetensors", {NAME: ("F32", [1, 32], floats("F32", moved))}
    )
    document = diff_json(run_main, quantized, plain)
    found = row(document, NAME)
    assert found["status"] == "changed"
    assert found["diff_norm"] == 2.0**-20
    assert document["identical"] is False


def test_block_fp8_against_its_float32_values_is_the_same(tmp_path: Path, run_main: Any) -> None:
    codes = bytes(range(0x30, 0x40)) + bytes([0x7F, 0xFF, 0x00, 0x80])  # NaN, +0, -0 codes
    scale = 0x3E800000  # 0.25
    scale_value = float32_value(scale)
    assert scale_value is not None
    values = [None if (v := e4m3fn_value(c)) is None else v * scale_value for c in codes]
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    quantized = write_model_directory(
        tmp_path / "q",
        {
            "model.safetensors": {
                "l.weight": ("F8_E4M3", [4, 5], codes),
                "l.weight_scale_inv": ("F32", [1, 1], struct.pack("<I", scale)),
            }
        },
        config,
    )
    plain = write_raw_safetensors(
        tmp_path / "p.safetensors", {"l.weight": ("F32", [4, 5], floats("F32", values))}
    )
    for a, b in ((quantized, plain), (plain, quantized)):
        document = diff_json(run_main, a, b)
        found = row(document, "l.weight")
        assert (found["status"], found["diff_norm"], found["max_abs_diff"]) == ("same", 0.0, 0.0)
        assert document["identical"] is True


def test_another_dtype_with_equal_values_is_a_dtype_change_as_for_plain_tensors(
    tmp_path: Path, run_main: Any
) -> None:
    stored, values = mxfp4(0x21, 127)
    quantized = write_raw_safetensors(tmp_path / "q.safetensors", stored)
    wide = write_raw_safetensors(
        tmp_path / "w.safetensors", {NAME: ("F64", [1, 32], floats("F64", values))}
    )
    narrow = write_raw_safetensors(
        tmp_path / "n.safetensors", {NAME: ("F32", [1, 32], floats("F32", values))}
    )
    plain = diff_json(run_main, narrow, wide)  # two plain tensors: the project's rule
    expected = (row(plain, NAME)["status"], plain["identical"])
    assert expected == ("dtype changed", False)
    document = diff_json(run_main, quantized, wide)
    found = row(document, NAME)
    assert (found["status"], document["identical"]) == expected
    assert (found["dtype_a"], found["dtype_b"]) == ("float32", "float64")
    assert found["diff_norm"] == 0.0
    assert document["counts"]["dtype changed"] == 1


def test_clipcli_own_float32_conversion_is_the_same(tmp_path: Path, run_main: Any) -> None:
    stored, _ = mxfp4(0x3A, 125)
    quantized = write_raw_safetensors(tmp_path / "q.safetensors", stored)
    out = tmp_path / "f32.safetensors"
    assert run_main("convert", "--dtype", "float32", quantized, out, "-q").code == 0
    document = diff_json(run_main, quantized, out)
    assert row(document, NAME)["status"] == "same"
    assert document["identical"] is True
