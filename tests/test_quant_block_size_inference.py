"""Issue 21, break 1: a block-FP8 file without a config.json is read only where its shapes
leave exactly one block size; no block size (DeepSeek's 128 x 128 included) is assumed.

The rule is checked against a brute-force reference that shares no code with clipcli:
every block size b from 1 to n + 1 with ceil(n / b) == s, and the distinct ways they map
the n rows to scale rows (b >= n all map every row to scale 0: one reading). Values are
checked with exact Fraction sums (tests/quant_reference.py) under the block size the
reference says is the only one.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from quant_reference import Stats, e4m3fn_value, float32_value, write_raw_safetensors

from clipcli.errors import ClipcliError
from clipcli.formats.base import TensorInfo
from clipcli.formats.opening import open_reader
from clipcli.logical.quantized.view import QuantizedView
from clipcli.numerics.norms import NormAccumulator

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)


def readings(extent: int, scales: int) -> set[tuple[int, ...]]:
    """Every distinct mapping of `extent` rows to scale rows that some block size gives."""
    return {
        tuple(i // b for i in range(extent))
        for b in range(1, extent + 2)
        if -(-extent // b) == scales
    }


def only_block(extent: int, scales: int) -> int | None:
    """The block size the reference accepts: one reading, and its least block size."""
    if len(readings(extent, scales)) != 1:
        return None
    return min(b for b in range(1, extent + 2) if -(-extent // b) == scales)


def view_of(shape: tuple[int, int], scale_shape: tuple[int, ...]) -> QuantizedView:
    rows, columns = shape
    infos = [
        TensorInfo("l.weight", E4M3, shape, rows * columns),
        TensorInfo("l.weight_scale_inv", F32, scale_shape, 4 * math.prod(scale_shape)),
    ]
    return QuantizedView(infos, None)


@pytest.mark.parametrize("extent", range(1, 41))
def test_every_scale_count_is_read_only_when_one_block_fits(extent: int) -> None:
    """Rows 1..40 against every scale-row count 0..extent+1 (one column, one scale column):
    read exactly when the reference finds one reading, refused (exit 3) otherwise."""
    for scales in range(extent + 2):
        expected = only_block(extent, scales)
        if expected is None:
            with pytest.raises(ClipcliError) as caught:
                view_of((extent, 1), (scales, 1))
            assert caught.value.exit_code == 3
            continue
        view = view_of((extent, 1), (scales, 1))
        (weight,) = view.tensors()
        block_rows = view.recognised(weight).params["block"][0]
        # b >= extent all read alike: any of them is the reference's reading
        assert readings(extent, scales) == {tuple(i // block_rows for i in range(extent))}


@pytest.mark.parametrize(
    ("shape", "scale_shape", "fits"),
    [
        ((300, 200), (3, 2), "100..149 x 100..199"),  # the attack: 128 x 128 is one of many
        ((16256, 1), (127, 1), "128..129 x 1"),  # 128 one of two: one row short of the edge
        ((4, 1), (2, 1), "2..3 x 1"),
        ((2, 1), (3, 1), "no block size"),  # more scales than rows
        ((300, 200), (6,), "no block layout"),  # six scales, not two dimensions
    ],
)
def test_shapes_several_blocks_fit_are_refused(
    shape: tuple[int, int], scale_shape: tuple[int, ...], fits: str
) -> None:
    with pytest.raises(ClipcliError) as caught:
        view_of(shape, scale_shape)
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "\n" not in message
    assert "block size cannot be told" in message
    assert fits in message


def encoded(rows: int, columns: int, block: tuple[int, int], seed: int) -> tuple[Any, Fraction]:
    """A weight written with `block` and its exact sum of squares (the reference decoder)."""
    rng = np.random.default_rng(seed)
    codes = [int(c) for c in rng.integers(0, 256, rows * columns)]
    codes = [0 if c & 0x7F == 0x7F else c for c in codes]  # no NaN
    scale_shape = [-(-rows // block[0]), -(-columns // block[1])]
    bits = [int(0x3A000000 + b) for b in rng.integers(0, 1 << 23, math.prod(scale_shape))]
    scales = [float32_value(b) for b in bits]
    values = []
    for i in range(rows):
        for j in range(columns):
            code = e4m3fn_value(codes[i * columns + j])
            scale = scales[(i // block[0]) * scale_shape[1] + j // block[1]]
            assert code is not None
            assert scale is not None
            values.append(code * scale)
    stored = {
        "l.weight": ("F8_E4M3", [rows, columns], bytes(codes)),
        "l.weight_scale_inv": ("F32", scale_shape, b"".join(struct.pack("<I", b) for b in bits)),
    }
    return stored, Stats(values).sumsq


def measured_sumsq(path: Path) -> float:
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        (weight,) = view.tensors()
        acc = NormAccumulator()
        for chunk in view.chunks(reader, weight):
            acc.add(chunk)
        acc.finish()
        return acc.norm


@pytest.mark.parametrize(
    ("rows", "columns", "block"),
    [
        (16257, 1, (128, 1)),  # the fewest rows from which 128 rows a block is the only fit
        (3, 7, (2, 7)),  # 3 rows over 2 scales: only 2 fits
        (5, 9, (5, 9)),  # one scale per dimension: the whole tensor
    ],
)
def test_a_block_the_shapes_tell_is_read_exactly(
    tmp_path: Path, rows: int, columns: int, block: tuple[int, int]
) -> None:
    assert only_block(rows, -(-rows // block[0])) == min(block[0], rows)
    stored, sumsq = encoded(rows, columns, block, rows)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    norm = measured_sumsq(path)
    exact = math.sqrt(sumsq)
    assert abs(norm - exact) <= 2 * math.ulp(exact)


def test_the_attack_file_is_refused_by_every_command(tmp_path: Path, run_main: Any) -> None:
    """[300, 200] written with 100 x 100 blocks: read as 128 x 128 it was off by 4e-4 and
    a clip --global 10 wrote a norm of 10.004 (issue 21)."""
    stored, _ = encoded(300, 200, (100, 100), 1)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    for args in (
        ("norms", path),
        ("clip", "--global", "10", path, tmp_path / "o.safetensors"),
        ("diff", path, path),
    ):
        result = run_main(*args)
        assert result.code == 3, args
        (line,) = result.stderr.splitlines()
        assert line.startswith("clipcli: error: l.weight_scale_inv: no config.json")
    assert not (tmp_path / "o.safetensors").exists()
