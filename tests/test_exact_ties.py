"""8- and 16-bit floats clipped as whole tensors (--norm, --average, --global): the factor
is the largest on the search's grid whose output's exact norm is <= C, ties included.

The float64 margin of the histogram search rejected an output exactly at C (and a few
roundings under it): float16 [6, 8] at C = 5 was written [3, 3.998] where [3, 4] is
exactly within, while --axes (whose slices were already decided exactly) wrote [3, 4].
References: sums of squares as Fractions and rounding from ml_dtypes.finfo's definition
(test_axes_many_slices.round_exactly), nothing of clipcli's arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import Run
from test_axes_many_slices import round_exactly

from clipcli.numerics import scaling
from clipcli.numerics.certain import CertainSumsq, counted_squares_within
from clipcli.numerics.norms import NormAccumulator
from clipcli.numerics.search import exact_product_bits

SMALL_FLOATS = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def _no_pass(_which: Sequence[int], _factor: scaling.Factor) -> CertainSumsq:
    raise AssertionError("8/16-bit members need no pass over the data: histograms decide")


def _member(name: str, array: np.ndarray) -> scaling.Member:
    stats = NormAccumulator(keep_histogram=True)
    stats.add(array.reshape(-1))
    stats.finish()
    return scaling.Member(name, array.dtype, array.size, stats)


def _output_sumsq(arrays: Sequence[np.ndarray], s: Fraction) -> Fraction:
    return sum(
        (
            round_exactly(Fraction(float(v)) * s, array.dtype.type) ** 2
            for array in arrays
            for v in array.astype(np.float64).reshape(-1)
        ),
        Fraction(0),
    )


def _assert_largest(arrays: Sequence[np.ndarray], limit: float) -> float:
    """group_factor's factor for the arrays together: within C exactly, the next grid
    factor over it exactly. Returns the factor (1.0: left alone)."""
    members = [_member(f"t{i}", a) for i, a in enumerate(arrays)]
    factor = scaling.group_factor(members, limit, _no_pass)
    bound = Fraction(limit) ** 2
    if factor is None:
        assert _output_sumsq(arrays, Fraction(1)) <= bound
        return 1.0
    assert factor.exponent == 0
    s = Fraction(factor.mantissa)
    assert _output_sumsq(arrays, s) <= bound
    bits = exact_product_bits([a.dtype for a in arrays])
    step = Fraction(2) ** (math.frexp(factor.mantissa)[1] - bits)
    assert _output_sumsq(arrays, s + step) > bound, factor.mantissa
    return factor.mantissa


@pytest.mark.parametrize("dtype", SMALL_FLOATS, ids=lambda d: np.dtype(d).name)
def test_pythagorean_tensors_land_exactly_on_the_limit(dtype: type) -> None:
    """6s and 8s in equal numbers m (m a square): the norm is 10 * sqrt(m), and at
    C = 5 * sqrt(m) factors from 1/2 up to the next rounding change give 3s and 4s,
    exactly C. Every such tensor gets the largest of them."""
    rng = np.random.default_rng(3)
    for m in (1, 4, 9, 25):
        values = np.array([6.0, 8.0] * m) * rng.choice([-1.0, 1.0], size=2 * m)
        array: np.ndarray = rng.permutation(values).astype(dtype)
        limit = 5.0 * math.isqrt(m)
        factor = Fraction(_assert_largest([array], limit))
        assert _output_sumsq([array], factor) == Fraction(limit) ** 2


@pytest.mark.parametrize("dtype", SMALL_FLOATS, ids=lambda d: np.dtype(d).name)
def test_whole_tensor_factors_are_within_the_limit_and_the_largest(dtype: type) -> None:
    """Random tensors, limits at a rounded output's own norm (where it is a float: one
    element, or equal magnitudes), a hair around it, and ordinary ones."""
    rng = np.random.default_rng(8)
    for trial in range(6):
        values = rng.standard_normal(40) * [0.01, 1.0, 20.0][trial % 3]
        values[rng.random(40) < 0.2] = 0.0
        array: np.ndarray = values.astype(dtype)
        norm = float(np.sqrt(np.sum(array.astype(np.float64) ** 2)))
        if norm == 0.0:
            continue
        limits = [norm * 0.7, norm * 0.31, math.nextafter(norm * 0.7, 0.0)]
        for limit in limits:
            _assert_largest([array], limit)
    for count in (1, 4, 16):  # equal magnitudes: the best output often lands exactly on C
        array = rng.choice([-2.0, 2.0], size=count).astype(dtype)
        for limit in (0.5 * math.sqrt(count), 0.75 * math.sqrt(count), 1.0):
            _assert_largest([array], limit)
            _assert_largest([array], math.nextafter(limit, 0.0))
            _assert_largest([array], math.nextafter(limit, math.inf))


def test_a_global_group_of_two_dtypes_lands_exactly_on_the_limit() -> None:
    """float16 and bfloat16 [6, 8, -6, -8] together: norm 20, at C = 10 factor 1/2 writes
    3s and 4s in both, exactly C (one histogram per dtype, decided together)."""
    a = np.array([6, 8, -6, -8], np.float16)
    b = np.array([-8, 6, 8, -6], ml_dtypes.bfloat16)
    factor = Fraction(_assert_largest([a, b], 10.0))
    assert _output_sumsq([a, b], factor) == 100
    assert _assert_largest([a, b], math.nextafter(10.0, 0.0)) < 0.5


def test_counted_squares_within_against_fractions() -> None:
    """Counts around the split (2**26) and up to 2**53 - 1, limits at the exact sum's
    rounding and one ulp either side, and limits at and past the Dekker range's ends
    (1e-140, 1e140: exclusive, fractions there)."""
    rng = np.random.default_rng(5)
    split = 2**26
    for _ in range(40):
        values = rng.standard_normal(6).astype(np.float16).astype(np.float64)
        counts = rng.choice(
            [1, split - 1, split, split + 1, 2**53 - 1, 2**40 + 3, 7], size=6
        ).astype(np.float64)
        exact = sum(
            (
                Fraction(v) ** 2 * int(c)
                for v, c in zip(values.tolist(), counts.tolist(), strict=True)
            ),
            Fraction(0),
        )
        if exact == 0:
            continue
        near = math.sqrt(float(exact))
        for limit in (near, math.nextafter(near, 0.0), math.nextafter(near, math.inf)):
            assert counted_squares_within(values, counts, limit) == (exact <= Fraction(limit) ** 2)
    # A sum exactly equal to C**2: one value 3 and one 4, C = 5; and with counts past the
    # split (each count 2**52: norm 5 * 2**26).
    three_four = np.array([3.0, 4.0])
    assert counted_squares_within(three_four, np.array([1.0, 1.0]), 5.0)
    assert not counted_squares_within(three_four, np.array([1.0, 1.0]), math.nextafter(5.0, 0))
    big = np.array([2.0**52, 2.0**52])
    assert counted_squares_within(three_four, big, 5.0 * 2**26)
    assert not counted_squares_within(three_four, big, math.nextafter(5.0 * 2**26, 0))
    # At the ends of the split's range and past them: the same answers.
    for limit in (1e-140, 1e140, math.nextafter(1e-140, 0), math.nextafter(1e140, math.inf)):
        for scale in (limit / 5, math.nextafter(limit / 5, math.inf)):
            values = three_four * scale
            exact = Fraction(values[0]) ** 2 + Fraction(values[1]) ** 2
            expected = exact <= Fraction(limit) ** 2
            assert counted_squares_within(values, np.array([1.0, 1.0]), limit) == expected


def test_clip_writes_the_tie_through_every_whole_tensor_mode(
    tmp_path: Path, run_main: Callable[..., Run]
) -> None:
    """Through the CLI: float16 [6, 8] at --norm 5, --average 2.5 and --global 5 is written
    [3, 4]; --axes 0 wrote it so before; clipping the output again leaves it alone."""
    src = tmp_path / "in.npz"
    np.savez(src, a=np.array([6.0, 8.0], np.float16))
    for mode in (
        ["--norm", "5"],
        ["--average", "2.5"],
        ["--global", "5"],
        ["--norm", "5", "--axes", "0"],
    ):
        out = tmp_path / "out.npz"
        again = tmp_path / "again.npz"
        assert run_main("clip", *mode, "-q", "--force", src, out).code == 0
        written = np.load(out)["a"]
        assert written.tolist() == [3.0, 4.0], mode
        assert run_main("clip", *mode, "-q", "--force", out, again).code == 0
        assert np.load(again)["a"].tobytes() == written.tobytes()


def test_near_tie_searches_sum_exactly_once_per_distinct_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack s33num: at a limit one ulp under a tie, the bisection probes many factors
    that round to one same output, and each probe summed the ~100,000 exact terms again
    (5-7x the CPU of the float64 search). An exact sum is now made once per distinct
    output: counted here as events (the calls), not time."""
    sums: list[int] = []
    real = counted_squares_within

    def counted(values: np.ndarray, counts: np.ndarray, limit: float) -> bool:
        sums.append(values.size)
        return real(values, counts, limit)

    monkeypatch.setattr(scaling, "counted_squares_within", counted)
    values = np.arange(1, 2001, dtype=np.float64)
    array: np.ndarray = np.random.default_rng(4).permutation(values).astype(np.float16)
    exact = _output_sumsq([array], Fraction(1, 2))
    limit = math.sqrt(float(exact))
    while Fraction(limit) ** 2 >= exact:  # the largest float whose square is under the tie
        limit = math.nextafter(limit, 0.0)
    _assert_largest([array], limit)
    assert 0 < len(sums) <= 3, len(sums)


def test_tied_slices_split_the_limit_once_per_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack s33num: 200,000 rows of [6, 8] at C = 5, every row an exact tie, took 7x the
    CPU when each slice's exact check split C**2 and made numpy calls of its own. The
    split is made once per margin, whatever the number of slices decided exactly."""
    from clipcli.numerics import slices

    splits: list[float] = []
    from clipcli.numerics.certain import limit_split

    real = limit_split

    def counted(limit: float) -> tuple[float, float] | None:
        splits.append(limit)
        return real(limit)

    monkeypatch.setattr(slices, "limit_split", counted)
    rng = np.random.default_rng(9)
    rows = np.tile([6.0, 8.0], (2000, 1)) * rng.choice([-1.0, 1.0], size=(2000, 2))
    array: np.ndarray = rows.astype(np.float16)
    _, scales = slices.axes_scales(array, (1,), 5.0)
    out = (array.astype(np.float64) * scales.reshape(-1, 1)).astype(np.float16)
    assert np.all(np.abs(out.astype(np.float64)).sum(axis=1) == 7.0)  # [3, 4]: exactly C
    assert 0 < len(splits) <= 20, len(splits)


def test_terms_at_most_against_fractions() -> None:
    """The extraction that adds up exact terms (certain.terms_at_most): terms of either
    sign spread over 300 binades, equal ones, zeros, one to 3,000 of them; limits at the
    sum's own square root and one ulp either side, and sums that are exactly a limit's
    square (3**2 + 4**2 = 5**2, scaled, with tiny terms that cancel)."""
    from clipcli.numerics.certain import limit_split, terms_at_most

    def split(limit: float) -> tuple[float, float]:
        parts = limit_split(limit)
        assert parts is not None
        return parts

    rng = np.random.default_rng(17)
    for trial in range(300):
        size = int(rng.integers(1, 3000)) if trial % 3 else int(rng.integers(1, 20))
        exponents = rng.integers(-150, 150, size=size)
        terms = np.ldexp(rng.integers(1, 2**20, size=size).astype(np.float64), exponents)
        if trial % 4 == 0:
            terms[rng.random(size) < 0.3] = 0.0
        if trial % 5 == 0:
            terms = np.repeat(terms[:1], size)
        if trial % 7 == 0:
            terms[::2] *= -1.0  # rests and parts of either sign
        exact = sum(map(Fraction, terms.tolist()), Fraction(0))
        if exact <= 0:
            assert terms_at_most(terms, split(1.0)) == (exact <= 1)
            continue
        root = math.sqrt(float(exact))
        if not 1e-140 < root < 1e140:
            continue
        for limit in (root, math.nextafter(root, 0.0), math.nextafter(root, math.inf)):
            expected = exact <= Fraction(limit) ** 2
            assert terms_at_most(terms, split(limit)) == expected, (trial, limit)
    tiny = 2.0**-100
    for scale in (1.0, 2.0**40, 2.0**-60):
        at_limit = np.array([9.0, 16.0, tiny, -tiny, tiny / 3, -tiny / 3]) * scale
        assert terms_at_most(at_limit, split(5.0 * math.sqrt(scale)))
        over = np.array([9.0, 16.0, tiny]) * scale
        assert not terms_at_most(over, split(5.0 * math.sqrt(scale)))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_long_slices_near_a_tie_are_decided_exactly(dtype: type) -> None:
    """Slices of more than EXTRACT_FROM_TERMS distinct magnitudes decide near-ties by
    extraction: each row's factor is within C exactly and the next grid factor over it."""
    from clipcli.numerics import slices

    rng = np.random.default_rng(23)
    rows: np.ndarray = (rng.standard_normal((3, 3000)) * [[1e-3], [1.0], [300.0]]).astype(dtype)
    distinct = [np.unique(np.abs(r.astype(np.float64))).size for r in rows]
    assert min(distinct) > slices.EXTRACT_FROM_TERMS
    for k in range(3):
        tied = _output_sumsq([rows[k]], Fraction(1, 2))
        root = math.sqrt(float(tied))
        for limit in (root, math.nextafter(root, 0.0), math.nextafter(root, math.inf)):
            _, scales = slices.axes_scales(rows[k : k + 1], (1,), limit)
            factor = float(scales.reshape(-1)[0])
            bound = Fraction(limit) ** 2
            assert _output_sumsq([rows[k]], Fraction(factor)) <= bound
            bits = exact_product_bits([rows.dtype])
            step = Fraction(2) ** (math.frexp(factor)[1] - bits)
            assert _output_sumsq([rows[k]], Fraction(factor) + step) > bound


def test_limits_past_the_datas_range_print_no_numpy_warnings(tmp_path: Path) -> None:
    """Attack s33num2: --axes with --norm 1e-300 printed numpy's RuntimeWarning (overflow
    in the margins' relative squares) on stderr, exit 0: stderr holds clipcli's lines
    only. A real process: pytest would catch the warnings of one in this process."""
    import subprocess
    import sys

    from handmade import write_safetensors

    rng = np.random.default_rng(3)
    values = rng.standard_normal((3, 5, 7)) * 100
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        src = tmp_path / f"{np.dtype(dtype).name}.safetensors"
        write_safetensors(src, {"w": values.astype(dtype)})
        for limit in ("1e-300", "5e-324", "1e300"):
            for axes in (["0"], ["1,2"]):
                out = tmp_path / "out.safetensors"
                args = ["clip", "--norm", limit, "--axes", *axes, "-q", "--force", src, out]
                run = subprocess.run(
                    [sys.executable, "-m", "clipcli", *map(str, args)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert run.returncode == 0, run.stderr
                assert run.stderr == "", (dtype, limit, axes, run.stderr)


@pytest.mark.parametrize("extra", [0, 1])
def test_slices_at_the_extraction_threshold_are_decided_alike(
    extra: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice of exactly EXTRACT_FROM_TERMS distinct magnitudes is decided with
    math.fsum, one more by extraction: both land exactly on a tie. The row holds 1, 2, ...,
    count - 1 and one x with 1**2 + ... + x**2 = m**2 (m even): halved, its output has norm
    m / 2 = C exactly."""
    from clipcli.numerics import slices

    count = slices.EXTRACT_FROM_TERMS + extra
    base = sum(v * v for v in range(1, count))
    x = next(
        x
        for x in range(count, 2049)
        if math.isqrt(base + x * x) ** 2 == base + x * x and math.isqrt(base + x * x) % 2 == 0
    )
    limit = math.isqrt(base + x * x) / 2
    row = np.array([*range(1, count), x], dtype=np.float16).reshape(1, -1)
    used: list[str] = []

    def spying(name: str) -> Callable[..., bool]:
        real = getattr(slices, name)

        def spy(terms: object, split: tuple[float, float]) -> bool:
            used.append(name)
            return bool(real(terms, split))

        return spy

    for name in ("terms_within", "terms_at_most"):
        monkeypatch.setattr(slices, name, spying(name))
    _, scales = slices.axes_scales(row, (1,), limit)
    factor = Fraction(float(scales.reshape(-1)[0]))
    assert _output_sumsq([row.reshape(-1)], factor) == Fraction(limit) ** 2
    bits = exact_product_bits([row.dtype])
    step = Fraction(2) ** (math.frexp(float(factor))[1] - bits)
    assert _output_sumsq([row.reshape(-1)], factor + step) > Fraction(limit) ** 2
    assert set(used) == {"terms_at_most" if extra else "terms_within"}
