"""Block-scaled FP8 through the quantized view: exact norms of the dequantized values.

Fixtures are encoded from the format's definition (tests/quant_reference.py: fp8 values
from their bit fields, float32 scales from theirs); the reference statistics are Fraction
sums; clipcli's are its own NormAccumulator over the view's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import (
    Stats,
    bf16_payload,
    bfloat16_value,
    close,
    e4m3fn_value,
    e5m2_value,
    f32_payload,
    float32_value,
    random_float32_bits,
    write_model_directory,
    write_raw_safetensors,
)

from clipcli.errors import ClipcliError, InputError
from clipcli.formats.opening import open_reader
from clipcli.logical.quantized import fp8_block, rules
from clipcli.logical.quantized.view import QuantizedView
from clipcli.numerics.norms import NormAccumulator


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_fp8(
    rng: np.random.Generator,
    rows: int,
    columns: int,
    block: tuple[int, int],
    *,
    codes: Sequence[int] | None = None,
    code_dtype: str = "F8_E4M3",
    scale_dtype: str = "F32",
) -> tuple[dict[str, tuple[str, list[int], bytes]], list[Fraction | None]]:
    """One weight's stored tensors and its exact real values, row-major."""
    count = rows * columns
    if codes is None:
        codes = [int(c) for c in rng.integers(0, 256, count)]
        codes[: min(256, count)] = range(min(256, count))  # every code where room allows
    scale_shape = [ceil_div(rows, block[0]), ceil_div(columns, block[1])]
    scale_count = scale_shape[0] * scale_shape[1]
    if scale_dtype == "F32":
        scale_bits = random_float32_bits(rng, scale_count)
        scale_values = [float32_value(b) for b in scale_bits]
        scale_payload = f32_payload(scale_bits)
    else:
        scale_bits = [b >> 16 for b in random_float32_bits(rng, scale_count)]
        scale_values = [bfloat16_value(b) for b in scale_bits]
        scale_payload = bf16_payload(scale_bits)
    decode = e4m3fn_value if code_dtype == "F8_E4M3" else e5m2_value
    values: list[Fraction | None] = []
    for i in range(rows):
        for j in range(columns):
            code = decode(codes[i * columns + j])
            scale = scale_values[(i // block[0]) * scale_shape[1] + j // block[1]]
            values.append(None if code is None or scale is None else code * scale)
    stored = {
        "layer.weight": (code_dtype, [rows, columns], bytes(codes)),
        "layer.weight_scale_inv": (scale_dtype, scale_shape, scale_payload),
    }
    return stored, values


def measured(path: Path, chunk_elems: int | None = None) -> dict[str, NormAccumulator]:
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        found = {}
        for tensor in view.tensors():
            acc = NormAccumulator()
            for chunk in view.chunks(reader, tensor, chunk_elems):
                acc.add(chunk)
            acc.finish()
            found[tensor.info.name] = acc
        return found


def assert_exact(acc: NormAccumulator, values: Sequence[Fraction | None]) -> None:
    ref = Stats(values)
    assert acc.numel == ref.count
    assert acc.nonfinite == ref.nonfinite
    assert Fraction(acc.max_abs) == ref.max_abs
    finite = NormAccumulator()
    finite.sumsq, finite.max_abs = acc.sumsq, acc.max_abs
    assert close(finite.finite_norm, ref.norm), (finite.finite_norm, ref.norm)


def fp8_config(block: Sequence[Any] | None) -> dict[str, Any]:
    quant: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    return {"architectures": ["X"], "quantization_config": quant}


# ------------------------------------------------------------------ exact norms


@pytest.mark.parametrize(("rows", "columns"), [(130, 260), (128, 128), (1, 300), (257, 1)])
def test_single_file_default_block_every_code_edge_blocks(
    tmp_path: Path, rows: int, columns: int
) -> None:
    """DeepSeek's 128 x 128 blocks, partial edge blocks, all 256 codes (0x7F and 0xFF are
    NaN: counted non-finite, never in the sum). Issue 21: a file alone is read only where
    its shapes leave one block size (here [128, 128]: one scale); the others, whose scale
    shapes other block sizes fit too, are refused alone and read beside their config.json."""
    stored, values = block_fp8(np.random.default_rng(rows), rows, columns, (128, 128))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    if (rows, columns) != (128, 128):
        assert "block size cannot be told" in refused(path)
        path = write_model_directory(
            tmp_path / "m", {"model.safetensors": stored}, fp8_config([128, 128])
        )
    stats = measured(path)
    assert list(stats) == ["layer.weight"]  # the scale is a part, not a tensor of its own
    assert_exact(stats["layer.weight"], values)
    if rows * columns >= 256:
        assert stats["layer.weight"].nonfinite >= 2


@pytest.mark.parametrize("chunk_elems", [1, 7, 11, 64, None])
def test_declared_blocks_not_dividing_the_shape_stream_by_rows(
    tmp_path: Path, chunk_elems: int | None
) -> None:
    """config.json's weight_block_size [3, 5] over [20, 23]: every chunk size (a row at
    a time, a part of a block, many rows) gives the same exact statistics."""
    stored, values = block_fp8(np.random.default_rng(5), 20, 23, (3, 5))
    directory = write_model_directory(
        tmp_path / "model", {"model.safetensors": stored}, fp8_config([3, 5])
    )
    assert_exact(measured(directory, chunk_elems)["layer.weight"], values)


def test_scale_in_another_shard(tmp_path: Path) -> None:
    stored, values = block_fp8(np.random.default_rng(1), 40, 70, (16, 32))
    plain = ("F32", [3], f32_payload([0x3F800000, 0x40000000, 0xC0400000]))
    shards = {
        "model-00001-of-00002.safetensors": {
            "layer.weight": stored["layer.weight"],
            "norm.weight": plain,
        },
        "model-00002-of-00002.safetensors": {
            "layer.weight_scale_inv": stored["layer.weight_scale_inv"]
        },
    }
    directory = write_model_directory(tmp_path / "model", shards, fp8_config([16, 32]))
    stats = measured(directory)
    assert list(stats) == ["layer.weight", "norm.weight"]
    assert_exact(stats["layer.weight"], values)
    assert stats["norm.weight"].finite_norm == 14**0.5
    with open_reader(directory) as reader:
        view = QuantizedView.of(reader)
        assert [(i.name, role) for i, role in view.side_tensors()] == [
            ("layer.weight_scale_inv", "scale")
        ]
        weight = view.tensors()[0]
        assert weight.scheme == "fp8-block"
        assert weight.info.shape == (40, 70)
        assert view.scaled_parts(weight) == ["layer.weight_scale_inv"]


def test_e5m2_codes_and_bfloat16_scales(tmp_path: Path) -> None:
    stored, values = block_fp8(
        np.random.default_rng(2), 129, 131, (128, 128), code_dtype="F8_E5M2", scale_dtype="BF16"
    )
    # issue 21: [2, 2] scales fit other blocks than 128 x 128 too: the config says which
    path = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([128, 128])
    )
    assert_exact(measured(path)["layer.weight"], values)


def test_one_scale_for_the_whole_tensor(tmp_path: Path) -> None:
    """quant_method fp8 without weight_block_size: one scale (shape [1] or [])."""
    rng = np.random.default_rng(3)
    codes = [int(c) for c in rng.integers(0, 256, 6 * 9)]
    scale = float32_value(0x3C23D70A)
    assert scale is not None
    stored = {
        "layer.weight": ("F8_E4M3", [6, 9], bytes(codes)),
        "layer.weight_scale_inv": ("F32", [], f32_payload([0x3C23D70A])),
    }
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config(None)
    )
    values = [None if (v := e4m3fn_value(c)) is None else v * scale for c in codes]
    assert_exact(measured(directory)["layer.weight"], values)


# ------------------------------------------------------------------ refusals (exit 3)


def refused(path: Path) -> str:
    with pytest.raises(ClipcliError) as caught, open_reader(path) as reader:
        QuantizedView.of(reader)
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("scale_rows", [1, 3])  # ceil(40 / 16) = 3: 2 is the fit
def test_scale_shape_that_does_not_fit_is_refused(tmp_path: Path, scale_rows: int) -> None:
    stored, _ = block_fp8(np.random.default_rng(4), 40, 64, (16, 32))
    scale_payload = f32_payload([0x3F800000] * (scale_rows * 2))
    stored["layer.weight_scale_inv"] = ("F32", [scale_rows, 2], scale_payload)
    if scale_rows == 3:  # exactly ceil(40/16): fits
        directory = write_model_directory(
            tmp_path / "ok", {"model.safetensors": stored}, fp8_config([16, 32])
        )
        assert measured(directory)["layer.weight"].numel == 40 * 64
        stored["layer.weight_scale_inv"] = ("F32", [4, 2], f32_payload([0x3F800000] * 8))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([16, 32])
    )
    assert "does not fit layer.weight" in refused(directory)


@pytest.mark.parametrize(
    "block", [[0, 128], [-1, 128], [True, 128], [128], [128, 1.5], "128", [rules.MAX_BLOCK + 1, 1]]
)
def test_block_sizes_from_config_are_checked_before_use(tmp_path: Path, block: Any) -> None:
    stored, _ = block_fp8(np.random.default_rng(6), 4, 4, (4, 4))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config(block)
    )
    assert "weight_block_size" in refused(directory)


def test_the_largest_block_size_is_accepted(tmp_path: Path) -> None:
    stored, values = block_fp8(np.random.default_rng(6), 4, 4, (4, 4))
    stored["layer.weight_scale_inv"] = ("F32", [1, 1], f32_payload([0x3F800000]))
    config = fp8_config([rules.MAX_BLOCK, rules.MAX_BLOCK])
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, config)
    codes = stored["layer.weight"][2]
    assert_exact(measured(directory)["layer.weight"], [e4m3fn_value(c) for c in codes])


def test_declared_fp8_codes_without_their_scale_are_refused(tmp_path: Path) -> None:
    """A dropped weight_scale_inv makes weights ~200x too large: never measured as codes."""
    stored, _ = block_fp8(np.random.default_rng(7), 4, 4, (4, 4))
    del stored["layer.weight_scale_inv"]
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, fp8_config([4, 4])
    )
    assert "without their layer.weight_scale_inv" in refused(directory)


def test_block_size_that_names_cannot_tell_is_refused(tmp_path: Path) -> None:
    stored, _ = block_fp8(np.random.default_rng(8), 64, 64, (32, 32))  # scale [2, 2]
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)
    assert "block size cannot be told" in refused(path)


def test_malformed_quantization_config_is_refused(tmp_path: Path) -> None:
    stored, _ = block_fp8(np.random.default_rng(9), 4, 4, (4, 4))
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, {"quantization_config": [1]}
    )
    assert "quantization_config is not an object" in refused(directory)
    (directory / "config.json").write_text("{not json")
    assert "config.json: is not readable JSON" in refused(directory)


def test_a_stored_tensor_claimed_twice_is_refused(tmp_path: Path) -> None:
    """Two schemes claiming one stored tensor: ambiguous, never a guess."""
    stored, _ = block_fp8(np.random.default_rng(10), 4, 4, (4, 4))
    path = write_raw_safetensors(tmp_path / "m.safetensors", stored)

    class Twin:
        NAMES: Sequence[str] = ("twin",)
        recognise = staticmethod(fp8_block.recognise)
        code_rows = staticmethod(fp8_block.code_rows)
        decode_rows = staticmethod(fp8_block.decode_rows)
        scaled_parts = staticmethod(fp8_block.scaled_parts)

    with open_reader(path) as reader, pytest.raises(InputError, match="ambiguous") as caught:
        QuantizedView(reader.infos, None, (fp8_block, Twin()))
    assert "claimed by both" in str(caught.value)


def test_plain_checkpoint_is_the_identity(tmp_path: Path) -> None:
    path = write_raw_safetensors(
        tmp_path / "m.safetensors",
        {"a.weight": ("F32", [2], f32_payload([0x3F800000, 0x40000000])), "b": ("U8", [1], b"\7")},
    )
    with open_reader(path) as reader:
        view = QuantizedView.of(reader)
        assert view.identity
        assert view.side_tensors() == []
        assert [t.info for t in view.tensors()] == reader.infos
        assert all(view.lowerable(t) is None for t in view.tensors())


@pytest.mark.parametrize("room", [0, -1])
def test_small_parts_budget_at_and_past_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """A weight's scales are read whole: at most SMALL_PARTS_LIMIT bytes of them."""
    from clipcli.logical.quantized import view as view_module

    stored, values = block_fp8(np.random.default_rng(11), 20, 23, (3, 5))
    directory = write_model_directory(
        tmp_path / "model", {"model.safetensors": stored}, fp8_config([3, 5])
    )
    scale_bytes = len(stored["layer.weight_scale_inv"][2])
    monkeypatch.setattr(view_module, "SMALL_PARTS_LIMIT", scale_bytes + room)
    if room == 0:
        assert_exact(measured(directory)["layer.weight"], values)
    else:
        with pytest.raises(InputError, match="the limit is") as caught:
            measured(directory)
        assert caught.value.exit_code == 3
