"""convert where it would write real values (--dtype; a GGUF file into another format) of
a quantized weight stored in a layout clipcli recognises but does not decode: exit 4, one
line naming the tensor, nothing written, as clip refuses it.

It used to exit 0 and write compressed-tensors' int8 codes as the weight, their scale as
a plain tensor, config.json without its quantization_config, and say "weights
dequantized" (the attack's r4); a GGUF Q8_K tensor (which gguf cannot dequantize) went
into safetensors as its raw block bytes, shape and meaning lost. A plain convert into the
same format still copies every stored tensor and config.json as they are (lossless)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from quant_reference import (
    f32_payload,
    float32_bits,
    read_raw_safetensors,
    write_model_directory,
    write_raw_safetensors,
)

REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "quant_reference"
CASES: dict[str, Any] = json.loads((REFERENCE_DIR / "reference.json").read_text())["cases"]
UNDECODED = sorted(name for name, case in CASES.items() if not case["decoded_by_clipcli"])
DECODED = sorted(name for name, case in CASES.items() if case["decoded_by_clipcli"])
X = "model.layers.0.mlp.down_proj"
INT_QUANTIZED = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        }
    },
}


def int_quantized(prefix: str = X + ".") -> dict[str, tuple[str, list[int], bytes]]:
    rng = np.random.default_rng(17)
    codes = rng.integers(-128, 127, (8, 8)).astype(np.int8)
    return {
        prefix + "weight": ("I8", [8, 8], codes.tobytes()),
        prefix + "weight_scale": ("F16", [8, 1], np.full((8, 1), 0.01, np.float16).tobytes()),
        "model.norm.weight": ("F32", [8], np.ones(8, np.float32).tobytes()),
    }


def refused(run: Any, out: Path, *named: str) -> None:
    assert run.code == 4, (run.stdout, run.stderr)
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("clipcli: error: ")
    for name in named:
        assert name in run.stderr
    assert "nothing written" in run.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(out.name)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_dtype_of_int_quantized_codes_is_refused(
    dtype: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    directory = write_model_directory(
        tmp_path / "m",
        {"model.safetensors": int_quantized()},
        {"quantization_config": INT_QUANTIZED},
    )
    out = tmp_path / "out"
    run = run_main("convert", "--dtype", dtype, directory, out)
    refused(run, out, f"{X}.weight", "int8 codes with scales", f"--dtype {dtype}")
    assert "dequantized" not in run.stderr


def test_plain_convert_of_int_quantized_codes_is_lossless(
    run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """Without --dtype: every stored tensor and config.json byte for byte (the view has no
    say in a plain convert into the same format)."""
    stored = int_quantized()
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, {"quantization_config": INT_QUANTIZED}
    )
    out = tmp_path / "out"
    run = run_main("convert", directory, out)
    assert run.code == 0, run.stderr
    assert read_raw_safetensors(out / "model.safetensors") == stored
    assert (out / "config.json").read_bytes() == (directory / "config.json").read_bytes()
    assert "dequantized" not in run.stderr


@pytest.mark.parametrize("prefix", [X + ".", ""])
def test_a_single_file_of_int8_codes_is_refused_too(
    prefix: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """No config.json to drop: still codes cast as if they were a weight. The root
    module's bare `weight` + `weight_scale` (+ `input_scale`) too."""
    stored = int_quantized(prefix)
    stored[prefix + "input_scale"] = ("F32", [1], f32_payload(float32_bits([0.5])))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    out = tmp_path / "out.safetensors"
    refused(run_main("convert", "--dtype", "float16", path, out), out, f"'{prefix}weight'")


@pytest.mark.parametrize("case", UNDECODED)
def test_the_pinned_undecoded_layouts_are_refused(
    case: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run = run_main("convert", "--dtype", "bfloat16", REFERENCE_DIR / case, out)
    refused(run, out, "int8 codes with scales")


@pytest.mark.parametrize("case", DECODED)
def test_decoded_layouts_still_convert(
    case: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """The refusal does not reach what clipcli decodes: their config is dropped, the note
    says so, and no scale is written."""
    out = tmp_path / "out"
    run = run_main("convert", "--dtype", "float32", REFERENCE_DIR / case, out)
    assert run.code == 0, run.stderr
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert "weights dequantized" in run.stderr


def test_a_decoded_set_beside_an_undecoded_one_is_refused(
    run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """A view that decodes one weight (block fp8) does not let the other (int8 codes with
    a scale) through as plain tensors."""
    stored = int_quantized()
    stored["fp.weight"] = ("F8_E4M3", [2, 2], bytes([0x38, 0x40, 0xB8, 0x00]))
    stored["fp.weight_scale_inv"] = ("F32", [1, 1], f32_payload(float32_bits([0.5])))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    out = tmp_path / "out.safetensors"
    refused(run_main("convert", "--dtype", "float32", path, out), out, f"'{X}.weight'")


def test_a_config_declaring_what_no_tensor_is_is_refused(
    run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """quantization_config in a layout nothing recognises: dropping it and calling the
    stored tensors dequantized weights would be a guess (clip refuses it alike)."""
    stored = {"w": ("F32", [2], np.ones(2, np.float32).tobytes())}
    directory = write_model_directory(
        tmp_path / "m",
        {"model.safetensors": stored},
        {"quantization_config": {"quant_method": "hqq"}},
    )
    out = tmp_path / "out"
    refused(run_main("convert", "--dtype", "float16", directory, out), out, "config.json", "hqq")
    run = run_main("convert", directory, out)
    assert run.code == 0, run.stderr
    assert (out / "config.json").read_bytes() == (directory / "config.json").read_bytes()


# ---------------------------------------------------------------- GGUF


def q8_k_file(path: Path) -> Path:
    """A GGUF file with a Q8_K tensor: a block type gguf.quants cannot dequantize."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("plain", np.ones((2, 32), np.float32))
    q8_k = rng.integers(0, 256, (2, 292), dtype=np.uint8)
    q8_k[:, :4] = 0  # its float32 d: 0, no NaN
    writer.add_tensor("k", q8_k, raw_shape=q8_k.shape, raw_dtype=GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_gguf_blocks_gguf_cannot_dequantize_are_not_written_into_safetensors(
    dtype: str | None, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    source = q8_k_file(tmp_path / "k.gguf")
    out = tmp_path / "out.safetensors"
    args = ["convert", source, out] + ([] if dtype is None else ["--dtype", dtype])
    refused(run_main(*args), out, "'k'", "GGUF Q8_K")


def test_gguf_blocks_gguf_cannot_dequantize_copy_into_gguf(
    run_main: Callable[..., Any], tmp_path: Path
) -> None:
    source = q8_k_file(tmp_path / "k.gguf")
    out = tmp_path / "out.gguf"
    run = run_main("convert", source, out)
    assert run.code == 0, run.stderr
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    for a, b in zip(before.tensors, after.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
