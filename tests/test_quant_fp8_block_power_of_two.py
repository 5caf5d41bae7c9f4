"""clip of block-scaled FP8 whose scales are powers of two (issue 21): E8M0 scale bytes
(F8_E8M0, as transformers writes scale_fmt "ue8m0") and float32 scales under config.json's
scale_fmt "ue8m0" (DeepSeek-V3.1: the kernels that serve them keep only the exponent).
The factor is rounded down to a power of two 2**-k: every E8M0 byte s becomes s - k, every
float32 scale is multiplied by 2**-k exactly (so it stays a power of two), the fp8 codes
stay byte for byte, and the dequantized norm never exceeds the limit. A scale that cannot
take the step is refused (exit 4, one line, nothing written).

The reference shares no code with clipcli: files are written and read as raw bytes, fp8
e4m3fn decoded from its definition (1 sign, 4 exponent bits of bias 7, 3 mantissa bits;
exponent 0 subnormal; S.1111.111 NaN), E8M0 as 2**(s - 127), sums of squares exact
Fractions.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from conftest import Run
from handmade import RawTensors, read_raw_safetensors, write_raw_safetensors

BLOCK = (2, 4)  # rows x columns per scale
SHAPE = (3, 6)  # partial edge blocks both ways: scales [2, 2]
WEIGHT, SCALE = "layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight_scale_inv"
NOTE = "scale rounded down to a power of two"

Stored = RawTensors


def e4m3(code: int) -> Fraction:
    sign = -1 if code & 0x80 else 1
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    assert (code & 0x7F) != 0x7F, "NaN code"
    if exponent == 0:
        return sign * Fraction(mantissa, 8) * Fraction(2) ** -6
    return sign * (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


def scale_values(dtype: str, payload: bytes) -> list[Fraction]:
    if dtype == "F8_E8M0":
        return [Fraction(2) ** (byte - 127) for byte in payload]
    assert dtype == "F32"
    return [Fraction(v) for v in struct.unpack(f"<{len(payload) // 4}f", payload)]


def decoded(stored: Stored) -> list[Fraction]:
    codes = stored[WEIGHT][2]
    scales = scale_values(stored[SCALE][0], stored[SCALE][2])
    per_row = -(-SHAPE[1] // BLOCK[1])
    return [
        e4m3(codes[i * SHAPE[1] + j]) * scales[(i // BLOCK[0]) * per_row + j // BLOCK[1]]
        for i in range(SHAPE[0])
        for j in range(SHAPE[1])
    ]


def sumsq(values: list[Fraction]) -> Fraction:
    return sum((v * v for v in values), Fraction(0))


write_safetensors = write_raw_safetensors
read_safetensors = read_raw_safetensors


# fp8 codes 0x38 = 1.0, 0x40 = 2.0, 0xC8 = -4.0, 0x01 = the least subnormal, 0x00 = 0
CODES = bytes([0x38, 0x40, 0xC8, 0x01, 0x00, 0x38] * 3)


def model(tmp_path: Path, scale_dtype: str, scales: bytes, scale_fmt: str | None) -> Path:
    directory = tmp_path / "in"
    directory.mkdir(parents=True)
    config: dict[str, Any] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    if scale_fmt is not None:
        config["scale_fmt"] = scale_fmt
    (directory / "config.json").write_text(json.dumps({"quantization_config": config}))
    write_safetensors(
        directory / "model.safetensors",
        {WEIGHT: ("F8_E4M3", list(SHAPE), CODES), SCALE: (scale_dtype, [2, 2], scales)},
    )
    return directory


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def steps_for(limit: float, norm: float) -> int:
    """k of the largest power of two 2**-k at or below limit / norm (exact: Fractions)."""
    ratio = Fraction(limit) / Fraction(norm)
    k = 0
    while Fraction(1, 2**k) > ratio:
        k += 1
    return k


def clipped(run_main: Callable[..., Run], directory: Path, out: Path, limit: float) -> Run:
    return run_main("clip", "--global", repr(limit), directory, out)


@pytest.mark.parametrize(
    ("scale_dtype", "scales", "scale_fmt"),
    [
        ("F8_E8M0", bytes([127, 120, 130, 127]), None),
        ("F8_E8M0", bytes([127, 120, 130, 127]), "ue8m0"),
        ("F32", f32(1.0, 2.0**-7, 8.0, 1.0), "ue8m0"),
    ],
    ids=["e8m0-no-scale-fmt", "e8m0-ue8m0", "f32-ue8m0"],
)
@pytest.mark.parametrize("limit", [1.0, 7.5, 40.0])
def test_power_of_two_scales_take_a_power_of_two(
    run_main: Callable[..., Run],
    tmp_path: Path,
    scale_dtype: str,
    scales: bytes,
    scale_fmt: str | None,
    limit: float,
) -> None:
    directory = model(tmp_path, scale_dtype, scales, scale_fmt)
    before = read_safetensors(directory / "model.safetensors")
    exact = sumsq(decoded(before))
    norm = math.sqrt(exact)
    run = clipped(run_main, directory, tmp_path / "out", limit)
    assert run.code == 0, run.stderr
    after = read_safetensors(tmp_path / "out" / "model.safetensors")
    assert after[WEIGHT] == before[WEIGHT]  # codes byte for byte
    k = steps_for(limit, norm) if Fraction(limit) ** 2 < exact else 0
    if scale_dtype == "F8_E8M0":
        assert list(after[SCALE][2]) == [b - k for b in before[SCALE][2]]
    else:
        moved = scale_values("F32", after[SCALE][2])
        assert moved == [v / 2**k for v in scale_values("F32", before[SCALE][2])]
        assert all(v.numerator == 1 or v.denominator == 1 for v in moved)  # powers of two
    assert sumsq(decoded(after)) <= Fraction(limit) ** 2
    if k:
        assert sumsq(decoded(after)) * 4 > Fraction(limit) ** 2  # 2**-(k-1) was too much
        assert NOTE in run.stdout
    else:
        assert NOTE not in run.stdout


def test_float32_scales_without_scale_fmt_take_the_exact_factor(
    run_main: Callable[..., Run], tmp_path: Path
) -> None:
    directory = model(tmp_path, "F32", f32(1.0, 2.0**-7, 8.0, 1.0), None)
    run = clipped(run_main, directory, tmp_path / "out", 7.5)
    assert run.code == 0, run.stderr
    moved = scale_values("F32", read_safetensors(tmp_path / "out" / "model.safetensors")[SCALE][2])
    assert any(v.numerator != 1 and v.denominator != 1 for v in moved)  # not powers of two
    assert NOTE not in run.stdout


def e8m0_model_needing(tmp_path: Path, least: int) -> tuple[Path, int]:
    """A model whose least scale byte is `least`, and the k its clip to 2**-20 needs."""
    directory = model(tmp_path, "F8_E8M0", bytes([127, least, 127, 127]), None)
    exact = sumsq(decoded(read_safetensors(directory / "model.safetensors")))
    return directory, steps_for(2.0**-20, math.sqrt(exact))


def test_e8m0_byte_exactly_k_goes_to_zero(run_main: Callable[..., Run], tmp_path: Path) -> None:
    _, k = e8m0_model_needing(tmp_path / "probe", 0)  # block 1 as good as zero, as below
    directory = model(tmp_path, "F8_E8M0", bytes([127, k, 127, 127]), None)
    run = clipped(run_main, directory, tmp_path / "out", 2.0**-20)
    assert run.code == 0, run.stderr
    assert read_safetensors(tmp_path / "out" / "model.safetensors")[SCALE][2][1] == 0


def test_e8m0_byte_one_below_k_is_refused(run_main: Callable[..., Run], tmp_path: Path) -> None:
    _, k = e8m0_model_needing(tmp_path / "probe", 0)  # block 1 as good as zero, as below
    directory = model(tmp_path, "F8_E8M0", bytes([127, k - 1, 127, 127]), None)
    run = clipped(run_main, directory, tmp_path / "out", 2.0**-20)
    assert run.code == 4
    assert run.stderr.count("\n") == 1
    assert "below 0" in run.stderr
    assert not (tmp_path / "out").exists()


def test_e8m0_nan_byte_is_refused(run_main: Callable[..., Run], tmp_path: Path) -> None:
    directory = model(tmp_path, "F8_E8M0", bytes([127, 0xFF, 127, 127]), None)
    run = clipped(run_main, directory, tmp_path / "out", 1.0)
    assert run.code == 4
    assert run.stderr.count("\n") == 1
    assert "NaN" in run.stderr  # the NaN block: refused as any NaN weight is
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("least", "accepted"), [(2.0**-126, True), (2.0**-127, False)])
def test_float32_power_of_two_scale_at_the_normal_edge(
    run_main: Callable[..., Run], tmp_path: Path, least: float, accepted: bool
) -> None:
    """The least float32 scale times 2**-k: exactly float32's least normal is accepted; one
    power below it (a subnormal, whose kernels' exponent reading breaks) is refused."""
    probe = model(tmp_path / "p", "F32", f32(1.0, 0.0, 1.0, 1.0), "ue8m0")  # block 1 ~ 0
    exact = sumsq(decoded(read_safetensors(probe / "model.safetensors")))
    k = steps_for(2.0**-20, math.sqrt(exact))
    directory = model(tmp_path, "F32", f32(1.0, least * 2.0**k, 1.0, 1.0), "ue8m0")
    run = clipped(run_main, directory, tmp_path / "out", 2.0**-20)
    if accepted:
        assert run.code == 0, run.stderr
        moved = read_safetensors(tmp_path / "out" / "model.safetensors")[SCALE][2]
        assert struct.unpack("<4f", moved)[1] == least
    else:
        assert run.code == 4
        assert run.stderr.count("\n") == 1
        assert "normal range" in run.stderr
        assert not (tmp_path / "out").exists()


def test_clip_shows_the_dtype_norms_shows(run_main: Callable[..., Run], tmp_path: Path) -> None:
    """A quantized weight's row says the dtype it dequantizes to, in clip as in norms (clip
    used to show its float64 decoding)."""
    directory = model(tmp_path, "F8_E8M0", bytes([127, 120, 130, 127]), None)
    norms = {
        row["name"]: row["dtype"]
        for row in run_main("norms", directory, "--json").json()["tensors"]
    }
    run = run_main("clip", "--global", "1", "--json", directory, tmp_path / "out")
    assert run.code == 0, run.stderr
    clip = {row["name"]: row["dtype"] for row in run.json()["tensors"]}
    assert clip == norms
    assert clip[WEIGHT] != "float64"


@pytest.mark.parametrize(
    "said", ["UE8M0", " ue8m0", "ue8m0 ", "ue8m0\u0000", "e8m0", 8, True, ["ue8m0"], {"a": 1}]
)
def test_a_scale_fmt_loaders_may_read_either_way_is_refused(
    run_main: Callable[..., Run], tmp_path: Path, said: Any
) -> None:
    """Only the exact "ue8m0" (as loaders compare it) makes the scales powers of two; a near
    miss or a value that is no string is exit 3 in one line, for norms and clip alike."""
    directory = model(tmp_path, "F32", f32(1.5, 3.0, 0.75, 1.0), None)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = said
    (directory / "config.json").write_text(json.dumps(config))
    for command in (("norms", directory), ("clip", "--global", "1", directory, tmp_path / "o")):
        run = run_main(*command)
        assert run.code == 3, run.stderr
        assert run.stderr.count("\n") == 1
        assert "scale_fmt" in run.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("said", [None, "float32"])
def test_a_scale_fmt_that_says_nothing_of_e8m0_reads_plain_scales(
    run_main: Callable[..., Run], tmp_path: Path, said: str | None
) -> None:
    directory = model(tmp_path, "F32", f32(1.5, 3.0, 0.75, 1.0), None)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = said
    (directory / "config.json").write_text(json.dumps(config))
    run = clipped(run_main, directory, tmp_path / "out", 7.5)
    assert run.code == 0, run.stderr
    assert NOTE not in run.stdout
