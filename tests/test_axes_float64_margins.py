"""The margins of float64 slices in the --axes search (numerics.slices._certain_rows_margin).

A float64 slice's search asks about five margins, each a certain bound of the rounded
slice's sum of squares against C**2 by split sums (~10 ns a value). Where the plain float64
sum of squares is far enough from C**2 for its rounding to leave no doubt (the search's
first guesses, 2**-24 either side of TF's factor), the plain sum now decides (~1 ns).

References: exact sums of squares as fractions, and the factors found where every margin
takes the split sums (the plain decision out of reach), which must be the same.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from clipcli.numerics import norms, slices
from clipcli.numerics.search import U64


def _slack(terms: int) -> float:
    return (terms + 4) * U64 * 1.01


def _edge(terms: int, side: int) -> float:
    """The ratio nearest 1 that is still decided on `side` (-1: under, +1: over), found by
    stepping float by float from 1 (a few dozen steps: the slack is that many ulps)."""
    r = 1.0
    ones = np.ones(1)
    while not slices._plainly_decided(np.array([r]), ones, terms)[0]:
        r = math.nextafter(r, side * math.inf)
    return r


@pytest.mark.parametrize("terms", [1, 7, 1000, 1 << 17])
def test_the_plain_sum_decides_from_exactly_its_slack(terms: int) -> None:
    """At the first decided ratio on each side: decided; one float nearer 1: not. And the
    first decided ratio is where the strict comparison with (1 +- slack) first holds."""
    slack = _slack(terms)
    under, over = _edge(terms, -1), _edge(terms, +1)
    assert under * (1 + slack) < 1.0 <= math.nextafter(under, 2.0) * (1 + slack)
    assert over * (1 - slack) > 1.0 >= math.nextafter(over, 0.0) * (1 - slack)
    ones = np.ones(2)
    decided = slices._plainly_decided
    assert decided(np.array([under, over]), ones, terms).all()
    nearer = np.array([math.nextafter(under, 2.0), math.nextafter(over, 0.0)])
    assert not decided(nearer, ones, terms).any()
    # The slack covers the sum's rounding: at least (terms + 3) roundings of each side.
    assert 1.0 - under >= (terms + 3) * U64
    assert over - 1.0 >= (terms + 3) * U64


def test_the_plain_sum_decides_only_where_c_squared_is_within_its_range() -> None:
    low, high = slices._PLAIN_DECIDES
    far = np.full(4, 0.5)
    csq = np.array([low, math.nextafter(low, 0.0), high, math.nextafter(high, math.inf)])
    assert slices._plainly_decided(far, csq, 8).tolist() == [True, False, True, False]
    assert not slices._plainly_decided(np.array([math.inf, math.nan]), np.ones(2), 8).any()


def _norm(row: np.ndarray) -> float:
    """The row's L2 norm from its exact sum of squares (any magnitude float64 holds)."""
    total = sum((Fraction(v) ** 2 for v in row.tolist()), Fraction(0))
    if not total:
        return 0.0
    half = (total.numerator.bit_length() - total.denominator.bit_length()) // 2
    return math.ldexp(math.sqrt(float(total / Fraction(4) ** half)), half)


def _exact_margin(row: np.ndarray, limit: float) -> Fraction:
    """1 - (the row's exact sum of squares) / limit**2."""
    total = sum((Fraction(v) ** 2 for v in row.tolist()), Fraction(0))
    return 1 - total / Fraction(limit) ** 2


def test_margins_have_the_exact_sign_whichever_sum_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 1 to 64 values at magnitudes from 1e-300 to 1e300, against limits from 0.5 to
    2 times their norm and within a few ulps of it: margin >= 0 only where the exact sum
    of squares is <= C**2, and below 0 only where it is over (or so close to C**2 that
    only an exact decision tells: the split sums' bound is certain, not exact); both sums
    decide some rows."""
    split_rows: list[int] = []
    split = slices._split_rows_margin

    def counted(x: np.ndarray, c: np.ndarray) -> np.ndarray:
        split_rows.append(x.shape[0])
        return split(x, c)

    monkeypatch.setattr(slices, "_split_rows_margin", counted)
    rng = np.random.default_rng(11)
    asked = 0
    for trial in range(400):
        n = int(rng.integers(1, 65))
        scale = 10.0 ** rng.uniform(-300, 300)
        rows = rng.standard_normal((3, n)) * scale
        norm = _norm(rows[0])
        if trial % 2:
            limit = norm * float(rng.uniform(0.5, 2.0))
        else:
            limit = norm
            for _ in range(int(rng.integers(-4, 5))):
                limit = math.nextafter(limit, math.inf if trial % 4 else 0.0)
        margins = slices._certain_rows_margin(rows, limit)
        for row, margin in zip(rows, margins, strict=True):
            exact = _exact_margin(row, limit)
            if margin >= 0:  # certain: it fits
                assert exact >= 0, (trial, n, limit)
            else:  # over, or within the split sums' tiny bound of C**2 (an exact tie)
                assert exact < Fraction(1, 2**100), (trial, n, limit)
        asked += rows.shape[0]
    assert 0 < sum(split_rows) < asked


def _hard_rows(
    rng: np.random.Generator, trial: int, count: int, lengths: list[int]
) -> tuple[np.ndarray, float]:
    """`count` float64 rows of one of `lengths` at a magnitude from 1e-300 to 1e300, all
    alike every third trial, and a limit at the first row's norm (odd trials) or half it."""
    rows = rng.standard_normal((count, int(rng.choice(lengths)))) * 10.0 ** rng.uniform(-300, 300)
    if trial % 3 == 0:
        rows[1:] = rows[0]
    return rows, _norm(rows[0]) * (1.0 if trial % 2 else 0.5)


def test_the_factors_are_the_split_sums_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 boxes of rows (--axes 1) at magnitudes from 1e-300 to 1e300, every row over
    the limit, some rows alike and limits at a row's norm: the same factors, bit for bit,
    with the plain decision and without it."""
    rng = np.random.default_rng(12)
    for trial in range(60):
        box, limit = _hard_rows(rng, trial, 6, [1, 2, 5, 64, 1000, 3000])
        n, scale = box.shape[1], float(np.max(np.abs(box)))
        with_plain = slices.box_axes_scales(box, (1,), box.dtype, limit)
        monkeypatch.setattr(slices, "_PLAIN_DECIDES", (math.inf, -math.inf))
        split_only = slices.box_axes_scales(box, (1,), box.dtype, limit)
        monkeypatch.undo()
        assert with_plain.tobytes() == split_only.tobytes(), (trial, n, scale)


@pytest.mark.parametrize("block", [4, 64, 1024])
def test_long_rows_in_pieces_give_the_whole_rows_factors(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Rows longer than MARGIN_BLOCK_VALUES are worked out a piece at a time
    (_long_row_margin): the factors are those of the rows taken whole, bit for bit, with
    the plain decision and without it (every margin by the split sums), at magnitudes
    from 1e-300 to 1e300, rows alike, tiny values beside large ones, limits at a row's
    norm and within ulps of it."""
    rng = np.random.default_rng(13)
    for trial in range(24):
        rows, limit = _hard_rows(rng, trial, 4, [8, 65, 1023, 1024, 1025, 2500])
        n = rows.shape[1]
        if trial % 4 == 1:
            rows[:, ::3] *= 1e-200
            limit = _norm(rows[0]) * (1.0 if trial % 2 else 0.5)
        if trial % 6 == 5:
            limit = math.nextafter(limit, 0.0)
        whole = slices.axes_scales(rows, (1,), limit)[1]
        with monkeypatch.context() as patched:
            patched.setattr(slices, "MARGIN_BLOCK_VALUES", block)
            pieces = slices.axes_scales(rows, (1,), limit)[1]
            patched.setattr(slices, "_PLAIN_DECIDES", (math.inf, -math.inf))
            split_only = slices.axes_scales(rows, (1,), limit)[1]
        assert pieces.tobytes() == whole.tobytes(), (trial, n, block)
        assert split_only.tobytes() == whole.tobytes(), (trial, n, block)


@pytest.mark.parametrize("block", [4, 8, 9, 64])
def test_a_long_rows_split_margin_is_the_whole_rows_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Where the plain sum does not decide, _long_row_margin's margin is the whole row's
    split sums' margin bit for bit (its error terms laid out and summed as the whole
    row's): one bound, whatever the pieces (bounds worked out piece by piece gave a factor
    one ulp from the whole row's on a crafted row, attack s43b). Lengths at and around
    multiples of the piece, zero rows, tiny values beside large ones, limits down to
    the smallest subnormal (c * c then 0: a ZeroDivisionError, exit 70, attack s43b)."""
    monkeypatch.setattr(slices, "MARGIN_BLOCK_VALUES", block)
    monkeypatch.setattr(slices, "_PLAIN_DECIDES", (math.inf, -math.inf))
    rng = np.random.default_rng(15)
    lengths = [block + 1, 2 * block, 2 * block + 1, 3 * block - 1, 7 * block + 1, 33 * block + 5]
    with np.errstate(all="ignore"):
        for trial in range(40):
            row = rng.standard_normal(int(rng.choice(lengths))) * 10.0 ** rng.uniform(-300, 300)
            if trial % 4 == 1:
                row[::3] *= 1e-200
            if trial % 10 == 3:
                row[:] = 0.0
            peak = float(np.max(np.abs(row)))
            for factor in (1.0, 0.5, math.nextafter(1.0, 0.0)):
                for limit in (1.0, 1e-300, 5e-324, 1e300, 3 * peak):
                    got = slices._long_row_margin(row, factor, peak, row.dtype, limit)
                    whole = slices._certain_rows_margin((row * factor)[None, :], limit)[0]
                    assert np.array_equal(got, whole, equal_nan=True), (trial, factor, limit)


def test_a_long_rows_margin_has_the_exact_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    """_long_row_margin against fractions: >= 0 only where the exact sum of squares of the
    rounded row is <= C**2 (rows of 9 to 300 values in pieces of 4 to 64)."""
    rng = np.random.default_rng(14)
    for trial in range(200):
        monkeypatch.setattr(slices, "MARGIN_BLOCK_VALUES", int(rng.choice([4, 8, 64])))
        n = int(rng.integers(9, 301))
        row = rng.standard_normal(n) * 10.0 ** rng.uniform(-300, 300)
        limit = _norm(row)
        factor = float(rng.choice([1.0, 0.5, math.nextafter(1.0, 0.0)]))
        peak = float(np.max(np.abs(row)))
        margin = slices._long_row_margin(row, factor, peak, np.dtype(np.float64), limit)
        rounded = row * factor  # float64: the product is the one rounding
        exact = _exact_margin(rounded, limit)
        if margin >= 0:
            assert exact >= 0, (trial, n)
        else:
            assert exact < Fraction(1, 2**100), (trial, n)


def test_slice_exponents_kept_small_are_the_full_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """streamed_sumsq keeps float64 slices' exponents as int16, worked out in blocks: the
    same exponents as rescale_exponents, from the smallest subnormal to the largest
    float64, across block bounds (blocks of 3 for 8 peaks)."""
    monkeypatch.setattr(slices, "EXPONENT_BLOCK", 3)
    peaks = np.array(
        [5e-324, 2.0**-1022, 2.0**-401, 2.0**-400, 1.0, 2.0**400, 2.0**401, 1.7976931348623157e308]
    ).reshape(2, 1, 4)
    small = slices._small_exponents(peaks)
    assert small.dtype == np.int16
    assert small.shape == peaks.shape
    assert np.array_equal(small, norms.rescale_exponents(peaks))
    assert small.min() == -1073
    assert small.max() == 1024
