"""convert --dtype (issues 21, 22): a GGUF block tensor already decoded to the target dtype
is still dequantized (it was exit 70), and the note about config.json is said only where
a config.json is written (a one-file OUT leaves it out, and says that instead).

References: the gguf package's own writer and dequantizer, safetensors' own reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Run
from handmade import RawTensors, write_raw_safetensors

gguf = pytest.importorskip("gguf")


def q4_0_file(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(7)
    values = rng.standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.w", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gguf_blocks_convert_to_every_dtype(
    run_main: Callable[..., Run], tmp_path: Path, dtype: str
) -> None:
    from safetensors.numpy import load_file

    source = q4_0_file(tmp_path / "q.gguf")
    out = tmp_path / "o.safetensors"
    run = run_main("convert", "--dtype", dtype, source, out)
    assert run.code == 0, run.stderr
    tensor = gguf.GGUFReader(str(source)).tensors[0]
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64)
    import ml_dtypes  # the reference rounding to the narrow dtypes

    target = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    written = load_file(str(out))["blk.0.w"]
    assert written.dtype == np.dtype(target)
    assert np.array_equal(written, expected.astype(target).reshape(written.shape))


def quantized_directory(tmp_path: Path) -> Path:
    """A block-FP8 model directory (codes 1.0 everywhere, one float32 scale of 0.5)."""
    import struct

    directory = tmp_path / "model"
    directory.mkdir()
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}}
    (directory / "config.json").write_text(json.dumps(config))
    tensors: RawTensors = {"l.weight": ("F8_E4M3", [2, 2], bytes([0x38] * 4))}
    tensors["l.weight_scale_inv"] = ("F32", [1, 1], struct.pack("<f", 0.5))
    write_raw_safetensors(directory / "model.safetensors", tensors)
    return directory


def test_one_file_out_does_not_claim_a_config_it_left_out(
    run_main: Callable[..., Run], tmp_path: Path
) -> None:
    run = run_main(
        "convert", "--dtype", "float32", quantized_directory(tmp_path), tmp_path / "o.safetensors"
    )
    assert run.code == 0, run.stderr
    assert "left out the model directory's other files (config.json)" in run.stderr
    assert "quantization_config" not in run.stderr


def test_a_directory_out_says_its_config_lost_the_quantization(
    run_main: Callable[..., Run], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run = run_main("convert", "--dtype", "float32", quantized_directory(tmp_path), out)
    assert run.code == 0, run.stderr
    assert "config.json written without its quantization_config" in run.stderr
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
