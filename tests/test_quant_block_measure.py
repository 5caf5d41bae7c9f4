"""Norms of fp8 weights measured per block (issue 21 benchmark): how often each code occurs
in each block, times a 256-entry table of code x scale per block, instead of every value
decoded to float64 (clipcli.numerics.coded, fp8_block.measure_rows).

The reference shares no code with clipcli: values are decoded from the formats' bit
fields into Fractions (tests/quant_reference.py) and summed exactly; NaN or infinity is
classified from IEEE rules (NaN code, NaN scale, inf x 0). clipcli is measured as `norms`
measures (clipcli.api.measure: the pipeline, worker threads and all).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from quant_reference import (
    Stats,
    close,
    e4m3fn_value,
    e5m2_value,
    f32_payload,
    float32_value,
    random_float32_bits,
    sqrt_fraction,
    write_model_directory,
    write_raw_safetensors,
)
from test_quantized_fp4 import NVFP4_CONFIG, gpt_oss_mxfp4, nvfp4

from clipcli import api
from clipcli.logical.quantized import fp8_block, fp8_scaled
from clipcli.logical.quantized import mxfp4 as mxfp4_scheme
from clipcli.logical.quantized import nvfp4 as nvfp4_scheme
from clipcli.logical.quantized.scheme import Recognised
from clipcli.logical.view import Part
from clipcli.numerics import coded
from clipcli.numerics.norms import NormAccumulator

F32_MAX = 0x7F7FFFFF  # 3.4028235e38
F32_3E38 = struct.unpack("<I", struct.pack("<f", 3e38))[0]
F32_SMALLEST = 0x00000001  # 2**-149, subnormal
F32_LARGEST_SUBNORMAL = 0x007FFFFF
F32_INF, F32_NAN = 0x7F800000, 0x7FC00000


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_config(block: Sequence[int]) -> dict[str, Any]:
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    return {"architectures": ["X"], "quantization_config": quant}


class Reference:
    """Exact statistics of code x scale values, with IEEE's NaN and infinity rules."""

    def __init__(self) -> None:
        self.values: list[Fraction | None] = []
        self.nan = 0
        self.inf = 0

    def add(self, code_value: Fraction | None, code_is_nan: bool, scale_bits: int) -> None:
        scale = float32_value(scale_bits)
        scale_nan = (scale_bits >> 23) & 0xFF == 0xFF and scale_bits & 0x7FFFFF
        if code_value is not None and scale is not None:
            self.values.append(code_value * scale)
            return
        self.values.append(None)
        code_zero = code_value == 0
        scale_zero = scale == 0
        if (
            code_is_nan
            or scale_nan
            or (scale is None and code_zero)
            or (code_value is None and scale_zero)
        ):
            self.nan += 1
        else:
            self.inf += 1


def block_weight(
    rows: int,
    columns: int,
    block: tuple[int, int],
    scale_bits: Sequence[int],
    codes: Sequence[int],
    code_dtype: str = "F8_E4M3",
) -> tuple[dict[str, tuple[str, list[int], bytes]], Reference]:
    """One block-FP8 weight (codes row-major, a float32 scale per block) and its exact
    values."""
    shape = [ceil_div(rows, block[0]), ceil_div(columns, block[1])]
    assert len(scale_bits) == shape[0] * shape[1]
    decode = e4m3fn_value if code_dtype == "F8_E4M3" else e5m2_value
    ref = Reference()
    for i in range(rows):
        for j in range(columns):
            code = codes[i * columns + j]
            value = decode(code)
            is_nan = value is None and (code_dtype == "F8_E4M3" or code & 0x7F > 0x7C)
            ref.add(value, is_nan, scale_bits[(i // block[0]) * shape[1] + j // block[1]])
    stored = {
        "layer.weight": (code_dtype, [rows, columns], bytes(codes)),
        "layer.weight_scale_inv": ("F32", shape, f32_payload(scale_bits)),
    }
    return stored, ref


def every_code_first(rng: np.random.Generator, count: int) -> list[int]:
    codes = [int(c) for c in rng.integers(0, 256, count)]
    codes[: min(256, count)] = range(min(256, count))
    return codes


@pytest.fixture
def tables_used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per run of rows measure_rows was asked for: True when it measured the
    run through tables, False when it left the run to decoding."""
    calls: list[bool] = []
    real = fp8_block.measure_rows

    def spy(*args: Any) -> NormAccumulator | None:
        result = real(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(fp8_block, "measure_rows", spy)
    monkeypatch.setattr(fp8_scaled, "measure_rows", spy)
    return calls


def measured(path: Path) -> NormAccumulator:
    rows = {row.info.name: row for row in api.measure(path).tensors}
    return rows["layer.weight"].stats


def assert_exact(acc: NormAccumulator, ref: Reference) -> None:
    stats = Stats(ref.values)
    assert acc.numel == stats.count
    assert (acc.nan_count, acc.inf_count) == (ref.nan, ref.inf)
    assert acc.nonfinite == stats.nonfinite == ref.nan + ref.inf
    assert Fraction(acc.max_abs) == stats.max_abs
    assert close(acc.finite_norm, stats.norm), (acc.finite_norm, stats.norm)
    finite = [v for v in ref.values if v is not None]
    if finite and not ref.inf:  # (with infinities, table_statistics' own test covers them)
        assert Fraction(acc.max_value) == max(finite)
        assert Fraction(acc.min_value) == min(finite)


# ------------------------------------------------------------------ through norms


@pytest.mark.parametrize(("rows", "columns"), [(200, 300), (128, 256), (129, 385)])
def test_every_code_edge_blocks_nan_codes(
    tmp_path: Path, rows: int, columns: int, tables_used: list[bool]
) -> None:
    """DeepSeek's 128 x 128 blocks with partial edge blocks, all 256 codes (0x7F and 0xFF
    are NaN: counted, never summed), random float32 scales of either sign."""
    rng = np.random.default_rng(rows)
    scales = random_float32_bits(rng, ceil_div(rows, 128) * ceil_div(columns, 128))
    stored, ref = block_weight(
        rows, columns, (128, 128), scales, every_code_first(rng, rows * columns)
    )
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([128, 128])
    )
    acc = measured(directory)
    assert_exact(acc, ref)
    assert acc.nan_count >= 2
    assert tables_used
    assert all(tables_used)


def test_e5m2_codes_infinities_and_nans(tmp_path: Path, tables_used: list[bool]) -> None:
    """E5M2 has infinities (0x7C, 0xFC) beside its NaNs: inf x scale stays inf, except
    under a zero scale, where it is NaN."""
    rng = np.random.default_rng(7)
    scales = random_float32_bits(rng, 4)
    scales[3] = 0  # a zero scale: inf x 0 = NaN, every finite code 0
    codes = every_code_first(rng, 64 * 64)
    codes[64 * 32 + 32 : 64 * 32 + 32 + 256] = range(256)  # every code in the zero block
    stored, ref = block_weight(64, 64, (32, 32), scales, codes, "F8_E5M2")
    # a block of 32 x 32 holds 1024 values: tables pay (4 blocks x 256 <= 4096)
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([32, 32])
    )
    acc = measured(directory)
    assert_exact(acc, ref)
    assert acc.inf_count > 0
    assert acc.nan_count > 0
    assert all(tables_used)


@pytest.mark.parametrize(
    ("kind", "bits"),
    [
        ("smallest subnormal", F32_SMALLEST),
        ("largest subnormal", F32_LARGEST_SUBNORMAL),
        ("3e38", F32_3E38),
        ("float32 max", F32_MAX),
        ("negative max", F32_MAX | 1 << 31),
        ("zero", 0),
        ("negative zero", 1 << 31),
    ],
)
def test_extreme_scales_every_code(
    tmp_path: Path, kind: str, bits: int, tables_used: list[bool]
) -> None:
    """One extreme scale for every block: subnormal float32 scales (values down to
    2**-158), 3e38 and float32's max (values up to 1.5e41, squares 2e82), a zero scale
    (every value 0, NaN codes still NaN). Exact against Fractions."""
    del kind
    rng = np.random.default_rng(bits & 0xFFFF)
    stored, ref = block_weight(16, 512, (16, 256), [bits, bits], every_code_first(rng, 16 * 512))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([16, 256])
    )
    assert_exact(measured(directory), ref)
    assert tables_used
    assert all(tables_used)


def test_mixed_extreme_scales_in_one_weight(tmp_path: Path, tables_used: list[bool]) -> None:
    """Subnormal, huge, zero, negative and non-finite scales side by side: each block's
    values from its own table, the sum as exact as a float64 sum allows."""
    rng = np.random.default_rng(11)
    scales = [F32_SMALLEST, F32_3E38, 0, F32_MAX | 1 << 31, F32_INF, F32_NAN, 0x3C23D70A, 1]
    stored, ref = block_weight(32, 1024, (8, 512), scales, every_code_first(rng, 32 * 1024))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([8, 512])
    )
    acc = measured(directory)
    assert_exact(acc, ref)
    assert acc.inf_count > 0
    assert acc.nan_count > 0
    assert all(tables_used)


def test_small_blocks_are_decoded_and_still_exact(tmp_path: Path, tables_used: list[bool]) -> None:
    """Blocks of 3 x 5 (15 values) would make more table entries than values: the runs
    are decoded instead (measure_rows declines), with the same exact result."""
    rng = np.random.default_rng(3)
    scales = random_float32_bits(rng, ceil_div(20, 3) * ceil_div(23, 5))
    stored, ref = block_weight(20, 23, (3, 5), scales, every_code_first(rng, 20 * 23))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([3, 5])
    )
    assert_exact(measured(directory), ref)
    assert tables_used
    assert not any(tables_used)


def scaled_fp8_directory(
    tmp_path: Path, rows: int, columns: int, scale_shape: list[int], scale_bits: list[int]
) -> tuple[Path, Reference]:
    """compressed-tensors float-quantized FP8: a scale per tensor ([1]) or per channel
    ([rows, 1])."""
    rng = np.random.default_rng(rows * columns)
    codes = every_code_first(rng, rows * columns)
    ref = Reference()
    for i in range(rows):
        for j in range(columns):
            value = e4m3fn_value(codes[i * columns + j])
            ref.add(value, value is None, scale_bits[i if len(scale_bits) > 1 else 0])
    stored = {
        "layer.weight": ("F8_E4M3", [rows, columns], bytes(codes)),
        "layer.weight_scale": ("F32", scale_shape, f32_payload(scale_bits)),
    }
    strategy = "channel" if len(scale_bits) > 1 else "tensor"
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                }
            },
        }
    }
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    return directory, ref


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_scaled_fp8_per_tensor_and_per_channel(
    tmp_path: Path, strategy: str, tables_used: list[bool]
) -> None:
    """fp8_scaled shares the measurement: one table per tensor, or per row."""
    rows, columns = 24, 300
    if strategy == "tensor":
        directory, ref = scaled_fp8_directory(tmp_path, rows, columns, [1], [F32_3E38])
    else:
        bits = random_float32_bits(np.random.default_rng(4), rows)
        bits[:3] = [F32_SMALLEST, 0, F32_MAX]
        directory, ref = scaled_fp8_directory(tmp_path, rows, columns, [rows, 1], bits)
    assert_exact(measured(directory), ref)
    assert tables_used
    assert all(tables_used)


# ------------------------------------------------------------------ the pure parts


@pytest.mark.parametrize(("blocks", "elements", "pays"), [(4, 1024, True), (4, 1023, False)])
def test_tables_pay_at_the_limit(blocks: int, elements: int, pays: bool) -> None:
    """Tables when blocks hold 256 values or more on average: exactly 256 pays, 255.75
    does not."""
    assert coded.tables_pay(blocks, elements) is pays


def test_blocks_of_255_values_are_decoded(tmp_path: Path, tables_used: list[bool]) -> None:
    """The limit itself through norms: blocks of 16 x 16 = 256 values use tables, blocks
    of 15 x 17 = 255 do not."""
    for (block_rows, block_columns), expected in (((16, 16), True), ((15, 17), False)):
        rows, columns = block_rows * 2, block_columns * 3
        rng = np.random.default_rng(block_rows)
        scales = random_float32_bits(rng, 6)
        stored, ref = block_weight(
            rows,
            columns,
            (block_rows, block_columns),
            scales,
            every_code_first(rng, rows * columns),
        )
        directory = write_model_directory(
            tmp_path / f"m{block_rows}",
            {"model.safetensors": stored},
            fp8_config([block_rows, block_columns]),
        )
        tables_used.clear()
        assert_exact(measured(directory), ref)
        assert tables_used == [expected]


def naive_counts(codes: np.ndarray, first_row: int, block: tuple[int, int]) -> np.ndarray:
    rows, columns = codes.shape
    first = first_row // block[0]
    row_blocks = (first_row + rows - 1) // block[0] - first + 1
    counts = np.zeros((row_blocks, ceil_div(columns, block[1]), 256), dtype=np.int64)
    for i in range(rows):
        for j in range(columns):
            counts[(first_row + i) // block[0] - first, j // block[1], codes[i, j]] += 1
    return counts


@pytest.mark.parametrize(
    ("rows", "columns", "first_row", "block"),
    [(7, 9, 5, (3, 4)), (1, 300, 0, (1, 300)), (10, 10, 13, (4, 10)), (5, 600, 2, (2, 1))],
)
def test_block_code_counts_against_a_loop(
    rows: int, columns: int, first_row: int, block: tuple[int, int]
) -> None:
    """Row blocks counted from the one first_row lies in; partial edge blocks; index
    types from uint16 to uint32 (600 column blocks x 3 row blocks x 256 bins > 2**16)."""
    codes = np.random.default_rng(rows).integers(0, 256, (rows, columns), dtype=np.uint8)
    got = coded.block_code_counts(codes, first_row, *block)
    assert np.array_equal(got, naive_counts(codes, first_row, block))


def test_block_code_counts_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """np.bincount is called on pieces of COUNT_PIECE codes (its intp copy stays small):
    a run of exactly one piece, one piece and one code, and several pieces count alike."""
    monkeypatch.setattr(coded, "COUNT_PIECE", 64)
    rng = np.random.default_rng(0)
    for size in (64, 65, 64 * 5 + 3):
        codes = rng.integers(0, 256, (1, size), dtype=np.uint8)
        got = coded.block_code_counts(codes, 0, 1, 32)
        assert np.array_equal(got, naive_counts(codes, 0, (1, 32)))


def repeated(counts: np.ndarray, values: np.ndarray) -> Iterator[float]:
    for count, value in zip(counts.reshape(-1), values.reshape(-1), strict=True):
        for _ in range(int(count)):
            yield float(value)


@pytest.mark.parametrize(
    "values",
    [
        [1e200, -3e199, 2.5, 0.0],  # squares overflow float64: rescaled by 2**-665
        [1e-200, -7e-201, 3e-210, 0.0],  # squares underflow: rescaled by 2**664
        [1.7e308, -1.7e308, 1.0, 0.0],  # the largest float64s: the sum is inf unless scaled
        [5e-324, 1e-323, 0.0, -0.0],  # subnormal float64s
        [math.nan, math.inf, -math.inf, 2.0],
        [0.0, -0.0, math.nan, math.nan],
    ],
)
def test_table_statistics_rescale_like_norms(values: list[float]) -> None:
    """table_statistics scales by the one rule (a power of two from the largest finite
    magnitude), so float64 tables of any range (scales 3e38 x codes, or float64 scales a
    future scheme may bring) neither overflow nor underflow: exact against Fractions, and
    every count and extreme as NormAccumulator.add gives them on the repeated values."""
    table = np.array(values, dtype=np.float64)
    counts = np.array([3, 1, 2, 5], dtype=np.int64)
    acc = coded.table_statistics(counts, table)
    expanded = np.array(list(repeated(counts, table)))
    plain = NormAccumulator()
    plain.add(expanded)
    assert (acc.numel, acc.nan_count, acc.inf_count, acc.nonfinite) == (
        plain.numel,
        plain.nan_count,
        plain.inf_count,
        plain.nonfinite,
    )
    assert (acc.max_abs, acc.max_value, acc.min_value) == (
        plain.max_abs,
        plain.max_value,
        plain.min_value,
    )
    exact = sum(
        (
            Fraction(v) ** 2 * int(c)
            for v, c in zip(values, counts, strict=True)
            if math.isfinite(v)
        ),
        Fraction(0),
    )
    # The norm is sqrt(ssq) x 2**exp: compared so, since 1.7e308 x sqrt(5) is no float64.
    assert close(math.sqrt(acc.ssq), sqrt_fraction(exact / Fraction(4) ** acc.exp))


def test_table_statistics_of_nothing_present() -> None:
    acc = coded.table_statistics(np.zeros(256, np.int64), np.arange(256, dtype=np.float64))
    assert (acc.numel, acc.max_abs, acc.finite_norm, acc.nonfinite) == (0, 0.0, 0.0, 0)


# ------------------------------------------------------------------ against decoding


@pytest.mark.parametrize("seed", range(3))
def test_measure_rows_matches_decoding_every_run(seed: int) -> None:
    """measure_rows over runs that start and stop inside row blocks, against numpy's
    decoding of the same rows (ml_dtypes' values x the scales, spread with np.repeat):
    counts and extremes equal, sums within float64 rounding. Scales from 2**-126 to
    2**120 of either sign."""
    rng = np.random.default_rng(seed)
    rows, columns, block = 70, 530, (16, 128)
    codes = rng.integers(0, 256, (rows, columns), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    shape = (ceil_div(rows, block[0]), ceil_div(columns, block[1]))
    bits = random_float32_bits(rng, shape[0] * shape[1], -126, 120)
    scales = np.array(bits, dtype=np.uint32).view(np.float32).reshape(shape)
    spread = np.repeat(np.repeat(scales.astype(np.float64), block[0], 0), block[1], 1)
    weight = Recognised(
        "w",
        "fp8-block",
        (rows, columns),
        "w",
        (Part("w", "codes"), Part("s", "scale")),
        params={"block": block},
    )
    # rows 15..16 straddle two row blocks: 10 blocks' tables (2,560 entries) for 1,060
    # values do not pay, and measure_rows declines (the caller decodes)
    assert fp8_block.measure_rows(weight, codes[15:17], 15, 17, {"s": scales}) is None
    for start, stop in ((0, 70), (3, 19), (20, 70), (60, 70), (66, 70)):
        got = fp8_block.measure_rows(weight, codes[start:stop], start, stop, {"s": scales})
        assert got is not None
        expected = NormAccumulator()
        with np.errstate(all="ignore"):
            values = codes[start:stop].astype(np.float64) * spread[start:stop, :columns]
        expected.add(values.reshape(-1))
        assert (got.numel, got.nan_count, got.inf_count) == (
            expected.numel,
            expected.nan_count,
            expected.inf_count,
        )
        assert (got.max_abs, got.max_value, got.min_value) == (
            expected.max_abs,
            expected.max_value,
            expected.min_value,
        )
        assert math.isclose(got.finite_norm, expected.finite_norm, rel_tol=1e-14)


# ------------------------------------------------------------------ MXFP4 and NVFP4


@pytest.fixture
def fp4_tables_used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """As tables_used, for mxfp4 and nvfp4: their blocks of 32 and 16 values share one
    table per scale code (256 x 16 entries), not one per block."""
    calls: list[bool] = []
    for module in (mxfp4_scheme, nvfp4_scheme):
        real = module.measure_rows

        def spy(
            *args: Any, real: Callable[..., NormAccumulator | None] = real
        ) -> NormAccumulator | None:
            result = real(*args)
            calls.append(result is not None)
            return result

        monkeypatch.setattr(module, "measure_rows", spy)
    return calls


@pytest.mark.parametrize(
    ("rows", "blocks", "tables"), [(128, 1, True), (127, 1, False), (64, 4, True)]
)
def test_mxfp4_through_scale_code_tables(
    tmp_path: Path, rows: int, blocks: int, tables: bool, fp4_tables_used: list[bool]
) -> None:
    """gpt-oss MXFP4, every e2m1 code, E8M0 scales including 0xFF (NaN) and the extremes
    2**-127 and 2**127: exact. 128 x 32 = 4,096 values is exactly one table's size (tables
    pay); 127 x 32 is one row short (decoded)."""
    rng = np.random.default_rng(rows + blocks)
    exponents = [int(e) for e in rng.integers(0, 256, rows * blocks)]
    exponents[:3] = [0, 0xFE, 0xFF]
    stored, _, _, values = gpt_oss_mxfp4(rng, (rows,), blocks, exponents)
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    rows_found = {row.info.name: row for row in api.measure(path).tensors}
    acc = rows_found["mlp.experts.down_proj"].stats
    stats = Stats(values)
    assert acc.numel == stats.count
    assert acc.nan_count == acc.nonfinite == stats.nonfinite >= 32
    assert Fraction(acc.max_abs) == stats.max_abs
    assert close(acc.finite_norm, stats.norm)
    assert fp4_tables_used == [tables]


@pytest.mark.parametrize(("rows", "tables"), [(64, True), (63, False)])
@pytest.mark.parametrize("global_scale", [1.0, 3.0, 1e-30, 3e38])
def test_nvfp4_through_scale_code_tables(
    tmp_path: Path, rows: int, tables: bool, global_scale: float, fp4_tables_used: list[bool]
) -> None:
    """NVFP4: fp4 x fp8 scale / global scale, each value rounded once by the division as
    decode_rows rounds it: NaN scale codes counted, the norm within the ulps the decoded
    path is held to (tests/test_quantized_fp4.py). 64 x 64 = 4,096 values: tables."""
    stored, _, _, values = nvfp4(np.random.default_rng(rows), rows, 64, global_scale)
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    acc = measured(directory)
    stats = Stats(values)
    assert acc.numel == stats.count
    assert acc.nan_count == acc.nonfinite == stats.nonfinite >= 16
    assert close(float(Fraction(acc.max_abs)), float(stats.max_abs), 1)
    assert close(acc.finite_norm, stats.norm, 4)
    assert fp4_tables_used == [tables]


def test_nibble_counts_against_a_loop() -> None:
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (5, 40), dtype=np.uint8)  # 80 codes a row
    scale_codes = rng.integers(0, 256, (5, 3), dtype=np.uint8)  # blocks of 32: 32 + 32 + 16
    expected = np.zeros((256, 16), dtype=np.int64)
    for r in range(5):
        for k in range(40):
            for element, code in ((2 * k, packed[r, k] & 0xF), (2 * k + 1, packed[r, k] >> 4)):
                expected[scale_codes[r, element // 32], code] += 1
    assert np.array_equal(coded.nibble_counts(packed, scale_codes, 32), expected)
