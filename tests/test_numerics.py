"""Exact norms (DESIGN.md §2): sums of squares accumulated in float64 with rescaling, so
that no finite input overflows or underflows, with relative error <= 1e-7 for any size.

Library level through `clipcli.norms` (l2_norm, accumulate over chunks, global_norm), then
the same numbers through `clipcli norms` / `clipcli clip` on files of every format.
TensorFlow squares float16 in float16: ||[300.0] * 300|| overflows to inf there; not here.
"""

from __future__ import annotations

import bisect
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from clipcli import dtypes
from clipcli.numerics import float16, rounding, scaling
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.norms import NormAccumulator, accumulate, global_norm, l2_norm
from clipcli.numerics.search import truncate_factor

SQRT2 = 1.4142135623730951
FP16_300 = np.full(300, 300.0, dtype=np.float16)  # sqrt(300 * 300**2) = 300 * sqrt(300)
FP16_300_NORM = 5196.152422706632


def chunked(array: np.ndarray, size: int) -> Iterator[np.ndarray]:
    flat = array.reshape(-1)
    return (flat[i : i + size] for i in range(0, flat.size, size))


# ------------------------------------------------------------------ library: exact values


def test_float16_squares_do_not_overflow() -> None:
    assert l2_norm(FP16_300) == pytest.approx(FP16_300_NORM, rel=1e-12)
    assert accumulate(chunked(FP16_300, 7)).norm == pytest.approx(FP16_300_NORM, rel=1e-12)
    assert l2_norm(np.array([300.0], np.float16)) == 300.0
    # the largest float16, 65504, squared is 4.3e9: far beyond float16, exact in float64
    assert l2_norm(np.full(4, 65504.0, np.float16)) == 131008.0


def test_float32_1e20() -> None:
    x = np.array([1e20, 1e20], dtype=np.float32)
    assert l2_norm(x) == pytest.approx(1.4142135623730951e20, rel=1e-7)


@pytest.mark.parametrize("magnitude", [1e200, 1e-200, 1e300, 1e-300])
def test_float64_extremes(magnitude: float) -> None:
    x = np.array([magnitude, magnitude], dtype=np.float64)
    assert l2_norm(x) == pytest.approx(SQRT2 * magnitude, rel=1e-14)
    assert accumulate([x[:1], x[1:]]).norm == pytest.approx(SQRT2 * magnitude, rel=1e-14)


def test_float64_subnormals() -> None:
    tiny = np.full(4, 5e-324)  # the smallest subnormal; its square is 0 in float64
    assert l2_norm(tiny) == 2 * 5e-324


def test_mixed_magnitudes_in_one_tensor_and_across_chunks() -> None:
    x = np.array([1e200, 1e-200, 3e200, 5.0, -1e-300])
    assert l2_norm(x) == pytest.approx(math.sqrt(10) * 1e200, rel=1e-14)
    acc = accumulate([np.array([1e-200]), np.array([3.0]), np.array([4.0]), np.array([1e-300])])
    assert acc.norm == pytest.approx(5.0, rel=1e-15)
    acc = accumulate([np.array([1e-200, 1e-200]), np.array([1e200])])
    assert acc.norm == pytest.approx(1e200, rel=1e-15)


def test_merging_partial_accumulators_matches_one_pass() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(10_000) * np.exp(rng.uniform(-300, 300, 10_000))
    whole = accumulate([x])
    merged = NormAccumulator()
    for piece in chunked(x, 333):
        merged.merge(accumulate([piece]))
    assert merged.norm == pytest.approx(whole.norm, rel=1e-13)
    assert merged.numel == x.size
    assert merged.max_abs == float(np.max(np.abs(x)))


def test_global_norm_neither_overflows_nor_underflows() -> None:
    assert global_norm([3e200, 4e200]) == pytest.approx(5e200, rel=1e-15)
    assert global_norm([3e-200, 4e-200]) == pytest.approx(5e-200, rel=1e-15)
    assert global_norm([3.0, 0.0, 4.0]) == 5.0
    assert global_norm([]) == 0.0


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.array([3.0, 4.0], dtype=ml_dtypes.bfloat16), 5.0),
        (np.array([448.0, 448.0], dtype=ml_dtypes.float8_e4m3fn), 448.0 * SQRT2),
        (np.array([57344.0, -57344.0], dtype=ml_dtypes.float8_e5m2), 57344.0 * SQRT2),
        (np.array([3 + 4j, 0j], dtype=np.complex64), 5.0),  # |z|^2, as DESIGN.md says
        (np.array([2**62, -(2**62)], dtype=np.int64), 2.0**62 * SQRT2),
        (np.array([255, 255, 255, 255], dtype=np.uint8), 510.0),
        (np.array([True, True, False, True]), math.sqrt(3)),
        (np.array(-7.5, dtype=np.float32), 7.5),
        (np.zeros((0, 3), dtype=np.float32), 0.0),
    ],
    ids=["bf16", "fp8-e4m3fn", "fp8-e5m2", "complex", "int64", "uint8", "bool", "scalar", "empty"],
)
def test_every_dtype(array: np.ndarray, expected: float) -> None:
    assert l2_norm(array) == pytest.approx(expected, rel=1e-15)


def test_nonfinite_values_are_counted() -> None:
    acc = accumulate([np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)])
    assert acc.nonfinite == 3
    assert math.isnan(acc.norm)
    acc = accumulate([np.array([np.inf, 3.0, 4.0], np.float64)])
    assert acc.nonfinite == 1
    assert acc.norm == math.inf


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_every_16_bit_pattern_measures_as_float64_does(dtype: Any) -> None:
    """All 65,536 values (subnormals, ±0, ±inf and NaNs included), one value per chunk and
    all together: the fast 16-bit paths (bit tricks, ml_dtypes casts) agree exactly with
    float64 arithmetic on the same values."""
    values = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)
    with np.errstate(invalid="ignore"):  # casting a signalling NaN
        wide = values.astype(np.float32).astype(np.float64)  # exact; NaN stays NaN
    finite = wide[np.isfinite(wide)]
    together = accumulate([values])
    one_by_one = accumulate(values[i : i + 1] for i in range(values.size))
    for acc in (together, one_by_one):
        assert acc.numel == 2**16
        assert acc.nonfinite == np.count_nonzero(~np.isfinite(wide))
        assert acc.nan_count == np.count_nonzero(np.isnan(wide))
        assert acc.max_abs == np.max(np.abs(finite))
        assert (acc.min_value, acc.max_value) == (-math.inf, math.inf)
        assert acc.finite_norm == pytest.approx(math.sqrt(math.fsum(finite**2)), rel=1e-12)
    # finite values only, chunk by chunk: every extreme and the norm exact
    for chunk in chunked(values[np.isfinite(wide)], 4096):
        expected = chunk.astype(np.float64)
        acc = accumulate([chunk])
        assert (acc.min_value, acc.max_value) == (expected.min(), expected.max())
        assert acc.norm == pytest.approx(math.sqrt(math.fsum(expected**2)), rel=1e-12)
        assert acc.nonfinite == 0


FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def all_float8(name: str) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name))


@pytest.mark.parametrize("name", FLOAT8)
def test_every_8_bit_float_measures_as_float64_does(name: str) -> None:
    """All 256 values (NaN included), widened through clipcli's lookup table."""
    values = all_float8(name)
    with np.errstate(invalid="ignore"):
        wide = values.astype(np.float32).astype(np.float64)
    finite = wide[np.isfinite(wide)]
    for acc in (accumulate([values]), accumulate(values[i : i + 1] for i in range(256))):
        assert acc.numel == 256
        assert acc.nan_count == np.count_nonzero(np.isnan(wide))
        assert acc.nonfinite == np.count_nonzero(~np.isfinite(wide))
        assert acc.max_abs == np.max(np.abs(finite))
        assert acc.finite_norm == pytest.approx(math.sqrt(math.fsum(finite**2)), rel=1e-15)


@pytest.mark.parametrize("name", FLOAT8)
def test_8_bit_float_clamp_by_table_keeps_bits(name: str) -> None:
    """Clamping looks 8-bit floats up in a 256-entry table: on a shuffled 2-D chunk the
    result must be the independent clamp's, bit for bit. (Scaling is checked against exact
    arithmetic below: test_8_bit_float_scaling_matches_exact_arithmetic.)"""
    dtype = np.dtype(getattr(ml_dtypes, name))
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, size=(37, 29), dtype=np.uint8).view(dtype)
    signed = name != "float8_e8m0fnu"
    for low, high in [(-0.5, 0.5), (-1e9, 1e9), (0.25, 2.0)] if signed else [(0.25, 4.0)]:
        lo, hi = rounding.value_bounds(dtype, low, high)
        expected = clamp_keeping_bits(chunk, lo, hi)
        got = rounding.clamp_chunk(chunk, lo, hi)
        assert got.dtype == dtype
        assert got.shape == chunk.shape
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_64m_float32_normals_within_1e_7() -> None:
    """64 Mi float32 normals, fed chunk by chunk as a reader would: relative error <= 1e-7
    against numpy's float64 norm (naive float32 accumulation drifts by ~1e-4 here)."""
    x = np.random.default_rng(0).standard_normal(64 * 2**20, dtype=np.float32)
    reference = float(np.linalg.norm(x.astype(np.float64)))
    acc = accumulate(chunked(x, 1 << 21))
    assert acc.numel == x.size
    assert acc.norm == pytest.approx(reference, rel=1e-7)


ALL_FLOAT16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
FLOAT16_BOUNDS = [
    (-1.0, 1.0),
    (0.0, 0.0),
    (-0.0, -0.0),
    (-0.0, 2.0),
    (-3.5, -0.0),
    (-math.inf, math.inf),
    (-math.inf, -math.inf),
    (math.inf, math.inf),
    (0.0, math.inf),
    (-65504.0, 65504.0),
    (6e-8, 1.2e-7),  # subnormals
    (-6e-8, 6e-8),
]


def clamp_keeping_bits(chunk: np.ndarray, lo: Any, hi: Any) -> np.ndarray:
    """The clamp clipcli promises (issue 10): only elements strictly below lo or above hi
    are replaced, by the bound; everything else (NaN payloads, -0.0 on a bound of 0) keeps
    its bits. np.clip rewrites NaN payloads of fp8/bf16 and picks either zero."""
    with np.errstate(invalid="ignore"):
        wide = chunk.astype(np.float32).astype(np.float64)
    out = chunk.copy()
    out[wide < float(lo)] = lo
    out[wide > float(hi)] = hi
    return out


@pytest.mark.parametrize(("low", "high"), FLOAT16_BOUNDS)
def test_float16_clamp_keeps_bits_within_bounds(low: float, high: float) -> None:
    """float16 is clamped through a lookup table (numpy compares float16 in software, 15x
    slower): every one of the 65,536 values, NaN payloads and the sign of zero included,
    comes out exactly as the independent clamp gives it (was np.clip, which replaces
    -0.0 by a +0.0 bound: issue 10 says a value within the bounds keeps its bits)."""
    lo, hi = np.asarray(low, np.float16), np.asarray(high, np.float16)
    expected = clamp_keeping_bits(ALL_FLOAT16, lo, hi)
    got = rounding.clamp_chunk(ALL_FLOAT16, lo, hi)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("scale", [0.3, 1e-3, 0.999, 2.0**-20, 1 - 2.0**-30, 0.01])
def test_float16_scaling_is_rounded_once(scale: float) -> None:
    """float16 is widened by moving bits; the result must be the exact product rounded once
    to float16, for every finite value (issue 10: it was a float32 product rounded again).
    numpy rounds float64 to float16 directly, and the product of a float16 and a factor
    of <= 42 significant bits is exact in float64."""
    scale = truncate_factor(scale, 42)
    finite = ALL_FLOAT16[np.isfinite(ALL_FLOAT16)]
    with np.errstate(under="ignore"):
        expected = (finite.astype(np.float64) * scale).astype(np.float16)
    got = rounding.scale_chunk(finite, scale)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def float32_patterns() -> np.ndarray:
    """3.1 million float32 values covering every sign and exponent (subnormal, normal, inf,
    NaN) with every float16-sized top of the mantissa, each with the low 13 bits float16
    rounding looks at set to 0, 1, just under, at and just over half, and all ones."""
    top = np.arange(1024, dtype=np.uint32) << 13
    low = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], dtype=np.uint32)
    mantissas = (top[:, None] | low[None, :]).reshape(-1)
    exponents = np.arange(256, dtype=np.uint32) << 23
    magnitudes = (exponents[:, None] | mantissas[None, :]).reshape(-1)
    return np.concatenate([magnitudes, magnitudes | np.uint32(0x80000000)]).view(np.float32)


def test_float32_to_float16_is_numpys_cast_bit_for_bit() -> None:
    """Ties to even, subnormals, overflow to inf and NaN payloads, as numpy rounds them
    (numpy takes 70 ns for each inexact subnormal; float16.from_float32 2.5 ns for any)."""
    values = float32_patterns()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float16)
    got = float16.from_float32(values)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_float16_widening_by_bits_is_exact_and_flags_nonfinite() -> None:
    finite = ALL_FLOAT16[np.isfinite(ALL_FLOAT16)]
    np.testing.assert_array_equal(
        float16.bits_as_float32(finite).view(np.uint32), finite.astype(np.float32).view(np.uint32)
    )
    assert float16.finite_as_float32(finite) is not None
    for bad in (np.inf, -np.inf, np.nan):
        assert float16.finite_as_float32(np.array([1.0, bad], np.float16)) is None


# ------------------------------------------------------------------ the same through the CLI


EXTREMES = {
    "fp16_300": (FP16_300, FP16_300_NORM, 1e-12),
    "f32_1e20": (np.array([1e20, 1e20], np.float32), 1.4142135623730951e20, 1e-7),
    "f64_1e200": (np.array([1e200, 1e200]), SQRT2 * 1e200, 1e-14),
    "f64_1e-200": (np.array([1e-200, 1e-200]), SQRT2 * 1e-200, 1e-14),
}


def test_norms_cli_exact_on_every_format(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    cli: Callable[..., Any],
) -> None:
    path = write_checkpoint(ckpt("extremes"), {k: v[0] for k, v in EXTREMES.items()})
    result = cli("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    report = result.json()
    rows = {row["name"]: row for row in report["tensors"]}
    for name, (_, expected, rel) in EXTREMES.items():
        assert rows[name]["norm"] == pytest.approx(expected, rel=rel), name
    assert report["global_norm"] == pytest.approx(SQRT2 * 1e200, rel=1e-14)


def test_clip_float16_where_tf_overflows(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Callable[..., Any],
    norm64: Callable[[np.ndarray], float],
) -> None:
    # TF: 300**2 overflows float16, the norm is inf and the clipped tensor becomes zeros.
    src = write_checkpoint(ckpt("in"), {"h": FP16_300})
    result = cli("clip", "--norm", "100", src, ckpt("out"), "--quiet")
    assert result.code == 0, result.stderr
    out = read_checkpoint(ckpt("out"))["h"]
    assert out.dtype == np.float16
    expected = 100 / math.sqrt(300)  # 5.7735...
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2 * 2.0**-10)
    assert 100 * (1 - 2.0**-9) <= norm64(out) <= 100


@pytest.mark.parametrize(
    ("x", "limit"),
    [
        (np.array([1e200, 1e200]), 1.0),
        (np.array([1e200, 1e200]), 1e199),
        (np.array([1e-200, 1e-200]), 1e-201),
        (np.array([1e20, 1e20], np.float32), 1.0),
    ],
    ids=["1e200-to-1", "1e200-to-1e199", "1e-200-to-1e-201", "f32-1e20-to-1"],
)
def test_clip_extremes(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Callable[..., Any],
    norm64: Callable[[np.ndarray], float],
    x: np.ndarray,
    limit: float,
) -> None:
    src = write_checkpoint(ckpt("in"), {"x": x})
    result = cli("clip", "--global", repr(limit), src, ckpt("out"), "--quiet")
    assert result.code == 0, result.stderr
    out = read_checkpoint(ckpt("out"))["x"]
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out, np.full(2, limit / SQRT2), rtol=1e-6)
    assert norm64(out) <= limit


# ------------------------------------------------------------------ an independent reference
#
# Every code of an 8- or 16-bit float decoded from its bits by hand (the layouts below, not
# ml_dtypes), scaled exactly (integers), and rounded to nearest, ties to the even code
# (e8m0's ties up, see reference_scaled), with clipcli's one documented departure: a dtype
# without zero (e8m0fnu) rounds a value below its smallest to that smallest, never to NaN.
# Shares no code with clipcli.numerics; it found e8m0 values just above 2**-127 rounded up
# (ml_dtypes on float32 subnormals) and positive values scaled by 2**-1000 written as NaN.


@dataclass(frozen=True)
class Layout:
    """A float format's bits: [sign] exponent mantissa. `nan` says where NaN lives:
    "ieee" (all-ones exponent: inf if the mantissa is 0), "all_ones" (the all-ones
    magnitude only; no inf), "negative_zero" (the code 0x80; no -0, no inf)."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    nan: str
    signed: bool = True
    subnormals: bool = True

    @property
    def width(self) -> int:
        return self.exponent_bits + self.mantissa_bits + int(self.signed)


LAYOUTS = {
    "float16": Layout(5, 10, 15, "ieee"),
    "bfloat16": Layout(8, 7, 127, "ieee"),
    "float8_e4m3fn": Layout(4, 3, 7, "all_ones"),
    "float8_e5m2": Layout(5, 2, 15, "ieee"),
    "float8_e4m3fnuz": Layout(4, 3, 8, "negative_zero"),
    "float8_e5m2fnuz": Layout(5, 2, 16, "negative_zero"),
    "float8_e8m0fnu": Layout(8, 0, 127, "all_ones", signed=False, subnormals=False),
}


def decode(layout: Layout, code: int) -> tuple[int, int, int] | None:
    """(sign, integer significand, power of two) of a code, or None for NaN and inf."""
    m, e = layout.mantissa_bits, layout.exponent_bits
    sign = (code >> (e + m)) & 1 if layout.signed else 0
    exponent = (code >> m) & ((1 << e) - 1)
    mantissa = code & ((1 << m) - 1)
    top = (1 << e) - 1
    if layout.nan == "ieee" and exponent == top:
        return None
    if layout.nan == "all_ones" and exponent == top and mantissa == (1 << m) - 1:
        return None
    if layout.nan == "negative_zero" and code == 1 << (e + m):
        return None
    if exponent == 0 and layout.subnormals:
        return sign, mantissa, 1 - layout.bias - m
    return sign, (1 << m) | mantissa, exponent - layout.bias - m


@dataclass(frozen=True)
class Magnitudes:
    """The finite non-negative values of a layout as integers in units of 2**-shift,
    ascending, with their codes."""

    shift: int
    units: list[int]
    codes: list[int]


def magnitudes(layout: Layout) -> Magnitudes:
    found = {}
    for code in range(1 << (layout.width - int(layout.signed))):  # sign bit clear
        parts = decode(layout, code)
        if parts is not None:
            found[code] = parts
    shift = -min(power for _, _, power in found.values())
    pairs = sorted((sig << (power + shift), code) for code, (_, sig, power) in found.items())
    return Magnitudes(shift, [u for u, _ in pairs], [c for _, c in pairs])


def reference_scaled(layout: Layout, factor: Fraction) -> list[int | None]:
    """For every code: the code of value * factor rounded once (None where the input is
    NaN or inf: the output must then be NaN, or the same infinity)."""
    table = magnitudes(layout)
    sign_bit = 1 << (layout.width - 1) if layout.signed else 0
    result: list[int | None] = []
    for code in range(1 << layout.width):
        parts = decode(layout, code)
        if parts is None:
            result.append(None)
            continue
        sign, sig, power = parts
        # |value * factor| in units of 2**-shift, as the fraction num / den (exact).
        num = sig * factor.numerator << max(0, power + table.shift)
        den = factor.denominator << max(0, -(power + table.shift))
        at = bisect.bisect_right(table.units, num // den)  # units[at - 1] <= value
        if at == 0:  # below the smallest (only a dtype without zero): to that smallest
            chosen = 0
        elif table.units[at - 1] * den == num or at == len(table.units):
            chosen = at - 1  # exact (no overflow: every factor here is below 1)
        else:
            low, high = table.units[at - 1], table.units[at]
            twice = 2 * num - (low + high) * den  # sign of value - midpoint
            if twice == 0 and layout.mantissa_bits == 0:
                # One-digit significands (e8m0): both neighbours are "odd", so ties to
                # even means nothing there; ml_dtypes rounds such ties up, and so do we.
                chosen = at
            elif twice == 0:
                chosen = at - 1 if table.codes[at - 1] % 2 == 0 else at
            else:
                chosen = at - 1 if twice < 0 else at
        out = table.codes[chosen]
        if sign and (table.units[chosen] != 0 or layout.nan != "negative_zero"):
            out |= sign_bit  # -0.0 stays -0.0 where the format has one
        result.append(out)
    return result


def few_bits(value: float, bits: int) -> float:
    """value truncated to `bits` significant bits, by hand: the factors clipcli hands out
    have few enough bits that value * factor is exact in float64 (rounded once)."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(math.floor(math.ldexp(mantissa, bits)), exponent - bits)


def check_scaling_against_reference(name: str, scale: float, exponent: int) -> None:
    layout = LAYOUTS[name]
    dtype = np.dtype(getattr(ml_dtypes, name) if name != "float16" else np.float16)
    uint = np.dtype(f"u{dtype.itemsize}")
    codes = np.arange(1 << layout.width, dtype=np.uint32).astype(uint)
    expected = reference_scaled(layout, Fraction(scale) * Fraction(2) ** exponent)
    rng = np.random.default_rng(13)
    order = rng.permutation(codes.size)  # shuffled, 2-D: the table lookup keeps positions
    chunk = codes[order].reshape(-1, 16).view(dtype)
    got = rounding.scale_chunk(chunk, scale, exponent)
    assert got.dtype == dtype
    assert got.shape == chunk.shape
    got_codes = got.view(uint).reshape(-1)
    with np.errstate(invalid="ignore"):
        given = chunk.astype(np.float32).reshape(-1)
        got_wide = got.astype(np.float32).reshape(-1)
    mismatches = []
    for position, code in enumerate(order.tolist()):
        want = expected[code]
        if want is None:  # NaN stays NaN, an infinity stays that infinity (factor > 0)
            if math.isnan(given[position]):
                ok = bool(math.isnan(got_wide[position]))
            else:
                ok = int(got_codes[position]) == code
        else:
            ok = int(got_codes[position]) == want
        if not ok:
            mismatches.append((hex(code), hex(int(got_codes[position])), want))
    assert not mismatches, mismatches[:10]


def test_hand_decoded_layouts_agree_with_ml_dtypes() -> None:
    """The reference's own check: every code decodes to the value numpy/ml_dtypes give."""
    for name, layout in LAYOUTS.items():
        dtype = np.dtype(getattr(ml_dtypes, name) if name != "float16" else np.float16)
        codes = np.arange(1 << layout.width, dtype=np.uint32).astype(f"u{dtype.itemsize}")
        with np.errstate(invalid="ignore"):
            wide = codes.view(dtype).astype(np.float32).astype(np.float64)
        for code in range(1 << layout.width):
            parts = decode(layout, code)
            if parts is None:
                assert not math.isfinite(wide[code]), (name, hex(code))
            else:
                sign, sig, power = parts
                assert wide[code] == (-1) ** sign * math.ldexp(sig, power), (name, hex(code))


FACTORS = [(0.3, 0), (0.999, 0), (0.75, -3), (0.5, -1000), (1 - 2.0**-30, 0), (2.0**-20, 0)]


@pytest.mark.parametrize("name", FLOAT8)
@pytest.mark.parametrize(("scale", "exponent"), FACTORS)
def test_8_bit_float_scaling_matches_exact_arithmetic(
    name: str, scale: float, exponent: int
) -> None:
    """Every one of the 256 codes, through the lookup table clipcli scales fp8 with, against
    the hand-decoded reference: exact product, rounded once to nearest even."""
    digits = LAYOUTS[name].mantissa_bits + 1
    check_scaling_against_reference(name, few_bits(scale, 53 - digits), exponent)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize(("scale", "exponent"), [(0.3, 0), (0.75, -3), (1 - 2.0**-30, 0)])
def test_16_bit_float_scaling_matches_exact_arithmetic(
    name: str, scale: float, exponent: int
) -> None:
    """Every one of the 65,536 codes (float16 through its table, bfloat16 through the
    round-to-odd path), against the hand-decoded reference."""
    digits = LAYOUTS[name].mantissa_bits + 1
    check_scaling_against_reference(name, few_bits(scale, 53 - digits), exponent)


# ------------------------------------------------------------------ the process around them

_COUNT_THREADS = """
import os, runpy, sys
sys.argv = ["clipcli", "ls", sys.argv[1]]
try:
    runpy.run_module("clipcli", run_name="__main__")
except SystemExit:
    pass
print(len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_entry_point_keeps_blas_to_one_thread(tmp_path: Path) -> None:
    """clipcli threads over chunks itself; BLAS threads on top only spin and contend (the
    float64 dot products of the norms ran 5x slower on a busy 2-core machine). BLAS reads
    its thread count once, when numpy loads, and the entry point imports numpy early, so
    the setting must come before that. OpenBLAS starts its threads at load: after a run
    with CLIPCLI_THREADS=1 the process holds its main thread alone."""
    path = tmp_path / "m.npz"
    np.savez(path, w=np.ones(3, np.float32))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env["CLIPCLI_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_THREADS, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "1"


# ------------------------------------------------------------------ the scale search


def _float16_sumsq(values: np.ndarray) -> Fraction:
    """The exact sum of squares of float16 values (integers in units of 2**-24)."""
    units = (values.astype(np.float64) * 2.0**24).astype(np.int64).tolist()
    return Fraction(sum(u * u for u in units), 2**48)


@pytest.mark.parametrize("seed", range(6))
def test_float16_factor_is_the_largest_that_fits(seed: int) -> None:
    """The search (histogram margins, narrowed once the answer is bracketed) returns the
    largest factor of 42 significant bits whose rounded output has norm <= C: checked with
    numpy's own float16 rounding of the exact product and exact integer sums. The next
    factor up must go over C, exactly (near-ties are decided exactly)."""
    rng = np.random.default_rng(100 + seed)
    size = int(rng.integers(5, 20_000))
    x = (rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 2)).astype(np.float16)
    stats = NormAccumulator(keep_histogram=True)
    stats.add(x)
    stats.finish()
    norm = math.sqrt(_float16_sumsq(x))
    for fraction in (0.3, 0.9, 0.999, 0.99999):
        limit = norm * fraction
        member = scaling.Member("t", x.dtype, x.size, stats)
        factor = scaling.group_factor([member], limit, _no_pass)
        assert factor is not None
        assert factor.exponent == 0
        s = factor.mantissa
        mantissa, exponent = math.frexp(s)
        assert math.ldexp(mantissa, 42) == int(math.ldexp(mantissa, 42))  # 42 bits at most
        bound = Fraction(limit) ** 2
        with np.errstate(under="ignore"):
            fits = _float16_sumsq((x.astype(np.float64) * s).astype(np.float16))
            after = s + math.ldexp(1.0, exponent - 42)
            over = _float16_sumsq((x.astype(np.float64) * after).astype(np.float16))
        assert fits <= bound
        assert over > bound


def _no_pass(which: Sequence[int], factor: scaling.Factor) -> CertainSumsq:
    """float16 members need no pass over the data: the histogram decides."""
    raise AssertionError(f"unexpected pass over {which} at {factor}")


# ------------------------------------------------------------------ the dtype layer


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dtype_facts_match_the_hand_decoded_layouts(name: str) -> None:
    """Every fact clipcli.dtypes gives about an 8/16-bit float, against the layouts above
    (written from the formats' definitions, not from ml_dtypes)."""
    layout = LAYOUTS[name]
    dtype = np.dtype(getattr(ml_dtypes, name) if name != "float16" else np.float16)
    assert dtypes.is_floating(dtype)
    assert dtypes.is_numeric(dtype)
    assert dtypes.is_small_float(dtype)
    assert dtypes.is_float8(dtype) == (layout.width == 8)
    assert dtypes.is_ml_float(dtype) == (name != "float16")
    assert dtypes.from_ml_dtypes(dtype) == (name != "float16")
    assert dtypes.is_bfloat16(dtype) == (name == "bfloat16")
    assert dtypes.mantissa_digits(dtype) == layout.mantissa_bits + 1
    assert dtypes.unit_roundoff(dtype) == 2.0 ** -(layout.mantissa_bits + 1)
    assert dtypes.has_infinity(dtype) == (layout.nan == "ieee")
    table = magnitudes(layout)
    smallest = math.ldexp(table.units[1 if table.units[0] == 0 else 0], -table.shift)
    assert dtypes.smallest_subnormal(dtype) == smallest
    has_zero = table.units[0] == 0
    assert dtypes.smallest_without_zero(dtype) == (None if has_zero else smallest)
    codes = dtypes.all_values(dtype).view(dtypes.bits_dtype(dtype))
    assert codes.tolist() == list(range(1 << layout.width))
    wide = dtypes.float64_values(dtype)
    for code in range(1 << layout.width):
        parts = decode(layout, code)
        if parts is not None:
            sign, sig, power = parts
            assert wide[code] == (-1) ** sign * math.ldexp(sig, power), hex(code)


@pytest.mark.parametrize(
    ("dtype", "numeric", "floating"),
    [
        (np.dtype(np.int8), True, False),
        (np.dtype(np.uint64), True, False),
        (np.dtype(np.bool_), True, False),
        (np.dtype(np.float32), True, True),
        (np.dtype(np.float64), True, True),
        (np.dtype(np.complex64), True, True),
        (np.dtype(np.complex128), True, True),
        (np.dtype(ml_dtypes.int4), False, False),
        (np.dtype("V4"), False, False),
        (np.dtype("S3"), False, False),
    ],
)
def test_dtype_facts_of_wider_and_non_float_types(
    dtype: np.dtype[Any], numeric: bool, floating: bool
) -> None:
    assert dtypes.is_numeric(dtype) == numeric
    assert dtypes.is_floating(dtype) == floating
    assert not dtypes.is_ml_float(dtype)
    assert not dtypes.is_small_float(dtype)
    assert dtypes.from_ml_dtypes(dtype) == (dtype == np.dtype(ml_dtypes.int4))
    if dtype.kind == "c":
        real = np.dtype(np.float32 if dtype.itemsize == 8 else np.float64)
        assert dtypes.real_dtype(dtype) == real
        assert dtypes.mantissa_digits(dtype) == (24 if real == np.float32 else 53)
    if not floating:
        assert dtypes.unit_roundoff(dtype) == 0.0
        assert dtypes.smallest_subnormal(dtype) == 0.0
