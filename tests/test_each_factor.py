"""--norm and --average search every tensor's factor together (scaling.each_factor): the
factors must be those of group_factor on each tensor alone, bit for bit, with the same
passes over the data in the same order, whatever mix of dtypes, sizes and limits.

The reference is group_factor itself, one member at a time (what the plan called before);
each batched factor is also checked against the promise with exact arithmetic: the output
of numpy's own rounding of the exact product has a norm <= C as a Fraction.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_axes_many_slices import round_exactly

from clipcli.dtypes import finfo
from clipcli.errors import DataRefusedError
from clipcli.jobs.spec import ClipSpec, Mode, exact_limit, tensor_limit
from clipcli.numerics import rounding, scaling
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.norms import NormAccumulator
from clipcli.numerics.search import AMBIGUOUS

Case = tuple[np.ndarray, float, bool]  # values, limit, histogram kept


def _member(name: str, values: np.ndarray, histogram: bool, elsewhere: bool) -> scaling.Member:
    stats = NormAccumulator(keep_histogram=histogram)
    with np.errstate(all="ignore"):
        stats.add(values.reshape(-1))
    stats.finish()
    return scaling.Member(name, values.dtype, values.size, stats, elsewhere)


Spec = tuple[np.ndarray, bool, bool]  # values, histogram kept, rounded elsewhere
Problem = tuple[list[Spec], float, Fraction | None]  # members, limit, exact limit


class _Passes:
    """output_sumsq over arrays in memory (each chunk scaled and rounded as the write pass
    does), recording every pass asked for by the members' positions in the whole list."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = arrays
        self.asked: list[tuple[tuple[int, ...], float, int]] = []

    def of(self, positions: Sequence[int]) -> scaling.OutputSumsq:
        def output_sumsq(which: Sequence[int], factor: scaling.Factor) -> CertainSumsq:
            chosen = [positions[i] for i in which]
            self.asked.append((tuple(chosen), factor.mantissa, factor.exponent))
            total = CertainSumsq()
            for i in chosen:
                with np.errstate(all="ignore"):
                    array = self.arrays[i]
                    total.add(rounding.scale_chunk(array, factor.mantissa, factor.exponent))
            return total

        return output_sumsq


def _compare_problems(problems: Sequence[Problem]) -> list[scaling.Factor | None]:
    """each_factor against group_factor of each problem alone: the same factors, errors
    and passes. Returns the factors."""
    arrays: list[np.ndarray] = []
    groups: list[list[scaling.Member]] = []
    place: dict[int, int] = {}  # id(member) -> its position in arrays
    for members, _, _ in problems:
        group = []
        for values, kept, elsewhere in members:
            member = _member(f"t{len(arrays)}", values, kept, elsewhere)
            place[id(member)] = len(arrays)
            arrays.append(values)
            group.append(member)
        groups.append(group)

    expected: list[scaling.Factor | None | str] = []
    one_by_one = _Passes(arrays)
    for group, (_, limit, exact) in zip(groups, problems, strict=True):
        passes = one_by_one.of([place[id(m)] for m in group])
        try:
            expected.append(scaling.group_factor(group, limit, passes, exact))
        except DataRefusedError as exc:
            expected.append(str(exc))
            break
    together = _Passes(arrays)
    found: list[scaling.Factor | None | str] = []
    queue = (
        (group, limit, exact) for group, (_, limit, exact) in zip(groups, problems, strict=True)
    )
    try:
        found.extend(
            scaling.each_factor(queue, lambda group: together.of([place[id(m)] for m in group]))
        )
    except DataRefusedError as exc:
        found.append(str(exc))
    if expected and isinstance(expected[-1], str):
        # Refused: the same refusal after the same passes (what the block had found
        # before it is never used).
        assert found[-1:] == expected[-1:]
    else:
        assert found == expected
    assert together.asked == one_by_one.asked
    return [f for f in found if not isinstance(f, str)]


def _compare(cases: Sequence[Case], elsewhere: Sequence[bool] = ()) -> list[scaling.Factor | None]:
    """_compare_problems with a problem per tensor, as --norm makes them."""
    marks = list(elsewhere) or [False] * len(cases)
    return _compare_problems(
        [
            ([(values, kept, mark)], limit, Fraction(limit) if math.isfinite(limit) else None)
            for (values, limit, kept), mark in zip(cases, marks, strict=True)
        ]
    )


def _output_within(values: np.ndarray, factor: scaling.Factor, limit: float) -> bool:
    """Exactly: numpy rounds the exact product once to the dtype (factor * value is exact
    in float64 by the factor's bits), and the squares are summed as Fractions."""
    if values.dtype.itemsize <= 2:  # ml_dtypes rounds float64 through float32: twice
        s = Fraction(math.ldexp(factor.mantissa, factor.exponent))
        exact = [
            round_exactly(Fraction(v) * s, values.dtype.type)
            for v in values.astype(np.float64).tolist()
        ]
        return sum((v**2 for v in exact), Fraction(0)) <= Fraction(limit) ** 2
    with np.errstate(all="ignore"):
        wide = np.complex128 if values.dtype.kind == "c" else np.float64
        scaled = values.astype(wide) * math.ldexp(factor.mantissa, factor.exponent)
        out = scaled.astype(values.dtype)
    if out.dtype.kind == "c":
        parts = np.concatenate([out.real.astype(np.float64), out.imag.astype(np.float64)])
    else:
        parts = out.astype(np.float64)
    return sum((Fraction(v) ** 2 for v in parts.tolist()), Fraction(0)) <= Fraction(limit) ** 2


def _norm(values: np.ndarray) -> float:
    return math.sqrt(
        sum((Fraction(v) ** 2 for v in np.abs(values).astype(np.float64).tolist()), Fraction(0))
    )


RATIOS = [0.3, 0.9, 1 - 1e-7, 1 - 2 * AMBIGUOUS, 1 - AMBIGUOUS, 1.0, 1 + AMBIGUOUS, 1.5, 1e-5]


@pytest.mark.parametrize("seed", range(4))
def test_float32_members_get_group_factor_bit_for_bit(seed: int) -> None:
    """One-element to 70,000-element float32 tensors (blocks of the norm's dot product
    merged), each with a limit at a chosen ratio of its norm, on both sides of the
    ambiguous band and on its edges, over scales from 1e-30 to 1e30."""
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    for k in range(300):
        size = (
            int(rng.choice([1, 1, 2, 7, 1000, 70_000])) if k % 25 == 0 else int(rng.integers(1, 4))
        )
        values = (rng.standard_normal(size) * 10.0 ** rng.uniform(-30, 30)).astype(np.float32)
        cases.append((values, _norm(values) * float(rng.choice(RATIOS)), False))
    factors = _compare(cases)
    for (values, limit, _), factor in zip(cases, factors, strict=True):
        if factor is not None:
            assert _output_within(values, factor, limit)


SUBNORMAL_PARTS = bytes.fromhex("9c1c0000402b0080")  # 1.03e-41 - 1.55e-41j, complex64


def test_every_path_of_the_search_in_one_list() -> None:
    """Members that each_factor searches together beside every kind it leaves to
    group_factor: float64 and complex128 (verified by a pass), 8- and 16-bit floats with
    their histograms and without, complex64, zero tensors, infinite limits, members
    rounded elsewhere, ratios at TINY_RATIO and a hair below, subnormal outputs."""
    one = np.ones(1, np.float32)
    tiny = scaling.TINY_RATIO
    cases: list[Case] = [
        (np.array([3.0, 4.0], np.float32), 2.5, False),
        (np.array([3.0, 4.0], np.float64), 2.5, False),  # verified by a pass
        (np.array([3.0 + 4.0j], np.complex128), 2.5, False),
        (np.array([3.0 + 4.0j], np.complex64), 2.5, False),
        (np.array([6.0, 8.0], np.float16), 5.0, True),  # histogram: exact ties
        (np.array([6.0, 8.0], np.float16), 5.0, False),  # no histogram: the bound
        (np.array([6.0, 8.0], ml_dtypes.bfloat16), 5.0, False),
        (np.array([6.0, 8.0], ml_dtypes.float8_e4m3fn), 5.0, False),
        (np.array([6.0, 8.0], ml_dtypes.bfloat16), 5.0, True),
        (np.zeros(3, np.float32), 1.0, False),  # zero: left alone
        (np.array([5.0], np.float32), math.inf, False),
        (one, tiny, False),  # at TINY_RATIO: still the bound
        (one, tiny * (1 - 2.0**-53), False),  # below it: verified by a pass
        (np.array([1e-40, -3e-41], np.float32), 1e-42, False),  # subnormal outputs
        (np.array([1e-40], np.float32), 5e-46, False),  # under the smallest: zero
        (np.array([2.0], np.float32), 1.0, False),
        # complex64 subnormal parts round apart: written over C before (attack s36)
        (
            np.frombuffer(bytes.fromhex("9c1c0000402b0080"), np.complex64),
            1.860247643066752e-41,
            False,
        ),
        (np.frombuffer(bytes.fromhex("9c1c0000402b0080") * 3, np.complex64), 3.2e-41, False),
    ]
    factors = _compare(cases)
    assert factors[0] is not None
    assert factors[-1] is not None
    assert factors[9] is None  # a zero tensor
    assert factors[10] is None  # an infinite limit
    for (values, limit, _), factor in zip(cases, factors, strict=True):
        if factor is not None and factor.exponent == 0:
            assert _output_within(values, factor, limit)


def test_members_rounded_elsewhere_are_each_verified() -> None:
    """A member whose output is rounded in its stored scales is never searched on the
    bound: group_factor verifies it, with the same passes as before."""
    cases: list[Case] = [(np.array([3.0, 4.0], np.float32), 2.5, False)] * 3
    _compare(cases, elsewhere=[False, True, False])


def test_a_refusal_is_the_first_one_in_order() -> None:
    """A dtype without zero that cannot reach its limit is refused (exit 4) at the same
    member as before, after the same passes."""
    e8m0 = ml_dtypes.float8_e8m0fnu
    cases: list[Case] = [
        (np.array([3.0, 4.0], np.float64), 2.5, False),
        (np.array([3.0], np.float32), 1.0, False),
        (np.ones(64, e8m0), 2.0**-126, True),
        (np.array([3.0], np.float32), 1.0, False),
    ]
    _compare(cases)


@pytest.mark.parametrize("count", [1, 4095, 4096, 4097, 8193])
def test_blocks_of_members(count: int) -> None:
    """Lists at and around the block size: every member gets its own factor, in order."""
    rng = np.random.default_rng(count)
    values = rng.standard_normal(count).astype(np.float32)
    cases: list[Case] = [(values[i : i + 1], 0.5, False) for i in range(count)]
    factors = _compare(cases)
    for (single, limit, _), factor in zip(cases, factors, strict=True):
        assert (factor is None) == (abs(float(single[0])) <= limit)


def test_small_blocks_with_every_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 3 over a list that mixes dtypes: a block with none searched together,
    one with several dtypes, one with all members within their limits."""
    monkeypatch.setattr(scaling, "EACH_BLOCK", 3)
    rng = np.random.default_rng(7)
    kinds = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64]
    cases: list[Case] = []
    for k in range(40):
        dtype = kinds[int(rng.integers(len(kinds)))]
        values = (rng.standard_normal(int(rng.integers(1, 6))) * 3).astype(dtype)
        ratio = float(rng.choice(RATIOS))
        cases.append((values, _norm(values) * ratio, bool(k % 2)))
    _compare(cases)


@pytest.mark.parametrize("seed", range(3))
def test_groups_get_group_factor_bit_for_bit(seed: int) -> None:
    """--group-by's problems: groups of 1 to 6 tensors of mixed dtypes (float32 beside
    float64, 16-bit floats with and without histograms, complex64), zero tensors among
    live ones, limits around the group's norm; the exact limit left to group_factor."""
    rng = np.random.default_rng(50 + seed)
    kinds = [np.float32, np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64]
    problems: list[Problem] = []
    for _ in range(200):
        members: list[Spec] = []
        for _ in range(int(rng.integers(1, 7))):
            dtype = kinds[int(rng.integers(len(kinds)))]
            size = int(rng.integers(1, 5))
            scale = 0.0 if rng.random() < 0.15 else 10.0 ** rng.uniform(-5, 3)
            values = (rng.standard_normal(size) * scale).astype(dtype)
            members.append((values, bool(rng.random() < 0.3), False))
        norm = math.sqrt(sum(_norm(values) ** 2 for values, _, _ in members))
        problems.append((members, norm * float(rng.choice(RATIOS)), None))
    _compare_problems(problems)


@pytest.mark.parametrize("mode", [Mode.NORM, Mode.AVERAGE, Mode.GLOBAL])
def test_tensor_limit_is_the_exact_limit_rounded_down(mode: Mode) -> None:
    """tensor_limit answers C itself outside --average without making a Fraction: still
    the exact limit rounded down, at every size, for C at float64's extremes."""
    limits = [1.0, 0.1, 5e-324, 1.7976931348623157e308, 3.0, math.inf, 2.0**-1074 * 3]
    for limit in limits:
        spec = ClipSpec(mode, limit=limit)
        for numel in (0, 1, 3, 7, 10**6 + 1, 2**60 + 1):
            exact = exact_limit(spec, numel)
            value = tensor_limit(spec, numel)
            if exact is None:
                assert value == math.inf
                continue
            assert Fraction(value) <= exact if math.isfinite(value) else exact > 2**1023
            if math.isfinite(value) and value < 1.7976931348623157e308:
                assert Fraction(math.nextafter(value, math.inf)) > exact


SMALL = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("dtype", SMALL, ids=lambda d: np.dtype(d).name)
def test_histogram_problems_get_group_factor_bit_for_bit(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8- and 16-bit members with their histograms, searched together on them
    (_histogram_factors): tensors and groups of one dtype, zero members among live ones,
    exact ties (6s and 8s at C = 5 sqrt(m): the output lands on C), limits on both sides
    of the ambiguous band, subnormal outputs; every problem is searched together (the
    batch is counted), and the factor is the largest whose output's exact norm <= C."""
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize) * 7 + len(np.dtype(dtype).name))
    problems: list[Problem] = []
    for k in range(120):
        members: list[Spec] = []
        for _ in range(1 if k % 3 else int(rng.integers(2, 4))):
            if k % 5 == 0:
                m = int(rng.choice([1, 4, 9]))
                values = (np.array([6.0, 8.0] * m) * rng.choice([-1.0, 1.0], 2 * m)).astype(dtype)
            elif k % 7 == 0:
                values = np.zeros(3, dtype)
            else:
                size = int(rng.integers(1, 200))
                values = (rng.standard_normal(size) * 10.0 ** rng.uniform(-2, 1)).astype(dtype)
            members.append((values, True, False))
        norm = math.sqrt(sum(_norm(v) ** 2 for v, _, _ in members))
        ratio = 0.5 if k % 5 == 0 else float(rng.choice(RATIOS + [1e-3, 0.01]))
        limit = norm * ratio if norm else 1.0
        problems.append((members, limit, Fraction(limit)))
    searched = []
    batched = scaling._histogram_factors

    def counting(batch: Any, dtype: Any) -> np.ndarray:
        searched.append(len(batch.places))
        return batched(batch, dtype)

    monkeypatch.setattr(scaling, "_histogram_factors", counting)
    factors = _compare_problems(problems)
    assert sum(searched) >= 60  # most of them went through the batch
    for (members, limit, _), factor in zip(problems, factors, strict=True):
        if factor is not None:
            for values, _, _ in members:
                if len(members) == 1:
                    assert _output_within(values, factor, limit)


@pytest.mark.parametrize("limit", [1.34684704745754e-118, 9.332636185032189e-302, 5e-324])
def test_a_tiny_limit_warns_nothing(limit: float) -> None:
    """Outputs far over a tiny limit overflow the float64 sums of squares to inf (over the
    limit): no RuntimeWarning, alone or together, with or without histograms (attack s36:
    C = 1e-118 printed "overflow encountered in multiply")."""
    rng = np.random.default_rng(9)
    problems: list[Problem] = []
    for dtype in [*SMALL, np.float32, np.complex64]:
        top = float(finfo(np.dtype(dtype)).max) if dtype is not np.complex64 else 3e38
        values = (rng.uniform(-0.5, 0.5, 50) * top).astype(dtype)  # the search tries 1
        for kept in (True, False):
            problems.append(([(values, kept, False)], limit, Fraction(limit)))
        problems.append(([(values, True, False), (values[:5].copy(), True, False)], limit, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compare_problems(problems)


def test_histogram_problems_in_parts_of_bounded_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch is searched HISTOGRAM_VALUES_AT_ONCE distinct values at a time: exactly at
    the bound one part, a value more a new one; a problem over the bound alone. The same
    factors as group_factor whatever the parts."""
    monkeypatch.setattr(scaling, "HISTOGRAM_VALUES_AT_ONCE", 10)
    parts: list[list[int]] = []
    batched = scaling._histogram_factors

    def recording(batch: Any, dtype: Any) -> np.ndarray:
        parts.append([sum(bits.size for bits, _ in h) for h in batch.histograms])
        return batched(batch, dtype)

    monkeypatch.setattr(scaling, "_histogram_factors", recording)
    problems: list[Problem] = []
    for size in (3, 3, 4, 1, 25, 9, 2):  # distinct values each: 1, 2, 4, ... as float16
        values = np.arange(1, size + 1, dtype=np.float16) * np.float16(0.5)
        problems.append(([(values, True, False)], _norm(values) * 0.7, None))
    _compare_problems(problems)
    assert parts == [[3, 3, 4], [1], [25], [9], [2]]
