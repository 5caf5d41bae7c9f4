"""`clip --norm C --axes ...` on long slices reads only the boxes a slice's check needs
(issue 20, "--axes in bounded memory", and speed at scale).

A long slice (numerics.slices.counts_long_slices) is searched as a tensor of its own, and
its search may check its output (float64's factor, a tie) with a pass over its values.
That pass read the whole tensor to find them: float64 [64, 2**21] with --axes 1 read
~64 GiB for a 1 GiB tensor (16.5 s, 12.5 s of it in the kernel's copies). A reader with
random access (Reader.elements_loader) now reads just the boxes that hold the slice.

References: the same clip where the reader has no random access (the boxes read in
order, as before), whose output must be the same bit for bit, and the bytes the reader
was asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from handmade import read_safetensors, write_safetensors
from test_axes_bounded_memory import boxes_of

from clipcli.cli.entry import main
from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.numerics import slices

ROWS, ROW = 16, 1024  # float64 rows of 8 KiB: long slices of 4 boxes each
BUDGET = 256


def _clip(
    src: Path, out: Path, limit: float, monkeypatch: pytest.MonkeyPatch, *, random_access: bool
) -> int:
    """Bytes of tensor data the reader read for `clip --norm limit --axes 1`."""
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", BUDGET)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", ROW * 8)
    read: list[int] = []
    plain_read = SafetensorsReader.read_bytes
    plain_loader = SafetensorsReader.elements_loader

    def counted_read(
        self: SafetensorsReader, info: TensorInfo, start: int, stop: int
    ) -> np.ndarray:
        read.append(stop - start)
        return plain_read(self, info, start, stop)

    def loader(
        self: SafetensorsReader, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        return plain_loader(self, info, start, stop) if random_access else None

    monkeypatch.setattr(SafetensorsReader, "read_bytes", counted_read)
    monkeypatch.setattr(SafetensorsReader, "elements_loader", loader)
    args = ["clip", "--norm", repr(limit), "--axes", "1", "-q", "--no-fsync", str(src), str(out)]
    assert main(args) == 0
    return sum(read)


@pytest.mark.parametrize("tie", [False, True], ids=["float64 checks", "a tie of every row"])
def test_a_long_slice_check_reads_only_the_boxes_that_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tie: bool
) -> None:
    """Float64 rows clipped at half their norm (the search checks each row's factor) and,
    every row alike, at their norm exactly (each row is a tie its check settles): the
    output is the one read in order, and the tensor is read a few times in all, not a
    few times a row."""
    rng = np.random.default_rng(5)
    row = rng.standard_normal(ROW)
    values = np.tile(row, (ROWS, 1)) if tie else rng.standard_normal((ROWS, ROW))
    limit = float(np.sqrt(np.sum(row * row))) if tie else 0.5 * float(np.sqrt(ROW))
    src = write_safetensors(tmp_path / "in.safetensors", {"w": values})
    at_random = _clip(src, tmp_path / "random.safetensors", limit, monkeypatch, random_access=True)
    in_order = _clip(src, tmp_path / "order.safetensors", limit, monkeypatch, random_access=False)
    got = read_safetensors(tmp_path / "random.safetensors")["w"]
    assert got.tobytes() == read_safetensors(tmp_path / "order.safetensors")["w"].tobytes()
    tensor = values.nbytes
    # In order, the rows' checks are made together (slices._lockstep_factors): a pass a
    # round, not one for each row's check (ROWS * tensor and more before).
    assert in_order <= 6 * tensor
    # Measuring, the slices' sums, the write, and per row a few checks of its own boxes.
    assert at_random <= 4 * tensor + ROWS * 4 * ROW * 8


def test_a_pass_over_some_boxes_yields_those_boxes_in_order() -> None:
    """Boxes.only: the accepted boxes, the same as the whole pass's, in its order."""
    array = np.arange(3 * 5 * 7, dtype=np.float64).reshape(3, 5, 7)
    boxes = boxes_of(array, 10)
    every = list(boxes())

    def odd_rows(index: slices.BoxIndex) -> bool:
        return isinstance(index[0], int) and index[0] % 2 == 1

    some: Iterator[slices.Box] = boxes(only=odd_rows)
    picked = list(some)
    expected = [(box, index) for box, index in every if odd_rows(index)]
    assert [index for _, index in picked] == [index for _, index in expected]
    for (box, _), (want, _) in zip(picked, expected, strict=True):
        assert np.array_equal(box, want)
    assert [id(box) for box, _ in slices.accepted(every, odd_rows)] == [id(b) for b, _ in expected]
