"""`clipcli diff` computes every difference exactly before rounding it once (issue 18 item 4).

int64/uint64 values beyond 2**53 used to be widened to float64 first, so 2**60 and 2**60 + 1
compared equal: "changed" with max |A−B| = 0, and `diff --fail-above 0` exited 0. The
references here share no code with clipcli: Python integers and fractions.Fraction for the
exact differences, the official safetensors / numpy writers for the files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.numerics.difference import difference

Cli = Callable[..., Any]
EXACT = 2**53


def exact_values(array: np.ndarray) -> list[Fraction]:
    """Each element as an exact rational (ints through Python ints, floats as they are)."""
    flat = array.reshape(-1)
    if flat.dtype.kind in "iub":
        return [Fraction(int(v)) for v in flat.tolist()]
    return [Fraction(float(v)) for v in flat.astype(np.float64).tolist()]


def reference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |A−B|, ‖A−B‖) from exact differences: the max rounded once, the norm's square
    exact before its one square root."""
    diffs = [x - y for x, y in zip(exact_values(a), exact_values(b), strict=True)]
    largest = max((abs(d) for d in diffs), default=Fraction(0))
    sumsq = sum((d * d for d in diffs), Fraction(0))
    return float(largest), sqrt_of(sumsq)


def sqrt_of(value: Fraction) -> float:
    """sqrt of an exact rational of any size (float64 would overflow or underflow its
    square), to about 1e-16 relative: an integer square root of ~106 bits, then scaled."""
    if value == 0:
        return 0.0
    k = (110 - (value.numerator.bit_length() - value.denominator.bit_length())) // 2
    scaled = value * Fraction(4) ** k
    return math.ldexp(float(math.isqrt(scaled.numerator // scaled.denominator)), -k)


def diff_json(
    cli: Cli, tmp_path: Path, a: dict[str, np.ndarray], b: dict[str, np.ndarray], *args: str
) -> tuple[int, dict[str, Any]]:
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(a, str(pa))
    save_file(b, str(pb))
    result = cli("diff", str(pa), str(pb), "--format", "json", *args)
    return result.code, result.json()


def row(report: dict[str, Any], name: str = "t") -> dict[str, Any]:
    found: list[dict[str, Any]] = [t for t in report["tensors"] if t["name"] == name]
    assert len(found) == 1
    return found[0]


# ------------------------------------------------------------------ through the CLI


def test_int64_change_of_one_beyond_2_53_is_seen(cli: Cli, tmp_path: Path) -> None:
    a = np.array([2**60, -(2**62), 2**63 - 2, 7], np.int64)
    b = a.copy()
    b[0] += 1  # 2**60 + 1: float64 rounds it back to 2**60
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": b}, "--fail-above", "0")
    assert code == 1
    t = row(report)
    assert t["status"] == "changed"
    assert t["max_abs_diff"] == 1.0
    assert t["diff_norm"] == 1.0
    assert t["rel_change"] > 0


@pytest.mark.parametrize(
    ("low", "high"),
    [(EXACT - 1, EXACT), (EXACT, EXACT + 1), (-EXACT, -EXACT + 1), (-EXACT - 1, -EXACT)],
    ids=["at-2**53", "past-2**53", "at--2**53", "past--2**53"],
)
def test_int64_at_and_past_2_53(cli: Cli, tmp_path: Path, low: int, high: int) -> None:
    # At the limit float64 holds both values; one step past it, no longer both.
    assert (float(low) == float(high)) is (EXACT + 1 in (low, high) or -EXACT - 1 in (low, high))
    a, b = np.array([low], np.int64), np.array([high], np.int64)
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": b}, "--fail-above", "0")
    assert code == 1
    assert (row(report)["max_abs_diff"], row(report)["diff_norm"]) == (1.0, 1.0)


def test_identical_int64_passes_fail_above_zero(cli: Cli, tmp_path: Path) -> None:
    a = np.array([2**60 + 1, -(2**63), 2**63 - 1], np.int64)
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": a.copy()}, "--fail-above", "0")
    assert code == 0
    assert row(report)["status"] == "same"


def test_uint64_against_int64_and_extremes(cli: Cli, tmp_path: Path) -> None:
    # uint64 2**64 - 1 against int64 -2**63: a difference of 3 * 2**63 - 1, beyond both
    # types; and small differences of values beyond 2**53 in a tensor of their own.
    a = {
        "wide": np.array([2**64 - 1, 2**63, 0], np.uint64),
        "near": np.array([2**53 + 1, 2**60 + 3], np.uint64),
    }
    b = {
        "wide": np.array([-(2**63), 2**63 - 1, 1], np.int64),
        "near": np.array([2**53, 2**60], np.int64),
    }
    code, report = diff_json(cli, tmp_path, a, b, "--fail-above", "0")
    assert code == 1
    for name in a:
        t = row(report, name)
        assert t["status"] == "dtype changed"
        largest, norm = reference(a[name], b[name])
        assert t["max_abs_diff"] == largest
        assert t["diff_norm"] == pytest.approx(norm, rel=1e-15)
    assert row(report, "near")["max_abs_diff"] == 3.0


def test_int64_against_float64_of_the_same_values(cli: Cli, tmp_path: Path) -> None:
    # int64 written as float64 by another tool: 2**60 + 1 became 2**60, a real change of 1.
    a = np.array([2**60 + 1, 3, 2**62 + 2**40 + 5, -(2**55) - 3], np.int64)
    b = a.astype(np.float64)
    _, report = diff_json(cli, tmp_path, {"t": a}, {"t": b})
    t = row(report)
    largest, norm = reference(a, b)
    assert largest == 5.0
    assert t["max_abs_diff"] == largest
    assert t["diff_norm"] == pytest.approx(norm, rel=1e-15)


def test_bool_and_narrow_integers_against_int64(cli: Cli, tmp_path: Path) -> None:
    # True − (2**53 + 3) = -(2**53 + 2); -2 − (2**53 + 1) = -(2**53 + 3), a tie rounding to
    # -(2**53 + 4). Widened first, both came out 2 short.
    a = {
        "m": np.array([True, False]),
        "i": np.array([-2, 5], np.int32),
        "w": np.array([-(2**31), 2**31 - 1], np.int32),
    }
    b = {
        "m": np.array([2**53 + 3, 0], np.int64),
        "i": np.array([2**53 + 1, 5], np.int64),
        "w": np.array([2**62, -(2**62)], np.int64),
    }
    _, report = diff_json(cli, tmp_path, a, b)
    for name in a:
        largest, norm = reference(a[name], b[name])
        assert row(report, name)["max_abs_diff"] == largest
        assert row(report, name)["diff_norm"] == pytest.approx(norm, rel=1e-15)
    assert row(report, "i")["max_abs_diff"] == float(2**53 + 4)


def test_float64_one_ulp_change_is_seen_at_every_scale(cli: Cli, tmp_path: Path) -> None:
    a = np.array([1.0, 1e300, 5e-324, 2.0**-1022])
    b = np.nextafter(a, np.inf)
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": b}, "--fail-above", "0")
    assert code == 1
    largest, norm = reference(a, b)
    assert row(report)["max_abs_diff"] == largest
    assert row(report)["diff_norm"] == pytest.approx(norm, rel=1e-15)


def test_a_change_below_float64s_relative_range_is_not_zero(cli: Cli, tmp_path: Path) -> None:
    # ‖A−B‖/‖A‖ = 5e-324 / 1e300 underflows float64: it used to be reported as 0.
    a = np.array([1e300, 0.0])
    b = np.array([1e300, 5e-324])
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": b}, "--fail-above", "0")
    assert code == 1
    assert row(report)["rel_change"] == 5e-324
    assert report["max_rel_change"] == 5e-324
    assert report["global_rel_change"] == 5e-324
    same = diff_json(cli, tmp_path, {"t": a}, {"t": a.copy()}, "--fail-above", "0")
    assert same[0] == 0


def test_relative_change_of_differences_beyond_float64(cli: Cli, tmp_path: Path) -> None:
    # 1.5e308 − −1.5e308 overflows float64, but ‖A−B‖/‖A‖ is exactly 2.
    a = np.array([1.5e308, 0.0])
    b = np.array([-1.5e308, 0.0])
    _, report = diff_json(cli, tmp_path, {"t": a}, {"t": b})
    t = row(report)
    assert t["rel_change"] == 2.0
    assert t["max_abs_diff"] is None  # 3e308: beyond float64, JSON null as every inf
    # two such elements: ‖A‖ itself overflows float64, the ratio still does not
    a2, b2 = np.array([1.5e308, 1.5e308]), np.array([-1.5e308, 1.5e308])
    _, report = diff_json(cli, tmp_path, {"t": a2}, {"t": b2})
    assert row(report)["rel_change"] == pytest.approx(math.sqrt(2), rel=1e-15)


def test_change_next_to_an_unchanged_infinity_fails_the_threshold(cli: Cli, tmp_path: Path) -> None:
    # ‖A‖ is inf: change / inf used to be 0 and --fail-above 0 passed a changed tensor.
    a = np.array([np.inf, 1.0])
    b = np.array([np.inf, 2.0])
    code, report = diff_json(cli, tmp_path, {"t": a}, {"t": b}, "--fail-above", "1e300")
    assert code == 1
    assert row(report)["rel_change"] is None or math.isnan(row(report)["rel_change"])
    assert row(report)["diff_norm"] == 1.0
    code, _ = diff_json(cli, tmp_path, {"t": a}, {"t": a.copy()}, "--fail-above", "0")
    assert code == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_narrow_floats_against_int64(cli: Cli, tmp_path: Path, dtype: Any) -> None:
    rng = np.random.default_rng(7)
    a = (rng.integers(-(2**63), 2**63 - 1, 64, dtype=np.int64) >> rng.integers(0, 60, 64)).astype(
        np.int64
    )
    b = rng.standard_normal(64).astype(dtype) * np.asarray(1000, dtype)
    _, report = diff_json(cli, tmp_path, {"t": a}, {"t": b})
    largest, norm = reference(a, b)
    assert row(report)["max_abs_diff"] == largest
    assert row(report)["diff_norm"] == pytest.approx(norm, rel=1e-15)


def test_complex_against_int64(cli: Cli, tmp_path: Path) -> None:
    pa, pb = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(pa, t=np.array([2**60 + 1, 2**62], np.int64))
    np.savez(pb, t=np.array([2**60 + 0j, 2**62 + 3j], np.complex128))
    code = cli("diff", str(pa), str(pb), "--format", "json")
    t = row(code.json())
    assert t["max_abs_diff"] == 3.0  # |0 - 3i|; the real parts differ by 1 and 0
    assert t["diff_norm"] == pytest.approx(math.sqrt(10), rel=1e-15)


# ------------------------------------------------------------------ the arithmetic itself


def assert_correctly_rounded(a: np.ndarray, b: np.ndarray) -> None:
    d, shift = difference(a, b)
    assert shift == 0
    for x, y, got in zip(exact_values(a), exact_values(b), d.tolist(), strict=True):
        assert got == float(x - y), (x, y, got)  # Fraction -> float rounds once, to nearest


def int64_samples() -> np.ndarray:
    rng = np.random.default_rng(11)
    edges = [2**63 - 1, -(2**63), EXACT, EXACT + 1, -EXACT, -EXACT - 1, EXACT + 3, 0, 1, -1]
    wide = rng.integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)
    near = rng.integers(-(2**55), 2**55, 200, dtype=np.int64)
    return np.concatenate([np.array(edges, np.int64), wide, near])


def test_integer_pairs_are_correctly_rounded() -> None:
    signed = int64_samples()
    unsigned = signed.view(np.uint64)
    for a in (signed, unsigned):
        for b in (signed, unsigned, signed[::-1].copy(), unsigned[::-1].copy()):
            assert_correctly_rounded(a, b)
        assert_correctly_rounded(a, (signed >> 33).astype(np.int32))
        assert_correctly_rounded(a, signed % 2 == 0)


def test_integer_against_float_pairs_are_correctly_rounded() -> None:
    signed = int64_samples()
    rng = np.random.default_rng(3)
    for a in (signed, signed.view(np.uint64)):
        as_float = a.astype(np.float64)
        fractions = rng.choice([0.5, -0.5, 0.25, 0.75, -0.999, 1e-300, 1.5, 2.5], a.size)
        for b in (
            as_float,
            as_float + fractions,  # the integer's neighbours, ties included
            rng.uniform(-(2.0**52), 2.0**52, a.size),  # fractions below 2**52
            as_float * 2.0**30,  # up to 2**93: through the integer parts and Python ints
            as_float * 2.0**60,  # up to 2**123: a float that dominates any 64-bit integer
            np.where(rng.random(a.size) < 0.5, np.inf, np.nan),
        ):
            with np.errstate(invalid="ignore"):
                d, _ = difference(a, b)
                d_back, _ = difference(b, a)
            finite = np.isfinite(b)
            expected = [
                float(x - Fraction(y))
                for x, y in zip(exact_values(a[finite]), b[finite].tolist(), strict=True)
            ]
            assert d[finite].tolist() == expected
            assert (-d_back[finite]).tolist() == expected
            np.testing.assert_equal(d[~finite], a[~finite].astype(np.float64) - b[~finite])


@pytest.mark.parametrize(
    "magnitude",
    [2.0**90 - 2.0**37, 2.0**90, 2.0**118 - 2.0**65, 2.0**118],
    ids=["below-2**90", "2**90", "below-2**118", "2**118"],
)
def test_the_float_magnitude_limits(magnitude: float) -> None:
    # Each limit between the three ways (integer parts, Python integers, f dominates):
    # exactly at it and one float64 step below, against integers that decide the rounding.
    ints = np.array([2**63 - 1, -(2**63), 2**62 + 1, EXACT + 1, -(2**60) - 1], np.int64)
    for sign in (1.0, -1.0):
        floats = np.full(ints.size, sign * magnitude)
        assert_correctly_rounded(ints, floats)
        assert_correctly_rounded(ints.view(np.uint64), floats)


def test_tie_cases_of_an_integer_minus_a_fraction() -> None:
    # D − f where D is the integer difference: ties and near-ties on both sides of 2**53.
    for d in (EXACT - 1, EXACT, EXACT + 1, EXACT + 2, EXACT + 3, 2**54 + 2, -EXACT - 1, -EXACT):
        for fraction in (0.5, -0.5, 0.25, -0.25, 2.0**-40, -(2.0**-40)):
            a = np.array([d + 1000], np.int64)
            b = np.array([1000 + fraction])
            assert_correctly_rounded(a, b)


def test_finite_differences_beyond_float64_come_back_halved() -> None:
    a, b = np.array([1.5e308, 1.0, 3.0]), np.array([-1.5e308, 0.5, 3.0])
    d, shift = difference(a, b)
    assert shift == 1
    assert d.tolist() == [1.5e308, 0.25, 0.0]


@pytest.mark.parametrize(
    ("a_bits", "b_bits"),
    [
        ([0x00000000, 0x3F800000], [0x80000000, 0x3F800000]),  # 0.0 against -0.0
        ([0x7FC00001, 0x3F800000], [0x7FC00002, 0x3F800000]),  # NaN payloads
    ],
)
def test_bits_no_value_shows_fail_above_zero(
    tmp_path: Path, a_bits: list[int], b_bits: list[int]
) -> None:
    """`changed` by its bits alone: the smallest relative change, so `--fail-above 0` exits 1
    and any positive threshold still passes (found by the attack on issue 18)."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"t": np.array(a_bits, np.uint32).view(np.float32)}, str(a))
    save_file({"t": np.array(b_bits, np.uint32).view(np.float32)}, str(b))
    from clipcli.cli.entry import main

    assert main(["diff", str(a), str(b), "--fail-above", "0"]) == 1
    assert main(["diff", str(a), str(b), "--fail-above", "1e-300"]) == 0
