"""Issue 21, breaks 2 and 3: clip --global (and --group-by) over quantized weights whose
scales round coarsely (bfloat16, float16, fp8 e4m3 for NVFP4), together with plain float32
tensors whose rounding is their own: the written result never exceeds the limit.

The factor search used to trust its rounding bounds for such a group (the quantized
weight's values are float64, so it took their rounding for float64's): the bound was
broken by up to 2**-9 (bfloat16) or more (e4m3). Every figure here comes from the written
bytes, decoded with the reference decoders (tests/quant_reference.py and the float16
decoder below) and summed as Fractions.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import (
    bfloat16_value,
    e2m1_value,
    e4m3fn_value,
    float32_value,
    read_raw_safetensors,
    write_model_directory,
)

PLAIN = ("F32", [2, 2], struct.pack("<4f", 0.5, -0.5, 0.25, 0.125))


def float16_value(bits: int) -> Fraction:
    """IEEE binary16 from its bits (finite only here)."""
    sign = -1 if bits >> 15 else 1
    exponent, mantissa = (bits >> 10) & 0x1F, bits & 0x3FF
    assert exponent != 0x1F
    if exponent == 0:
        return sign * Fraction(mantissa, 2**10) * Fraction(1, 2**14)
    return sign * (1 + Fraction(mantissa, 2**10)) * Fraction(2) ** (exponent - 15)


def scale_values(code: str, payload: bytes) -> list[Fraction]:
    if code == "F32":
        values = [float32_value(b) for (b,) in struct.iter_unpack("<I", payload)]
    elif code == "BF16":
        values = [bfloat16_value(b) for (b,) in struct.iter_unpack("<H", payload)]
    else:
        assert code == "F16"
        values = [float16_value(b) for (b,) in struct.iter_unpack("<H", payload)]
    assert all(v is not None for v in values)
    return [v for v in values if v is not None]


def plain_sumsq(payload: bytes) -> Fraction:
    return sum((Fraction(v) ** 2 for (v,) in struct.iter_unpack("<f", payload)), Fraction(0))


def ct_fp8(seed: int, scale_code: str, group: int | None) -> dict[str, Any]:
    """compressed-tensors FP8, channel (group None) or group scales in `scale_code`."""
    rng = np.random.default_rng(seed)
    rows, columns = 24, 64
    codes = bytes(0x40 if c & 0x7F == 0x7F else int(c) for c in rng.integers(0, 256, 1536))
    per_row = 1 if group is None else -(-columns // group)
    raw = rng.random(rows * per_row) * 0.01 + 0.001
    if scale_code == "F32":
        payload = struct.pack(f"<{raw.size}f", *raw)
    elif scale_code == "F16":
        payload = raw.astype(np.float16).tobytes()
    else:  # bfloat16: the high half of the float32, rounded to nearest even
        bits = np.frombuffer(raw.astype(np.float32).tobytes(), np.uint32).astype(np.uint64)
        payload = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return {
        "l.weight": ("F8_E4M3", [rows, columns], codes),
        "l.weight_scale": (scale_code, [rows, per_row], payload),
        "l.input_scale": ("F32", [1], struct.pack("<f", 3.0)),
        "plain.weight": PLAIN,
    }


def ct_config(group: int | None) -> dict[str, Any]:
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True}
    weights.update(
        {"strategy": "channel"} if group is None else {"strategy": "group", "group_size": group}
    )
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        }
    }


def ct_sumsq(tensors: dict[str, tuple[str, list[int], bytes]], group: int | None) -> Fraction:
    _, (rows, columns), codes = tensors["l.weight"]
    code, (_, per_row), payload = tensors["l.weight_scale"]
    scales = scale_values(code, payload)
    group = columns if group is None else group
    total = Fraction(0)
    for i in range(rows):
        for j in range(columns):
            value = e4m3fn_value(codes[i * columns + j])
            assert value is not None
            total += (value * scales[i * per_row + j // group]) ** 2
    return total


def clipped(run_main: Any, src: Path, out: Path, *mode: str) -> dict[str, Any]:
    result = run_main("clip", *mode, src, out, "-q")
    assert result.code == 0, result.stderr
    return read_raw_safetensors(out / "model.safetensors")


# The slack the scales' rounding leaves under the limit (norm squared, relative): twice a
# few units of the scale dtype (the search stops within a fraction of one).
SLACK = {"F32": Fraction(1, 2**18), "F16": Fraction(1, 2**8), "BF16": Fraction(1, 2**5)}


@pytest.mark.parametrize("scale_code", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("group", [None, 32, 40], ids=["channel", "group32", "group40"])
@pytest.mark.parametrize("limit", [0.37, 2.5])
def test_global_clip_of_fp8_with_rounded_scales_and_a_plain_tensor_keeps_the_bound(
    tmp_path: Path, run_main: Any, scale_code: str, group: int | None, limit: float
) -> None:
    stored = ct_fp8(5 + (group or 0), scale_code, group)
    src = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, ct_config(group))
    before = ct_sumsq(stored, group) + plain_sumsq(PLAIN[2])
    assert before > Fraction(limit) ** 2  # a clip is needed
    written = clipped(run_main, src, tmp_path / "out", "--global", repr(limit))
    assert written["l.weight"] == stored["l.weight"]  # the codes, byte for byte
    assert written["l.input_scale"] == stored["l.input_scale"]
    after = ct_sumsq(written, group) + plain_sumsq(written["plain.weight"][2])
    assert after <= Fraction(limit) ** 2  # the promise, exactly
    assert after >= Fraction(limit) ** 2 * (1 - SLACK[scale_code])


@pytest.mark.parametrize("scale_code", ["BF16", "F16"])
def test_group_by_clip_of_mixed_groups_keeps_each_bound(
    tmp_path: Path, run_main: Any, scale_code: str
) -> None:
    """--group-by puts the quantized weight and the plain one in one group each ('l' and
    'plain'): a factor per group, each within the limit on its own."""
    stored = ct_fp8(8, scale_code, None)
    stored["l.bias"] = PLAIN  # a plain float32 tensor in the quantized weight's group
    src = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, ct_config(None))
    limit = 0.2
    written = clipped(
        run_main, src, tmp_path / "out", "--global", repr(limit), "--group-by", r"^(\w+)\."
    )
    group_l = ct_sumsq(written, None) + plain_sumsq(written["l.bias"][2])
    assert group_l <= Fraction(limit) ** 2
    assert plain_sumsq(written["plain.weight"][2]) <= Fraction(limit) ** 2


def nvfp4_layer(rng: np.random.Generator, name: str, global_scale: float) -> dict[str, Any]:
    rows, columns = 16, 64
    nibbles = rng.integers(0, 16, rows * columns)
    packed = bytes(int(a) | int(b) << 4 for a, b in zip(nibbles[0::2], nibbles[1::2], strict=True))
    scale_codes = bytes(int(c) for c in rng.integers(0x08, 0x7E, rows * columns // 16))
    return {
        f"{name}.weight_packed": ("U8", [rows, columns // 2], packed),
        f"{name}.weight_scale": ("F8_E4M3", [rows, columns // 16], scale_codes),
        f"{name}.weight_global_scale": ("F32", [1], struct.pack("<f", global_scale)),
        f"{name}.input_global_scale": ("F32", [1], struct.pack("<f", 100.0)),
    }


def nvfp4_sumsq(tensors: dict[str, Any], name: str) -> Fraction:
    _, (rows, half), packed = tensors[f"{name}.weight_packed"]
    scale_codes = tensors[f"{name}.weight_scale"][2]
    (g,) = struct.unpack("<f", tensors[f"{name}.weight_global_scale"][2])
    total = Fraction(0)
    for i in range(rows * half * 2):
        byte = packed[i // 2]
        code = byte & 0xF if i % 2 == 0 else byte >> 4
        scale = e4m3fn_value(scale_codes[i // 16])
        assert scale is not None
        total += (e2m1_value(code) * scale / Fraction(g)) ** 2
    return total


NVFP4_CONFIG = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {},
    }
}


@pytest.mark.parametrize("limit", [0.001, 0.0123, 0.5])
def test_global_clip_of_nvfp4_with_a_plain_tensor_keeps_the_bound(
    tmp_path: Path, run_main: Any, limit: float
) -> None:
    """q/k/v share a global scale (never touched); their e4m3 block scales take the factor
    (3 significant bits: coarse) and the plain float32 tensor its own rounding."""
    rng = np.random.default_rng(7)
    names = ["m.q_proj", "m.k_proj", "m.v_proj"]
    stored: dict[str, Any] = {}
    for name in names:
        stored.update(nvfp4_layer(rng, name, 448.0 * 6 / 2.5))
    stored["m.o.weight"] = ("F32", [4], struct.pack("<4f", 0.25, 0.25, 0.25, 0.25))
    src = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    written = clipped(run_main, src, tmp_path / "out", "--global", repr(limit))
    after = plain_sumsq(written["m.o.weight"][2])
    for name in names:
        assert written[f"{name}.weight_packed"] == stored[f"{name}.weight_packed"]
        assert written[f"{name}.weight_global_scale"] == stored[f"{name}.weight_global_scale"]
        after += nvfp4_sumsq(written, name)
    assert after <= Fraction(limit) ** 2
    assert after >= Fraction(limit) ** 2 * Fraction(3, 4)  # e4m3: within a few of its units
    assert math.isfinite(float(after))
