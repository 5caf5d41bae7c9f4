"""clip of MXFP4 weights (issue 21) through their E8M0 scales: the factor is rounded down
to a power of two 2**-k, every scale byte s becomes s - k, the code bytes stay as they
are, and the dequantized result never exceeds the limit.

The reference here shares no code with clipcli: the files are written and read as raw
bytes, and decoded from the OCP Microscaling (MX) v1.0 definition (E2M1 elements, low
nibble first as gpt-oss and compressed-tensors pack them; E8M0 scale 2**(s - 127), 0xFF
NaN), with every sum of squares an exact Fraction.
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
from handmade import RawTensors, read_raw_safetensors, write_raw_safetensors

BLOCK = 32
E2M1 = [Fraction(m) for m in ("0", "1/2", "1", "3/2", "2", "3", "4", "6")]
BLOCKS, SCALES = "mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales"
WEIGHT = "mlp.experts.down_proj"
NOTE = "scale rounded down to a power of two"

Stored = RawTensors


# ---------------------------------------------------------------- our own reference


def e2m1(code: int) -> Fraction:
    magnitude = E2M1[code & 0x7]
    return -magnitude if code & 0x8 else magnitude


def e8m0(byte: int) -> Fraction:
    assert byte != 0xFF, "NaN scale"
    return Fraction(2) ** (byte - 127)


def decoded(payload: bytes, scales: bytes, columns: int) -> list[Fraction]:
    """Every value of an MXFP4 weight of `columns` per row: two codes per byte (low nibble
    the even element), rows padded to whole bytes, one scale per 32 values of a row."""
    row_bytes = (columns + 1) // 2
    per_row = -(-columns // BLOCK)
    values = []
    for row in range(len(payload) // row_bytes):
        codes = [
            nibble
            for byte in payload[row * row_bytes : (row + 1) * row_bytes]
            for nibble in (byte & 0xF, byte >> 4)
        ]
        for j in range(columns):
            values.append(e2m1(codes[j]) * e8m0(scales[row * per_row + j // BLOCK]))
    return values


def sumsq(values: list[Fraction]) -> Fraction:
    return sum((v * v for v in values), Fraction(0))


def pack(codes: list[int]) -> bytes:
    return bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))


write_safetensors = write_raw_safetensors
read_safetensors = read_raw_safetensors


def gpt_oss(
    rng: np.random.Generator,
    rows: int,
    blocks: int,
    exponents: list[int] | None = None,
    prefix: str = "mlp.experts.down_proj",
) -> Stored:
    """gpt-oss's layout: X_blocks U8 [rows, blocks, 16], X_scales U8 [rows, blocks]."""
    codes = [int(c) for c in rng.integers(0, 16, rows * blocks * BLOCK)]
    codes[:16] = range(16)  # every code
    if exponents is None:
        exponents = [int(e) for e in rng.integers(110, 140, rows * blocks)]
    return {
        prefix + "_blocks": ("U8", [rows, blocks, 16], pack(codes)),
        prefix + "_scales": ("U8", [rows, blocks], bytes(exponents)),
    }


def weight_values(stored: Stored, prefix: str = "mlp.experts.down_proj") -> list[Fraction]:
    _, shape, payload = stored[prefix + "_blocks"]
    return decoded(payload, stored[prefix + "_scales"][2], shape[-2] * BLOCK)


def least_float_at_or_above(exact: Fraction) -> float:
    """The least float64 whose square is at least `exact` (a sum of squares)."""
    norm = math.sqrt(float(exact))
    while Fraction(norm) ** 2 < exact:
        norm = math.nextafter(norm, math.inf)
    while Fraction(math.nextafter(norm, 0.0)) ** 2 >= exact:
        norm = math.nextafter(norm, 0.0)
    return norm


def steps_needed(exact: Fraction, limit: float) -> int:
    """The least k >= 0 with exact / 4**k <= limit**2: the tightest power of two."""
    k = 0
    while exact / 4**k > Fraction(limit) ** 2:
        k += 1
    return k


def clip(run_main: Any, src: Path, out: Path, *mode: str) -> dict[str, dict[str, Any]]:
    result = run_main("clip", *mode, src, out, "--format", "json")
    assert result.code == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)["tensors"]}


def refused(run_main: Any, src: Path, out: Path, *mode: str) -> str:
    result = run_main("clip", *mode, src, out)
    assert result.code == 4, (result.code, result.stdout, result.stderr)
    lines: list[str] = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("clipcli: error: ")
    assert not out.exists()
    return lines[0]


# ---------------------------------------------------------------- one weight


@pytest.mark.parametrize("where", ["at", "just-above", "far-above", "power-of-two"])
def test_a_clip_lowers_every_scale_byte_by_k(tmp_path: Path, run_main: Any, where: str) -> None:
    """The tensor's norm at the limit: unchanged, bit-identical. Just above it: halved
    (k = 1). Far above: the least k that reaches the limit, every byte s -> s - k. A norm
    exactly 2**k times the limit takes exactly that k (the result is exactly at C)."""
    stored = gpt_oss(np.random.default_rng(1), 3, 4)
    exact = sumsq(weight_values(stored))
    at = least_float_at_or_above(exact)
    limit = {
        "at": at,
        "just-above": math.nextafter(at, 0.0),
        "far-above": at / 1000,
        "power-of-two": at / 8,
    }[where]
    if where == "power-of-two":  # 256 ones at 2**0: norm 16 = 2**3 * C, exactly
        stored[SCALES] = ("U8", [3, 4], bytes([127] * 12))
        stored[BLOCKS] = ("U8", [3, 4, 16], pack([0x2] * 256 + [0x0] * 128))
        exact = sumsq(weight_values(stored))
        assert exact == 256
        limit = 2.0
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    rows = clip(run_main, src, out, "--norm", repr(limit))
    written = read_safetensors(out)
    assert written[BLOCKS] == stored[BLOCKS]  # the codes, byte for byte
    after = sumsq(weight_values(written))
    assert after <= Fraction(limit) ** 2  # the promise, exactly
    k = steps_needed(exact, limit)
    assert {"at": 0, "just-above": 1, "power-of-two": 3}.get(where, k) == k
    assert written[SCALES][2] == bytes(s - k for s in stored[SCALES][2])
    assert after == exact / 4**k
    if k == 0:
        assert written == stored  # every tensor bit-identical
        assert not rows[WEIGHT]["changed"]
    else:
        assert rows[WEIGHT]["scale"] == 2.0**-k
        assert NOTE in rows[WEIGHT]["note"]
        assert rows[WEIGHT]["norm_after"] == pytest.approx(math.sqrt(after), rel=1e-15)


def test_the_table_says_the_factor_was_rounded(tmp_path: Path, run_main: Any) -> None:
    stored = gpt_oss(np.random.default_rng(2), 2, 2)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    result = run_main("clip", "--norm", "0.001", src, tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    assert NOTE in result.stdout


def test_compressed_tensors_mxfp4_pack_with_a_partial_block(tmp_path: Path, run_main: Any) -> None:
    """compressed-tensors `mxfp4-pack-quantized`: weight_packed [out, in/2], an F8_E8M0
    weight_scale [out, ceil(in/32)], in = 40 (the second block of a row is partial)."""
    rng = np.random.default_rng(3)
    out_rows, columns = 5, 40
    codes = [int(c) for c in rng.integers(0, 16, out_rows * columns)]
    exponents = [int(e) for e in rng.integers(120, 135, out_rows * 2)]
    stored = {
        "layer.weight_packed": ("U8", [out_rows, columns // 2], pack(codes)),
        "layer.weight_scale": ("F8_E8M0", [out_rows, 2], bytes(exponents)),
    }
    directory = tmp_path / "m"
    directory.mkdir()
    write_safetensors(directory / "model.safetensors", stored)
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}},
        }
    }
    (directory / "config.json").write_text(json.dumps(config))
    exact = sumsq(decoded(stored["layer.weight_packed"][2], bytes(exponents), columns))
    limit = float(math.sqrt(exact)) / 5
    out = tmp_path / "out"
    rows = clip(run_main, directory, out, "--norm", repr(limit))
    written = read_safetensors(out / "model.safetensors")
    k = steps_needed(exact, limit)
    assert k == 3
    assert written["layer.weight_packed"] == stored["layer.weight_packed"]
    assert written["layer.weight_scale"] == (
        "F8_E8M0",
        [out_rows, 2],
        bytes(e - k for e in exponents),
    )
    after = sumsq(
        decoded(stored["layer.weight_packed"][2], written["layer.weight_scale"][2], columns)
    )
    assert after <= Fraction(limit) ** 2
    assert rows["layer.weight"]["scale"] == 2.0**-k


# ---------------------------------------------------------------- refusals and edges


def test_a_nan_scale_byte_is_refused_naming_the_weight(tmp_path: Path, run_main: Any) -> None:
    stored = gpt_oss(np.random.default_rng(4), 2, 2, exponents=[127, 255, 120, 130])
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    line = refused(run_main, src, tmp_path / "out.safetensors", "--norm", "0.01")
    assert WEIGHT in line
    # --skip-nonfinite leaves it as it is, byte for byte
    out = tmp_path / "kept.safetensors"
    result = run_main("clip", "--norm", "0.01", "--skip-nonfinite", src, out, "-q")
    assert result.code == 0, result.stderr
    assert read_safetensors(out) == stored


def test_the_view_refuses_a_nan_scale_byte_for_any_factor(tmp_path: Path) -> None:
    """The view's own check (refused_factor), which the plan reaches only when the NaN
    block was not measured as such: a NaN scale byte is never rewritten."""
    from clipcli.formats.opening import open_reader
    from clipcli.logical.quantized.view import QuantizedView

    stored = gpt_oss(np.random.default_rng(5), 1, 2, exponents=[127, 255])
    path = write_safetensors(tmp_path / "in.safetensors", stored)
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        (tensor,) = view.tensors()
        why = view.refused_factor(reader, tensor, 0.5, 0)
    assert why is not None
    assert why.startswith(WEIGHT + ": ")
    assert "0xFF" in why


def underflow_edge(low_byte: int, low_codes: list[int]) -> Stored:
    """Block 0: 32 ones at 2**0 (norm sqrt(32)); block 1: `low_codes` at 2**(low_byte -
    127). A limit of 1 takes k = 3 (sqrt(32) / 8 <= 1 < sqrt(32) / 4)."""
    return {
        BLOCKS: ("U8", [1, 2, 16], pack([0x2] * 32 + low_codes)),
        SCALES: ("U8", [1, 2], bytes([127, low_byte])),
    }


@pytest.mark.parametrize("low_byte", [3, 4])
def test_a_scale_byte_at_k_goes_to_zero(tmp_path: Path, run_main: Any, low_byte: int) -> None:
    stored = underflow_edge(low_byte, [0x7] * 32)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    clip(run_main, src, out, "--norm", "1")
    written = read_safetensors(out)
    assert written[SCALES][2] == bytes([124, low_byte - 3])
    assert written[BLOCKS] == stored[BLOCKS]
    assert sumsq(weight_values(written)) <= 1


def test_a_scale_byte_below_k_under_nonzero_codes_is_refused(tmp_path: Path, run_main: Any) -> None:
    """s = k - 1: 2**(s - k - 127) is below E8M0's least value; keeping s would leave the
    block unscaled, clamping it to 0 would not scale it by 2**-k: refused, nothing written."""
    stored = underflow_edge(2, [0x0] * 31 + [0x9])  # one nonzero code (-0.5)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    line = refused(run_main, src, tmp_path / "out.safetensors", "--norm", "1")
    assert WEIGHT in line
    assert "2**-3" in line
    assert "byte 2 at block 1" in line


def test_a_limit_no_byte_can_reach_is_refused_naming_the_weight(
    tmp_path: Path, run_main: Any
) -> None:
    """Every byte below the k the limit needs: the factor search sees the values that k
    would give (not the blocks left unscaled), so the refusal names the weight and the
    byte, never a bare 'no factor found'."""
    stored = gpt_oss(np.random.default_rng(11), 2, 2, exponents=[5, 6, 7, 8])
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    line = refused(run_main, src, tmp_path / "out.safetensors", "--norm", "1e-40")
    assert f"{WEIGHT}: scaling by 2**-" in line
    assert "byte 5 at block 0" in line


def test_a_zero_block_below_k_keeps_its_byte(tmp_path: Path, run_main: Any) -> None:
    """A block whose codes are all +-0 is zero whatever its scale (quantizers give such
    blocks the least exponent, byte 0): it keeps its byte, and the rest is scaled."""
    stored = underflow_edge(0, [0x0] * 16 + [0x8] * 16)  # +0 and -0
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    clip(run_main, src, out, "--norm", "1")
    written = read_safetensors(out)
    assert written[SCALES][2] == bytes([124, 0])
    assert written[BLOCKS] == stored[BLOCKS]


def test_axes_and_value_are_refused_in_one_line(tmp_path: Path, run_main: Any) -> None:
    stored = gpt_oss(np.random.default_rng(6), 2, 2)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    line = refused(run_main, src, tmp_path / "a.safetensors", "--norm", "0.1", "--axes", "-1")
    assert WEIGHT in line
    assert "axes" in line
    line = refused(run_main, src, tmp_path / "v.safetensors", "--value", "0.1")
    assert WEIGHT in line
    assert "--exclude" in line


# ---------------------------------------------------------------- beside other tensors


def bf16_tensor(rng: np.random.Generator, count: int) -> bytes:
    """Finite bfloat16 values' bits (float32 values cut to their upper half)."""
    values = rng.normal(0, 2, count).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    return bits.tobytes()


def bf16_values(payload: bytes) -> list[Fraction]:
    out = []
    for (bits,) in struct.iter_unpack("<H", payload):
        (value,) = struct.unpack("<f", struct.pack("<I", bits << 16))
        out.append(Fraction(value))
    return out


def test_global_clip_beside_bf16_tensors_keeps_the_global_bound(
    tmp_path: Path, run_main: Any
) -> None:
    """--global over MXFP4 weights and bf16 tensors: the bf16 tensors take the group's
    factor f, the MXFP4 ones 2**-k <= f (the largest power of two at or below it); the
    global norm of what is written stays within C, summed exactly."""
    rng = np.random.default_rng(7)
    stored = gpt_oss(rng, 2, 3, prefix="layers.0.mlp.down_proj")
    stored.update(gpt_oss(rng, 3, 1, prefix="layers.1.mlp.up_proj"))
    plain = bf16_tensor(rng, 50)
    stored["layers.0.attn.weight"] = ("BF16", [5, 10], plain)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    before = (
        sumsq(weight_values(stored, "layers.0.mlp.down_proj"))
        + sumsq(weight_values(stored, "layers.1.mlp.up_proj"))
        + sumsq(bf16_values(plain))
    )
    limit = math.sqrt(float(before)) / 3
    out = tmp_path / "out.safetensors"
    rows = clip(run_main, src, out, "--global", repr(limit))
    written = read_safetensors(out)
    after = (
        sumsq(weight_values(written, "layers.0.mlp.down_proj"))
        + sumsq(weight_values(written, "layers.1.mlp.up_proj"))
        + sumsq(bf16_values(written["layers.0.attn.weight"][2]))
    )
    assert after <= Fraction(limit) ** 2
    f = rows["layers.0.attn.weight"]["scale"]
    # the bf16 tensor takes the factor a plain checkpoint would give it: C / G, within
    # bf16's rounding (the MXFP4 weights' rounding down leaves it no larger factor)
    uniform = limit / math.sqrt(float(before))
    assert uniform * (1 - 2**-7) <= f <= uniform * (1 + 2**-7)
    k = 1 - math.frexp(f)[1]  # 2**-k <= f < 2**(1 - k)
    for prefix in ("layers.0.mlp.down_proj", "layers.1.mlp.up_proj"):
        assert written[prefix + "_blocks"] == stored[prefix + "_blocks"]
        assert written[prefix + "_scales"][2] == bytes(s - k for s in stored[prefix + "_scales"][2])
        assert rows[prefix]["scale"] == 2.0**-k
        assert NOTE in rows[prefix]["note"]
    assert NOTE not in rows["layers.0.attn.weight"]["note"]


def test_group_by_gives_each_group_its_power_of_two(tmp_path: Path, run_main: Any) -> None:
    rng = np.random.default_rng(8)
    stored = gpt_oss(rng, 2, 2, prefix="layers.0.mlp.down_proj")
    stored.update(
        gpt_oss(rng, 2, 2, [e - 6 for e in range(130, 134)], prefix="layers.1.mlp.down_proj")
    )
    plain = bf16_tensor(rng, 8)
    stored["layers.1.norm.weight"] = ("BF16", [8], plain)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    limit = 0.5
    rows = clip(run_main, src, out, "--global", repr(limit), "--group-by", r"layers\.(\d+)\.")
    written = read_safetensors(out)
    for layer in ("0", "1"):
        prefix = f"layers.{layer}.mlp.down_proj"
        total = sumsq(weight_values(written, prefix))
        if layer == "1":
            total += sumsq(bf16_values(written["layers.1.norm.weight"][2]))
        assert total <= Fraction(limit) ** 2
        assert written[prefix + "_blocks"] == stored[prefix + "_blocks"]
        k = -round(math.log2(rows[prefix]["scale"]))
        assert rows[prefix]["scale"] == 2.0**-k
        assert written[prefix + "_scales"][2] == bytes(s - k for s in stored[prefix + "_scales"][2])
    # the group of layer 0 holds one MXFP4 weight alone: the tightest power of two
    exact0 = sumsq(weight_values(stored, "layers.0.mlp.down_proj"))
    assert rows["layers.0.mlp.down_proj"]["scale"] == 2.0 ** -steps_needed(exact0, limit)


def test_average_clip_rounds_per_tensor(tmp_path: Path, run_main: Any) -> None:
    """--average C: the norm divided by numel is held to C (TF's clip_by_average_norm)."""
    stored = gpt_oss(np.random.default_rng(9), 2, 2)
    src = write_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    clip(run_main, src, out, "--average", "0.01")
    written = read_safetensors(out)
    exact = sumsq(weight_values(stored))
    limit = Fraction(0.01) * 2 * 2 * BLOCK
    k = 0
    while exact / 4**k > limit**2:
        k += 1
    assert k > 1
    assert written[SCALES][2] == bytes(s - k for s in stored[SCALES][2])
    assert sumsq(weight_values(written)) <= limit**2


# ---------------------------------------------------------------- GGUF's MXFP4 blocks


def gguf_mxfp4_blocks(exponents: list[int], codes: list[int]) -> np.ndarray:
    """GGUF MXFP4 blocks of 17 bytes: the E8M0 exponent, then 16 bytes whose low nibbles
    are elements 0-15 and high nibbles elements 16-31 (ggml's block_mxfp4)."""
    out = bytearray()
    for b, e in enumerate(exponents):
        block = codes[b * BLOCK : (b + 1) * BLOCK]
        out.append(e)
        out += bytes(block[j] | block[16 + j] << 4 for j in range(16))
    return np.frombuffer(bytes(out), np.uint8).reshape(2, -1)


def gguf_mxfp4_values(raw: bytes) -> list[Fraction]:
    values = []
    for start in range(0, len(raw), 17):
        scale = e8m0(raw[start])
        qs = raw[start + 1 : start + 17]
        codes = [q & 0xF for q in qs] + [q >> 4 for q in qs]
        values += [e2m1(c) * scale for c in codes]
    return values


def test_gguf_mxfp4_blocks_take_a_power_of_two(tmp_path: Path, run_main: Any) -> None:
    """GGUF's MXFP4 (issue 21's sibling): each block's exponent byte e -> e - k, its code
    bytes kept; checked with our decoder and with gguf.quants' own."""
    pytest.importorskip("gguf")
    from test_gguf_writer import read_back, write_gguf

    rng = np.random.default_rng(10)
    exponents = [int(e) for e in rng.integers(115, 135, 4)]
    codes = [int(c) for c in rng.integers(0, 16, 4 * BLOCK)]
    raw = gguf_mxfp4_blocks(exponents, codes)
    src = write_gguf(tmp_path / "m.gguf", {"mx": (raw, "MXFP4")})
    exact = sumsq(gguf_mxfp4_values(raw.tobytes()))
    limit = math.sqrt(float(exact)) / 6
    out = tmp_path / "o.gguf"
    rows = clip(run_main, src, out, "--norm", repr(limit))
    kind, written, values = read_back(out)["mx"]
    assert kind == "MXFP4"
    k = steps_needed(exact, limit)
    assert k == 3
    blocks, before = written.reshape(-1, 17), raw.reshape(-1, 17)
    assert (blocks[:, 1:] == before[:, 1:]).all()  # the codes, byte for byte
    assert blocks[:, 0].tolist() == [e - k for e in exponents]
    after = sumsq(gguf_mxfp4_values(written.tobytes()))
    assert after <= Fraction(limit) ** 2
    assert after == exact / 4**k
    assert sumsq([Fraction(float(v)) for v in values.ravel()]) == after  # gguf agrees
    assert rows["mx"]["scale"] == 2.0**-k
    assert NOTE in rows["mx"]["note"]


def test_gguf_mxfp4_exponent_below_k_is_refused(tmp_path: Path, run_main: Any) -> None:
    pytest.importorskip("gguf")
    from test_gguf_writer import write_gguf

    # block 0: 32 ones at 2**0 (norm sqrt(32): a limit of 1 takes k = 3); the others at
    # exponents 3, 0 (zero codes: kept) and 2 (one nonzero code: refused)
    codes = [0x2] * 32 + [0x7] * 32 + [0x0] * 16 + [0x8] * 16 + [0x0] * 31 + [0x1]
    raw = gguf_mxfp4_blocks([127, 3, 0, 2], codes)
    src = write_gguf(tmp_path / "m.gguf", {"mx": (raw, "MXFP4")})
    line = refused(run_main, src, tmp_path / "o.gguf", "--norm", "1")
    assert "mx: scaling by 2**-3" in line
    assert "exponent 2 at block 3" in line
    # a limit every exponent is too low for: named, never a bare "no factor found"
    line = refused(run_main, src, tmp_path / "o2.gguf", "--norm", "1e-40")
    assert "mx: scaling by 2**-" in line
    # without the last block, the clip goes through: 127 -> 124, 3 -> 0, 0 kept
    raw = gguf_mxfp4_blocks([127, 3, 0, 5], codes)
    src = write_gguf(tmp_path / "ok.gguf", {"mx": (raw, "MXFP4")})
    out = tmp_path / "ok-out.gguf"
    clip(run_main, src, out, "--norm", "1")
    from test_gguf_writer import read_back

    _, written, _ = read_back(out)["mx"]
    assert written.reshape(-1, 17)[:, 0].tolist() == [124, 0, 0, 2]


def test_scales_in_another_shard_than_their_blocks(tmp_path: Path, run_main: Any) -> None:
    """A gpt-oss model directory whose X_scales sit in the second shard: the bytes are
    rewritten there, the blocks in the first shard kept."""
    stored = gpt_oss(np.random.default_rng(12), 2, 3)
    directory = tmp_path / "m"
    directory.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": BLOCKS,
        "model-00002-of-00002.safetensors": SCALES,
    }
    for shard, name in shards.items():
        write_safetensors(directory / shard, {name: stored[name]})
    index = {"metadata": {}, "weight_map": {name: shard for shard, name in shards.items()}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "mxfp4"}})
    )
    exact = sumsq(weight_values(stored))
    limit = math.sqrt(float(exact)) / 3
    out = tmp_path / "out"
    clip(run_main, directory, out, "--norm", repr(limit))
    k = steps_needed(exact, limit)
    first = read_safetensors(out / "model-00001-of-00002.safetensors")
    second = read_safetensors(out / "model-00002-of-00002.safetensors")
    assert first == {BLOCKS: stored[BLOCKS]}
    assert second[SCALES][2] == bytes(s - k for s in stored[SCALES][2])
    assert sumsq(weight_values({**first, **second})) <= Fraction(limit) ** 2


def test_gguf_global_clip_beside_other_block_types_keeps_the_bound(
    tmp_path: Path, run_main: Any
) -> None:
    """--global over GGUF MXFP4 beside Q8_0 blocks and a float32 tensor: the global norm
    of what gguf dequantizes from OUT stays within C, summed exactly; MXFP4 took 2**-k at
    or below the factor the others took."""
    pytest.importorskip("gguf")
    from test_gguf_writer import read_back, write_gguf

    rng = np.random.default_rng(13)
    exponents = [int(e) for e in rng.integers(120, 130, 4)]
    raw = gguf_mxfp4_blocks(exponents, [int(c) for c in rng.integers(0, 16, 4 * BLOCK)])
    src = write_gguf(
        tmp_path / "m.gguf",
        {
            "mx": (raw, "MXFP4"),
            "q": (rng.standard_normal((2, 64)).astype(np.float32), "Q8_0"),
            "f": rng.standard_normal(8).astype(np.float32),
        },
    )
    before = read_back(src)
    total = sum(
        (sumsq([Fraction(float(v)) for v in values.ravel()]) for _, _, values in before.values()),
        Fraction(0),
    )
    limit = math.sqrt(float(total)) / 5
    out = tmp_path / "o.gguf"
    rows = clip(run_main, src, out, "--global", repr(limit))
    after = read_back(out)
    written = sum(
        (sumsq([Fraction(float(v)) for v in values.ravel()]) for _, _, values in after.values()),
        Fraction(0),
    )
    assert written <= Fraction(limit) ** 2
    f = rows["f"]["scale"]
    k = 1 - math.frexp(f)[1]
    assert rows["mx"]["scale"] == 2.0**-k
    blocks = after["mx"][1].reshape(-1, 17)
    assert blocks[:, 0].tolist() == [e - k for e in exponents]
    assert (blocks[:, 1:] == raw.reshape(-1, 17)[:, 1:]).all()
