"""Issue 21, break 4: a config.json whose quantization_config does not describe the
tensors (another quant_method, an unknown or non-string one, a format for another layout)
must never turn quantized tensors into plain ones: codes read raw and a scale counted as a
weight. It is refused (exit 3, one line) by every command that reads values.

Fixtures are written byte by byte (tests/quant_reference.py); the expected norm of the
one accepted case is an exact Fraction sum.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from quant_reference import (
    Stats,
    e2m1_value,
    e4m3fn_value,
    f32_payload,
    float32_value,
    write_model_directory,
)

SCALE_BITS = 0x3C000000  # 2**-7

BLOCK_FP8 = {
    "l.weight": ("F8_E4M3", [4, 4], bytes([0x38, 0x40, 0xB8, 0x30] * 4)),
    "l.weight_scale_inv": ("F32", [1, 1], f32_payload([SCALE_BITS])),
    "n.weight": ("F32", [2], f32_payload([0x3F800000, 0x3F800000])),
}
# Scales that fit blocks of 100..149 x 100..199: even the names alone cannot read them.
AMBIGUOUS_FP8 = {
    "l.weight": ("F8_E4M3", [300, 200], bytes([0x38]) * 60000),
    "l.weight_scale_inv": ("F32", [3, 2], f32_payload([SCALE_BITS] * 6)),
}
MXFP4 = {
    "m.experts.up_proj_blocks": ("U8", [1, 2, 16], bytes(range(32))),
    "m.experts.up_proj_scales": ("U8", [1, 2], bytes([127, 126])),
}
NVFP4 = {
    "q.weight_packed": ("U8", [2, 8], bytes(range(16))),
    "q.weight_scale": ("F8_E4M3", [2, 1], bytes([0x38, 0x40])),
    "q.weight_global_scale": ("F32", [1], f32_payload([0x3F800000])),
}
CT_FP8 = {
    "c.weight": ("F8_E4M3", [2, 2], bytes([0x38, 0x40, 0x30, 0x38])),
    "c.weight_scale": ("F32", [2, 1], f32_payload([SCALE_BITS, SCALE_BITS])),
}

CONFIGS: dict[str, Any] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "unknown": {"quant_method": "evil", "weight_block_size": [128, 128]},
    "mxfp4": {"quant_method": "mxfp4"},
    "ct-nvfp4": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {},
    },
    "null-method": {"quant_method": None},
    "no-method": {"bits": 8},
}
WRONG_FOR: dict[str, dict[str, Any]] = {
    "block-fp8": {**CONFIGS, "fbgemm": {"quant_method": "fbgemm_fp8"}},
    "ambiguous-fp8": CONFIGS,
    "mxfp4": {
        **{k: v for k, v in CONFIGS.items() if k != "mxfp4"},
        "fp8": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    "nvfp4": {k: v for k, v in CONFIGS.items() if k != "ct-nvfp4"},
    "ct-fp8": {k: v for k, v in CONFIGS.items() if k != "ct-nvfp4"},
}
LAYOUTS = {
    "block-fp8": BLOCK_FP8,
    "ambiguous-fp8": AMBIGUOUS_FP8,
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,
    "ct-fp8": CT_FP8,
}
CASES = [(layout, name) for layout, configs in WRONG_FOR.items() for name in configs]


def refused_everywhere(run_main: Any, directory: Path, tmp_path: Path, *needles: str) -> None:
    out = tmp_path / "out"
    for args in (
        ("norms", directory, "--format", "json"),
        ("diff", directory, directory),
        ("clip", "--global", "1", directory, out),
    ):
        result = run_main(*args)
        assert result.code == 3, (args, result.stdout, result.stderr)
        assert result.stdout == ""  # nothing measured, no scale counted as a weight
        (line,) = result.stderr.splitlines()
        assert line.startswith("clipcli: error: ")
        for needle in needles:
            assert needle in line
    assert not out.exists()


@pytest.mark.parametrize(("layout", "config"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_a_config_that_does_not_describe_the_tensors_is_refused(
    tmp_path: Path, run_main: Any, layout: str, config: str
) -> None:
    quant = WRONG_FOR[layout][config]
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": LAYOUTS[layout]}, {"quantization_config": quant}
    )
    if config == "fbgemm":  # it claims l.weight by name and finds no weight_scale beside it
        refused_everywhere(run_main, directory, tmp_path, "l.weight_scale", "cannot be known")
        return
    refused_everywhere(
        run_main, directory, tmp_path, "does not describe the tensors", "quantized weight"
    )


@pytest.mark.parametrize("method", [5, True, 1.5, ["fp8"], {"x": 1}])
def test_a_quant_method_that_is_not_a_string_is_refused(
    tmp_path: Path, run_main: Any, method: Any
) -> None:
    directory = write_model_directory(
        tmp_path / "m",
        {"model.safetensors": BLOCK_FP8},
        {"quantization_config": {"quant_method": method}},
    )
    refused_everywhere(run_main, directory, tmp_path, "quant_method", "is not a string")


def test_a_config_that_declares_one_layout_refuses_another_beside_it(
    tmp_path: Path, run_main: Any
) -> None:
    """The fp8 config describes l.weight; MXFP4 blocks beside it it does not."""
    directory = write_model_directory(
        tmp_path / "m",
        {"model.safetensors": {**BLOCK_FP8, **MXFP4}},
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    )
    refused_everywhere(run_main, directory, tmp_path, "m.experts.up_proj", "mxfp4")


def test_the_config_that_describes_the_tensors_is_read(tmp_path: Path, run_main: Any) -> None:
    directory = write_model_directory(
        tmp_path / "m",
        {"model.safetensors": BLOCK_FP8},
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    )
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["tensors"]}
    scale = float32_value(SCALE_BITS)
    assert scale is not None
    codes = BLOCK_FP8["l.weight"][2]
    values = []
    for code in codes:
        value = e4m3fn_value(code)
        assert value is not None
        values.append(value * scale)
    exact = math.sqrt(Stats(values).sumsq)
    assert abs(rows["l.weight"]["norm"] - exact) <= 2 * math.ulp(exact)
    assert rows["l.weight_scale_inv"]["role"] == "quantization"
    assert not rows["l.weight_scale_inv"]["in_global"]


def test_an_unknown_method_over_plain_tensors_reads_them(tmp_path: Path, run_main: Any) -> None:
    """Nothing there looks quantized: the config has nothing to disagree with."""
    plain = {"a.weight": ("F32", [2], f32_payload([0x3F800000, 0x40000000]))}
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": plain}, {"quantization_config": CONFIGS["unknown"]}
    )
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["global_norm"] == math.sqrt(5)


def test_fp4_reference_sanity() -> None:
    """The reference decoders the fixtures rely on (e2m1 for MXFP4/NVFP4)."""
    assert [e2m1_value(c) for c in (1, 7, 9)] == [0.5, 6, -0.5]
    assert struct.unpack("<f", f32_payload([SCALE_BITS]))[0] == 2.0**-7
