"""The factor search's checks of quantized weights from code counts (issue 20).

A clip's factor search checks ten or so factors; each check of a weight whose scales a
factor rounds used to decode the whole weight and sum its squares exactly (~25 ns a
value: 106 s for `clip --global` of a 512 MiB block-FP8 file whose norms take 1.7 s).
Schemes with code tables (block FP8, MXFP4, NVFP4) are now checked by counting codes
under the scaled scales, with a bound of about 2**-48 of the sum
(numerics/coded.bounded_table_sumsq), and a check whose decision falls within that bound
is worked out exactly from the decoded values (CertainSumsq.add_bounded).

References: Fraction sums of the values the tables stand for; the same clip with the
counted checks turned off (every check decoding, as before), byte for byte; the real
values of the written file decoded from the formats' definitions (tests/quant_reference).
"""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import read_raw_safetensors
from quant_reference import (
    e4m3fn_value,
    f32_payload,
    float32_bits,
    write_model_directory,
    write_raw_safetensors,
)
from test_quantized_fp4 import NVFP4_CONFIG, gpt_oss_mxfp4, nvfp4

from clipcli.jobs import execution
from clipcli.logical.quantized.view import QuantizedView
from clipcli.numerics import coded
from clipcli.numerics.certain import CertainSumsq

FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}

# ---------------------------------------------------------------- the bounded sum


def exact_sumsq(counts: np.ndarray, values: np.ndarray) -> Fraction:
    return sum(
        (
            Fraction(int(c)) * Fraction(float(v)) ** 2
            for c, v in zip(counts.reshape(-1), values.reshape(-1), strict=True)
        ),
        Fraction(0),
    )


@pytest.mark.parametrize("seed", range(12))
def test_the_bounded_sum_holds_the_exact_one(seed: int) -> None:
    """Counts up to 2**20 and values over every float64 exponent a run can hold (within
    2**400 of the largest, so no square leaves the normal range): the exact sum lies
    within the bound, and the bound is at most 2**-47 of the sum."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 3000))
    spread = int(rng.integers(0, 390))
    centre = int(rng.integers(-600, 600))
    values = np.ldexp(rng.random(size) + 0.5, rng.integers(centre - spread, centre + 1, size))
    values *= rng.choice([-1.0, 1.0], size)
    counts = rng.integers(0, 1 << int(rng.integers(1, 21)), size)
    counts[rng.random(size) < 0.2] = 0
    got = coded.bounded_table_sumsq(counts, values)
    assert got is not None
    total, bound = got
    exact = exact_sumsq(counts, values)
    assert abs(total - exact) <= bound
    assert bound <= exact * Fraction(1, 2**47)


def test_values_far_below_the_largest_are_bounded_not_summed() -> None:
    """Values are scaled so that the largest is in [0.5, 1): one then below 2**-400 (its
    square could leave float64's normal range) is counted in the bound as its largest
    possible square, 2**-800 a copy; one at 2**-400 is summed, its bound relative."""
    below = coded.bounded_table_sumsq(np.array([1, 3]), np.array([0.75, 2.0**-401]))
    at = coded.bounded_table_sumsq(np.array([1, 3]), np.array([0.75, 2.0**-400]))
    assert below is not None
    assert at is not None
    assert below[0] == at[0] == Fraction(9, 16)  # 3 x 2**-800 is below half an ulp
    assert below[1] == Fraction(9, 16) / 2**48 + 3 * Fraction(2) ** -800
    assert at[1] == Fraction(9, 16) / 2**48
    for (total, bound), tiny in ((below, 2.0**-401), (at, 2.0**-400)):
        assert abs(total - exact_sumsq(np.array([1, 3]), np.array([0.75, tiny]))) <= bound


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_counted_nan_or_infinity_is_left_to_the_decoder(bad: float) -> None:
    values = np.array([1.0, bad, 2.0])
    assert coded.bounded_table_sumsq(np.array([1, 1, 1]), values) is None
    # a value no code of the run takes does not count
    assert coded.bounded_table_sumsq(np.array([1, 0, 1]), values) == (
        Fraction(5),
        Fraction(5, 2**48),
    )


def test_nothing_or_only_zeros_present() -> None:
    assert coded.bounded_table_sumsq(np.zeros(4, dtype=np.int64), np.ones(4)) == (
        Fraction(0),
        Fraction(0),
    )
    assert coded.bounded_table_sumsq(np.array([7, 0]), np.array([0.0, 5.0])) == (
        Fraction(0),
        Fraction(0),
    )


# ---------------------------------------------------------------- deciding within a bound


class Exactly:
    """A part's exact sum, counting how often it is asked for."""

    def __init__(self, total: Fraction) -> None:
        self.total = total
        self.calls = 0

    def __call__(self) -> CertainSumsq:
        self.calls += 1
        part = CertainSumsq()
        part.total = self.total
        return part


def bounded(exact: Fraction) -> tuple[CertainSumsq, Exactly]:
    """8200 +- 1800: certainly within at C = 100 (8200 + 1800 = 100**2), certainly over
    below C = 80 (8200 - 1800 = 80**2)."""
    exactly = Exactly(exact)
    sums = CertainSumsq()
    sums.add_bounded(Fraction(8200), Fraction(1800), exactly)
    return sums, exactly


def test_a_bounded_part_is_worked_out_only_when_a_decision_needs_it() -> None:
    sums, exactly = bounded(Fraction(8300))
    assert sums.at_most(100)  # exactly at the top of the bound: within
    assert not sums.at_most(math.nextafter(80.0, 0.0))  # below its bottom: over
    assert exactly.calls == 0
    assert not sums.at_most(90)  # 8100 lies within the bound: worked out, 8300
    assert exactly.calls == 1
    assert sums.total == 8300
    assert sums.bound == 0
    assert sums.at_most(math.sqrt(8300) * (1 + 2.0**-50))
    assert exactly.calls == 1  # once


def test_exactly_at_the_bottom_of_the_bound_the_part_is_worked_out() -> None:
    sums, exactly = bounded(Fraction(6400))
    assert sums.at_most(80)  # 8200 - 1800 = 80**2 is not certainly over
    assert exactly.calls == 1


def test_merged_parts_stay_bounded_and_are_worked_out_together() -> None:
    first, second = Exactly(Fraction(50)), Exactly(Fraction(60))
    a, b = CertainSumsq(), CertainSumsq()
    a.add_bounded(Fraction(49), Fraction(2), first)
    b.add_bounded(Fraction(61), Fraction(2), second)
    plain = CertainSumsq()
    plain.add(np.array([3.0]))  # 9, exact
    plain.merge(a)
    plain.merge(b)
    assert plain.total == 119
    assert plain.bound == 4
    assert plain.at_most(12)  # 144 >= 119 + 4
    assert first.calls == second.calls == 0
    assert not plain.at_most(math.sqrt(118.5))  # 119 - 4 <= 118.5 < 119 + 4: worked out
    assert first.calls == second.calls == 1
    assert plain.total == 119
    assert plain.bound == 0


# ---------------------------------------------------------------- whole clips


def block_fp8_weight(rng: np.random.Generator, rows: int, columns: int) -> dict[str, Any]:
    """Every e4m3 code but NaN, float32 scales of random mantissas in [2**-7, 2**-2)."""
    codes = rng.integers(0, 256, rows * columns).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN codes become 1.0
    shape = [-(-rows // 128), -(-columns // 128)]
    count = shape[0] * shape[1]
    scales = np.ldexp(rng.random(count) + 1, rng.integers(-7, -2, count)).astype(np.float32)
    return {
        "layer.weight": ("F8_E4M3", [rows, columns], codes.tobytes()),
        "layer.weight_scale_inv": ("F32", shape, scales.tobytes()),
    }


def fixture(kind: str, directory: Path) -> Path:
    rng = np.random.default_rng(7)
    if kind == "fp8-block":
        stored = block_fp8_weight(rng, 300, 520)
        return write_model_directory(directory, {"model.safetensors": stored}, FP8_CONFIG)
    if kind == "mxfp4":
        exponents = [int(e) for e in rng.integers(110, 140, 256 * 4)]
        stored = gpt_oss_mxfp4(rng, (256,), 4, exponents)[0]
        directory.mkdir()
        return write_raw_safetensors(directory / "m.safetensors", stored)
    stored = nvfp4(rng, 128, 64, 3.0, positive=True)[0]
    return write_model_directory(directory, {"model.safetensors": stored}, NVFP4_CONFIG)


class Spies:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counted = 0
        self.decoded = 0
        real_counted, real_decoded = coded.bounded_table_sumsq, execution._decoded_sumsq

        def counted(*args: Any) -> Any:
            self.counted += 1
            return real_counted(*args)

        def decoded(*args: Any) -> Any:
            self.decoded += 1
            return real_decoded(*args)

        monkeypatch.setattr(coded, "bounded_table_sumsq", counted)
        monkeypatch.setattr(execution, "_decoded_sumsq", decoded)


def clip_json(run_main: Any, src: Path, out: Path, *mode: str) -> dict[str, Any]:
    result = run_main("clip", *mode, src, out, "--format", "json")
    assert result.code == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    report.pop("out", None)
    return report


def written(out: Path) -> dict[str, bytes]:
    """The output's bytes: of a file, or of each file of a directory by name."""
    if out.is_file():
        return {"": out.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.mark.parametrize("kind", ["fp8-block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("mode", [("--global", "0.37"), ("--norm", "0.2")])
def test_counted_checks_write_what_decoded_checks_wrote(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, kind: str, mode: tuple[str, str]
) -> None:
    """The same clip with every check decoding (the view's counted loaders turned off):
    byte-identical files and the same report; the counted one never decoded to check."""
    src = fixture(kind, tmp_path / "in")
    norm = run_main("norms", src, "--format", "json")
    assert norm.code == 0, norm.stderr
    rows = json.loads(norm.stdout)["tensors"]
    weights = [row["norm"] for row in rows if row["role"] == "weight"]
    assert weights
    assert min(weights) > 1.0  # each weight is clipped
    suffix = ".safetensors" if src.is_file() else ""
    spies = Spies(monkeypatch)
    counted = clip_json(run_main, src, tmp_path / f"counted{suffix}", *mode)
    assert spies.counted > 0
    assert spies.decoded == 0
    monkeypatch.setattr(QuantizedView, "scaled_sumsq_loaders", lambda *_: None)
    decoded = clip_json(run_main, src, tmp_path / f"decoded{suffix}", *mode)
    assert spies.decoded > 0
    assert counted == decoded
    assert written(tmp_path / f"counted{suffix}") == written(tmp_path / f"decoded{suffix}")


def ones_at_norm_512(directory: Path) -> Path:
    """512 x 512 codes of 1.0 (e4m3 0x38) under scales of 1.0: the norm is exactly 512."""
    (one,) = float32_bits([1.0])
    stored = {
        "layer.weight": ("F8_E4M3", [512, 512], bytes([0x38]) * (512 * 512)),
        "layer.weight_scale_inv": ("F32", [4, 4], f32_payload([one] * 16)),
    }
    return write_model_directory(directory, {"model.safetensors": stored}, FP8_CONFIG)


def written_sumsq(out: Path) -> Fraction:
    stored = read_raw_safetensors(out / "model.safetensors")
    codes = stored["layer.weight"][2]
    scales = struct.unpack("<16f", stored["layer.weight_scale_inv"][2])
    total = Fraction(0)
    for block in range(16):
        row_block, column_block = divmod(block, 4)
        scale = Fraction(scales[block])
        for r in range(row_block * 128, row_block * 128 + 128):
            for code in set(
                codes[r * 512 + column_block * 128 : r * 512 + column_block * 128 + 128]
            ):
                count = codes[
                    r * 512 + column_block * 128 : r * 512 + column_block * 128 + 128
                ].count(code)
                value = e4m3fn_value(code)
                assert value is not None
                total += count * (value * scale) ** 2
    return total


def test_a_norm_exactly_at_the_limit_is_decided_exactly(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At C = 512 the counted check cannot tell (512**2 lies within its bound): the weight
    is decoded once and left alone; one float below 512 it is clipped to within C."""
    src = ones_at_norm_512(tmp_path / "in")
    spies = Spies(monkeypatch)
    at = clip_json(run_main, src, tmp_path / "at", "--global", "512")
    assert spies.decoded == 1
    assert not any(row["changed"] for row in at["tensors"])
    assert written(tmp_path / "at") == written(src)
    below = math.nextafter(512.0, 0.0)
    clip_json(run_main, src, tmp_path / "below", "--global", repr(below))
    assert written_sumsq(tmp_path / "below") <= Fraction(below) ** 2
