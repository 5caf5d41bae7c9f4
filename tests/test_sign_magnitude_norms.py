"""Issue 20, norms of 8- and 16-bit floats: their extremes come from two integer maxes over
the bits (numerics.sign_magnitude), not from comparing values. Checked against ml_dtypes'
own float64 values and numpy's max/min on them (no clipcli code), for every dtype
ml_dtypes has: every pair of 8-bit codes, every 16-bit code beside +0, -0 and the extremes,
one-signed chunks, and each non-finite code at the end of a finite chunk; and that the
whole NormAccumulator of such a chunk is the one its float64 copy gives.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from small_floats import FP8_NAMES, SMALL_FLOAT_NAMES, dtypes_of

from clipcli.numerics import norms, sign_magnitude
from clipcli.numerics.norms import CACHE_BLOCK, NormAccumulator

DTYPES = dtypes_of(SMALL_FLOAT_NAMES)
# The dtypes the bit path must take (the others are measured the float32 way).
SIGN_MAGNITUDE = {"bfloat16", "float16", *FP8_NAMES[:4]}


def codes_of(dtype: np.dtype, codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, np.uint32).astype(f"u{dtype.itemsize}").view(dtype)


def wide(chunk: np.ndarray) -> np.ndarray:
    """ml_dtypes' (or numpy's) own float64 values of the chunk."""
    with np.errstate(invalid="ignore"):  # signalling NaN codes
        return chunk.astype(np.float64)


def reference(chunk: np.ndarray) -> tuple[float, float] | None:
    """(max, min) of the chunk's values as ml_dtypes widens them; None with inf or NaN, or
    where a zero extreme meets values of both signs (left to numpy, whose choice between
    0.0 and -0.0 is then their order's)."""
    values = wide(chunk)
    if not np.isfinite(values).all():
        return None
    high, low = values.max(), values.min()
    negative = np.signbit(values)
    if (high == 0.0 or low == 0.0) and negative.any() and not negative.all():
        return None
    if high == 0.0:  # one sign only: its zero (numpy's max of equal zeros is that zero)
        high = -0.0 if negative.all() else 0.0
    if low == 0.0:
        low = -0.0 if negative.all() else 0.0
    return float(high), float(low)


def same(got: tuple[float, float] | None, want: tuple[float, float] | None) -> bool:
    """Equal, bit for bit (-0.0 told from 0.0)."""
    if got is None or want is None:
        return got is want
    return np.array(got, np.float64).tobytes() == np.array(want, np.float64).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_layout_is_found_where_it_holds(dtype: np.dtype) -> None:
    layout = sign_magnitude.layout(dtype)
    assert (layout is not None) == (dtype.name in SIGN_MAGNITUDE)
    if layout is not None:
        finite = np.isfinite(wide(codes_of(dtype, np.arange(256**dtype.itemsize))))
        codes = codes_of(dtype, np.flatnonzero(finite))
        bits = np.empty(codes.size, np.int32)
        moved, power = sign_magnitude.scaled_values(codes, layout, bits)
        want = wide(codes)
        assert np.array_equal(np.ldexp(wide(moved), power), want)


def test_not_native_byte_order_has_no_layout() -> None:
    assert sign_magnitude.layout(np.dtype(">f2")) is None
    assert sign_magnitude.layout(np.dtype(np.float32)) is None


@pytest.mark.parametrize(
    "dtype", [d for d in DTYPES if d.name in SIGN_MAGNITUDE and d.itemsize == 1], ids=str
)
def test_every_pair_of_8_bit_codes(dtype: np.dtype) -> None:
    layout = sign_magnitude.layout(dtype)
    assert layout is not None
    for first in range(256):
        for second in range(256):
            chunk = codes_of(dtype, np.array([first, second]))
            got = sign_magnitude.finite_extremes(chunk, layout)
            assert same(got, reference(chunk)), (first, second, got)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_every_16_bit_code_beside_zeros_and_extremes(name: str) -> None:
    dtype = np.dtype(np.float16) if name == "float16" else np.dtype(ml_dtypes.bfloat16)
    layout = sign_magnitude.layout(dtype)
    assert layout is not None
    values = wide(codes_of(dtype, np.arange(65536)))
    finite = np.flatnonzero(np.isfinite(values))
    # The partners: +0, -0, the smallest subnormals, the largest finite codes, and the
    # first non-finite code of each half (exactly at the limit of the finite ones).
    top_positive = int(finite[finite < 32768].max())
    top_negative = int(finite.max())
    partners = [0, 32768, 1, 32769, top_positive, top_negative, top_positive + 1, top_negative + 1]
    codes = np.arange(65536)
    for partner in partners:
        chunks = codes_of(dtype, np.stack([codes, np.full(65536, partner)], axis=1))
        for code in codes:
            got = sign_magnitude.finite_extremes(chunks[code], layout)
            assert same(got, reference(chunks[code])), (code, partner, got)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.name in SIGN_MAGNITUDE], ids=str)
@pytest.mark.parametrize("signs", ["positive", "negative", "zeros", "mixed"])
def test_one_signed_and_mixed_chunks(dtype: np.dtype, signs: str) -> None:
    layout = sign_magnitude.layout(dtype)
    assert layout is not None
    half = 256**dtype.itemsize // 2
    values = wide(codes_of(dtype, np.arange(2 * half)))
    finite = np.flatnonzero(np.isfinite(values))
    pool = {
        "positive": finite[finite < half],
        "negative": finite[finite >= half],
        "zeros": np.array([0, half]),
        "mixed": finite,
    }[signs]
    rng = np.random.default_rng(7)
    for size in (1, 2, 3, 100, 5000):
        chunk = codes_of(dtype, rng.choice(pool, size))
        assert same(sign_magnitude.finite_extremes(chunk, layout), reference(chunk))
        # A strided view of it: the bits are read through the same strides.
        assert same(sign_magnitude.finite_extremes(chunk[::3], layout), reference(chunk[::3]))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.name in SIGN_MAGNITUDE], ids=str)
def test_each_non_finite_code_ends_a_finite_chunk(dtype: np.dtype) -> None:
    layout = sign_magnitude.layout(dtype)
    assert layout is not None
    values = wide(codes_of(dtype, np.arange(256**dtype.itemsize)))
    finite = np.flatnonzero(np.isfinite(values))
    rng = np.random.default_rng(3)
    for bad in np.flatnonzero(~np.isfinite(values))[::7]:
        codes = np.append(rng.choice(finite, 64), bad)
        assert sign_magnitude.finite_extremes(codes_of(dtype, codes), layout) is None


def accumulated(chunk: np.ndarray) -> NormAccumulator:
    held = NormAccumulator()
    held.add(chunk)
    return held


def bits_of(held: NormAccumulator) -> bytes:
    """Every statistic's bits (-0.0 told from 0.0, NaN equal to NaN)."""
    fields = [held.max_abs, held.min_value, held.max_value, held.sumsq.mant]
    counts = [held.sumsq.exp, held.numel, held.nonfinite, held.nan_count, held.inf_count]
    return np.array(fields, np.float64).tobytes() + np.array(counts, np.int64).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", ["finite", "non_finite", "zeros", "non_negative", "non_positive", "all_zero"]
)
def test_accumulator_is_the_float32_copys_bit_for_bit(dtype: np.dtype, case: str) -> None:
    """The statistics the chunk's float32 copy gives (the way these dtypes were measured
    before), bit for bit, and the float64 copy's by value: the same float64 values summed
    in the same order."""
    values = wide(codes_of(dtype, np.arange(256**dtype.itemsize)))
    finite = np.flatnonzero(np.isfinite(values))
    if case == "non_negative":  # +0 among them: its own zero is the smallest value
        finite = finite[~np.signbit(values[finite])]
    if case == "non_positive":  # -0 among them, where the dtype has one
        finite = finite[np.signbit(values[finite])]
        if not finite.size:
            pytest.skip(f"{dtype} has no negative values")
    if case == "all_zero":
        finite = np.array([0])
    codes = np.random.default_rng(5).choice(finite, 3 * (1 << 18) + 11)
    non_finite = np.flatnonzero(~np.isfinite(values))
    if case == "non_finite" and non_finite.size:
        codes[12345] = non_finite[0]
    if case == "zeros":  # +0 and, where the dtype has one, -0, among both signs
        codes[[7, 9, 1 << 18, (1 << 18) + 2]] = [0, values.size // 2] * 2
    chunk = codes_of(dtype, codes)
    for part in (chunk, chunk[1:], chunk[::2], chunk[:1], chunk[7:10], chunk[9:10]):
        got = accumulated(part)
        with np.errstate(invalid="ignore"):
            as_float32 = part.astype(np.float32)
        assert bits_of(got) == bits_of(accumulated(as_float32))
        assert got == accumulated(wide(part))


def test_bit_move_at_its_widest() -> None:
    """bfloat16 moved bit by bit fills all 31 bits below float32's sign (exactly at the
    limit of what the move allows): still every finite value, times 2**0."""
    dtype = np.dtype(ml_dtypes.bfloat16)
    values = wide(codes_of(dtype, np.arange(65536)))
    finite = np.isfinite(values)
    how = sign_magnitude._bit_move(dtype, values, finite)
    assert how is not None
    assert how[0] == 16
    assert how[2] == 0
    signed = codes_of(dtype, np.arange(65536)).view(np.int16)
    moved = sign_magnitude._moved(signed, how, np.empty(65536, np.int32))
    assert np.array_equal(wide(moved)[finite], values[finite])


@pytest.mark.parametrize("size", [CACHE_BLOCK - 1, CACHE_BLOCK, CACHE_BLOCK + 1])
def test_moved_bits_past_the_reused_buffer(size: int) -> None:
    """Up to CACHE_BLOCK values are moved in a buffer reused by the thread, beyond it in a
    fresh one (CLIPCLI_CACHE_BLOCK can hand over bigger chunks): the same values either
    way, and a reused buffer's values are not those of the call before."""
    dtype = np.dtype(np.float16)
    layout = sign_magnitude.layout(dtype)
    assert layout is not None
    rng = np.random.default_rng(size)
    first = rng.standard_normal(size).astype(dtype)
    second = rng.standard_normal(size).astype(dtype)
    buffers = []
    for chunk in (first, second):
        bits = norms._scratch("bits", np.int32, size)
        buffers.append(bits)
        moved, power = sign_magnitude.scaled_values(chunk, layout, bits)
        assert np.shares_memory(moved, bits)
        assert np.array_equal(np.ldexp(moved.astype(np.float64), power), wide(chunk))
    assert np.shares_memory(buffers[0], buffers[1]) == (size <= CACHE_BLOCK)


@pytest.mark.parametrize(
    "dtype",
    [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.int8)]
    + [d for d in DTYPES if d.name in SIGN_MAGNITUDE],
    ids=str,
)
@pytest.mark.parametrize("shape", [(), (3, 5), (64, 4096), (2, 3, 7)])
def test_any_shape_is_measured_as_its_flat_copy(dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """A chunk of any number of dimensions has its flat copy's statistics, bit for bit (a
    2-D float16 chunk raised ValueError in add()'s dot product, attack s39); a Fortran-order
    one too."""
    rng = np.random.default_rng(len(shape))
    with np.errstate(all="ignore"):
        data = (rng.standard_normal(shape) * 3).astype(dtype)
    for chunk in (data, np.asfortranarray(data), data.T):
        flat = np.ascontiguousarray(chunk).reshape(-1)
        assert bits_of(accumulated(chunk)) == bits_of(accumulated(flat))
