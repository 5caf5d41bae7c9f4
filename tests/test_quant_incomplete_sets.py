"""Issue 21: a quantized set missing a part (GPTQ/AWQ codes without their qzeros or
scales, compressed-tensors packed codes without their scale or shape, NVFP4 codes without
their global scale, gpt-oss blocks without their scales, a bitsandbytes absmax without its
quant state, a scale whose codes are not stored) is refused (exit 3, one line naming the
weight and the missing tensor, suggesting --stored) by every command that reads it as
logical tensors. Before, such a set fell through to plain tensors: its packed words
measured as a weight, its scales counted in the global norm. `--stored` still shows the
stored tensors as they are. Plain checkpoints with names like `scales`, `g_idx`,
`down_blocks` are not refused; their norms are checked against exact Fraction sums.

Fixtures are written byte by byte (tests/quant_reference.py), sharing no code with clipcli.
"""

from __future__ import annotations

import json
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from quant_reference import (
    Stats,
    close,
    f32_payload,
    float32_value,
    write_model_directory,
    write_raw_safetensors,
)

Tensors = dict[str, tuple[str, list[int], bytes]]


def i32(count: int, word: int = 0x12345678) -> bytes:
    return struct.pack("<I", word) * count


def f16(count: int) -> bytes:
    return struct.pack("<e", 0.5) * count


ONE = 0x3F800000
HALF = 0x3F000000


def bnb_state(kind: str = "nf4") -> bytes:
    return json.dumps(
        {"quant_type": kind, "blocksize": 64, "dtype": "bfloat16", "shape": [4, 4]}
    ).encode()


# name -> (tensors, config or None, what the one error line must name)
CASES: dict[str, tuple[Tensors, dict[str, Any] | None, tuple[str, ...]]] = {
    "gptq-without-qzeros": (
        {
            "m.qweight": ("I32", [4, 8], i32(32)),
            "m.scales": ("F16", [1, 8], f16(8)),
            "m.bias": ("F32", [1], f32_payload([ONE])),
        },
        None,
        ("m.weight", "m.qzeros", "m.qweight"),
    ),
    "gptq-without-scales": (
        {"m.qweight": ("I32", [4, 8], i32(32)), "m.qzeros": ("I32", [1, 1], i32(1))},
        None,
        ("m.weight", "m.scales"),
    ),
    "qweight-in-neither-layout": (
        {
            "m.qweight": ("I32", [4, 8], i32(32)),
            "m.qzeros": ("I32", [1, 3], i32(3)),
            "m.scales": ("F16", [1, 5], f16(5)),
        },
        None,
        ("m.weight", "neither GPTQ"),
    ),
    "qzeros-without-qweight": (
        {"m.qzeros": ("I32", [1, 1], i32(1)), "m.scales": ("F16", [1, 8], f16(8))},
        None,
        ("m.weight", "m.qzeros", "m.qweight"),
    ),
    "gptq-scales-without-qweight-beside-a-gptq-weight": (
        {
            "a.qweight": ("I32", [4, 8], i32(32)),  # 32 inputs, 8 outputs, 4 bits
            "a.qzeros": ("I32", [1, 1], i32(1)),
            "a.scales": ("F16", [1, 8], f16(8)),
            "a.g_idx": ("I32", [32], i32(32, 0)),  # 32 inputs in 4 words: 4 bits
            "b.scales": ("F16", [1, 8], f16(8)),
        },
        None,
        ("b.weight", "b.scales", "b.qweight"),
    ),
    "gptq-config-g_idx-alone": (
        {"m.g_idx": ("I32", [4], i32(4, 0))},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        ("m.weight", "m.g_idx", "m.qweight"),
    ),
    "nvfp4-without-global-scale": (
        {
            "q.weight_packed": ("U8", [2, 8], bytes(range(16))),
            "q.weight_scale": ("F8_E4M3", [2, 1], bytes([0x38, 0x40])),
        },
        None,
        ("q.weight", "q.weight_global_scale"),
    ),
    "fp4-packed-without-scale": (
        {
            "q.weight_packed": ("U8", [2, 8], bytes(range(16))),
            "q.weight_global_scale": ("F32", [1], f32_payload([ONE])),
        },
        None,
        ("q.weight", "q.weight_scale"),
    ),
    "fp4-packed-with-a-bfloat16-scale": (
        {
            "q.weight_packed": ("U8", [2, 8], bytes(range(16))),
            "q.weight_scale": ("BF16", [2, 1], bytes(4)),
        },
        None,
        ("q.weight", "neither MXFP4"),
    ),
    "global-scale-without-codes": (
        {"q.weight_global_scale": ("F32", [1], f32_payload([ONE]))},
        None,
        ("q.weight", "q.weight_global_scale", "q.weight_packed"),
    ),
    "weight-shape-without-codes": (
        {"p.weight_shape": ("I64", [2], struct.pack("<qq", 4, 8))},
        None,
        ("p.weight", "p.weight_shape", "p.weight_packed"),
    ),
    "gpt-oss-blocks-without-scales": (
        {"e.up_proj_blocks": ("U8", [1, 2, 16], bytes(range(32)))},
        None,
        ("e.up_proj", "e.up_proj_scales"),
    ),
    "gpt-oss-config-scales-without-blocks": (
        {"e.up_proj_scales": ("U8", [1, 2], bytes([127, 126]))},
        {"quant_method": "mxfp4"},
        ("e.up_proj", "e.up_proj_scales", "e.up_proj_blocks"),
    ),
    "block-fp8-scale-without-weight": (
        {
            "l.weight_scale_inv": ("F32", [1, 1], f32_payload([HALF])),
            "n.weight": ("F32", [2], f32_payload([ONE, ONE])),
        },
        None,
        ("l.weight", "l.weight_scale_inv"),
    ),
    "ct-weight-scale-without-codes-beside-an-nvfp4-weight": (
        {
            "q.weight_packed": ("U8", [2, 8], bytes(range(16))),
            "q.weight_scale": ("F8_E4M3", [2, 1], bytes([0x38, 0x40])),
            "q.weight_global_scale": ("F32", [1], f32_payload([ONE])),
            "k.weight_scale": ("F8_E4M3", [2, 1], bytes([0x38, 0x40])),
        },
        None,
        ("k.weight", "k.weight_scale", "k.weight_packed"),
    ),
    "bnb-absmax-without-quant-state": (
        {
            "m.weight": ("BF16", [4, 1], bytes(range(8))),  # quant_storage bf16: 16 nibbles
            "m.weight.absmax": ("F32", [1], f32_payload([ONE])),
            "m.weight.quant_map": ("F32", [16], f32_payload([HALF] * 16)),
        },
        None,
        ("m.weight", "m.weight.quant_state.bitsandbytes__nf4"),
    ),
    "bnb-quant-map-without-codes": (
        {"m.weight.quant_map": ("F32", [16], f32_payload([HALF] * 16))},
        None,
        ("m.weight", "m.weight.quant_map"),
    ),
    "bnb-quant-state-without-absmax": (
        {
            "m.weight": ("U8", [8, 1], bytes(range(8))),
            "m.weight.quant_map": ("F32", [16], f32_payload([HALF] * 16)),
            "m.weight.quant_state.bitsandbytes__nf4": ("U8", [len(bnb_state())], bnb_state()),
        },
        None,
        ("m.weight.quant_state.bitsandbytes__nf4", "m.weight.absmax"),
    ),
    "bnb-scb-without-weight": (
        {"m.SCB": ("F32", [2], f32_payload([ONE, ONE]))},
        None,
        ("m.weight", "m.SCB"),
    ),
    "bnb-int8-config-without-scb": (
        {"m.weight": ("I8", [2, 2], bytes([1, 2, 3, 4]))},
        {"quant_method": "bitsandbytes", "load_in_8bit": True},
        ("m.weight", "m.SCB"),
    ),
    "ct-packed-int-without-shape": (  # refused before this issue too: one rule for all
        {
            "p.weight_packed": ("I32", [4, 1], i32(4)),
            "p.weight_scale": ("F16", [4, 1], f16(4)),
        },
        None,
        ("p.weight_packed", "p.weight_shape"),
    ),
    "config-fp8-without-scale": (  # refused before this issue too, now with the hint
        {"l.weight": ("F8_E4M3", [2, 2], bytes([0x38] * 4))},
        {"quant_method": "fp8", "weight_block_size": [128, 128]},
        ("l.weight", "l.weight_scale_inv"),
    ),
}


def checkpoint(tmp_path: Path, tensors: Tensors, config: dict[str, Any] | None) -> Path:
    if config is None:
        return write_raw_safetensors(tmp_path / "m.safetensors", tensors)
    return write_model_directory(
        tmp_path / "m", {"model.safetensors": tensors}, {"quantization_config": config}
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_set_missing_a_part_is_refused_by_every_command(
    tmp_path: Path, run_main: Any, case: str
) -> None:
    tensors, config, needles = CASES[case]
    path = checkpoint(tmp_path, tensors, config)
    out = tmp_path / "out.safetensors"
    for args in (
        ("norms", path),
        ("norms", "--format", "json", path),
        ("ls", path),
        ("diff", path, path),
        ("clip", "--global", "1", path, out),
        ("convert", "--dtype", "float32", path, out),
    ):
        result = run_main(*args)
        assert result.code == 3, (args, result.stdout, result.stderr)
        assert result.stdout == ""  # nothing measured: no code word, no scale in a norm
        (line,) = result.stderr.splitlines()
        assert line.startswith("clipcli: error: ")
        for needle in (*needles, "--stored"):
            assert needle in line, (args, line)
    assert not out.exists()


@pytest.mark.parametrize("case", list(CASES))
def test_stored_still_shows_the_stored_tensors(tmp_path: Path, run_main: Any, case: str) -> None:
    tensors, config, _ = CASES[case]
    path = checkpoint(tmp_path, tensors, config)
    listed = run_main("ls", "--stored", "--format", "json", path)
    assert listed.code == 0, listed.stderr
    measured = run_main("norms", "--stored", "--format", "json", path)
    assert measured.code == 0, measured.stderr
    rows = json.loads(measured.stdout)["tensors"]
    assert [r["name"] for r in rows] == sorted(tensors, key=_natural)


def _natural(name: str) -> list[Any]:
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# Plain checkpoints whose names look like parts of a quantized set, but are not: no
# quantization_config, no quantized weight recognised beside them.
PLAIN: dict[str, Tensors] = {
    "scales-and-g_idx": {
        "encoder.scales": ("F32", [2], f32_payload([ONE, HALF])),
        "encoder.g_idx": ("I32", [3], i32(3, 1)),
        "encoder.weight": ("F32", [2], f32_payload([HALF, HALF])),
    },
    "uint8-scales": {"pos_scales": ("U8", [4], bytes([1, 2, 3, 4]))},
    "diffusers-blocks": {
        "down_blocks.0.resnets.0.conv1.weight": ("F32", [2], f32_payload([ONE, ONE])),
        "up_blocks.1.attentions.0.proj_in.weight": ("F32", [1], f32_payload([HALF])),
    },
    "float-blocks": {"x_blocks": ("F32", [1, 2, 16], f32_payload([HALF] * 32))},
    "uint8-blocks-not-16-wide": {"tok_blocks": ("U8", [2, 8], bytes(range(16)))},
    "a-float-weight-with-a-learned-weight_scale": {
        "head.weight": ("F32", [2], f32_payload([ONE, HALF])),
        "head.weight_scale": ("F32", [1], f32_payload([HALF])),
    },
    "fp8-cast-without-scales": {  # e.g. a model cast to float8 for storage: code = value
        "l.weight": ("F8_E4M3", [2], bytes([0x38, 0x40])),
    },
    "int8-weight-without-config": {"m.weight": ("I8", [2], bytes([1, 2]))},
    "scales-beside-an-fp8-block-weight": {  # GPTQ's generic name in another family
        "l.weight": ("F8_E4M3", [1, 1], bytes([0x38])),
        "l.weight_scale_inv": ("F32", [1, 1], f32_payload([HALF])),
        "norm.scales": ("F32", [1], f32_payload([ONE])),
    },
}


def _float32_values(tensors: Tensors) -> list[Fraction]:
    values: list[Fraction] = []
    for code, _, payload in tensors.values():
        if code == "F32":
            words = struct.unpack(f"<{len(payload) // 4}I", payload)
            values += [v for v in map(float32_value, words) if v is not None]
    return values


@pytest.mark.parametrize("case", list(PLAIN))
def test_plain_names_that_look_quantized_are_not_refused(
    tmp_path: Path, run_main: Any, case: str
) -> None:
    tensors = PLAIN[case]
    path = write_raw_safetensors(tmp_path / "p.safetensors", tensors)
    listed = run_main("ls", path)
    assert listed.code == 0, listed.stderr
    result = run_main("norms", "--format", "json", path)
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    if case == "scales-beside-an-fp8-block-weight":
        # 1.0 * 0.5 (the fp8 weight's real value) and the plain norm.scales 1.0
        assert close(report["global_norm"], Stats([Fraction(1, 2), Fraction(1)]).norm)
        return
    if case == "fp8-cast-without-scales":
        assert close(report["global_norm"], Stats([Fraction(1), Fraction(2)]).norm)
        return
    assert close(report["global_norm"], Stats(_float32_values(tensors)).norm)


def test_the_fix_is_what_makes_gptq_without_qzeros_refused(tmp_path: Path, run_main: Any) -> None:
    """The failure the issue names: the scales would count in the global norm. With
    --stored they do, by request, and the packed words are listed as int32."""
    tensors, config, _ = CASES["gptq-without-qzeros"]
    path = checkpoint(tmp_path, tensors, config)
    stored = json.loads(run_main("norms", "--stored", "--format", "json", path).stdout)
    rows = {r["name"]: r for r in stored["tensors"]}
    assert rows["m.qweight"]["dtype"] == "int32"
    assert rows["m.scales"]["in_global"] is True
