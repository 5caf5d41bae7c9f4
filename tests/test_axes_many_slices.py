"""`clip --norm C --axes ...` on tensors of millions of slices (issue 20, "--axes in bounded
memory"): per-slice arrays of the whole tensor (norms, ratios, masks, factors, the values
of every slice over the limit widened to float64) took 4.4 GB for a 100 MB float16 tensor of
25 million two-element slices.

- Where each box holds whole slices (the boxes cut an axis before every reduced one), a
  box's factors come from the box alone: memory is one box's.
- Otherwise the slices' sums are kept (9 bytes a slice) and their factors are worked out a
  piece of slices at a time, each piece's sums giving way to its factors.

Either way each slice's factor must be the one the whole tensor gives it, bit for bit: the
references are the in-memory path (numerics.slices.axes_scales on the whole array), exact
sums of squares as Fractions, and the old whole-tensor streamed path's output.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from handmade import read_safetensors, write_safetensors
from peak_memory import peak_rss
from test_axes_bounded_memory import boxes_of, exact_sumsq

from clipcli.cli.entry import main
from clipcli.numerics import slices


def holds_whole_slices(shape: tuple[int, ...], axes: tuple[int, ...], budget: int) -> bool:
    """From the boxes themselves: every reduced axis whole in every box."""

    def whole(part: int | slice, n: int) -> bool:
        return isinstance(part, slice) and part.indices(n) == (0, n, 1)

    return all(
        whole(index[a], shape[a]) or shape[a] == 1 and index[a] == 0
        for index in slices.box_indices(shape, budget)
        for a in axes
    )


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 5), (2, 3, 1, 4)])
@pytest.mark.parametrize("budget", [1, 3, 4, 5, 19, 20, 21, 60, 120, 121])
def test_boxes_hold_whole_slices_as_the_boxes_show(shape: tuple[int, ...], budget: int) -> None:
    for r in range(1, len(shape) + 1):
        for axes in itertools.combinations(range(len(shape)), r):
            expected = holds_whole_slices(shape, axes, budget)
            assert slices.boxes_hold_whole_slices(shape, axes, budget) == expected, axes


def test_whole_slices_exactly_at_the_budget() -> None:
    # (4, 5): one box at 20 elements, so every slice is whole; at 19 rows are cut apart.
    assert slices.boxes_hold_whole_slices((4, 5), (0,), 20)
    assert not slices.boxes_hold_whole_slices((4, 5), (0,), 19)
    assert slices.boxes_hold_whole_slices((4, 5), (1,), 19)
    # rows of 5 exactly at the budget stay whole; one element less cuts the row.
    assert slices.boxes_hold_whole_slices((4, 5), (1,), 5)
    assert not slices.boxes_hold_whole_slices((4, 5), (1,), 4)


DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    np.complex64,
]


def random_array(shape: tuple[int, ...], dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 3
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    array: np.ndarray = values.astype(dtype)
    return array


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_a_boxs_own_factors_are_the_whole_tensors(dtype: type) -> None:
    for shape in [(7, 5, 3), (9, 4), (3, 2, 4, 5)]:
        array = random_array(shape, dtype, 11)
        for r in range(1, len(shape)):
            for axes in itertools.combinations(range(1, len(shape)), r):
                _, whole = slices.axes_scales(array, axes, 1.5)
                for budget in [1, 4, 7, 30]:
                    if not slices.boxes_hold_whole_slices(shape, axes, budget):
                        continue
                    for box, index in boxes_of(array, budget)():
                        own = slices.box_axes_scales(box, axes, array.dtype, 1.5)
                        region = slices.box_region(index, axes)
                        assert np.array_equal(own, whole[region]), (shape, axes, budget)


@pytest.mark.parametrize("slice_count", [1, 2, 3, 4, 5, 6])
def test_slice_pieces_cover_every_slice_once_exactly_at_the_step(
    slice_count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slices, "SLICE_PIECE", 3)
    pieces = slices.slice_pieces(slice_count, 1)
    covered = [i for piece in pieces for i in range(slice_count)[piece]]
    assert covered == list(range(slice_count))
    assert len(pieces) == (1 if slice_count <= 3 else 2)  # 3 slices: one piece; 4: two


def test_slice_pieces_hold_at_most_the_values_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slices, "SLICE_PIECE_VALUES", 12)
    assert [p.stop - p.start for p in slices.slice_pieces(8, 4)] == [3, 3, 2]  # 12 values
    assert [p.stop - p.start for p in slices.slice_pieces(8, 13)] == [1] * 8  # one at least


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(("piece", "window_bytes"), [(1, 1), (2, 64), (5, 1 << 20)])
def test_factors_worked_out_by_pieces_are_the_whole_tensors(
    dtype: type, piece: int, window_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of 1, 2 and 5 slices; their values gathered a piece at a time, a few
    pieces at a time, and all at once."""
    monkeypatch.setattr(slices, "SLICE_PIECE", piece)
    monkeypatch.setattr(slices, "SLICE_WINDOW_BYTES", window_bytes)
    for shape in [(7, 5, 3), (4, 9), (2, 3, 4, 5)]:
        array = random_array(shape, dtype, 3)
        for r in range(1, len(shape) + 1):
            for axes in itertools.permutations(range(len(shape)), r):
                _, whole = slices.axes_scales(array, axes, 1.5)
                for budget in [1, 7, 1000]:
                    got = slices.streamed_axes_scales(
                        boxes_of(array, budget), array.shape, axes, array.dtype, 1.5
                    )
                    assert np.array_equal(got, whole), (shape, axes, budget)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block_values", [1, 9, 10, 11, 19, 20, 1 << 20])
def test_float64_margins_by_blocks_of_rows_are_the_whole_windows(
    dtype: type, block_values: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float64 slices' margins are worked out a block of rows at a time (rows of 10
    float64 values: a row a block for 1, 9, 10 and 11 values, one row short of 20, two at 20, all
    at once): the factors are the ones the whole window gives, bit for bit."""
    array = random_array((10, 10), dtype, 4)
    if np.dtype(dtype).kind == "c":
        array = array[:, :5].copy()  # 5 complex values: rows of 10 float64 parts
    _, whole = slices.axes_scales(array, (1,), 1.5)
    monkeypatch.setattr(slices, "MARGIN_BLOCK_VALUES", block_values)
    _, blocked = slices.axes_scales(array, (1,), 1.5)
    assert np.array_equal(blocked, whole)
    assert np.count_nonzero(whole != 1.0) > 1


@pytest.mark.parametrize("pieces", [1, 5, 6, 7, 12])
def test_windows_group_pieces_up_to_the_window_exactly(pieces: int) -> None:
    """Pieces of 2 slices in windows of 6 slices: 3 pieces a window, a 4th starts the next."""
    ranges = [slice(2 * k, 2 * k + 2) for k in range(pieces)]
    windows = slices._windows(ranges, 6)
    assert [piece for window in windows for piece in window] == ranges
    assert [len(window) for window in windows] == [
        min(3, pieces - 3 * k) for k in range(len(windows))
    ]
    assert all(window[-1].stop - window[0].start <= 6 for window in windows)
    assert slices._windows([slice(0, 9)], 6) == [[slice(0, 9)]]  # a piece over it: alone


def test_one_pass_gathers_a_windows_values_not_one_per_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """24 float16 columns, all over the limit, in pieces of 2: a window of 6 columns
    (6 x 5 values x 2 bytes) takes one pass for its 3 pieces. Passes: the sums' and 4."""
    monkeypatch.setattr(slices, "SLICE_PIECE", 2)
    monkeypatch.setattr(slices, "SLICE_WINDOW_BYTES", 60)
    array = random_array((5, 24), np.float16, 8)
    boxes = boxes_of(array, 7)
    passes: list[int] = []

    def counted(only: Callable[[slices.BoxIndex], bool] | None = None) -> Iterator[slices.Box]:
        passes.append(1)
        return boxes(only)

    got = slices.streamed_axes_scales(counted, array.shape, (0,), array.dtype, 0.5)
    assert np.all(got < 1.0)
    assert len(passes) == 1 + 24 // 6
    _, whole = slices.axes_scales(array, (0,), 0.5)
    assert np.array_equal(got, whole)


def test_a_slice_at_the_limit_exactly_stays_in_any_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact check gathers a piece's near slices only; 3-4-5 columns in three pieces."""
    monkeypatch.setattr(slices, "SLICE_PIECE", 1)
    array = np.array([[3.0, 1.0, 4.0], [4.0, 1.0, 3.0]], np.float32)  # norms 5, sqrt 2, 5
    scales = slices.streamed_axes_scales(boxes_of(array, 1), array.shape, (0,), array.dtype, 5.0)
    assert scales.reshape(-1).tolist() == [1.0, 1.0, 1.0]
    scales = slices.streamed_axes_scales(boxes_of(array, 1), array.shape, (0,), array.dtype, 4.999)
    factors = scales.reshape(-1)
    assert factors[0] < 1.0
    assert factors[1] == 1.0
    assert factors[2] < 1.0


def clip_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["clip", *args, "--format", "json"]) == 0
    report: dict[str, object] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("axes", ["1", "0", "-1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_streamed_clip_reports_and_writes_what_the_in_memory_clip_does(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    axes: str,
    dtype: type,
) -> None:
    """Slices that clip only in some boxes (the first box has none): the count of clipped
    slices, the norms after, the flushes and every byte are those of the whole tensor held
    in memory."""
    rng = np.random.default_rng(9)
    values = rng.standard_normal((40, 12)) * 0.1
    values[25:, :] *= 40  # rows 25 and on are over the limit in --axes 1; columns in all
    original: np.ndarray = values.astype(dtype)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    limit = "2.5"
    reports, outputs = [], []
    for budget in [1 << 20, 36]:  # the whole tensor in one box; boxes of three rows
        monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", budget)
        out = tmp_path / f"out{budget}.safetensors"
        reports.append(clip_json(["--norm", limit, "--axes", axes, str(src), str(out)], capsys))
        outputs.append(out.read_bytes())
        reports[-1].pop("out")
    assert outputs[0] == outputs[1]
    clipped = read_safetensors(tmp_path / "out36.safetensors")["w"]
    exact_after = math.sqrt(exact_sumsq(clipped))
    # The norm after is summed box by box when streamed (as every chunked tensor's is): it
    # may differ from the whole array's in the last bit; both are within 2**-50 of exact.
    for report in reports:
        tensor = report["tensors"][0]  # type: ignore[index]
        assert math.isclose(tensor.pop("norm_after"), exact_after, rel_tol=2.0**-50)
        assert math.isclose(report.pop("global_norm_after"), exact_after, rel_tol=2.0**-50)  # type: ignore[arg-type]
        assert "slices clipped" in tensor["note"]
    assert reports[0] == reports[1]
    axis = int(axes) % 2
    rows = np.moveaxis(clipped, axis, 1).reshape(-1, clipped.shape[axis])
    assert all(exact_sumsq(row) <= Fraction(2.5) ** 2 for row in rows)


def test_box_by_box_within_the_limit_copies_the_tensor_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 36)
    original = (np.random.default_rng(2).standard_normal((30, 12)) / 100).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    out = tmp_path / "out.safetensors"
    assert slices.boxes_hold_whole_slices(original.shape, (1,), 36)
    assert main(["clip", "--norm", "1", "--axes", "1", "-q", str(src), str(out)]) == 0
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize(("shape", "axes"), [((4_000_000, 2), "1"), ((2, 4_000_000), "0")])
def test_four_million_slices_are_clipped_in_bounded_memory(
    tmp_path: Path, shape: tuple[int, int], axes: str
) -> None:
    """A 32 MB float32 tensor of 4 million two-element slices: 660 MB with whole-tensor
    per-slice arrays; now ~140 MB (whole slices in each box) and ~165 MB (slices cut by the
    boxes: their sums stay, 9 bytes a slice). The bound is what is left over a budget of
    200 MiB for the tensor's own size, as issue 20 sets for --axes."""
    original: np.ndarray = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    out = tmp_path / "out.safetensors"
    code, peak, stderr = peak_rss(
        "clip", "--norm", "1", "--axes", axes, "-q", "--no-fsync", src, out
    )
    assert code == 0, stderr
    assert peak < 200 << 20, peak
    clipped = read_safetensors(out)["w"]
    axis = int(axes)
    norms = np.sqrt(np.sum(clipped.astype(np.float64) ** 2, axis=axis))
    assert np.all(norms <= 1.0)
    assert math.isclose(float(norms.max()), 1.0, rel_tol=1e-6)


def round_exactly(q: Fraction, dtype: type) -> Fraction:
    """q rounded to nearest, ties to even, into dtype's significand and exponent range,
    from its definition (ml_dtypes.finfo for the precision and smallest normal exponent);
    past the largest finite value: infinite (as a huge Fraction, over any limit)."""
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    digits, min_exp = int(info.nmant) + 1, int(info.minexp)
    if q == 0:
        return Fraction(0)
    magnitude = abs(q)
    exp = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exp > magnitude:
        exp -= 1
    spacing = Fraction(2) ** (max(exp, min_exp) - digits + 1)
    rounded = round(magnitude / spacing) * spacing  # Fraction rounds half to even
    if rounded > Fraction(float(info.max)):
        return Fraction(10) ** 400
    return rounded


def assert_largest_within(
    array: np.ndarray, scales: np.ndarray, limit: float, bits: int, dtype: type
) -> None:
    """Each row's factor: its output's exact norm (fractions) is <= limit, and one step of
    the search's grid more takes it over; a row left as it is (factor 1) is within."""
    bound = Fraction(limit) ** 2
    for row, factor in zip(array, scales.reshape(-1), strict=True):
        exact = [Fraction(float(v)) for v in row.astype(np.float64)]
        if factor == 1.0:
            assert sum(v * v for v in exact) <= bound  # within: left as it is
            continue
        s = Fraction(float(factor))
        assert sum(round_exactly(v * s, dtype) ** 2 for v in exact) <= bound
        step = Fraction(2) ** (math.frexp(float(factor))[1] - 1 - bits + 1)
        above = sum(round_exactly(v * (s + step), dtype) ** 2 for v in exact)
        assert above > bound, (factor, float(above / bound))


@pytest.mark.parametrize(
    "dtype",
    [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
    ids=lambda d: np.dtype(d).name,
)
def test_small_float_slice_factors_are_within_the_limit_and_the_largest(dtype: type) -> None:
    """Each clipped slice's factor s: the exact sum of its rounded products is <= C**2, and
    at the next factor of the search's grid it is over C**2, exactly (the float64 margin
    decides only where its sign is certain). The slices' histograms, narrowing and jumps
    are checked from the outside."""
    from clipcli.numerics.search import exact_product_bits

    rng = np.random.default_rng(21)
    values = rng.standard_normal((24, 60)) * rng.choice([0.01, 1.0, 20.0], size=(24, 1))
    values[rng.random(values.shape) < 0.2] = 0.0
    array: np.ndarray = values.astype(dtype)
    wide = array.astype(np.float64)
    norms = np.sqrt((wide * wide).sum(axis=1))
    bits = exact_product_bits([array.dtype])
    # Limits at a slice's own output norm and a hair around it: where the float64 sum's
    # rounding could decide (an attack's float16 row of 10 needed this).
    tied = [float(np.sqrt(np.sum(wide[k] ** 2))) * 0.7 for k in range(3)]
    near = [math.nextafter(t, direction) for t in tied for direction in (0.0, math.inf)]
    for limit in [float(np.median(norms)), float(norms.min()) * 0.5, *tied, *near]:
        _, scales = slices.axes_scales(array, (1,), limit)
        assert_largest_within(array, scales, limit, bits, dtype)


def test_an_attacks_float16_row_gets_the_same_factor_alone_and_among_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row whose output at the largest fitting factor is 15 roundings under C**2: the
    float64 sum's order decided it, and the search's narrowing moved the factor a step
    down. Its factor must be the same alone, among 30 random rows, and in pieces."""
    bits = [15398, 16622, 15342, 50130, 16751, 15707, 48754, 16121, 15456, 15119]
    row = np.array(bits, np.uint16).view(np.float16).reshape(1, 10)
    limit = 4.438546608014401
    alone = slices.axes_scales(row, (1,), limit)[1].item()
    others = (np.random.default_rng(6).standard_normal((30, 10)) * 2).astype(np.float16)
    for at in (0, 15, 30):
        mixed = np.concatenate([others[:at], row, others[at:]])
        assert slices.axes_scales(mixed, (1,), limit)[1][at].item() == alone
        monkeypatch.setattr(slices, "SLICE_PIECE", 4)
        streamed = slices.streamed_axes_scales(
            boxes_of(mixed, 20), mixed.shape, (1,), mixed.dtype, limit
        )
        monkeypatch.undo()
        assert streamed[at].item() == alone
    wide = row.astype(np.float64) * alone
    out = [Fraction(float(v)) for v in wide.astype(np.float16).reshape(-1)]
    assert sum(v * v for v in out) <= Fraction(limit) ** 2
    assert alone == 0.7000364697300938  # the largest: the one the previous version found


@pytest.mark.parametrize(
    "dtype",
    [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
    ids=lambda d: np.dtype(d).name,
)
def test_ties_land_exactly_on_the_limit(dtype: type) -> None:
    """Rows of four +-2 and one-element slices: their best outputs (+-0.5 each, norm 1;
    +-0.5) have norm exactly C. Every slice must reach it (a float64 margin rejects the
    tie; the exact check takes it, as one subtraction per slice: attack s32att2 found the
    fractions it first took 60-200x slower than the old search)."""
    rng = np.random.default_rng(12)
    rows: np.ndarray = rng.choice([-2.0, 2.0], size=(1000, 4)).astype(dtype)
    _, factors = slices.axes_scales(rows, (1,), 1.0)
    out = (rows.astype(np.float64) * factors).astype(dtype).astype(np.float64)
    assert np.all(np.sum(out * out, axis=1) == 1.0)
    singles: np.ndarray = rng.choice([-3.0, 1.5, 6.0], size=(1, 1000)).astype(dtype)
    _, factors = slices.axes_scales(singles, (0,), 0.5)
    out = (singles.astype(np.float64) * factors).astype(dtype).astype(np.float64)
    assert np.all(np.abs(out) == 0.5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_a_margin_asked_again_is_the_one_worked_out_fresh(dtype: type) -> None:
    """_SliceRounding keeps its last margins and gives a slice whose factor was asked for
    before that margin again (the search keeps most slices' factors from step to step).
    Each margin, after any history of questions, must equal a fresh object's, bit for bit,
    narrowed or not, and so must the factors."""
    rng = np.random.default_rng(31)
    rows: np.ndarray = (rng.standard_normal((12, 40)) * 3).astype(dtype)
    limit = 2.0
    ratios = limit / np.sqrt(np.sum(rows.astype(np.float64) ** 2, axis=1))
    asked = [ratios * (1 + d) for d in (-1e-3, 1e-3, 0.0)]
    mixed = asked[0].copy()
    mixed[::2] = asked[1][::2]  # half the slices' factors as before, half changed
    asked += [mixed, asked[0], ratios * 0.5]
    kept = slices._SliceRounding.of(rows, limit)
    for factors in asked:
        fresh = slices._SliceRounding.of(rows, limit)
        assert kept.margin(factors).tobytes() == fresh.margin(factors).tobytes()
    narrowed_margin = kept.within(asked[0], asked[1])[0]
    for factors in (mixed, asked[2], mixed, ratios * (1 - 5e-4)):
        fresh_margin = slices._SliceRounding.of(rows, limit).within(asked[0], asked[1])[0]
        assert narrowed_margin(factors).tobytes() == fresh_margin(factors).tobytes()


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((6, 7), (1,)), ((6, 7), (0,)), ((3, 4, 5), (1, 2)), ((3, 4, 5), (0, 2)), ((4, 1, 6), (2,))],
)
@pytest.mark.parametrize("budget", [1, 5, 7, 14, 20, 42, 1000])
def test_gathered_slices_are_the_tensors_rows_whatever_the_boxes(
    shape: tuple[int, ...], axes: tuple[int, ...], budget: int
) -> None:
    """streamed_picked copies a rectangle of consecutive slices and places (a box of rows)
    as a block, and scatters the rest: either way the rows are the tensor's slices, for every
    span (at, around and across box edges)."""
    array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    rest = [i for i in range(len(shape)) if i not in axes]
    moved = np.moveaxis(array, list(axes), list(range(len(rest), len(shape))))
    reference = moved.reshape(-1, math.prod(shape[a] for a in axes))
    count = reference.shape[0]
    for start in range(count):
        for stop in (start + 1, min(count, start + 3), count):
            got = slices.streamed_picked(
                boxes_of(array, budget), shape, axes, array.dtype, slice(start, stop)
            )
            assert got.tobytes() == reference[start:stop].tobytes(), (start, stop)


STRIP = slices.TRANSPOSE_STRIP


@pytest.mark.parametrize(
    ("shape", "axes"),
    [
        ((2 * STRIP + 3, 5), (0,)),
        ((STRIP + 1, 3, 4), (0,)),
        ((3, 2 * STRIP + 1, 2), (0, 1)),
        ((2 * STRIP, 6), (0,)),
    ],
)
@pytest.mark.parametrize("rows", [1, STRIP - 1, STRIP, STRIP + 1, 2 * STRIP, 10**6])
def test_gathered_columns_are_the_tensors_whatever_the_strips(
    shape: tuple[int, ...], axes: tuple[int, ...], rows: int
) -> None:
    """Boxes of `rows` rows with --axes 0: every slice gets a piece of each box, copied a
    strip of TRANSPOSE_STRIP box rows at a time (boxes at, below and above one strip's
    width, and whole tensors): the rows are the tensor's slices all the same."""
    array = np.arange(math.prod(shape), dtype=np.float64).reshape(shape) * 0.5 - 7
    budget = rows * math.prod(shape[1:])
    rest = [i for i in range(len(shape)) if i not in axes]
    moved = np.moveaxis(array, list(axes), list(range(len(rest), len(shape))))
    reference = moved.reshape(-1, math.prod(shape[a] for a in axes))
    count = reference.shape[0]
    for start, stop in [(0, count), (1, count), (0, 1), (count // 2, min(count, count // 2 + 2))]:
        got = slices.streamed_picked(
            boxes_of(array, budget), shape, axes, array.dtype, slice(start, stop)
        )
        assert got.tobytes() == reference[start:stop].tobytes(), (start, stop)


@pytest.mark.parametrize("width", [1, STRIP - 1, STRIP, STRIP + 1, 3 * STRIP + 2])
@pytest.mark.parametrize("rows", [13, slices.STRIPS_FROM_ROWS - 1, slices.STRIPS_FROM_ROWS])
@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.float64])
def test_copy_rectangle_copies_strided_and_contiguous_sources(
    width: int, rows: int, dtype: type
) -> None:
    """_copy_rectangle is target[...] = source: from a transposed view (strips from
    STRIPS_FROM_ROWS target rows, the limit included; one copy below) and from a C-order
    array (one copy), at and around the strip width."""
    box: np.ndarray = np.arange(width * rows).reshape(width, rows).astype(dtype)
    for source in (box.T, np.ascontiguousarray(box.T)):
        target: np.ndarray = np.zeros((rows, width), dtype)
        slices._copy_rectangle(target, source)
        assert target.tobytes() == np.ascontiguousarray(source).tobytes()


@pytest.mark.parametrize(
    "lengths",
    [[0], [3], [0, 0, 5], [5, 0, 0], [2, 0, 3, 0, 0, 1], [1] * 9, [0] * 4, [300, 7, 0, 4096]],
)
def test_segment_sums_are_each_segments_own_sum_and_0_when_empty(lengths: list[int]) -> None:
    """slices._segment_sums (np.add.reduceat, which gives an empty segment the next value
    instead of 0) against plain sums of each segment; and a segment's sum is the same bits
    whatever segments lie beside it (a margin must not depend on the slices asked with it)."""
    rng = np.random.default_rng(sum(lengths))
    values = rng.standard_normal(sum(lengths)) * 10.0 ** rng.integers(-20, 20, sum(lengths))
    begins = slices._begins_of(np.array(lengths, np.intp))
    assert begins.tolist() == [0, *np.cumsum(lengths).tolist()]
    sums = slices._segment_sums(values, begins)
    assert sums.shape == (len(lengths),)
    for k, length in enumerate(lengths):
        own = values[begins[k] : begins[k + 1]]
        if length == 0:
            assert sums[k] == 0.0
            continue
        alone = slices._segment_sums(own, np.array([0, length]))
        assert alone[0] == sums[k]  # the same bits alone
        assert abs(sums[k] - math.fsum(own.tolist())) <= length * 2**-52 * np.abs(own).sum()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_boxes_give_the_bytes_and_report_of_one_thread_at_any_thread_count(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    dtype: type,
) -> None:
    """--axes 1 where each box holds whole rows, box by box: 1, 2 and 5 threads write the
    same bytes and report the same norms and clipped-slice count. (Session 42 searched
    the boxes in worker threads for a while, then went back to one thread for their
    memory; the bytes must not depend on the count either way.)"""
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 96)  # 2 rows of 48 a box, 32 boxes
    array = random_array((64, 48), dtype, 8)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": array})
    seen = []
    for threads in ["1", "2", "5"]:
        monkeypatch.setenv("CLIPCLI_THREADS", threads)
        out = tmp_path / f"out{threads}.safetensors"
        assert main(["clip", "--norm", "20", "--axes", "1", "--json", str(src), str(out)]) == 0
        report = json.loads(capsys.readouterr().out)
        seen.append((read_safetensors(out)["w"].tobytes(), report["tensors"]))
    assert seen[0] == seen[1] == seen[2]
    note = seen[0][1][0]["note"]  # "N of 64 slices clipped"
    assert note.endswith(" of 64 slices clipped"), note
    assert note.split()[0] not in ("0", "64"), note


def test_box_elements_hold_the_float64_boxes_bytes_from_exactly_8_bytes() -> None:
    """Boxes of STREAM_BOX_ELEMENTS up to 8 bytes an element (float64, complex64), half
    that for complex128: a box's float64 working copies take a float64 box's bytes."""
    full = slices.STREAM_BOX_ELEMENTS
    for dtype in [ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.float32, np.float64]:
        assert slices.box_elements(np.dtype(dtype)) == full
    assert slices.box_elements(np.dtype(np.complex64)) == full
    assert slices.box_elements(np.dtype(np.complex128)) == full // 2


@pytest.mark.parametrize(
    ("shape", "axes"), [((12, 4, 3, 3), "2,3"), ((2, 10, 6), "2"), ((2, 10, 6), "-1")]
)
def test_boxes_that_keep_a_later_axis_whole_clip_as_one_box_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], axes: str
) -> None:
    """Boxes cut an early axis and keep a later, unreduced one whole (conv weights with
    --axes 2,3, 3-D tensors with --axes 2): the box's region has slice(None) there. The
    box-by-box route was exit 70 on them (attack s42b: the first slice's number for a
    refusal's message took that None as a start); its output is the one the tensor held
    whole gets."""
    array = random_array(shape, np.float32, 6)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": array})
    args = ["clip", "--norm", "1", "--axes", axes, "-q", "--no-fsync", str(src)]
    assert main([*args, str(tmp_path / "whole.safetensors")]) == 0
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 2 * math.prod(shape[1:]))
    assert main([*args, str(tmp_path / "boxes.safetensors")]) == 0
    whole = read_safetensors(tmp_path / "whole.safetensors")["w"]
    boxed = read_safetensors(tmp_path / "boxes.safetensors")["w"]
    assert boxed.tobytes() == whole.tobytes()
    assert boxed.tobytes() != array.tobytes()


def test_a_refusal_in_a_box_that_keeps_a_later_axis_whole_names_the_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """float8_e8m0fnu [6, 4, 4], --axes 2, boxes of 2 x 4 x 4: the slices of 4 smallest
    values (2**-127) have norm 2**-126, the limit; slice (3, 2), number 14, holds 1s and
    is over it, and no factor reaches it. The refusal names that slice."""
    codes = np.zeros((6, 4, 4), np.uint8)
    codes[3, 2] = 127  # 1.0s
    tensor = codes.view(ml_dtypes.float8_e8m0fnu)
    src = write_safetensors(tmp_path / "in.safetensors", {"s": tensor})
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 2 * 4 * 4)
    floor = 2.0**-126
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", repr(floor), "--axes", "2", "-q", str(src), str(out)]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("clipcli: error: 's (slice 14)': a dtype without zero"), err
    assert not out.exists()


@pytest.mark.parametrize("per_slice", [1, 2, 3, 1023, 1024, 1025])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_slice_roundings_are_the_same_whichever_sort_orders_the_codes(
    monkeypatch: pytest.MonkeyPatch, per_slice: int, dtype: type
) -> None:
    """Short slices' codes are sorted with numpy's default sort, long ones' with its radix
    sort (RADIX_SORT_FROM, at and one either side of it): codes are integers, so the
    distinct magnitudes, their counts and their slices are the same either way."""
    rng = np.random.default_rng(per_slice)
    values = rng.standard_normal((7, per_slice)) * 3
    values[:, ::3] = values[:, :1]  # repeated magnitudes, and their negatives
    values[:, 1::5] = -values[:, 1::5]
    picked: np.ndarray = values.astype(dtype)
    built = []
    for radix_from in [1, 1 << 30]:
        monkeypatch.setattr(slices, "RADIX_SORT_FROM", radix_from)
        rounding = slices._SliceRounding.of(picked, 1.0)
        built.append((rounding.magnitudes, rounding.counts, rounding.owner, rounding.begins))
    for a, b in zip(*built, strict=True):
        assert np.array_equal(a, b)


SMALL_FLOATS = [
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e3m4,
    ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e8m0fnu,
]


@pytest.mark.parametrize("dtype", SMALL_FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("per_slice", [1, 3, 1024, 1500])
def test_slice_histograms_count_each_rows_magnitudes_as_unique_does(
    dtype: type, per_slice: int
) -> None:
    """_SliceRounding.of: each row's distinct nonzero magnitudes, ascending, with their
    counts, as np.unique of its absolute values gives them, whatever the dtype's codes:
    float8_e8m0fnu's code 0 is 2**-127, not zero (a version that took code 0 for zero left
    those values out, and their slices got a factor twice too large); rows of zeros and
    of both zeros' signs have none. Both sorts (short rows, radix) are covered."""
    rng = np.random.default_rng(per_slice)
    values = rng.standard_normal((40, per_slice)) * rng.choice([1e-40, 1e-3, 1.0, 1e3], (40, 1))
    values[rng.random(values.shape) < 0.2] = 0.0
    values[3] = 0.0
    values[4, : per_slice // 2] = -0.0
    with np.errstate(all="ignore"):
        array = values.astype(dtype)
    array = np.where(np.isfinite(array.astype(np.float64)), array, array.dtype.type(1.0))
    rounding = slices._SliceRounding.of(array, 1.0)
    for row in range(array.shape[0]):
        wide = np.abs(array[row].astype(np.float64))
        expected, counts = np.unique(wide[wide != 0], return_counts=True)
        span = slice(rounding.begins[row], rounding.begins[row + 1])
        assert np.array_equal(rounding.magnitudes[span], expected), row
        assert np.array_equal(rounding.counts[span], counts), row
        assert np.all(rounding.owner[span] == row)
    assert rounding.begins[-1] == rounding.magnitudes.size


@pytest.mark.parametrize("dtype", SMALL_FLOATS, ids=lambda d: np.dtype(d).name)
def test_crossing_guesses_change_no_factor(dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of CROSSINGS_FROM values or more start the search at their crossings
    (_SliceRounding._crossing); the factors must be those of the estimate's rungs alone,
    bit for bit, for rows just under, at and over the threshold, mixed scales and zeros,
    and limits at a row's own norm."""
    rng = np.random.default_rng(7)
    threshold = slices.CROSSINGS_FROM
    for per_slice in (threshold - 1, threshold, threshold + 37):
        values = rng.standard_normal((12, per_slice)) * rng.choice([1e-3, 1.0, 30.0], (12, 1))
        values[rng.random(values.shape) < 0.1] = 0.0
        with np.errstate(all="ignore"):
            array = values.astype(dtype)
        wide = array.astype(np.float64)
        wide = np.where(np.isfinite(wide), wide, 0.0)
        norms = np.sqrt(np.sum(wide * wide, axis=1))
        for limit in (float(np.median(norms)) * 0.9, float(norms[0]), float(norms.min()) / 3):
            if not limit > 0:
                continue
            crossings: list[int] = []
            found = slices._SliceRounding._crossing

            def counted(
                self: object, *args: object, found: object = found, calls: list[int] = crossings
            ) -> object:
                calls.append(1)
                return found(self, *args)  # type: ignore[operator]

            monkeypatch.setattr(slices._SliceRounding, "_crossing", counted)
            with np.errstate(all="ignore"):
                with_crossings = slices.axes_scales(array, (1,), limit)[1]
            monkeypatch.setattr(slices, "CROSSINGS_FROM", 1 << 40)
            with np.errstate(all="ignore"):
                without = slices.axes_scales(array, (1,), limit)[1]
            monkeypatch.undo()
            assert np.array_equal(with_crossings.view(np.int64), without.view(np.int64))
            if per_slice >= threshold and np.any(with_crossings != 1.0):
                assert crossings  # the path under test ran


@pytest.mark.parametrize(
    "dtype",
    [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
    ids=lambda d: np.dtype(d).name,
)
def test_long_small_float_slices_get_the_largest_factor_within_the_limit(dtype: type) -> None:
    """As the test above for rows of 60, for rows long enough to start from their
    crossings: each factor's output is within C exactly, and one step more is over it."""
    from clipcli.numerics.search import exact_product_bits

    rng = np.random.default_rng(23)
    per_slice = slices.CROSSINGS_FROM + 76
    values = rng.standard_normal((4, per_slice)) * rng.choice([0.01, 1.0, 20.0], size=(4, 1))
    array: np.ndarray = values.astype(dtype)
    wide = array.astype(np.float64)
    norms = np.sqrt((wide * wide).sum(axis=1))
    bits = exact_product_bits([array.dtype])
    for limit in [float(np.median(norms)) * 0.8, float(norms[1]) * 0.999]:
        _, scales = slices.axes_scales(array, (1,), limit)
        assert_largest_within(array, scales, limit, bits, dtype)


@pytest.mark.parametrize("threads", ["2", "3", "8"])
def test_boxes_worked_out_side_by_side_report_and_write_what_one_thread_does(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    threads: str,
) -> None:
    """Boxes of whole slices are cut into parts for the worker threads and joined again:
    the report (norms after, to the last bit) and the bytes must be one thread's. Rows of
    3,000 and 3,001 values, so that no box is a whole number of the statistics' blocks
    (boxes cut smaller for the threads summed the norms in other groups: attack s48)."""
    rng = np.random.default_rng(48)
    src = tmp_path / "rows.safetensors"
    write_safetensors(
        src,
        {
            "a": rng.standard_normal((600, 3000)).astype(ml_dtypes.bfloat16),
            "b": rng.standard_normal((700, 3001)).astype(np.float32),
            "c": rng.standard_normal((1000, 1500)).astype(np.float16),
        },
    )
    out = tmp_path / "out.safetensors"
    outputs = {}
    for count in ("1", threads):
        monkeypatch.setenv("CLIPCLI_THREADS", count)
        args = ["--norm", "0.5", "--axes", "1", "--force", str(src), str(out)]
        outputs[count] = (clip_json(args, capsys), out.read_bytes())
    one, many = outputs["1"], outputs[threads]
    assert many[1] == one[1]
    assert json.dumps(many[0], sort_keys=True) == json.dumps(one[0], sort_keys=True)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4096, 4096), ml_dtypes.bfloat16), ((1 << 23, 2), np.float16)],
    ids=["bf16 rows of 4096", "f16 pairs"],
)
def test_boxes_side_by_side_hold_about_one_threads_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], dtype: type
) -> None:
    """32 MiB of rows (worked out side by side) and of pairs (short slices: one thread)
    with --axes 1: from one thread to CLIPCLI_THREADS=16 the peak grows within 48 MiB of
    what a --global clip of the same file grows (the reads and the measuring pass use
    every thread: ~50 MiB on a CI machine). A full box searched per thread, up to 16 at
    once, grew ~25-40 MiB a thread (attack s48: float16 pairs 105 MiB on one thread, 614
    on sixteen)."""
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    write_safetensors(src, {"w": np.random.default_rng(9).standard_normal(shape).astype(dtype)})
    growth = {}
    for mode in (["--axes", "1", "--norm", "0.5"], ["--global", "0.5"]):
        peaks = {}
        for threads in ("1", "16"):
            monkeypatch.setenv("CLIPCLI_THREADS", threads)
            args = ["clip", *mode, "-q", "--no-fsync", "--force"]
            code, peaks[threads], stderr = peak_rss(*args, src, out)
            assert code == 0, stderr
        growth[mode[0]] = peaks["16"] - peaks["1"]
    assert growth["--axes"] - growth["--global"] < 48 << 20, growth


def test_side_by_side_from_slices_of_exactly_1024_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads for a tensor's boxes where slices hold SIDE_BY_SIDE_FROM values or more,
    exactly at it too; one under it, for float16, and never more than SIDE_BY_SIDE_SHARE
    whatever CLIPCLI_THREADS says."""
    from clipcli.formats.base import TensorInfo
    from clipcli.jobs import execution

    def share(dtype: type, shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
        info = TensorInfo("w", np.dtype(dtype), shape, 0)
        return execution._side_by_side_share(info, axes)

    at = execution.SIDE_BY_SIDE_FROM
    assert at == 1024
    monkeypatch.setenv("CLIPCLI_THREADS", "2")
    assert share(ml_dtypes.bfloat16, (64, at), (1,)) == 2
    assert share(ml_dtypes.bfloat16, (64, at - 1), (1,)) == 1
    assert share(ml_dtypes.bfloat16, (at, 64), (0,)) == 2
    assert share(ml_dtypes.bfloat16, (64, 32, 32), (1, 2)) == 2  # 32 x 32 = 1024
    assert share(np.float32, (64, at), (1,)) == 2
    assert share(np.float16, (64, at), (1,)) == 1
    monkeypatch.setenv("CLIPCLI_THREADS", "64")
    assert share(ml_dtypes.bfloat16, (64, at), (1,)) == execution.SIDE_BY_SIDE_SHARE == 2
    monkeypatch.setenv("CLIPCLI_THREADS", "1")
    assert share(ml_dtypes.bfloat16, (64, at), (1,)) == 1
