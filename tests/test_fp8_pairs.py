"""Issue 20, CPU per element of 8-bit floats: the clip's bit-pattern counts (measuring
pass) and table lookups (write pass) go two codes at a time from lookup.PAIRED_FROM
elements on. Checked against numpy's own np.bincount / np.take one code at a time and
against ml_dtypes' element-by-element scaling (no clipcli code), exactly at the limit,
one short of it, with an odd tail, an odd start address and a non-contiguous chunk; and
that np.bincount / np.take are handed half the elements (their cost is per element).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from clipcli.numerics import lookup, rounding
from clipcli.numerics.norms import NormAccumulator

FP8_TYPES = [np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]
LIMIT = lookup.PAIRED_FROM
SIZES = [LIMIT - 1, LIMIT, LIMIT + 1, 3 * LIMIT + 7]


def fp8_codes(size: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """`size` codes covering every one of the 256 patterns (NaN, +-inf, +-0 included)."""
    codes = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    codes[: min(size, 256)] = np.arange(min(size, 256), dtype=np.uint8)
    return codes.view(dtype)


@pytest.mark.parametrize("dtype", FP8_TYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_counts_are_numpys_bincount(dtype: np.dtype, size: int) -> None:
    chunk = fp8_codes(size, dtype, seed=size)
    want = np.bincount(chunk.view(np.uint8), minlength=256)
    got = lookup.bit_pattern_counts(chunk)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", SIZES)
def test_counts_of_an_odd_address_and_a_strided_chunk(size: int) -> None:
    dtype = FP8_TYPES[0]
    backing = fp8_codes(2 * size + 1, dtype, seed=7)
    for chunk in (backing[1 : size + 1], backing[::2][:size]):  # odd start; every other
        want = np.bincount(chunk.view(np.uint8), minlength=256)
        np.testing.assert_array_equal(lookup.bit_pattern_counts(chunk), want)


@pytest.mark.parametrize("dtype", FP8_TYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_scaling_is_ml_dtypes_element_by_element(dtype: np.dtype, size: int) -> None:
    """Each scaled code as ml_dtypes rounds the float64 product of that one value (the
    factor's product is exact in float64, and float64 -> float32 is exact for fp8's
    range, so ml_dtypes' single cast from float32 is the one rounding)."""
    chunk = fp8_codes(size, dtype, seed=size + 1)
    factor = 0.6875
    got = rounding.scale_chunk(chunk, factor)
    with np.errstate(invalid="ignore", over="ignore"):
        wide = chunk.astype(np.float64) * factor
        want = wide.astype(np.float32).astype(dtype)
    assert got.dtype == dtype
    assert got.shape == chunk.shape
    same = got.view(np.uint8) == want.view(np.uint8)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    assert np.all(same | both_nan)


@pytest.mark.parametrize("size", SIZES)
def test_lookup_is_numpys_take(size: int) -> None:
    """Any 256-entry table, any chunk layout: each byte becomes table[byte], in place."""
    dtype = FP8_TYPES[0]
    table = np.random.default_rng(size).permutation(256).astype(np.uint8)
    backing = fp8_codes(2 * size + 1, dtype, seed=size)
    chunks = [backing[:size], backing[1 : size + 1], backing[::2][:size]]
    chunks.append(backing[: size - size % 2].reshape(-1, 2))  # two dimensions
    for chunk in chunks:
        got = lookup.look_up(chunk, table)
        want = np.take(table, chunk.view(np.uint8)).view(dtype)
        assert got.shape == chunk.shape
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_histogram_of_a_measured_tensor_is_unchanged() -> None:
    """NormAccumulator's statistics from the pair counts equal those from one-at-a-time
    counts: the same sparse histogram and norm as np.bincount's counts give."""
    dtype = FP8_TYPES[0]
    chunk = fp8_codes(LIMIT + 1, dtype, seed=3)
    paired = NormAccumulator(keep_histogram=True)
    paired.add(chunk)
    paired.finish()
    single = NormAccumulator(keep_histogram=True)
    single.counts = np.bincount(chunk.view(np.uint8), minlength=256)
    single.numel, single.hist_dtype = chunk.size, dtype
    single.finish()
    assert paired.histogram is not None
    assert single.histogram is not None
    for got, want in zip(paired.histogram, single.histogram, strict=True):
        np.testing.assert_array_equal(got, want)
    assert (paired.norm, paired.nan_count, paired.inf_count) == (
        single.norm,
        single.nan_count,
        single.inf_count,
    )


class _Recorder:
    """Wraps a numpy function and records the size of its indices argument."""

    def __init__(self, fn: object, argument: int) -> None:
        self.fn, self.argument = fn, argument
        self.sizes: list[int] = []

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.sizes.append(np.asarray(args[self.argument]).size)
        return self.fn(*args, **kwargs)  # type: ignore[operator]


@pytest.mark.parametrize(("size", "handed"), [(LIMIT - 1, LIMIT - 1), (LIMIT, LIMIT // 2)])
def test_numpy_is_handed_half_the_elements(
    monkeypatch: pytest.MonkeyPatch, size: int, handed: int
) -> None:
    """From PAIRED_FROM elements on, np.bincount and np.take see one element per two codes
    (plus the odd tail's own call); below it, one per code."""
    chunk = fp8_codes(size, FP8_TYPES[0])
    counting = _Recorder(np.bincount, 0)
    monkeypatch.setattr(np, "bincount", counting)
    lookup.bit_pattern_counts(chunk)
    assert max(counting.sizes) == handed
    table = np.arange(256, dtype=np.uint8)
    lookup.look_up(chunk, table)  # the pair table built (and cached) before counting
    taking = _Recorder(np.take, 1)
    monkeypatch.setattr(np, "take", taking)
    lookup.look_up(chunk, table)
    assert max(taking.sizes) == handed
