"""Encoders and exact references for quantized-checkpoint tests, written from the formats'
published definitions and sharing no code with clipcli's decoders: fp8/fp4 values from
their bit fields as Fractions, sums of squares as Fractions, and safetensors files written
byte by byte (any dtype code, any payload).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from handmade import read_raw_safetensors as read_raw_safetensors  # shared by the tests

NAN = None  # a code whose value is NaN (or an infinity: non-finite either way)


def e4m3fn_value(code: int) -> Fraction | None:
    """OCP FP8 E4M3 (fn: no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 15 with mantissa 7 is NaN (0x7F, 0xFF)."""
    sign = -1 if code & 0x80 else 1
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return NAN
    if exponent == 0:
        return sign * Fraction(mantissa, 8) * Fraction(1, 2**6)
    return sign * (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


def e5m2_value(code: int) -> Fraction | None:
    """IEEE-like FP8 E5M2: bias 15, exponent 31 is infinity (mantissa 0) or NaN."""
    sign = -1 if code & 0x80 else 1
    exponent, mantissa = (code >> 2) & 0x1F, code & 0x3
    if exponent == 0x1F:
        return NAN
    if exponent == 0:
        return sign * Fraction(mantissa, 4) * Fraction(1, 2**14)
    return sign * (1 + Fraction(mantissa, 4)) * Fraction(2) ** (exponent - 15)


def e2m1_value(code: int) -> Fraction:
    """FP4 E2M1 (MXFP4/NVFP4): sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1 if code & 0x8 else 1
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * Fraction(mantissa, 2)
    return sign * (1 + Fraction(mantissa, 2)) * Fraction(2) ** (exponent - 1)


def e8m0_value(code: int) -> Fraction | None:
    """E8M0: 2**(code - 127); 0xFF is NaN."""
    return NAN if code == 0xFF else Fraction(2) ** (code - 127)


def float32_value(bits: int) -> Fraction | None:
    """IEEE binary32 from its bits."""
    sign = -1 if bits >> 31 else 1
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0xFF:
        return NAN
    if exponent == 0:
        return sign * Fraction(mantissa, 2**23) * Fraction(1, 2**126)
    return sign * (1 + Fraction(mantissa, 2**23)) * Fraction(2) ** (exponent - 127)


def bfloat16_value(bits: int) -> Fraction | None:
    return float32_value(bits << 16)


def float32_bits(values: Iterable[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


class Stats:
    """Exact norm statistics of a list of values (None = non-finite)."""

    def __init__(self, values: Iterable[Fraction | None]) -> None:
        self.sumsq = Fraction(0)
        self.max_abs = Fraction(0)
        self.nonfinite = 0
        self.count = 0
        for v in values:
            self.count += 1
            if v is None:
                self.nonfinite += 1
                continue
            self.sumsq += v * v
            self.max_abs = max(self.max_abs, abs(v))

    @property
    def norm(self) -> float:
        return sqrt_fraction(self.sumsq)


def sqrt_fraction(value: Fraction) -> float:
    """sqrt of a Fraction, within an ulp (integer square root at 120 bits)."""
    if value == 0:
        return 0.0
    shift = 240 - (value.numerator.bit_length() - value.denominator.bit_length())
    shift += shift % 2
    scaled = (
        (value.numerator << shift) // value.denominator
        if shift >= 0
        else (value.numerator // (value.denominator << -shift))
    )
    return math.ldexp(float(math.isqrt(scaled)), -shift // 2)


def close(actual: float, expected: float, ulps: int = 2) -> bool:
    if expected == 0.0:
        return actual == 0.0
    return abs(actual - expected) <= ulps * math.ulp(expected)


def write_raw_safetensors(
    path: Path,
    tensors: Mapping[str, tuple[str, Iterable[int], bytes]],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """A safetensors file from (dtype code, shape, payload bytes) per tensor, in order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (code, shape, payload) in tensors.items():
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(payload)],
        }
        offset += len(payload)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _, _, payload in tensors.values():
            out.write(payload)
    return path


def f32_payload(bits: Iterable[int]) -> bytes:
    return b"".join(struct.pack("<I", b) for b in bits)


def bf16_payload(bits: Iterable[int]) -> bytes:
    return b"".join(struct.pack("<H", b) for b in bits)


def random_float32_bits(
    rng: np.random.Generator, count: int, low: int = -20, high: int = 4
) -> list[int]:
    """Finite float32 bit patterns of random sign, mantissa and exponent in [low, high)."""
    signs = rng.integers(0, 2, count)
    exponents = rng.integers(low + 127, high + 127, count)
    mantissas = rng.integers(0, 1 << 23, count)
    return [
        int(s) << 31 | int(e) << 23 | int(m)
        for s, e, m in zip(signs, exponents, mantissas, strict=True)
    ]


def write_model_directory(
    directory: Path,
    shards: Mapping[str, Mapping[str, tuple[str, Iterable[int], bytes]]],
    config: Mapping[str, Any] | None,
) -> Path:
    """A Hugging Face model directory: the shards, their index and config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        write_raw_safetensors(directory / shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory
