"""narrow_round on the float64's bits (rounding._to_bfloat16, and float16 block by block) against a
rounding written from the definition (exact fractions, ties to even), and against the
float32-to-odd path it replaced, on the values where such code goes wrong: ties and their
neighbours, the carry into the next binade, the largest finite value and the step past
it, bfloat16's smallest normal and the subnormals below it, zeros, infinities and NaNs
whose payload sits only in the bits that are cut."""

import math
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from clipcli.dtypes import float64_values
from clipcli.numerics import rounding
from clipcli.numerics.widening import widen

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference(x: float) -> float:
    """x rounded to bfloat16 (8 significant bits, exponents down to 2**-133), from the
    definition."""
    if math.isnan(x) or math.isinf(x) or x == 0:
        return x
    _, e = math.frexp(x)  # |x| = m * 2**e, 0.5 <= m < 1
    quantum = max(e - 8, -133)
    steps = round(Fraction(x) / Fraction(2) ** quantum)  # ties to even
    value = Fraction(steps) * Fraction(2) ** quantum
    if abs(value) >= 2**128:
        return math.copysign(math.inf, x)
    if value == 0:
        return math.copysign(0.0, x)
    return float(value)


def edge_values() -> np.ndarray:
    rng = np.random.default_rng(20261128)
    steps = rng.integers(0, 0x7F80, 3000, dtype=np.uint32)  # positive finite bfloat16 codes
    values = (steps << np.uint32(16)).view(np.float32).astype(np.float64)
    above = (steps + 1).astype(np.uint32) << np.uint32(16)
    nexts = above.view(np.float32).astype(np.float64)  # the last is inf: no tie above it
    values, nexts = values[nexts < np.inf], nexts[nexts < np.inf]
    ties = (values + nexts) / 2  # exactly halfway (exact in float64)
    near = [ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), values, nexts]
    spread = np.ldexp(rng.random(3000) + 0.5, rng.integers(-150, 131, 3000))
    specials = [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        2.0**-126,
        np.nextafter(2.0**-126, 0),
        2.0**-133,
        2.0**-134,
        np.nextafter(2.0**-134, 1),
        2.0**-135,
        1.5 * 2.0**-134,
        5e-324,
        2.0**128 - 2.0**120,
        2.0**128 - 2.0**119,
        np.nextafter(2.0**128 - 2.0**119, 0),
        2.0**128,
        1.7976931348623157e308,
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        (1.0 + 2.0**-8) * (1 + 2.0**-52),
        2.0 - 2.0**-8,
        np.nextafter(2.0 - 2.0**-8, 0),
    ]
    out = np.concatenate(near + [spread, np.asarray(specials, np.float64)])
    return np.concatenate([out, -out])


def test_bits_match_the_definition_at_every_edge() -> None:
    values = edge_values()
    got = rounding.narrow_round(values, BF16).astype(np.float64)
    want = np.asarray([reference(float(x)) for x in values])
    assert np.array_equal(got, want, equal_nan=True)
    # Zeros keep their sign, bit for bit.
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_nan_stays_nan_whatever_its_payload() -> None:
    payloads = np.asarray(
        [
            0x7FF0_0000_0000_0001,
            0x7FF0_0000_1000_0000,
            0x7FF8_0000_0000_0000,
            0xFFF0_0000_0000_0001,
            0x7FFF_FFFF_FFFF_FFFF,
        ],
        np.uint64,
    ).view(np.float64)
    got = rounding.narrow_round(payloads, BF16).astype(np.float32)
    assert np.isnan(got).all()


@pytest.mark.parametrize("seed", range(3))
def test_bits_match_the_float32_path_on_any_bits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(np.uint64).max, 1 << 18, dtype=np.uint64, endpoint=True)
    values = bits.view(np.float64)
    near = np.ldexp(rng.random(1 << 18), rng.integers(-140, 132, 1 << 18))
    for wide in (values, near, near.reshape(512, 512)[:, ::3]):
        got = rounding.narrow_round(wide, BF16)
        want = rounding._through_float32(wide, BF16)
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_empty_and_zero_dimensional() -> None:
    assert rounding.narrow_round(np.zeros(0), BF16).shape == (0,)
    one = rounding.narrow_round(np.asarray(1.00390625), BF16)
    assert one.shape == ()
    assert float(one) == 1.0  # a tie: to even


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("odd_at", [0, -1])
def test_blocks_at_their_edges(extra: int, odd_at: int) -> None:
    """The rounding goes block by block (_SCALE_BLOCK elements): an element only the
    slow path gets right (a subnormal, a NaN) at either end of an array one under, at and
    one over a block is still right."""
    size = rounding._SCALE_BLOCK + extra
    rng = np.random.default_rng(size)
    for odd in (3.1 * 2.0**-134, np.uint64(0x7FF0_0000_0000_0001).view(np.float64)):
        wide = rng.standard_normal(size)
        wide[odd_at] = odd
        got = rounding.narrow_round(wide, BF16).view(np.uint16)
        want = rounding._through_float32(wide, BF16).view(np.uint16)
        assert np.array_equal(got[:-1] if odd_at else got[1:], want[:-1] if odd_at else want[1:])
        assert np.isnan(float(got.view(BF16)[odd_at])) == np.isnan(odd)
        if not np.isnan(odd):
            assert got[odd_at] == want[odd_at]


@pytest.mark.parametrize("extra", [-1, 0, 1, rounding._SCALE_BLOCK + 1])
def test_float16_by_blocks_matches_numpys_own_rounding(extra: int) -> None:
    """float16 is rounded block by block too: against numpy's direct float64-to-float16
    cast (its own code, one rounding), with ties, overflow, subnormals and NaN at the
    blocks' ends."""
    size = rounding._SCALE_BLOCK + extra
    rng = np.random.default_rng(size)
    wide = np.ldexp(rng.random(size) + 0.5, rng.integers(-30, 18, size))
    halves = rng.integers(0, 0x7C00, size, dtype=np.uint16).view(np.float16).astype(np.float64)
    wide[::7] = halves[::7] * (1 + 2.0**-11)  # ties, where ends are even or odd
    specials = [65520.0, 65519.99, 2.0**-25, 3 * 2.0**-26, np.nan, -np.inf, -0.0, 1e300]
    for at in (0, rounding._SCALE_BLOCK - 1, -1):
        if -size <= at < size:
            wide[at] = specials[at % len(specials)]
    wide = np.concatenate([wide, specials])
    with np.errstate(over="ignore"):
        want = wide.astype(np.float16)
    got = rounding.narrow_round(wide, np.dtype(np.float16))
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize(
    "dtype",
    [np.float32, np.float64, BF16, np.float16, ml_dtypes.float8_e4m3fn, np.complex64, ">f4"],
    ids=str,
)
@pytest.mark.parametrize(
    ("shape", "axes"),
    [
        ((3, 70_000), (1,)),
        ((70_000, 3), (1,)),
        ((70_000, 3), (0,)),
        ((2, 40_000, 2), (1,)),
        ((2, 40_000, 2), (0, 2)),
        ((1, 200_000), (1,)),
        ((65_537,), (0,)),
    ],
)
def test_per_slice_scaling_in_row_blocks_is_the_whole_box_scaled(
    dtype: Any, shape: tuple[int, ...], axes: tuple[int, ...]
) -> None:
    """--axes scales a box a block of leading rows at a time (_scale_rows_in_blocks): the
    same values, bit for bit, as the whole box scaled at once (_scale), whatever the
    slices' layout against the blocks."""
    rng = np.random.default_rng(len(shape) * 7 + len(axes))
    values = rng.standard_normal(shape) * 3
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    box = values.astype(dtype)
    keep = tuple(1 if i in axes else n for i, n in enumerate(shape))
    mantissas = rng.integers(1 << 40, 1 << 44, keep).astype(np.float64)
    scales = np.ldexp(mantissas, -45)  # the search's factors: 45 bits at most, below 1
    got = rounding.scale_chunk(box, scales)
    with np.errstate(all="ignore"):
        want = rounding._scale(box, scales, 0)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


F16 = np.dtype(np.float16)
# The fp8 formats with a float64 grid (float8.from_float32 serves them).
FP8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3, ml_dtypes.float8_e3m4]


def reference_float16(x: float) -> float:
    """x rounded to float16 (11 significant bits, exponents down to 2**-24), from the
    definition."""
    if math.isnan(x) or math.isinf(x) or x == 0:
        return x
    _, e = math.frexp(x)
    quantum = max(e - 11, -24)
    value = Fraction(round(Fraction(x) / Fraction(2) ** quantum)) * Fraction(2) ** quantum
    if abs(value) >= 2**16:
        return math.copysign(math.inf, x)
    return math.copysign(0.0, x) if value == 0 else float(value)


def float16_edge_values() -> np.ndarray:
    codes = np.arange(0x7C00, dtype=np.uint16)  # every positive finite float16
    values = codes.view(np.float16).astype(np.float64)
    nexts = (codes + np.uint16(1)).view(np.float16).astype(np.float64)  # the last: inf
    ties = ((values + nexts) / 2)[:-1]
    near = [ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), values]
    largest, past = 65504.0, 65520.0  # the tie above the largest rounds to inf
    specials = [largest, past, np.nextafter(past, 0), np.nextafter(past, np.inf), 1e300]
    specials += [2.0**-14, np.nextafter(2.0**-14, 0), 2.0**-24, 2.0**-25, 3 * 2.0**-26]
    specials += [np.nextafter(2.0**-25, 1), 5e-324, 0.0, -0.0, 1.7976931348623157e308]
    out = np.concatenate(near + [np.asarray(specials, np.float64)])
    return np.concatenate([out, -out])


@pytest.mark.parametrize(
    ("dtype", "values", "definition"),
    [(BF16, edge_values, reference), (F16, float16_edge_values, reference_float16)],
    ids=["bfloat16", "float16"],
)
def test_rounded_as_float64_is_the_definition_at_every_edge(
    dtype: np.dtype[Any], values: Any, definition: Any
) -> None:
    """rounded_as_float64 (the factor searches' rounding, on float64's bits) against the
    rounding from the definition and against widen(narrow_round(...)), bit for bit, zeros'
    signs included: ties and their neighbours, every float16, the largest finite value
    and the tie past it, the smallest normal and the subnormals below it. inf and NaN
    among the values send the whole array to narrow_round: the same answer."""
    wide = values()
    finite = wide[np.isfinite(wide)]
    got = rounding.rounded_as_float64(finite, dtype)
    grid = rounding._float64_grid(dtype)
    assert grid is not None
    assert rounding._on_float64_bits(finite, grid) is not None
    want = np.asarray([definition(float(x)) for x in finite])
    assert got.view(np.uint64).tolist() == want.view(np.uint64).tolist()
    with np.errstate(over="ignore"):
        through = widen(rounding.narrow_round(wide, dtype))
    assert np.array_equal(rounding.rounded_as_float64(wide, dtype), through, equal_nan=True)


@pytest.mark.parametrize("dtype", [BF16, F16, *(np.dtype(d) for d in FP8)], ids=str)
@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("odd_at", [0, -1])
def test_rounded_as_float64_at_the_blocks_edges(
    dtype: np.dtype[Any], extra: int, odd_at: int
) -> None:
    """Block by block (_SCALE_BLOCK elements): a subnormal result, an overflow or a NaN
    at either end of an array one under, at and one over a block (a NaN in the last
    block, after the others were rounded, still hands the whole array to narrow_round),
    and a 2-D strided view: the same bits as widen(narrow_round(...))."""
    size = rounding._SCALE_BLOCK + extra
    rng = np.random.default_rng(size + odd_at)
    for odd in (3.1 * 2.0**-134, 3.1 * 2.0**-26, 1e300, -1e300, math.nan, math.inf):
        wide = rng.standard_normal(size) * 10.0 ** rng.integers(-6, 6, size)
        wide[odd_at] = odd
        with np.errstate(over="ignore"):
            want = widen(rounding.narrow_round(wide, dtype))
        got = rounding.rounded_as_float64(wide, dtype)
        assert got.shape == want.shape
        assert np.array_equal(got, want, equal_nan=True)
        assert np.array_equal(np.signbit(got), np.signbit(want))
    strided = rng.standard_normal((300, 700))[:, ::3]
    got = rounding.rounded_as_float64(strided, dtype)
    assert got.shape == strided.shape
    want = widen(rounding.narrow_round(strided, dtype))
    assert got.tobytes() == want.tobytes()


def fp8_neighbourhoods(dtype: np.dtype[Any]) -> np.ndarray:
    """Every value, midpoint and the float64 values either side of each, the ties past
    the largest value (e4m3fn's rounds down to it: its largest code is even), float64's
    extremes and a spread of magnitudes; both signs."""
    values = float64_values(dtype)
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    middles = (finite[1:] + finite[:-1]) / 2
    past = finite[-1] + (finite[-1] - finite[-2]) / 2
    points = np.concatenate([finite, middles, [past, past * 1.5, finite[-1] * 4, 1e300]])
    near = [points, np.nextafter(points, 0), np.nextafter(points, np.inf), [5e-324, 0.0]]
    spread = np.ldexp(np.random.default_rng(9).random(5000) + 0.5, np.arange(5000) % 60 - 40)
    out = np.concatenate([*near, spread])
    return np.concatenate([out, -out])


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: np.dtype(d).name)
def test_rounded_as_float64_of_fp8_is_narrow_rounds_and_the_definition(dtype: Any) -> None:
    """The fp8 formats float8.from_float32 serves have a float64 grid too: the same bits
    as widen(narrow_round(...)), NaN where ml_dtypes overflows to it (e4m3fn), and the
    definition's values (test_float8_bits.reference)."""
    from test_float8_bits import reference as fp8_reference

    dtype = np.dtype(dtype)
    assert rounding._float64_grid(dtype) is not None
    wide = fp8_neighbourhoods(dtype)
    got = rounding.rounded_as_float64(wide, dtype)
    with np.errstate(all="ignore"):
        want = widen(rounding.narrow_round(wide, dtype))
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    definition = np.asarray([fp8_reference(float(x), dtype) for x in wide])
    assert np.array_equal(got, definition, equal_nan=True)


@pytest.mark.parametrize(
    "dtype",
    [np.float32, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e8m0fnu],
    ids=lambda d: np.dtype(d).name,
)
def test_rounded_as_float64_of_other_dtypes_is_narrow_rounds(dtype: Any) -> None:
    """Dtypes without a float64 grid take narrow_round itself."""
    assert rounding._float64_grid(np.dtype(dtype)) is None
    wide = np.abs(np.random.default_rng(5).standard_normal(1000) * 100)
    with np.errstate(over="ignore", invalid="ignore"):
        want = widen(rounding.narrow_round(wide, np.dtype(dtype)))
        got = rounding.rounded_as_float64(wide, np.dtype(dtype))
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [BF16, F16, *(np.dtype(d) for d in FP8)], ids=str)
@pytest.mark.parametrize("below", [0, 1, 7, 8, 9, 63, 64])
def test_rounded_as_float64_picks_or_blends_subnormal_results(
    dtype: np.dtype[Any], below: int
) -> None:
    """A block of 64 values of which `below` round on the subnormal step: picked out by
    index up to 1 in _PICKED_BELOW (8 of 64, the limit, included), blended into every
    element beyond it (9 and up); ties on that step, -0.0 and values just under the
    smallest normal among them. Either way the bits are widen(narrow_round(...))'s."""
    assert rounding._PICKED_BELOW == 8
    grid = rounding._float64_grid(dtype)
    assert grid is not None
    rng = np.random.default_rng(below)
    step, normal = grid.step, grid.smallest_normal
    tiny = [1.5 * step, 2.5 * step, -0.0, normal * (1 - 2.0**-30), -3.5 * step, 0.7 * step]
    small = [tiny[k % len(tiny)] * (1 + (k // len(tiny))) for k in range(below)]
    edge = normal * (1 - 2.0**-30)  # every one of them below the smallest normal
    small = [math.copysign(min(abs(v), edge), v) for v in small]
    large = list(normal * (1 + rng.random(64 - below) * 8) * rng.choice([-1, 1], 64 - below))
    wide = np.asarray(small + large, np.float64)
    rng.shuffle(wide)
    assert int(np.count_nonzero(np.abs(wide) < normal)) == below
    got = rounding.rounded_as_float64(wide, dtype)
    with np.errstate(all="ignore"):
        want = widen(rounding.narrow_round(wide, dtype))
    assert got.view(np.uint64).tolist() == want.view(np.uint64).tolist()


@pytest.mark.parametrize(
    "dtype", [F16, BF16, np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.float32)], ids=str
)
@pytest.mark.parametrize("value", [1.0009765625, 2.0**-20, -0.0, 70000.0, math.nan])
def test_zero_dimensional_values_round_as_one_element_arrays(
    dtype: np.dtype[Any], value: float
) -> None:
    """A 0-D float64 rounds to a 0-D array of the dtype, the same bits as a 1-element
    array's (float16 raised TypeError: numpy hands 0-D results back as scalars; attack
    s40b)."""
    with np.errstate(all="ignore"):
        zero_d = rounding.narrow_round(np.asarray(value), dtype)
        one = rounding.narrow_round(np.asarray([value]), dtype)
        wide = rounding.rounded_as_float64(np.asarray(value), dtype)
    assert zero_d.shape == ()
    assert zero_d.dtype == dtype
    assert zero_d.reshape(1).tobytes() == one.tobytes()
    assert wide.shape == ()
    assert np.array_equal(wide.reshape(1), widen(one), equal_nan=True)
