"""convert --dtype: every quantized weight the view knows written dequantized as a plain
tensor named as its weight, every real float tensor cast, rounded once to nearest even.

References share no code with clipcli: the fixtures' exact values (Fractions, from
tests/quant_reference.py's encoders) rounded to the target here with Python integers
(round_exact), checked against numpy's own float64 -> float16/float32 casts; OUT is read
back with safetensors' own parser (safetensors.deserialize)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from quant_reference import f32_payload, float32_bits, write_model_directory, write_raw_safetensors
from test_quantized_fp4 import NVFP4_CONFIG, gpt_oss_mxfp4, nvfp4, pack_low_first
from test_quantized_fp8_block import block_fp8, fp8_config
from test_quantized_fp8_scaled import INPUT_SCALE, ct_config, tiled_fp8

from clipcli import api
from clipcli.errors import DataRefusedError

# (significand bits, smallest normal exponent, largest finite value) of each target
TARGETS = {
    "bfloat16": (8, -126, Fraction(2**8 - 1, 2**7) * 2**127),
    "float16": (11, -14, Fraction(65504)),
    "float32": (24, -126, Fraction(2**24 - 1, 2**23) * 2**127),
}
NUMPY = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
NUMPY["float32"] = np.dtype(np.float32)
CODES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def round_exact(value: Fraction | None, target: str) -> float:
    """`value` rounded once to `target`, to nearest, ties to even (Python's round() of a
    Fraction); past the largest finite value's half-step: +-inf. None (NaN) stays NaN."""
    if value is None:
        return math.nan
    bits, emin, largest = TARGETS[target]
    if value == 0:
        return 0.0
    magnitude = abs(value)
    exponent = max(math.floor(math.log2(magnitude)), emin)
    while Fraction(2) ** exponent > magnitude and exponent > emin:  # log2 rounding
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    quantum = Fraction(2) ** (exponent - bits + 1)
    rounded = round(magnitude / quantum) * quantum
    if rounded > largest:
        return math.copysign(math.inf, value)
    return float(rounded if value > 0 else -rounded)


def read_back(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as safetensors' own parser gives it."""
    from safetensors import deserialize

    tensors = {}
    for name, entry in deserialize(path.read_bytes()):
        dtype = NUMPY[CODES[entry["dtype"]]] if entry["dtype"] in CODES else None
        data = bytes(entry["data"])
        if dtype is None:
            tensors[name] = np.frombuffer(data, np.uint8)
        else:
            tensors[name] = np.frombuffer(data, dtype).reshape(entry["shape"])
    return tensors


def assert_values(got: np.ndarray, values: Sequence[Fraction | None], target: str) -> None:
    expected = np.array([round_exact(v, target) for v in values], dtype=np.float64)
    if target != "bfloat16":  # numpy's own cast of the exact float64 agrees
        exact64 = np.array([math.nan if v is None else float(v) for v in values])
        with np.errstate(over="ignore"):
            numpy_cast = exact64.astype(NUMPY[target]).astype(np.float64)
        np.testing.assert_array_equal(numpy_cast, expected)
    assert got.dtype == NUMPY[target]
    wide = got.astype(np.float64).reshape(-1)
    # The encoders' None is a NaN or infinite code (e5m2 has both): non-finite either way.
    nonfinite = np.array([v is None for v in values], dtype=bool)
    assert not np.isfinite(wide[nonfinite]).any()
    np.testing.assert_array_equal(wide[~nonfinite], expected[~nonfinite])


# ------------------------------------------------------------------ every scheme

Fixture = Callable[[Path], tuple[Path, str, list[Fraction | None], list[str]]]


def _single(stored: dict[str, Any], tmp: Path) -> Path:
    return write_raw_safetensors(tmp / "m.safetensors", stored)


def fp8_block_every_code(tmp: Path) -> Any:
    stored, values = block_fp8(np.random.default_rng(1), 130, 260, (128, 128))
    config = fp8_config([128, 128])
    directory = write_model_directory(tmp / "m", {"model.safetensors": stored}, config)
    return directory, "layer.weight", values, list(stored)


def fp8_block_declared_e5m2_bf16(tmp: Path) -> Any:
    stored, values = block_fp8(
        np.random.default_rng(2), 20, 23, (3, 5), code_dtype="F8_E5M2", scale_dtype="BF16"
    )
    directory = write_model_directory(tmp / "m", {"model.safetensors": stored}, fp8_config([3, 5]))
    return directory, "layer.weight", values, list(stored)


def compressed_tensors(strategy: dict[str, Any], tile: tuple[int, int], shape: list[int]) -> Any:
    def make(tmp: Path) -> Any:
        stored, values = tiled_fp8(np.random.default_rng(3), 21, 40, tile, shape)
        stored["layer.input_scale"] = INPUT_SCALE
        directory = write_model_directory(
            tmp / "m", {"model.safetensors": stored}, ct_config(**strategy)
        )
        return directory, "layer.weight", values, list(stored)

    return make


def fbgemm(tmp: Path) -> Any:
    stored, values = tiled_fp8(np.random.default_rng(4), 9, 33, (1, 33), [9, 1])
    stored["layer.input_scale_ub"] = INPUT_SCALE
    config = {"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200}}
    directory = write_model_directory(tmp / "m", {"model.safetensors": stored}, config)
    return directory, "layer.weight", values, list(stored)


def mxfp4_gpt_oss(tmp: Path) -> Any:
    stored, _, _, values = gpt_oss_mxfp4(np.random.default_rng(5), (2, 3), 3)
    return _single(stored, tmp), "mlp.experts.down_proj", values, list(stored)


def mxfp4_compressed_tensors(tmp: Path) -> Any:
    rng = np.random.default_rng(6)
    codes = [int(c) for c in rng.integers(0, 16, 3 * 64)]
    exponents = [int(e) for e in rng.integers(110, 140, 6)]
    from quant_reference import e2m1_value, e8m0_value

    values = [
        e2m1_value(codes[i]) * e8m0_value(exponents[(i // 64) * 2 + (i % 64) // 32])  # type: ignore[operator]
        for i in range(3 * 64)
    ]
    stored = {
        "layer.weight_packed": ("U8", [3, 32], pack_low_first(codes)),
        "layer.weight_scale": ("U8", [3, 2], bytes(exponents)),
    }
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {},
        }
    }
    directory = write_model_directory(tmp / "m", {"model.safetensors": stored}, config)
    return directory, "layer.weight", values, list(stored)


def nvfp4_with_nan_scales(tmp: Path) -> Any:
    stored, _, _, exact = nvfp4(np.random.default_rng(7), 5, 48, 3.0)
    directory = write_model_directory(tmp / "m", {"model.safetensors": stored}, NVFP4_CONFIG)
    # fp4 x scale / global_scale is a division: the real value is that quotient rounded
    # once to float64 (what every reader of the scheme computes), then to the target.
    values = [None if v is None else Fraction(float(v)) for v in exact]
    return directory, "layer.weight", values, list(stored)


def _transposed_reference(reference: list[list[Fraction]]) -> list[Fraction | None]:
    """The codes hold [in, out]; the weight written is [out, in], row-major."""
    return [reference[i][j] for j in range(len(reference[0])) for i in range(len(reference))]


def gptq_act_order(tmp: Path) -> Any:
    from safetensors.numpy import save_file
    from test_quant_gptq_awq import gptq_arrays, gptq_reference

    arrays, g_idx, q, z = gptq_arrays(96, 40, 4, 3, seed=4, act_order=True)
    del arrays["m.bias"]
    save_file(arrays, str(tmp / "m.safetensors"))
    values = _transposed_reference(gptq_reference(arrays, g_idx, q, z, plus=1))
    return tmp / "m.safetensors", "m.weight", values, list(arrays)


def awq_gemm(tmp: Path) -> Any:
    from safetensors.numpy import save_file
    from test_quant_gptq_awq import awq_arrays

    arrays, reference = awq_arrays(64, 24, 16, seed=3)
    save_file(arrays, str(tmp / "m.safetensors"))
    return tmp / "m.safetensors", "m.weight", _transposed_reference(reference), list(arrays)


SCHEMES: dict[str, Fixture] = {
    "gptq-int4-act-order (stored transposed)": gptq_act_order,
    "awq-int4 (stored transposed)": awq_gemm,
    "fp8-block": fp8_block_every_code,
    "fp8-block-e5m2-bf16-scale": fp8_block_declared_e5m2_bf16,
    "ct-fp8-tensor": compressed_tensors({"strategy": "tensor"}, (21, 40), [1]),
    "ct-fp8-channel": compressed_tensors({"strategy": "channel"}, (1, 40), [21, 1]),
    "ct-fp8-group": compressed_tensors({"strategy": "group", "group_size": 16}, (1, 16), [21, 3]),
    "ct-fp8-block": compressed_tensors(
        {"strategy": "block", "block_structure": [8, 16]}, (8, 16), [3, 3]
    ),
    "fbgemm-fp8": fbgemm,
    "mxfp4-gpt-oss": mxfp4_gpt_oss,
    "mxfp4-compressed-tensors": mxfp4_compressed_tensors,
    "nvfp4": nvfp4_with_nan_scales,
}


SHAPES = {
    "gptq-int4-act-order (stored transposed)": (40, 96),
    "awq-int4 (stored transposed)": (24, 64),
}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_dequantized_to_every_target(tmp_path: Path, scheme: str, target: str) -> None:
    source, weight, values, stored_names = SCHEMES[scheme](tmp_path)
    out = tmp_path / "out.safetensors"
    api.convert(source, out, dtype=target, allow_lossy=True)  # random scales overflow f16
    tensors = read_back(out)
    assert list(tensors) == [weight]  # scales, zero points, input scales: not written
    assert weight not in stored_names or scheme.startswith(("fp8", "ct", "fbgemm"))
    assert tensors[weight].shape == SHAPES.get(scheme, tensors[weight].shape)
    assert_values(tensors[weight], values, target)


def test_rounding_is_once_to_nearest_even_from_float64(tmp_path: Path) -> None:
    """1 + 2**-8 + 2**-30 is above bfloat16's half-step: it rounds up. Through float32
    (ml_dtypes' own cast) it would round twice, to 1.0."""
    value = 1 + 2**-8 + 2**-30
    path = tmp_path / "m.safetensors"
    from safetensors.numpy import save_file

    save_file({"w": np.array([value, 1 + 2**-8, 1 + 3 * 2**-8], np.float64)}, str(path))
    out = tmp_path / "out.safetensors"
    api.convert(path, out, dtype="bf16")
    got = read_back(out)["w"].astype(np.float64)
    assert list(got) == [1 + 2**-7, 1.0, 1 + 2**-6]  # up; tie to even (down); tie to even (up)
    assert float(np.array([value]).astype(ml_dtypes.bfloat16)[0]) == 1.0  # why it matters


# ------------------------------------------------------------------ plain tensors, overflow


def plain_file(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))
    return path


F16_MAX = 65504.0
HALFWAY = 65520.0  # float16's largest + half its step: ties to even go to inf


@pytest.mark.parametrize(
    ("value", "overflows"),
    [
        (F16_MAX, False),  # the largest float16
        (float(np.nextafter(np.float32(F16_MAX), np.float32(np.inf))), False),  # rounds down
        (float(np.nextafter(np.float32(HALFWAY), np.float32(0))), False),  # the last below
        (HALFWAY, True),  # the first float32 that overflows
        (1e6, True),
    ],
)
def test_narrowing_overflow_refused_at_the_edge(
    tmp_path: Path, value: float, overflows: bool
) -> None:
    path = plain_file(tmp_path / "m.safetensors", {"w": np.array([1.0, -value], np.float32)})
    out = tmp_path / "out.safetensors"
    if overflows:
        with pytest.raises(DataRefusedError, match="'?w'?: 1 values overflow float16"):
            api.convert(path, out, dtype="float16")
        assert not out.exists()
        assert list(tmp_path.iterdir()) == [path]
        warnings: list[tuple[str, str]] = []
        api.convert(
            path, out, dtype="float16", allow_lossy=True, notify=lambda *a: warnings.append(a)
        )
        assert read_back(out)["w"].tolist() == [1.0, -math.inf]
        assert any("overflowed float16" in line for _, line in warnings)
    else:
        api.convert(path, out, dtype="float16")
        assert read_back(out)["w"].tolist() == [1.0, -F16_MAX]


def test_bfloat16_overflow_edge_from_float32(tmp_path: Path) -> None:
    halfway = Fraction(2**9 - 1, 2**8) * 2**127  # bfloat16's largest + half its step
    below = float(np.nextafter(np.float32(float(halfway)), np.float32(0)))
    path = plain_file(tmp_path / "m.safetensors", {"w": np.array([below], np.float32)})
    api.convert(path, tmp_path / "ok.safetensors", dtype="bfloat16")
    assert read_back(tmp_path / "ok.safetensors")["w"].astype(np.float64)[0] == float(
        TARGETS["bfloat16"][2]
    )
    path = plain_file(tmp_path / "m2.safetensors", {"w": np.array([float(halfway)], np.float32)})
    with pytest.raises(DataRefusedError):
        api.convert(path, tmp_path / "no.safetensors", dtype="bfloat16")


def test_non_float_tensors_and_inf_nan_pass_through(tmp_path: Path) -> None:
    ids = np.arange(5, dtype=np.int64)
    path = plain_file(
        tmp_path / "m.safetensors",
        {"ids": ids, "w": np.array([np.inf, -np.inf, np.nan, 3.0], np.float32)},
    )
    out = tmp_path / "out.safetensors"
    api.convert(path, out, dtype="float16")  # inf stays inf: not an overflow
    back = read_back(out)
    assert bytes(back["ids"]) == ids.tobytes()
    w = back["w"]
    assert w.dtype == np.float16
    assert np.isposinf(w[0])
    assert np.isneginf(w[1])
    assert np.isnan(w[2])


@pytest.mark.parametrize("name", ["int8", "float64", "fp8", ""])
def test_unknown_dtype_is_a_usage_error(tmp_path: Path, run_main: Any, name: str) -> None:
    path = plain_file(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    run = run_main("convert", "--dtype", name, path, tmp_path / "o.safetensors")
    assert run.code == 2, run.stderr
    assert run.stderr.count("\n") == 1
    assert "--dtype" in run.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_cli_overflow_is_one_line_exit_4_nothing_written(tmp_path: Path, run_main: Any) -> None:
    path = plain_file(tmp_path / "m.safetensors", {"w": np.array([1e6], np.float32)})
    run = run_main("convert", "--dtype", "float16", path, tmp_path / "o.safetensors")
    assert run.code == 4
    assert run.stderr.startswith("clipcli: error: ")
    assert run.stderr.count("\n") == 1
    assert "--allow-lossy" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_without_dtype_convert_still_copies_the_stored_tensors(tmp_path: Path) -> None:
    stored, _ = block_fp8(np.random.default_rng(9), 20, 23, (3, 5))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([3, 5])
    )
    api.convert(directory, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        directory / "model.safetensors"
    ).read_bytes()
    assert (tmp_path / "out" / "config.json").read_bytes() == (
        directory / "config.json"
    ).read_bytes()


# ------------------------------------------------------------------ model directories


def test_model_directory_config_rewritten_other_files_kept(tmp_path: Path) -> None:
    """The scale sits in the first shard, its weight in the second: the weight is written
    in its codes' shard; the index is rebuilt; config.json loses quantization_config and
    keeps every other key; other files and folders are copied as they are."""
    stored, values = block_fp8(np.random.default_rng(1), 40, 70, (16, 32))
    (gbits,) = float32_bits([3.0])
    shards = {
        "model-00001-of-00002.safetensors": {
            "layer.weight_scale_inv": stored["layer.weight_scale_inv"],
            "norm.weight": ("F32", [1], f32_payload([gbits])),
        },
        "model-00002-of-00002.safetensors": {"layer.weight": stored["layer.weight"]},
    }
    config = fp8_config([16, 32])
    config["torch_dtype"] = "bfloat16"
    config["rope"] = {"theta": 1e6, "names": ["ü", "x"]}
    directory = write_model_directory(tmp_path / "m", shards, config)
    (directory / "tokenizer.json").write_text('{"k": 1}')
    (directory / "sub").mkdir()
    (directory / "sub" / "notes.txt").write_bytes(b"\x00\x01")
    (directory / "config.json").chmod(0o640)
    out = tmp_path / "out"
    notes: list[tuple[str, str]] = []
    api.convert(directory, out, dtype="bfloat16", notify=lambda *a: notes.append(a))
    written = json.loads((out / "config.json").read_text())
    expected = dict(config)
    del expected["quantization_config"]
    assert written == expected
    assert (out / "config.json").stat().st_mode & 0o777 == 0o640
    assert (out / "tokenizer.json").read_bytes() == b'{"k": 1}'
    assert (out / "sub" / "notes.txt").read_bytes() == b"\x00\x01"
    assert (
        "note",
        "config.json written without its quantization_config (weights dequantized)",
    ) in notes
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "layer.weight": "model-00002-of-00002.safetensors",
        "norm.weight": "model-00001-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 40 * 70 * 2 + 2
    assert list(read_back(out / "model-00001-of-00002.safetensors")) == ["norm.weight"]
    assert_values(
        read_back(out / "model-00002-of-00002.safetensors")["layer.weight"], values, "bfloat16"
    )
    from clipcli.formats.sharded.reader import validate_sharded

    validate_sharded(out)  # every shard opens with safetensors.safe_open; total_size right
    # and the output is a plain checkpoint now: no view claims anything in it
    from clipcli.formats.opening import open_reader
    from clipcli.logical.views import view_for

    with open_reader(out) as reader:
        assert view_for(reader) is None


def test_gguf_goes_through_the_same_path(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from test_format_gguf import official, write_gguf

    rng = np.random.default_rng(3)
    path = write_gguf(
        tmp_path / "m.gguf",
        {
            "q": (rng.standard_normal((2, 64)), "Q8_0"),
            "f": (np.array([[1.5, 2.0]], np.float32), None),
        },
    )
    out = tmp_path / "out.safetensors"
    api.convert(path, out, dtype="float16")
    expected = official(path)
    back = read_back(out)
    assert set(back) == {"q", "f"}
    for name, values in expected.items():
        np.testing.assert_array_equal(back[name], values.astype(np.float16))


@pytest.mark.parametrize("extra", [0, 1])
def test_config_read_up_to_its_limit(tmp_path: Path, extra: int) -> None:
    """config.json of exactly 16 MiB is rewritten; one byte more is refused (exit 3)."""
    from clipcli.errors import InputError
    from clipcli.logical.cast import CONFIG_LIMIT

    directory = tmp_path / "m"
    directory.mkdir()
    # an fp8 set the config describes (a config declaring what no tensor is: exit 4,
    # tests/test_quant_convert_undecoded.py)
    stored = {
        "w.weight": ("F8_E4M3", [1, 2], bytes([0x38, 0x40])),
        "w.weight_scale_inv": ("F32", [1, 1], f32_payload(float32_bits([0.5]))),
    }
    write_raw_safetensors(directory / "model.safetensors", stored)
    text = json.dumps({"quantization_config": {"quant_method": "fp8"}, "pad": ""})
    text = text[:-1] + " " * (CONFIG_LIMIT + extra - len(text)) + "}"  # JSON whitespace
    assert len(text.encode()) == CONFIG_LIMIT + extra
    (directory / "config.json").write_text(text)
    if extra:
        with pytest.raises(InputError):
            api.convert(directory, tmp_path / "out", dtype="float16")
        assert not (tmp_path / "out").exists()
    else:
        api.convert(directory, tmp_path / "out", dtype="float16")
        assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"pad": ""}


def test_hdf5_structure_is_not_carried_through_a_cast(tmp_path: Path) -> None:
    """The structure records each dataset's dtype: carried through a cast, an HDF5 copy
    would keep float32 datasets holding float16-rounded values. It is left behind, which
    is a loss: refused (exit 2) unless --allow-lossy; then every dataset is float16."""
    import h5py

    from clipcli.errors import UsageError

    source = tmp_path / "m.h5"
    with h5py.File(source, "w") as f:
        f.attrs["backend"] = "x"
        f.create_dataset("g/w", data=np.array([1.0 + 2**-12, 3.0], np.float32))
    out = tmp_path / "out.h5"
    with pytest.raises(UsageError, match="--dtype cast"):
        api.convert(source, out, dtype="float16")
    assert not out.exists()
    api.convert(source, out, dtype="float16", allow_lossy=True)
    with h5py.File(out, "r") as f:
        data = f["g/w"][()]
    assert data.dtype == np.float16
    assert data.tolist() == [1.0, 3.0]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize(("rows", "columns", "block"), [(130, 260, (128, 128)), (20, 23, (3, 5))])
def test_block_fp8_tables_equal_decode_then_cast(
    tmp_path: Path, target: str, rows: int, columns: int, block: tuple[int, int]
) -> None:
    """The 256-entry table per block (fp8_block.cast_rows) gives bit for bit what decoding
    then casting gives, and falls back to that where a table overflows (float16 here)."""
    from clipcli.formats.opening import open_reader
    from clipcli.logical.quantized import fp8_block
    from clipcli.logical.quantized.view import QuantizedView
    from clipcli.logical.view import View

    stored, _ = block_fp8(np.random.default_rng(rows), rows, columns, block)
    config = fp8_config(list(block))
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    dtype = NUMPY[target]
    with open_reader(directory) as reader:
        view = QuantizedView.of(reader)
        (weight,) = view.tensors()
        fast = list(view.cast_chunks(reader, weight, dtype))
        slow = list(View.cast_chunks(view, reader, weight, dtype))
        small = {p.name: reader.read(reader.infos[1]) for p in weight.parts[1:]}
        codes = reader.read(reader.infos[0])
        tables = fp8_block.cast_rows(view.recognised(weight), codes, 0, rows, small, dtype)
    joined = np.concatenate([c.values for c in fast])
    assert joined.tobytes() == np.concatenate([c.values for c in slow]).tobytes()
    assert sum(c.overflowed for c in fast) == sum(c.overflowed for c in slow)
    overflows = sum(c.overflowed for c in slow) > 0
    assert (tables is None) == overflows  # the table path is taken unless it overflows
    if tables is not None:
        assert tables.tobytes() == joined.tobytes()
