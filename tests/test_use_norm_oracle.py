"""`clip --global C --use-norm N` applies C / N as given, each value rounded once
(issue 18 item 16).

In a checkpoint that mixed float64 with narrower floats, the factor used to be cut to the
bits that keep a float32 product exact (29), so float64 tensors came out up to ~1.8e7 ulps
away from x·C/N. docs/NUMERICS.md promises: the factor is C / N rounded once to 53 significant
bits (float64's C / N wherever that is a normal float64), and every element is rounded
once, to nearest with ties to even, from the exact product x·factor.

The oracle shares no code with clipcli: the factor and every product are
fractions.Fraction, rounded by the integer arithmetic below; files are written and read
with the official safetensors reader (bfloat16 by hand, as conftest does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from expect import one_error_line
from handmade import write_safetensors

from clipcli.cli.entry import main
from clipcli.numerics.rounding import scale_chunk

Cli = Callable[..., Any]

# (significant bits, smallest normal exponent) of each binary float format.
FORMATS: dict[str, tuple[int, int]] = {
    "float64": (53, -1022),
    "float32": (24, -126),
    "float16": (11, -14),
    "bfloat16": (8, -126),
}
DTYPES = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def round_to(value: Fraction, bits: int, min_exp: int) -> Fraction:
    """value rounded to nearest, ties to even, in a binary format with `bits` significant
    bits and smallest normal exponent `min_exp` (subnormals below it; no overflow here)."""
    if value == 0:
        return Fraction(0)
    magnitude = abs(value)
    exp = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exp > magnitude:
        exp -= 1  # now 2**exp <= magnitude < 2**(exp + 1)
    quantum = Fraction(2) ** (max(exp, min_exp) - bits + 1)
    units, rest = divmod(magnitude, quantum)
    if rest * 2 > quantum or (rest * 2 == quantum and units % 2 == 1):
        units += 1
    rounded = units * quantum
    return rounded if value > 0 else -rounded


def as_dtype(value: Fraction, negative: bool, dtype: np.dtype) -> np.ndarray:
    """The representable value `value` as a 0-d array of dtype (sign kept for zeros)."""
    wide = float(value)  # exact: the value has at most 53 bits within float64's range
    if value == 0 and negative:
        wide = -0.0
    return np.asarray(wide).astype(dtype)  # exact: representable in dtype


def given_factor(limit: float, use_norm: float) -> Fraction:
    """C / N rounded once to 53 significant bits (no exponent limit)."""
    return round_to(Fraction(limit) / Fraction(use_norm), 53, -(10**6))


def expected_output(x: np.ndarray, factor: Fraction) -> np.ndarray:
    bits, min_exp = FORMATS[x.dtype.name]
    out = np.empty(x.shape, x.dtype)
    flat_out = out.reshape(-1)
    for i, v in enumerate(x.reshape(-1).astype(np.float64).tolist()):
        rounded = round_to(Fraction(v) * factor, bits, min_exp)
        flat_out[i] = as_dtype(rounded, math.copysign(1.0, v) < 0, x.dtype)
    return out


def bits_of(array: np.ndarray) -> list[int]:
    unsigned = {8: np.uint64, 4: np.uint32, 2: np.uint16}[array.dtype.itemsize]
    return [int(b) for b in array.reshape(-1).view(unsigned)]


def mixed_checkpoint(
    rng: np.random.Generator, scale: float, extremes: bool = True
) -> dict[str, np.ndarray]:
    """One tensor of each dtype, the same values rounded to each; what float16 cannot
    hold is 1. With extremes, float64 also holds 1e-300, -2**-1070 and 1.7e308."""
    n = 160
    spread = np.exp(rng.uniform(-6, 6, n))  # magnitudes over ~5 decades
    values = rng.standard_normal(n) * spread * scale
    with np.errstate(over="ignore"):  # beyond float16's range: inf, replaced below
        tensors = {name: values.astype(DTYPES[name]) for name in DTYPES}
    for array in tensors.values():
        array[~np.isfinite(array.astype(np.float32))] = 1
    # values whose products land on ties and subnormals in the narrow dtypes
    tensors["float16"][:4] = np.array([6.0e-5, -6.1e-5, 2.0**-24, 65504.0], np.float16)
    if extremes:
        tensors["float64"][:3] = [1e-300, -(2.0**-1070), 1.7e308]
    return tensors


CASES = [
    # (seed, C, N, scale of the values)
    (0, 1.0, 37.3, 1.0),
    (1, 0.7, 1.0000001, 3.0),
    (2, 3.3e-3, 91.7, 100.0),
    (3, 2.5, 1e30, 1e20),  # factor 2.5e-30: products deep in float32's subnormals
    (4, 1e-300, 1e10, 1e6),  # factor 1e-310: float64 outputs on the subnormal grid
    (5, 1e-200, 1e200, 1e30),  # factor 1e-400: below float64, carried as 2**exponent
]


@pytest.mark.parametrize(("seed", "limit", "use_norm", "scale"), CASES)
def test_every_element_is_x_times_c_over_n_rounded_once(
    cli: Cli,
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    seed: int,
    limit: float,
    use_norm: float,
    scale: float,
) -> None:
    rng = np.random.default_rng([seed, 18, 16])
    tensors = mixed_checkpoint(rng, scale)
    src = write_checkpoint(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    args = ["--global", repr(limit), "--use-norm", repr(use_norm), "--format", "json"]
    result = cli("clip", *args, str(src), str(out))
    assert result.code == 0, result.stderr
    factor = given_factor(limit, use_norm)
    if float(factor) >= 2.0**-1022:
        assert float(factor) == limit / use_norm  # the factor is float64's C / N
    for row in json.loads(result.stdout)["tensors"]:
        assert row["scale"] == float(factor)
    written = read_checkpoint(out)
    for name, x in tensors.items():
        assert written[name].dtype == x.dtype
        expected = expected_output(x, factor)
        assert bits_of(written[name]) == bits_of(expected), name


def test_use_norm_at_and_below_the_limit_changes_nothing(
    cli: Cli,
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
) -> None:
    # C / max(N, C): N == C is a factor of 1 (nothing to do), N a hair above C scales.
    tensors = mixed_checkpoint(np.random.default_rng(9), 1.0)
    src = write_checkpoint(tmp_path / "in.safetensors", tensors)
    for use_norm, changes in ((2.0, False), (math.nextafter(2.0, 3.0), True)):
        out = tmp_path / f"out{changes}.safetensors"
        result = cli("clip", "--global", "2", "--use-norm", repr(use_norm), str(src), str(out))
        assert result.code == 0, result.stderr
        written = read_checkpoint(out)
        factor = given_factor(2.0, use_norm)
        for name, x in tensors.items():
            expected = expected_output(x, factor) if changes else x
            assert bits_of(written[name]) == bits_of(expected), name


def test_global_without_use_norm_stays_within_the_limit(
    cli: Cli,
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
) -> None:
    # The searched factor (not C / N) still rounds once and keeps the promise: the exact
    # norm of the written values is <= C.
    # (No 1.7e308: its factor, below 1e-308, would be reported with fewer bits than it has.)
    tensors = mixed_checkpoint(np.random.default_rng(4), 1.0, extremes=False)
    src = write_checkpoint(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    limit = 3.0
    result = cli("clip", "--global", repr(limit), "--format", "json", str(src), str(out))
    assert result.code == 0, result.stderr
    (scale,) = {row["scale"] for row in json.loads(result.stdout)["tensors"]}
    written = read_checkpoint(out)
    total = Fraction(0)
    for name, x in tensors.items():
        expected = expected_output(x, Fraction(scale))
        assert bits_of(written[name]) == bits_of(expected), name
        total += sum(Fraction(v) ** 2 for v in written[name].astype(np.float64).tolist())
    assert total <= Fraction(limit) ** 2
    assert total >= Fraction(limit * 0.999) ** 2


# ------------------------------------------------------------------ the rounding itself


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_every_16_bit_pattern_scaled_by_a_53_bit_factor(name: str) -> None:
    dtype = DTYPES[name]
    x = np.arange(2**16, dtype=np.uint16).view(dtype)
    x = x[np.isfinite(x.astype(np.float32))]
    factor = given_factor(1.0, 3.0000000000000004)  # 0x3FD5555555555554: all 53 bits used
    assert Fraction(float(factor)).limit_denominator(2**60).denominator.bit_length() > 40
    got = scale_chunk(x, float(factor))
    assert bits_of(got) == bits_of(expected_output(x, factor))


def test_float32_and_float64_extremes_scaled_by_a_53_bit_factor() -> None:
    rng = np.random.default_rng(5)
    f32 = np.concatenate(
        [
            np.array([3.4028235e38, -1.4e-45, 1.1754944e-38, 1.0, -0.0], np.float32),
            (rng.standard_normal(400) * np.exp(rng.uniform(-80, 80, 400))).astype(np.float32),
        ]
    )
    f64 = np.concatenate(
        [
            np.array([1.7976931348623157e308, -5e-324, 2.0**-1022, 1.0, -0.0]),
            rng.standard_normal(400) * np.exp(rng.uniform(-690, 690, 400)),
        ]
    )
    for limit, use_norm in ((1.0, 3.0000000000000004), (1e-300, 3e10), (1e-200, 7e200)):
        factor = given_factor(limit, use_norm)
        # the factor as mantissa * 2**exponent, as the plan carries it
        exponent = factor.numerator.bit_length() - factor.denominator.bit_length()
        mantissa = float(factor / Fraction(2) ** exponent)
        for x in (f32, f64):
            got = scale_chunk(x, mantissa, exponent)
            assert bits_of(got) == bits_of(expected_output(x, factor)), (limit, x.dtype)


def double_rounding_factors(bits: int) -> list[float]:
    """53-bit factors m for which 3 * m rounded to float64 first lands exactly on a
    midpoint of a `bits`-bit format while the exact 3 * m does not, on the side that
    ties-to-even does not take: rounding twice gives the wrong neighbour."""
    found = []
    for k in range(1, 400):
        midpoint = 1 + Fraction(2 * k - 1, 2**bits)
        m = float(midpoint / 3)
        exact = 3 * Fraction(m)
        lands_on_midpoint = exact != midpoint and Fraction(float(exact)) == midpoint
        if lands_on_midpoint and round_to(exact, bits, -126) != round_to(midpoint, bits, -126):
            found.append(m)
    return found


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_no_double_rounding_through_float64(name: str) -> None:
    dtype = DTYPES[name]
    bits = FORMATS[name][0]
    factors = double_rounding_factors(bits)
    assert len(factors) >= 5
    x = np.array([3.0, -3.0], dtype)
    for m in factors:
        assert bits_of(scale_chunk(x, m)) == bits_of(expected_output(x, Fraction(m))), m


def test_float64_subnormal_results_round_once() -> None:
    # (2**52 + 2) * (1 - 2**-53) is 2**52 + 1.5 - 2**-52: float64 rounds it to 2**52 + 1,
    # which at 2**-1075 is a tie on the subnormal grid; the exact product is below it.
    x = np.array([2.0**52 + 2, -(2.0**52 + 2), -(2.0**-1074)])
    mantissa, exponent = 1 - 2.0**-53, -1075
    factor = Fraction(mantissa) * Fraction(2) ** exponent
    got = scale_chunk(x, mantissa, exponent)
    assert bits_of(got) == bits_of(expected_output(x, factor))
    assert got[0] == (2.0**51 + 1) * 2.0**-1074
    assert math.copysign(1.0, got[2]) == -1.0  # -0.0 keeps its sign


def test_use_norm_inf_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.array([3.0, 4.0], np.float32)})
    argv = ["clip", "--global", "1", "--use-norm", "inf", str(src), str(tmp_path / "o.npz")]
    assert main(argv) == 2
    assert "--use-norm must be finite" in one_error_line(capsys.readouterr().err)
