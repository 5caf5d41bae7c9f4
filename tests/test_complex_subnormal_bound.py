"""A complex element's real and imaginary parts round apart: the rounding bound of a
float32-family search counts two values per complex64 element. Before (attack s36), a
complex64 tensor of subnormals clipped to a subnormal limit just under its norm was
bounded as if each element moved by half a step, and written unchanged, over its limit:
by --norm (the whole tensor) and by --axes (each slice). Checked on the written file with
exact Fraction sums of squares, sharing nothing with clipcli's arithmetic."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors
from safetensors.numpy import load_file

from clipcli import api
from clipcli.jobs.spec import ClipSpec, Mode

PARTS = bytes.fromhex("9c1c0000402b0080")  # 1.0263e-41 - 1.5515e-41j, both subnormal


def _sumsq(values: np.ndarray) -> Fraction:
    wide = values.astype(np.complex128).reshape(-1)
    return sum((Fraction(z.real) ** 2 + Fraction(z.imag) ** 2 for z in wide), Fraction(0))


@pytest.mark.parametrize("axes", [None, (0,), (1,)])
@pytest.mark.parametrize("limit", [1.860247643066752e-41, 2.6307e-41, 3.2219e-41, 1e-42])
def test_complex_subnormals_are_written_within_the_limit(
    tmp_path: Path, axes: tuple[int, ...] | None, limit: float
) -> None:
    values = np.frombuffer(PARTS * 6, np.complex64).reshape(3, 2).copy()
    src = write_safetensors(tmp_path / "in.safetensors", {"t": values})
    out = tmp_path / "out.safetensors"
    api.clip(src, out, ClipSpec(Mode.NORM, limit=limit, axes=axes))
    written = load_file(str(out))["t"]
    if axes is None:
        slices = [written]
    elif axes == (0,):
        slices = [written[:, j] for j in range(written.shape[1])]
    else:
        slices = [written[i, :] for i in range(written.shape[0])]
    for part in slices:
        assert _sumsq(part) <= Fraction(limit) ** 2
