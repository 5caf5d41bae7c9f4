"""`clip --norm C --axes ...` on long slices of wide floats: the searches' checks of their
output are made for every slice together (issue 20, speed at scale).

A long slice (numerics.slices.counts_long_slices) is searched as a tensor of its own, and
a float64 search checks its factor with a pass over the slice's rounded output (a tie, a
factor below 2**-900 or a float32 tie too). Each check was a pass over the boxes holding
its slice: float64 [2**21, 64] with --axes 0, whose boxes each hold a piece of every
column, read its 1 GiB at least 64 times (20 s). Now the searches run in lockstep
(slices._lockstep_factors): one pass answers what every search asked.

References: each slice searched as before, its checks each a pass of its own
(scaling.each_factor with a direct OutputSumsq, written out here), whose factors must be
the same bit for bit; and the number of passes made.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_axes_bounded_memory import boxes_of

from clipcli.errors import DataRefusedError
from clipcli.numerics import scaling, slices
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.scaling import Factor, OutputSumsq, Problem, each_factor

BUDGET = 64  # box elements: every slice below is longer than a box
ROW = 144


def _one_at_a_time(
    problems: Sequence[Problem[slices._CountedSlice]],
    boxes: slices.Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    between: Callable[[], None],
) -> list[Factor | None]:
    """The searches as they ran before: each check a pass over its own slice's boxes."""

    def output_sumsq_of(of: Sequence[slices._CountedSlice]) -> OutputSumsq:
        def asked(members: Sequence[int], factor: Factor) -> CertainSumsq:
            if not members:
                return CertainSumsq()
            question = slices._Question(of[0].number, factor.mantissa, factor.exponent)
            return slices._output_sums(boxes, shape, axes, [question])[question]

        return asked

    return list(each_factor(problems, output_sumsq_of, between=between))


def _counting_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many questions each pass over the boxes answered (slices._output_sums spied on)."""
    passes: list[int] = []
    plain_sums = slices._output_sums

    def counted(*args: Any) -> dict[slices._Question, CertainSumsq]:
        passes.append(len(args[-1]))
        return plain_sums(*args)

    monkeypatch.setattr(slices, "_output_sums", counted)
    return passes


def _rows(dtype: type, rows: int, seed: int) -> np.ndarray:
    """Rows of ROW normals; row 0 all ones (norm 12: a limit of 12 is an exact tie), row 1
    all ones too, row 2 zero."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, ROW))
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal((rows, ROW))
    values[0] = values[1] = 1
    values[2] = 0
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize(("transpose", "axes"), [(False, (1,)), (True, (0,))])
def test_lockstep_checks_give_each_slice_searched_alone_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: type, transpose: bool, axes: tuple[int, ...]
) -> None:
    """Rows (--axes 1) and the same slices as columns (--axes 0, every box a piece of each):
    at a tie, a float under it, half the median norm (float64's checks: a shrink where TF's
    factor rounds over), a factor below 2**-900 and no clip at all."""
    rows = _rows(dtype, 12, seed=np.dtype(dtype).itemsize)
    array = np.ascontiguousarray(rows.T) if transpose else rows
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1)
    assert slices.counts_long_slices(array.shape, axes, array.dtype, BUDGET)
    norms = np.sqrt(np.sum(np.abs(rows.astype(np.complex128)) ** 2, axis=1))
    limits = [12.0, math.nextafter(12.0, 0.0), float(np.median(norms)) * 0.5, 1e-300, 1e30]
    for limit in limits:
        with monkeypatch.context() as spied:
            rounds = _counting_passes(spied)
            together = slices.streamed_axes_scales(
                boxes_of(array, BUDGET), array.shape, axes, array.dtype, limit
            )
        with monkeypatch.context() as alone:
            alone.setattr(slices, "_lockstep_factors", _one_at_a_time)
            apart = slices.streamed_axes_scales(
                boxes_of(array, BUDGET), array.shape, axes, array.dtype, limit
            )
        assert together.tobytes() == apart.tobytes(), limit
        # Every search that asked was answered a round at a time: rounds end with one that
        # asks nothing (none where no search asks), and no round asks more than a
        # question per slice.
        assert not rounds or rounds[-1] == 0
        assert all(asked <= len(rows) for asked in rounds)
        assert len(rounds) <= 4, rounds
        assert (together.reshape(-1)[0] != 1.0) == (limit < 12.0)  # the tie left alone


def test_a_float64_check_of_every_row_is_one_pass_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 float64 rows whose factors are each checked: a few passes in all, not one a row."""
    rows = _rows(np.float64, 64, seed=3)
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1)
    passes = _counting_passes(monkeypatch)
    columns = np.ascontiguousarray(rows.T)
    slices.streamed_axes_scales(boxes_of(columns, BUDGET), columns.shape, (0,), columns.dtype, 5.0)
    assert passes[0] == 63  # every row's first check (all but the zero row are over 5)
    assert len(passes) <= 4, passes


def test_an_answer_given_again_is_a_copy() -> None:
    """A search may add to the sum it is given: an answer kept for a later run is not
    changed by it (CertainSumsq.copy)."""
    total = CertainSumsq()
    total.add(np.array([3.0, 4.0]))
    copied = total.copy()
    copied.add(np.array([12.0]))
    assert total.at_most(5.0)
    assert not total.at_most(math.nextafter(5.0, 0.0))
    assert copied.at_most(13.0)
    assert not copied.at_most(math.nextafter(13.0, 0.0))


def test_a_refusal_is_the_first_slices_as_one_search_after_another_raised_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float8_e8m0fnu has no zero: slices whose limit no factor reaches are refused (exit
    4), and the slice named is the first such, as the searches one at a time named it."""
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1)
    array = np.ones((4, ROW), ml_dtypes.float8_e8m0fnu)
    array[0] = 2.0**-127  # the least norm the dtype allows is sqrt(144) * 2**-127
    messages = []
    for lockstep in (True, False):
        with monkeypatch.context() as patched:
            if not lockstep:
                patched.setattr(slices, "_lockstep_factors", _one_at_a_time)
            with pytest.raises(DataRefusedError) as refused:
                slices.streamed_axes_scales(
                    boxes_of(array, BUDGET), array.shape, (1,), array.dtype, 12 * 2.0**-127
                )
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    assert "slice 1" in messages[0], messages[0]


def test_searches_that_ask_nothing_are_searched_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bfloat16 slices searched on their histograms ask for no output: each_factor runs
    once for them all, as before the lockstep (one at a time: ~7 ms a slice, attack s44),
    and no pass is made."""
    rows = _rows(ml_dtypes.bfloat16, 12, seed=5)
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1)
    calls: list[int] = []
    plain_each = scaling.each_factor

    def counted_each(problems: Sequence[Problem[Any]], *args: Any, **kwargs: Any) -> Any:
        calls.append(len(problems))
        return plain_each(problems, *args, **kwargs)

    monkeypatch.setattr(slices, "each_factor", counted_each)
    passes = _counting_passes(monkeypatch)
    scales = slices.streamed_axes_scales(boxes_of(rows, BUDGET), rows.shape, (1,), rows.dtype, 6.0)
    assert np.count_nonzero(scales != 1.0) == 11  # every row but the zero one
    assert calls == [11]  # the 11 slices over it, the zero one no candidate
    assert passes == []


@pytest.mark.parametrize("limit", [1e300, sys.float_info.max])
def test_a_limit_past_float64_over_tiny_slices_warns_nothing(limit: float) -> None:
    """limit / norm overflows float64 for a bfloat16 slice of subnormals: such a slice is
    within the limit, and no RuntimeWarning reaches stderr (exit 70 under -W error: attack
    s44)."""
    array = np.empty((ROW, 2), ml_dtypes.bfloat16)
    array[:, 0] = 1e-3
    array[:, 1] = 2.0**-133
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
            patched.setattr(slices, "LONG_SLICE_BYTES", 1)
            scales = slices.streamed_axes_scales(
                boxes_of(array, BUDGET), array.shape, (0,), array.dtype, limit
            )
    assert np.all(scales == 1.0)
