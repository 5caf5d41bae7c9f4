"""GGUF files (issue 22): fixtures written with the `gguf` package's own GGUFWriter, one
tensor per type its `quantize` supports plus F32/F16/F64/I8..I64; norms checked against
`gguf.quants.dequantize` in float64, and Q8_0 against a decoder written here from the
block definition (fp16 d + 32 int8) with an exact Fraction sum."""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import MainRun
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_startup import _loaded, _modules_after

from clipcli.formats.gguf import GgufReader
from clipcli.formats.gguf.header import GGML_TYPES, PLAIN_TYPES

QUANTIZED = ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
PLAIN = {
    "f32": np.float32,
    "f16": np.float16,
    "f64": np.float64,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
}
TOKENS = [f"tok{i}" for i in range(1000)]


def write_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, str | None]], **writer: Any
) -> Path:
    """`tensors`: name -> (array, ggml type to quantize to, or None: stored as it is)."""
    out = gguf.GGUFWriter(str(path), "llama", **writer)
    out.add_context_length(4096)
    out.add_token_list(TOKENS)
    for name, (array, kind) in tensors.items():
        if kind is None:
            out.add_tensor(name, array)
        else:
            qtype = GGMLQuantizationType[kind]
            data = quantize(array.astype(np.float32), qtype)
            out.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


def every_type(path: Path, rows: int = 3, columns: int = 512) -> Path:
    rng = np.random.default_rng(22)
    tensors: dict[str, tuple[np.ndarray, str | None]] = {
        name: ((rng.standard_normal((rows, 64)) * 50).astype(dtype), None)
        for name, dtype in PLAIN.items()
    }
    for kind in QUANTIZED:
        tensors[kind.lower()] = (rng.standard_normal((rows, columns)), kind)
    return write_gguf(path, tensors)


def official(path: Path) -> dict[str, np.ndarray]:
    """Every tensor's values as gguf's own reader and dequantize give them, float64, numpy
    order (the fixture is our own file: GGUFReader's trust in it is fine here)."""
    reader = gguf.GGUFReader(str(path))
    values = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = np.asarray(tensor.data)
        if tensor.tensor_type.name not in ("F64", "I8", "I16", "I32", "I64"):  # typed already
            data = dequantize(data, tensor.tensor_type)
        values[tensor.name] = np.asarray(data, np.float64).reshape(shape)
    return values


def norms_json(clipcli: Any, path: Path, *more: str) -> dict[str, Any]:
    run: MainRun = clipcli("norms", path, "--format", "json", *more)
    assert run.returncode == 0, run.stderr
    return dict(json.loads(run.stdout))


@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return every_type(tmp_path_factory.mktemp("gguf") / "m.gguf")


def test_type_table_agrees_with_gguf_constants() -> None:
    for code, (name, block, size) in GGML_TYPES.items():
        qtype = GGMLQuantizationType(code)
        assert qtype.name == name
        assert GGML_QUANT_SIZES[qtype] == (block, size)
    for name in PLAIN_TYPES:
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] == 1


def test_norms_equal_gguf_dequantize_in_float64(clipcli: Any, fixture_file: Path) -> None:
    expected = official(fixture_file)
    report = norms_json(clipcli, fixture_file)
    got = {t["name"]: t for t in report["tensors"]}
    assert set(got) == set(expected)
    total = []
    for name, values in expected.items():
        exact = math.sqrt(math.fsum((values.ravel() ** 2).tolist()))
        assert got[name]["norm"] == pytest.approx(exact, rel=1e-15, abs=0), name
        assert got[name]["shape"] == list(values.shape), name
        # Integers are no parameters: not in the global norm; every float is.
        assert got[name]["in_global"] == (name not in ("i8", "i16", "i32", "i64")), name
        if got[name]["in_global"]:
            total.extend((values.ravel() ** 2).tolist())
    assert report["global_norm"] == pytest.approx(math.sqrt(math.fsum(total)), rel=1e-15)


def q8_0_norm_exact(raw: bytes) -> Fraction:
    """Q8_0 from its definition: blocks of 34 bytes, a little-endian fp16 scale d then 32
    int8 codes; value = d * code. The exact sum of squares."""
    assert len(raw) % 34 == 0
    total = Fraction(0)
    for start in range(0, len(raw), 34):
        (d,) = struct.unpack("<e", raw[start : start + 2])
        codes = struct.unpack("<32b", raw[start + 2 : start + 34])
        total += Fraction(d) ** 2 * sum(c * c for c in codes)
    return total


def test_q8_0_norm_against_an_independent_decoder(clipcli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    path = write_gguf(tmp_path / "q8.gguf", {"w": (rng.standard_normal((5, 96)) * 3, "Q8_0")})
    header = GgufReader(path)
    try:
        entry = header.entry("w")
        begin = header.header.data_start + entry.offset
        raw = path.read_bytes()[begin : begin + entry.nbytes]
    finally:
        header.close()
    exact = q8_0_norm_exact(raw)
    got = norms_json(clipcli, path)["tensors"][0]["norm"]
    # The correctly rounded square root of the exact sum, within one rounding.
    assert got == pytest.approx(math.sqrt(exact), rel=2**-52)
    assert Fraction(got) ** 2 == pytest.approx(exact, rel=2**-50)


def test_ls_shows_ggml_types_numpy_shapes_bytes_and_metadata(
    clipcli: Any, fixture_file: Path
) -> None:
    run = clipcli("ls", fixture_file, "--format", "json")
    assert run.returncode == 0, run.stderr
    listed = json.loads(run.stdout)
    rows = {t["name"]: t for t in listed["tensors"]}
    assert rows["q4_0"]["dtype"] == "Q4_0"
    assert rows["q4_0"]["shape"] == [3, 512]
    assert rows["q4_0"]["bytes"] == 3 * 512 // 32 * 18
    assert rows["f16"]["dtype"] == "float16"
    assert rows["f16"]["bytes"] == 3 * 64 * 2
    assert listed["non_float_elements"] == 4 * 3 * 64  # the integer tensors only
    metadata = listed["metadata"]
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.context_length"] == "4096"
    tokens = metadata["tokenizer.ggml.tokens"]
    assert tokens.startswith("[1,000 x string: 'tok0', 'tok1'")
    assert len(tokens) < 300  # summarised, not 1,000 tokens


def test_a_change_past_the_shown_items_is_a_metadata_difference(
    clipcli: Any, tmp_path: Path
) -> None:
    a = write_gguf(tmp_path / "a.gguf", {"w": (np.ones((1, 32)), "Q8_0")})
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes().replace(b"tok999", b"tok998"))
    run = clipcli("diff", a, b)
    assert run.returncode == 0, run.stderr
    assert "metadata tokenizer.ggml.tokens" in run.stdout


def test_convert_to_safetensors_dequantizes_and_keeps_metadata(
    clipcli: Any, fixture_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "m.safetensors"
    run = clipcli("convert", fixture_file, out)
    assert run.returncode == 0, run.stderr
    expected = official(fixture_file)
    from safetensors import safe_open

    with safe_open(out, "numpy") as handle:
        metadata = handle.metadata()
        names = set(handle.keys())
    assert names == set(expected)
    values = _safetensors_values(out)
    for name in QUANTIZED[1:]:  # the block types: float32, bit for bit what gguf gives
        got = values[name.lower()]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.astype(np.float64), expected[name.lower()])
    assert metadata["general.architecture"] == "llama"
    assert json.loads(metadata["tokenizer.ggml.tokens"]) == TOKENS
    run = clipcli("diff", fixture_file, out, "--format", "json")
    assert run.returncode == 0, run.stderr
    compared = json.loads(run.stdout)["tensors"]
    assert len(compared) == len(expected)
    assert all(t["status"] == "same" for t in compared)


def _safetensors_values(path: Path) -> dict[str, np.ndarray]:
    """The F32/F16/int tensors of a safetensors file, by safetensors' numpy loader
    (bfloat16 left out: numpy has no such dtype)."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    kept = [n for n, e in header.items() if n != "__metadata__" and e["dtype"] != "BF16"]
    from safetensors import safe_open

    with safe_open(path, "numpy") as handle:
        return {name: handle.get_tensor(name) for name in kept}


@pytest.mark.parametrize("chunk_elems", [7, 32, 100, 1 << 20])
def test_dequantized_chunks_are_bounded_and_in_order(fixture_file: Path, chunk_elems: int) -> None:
    from clipcli.logical import views

    expected = official(fixture_file)
    with GgufReader(fixture_file) as stored:
        reader = views.logical(stored)  # block tensors' values: the GGUF view's
        for info in reader.infos:
            pieces = list(reader.chunks(info, chunk_elems))
            assert all(p.ndim == 1 and p.size <= chunk_elems for p in pieces), info.name
            whole = np.concatenate(pieces).astype(np.float64)
            np.testing.assert_array_equal(whole, expected[info.name].ravel())


def test_types_gguf_cannot_dequantize_are_left_out_with_a_warning(
    clipcli: Any, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    path = tmp_path / "k.gguf"
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_tensor("plain", np.ones((2, 32), np.float32))
    q8_k = rng.integers(0, 256, (2, 292), dtype=np.uint8)  # Q8_K: no dequantizer in gguf
    q8_k[:, :4] = 0  # its float32 d: 0, no NaN
    out.add_tensor("k", q8_k, raw_shape=q8_k.shape, raw_dtype=GGMLQuantizationType.Q8_K)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    run = clipcli("norms", path, "--format", "json")
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("clipcli: warning:")
    assert "Q8_K" in run.stderr
    assert "'k'" in run.stderr
    assert len(run.stderr.splitlines()) == 1
    report = json.loads(run.stdout)
    assert report["global_norm"] == pytest.approx(8.0)
    k = next(t for t in report["tensors"] if t["name"] == "k")
    assert not k["in_global"]


def test_big_endian_files_read_as_little_endian_ones(clipcli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors: dict[str, tuple[np.ndarray, str | None]] = {
        "f32": (rng.standard_normal((4, 32)).astype(np.float32), None),
        "f16": (rng.standard_normal((4, 32)).astype(np.float16), None),
        "i32": (rng.integers(-99, 99, (3, 8)).astype(np.int32), None),
    }
    little = write_gguf(tmp_path / "le.gguf", tensors)
    big = write_gguf(
        tmp_path / "be.gguf",
        tensors,  # the writer swaps the bytes itself
        endianess=gguf.GGUFEndian.BIG,
    )
    assert little.read_bytes() != big.read_bytes()
    a, b = norms_json(clipcli, little), norms_json(clipcli, big)
    assert [t["norm"] for t in a["tensors"]] == [t["norm"] for t in b["tensors"]]
    run = clipcli("diff", little, big, "--format", "json")
    assert run.returncode == 0, run.stderr
    assert all(t["status"] == "same" for t in json.loads(run.stdout)["tensors"])


def test_random_block_bytes_of_every_dequantizable_type_are_measured(
    clipcli: Any, tmp_path: Path
) -> None:
    """Any bytes are a block (grid indices, scales, NaN scales): gguf.quants must decode
    them, and a NaN or inf is counted, never a crash."""
    from clipcli.formats.gguf.blocks import can_dequantize

    rng = np.random.default_rng(5)
    path = tmp_path / "r.gguf"
    out = gguf.GGUFWriter(str(path), "llama")
    kinds = [n for n in GGML_TYPES.values() if n[1] > 1 and can_dequantize(n[0])]
    for name, block, size in kinds:
        raw = rng.integers(0, 256, (2, 4 * size), dtype=np.uint8)
        out.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[name])
        assert block > 1
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    report = norms_json(clipcli, path)
    assert {t["name"] for t in report["tensors"]} == {k[0] for k in kinds}
    assert len(kinds) >= 20


def test_ls_of_a_gguf_file_imports_neither_gguf_nor_numpy(fixture_file: Path) -> None:
    modules = _modules_after(["ls", str(fixture_file)])
    assert "clipcli.formats.gguf" in modules
    assert not _loaded(modules, "gguf")


def test_other_formats_never_import_gguf(tmp_path: Path) -> None:
    from handmade import write_safetensors

    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    for argv in (["ls", str(path)], ["norms", str(path)]):
        modules = _modules_after(argv)
        assert not _loaded(modules, "gguf"), argv
        assert not _loaded(modules, "clipcli.formats.gguf"), argv


def test_the_gguf_view_maps_every_stored_tensor_once(fixture_file: Path) -> None:
    """GGUFView (clipcli.logical.gguf): each stored tensor is one logical tensor's only
    part; block types become float32 logical tensors whose chunks are gguf's values."""
    from clipcli.logical.gguf import GGUFView, gguf_view

    expected = official(fixture_file)
    reader = GgufReader(fixture_file)
    try:
        view = gguf_view(reader)
        assert isinstance(view, GGUFView)
        tensors = view.tensors()
        assert [p.name for t in tensors for p in t.parts] == [i.name for i in reader.stored_infos]
        for tensor in tensors:
            name = tensor.info.name
            quantized = name in {k.lower() for k in QUANTIZED[1:]}
            assert tensor.plain != quantized, name
            refusal = view.lowerable(tensor)
            # Clipped through their float16 block scales; MXFP4 through its E8M0 exponents,
            # by a power of two (issue 21).
            assert refusal is None, name
            assert view.power_of_two_factors(tensor) == (name == "mxfp4"), name
            values = np.concatenate(list(view.chunks(reader, tensor, 100)))
            np.testing.assert_array_equal(values.astype(np.float64), expected[name].ravel())
    finally:
        reader.close()
