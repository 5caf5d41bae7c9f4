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
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import read_raw_safetensors, write_safetensors
from quant_int_reference import dense_stream
from quant_reference import (
    e2m1_value,
    e4m3fn_value,
    e8m0_value,
    f32_payload,
    float32_bits,
    write_model_directory,
    write_raw_safetensors,
)
from test_quant_gptq_awq import awq_arrays, gptq_arrays
from test_quant_packed_int import config
from test_quant_packed_int import layer as packed_layer
from test_quantized_fp4 import NVFP4_CONFIG, gpt_oss_mxfp4, nvfp4

from clipcli.formats.opening import open_reader
from clipcli.jobs import execution
from clipcli.logical.quantized import fp8_block
from clipcli.logical.quantized import view as view_module
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


def test_counts_past_2_to_the_53_round_within_the_bound() -> None:
    """Code energies are int64 up to 2**62: their conversion to float64 rounds, and the
    bound still holds the exact sum."""
    rng = np.random.default_rng(3)
    counts = rng.integers(2**53, 2**62, 500) | 1  # odd: not a float64
    values = np.ldexp(rng.random(500) + 0.5, rng.integers(-60, 0, 500))
    got = coded.bounded_table_sumsq(counts, values)
    assert got is not None
    exact = exact_sumsq(counts, values)
    assert abs(got[0] - exact) <= got[1]
    assert got[0] != exact  # the counts did round


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
    if kind == "nvfp4":
        stored = nvfp4(rng, 128, 64, 3.0, positive=True)[0]
        return write_model_directory(directory, {"model.safetensors": stored}, NVFP4_CONFIG)
    directory.mkdir()
    if kind == "gptq":  # act-order: each input's group from a shuffled g_idx
        arrays = gptq_arrays(256, 48, 4, 8, seed=3, act_order=True)[0]
    elif kind == "awq":
        arrays = awq_arrays(256, 48, 32, seed=3)[0]
    else:  # compressed-tensors pack-quantized, asymmetric groups of 16
        arrays = packed_layer((48, 256), 4, 16, dense_stream, group=16)[0]
        (directory / "config.json").write_text(json.dumps({"quantization_config": config(4)}))
        write_safetensors(directory / "model.safetensors", arrays)
        return directory
    return write_safetensors(directory / "m.safetensors", arrays)


class Spies:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counted = 0
        self.decoded = 0
        real_counted, real_decoded = coded.bounded_table_sumsq, execution._decoded_sumsq

        def counted(*args: Any) -> Any:
            self.counted += 1
            return real_counted(*args)

        def decoded(*args: Any, **kwargs: Any) -> Any:
            self.decoded += 1
            return real_decoded(*args, **kwargs)

        monkeypatch.setattr(coded, "bounded_table_sumsq", counted)
        monkeypatch.setattr(execution, "_decoded_sumsq", decoded)


def decode_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks as they were: no energies summed together, no counted runs."""
    monkeypatch.setattr(QuantizedView, "energy_sumsq_together", lambda *_: (frozenset(), None))
    monkeypatch.setattr(QuantizedView, "scaled_sumsq_loaders", lambda *_: None)


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


def squares_by_block(
    codes: bytes, width: int, block: tuple[int, int], value: Any
) -> dict[tuple[int, int], Fraction]:
    """(row block, column block) -> sum of value(code)**2 over the block's codes."""
    counts: dict[tuple[int, int], Counter[int]] = {}
    for i, code in enumerate(codes):
        row, column = divmod(i, width)
        counts.setdefault((row // block[0], column // block[1]), Counter())[code] += 1
    return {
        key: sum((n * value(code) ** 2 for code, n in counter.items()), Fraction(0))
        for key, counter in counts.items()
    }


def finite(value: Fraction | None) -> Fraction:
    assert value is not None  # the fixtures hold no NaN scale
    return value


def low_first(packed: bytes) -> bytes:
    return bytes(c for byte in packed for c in (byte & 0x0F, byte >> 4))


def decoded_sumsq(out: Path) -> Fraction:
    """The exact sum of squares (Fractions) of every quantized weight's values as
    clipcli's decoders give them (exact products, pinned against Fraction references by
    tests/test_quant_gptq_awq.py and tests/test_quant_packed_int.py)."""
    total = Fraction(0)
    with open_reader(out) as reader:
        view = QuantizedView.of(reader)
        for tensor in view.tensors():
            if not tensor.plain:
                for chunk in view.chunks(reader, tensor):
                    total += sum((Fraction(v) ** 2 for v in chunk.tolist()), Fraction(0))
    return total


def real_sumsq(kind: str, out: Path) -> Fraction:
    """The exact sum of squares of the written weight's real values, decoded from the
    formats' definitions (tests/quant_reference): the bound a clip promises."""
    if kind in ("gptq", "awq", "packed-int"):
        return decoded_sumsq(out)
    stored = read_raw_safetensors(out if out.is_file() else out / "model.safetensors")
    if kind.startswith("fp8-block"):
        _, (rows, columns), codes = stored["layer.weight"]
        scale_shape, payload = stored["layer.weight_scale_inv"][1:]
        scales = struct.unpack(f"<{len(payload) // 4}f", payload)
        block = (128, 128)
        if kind == "fp8-block-any":  # the declared block, from config.json
            config = json.loads((out / "config.json").read_text())
            block = tuple(config["quantization_config"]["weight_block_size"])
        energies = squares_by_block(codes, columns, block, e4m3fn_value)
        return sum(
            (e * Fraction(scales[r * scale_shape[1] + c]) ** 2 for (r, c), e in energies.items()),
            Fraction(0),
        )
    if kind == "mxfp4":
        _, (rows, blocks, _), packed = stored["mlp.experts.down_proj_blocks"]
        exponents = stored["mlp.experts.down_proj_scales"][2]
        energies = squares_by_block(low_first(packed), blocks * 32, (1, 32), e2m1_value)
        return sum(
            (
                e * finite(e8m0_value(exponents[r * blocks + c])) ** 2
                for (r, c), e in energies.items()
            ),
            Fraction(0),
        )
    _, (rows, half), packed = stored["layer.weight_packed"]
    scale_codes = stored["layer.weight_scale"][2]
    (global_scale,) = struct.unpack("<f", stored["layer.weight_global_scale"][2])
    energies = squares_by_block(low_first(packed), half * 2, (1, 16), e2m1_value)
    groups = half * 2 // 16
    return sum(
        (
            e * (finite(e4m3fn_value(scale_codes[r * groups + c])) / Fraction(global_scale)) ** 2
            for (r, c), e in energies.items()
        ),
        Fraction(0),
    )


@pytest.mark.parametrize("kind", ["fp8-block", "mxfp4", "nvfp4", "gptq", "awq", "packed-int"])
@pytest.mark.parametrize("mode", [("--global", "0.37"), ("--norm", "0.2")])
def test_counted_checks_agree_with_decoded_checks(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, kind: str, mode: tuple[str, str]
) -> None:
    """The same clip with every check decoding (the view's counted loaders turned off):
    each written weight's exact norm is within C and as close to it as the decoding
    checks got; the factors agree to 2**-40 (the search steers by each check's sum, and
    the counted sum may differ from the decoded one in its last bits); the codes are
    the input's, byte for byte. The counted clip never decoded to check."""
    src = fixture(kind, tmp_path / "in")
    limit = Fraction(float(mode[1]))
    before = real_sumsq(kind, src)
    assert before > limit**2  # the weight is clipped
    suffix = ".safetensors" if src.is_file() else ""
    spies = Spies(monkeypatch)
    counted = clip_json(run_main, src, tmp_path / f"counted{suffix}", *mode)
    assert spies.counted > 0
    assert spies.decoded == 0
    decode_every_check(monkeypatch)
    decoded = clip_json(run_main, src, tmp_path / f"decoded{suffix}", *mode)
    assert spies.decoded > 0
    after = {how: real_sumsq(kind, tmp_path / f"{how}{suffix}") for how in ("counted", "decoded")}
    assert after["counted"] <= limit**2
    assert after["decoded"] <= limit**2
    assert after["counted"] >= min(after["decoded"], limit**2 * (1 - Fraction(1, 2**30)))
    rows = {how: report["tensors"] for how, report in (("counted", counted), ("decoded", decoded))}
    for got, want in zip(rows["counted"], rows["decoded"], strict=True):
        assert got["changed"] == want["changed"]
        if want.get("scale") is not None:
            assert abs(got["scale"] / want["scale"] - 1) <= 2.0**-40
    codes = {
        how: read_raw_safetensors(
            tmp_path / f"{how}{suffix}" if suffix else tmp_path / how / "model.safetensors"
        )
        for how in ("counted", "decoded")
    }
    for name, (dtype, _, payload) in codes["decoded"].items():
        if dtype in ("U8", "F8_E4M3", "I32") and "scale" not in name:
            assert codes["counted"][name][2] == payload


def ones_at_norm_512(directory: Path) -> Path:
    """512 x 512 codes of 1.0 (e4m3 0x38) under scales of 1.0: the norm is exactly 512."""
    (one,) = float32_bits([1.0])
    stored = {
        "layer.weight": ("F8_E4M3", [512, 512], bytes([0x38]) * (512 * 512)),
        "layer.weight_scale_inv": ("F32", [4, 4], f32_payload([one] * 16)),
    }
    return write_model_directory(directory, {"model.safetensors": stored}, FP8_CONFIG)


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
    assert real_sumsq("fp8-block", tmp_path / "below") <= Fraction(below) ** 2


# ---------------------------------------------------------------- block FP8: energies kept


def test_e4m3_squares_are_exact_integers_and_the_block_limit_cannot_overflow() -> None:
    """code_energies sums squares in units of 2**-18 as int64: every e4m3 square is an
    integer there, and ENERGY_BLOCK_LIMIT codes of the largest stay below 2**63."""
    squares = [e4m3fn_value(c) for c in range(256)]
    units = [v**2 * 2**fp8_block.ENERGY_UNIT for v in squares if v is not None]
    assert all(u.denominator == 1 for u in units)
    assert max(units) * fp8_block.ENERGY_BLOCK_LIMIT < 2**63


def energy_reference(codes: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, columns = codes.shape
    out = np.zeros((-(-rows // block[0]), -(-columns // block[1])), dtype=object)
    for (r, c), code in np.ndenumerate(codes):
        value = e4m3fn_value(int(code))
        assert value is not None
        out[r // block[0], c // block[1]] += value**2 * 2**18
    return out


@pytest.mark.parametrize(
    ("rows", "columns", "block"),
    [
        (300, 520, (128, 128)),  # counted per block (256 counts a block pay)
        (5, 9, (2, 4)),  # summed code by code: 8 codes a block
        (40, 64, (1, 1)),  # one scale a code
        (16, 256, (16, 16)),  # exactly 256 codes a block: counted
        (15, 255, (15, 17)),  # 255 codes a block: summed
    ],
)
def test_code_energies_over_runs_that_split_blocks(
    rows: int, columns: int, block: tuple[int, int]
) -> None:
    """Runs of rows starting and stopping inside row blocks, summed as the view sums them:
    each block's energy exactly (Fraction reference)."""
    rng = np.random.default_rng(rows)
    codes = rng.integers(0, 256, (rows, columns)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    scale_shape = (-(-rows // block[0]), -(-columns // block[1]))
    weight = fp8_block_recognised(rows, columns, block)
    small = {"s": np.ones(scale_shape, dtype=np.float32)}
    total = np.zeros(scale_shape[0] * scale_shape[1], dtype=np.int64)
    for start, stop in ((0, 1), (1, 130 % rows or 2), (130 % rows or 2, rows)):
        found = fp8_block.code_energies(weight, as_e4m3(codes[start:stop]), start, stop, small)
        assert found is not None
        first, partial = found  # the run's blocks in the flattened scales
        total[first : first + partial.size] += partial
    assert (total.reshape(scale_shape).astype(object) == energy_reference(codes, block)).all()


def test_small_blocks_never_count_256_codes_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 1 x 1 codes (one scale each): 256 counts a block would take 2 KiB a code
    (an attack held 2.7 GB for a 3 MB checkpoint); the energies are summed code by code,
    in the run's own size, and equal the reference."""
    from clipcli.numerics import coded as coded_module

    def refuse(*_: Any) -> Any:
        raise AssertionError("counted 256 codes a block")

    monkeypatch.setattr(coded_module, "block_code_counts", refuse)
    rng = np.random.default_rng(9)
    codes = rng.integers(0, 0x7F, (32, 48)).astype(np.uint8)
    weight = fp8_block_recognised(32, 48, (1, 1))
    small = {"s": np.ones((32, 48), dtype=np.float32)}
    found = fp8_block.code_energies(weight, as_e4m3(codes[3:20]), 3, 20, small)
    assert found is not None
    first, partial = found
    assert first == 3 * 48
    want = energy_reference(codes, (1, 1))[3:20].reshape(-1)
    assert (partial.astype(object) == want).all()


def as_e4m3(codes: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return codes.view(ml_dtypes.float8_e4m3fn)


def fp8_block_recognised(rows: int, columns: int, block: tuple[int, int]) -> Any:
    from clipcli.logical.quantized.scheme import Recognised
    from clipcli.logical.view import Part

    parts = (Part("w", "codes"), Part("s", "scale"))
    return Recognised("w", "fp8-block", (rows, columns), "w", parts, params={"block": block})


def test_nan_codes_and_e5m2_codes_have_no_energies() -> None:
    weight = fp8_block_recognised(4, 4, (2, 2))
    small = {"s": np.ones((2, 2), dtype=np.float32)}
    codes = np.full((4, 4), 0x38, dtype=np.uint8)
    assert fp8_block.code_energies(weight, as_e4m3(codes), 0, 4, small) is not None
    codes[3, 3] = 0xFF  # NaN
    assert fp8_block.code_energies(weight, as_e4m3(codes), 0, 4, small) is None
    import ml_dtypes

    e5m2 = np.full((4, 4), 0x3C, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
    assert fp8_block.code_energies(weight, e5m2, 0, 4, small) is None


@pytest.mark.parametrize(("limit", "kept"), [(4, True), (3, False)])
def test_the_block_limit_exactly(monkeypatch: pytest.MonkeyPatch, limit: int, kept: bool) -> None:
    """Blocks of 2 x 2 codes: energies at a limit of 4 codes, none at 3."""
    monkeypatch.setattr(fp8_block, "ENERGY_BLOCK_LIMIT", limit)
    weight = fp8_block_recognised(4, 4, (2, 2))
    small = {"s": np.ones((2, 2), dtype=np.float32)}
    codes = as_e4m3(np.full((4, 4), 0x38, dtype=np.uint8))
    assert (fp8_block.code_energies(weight, codes, 0, 4, small) is not None) == kept


@pytest.mark.parametrize(("spare", "kept"), [(0, True), (-1, False)])
def test_the_energy_budget_exactly(
    tmp_path: Path,
    run_main: Any,
    monkeypatch: pytest.MonkeyPatch,
    spare: int,
    kept: bool,
) -> None:
    """A budget of exactly the weight's 15 float32 scales' energies and the scales kept
    (15 x 8 + 15 x 4 bytes) keeps them (the codes counted once for every check); one
    byte less, each check counts them again."""
    src = fixture("fp8-block", tmp_path / "in")
    monkeypatch.setattr(view_module, "ENERGY_BUDGET_BYTES", 15 * 8 + 15 * 4 + spare)
    calls = {"energies": 0, "tables": 0}
    for name, real in (("energies", fp8_block.code_energies), ("tables", fp8_block.code_tables)):

        def spy(*args: Any, name: str = name, real: Any = real) -> Any:
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(fp8_block, f"code_{name}", spy)
    clip_json(run_main, src, tmp_path / "out", "--global", "0.37")
    if kept:
        assert calls["energies"] == 1  # one run of rows, counted once
    else:
        assert calls["energies"] == 0
        assert calls["tables"] > 2  # measured, then counted at every check


@pytest.mark.parametrize(
    ("sizes", "most", "pieces"),
    [((3, 2), 5, [5]), ((3, 3), 5, [3, 3]), ((11,), 5, [5, 5, 1]), ((2, 2, 2), 4, [4, 2])],
)
def test_a_check_works_through_the_kept_scales_in_pieces(
    sizes: tuple[int, ...], most: int, pieces: list[int]
) -> None:
    """Parts joined up to `most` scales a piece (exactly `most` is one piece), a part
    larger than that cut; every energy beside its own scale, in order."""
    parts = [
        (np.arange(n, dtype=np.int64) + 100 * i, (np.arange(n) + 100 * i).astype(np.float32))
        for i, n in enumerate(sizes)
    ]
    got = list(view_module._pieces(parts, most))
    assert [e.size for e, _ in got] == pieces
    energies = np.concatenate([e for e, _ in got])
    scales = np.concatenate([s for _, s in got])
    assert (energies == scales).all()
    assert energies.tolist() == [v for e, _ in parts for v in e.tolist()]


def test_the_check_does_not_depend_on_its_piece_size(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = fixture("fp8-block", tmp_path / "in")
    whole = clip_json(run_main, src, tmp_path / "whole", "--global", "0.37")
    monkeypatch.setattr(view_module, "CHECK_PIECE", 4)  # 15 scales: 4 pieces
    pieces = clip_json(run_main, src, tmp_path / "pieces", "--global", "0.37")
    assert whole == pieces
    assert written(tmp_path / "whole") == written(tmp_path / "pieces")


# ---------------------------------------------------------------- MXFP4: energies per scale code


def test_mxfp4_energies_are_per_scale_code_and_exact() -> None:
    """gpt-oss MXFP4: the sum of e2m1 values squared (units of 1/4) under each of the 255
    finite scale codes, whatever the weight's size; a NaN scale code (0xFF) gives none."""
    from clipcli.logical.quantized import mxfp4

    rng = np.random.default_rng(4)
    stored, codes, exponents, _ = gpt_oss_mxfp4(
        rng, (6,), 2, [int(e) for e in rng.integers(0, 255, 12)]
    )
    weight = mxfp4.recognise(infos_of(stored), None)[0]
    packed = np.frombuffer(stored["mlp.experts.down_proj_blocks"][2], np.uint8)
    small = {"mlp.experts.down_proj_scales": np.array(exponents, dtype=np.uint8)}
    found = mxfp4.code_energies(weight, packed, 0, 6, small)
    assert found is not None
    first, energies = found
    assert first == 0
    assert mxfp4.energy_slots(weight).size == energies.size == 255
    want = [Fraction(0)] * 255
    for row in range(6):
        for j, code in enumerate(codes[row]):
            want[exponents[row * 2 + j // 32]] += e2m1_value(code) ** 2 * 4
    assert energies.tolist() == want
    small["mlp.experts.down_proj_scales"][5] = 0xFF
    assert mxfp4.code_energies(weight, packed, 0, 6, small) is None


def infos_of(stored: dict[str, tuple[str, list[int], bytes]]) -> dict[str, Any]:
    from clipcli.formats.base import TensorInfo
    from clipcli.formats.safetensors.header import dtype_of

    return {
        name: TensorInfo(name, dtype_of(code), tuple(shape), len(payload))
        for name, (code, shape, payload) in stored.items()
    }


@pytest.mark.parametrize(
    ("shape", "block", "kept"),
    [((16, 16), (4, 4), True), ((17, 15), (5, 4), False), ((16, 16), (1, 1), False)],
)
def test_energies_are_kept_where_a_scale_stands_for_16_codes(
    tmp_path: Path,
    run_main: Any,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int],
    block: tuple[int, int],
    kept: bool,
) -> None:
    """16 x 16 codes under 16 scales (16 codes a scale): energies kept; 17 x 15 under 16
    scales (255 codes, one short of 16 a scale) and 1 x 1 blocks: each check counts
    instead (a kept scale costs a check more than decoding its one code would)."""
    rng = np.random.default_rng(11)
    rows, columns = shape
    codes = rng.integers(0, 0x7F, rows * columns).astype(np.uint8)
    scale_shape = [-(-rows // block[0]), -(-columns // block[1])]
    scales = np.ldexp(rng.random(scale_shape) + 1, -4).astype(np.float32)
    stored = {
        "layer.weight": ("F8_E4M3", [rows, columns], codes.tobytes()),
        "layer.weight_scale_inv": ("F32", scale_shape, scales.tobytes()),
    }
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    src = write_model_directory(tmp_path / "in", {"model.safetensors": stored}, config)
    calls: list[int] = []
    real = fp8_block.code_energies

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fp8_block, "code_energies", spy)
    report = clip_json(run_main, src, tmp_path / "out", "--global", "0.01")
    assert report["tensors"][0]["changed"]
    assert bool(calls) == kept
    assert real_sumsq("fp8-block-any", tmp_path / "out") <= Fraction(0.01) ** 2
