"""`clip --norm C --axes ...` in bounded memory (issue 20): a tensor of more than one box
is read box by box, its slices' sums of squares added up over the boxes, and scaled box by
box in a last pass, never held whole. The box budget is lowered here (a 1 GiB tensor is a
benchmark, benchmarks/many_tensors.py), so that slices span box boundaries.

References: exact sums of squares as Fractions, numpy's float64 norms, the in-memory path
(numerics.slices.axes_scales on the whole array) and the file read by hand (handmade).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from handmade import read_safetensors, write_safetensors

from clipcli.cli.entry import main
from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.jobs import execution
from clipcli.numerics import slices
from clipcli.numerics.rounding import scale_chunk


def boxes_of(array: np.ndarray, budget: int) -> slices.Boxes:
    indices = slices.box_indices(array.shape, budget)

    def one_pass(only: Callable[[slices.BoxIndex], bool] | None = None) -> Iterator[slices.Box]:
        for index in indices:
            if only is None or only(index):  # the others unread, as at random access
                yield array[index].reshape(slices.box_shape(array.shape, index)), index

    return one_pass


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 5), (2, 3, 1, 4)])
@pytest.mark.parametrize("budget", [1, 3, 4, 5, 19, 20, 21, 60, 120, 121])
def test_boxes_are_the_tensor_in_order_and_within_the_budget(
    shape: tuple[int, ...], budget: int
) -> None:
    array = np.arange(math.prod(shape)).reshape(shape)
    pieces = [box for box, _ in boxes_of(array, budget)()]
    assert np.array_equal(np.concatenate([p.reshape(-1) for p in pieces]), array.reshape(-1))
    row = shape[-1]
    assert all(p.size <= max(budget, row) for p in pieces)
    if math.prod(shape) <= budget:  # it fits: one box, exactly at the budget too
        assert len(pieces) == 1
    else:  # one element past the budget: cut
        assert len(pieces) > 1


def test_a_box_budget_of_exactly_the_tensor_is_one_box_and_one_less_is_two() -> None:
    assert len(slices.box_indices((4, 5), 20)) == 1
    assert len(slices.box_indices((4, 5), 19)) == 2  # rows of 5: 3 rows, then 1


def exact_sumsq(values: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in values.reshape(-1)), Fraction(0))


@pytest.mark.parametrize("budget", [11, 12, 13])  # rows of 12: at the boundary and past it
def test_slice_sums_across_boxes_are_exact(budget: int) -> None:
    rng = np.random.default_rng(budget)
    array = (rng.standard_normal((7, 12)) * 1e3).astype(np.float32)
    for axes in [(0,), (1,), (0, 1)]:
        sums, exps = slices.streamed_sumsq(boxes_of(array, budget), array.shape, axes, array.dtype)
        moved = np.moveaxis(array, axes, range(array.ndim - len(axes), array.ndim))
        rows = moved.reshape(-1, math.prod(array.shape[a] for a in axes))
        for got, exp, row in zip(sums.reshape(-1), exps.reshape(-1), rows, strict=True):
            exact = exact_sumsq(row)
            measured = Fraction(float(got)) * Fraction(4) ** int(exp)
            assert abs(measured - exact) <= exact * Fraction(1, 10**12)


def test_float64_extremes_across_boxes_keep_their_scale() -> None:
    """float64 slices of 1e200 and 1e-200 need a power of two taken out first (a pass of
    peaks): squared as they are, they overflow or vanish."""
    array = np.array([[1e200, 3e-200], [2e200, -4e-200], [-1e200, 5e-200]], np.float64)
    sums, exps = slices.streamed_sumsq(boxes_of(array, 2), array.shape, (0,), array.dtype)
    for column in range(2):
        measured = Fraction(float(sums[0, column])) * Fraction(4) ** int(exps[0, column])
        exact = exact_sumsq(array[:, column])
        assert abs(measured - exact) <= exact * Fraction(1, 10**12)


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_streamed_scales_are_the_in_memory_ones(dtype: type) -> None:
    rng = np.random.default_rng(1)
    for shape in [(7, 5, 3), (4, 9), (2, 3, 4, 5)]:
        values = rng.standard_normal(shape) * 3
        if np.dtype(dtype).kind == "c":
            values = values + 1j * rng.standard_normal(shape)
        array: np.ndarray = values.astype(dtype)
        for r in range(1, len(shape) + 1):
            for axes in itertools.permutations(range(len(shape)), r):
                _, whole = slices.axes_scales(array, axes, 1.5)
                for budget in [1, 4, 7, 1000]:
                    boxes = boxes_of(array, budget)
                    streamed = slices.streamed_axes_scales(
                        boxes, array.shape, axes, array.dtype, 1.5
                    )
                    assert np.array_equal(whole, streamed), (shape, axes, budget)
                    out = np.empty_like(array)
                    for box, index in boxes():
                        scaled = scale_chunk(box, streamed[slices.box_region(index, axes)])
                        out[index] = scaled.reshape(array[index].shape)
                    assert out.tobytes() == slices.scale_slices(array, whole, axes).tobytes()


def test_a_slice_whose_norm_is_the_limit_exactly_stays() -> None:
    """The near-the-limit check gathers the slices in question across boxes (3-4-5)."""
    array = np.array([[3.0, 1.0], [4.0, 1.0]], np.float32)  # columns: norm 5, norm sqrt 2
    scales = slices.streamed_axes_scales(boxes_of(array, 1), array.shape, (0,), array.dtype, 5.0)
    assert scales.reshape(-1).tolist() == [1.0, 1.0]
    scales = slices.streamed_axes_scales(boxes_of(array, 1), array.shape, (0,), array.dtype, 4.999)
    assert scales.reshape(-1)[0] < 1.0
    assert scales.reshape(-1)[1] == 1.0


@pytest.fixture
def small_boxes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Boxes of 64 elements, the sizes of the boxes summed (what is held at once), and no
    tensor read whole."""
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 64)
    held: list[int] = []
    real = slices._sum_squares

    def spy(array: np.ndarray, axes: tuple[int, ...], exps: np.ndarray) -> np.ndarray:
        held.append(array.size)
        return real(array, axes, exps)

    real_read = SafetensorsReader.read

    def never(self: SafetensorsReader, info: TensorInfo) -> np.ndarray:
        if info.name == "w":  # the tensor of many boxes
            raise AssertionError(f"{info} read whole")
        return real_read(self, info)

    monkeypatch.setattr(slices, "_sum_squares", spy)
    monkeypatch.setattr(SafetensorsReader, "read", never)
    return held


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=str)
@pytest.mark.parametrize("axes", ["0", "1", "0,1", "-1"])
def test_clip_axes_holds_one_box_at_a_time(
    tmp_path: Path, small_boxes: list[int], dtype: type, axes: str
) -> None:
    rng = np.random.default_rng(5)
    original: np.ndarray = (rng.standard_normal((37, 20)) * 2).astype(
        dtype
    )  # rows of 20: boxes of 60
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original, "b": np.ones((3, 1))})
    out = tmp_path / "out.safetensors"
    limit = 3.0
    assert main(["clip", "--norm", str(limit), "--axes", axes, "-q", str(src), str(out)]) == 0
    assert small_boxes
    assert max(small_boxes) <= 64  # never more than a box
    clipped = read_safetensors(out)["w"]
    axis = tuple(int(a) % 2 for a in axes.split(","))
    per_slice = math.prod(clipped.shape[a] for a in axis)
    moved = np.moveaxis(clipped, axis, range(2 - len(axis), 2)).reshape(-1, per_slice)
    assert all(exact_sumsq(row) <= Fraction(limit) ** 2 for row in moved)  # exactly
    # The same bytes as the in-memory path (the whole array, numerics.slices).
    _, scales = slices.axes_scales(original, axis, limit)
    assert clipped.tobytes() == slices.scale_slices(original, scales, axis).tobytes()


def test_clip_axes_within_the_limit_copies_the_tensor_bit_for_bit(
    tmp_path: Path, small_boxes: list[int]
) -> None:
    original = (np.random.default_rng(2).standard_normal((30, 10)) / 100).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 0
    assert small_boxes
    assert out.read_bytes() == src.read_bytes()


def test_a_tensor_of_one_box_is_clipped_in_memory_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 200)  # exactly the tensor
    streamed: list[int] = []
    real = execution._clip_slices_streamed

    def spy(*args: object) -> object:
        streamed.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(execution, "_clip_slices_streamed", spy)
    original = np.random.default_rng(3).standard_normal((20, 10)).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 0
    assert streamed == []
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 199)  # one element short: streamed
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", "--force", str(src), str(out)]) == 0
    assert streamed == [1]
