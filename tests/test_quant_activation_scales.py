"""Issue 21, third attack round, break 2: quantization parameters of activations (KV-cache
scales `X.k_scale`/`X.v_scale`, `X.q_scale`, `X.output_scale`, an `X.input_scale` no weight
claims) are no weights: in a quantized checkpoint they are listed with role quantization,
stay out of the global norm and are copied byte for byte by a clip. In a plain checkpoint
(no quantization_config, no quantized weight) a parameter of such a name, like
`layer_scale` or `scale` anywhere, stays a weight.

References: fp8 values from their bit fields (tests/quant_reference.py), sums of squares
as Fractions; the clipped file read back byte by byte.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from quant_reference import (
    e4m3fn_value,
    f32_payload,
    float32_value,
    read_raw_safetensors,
    sqrt_fraction,
    write_model_directory,
    write_raw_safetensors,
)

HALF = 0x3F000000
ONE = 0x3F800000
CODES = bytes([0x38, 0x40, 0xB8, 0x30, 0x44, 0x3C])  # 1, 2, -1, 0.5, 3, 1.5
ACTIVATION = {
    "m.self_attn.k_scale": ("F32", [], f32_payload([HALF])),
    "m.self_attn.v_scale": ("F32", [], f32_payload([HALF])),
    "m.self_attn.q_scale": ("F32", [1], f32_payload([HALF])),
    "m.self_attn.k_proj.output_scale": ("F32", [1], f32_payload([HALF])),
    "m.self_attn.k_proj.input_scale": ("F32", [1], f32_payload([HALF])),  # no weight claims it
    "m.self_attn.o_proj.kv_scale": ("F32", [], f32_payload([HALF])),
}
PLAIN_LOOKALIKES = {
    "m.layer_scale": ("F32", [2], f32_payload([ONE, ONE])),
    "m.scale": ("F32", [1], f32_payload([ONE])),
}
CT_FP8 = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
}


def quantized_stored() -> tuple[dict[str, Any], Fraction]:
    """A channel-FP8 q_proj (scales 2 and 0.5), a plain lm_head, the activation scales and
    two plain look-alikes; the exact sum of squares of the weights."""
    scales = [0x40000000, HALF]
    stored: dict[str, Any] = {
        "m.self_attn.q_proj.weight": ("F8_E4M3", [2, 3], CODES),
        "m.self_attn.q_proj.weight_scale": ("F32", [2, 1], f32_payload(scales)),
        "m.self_attn.q_proj.input_scale": ("F32", [1], f32_payload([ONE])),
        **ACTIVATION,
        **PLAIN_LOOKALIKES,
        "lm_head.weight": ("F32", [2], f32_payload([ONE, ONE])),
    }
    total = Fraction(0)
    for i, code in enumerate(CODES):
        value = e4m3fn_value(code)
        scale = float32_value(scales[i // 3])
        assert value is not None
        assert scale is not None
        total += (value * scale) ** 2
    total += 2 + 1 + 2  # layer_scale, scale, lm_head: weights
    return stored, total


def norms(run_main: Any, path: Path) -> dict[str, Any]:
    result = run_main("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def rows(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in document["tensors"]}


@pytest.mark.parametrize("with_config", [True, False], ids=["config", "names-alone"])
def test_activation_scales_are_quantization_parameters(
    tmp_path: Path, run_main: Any, with_config: bool
) -> None:
    stored, total = quantized_stored()
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, CT_FP8 if with_config else None
    )
    document = norms(run_main, directory)
    found = rows(document)
    for name in ACTIVATION:
        assert (found[name]["role"], found[name]["in_global"]) == ("quantization", False), name
    for name in (*PLAIN_LOOKALIKES, "lm_head.weight", "m.self_attn.q_proj.weight"):
        assert (found[name]["role"], found[name]["in_global"]) == ("weight", True), name
    exact = sqrt_fraction(total)
    assert abs(document["global_norm"] - exact) <= 2 * abs(exact) * 2**-52


def test_a_clip_copies_activation_scales_byte_for_byte(tmp_path: Path, run_main: Any) -> None:
    stored, _ = quantized_stored()
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, CT_FP8)
    out = tmp_path / "o"
    result = run_main("clip", "--global", "0.01", directory, out, "-q")
    assert result.code == 0, result.stderr
    written = read_raw_safetensors(out / "model.safetensors")
    for name, entry in ACTIVATION.items():
        assert written[name][2] == entry[2], name
    assert (
        written["m.self_attn.q_proj.input_scale"][2] == stored["m.self_attn.q_proj.input_scale"][2]
    )
    assert written["m.self_attn.q_proj.weight"][2] == CODES  # codes kept, scales scaled
    assert (
        written["m.self_attn.q_proj.weight_scale"][2]
        != stored["m.self_attn.q_proj.weight_scale"][2]
    )
    for name in PLAIN_LOOKALIKES:  # weights: scaled
        assert written[name][2] != stored[name][2], name


def test_kv_cache_only_quantization_lists_its_scales_apart(tmp_path: Path, run_main: Any) -> None:
    """A config that quantizes the KV cache alone: plain weights, scales apart."""
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        }
    }
    stored = {
        "m.self_attn.k_proj.weight": ("F32", [2], f32_payload([ONE, ONE])),
        "m.self_attn.k_scale": ("F32", [], f32_payload([HALF])),
        "m.self_attn.v_scale": ("F32", [], f32_payload([HALF])),
    }
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    found = rows(norms(run_main, directory))
    assert found["m.self_attn.k_scale"]["role"] == "quantization"
    assert found["m.self_attn.v_scale"]["role"] == "quantization"
    assert found["m.self_attn.k_proj.weight"]["role"] == "weight"


def test_a_plain_checkpoint_keeps_such_names_as_weights(tmp_path: Path, run_main: Any) -> None:
    stored = {**ACTIVATION, **PLAIN_LOOKALIKES}
    path = write_raw_safetensors(tmp_path / "plain.safetensors", stored)
    document = norms(run_main, path)
    for name, row in rows(document).items():
        assert (row["role"], row["in_global"]) == ("weight", True), name
    exact = sqrt_fraction(Fraction(len(ACTIVATION), 4) + 3)
    assert abs(document["global_norm"] - exact) <= 2 * exact * 2**-52
