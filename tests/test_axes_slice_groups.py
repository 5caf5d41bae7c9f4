"""`clip --norm C --axes ...` on tensors of more slices than one group (issue 20, "--axes in
bounded memory, any shape"): where the boxes cut the slices (two-element columns of a
[2, n] tensor with --axes 0), the slices' sums and factors were kept for the whole tensor,
~10 bytes a slice: a 0.25 GiB bfloat16 [2, 2**26] took 676 MiB. Now, where the reader can
read any box on its own, the slices are worked out a group at a time
(numerics.slices.slice_groups) from the boxes that hold them, and their factors wait in a
temporary file for the writing pass.

References: the same clip with every slice in one group (each factor depends on its own
slice alone, so grouping must change no byte and no report), the slice numbers of a box
worked out element by element with numpy, and exact sums of squares as Fractions.
"""

from __future__ import annotations

import itertools
import json
import math
import os
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
from clipcli.system import scratch


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 5), (2, 3, 1, 4)])
@pytest.mark.parametrize("budget", [1, 3, 4, 5, 19, 20, 21, 60, 121])
def test_a_boxs_slices_are_consecutive_and_the_ones_its_elements_belong_to(
    shape: tuple[int, ...], budget: int
) -> None:
    numbers = np.arange(math.prod(shape)).reshape(shape)
    for r in range(1, len(shape) + 1):
        for axes in itertools.permutations(range(len(shape)), r):
            keep = slices.keepdims_shape(shape, axes)
            # Each element's slice: its index with the reduced axes set to 0, raveled.
            index = np.indices(shape)
            for a in axes:
                index[a] = 0
            owner = np.ravel_multi_index(tuple(index), keep)
            for box_index in slices.box_indices(shape, budget):
                held = slices.box_slices(box_index, shape, axes)
                assert sorted(set(owner[box_index].reshape(-1).tolist())) == list(held)
                # The box's per-slice array, flattened, is those slices in order.
                box = numbers[box_index].reshape(slices.box_shape(shape, box_index))
                assert slices.keepdims_shape(box.shape, axes) == tuple(
                    1 if a in axes else n for a, n in enumerate(box.shape)
                )
                assert math.prod(slices.keepdims_shape(box.shape, axes)) == len(held)


def test_slice_groups_cut_exactly_past_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slices, "SLICE_GROUP", 6)
    f32 = np.dtype(np.float32)
    assert slices.slice_groups((2, 6), (0,), f32) == [slice(0, 6)]  # exactly a group
    assert slices.slice_groups((2, 7), (0,), f32) == [slice(0, 6), slice(6, 7)]  # one over
    assert slices.slice_groups((2, 13), (0,), f32) == [slice(0, 6), slice(6, 12), slice(12, 13)]
    assert slices.slice_groups((3, 2, 7), (1,), f32) == [
        slice(0, 6),
        slice(6, 12),
        slice(12, 18),
        slice(18, 21),
    ]


def test_long_slices_are_one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long slices are searched each as a tensor (counts_long_slices): never grouped."""
    monkeypatch.setattr(slices, "SLICE_GROUP", 1)
    f32 = np.dtype(np.float32)
    long_rows = (3, slices.LONG_SLICE_BYTES // 4)
    assert slices.counts_long_slices(long_rows, (1,), f32, slices.box_elements(f32))
    assert slices.slice_groups(long_rows, (1,), f32) == [slice(0, 3)]


def recording(boxes: slices.Boxes, read: list[slices.BoxIndex]) -> slices.Boxes:
    """The boxes, each one read noted in `read`."""

    def one_pass(only: Callable[[slices.BoxIndex], bool] | None = None) -> Iterator[slices.Box]:
        for box, index in boxes(only):
            read.append(index)
            yield box, index

    return one_pass


def scaled_sums(sums: np.ndarray, exps: np.ndarray) -> list[Fraction]:
    return [Fraction(float(s)) * Fraction(4) ** int(e) for s, e in zip(sums, exps, strict=True)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_a_spans_sums_are_those_of_the_whole_tensor(dtype: type) -> None:
    rng = np.random.default_rng(5)
    values = rng.standard_normal((3, 11, 4)) * 7
    if np.dtype(dtype) == np.float64:
        values[:, :5] *= 1e250  # slices that need a power of two taken out
        values[:, 7:] *= 1e-250
    array: np.ndarray = values.astype(dtype)
    for axes in [(0,), (0, 2), (2,), (1,)]:
        for budget in [3, 4, 13, 44]:
            boxes = boxes_of(array, budget)
            whole_sums, whole_exps = slices.streamed_sumsq(boxes, array.shape, axes, array.dtype)
            count = whole_sums.size
            for span in [slice(0, count), slice(1, count - 1), slice(count // 2, count // 2 + 1)]:
                read: list[slices.BoxIndex] = []
                sums, exps = slices.streamed_sumsq(
                    recording(boxes, read), array.shape, axes, array.dtype, span
                )
                # Scaled by their own exponent, each slice's sum is the whole tensor's one.
                got = scaled_sums(sums, exps)
                want = scaled_sums(whole_sums.reshape(-1)[span], whole_exps.reshape(-1)[span])
                assert got == want, (axes, budget, span)
                # Only the boxes holding the span's slices were read.
                for index in read:
                    held = slices.box_slices(index, array.shape, axes)
                    assert held.start < span.stop
                    assert span.start < held.stop


def clip_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["clip", "--format", "json", "--no-fsync", *args]) == 0
    report: dict[str, object] = json.loads(capsys.readouterr().out)
    report.pop("out")
    return report


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    ("shape", "axes"), [((2, 40), "0"), ((3, 4, 9), "0"), ((3, 4, 9), "0,2"), ((5, 6, 2), "1")]
)
def test_grouped_slices_write_and_report_what_one_group_does(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    dtype: type,
    shape: tuple[int, ...],
    axes: str,
) -> None:
    """Boxes of 8 elements cut the slices; groups of 1, 5 and 7 slices against one group
    of all. Some slices are over the limit, some within, one exactly at it."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal(shape)
    values[..., ::3] *= 4  # over the limit; the rest mostly within it
    reduced = tuple(int(a) for a in axes.split(","))
    # The last slice's norm is the limit exactly: 1.5, 2 and zeros (2.5**2 = 1.5**2 + 2**2).
    last = tuple(slice(None) if a in reduced else -1 for a in range(len(shape)))
    tie = np.zeros(values[last].size)
    tie[:2] = [1.5, 2.0]
    values[last] = tie.reshape(values[last].shape)
    original: np.ndarray = values.astype(dtype)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 8)
    outputs, reports = [], []
    for group in [1 << 30, 1, 5, 7]:
        monkeypatch.setattr(slices, "SLICE_GROUP", group)
        out = tmp_path / f"out{group}.safetensors"
        reports.append(clip_json(["--norm", "2.5", "--axes", axes, str(src), str(out)], capsys))
        outputs.append(out.read_bytes())
    assert all(output == outputs[0] for output in outputs)
    assert all(report == reports[0] for report in reports)
    assert "slices clipped" in reports[0]["tensors"][0]["note"]  # type: ignore[index]
    clipped = read_safetensors(tmp_path / "out5.safetensors")["w"]
    moved = np.moveaxis(clipped, reduced, range(len(shape) - len(reduced), len(shape)))
    rows = moved.reshape(-1, math.prod(shape[a] for a in reduced))
    assert all(exact_sumsq(row) <= Fraction(2.5) ** 2 for row in rows)


@pytest.fixture
def grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A float32 [2, 40] whose every column is over the limit, cut by boxes of 8 elements
    into groups of 16 slices; its input and where its output goes."""
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 8)
    monkeypatch.setattr(slices, "SLICE_GROUP", 16)
    original = (np.random.default_rng(8).standard_normal((2, 40)) * 10).astype(np.float32)
    return write_safetensors(
        tmp_path / "in.safetensors", {"w": original}
    ), tmp_path / "out.safetensors"


def spoil_the_factors(
    monkeypatch: pytest.MonkeyPatch, spoil: Callable[[int, int], object]
) -> list[int]:
    """Before the writing pass reads a box's factors back, spoil(fd, position) acts on the
    temporary file as another process could; the positions read."""
    real = scratch.read_at
    positions: list[int] = []

    def read_at(fd: int, buffer: memoryview, position: int) -> None:
        positions.append(position)
        spoil(fd, position)
        real(fd, buffer, position)

    monkeypatch.setattr(scratch, "read_at", read_at)
    return positions


@pytest.mark.parametrize("value", [float("nan"), 1.0000000000000002, -1e-300, 2.0, 0.5, -0.0, 0.0])
def test_factors_changed_in_the_temporary_file_are_refused_and_no_output_is_left(
    grouped: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: float,
) -> None:
    """A factor written into the file while clipcli runs, by another process of this user
    (through /proc/<pid>/fd), is exit 5 with one line and no OUT: outside [0, 1] or NaN,
    and inside it too (0.5 takes a slice clipped by 0.2 over the limit; -0.0 flips every
    sign; attack s46)."""
    src, out = grouped
    positions = spoil_the_factors(
        monkeypatch, lambda fd, at: os.pwrite(fd, np.array([value]).tobytes(), at)
    )
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 5
    assert positions  # the factors were read back
    err = capsys.readouterr().err
    assert "temporary file" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["in.safetensors"]


def test_factors_rewritten_as_they_were_are_applied(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check is of the bytes, not of a write: the same bytes written again pass, and
    the output is the one an untouched run writes."""
    src, out = grouped
    untouched = out.with_name("untouched.safetensors")
    args = ["clip", "--norm", "1", "--axes", "0", "-q", "--no-fsync"]
    assert main([*args, str(src), str(untouched)]) == 0

    def same_again(fd: int, at: int) -> None:
        os.pwrite(fd, os.pread(fd, 64, at), at)

    spoil_the_factors(monkeypatch, same_again)
    assert main([*args, str(src), str(out)]) == 0
    assert out.read_bytes() == untouched.read_bytes()


def test_a_file_cut_while_groups_are_worked_out_and_grown_again_is_refused(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cut to nothing after the first group is written: the next group's write grows it
    again, and the first group's hole reads as zeros, factors a range check accepts
    (attack s46: a real run wrote a third of its slices as zeros, exit 0)."""
    src, out = grouped
    real = scratch.write_at
    writes: list[int] = []

    def write_at(fd: int, data: bytes | memoryview, position: int) -> None:
        if len(writes) == 1:
            os.ftruncate(fd, 0)
        writes.append(position)
        real(fd, data, position)

    monkeypatch.setattr(scratch, "write_at", write_at)
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 5
    assert len(writes) >= 2
    assert "changed while in use" in capsys.readouterr().err
    assert not out.exists()


def test_a_temporary_file_cut_short_is_exit_5(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = grouped
    spoil_the_factors(monkeypatch, lambda fd, at: os.ftruncate(fd, at + 4))
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 5
    assert "cut short" in capsys.readouterr().err
    assert not out.exists()


def test_a_temporary_file_grown_past_its_factors_is_exit_5(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes added after the last group change no factor read, but the file is not what
    clipcli wrote (attack s46b): refused like any other change, and one byte counts."""
    src, out = grouped
    spoil_the_factors(monkeypatch, lambda fd, _at: os.ftruncate(fd, os.fstat(fd).st_size + 1))
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 5
    assert "changed while in use" in capsys.readouterr().err
    assert not out.exists()


def test_no_usable_temporary_directory_is_exit_5_naming_it(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = grouped
    missing = out.parent / "no-such-dir"
    monkeypatch.setenv("TMPDIR", str(missing))
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", str(src), str(out)]) == 5
    assert str(missing) in capsys.readouterr().err
    assert not out.exists()


def test_the_temporary_file_is_closed_after_the_clip(
    grouped: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out = grouped
    opened: list[int] = []
    real = scratch.unnamed_file

    def unnamed_file(prefix: str) -> tuple[int, bool]:
        fd, nameable = real(prefix)
        opened.append(fd)
        return fd, nameable

    monkeypatch.setattr(scratch, "unnamed_file", unnamed_file)
    assert main(["clip", "--norm", "1", "--axes", "0", "-q", "--no-fsync", str(src), str(out)]) == 0
    assert len(opened) == 1
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(opened[0])


@pytest.mark.slow
def test_sixteen_million_two_element_columns_are_clipped_in_bounded_memory(
    tmp_path: Path,
) -> None:
    """A float32 [2, 2**24] with --axes 0 (128 MiB, 16 million slices): ~9 bytes a slice
    held for all of them took 232 MB; a group at a time, 118 MB (measured), and memory
    no longer grows with the slices. The bound is issue 20's for --axes."""
    shape = (2, 1 << 24)
    original = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": original})
    out = tmp_path / "out.safetensors"
    code, peak, stderr = peak_rss(
        "clip", "--norm", "1", "--axes", "0", "-q", "--no-fsync", src, out
    )
    assert code == 0, stderr
    assert peak < 200 << 20, peak
    clipped = read_safetensors(out)["w"].astype(np.float64)
    norms = np.sqrt(np.sum(clipped**2, axis=0))
    assert np.all(norms <= 1.0)
    assert math.isclose(float(norms.max()), 1.0, rel_tol=1e-6)
