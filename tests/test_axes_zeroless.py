"""`clip --norm C` on float8_e8m0fnu, a dtype without zero (powers of two only): no factor
takes a tensor or a slice below the norm of its smallest values. Where that floor is over
the limit, the clip is refused (exit 4) in one line naming the tensor and, for --axes,
the slice; a tensor or slice exactly at the floor, with the limit equal to it, is within
the limit and kept as it is.

Found in session 42: --axes on short slices wrote every slice at its smallest values,
norm 2.35e-38 for a limit of 1e-300, exit 0. Each of --axes' four ways through the data
(the whole tensor, box by box, gathered slices, counted long slices) is checked here.
The reference is the dtype's definition: code k is 2**(k - 127), code 0 the smallest.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from handmade import read_safetensors, write_safetensors

from clipcli.cli.entry import main
from clipcli.numerics import slices

E8M0 = ml_dtypes.float8_e8m0fnu
LENGTH = 16  # values a slice: at the smallest value 2**-127 each, a slice's norm is 2**-125
FLOOR = 2.0**-125
OVER = 4  # the one slice above the floor


def _slices_tensor(rows: int, along: int) -> np.ndarray:
    """A [rows, LENGTH] (along 1) or [LENGTH, rows] (along 0) tensor of smallest values
    but for slice OVER, which holds 1s and 2s."""
    codes = np.zeros((rows, LENGTH), np.uint8)
    codes[OVER] = np.arange(LENGTH) % 2 + 127
    return (codes if along == 1 else codes.T.copy()).view(E8M0)


def _use(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """Send --axes down one of its ways through the data (clipcli.jobs.execution)."""
    if way != "whole":
        monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 2 * LENGTH)
    if way == "counted":
        monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1)
    if way == "gathered":
        monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1 << 40)


WAYS = [("whole", 1), ("whole", 0), ("box by box", 1), ("gathered", 0), ("counted", 0)]


@pytest.mark.parametrize(("way", "along"), WAYS)
def test_a_slice_over_an_unreachable_limit_is_refused_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    way: str,
    along: int,
) -> None:
    """The other slices are at the floor, equal to the limit: within it. Slice OVER is
    above it, and no factor can bring it to the limit (its floor is the limit itself)."""
    _use(monkeypatch, way)
    src = write_safetensors(tmp_path / "in.safetensors", {"s": _slices_tensor(8, along)})
    out = tmp_path / "out.safetensors"
    args = ["clip", "--norm", repr(FLOOR), "--axes", str(along), "-q", str(src), str(out)]
    assert main(args) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"clipcli: error: 's (slice {OVER})': a dtype without zero"), err
    assert not out.exists()


@pytest.mark.parametrize(("way", "along"), WAYS)
def test_slices_at_the_floor_equal_to_the_limit_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str, along: int
) -> None:
    """Every slice at its smallest values, norm 2**-125 exactly, limit 2**-125: nothing
    to clip. A hair below that limit, each slice is refused (it cannot be reached)."""
    _use(monkeypatch, way)
    tensor = np.zeros((8, LENGTH) if along == 1 else (LENGTH, 8), np.uint8).view(E8M0)
    src = write_safetensors(tmp_path / "in.safetensors", {"s": tensor})
    out = tmp_path / "out.safetensors"
    args = ["--axes", str(along), "-q", str(src), str(out)]
    assert main(["clip", "--norm", repr(FLOOR), *args]) == 0
    assert read_safetensors(out)["s"].tobytes() == tensor.tobytes()
    out.unlink()
    assert main(["clip", "--norm", repr(math.nextafter(FLOOR, 0.0)), *args]) == 4
    assert not out.exists()


@pytest.mark.parametrize(("way", "along"), WAYS)
def test_a_slice_over_a_reachable_limit_is_clipped_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str, along: int
) -> None:
    """A limit of twice the floor: slice OVER is clipped to a norm <= the limit (exact,
    from the codes), the others are kept bit for bit."""
    _use(monkeypatch, way)
    tensor = _slices_tensor(8, along)
    src = write_safetensors(tmp_path / "in.safetensors", {"s": tensor})
    out = tmp_path / "out.safetensors"
    limit = 2 * FLOOR
    assert (
        main(["clip", "--norm", repr(limit), "--axes", str(along), "-q", str(src), str(out)]) == 0
    )
    got = read_safetensors(out)["s"].view(np.uint8)
    rows, before = (got, tensor.view(np.uint8)) if along == 1 else (got.T, tensor.view(np.uint8).T)
    for k, (row, old) in enumerate(zip(rows, before, strict=True)):
        if k != OVER:
            assert row.tobytes() == old.tobytes()
    # Exact: sum of 4**(code - 127) against limit**2 = 4**-124, as fractions of powers of 2.
    from fractions import Fraction

    sumsq = sum(Fraction(2) ** (2 * (int(c) - 127)) for c in rows[OVER])
    assert sumsq <= Fraction(limit) ** 2


def test_a_tensor_at_the_floor_equal_to_the_limit_is_kept(tmp_path: Path) -> None:
    """clip --norm without --axes: the same rule for a whole tensor (it was refused at
    its floor even when the floor equalled the limit)."""
    tensor = np.zeros(LENGTH, np.uint8).view(E8M0)
    src = write_safetensors(tmp_path / "in.safetensors", {"s": tensor})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", repr(FLOOR), "-q", str(src), str(out)]) == 0
    assert read_safetensors(out)["s"].tobytes() == tensor.tobytes()
    out.unlink()
    assert main(["clip", "--norm", repr(math.nextafter(FLOOR, 0.0)), "-q", str(src), str(out)]) == 4
    assert not out.exists()
