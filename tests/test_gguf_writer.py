"""GGUF written (issue 22): `clip` of a GGUF file writes GGUF, block-quantized tensors
clipped through their float16 block scales only, and `convert` writes GGUF from GGUF
(byte for byte) and from other formats.

Every output is read back with gguf's own GGUFReader and `gguf.quants.dequantize`, in
float64; norms are compared with the limit exactly (Fraction); the scale fields' offsets
are written here from ggml-common.h's block structs, not taken from clipcli."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import MainRun
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file

# ggml-common.h: where each block keeps the float16 scales its values are linear in.
FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0"]  # gguf.quantize's
PLAIN = {"F32": np.float32, "F16": np.float16}
RANDOM_BLOCKS = [t for t in FIELDS if t not in QUANTIZABLE]  # K-quants, IQ: no quantizer


def write_gguf(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, str]]) -> Path:
    """name -> a plain array, or (array, ggml type): float values quantized by gguf, uint8
    rows taken as that type's raw blocks."""
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_context_length(4096)
    out.add_token_list([f"tok{i}" for i in range(300)])
    out.add_float32("test.scale", 0.25)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            array, kind = value
            qtype = GGMLQuantizationType[kind]
            data = array if array.dtype == np.uint8 else quantize(array, qtype)
            out.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            out.add_tensor(name, value)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


def random_blocks(kind: str, blocks: int, seed: int = 0) -> np.ndarray:
    """Rows of random blocks of `kind` whose float16 scales are finite, in [0.5, 2)."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (2, blocks * size), dtype=np.uint8)
    view = raw.reshape(2, blocks, size)
    for offset in FIELDS[kind]:
        scales = rng.uniform(0.5, 2.0, (2, blocks)).astype("<f2")
        view[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(2, blocks, 2)
    return raw


def read_back(path: Path) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    """name -> (ggml type, its stored bytes as uint8, its values in float64), by gguf."""
    reader = gguf.GGUFReader(str(path))
    found = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        kind = t.tensor_type.name
        values = data if kind in ("F32", "F16", "F64") else dequantize(data, t.tensor_type)
        found[t.name] = (kind, data.view(np.uint8).reshape(-1).copy(), values.astype(np.float64))
    return found


def exact_sumsq(values: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in values.ravel()), Fraction(0))


def fields_of(path: Path) -> dict[str, tuple[list[int], bytes]]:
    """Every metadata key as gguf reads it: its value types and raw value bytes."""
    reader = gguf.GGUFReader(str(path))
    return {
        name: (list(field.types), b"".join(bytes(np.asarray(p)) for p in field.parts))
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")  # the counts: tensor and KV count, version
    }


def payload(kind: str, raw: np.ndarray) -> np.ndarray:
    """The blocks' bytes with their scale fields zeroed: what a clip must not touch."""
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = raw.reshape(-1, size).copy()
    for offset in FIELDS.get(kind, ()):
        blocks[:, offset : offset + 2] = 0
    return blocks


def clip_norm(clipcli: Any, src: Path, out: Path, limit: float, *more: str) -> MainRun:
    run: MainRun = clipcli("clip", src, out, "--norm", repr(limit), "--format", "json", *more)
    return run


def one_line(run: MainRun) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("clipcli: error: ")
    return lines[0]


# ------------------------------------------------------------ clip: block scales only


@pytest.fixture(scope="module")
def every_clippable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tensor of each type gguf quantizes, the F32/F16 plain ones, and random blocks
    of each K-quant and IQ type that has float16 scales."""
    rng = np.random.default_rng(22)
    tensors: dict[str, np.ndarray | tuple[np.ndarray, str]] = {
        kind.lower(): (rng.standard_normal((3, 512)).astype(np.float32), kind)
        for kind in QUANTIZABLE
    }
    for kind, dtype in PLAIN.items():
        tensors[kind.lower()] = (rng.standard_normal((3, 64)) * 9).astype(dtype)
    for seed, kind in enumerate(RANDOM_BLOCKS):
        tensors[kind.lower()] = (random_blocks(kind, 2, seed), kind)
    return write_gguf(tmp_path_factory.mktemp("clip") / "m.gguf", tensors)


@pytest.mark.parametrize("where", ["far above", "just above", "within"])
def test_clip_rescales_block_scales_only_and_stays_within_the_limit(
    clipcli: Any, every_clippable: Path, tmp_path: Path, where: str
) -> None:
    """Each tensor clipped by --norm to a limit its norm is far above, just above, or just
    within: read back by gguf, every norm is <= its limit exactly, every block's bytes but
    its scale fields are the source's, and the metadata and alignment are the source's."""
    source = read_back(every_clippable)
    norms = {name: math.sqrt(exact_sumsq(v)) for name, (_, _, v) in source.items()}
    for name, (kind, raw, _) in source.items():
        limit = {"far above": norms[name] / 100, "just above": norms[name] * (1 - 2**-20)}.get(
            where, norms[name] * (1 + 2**-20)
        )
        out = tmp_path / f"{name}.gguf"
        run = clip_norm(clipcli, every_clippable, out, limit, "--include", name)
        assert run.returncode == 0, (name, run.stderr)
        written = read_back(out)
        assert list(written) == list(source)
        got_kind, got_raw, got_values = written[name]
        assert got_kind == kind
        assert exact_sumsq(got_values) <= Fraction(limit) ** 2, (name, where)
        row = next(t for t in json.loads(run.stdout)["tensors"] if t["name"] == name)
        assert row["changed"] is (where != "within"), name
        if where == "within":
            assert got_raw.tobytes() == raw.tobytes(), name
        elif kind in FIELDS:
            np.testing.assert_array_equal(payload(kind, got_raw), payload(kind, raw))
            assert exact_sumsq(got_values) >= Fraction(limit) ** 2 * Fraction(9, 10), name
        for other, (_, other_raw, _) in source.items():
            if other != name:
                assert written[other][1].tobytes() == other_raw.tobytes(), (name, other)
        assert fields_of(out) == fields_of(every_clippable)
        assert (
            gguf.GGUFReader(str(out)).alignment == gguf.GGUFReader(str(every_clippable)).alignment
        )


def q8_0_blocks(d: float, codes: list[int]) -> np.ndarray:
    """One row of Q8_0 blocks: float16 d, then 32 int8 codes per block."""
    assert len(codes) % 32 == 0
    blocks = []
    for start in range(0, len(codes), 32):
        blocks.append(
            np.float16(d).tobytes() + np.asarray(codes[start : start + 32], np.int8).tobytes()
        )
    return np.frombuffer(b"".join(blocks), np.uint8).reshape(1, -1).copy()


@pytest.mark.parametrize(
    ("limit", "changed"),
    [(5.0, False), (math.nextafter(5.0, 0.0), True), (5.0 * (1 - 2**-11), True), (0.5, True)],
)
def test_a_norm_exactly_at_the_limit_is_kept_byte_for_byte(
    clipcli: Any, tmp_path: Path, limit: float, changed: bool
) -> None:
    """d = 1, codes 3 and 4: the norm is exactly 5. At 5 the file's tensor bytes are the
    source's; one ulp below 5 the d is rescaled (float16 rounds it down: never above)."""
    src = write_gguf(
        tmp_path / "five.gguf",
        {"w": (q8_0_blocks(1.0, [3, 4] + [0] * 62), "Q8_0"), "b": np.ones(4, np.float32)},
    )
    out = tmp_path / "o.gguf"
    run = clip_norm(clipcli, src, out, limit, "--include", "w")
    assert run.returncode == 0, run.stderr
    before, after = read_back(src), read_back(out)
    assert exact_sumsq(before["w"][2]) == 25
    assert exact_sumsq(after["w"][2]) <= Fraction(limit) ** 2
    assert (after["w"][1].tobytes() != before["w"][1].tobytes()) is changed
    if not changed:
        assert out.read_bytes() == src.read_bytes()
    np.testing.assert_array_equal(payload("Q8_0", after["w"][1]), payload("Q8_0", before["w"][1]))


def test_a_global_clip_over_mixed_types_stays_within_the_limit(
    clipcli: Any, every_clippable: Path, tmp_path: Path
) -> None:
    """--global over F16 (searched through its histogram), F32 and block tensors (their
    float16 scales round: every factor checked by dequantizing): the global norm of what
    gguf reads back is <= the limit exactly, and near it."""
    source = read_back(every_clippable)
    total = sum((exact_sumsq(v) for _, _, v in source.values()), Fraction(0))
    for ratio in (0.999, 0.5, 0.01):
        limit = math.sqrt(total) * ratio
        out = tmp_path / f"g{ratio}.gguf"
        run = clipcli("clip", every_clippable, out, "--global", repr(limit))
        assert run.returncode == 0, run.stderr
        after = sum((exact_sumsq(v) for _, _, v in read_back(out).values()), Fraction(0))
        assert after <= Fraction(limit) ** 2, ratio
        assert after >= Fraction(limit) ** 2 * Fraction(98, 100), ratio


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_scaling_the_scale_fields_scales_every_value(kind: str) -> None:
    """By 1/2 (exact in float16 for scales in [0.5, 2)): gguf dequantizes each block to
    exactly half its values, so the values are linear in these fields and in no other."""
    from clipcli.logical.gguf import scale_fields

    qtype = GGMLQuantizationType[kind]
    raw = random_blocks(kind, 3, seed=7)
    scaled = scale_fields(kind, raw.reshape(-1), 0.5, 0).reshape(raw.shape)
    before = dequantize(raw, qtype).astype(np.float64)
    after = dequantize(scaled, qtype).astype(np.float64)
    np.testing.assert_array_equal(after, before / 2)
    np.testing.assert_array_equal(payload(kind, scaled), payload(kind, raw))


# ------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def with_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(4)
    return write_gguf(
        tmp_path_factory.mktemp("mx") / "m.gguf",
        {
            "mx": (rng.standard_normal((2, 64)).astype(np.float32), "MXFP4"),
            "q": (rng.standard_normal((2, 64)).astype(np.float32), "Q8_0"),
        },
    )


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        # issue 21: MXFP4 was refused here; its E8M0 exponents now take a power of two
        # (tests/test_quant_mxfp4_clip.py::test_gguf_mxfp4_blocks_take_a_power_of_two)
        (["--value", "0.1", "--include", "q"], 4, "cannot be clipped by clamp"),
        (["--norm", "1", "--axes", "0", "--include", "q"], 4, "cannot be clipped by axes"),
    ],
)
def test_a_clip_the_block_scales_cannot_carry_is_refused_in_one_line(
    clipcli: Any, with_mxfp4: Path, tmp_path: Path, argv: list[str], code: int, words: str
) -> None:
    out = tmp_path / "o.gguf"
    run = clipcli("clip", with_mxfp4, out, *argv)
    assert run.returncode == code, run.stderr
    assert words in one_line(run)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_clip_of_blocks_into_another_format_is_refused(
    clipcli: Any, with_mxfp4: Path, tmp_path: Path, suffix: str
) -> None:
    """Refused before any loss line (a .pt cannot hold the metadata either)."""
    out = tmp_path / f"o{suffix}"
    run = clipcli("clip", with_mxfp4, out, "--norm", "1", "--include", "q")
    assert run.returncode == 2, run.stderr
    assert "convert to it first" in one_line(run)
    assert not out.exists()


# ------------------------------------------------------------ convert


def test_convert_gguf_to_gguf_is_the_same_file(
    clipcli: Any, every_clippable: Path, tmp_path: Path
) -> None:
    out = tmp_path / "c.gguf"
    run = clipcli("convert", every_clippable, out)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes() == every_clippable.read_bytes()


def test_a_big_endian_file_is_written_big_endian(clipcli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    values = {"f32": rng.standard_normal((4, 32)).astype(np.float32)}
    src = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(src), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_custom_alignment(64)
    writer.add_tensor("f32", values["f32"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    copy = tmp_path / "c.gguf"
    assert clipcli("convert", src, copy).returncode == 0
    assert copy.read_bytes() == src.read_bytes()
    out = tmp_path / "o.gguf"
    run = clipcli("clip", src, out, "--norm", "1")
    assert run.returncode == 0, run.stderr
    reader = gguf.GGUFReader(str(out))
    assert reader.endianess == gguf.GGUFEndian.BIG
    assert reader.alignment == 64
    got = np.asarray(reader.tensors[0].data).astype(np.float64)
    assert exact_sumsq(got) <= 1
    assert fields_of(out) == fields_of(src)


def test_convert_from_safetensors_is_read_back_by_gguf(clipcli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    tensors: dict[str, np.ndarray] = {
        "w": rng.standard_normal((3, 5, 2, 4)).astype(np.float32),
        "h": rng.standard_normal(7).astype(np.float16),
        "i": np.arange(6, dtype=np.int32).reshape(2, 3),
        "n" * 63: np.ones(2, np.float64),
    }
    src = tmp_path / "m.safetensors"
    save_file(tensors, str(src), metadata={"general.name": "tiny", "format": "pt"})
    out = tmp_path / "m.gguf"
    run = clipcli("convert", src, out)
    assert run.returncode == 0, run.stderr
    reader = gguf.GGUFReader(str(out))
    got = {t.name: np.asarray(t.data).reshape(tuple(reversed(t.shape))) for t in reader.tensors}
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array)
    name_field = reader.fields["general.name"]
    assert bytes(name_field.parts[name_field.data[0]]).decode() == "tiny"
    run = clipcli("diff", src, out, "--format", "json")
    assert run.returncode == 0, run.stderr
    assert all(t["status"] == "same" for t in json.loads(run.stdout)["tensors"])


@pytest.mark.parametrize(
    ("tensors", "metadata", "words"),
    [
        ({"n" * 64: np.ones(2, np.float32)}, None, "at most 63 bytes"),
        ({"u": np.ones(2, np.uint8)}, None, "GGUF has no uint8 type"),
        ({"b": np.ones(2, np.bool_)}, None, "not bool"),
        ({"r": np.ones((1, 1, 1, 1, 2), np.float32)}, None, "holds at most 4"),
        ({"w": np.ones(2, np.float32)}, {"general.alignment": "64"}, "GGUF's own"),
    ],
)
def test_what_gguf_cannot_hold_is_refused_before_writing(
    clipcli: Any,
    tmp_path: Path,
    tensors: dict[str, np.ndarray],
    metadata: dict[str, str] | None,
    words: str,
) -> None:
    src = tmp_path / "m.safetensors"
    save_file(tensors, str(src), metadata=metadata)
    out = tmp_path / "m.gguf"
    run = clipcli("convert", src, out)
    assert run.returncode == 2, run.stderr
    assert words in one_line(run)
    assert not out.exists()


def test_rank_four_is_written(clipcli: Any, tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"r": np.ones((1, 2, 1, 3), np.float32)}, str(src))
    out = tmp_path / "m.gguf"
    assert clipcli("convert", src, out).returncode == 0
    assert [int(d) for d in gguf.GGUFReader(str(out)).tensors[0].shape] == [3, 1, 2, 1]
