"""The factor search: one uniform scale for a tensor, a group or the whole checkpoint.

The factor is the largest one whose rounded output has norm <= C (DESIGN.md section 2).
For 8- and 16-bit floats the measuring pass's bit-pattern histograms make the search
exact without reading data again; for float32 and wider, the limit is decided or the
factor verified by a pass over the data, which the caller supplies as an OutputCheck
(clipcli.jobs.pipeline reads the file; a unit test may use arrays in memory). The search
itself is clipcli.numerics.scaling.group_factor; this module adapts the plan's measured
tensors to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction

from clipcli.formats.base import TensorInfo
from clipcli.jobs.measurement import TensorStats
from clipcli.numerics import scaling
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.scaling import Factor
from clipcli.system import interrupts

__all__ = ["Factor", "OutputCheck", "search_each_factor", "search_factor", "tf_factor"]

# The sum of squares of these tensors with every value scaled by mantissa * 2**exponent
# and rounded to its dtype, with a certain error bound. A check may also have a method
# `rounded_elsewhere(info) -> bool` (clipcli.jobs.execution.output_check: a logical tensor
# whose factor is rounded in its stored scales): the search then verifies every factor
# for a group that holds such a tensor (scaling.Member.rounded_elsewhere).
# A plain check may have `each(groups, mantissa, exponent) -> list[CertainSumsq]`: the
# check of each group, in order, in one go (clipcli.jobs.execution: small tensors read
# many at a time); the search then decides ties (a norm within rounding error of C)
# together. A check may also have `power_of_two(info) -> bool` (a logical tensor whose stored
# scales are E8M0 exponents) and `as_values(infos, mantissa, exponent)` (the same sum of
# squares with those tensors' real values scaled as float64): such a tensor's write takes
# the factor f rounded down to a power of two 2**-k, which the plan then records as its
# factor (clipcli.jobs.plan). In a group of such tensors alone the search checks them at
# 2**-k (the tightest power of two); in a group with other tensors it counts them as
# float64 values scaled by f, so that the others take the factor a plain checkpoint would
# give them, and each written value |2**-k x| <= |round(f x)| (rounding is monotone and
# 2**-k x is exact): the group's bound holds for what is written.
OutputCheck = Callable[[Sequence[TensorInfo], float, int], CertainSumsq]


def search_factor(
    members: Sequence[TensorStats],
    limit: float,
    check: OutputCheck,
    exact_limit: Fraction | None = None,
) -> Factor | None:
    """The factor for `members` together, None when they are within the limit already.
    It applies to the members with a nonzero sum of squares only: a zero tensor is left
    bit-identical. Refuses (exit 4) a limit that a dtype without zero cannot reach."""
    elsewhere = getattr(check, "rounded_elsewhere", None)
    power = getattr(check, "power_of_two", None)
    if _plain(check):  # one record per member
        powers: Sequence[bool] = ()  # read only where as_values
        as_values = False
        as_members: Sequence[scaling.Measured] = members  # no record of each (200,000)
    else:
        powers = [power is not None and bool(power(m.info)) for m in members]
        live = [p for p, m in zip(powers, members, strict=True) if m.stats.ssq > 0]
        as_values = any(live) and not all(live)  # power-of-two tensors beside others
        as_members = [
            scaling.Member(
                m.info.name,
                m.info.dtype,
                m.info.numel,
                m.stats,
                not (as_values and p) and elsewhere is not None and bool(elsewhere(m.info)),
                p and not as_values,
            )
            for m, p in zip(members, powers, strict=True)
        ]

    stored = _pass_over(check, members)

    def output_sumsq(which: Sequence[int], factor: Factor) -> CertainSumsq:
        if not as_values:
            return stored(which, factor)
        others = [members[i].info for i in which if not powers[i]]
        total = check(others, factor.mantissa, factor.exponent)
        values = [members[i].info for i in which if powers[i]]
        total.merge(check.as_values(values, factor.mantissa, factor.exponent))  # type: ignore[attr-defined]
        return total

    return scaling.group_factor(as_members, limit, output_sumsq, exact_limit)


def search_each_factor(
    problems: Iterable[scaling.Problem[TensorStats]], check: OutputCheck
) -> Iterator[Factor | None]:
    """search_factor(members, limit, check, exact_limit) for each problem (members, limit,
    exact_limit) in order: --norm and --average (a tensor each), --group-by (a group each).
    The same factors; those of a plain checkpoint's tensors are searched together
    (scaling.each_factor)."""
    if not _plain(check):
        return _one_by_one(problems, check)
    each = getattr(check, "each", None)
    stored_sumsq_each = None
    if each is not None:  # ties decided together: the members as stored, a read for many

        def stored_sumsq_each(groups: Sequence[Sequence[TensorStats]]) -> list[CertainSumsq]:
            sums: list[CertainSumsq] = each([[m.info for m in group] for group in groups], 1.0, 0)
            return sums

    output_sumsq_of = functools.partial(_pass_over, check)
    return scaling.each_factor(problems, output_sumsq_of, stored_sumsq_each, interrupts.check)


def _one_by_one(
    problems: Iterable[scaling.Problem[TensorStats]], check: OutputCheck
) -> Iterator[Factor | None]:
    for members, limit, exact in problems:
        interrupts.check()  # between searches: a signal must not wait for them all
        yield search_factor(members, limit, check, exact)


def _plain(check: OutputCheck) -> bool:
    """A check that asks none of the optional questions: a plain checkpoint, each tensor's
    output its own values rounded to its own dtype."""
    return getattr(check, "rounded_elsewhere", None) is None and (
        getattr(check, "power_of_two", None) is None
    )


def _pass_over(check: OutputCheck, members: Sequence[TensorStats]) -> scaling.OutputSumsq:
    """The search's pass over members[which] scaled by a factor: the check of their infos."""

    def output_sumsq(which: Sequence[int], factor: Factor) -> CertainSumsq:
        return check([members[i].info for i in which], factor.mantissa, factor.exponent)

    return output_sumsq


def tf_factor(use_norm: float, limit: float) -> Factor | None:
    """--use-norm: TF's factor C / N as given (53 bits; see scaling.given_norm_factor)."""
    return scaling.given_norm_factor(use_norm, limit)
