# mypy: ignore-errors
# (runs only in a throwaway environment with torch and the quantization projects, which the
# project's own environment, where mypy runs, does not have)
"""Quantized checkpoints written and read back by the quantization projects' own code.

A second reference for clipcli's quantized view, sharing no code with it: every file here is
written by compressed-tensors' own compressors (scales from its own `calculate_qparams` /
`generate_gparam`, codes from its `compress`) or by bitsandbytes' own `quantize_4bit` /
`int8_vectorwise_quant`, and every expected norm and max |x| comes from the same project's
own decompression (`decompress`, `dequantize_4bit`), taken in float64.

Run it in a throwaway virtual environment that has torch, numpy, safetensors,
compressed-tensors and bitsandbytes (never the project's .venv):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch numpy safetensors compressed-tensors bitsandbytes autoawq
    /tmp/refvenv/bin/pip install auto-gptq  # a wheel; its packing layer needs no CUDA
    /tmp/refvenv/bin/python tests/data/quant_reference/make_reference.py

It rewrites the case directories beside it and reference.json (versions, norms, max |x|).
tests/test_quant_project_references.py imports it to build fresh cases when the projects
are importable, and checks the pinned files always.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
MODULES = ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj")


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # the producer: "compressed-tensors", "bitsandbytes", "autoawq", "auto-gptq"
    shapes: tuple[tuple[int, int], ...]
    options: dict[str, Any]


def weights_for(shapes: tuple[tuple[int, int], ...], seed: int) -> list[torch.Tensor]:
    """Random float32 weights with a spread of magnitudes across rows, so that per-channel
    and per-group scales differ, plus an all-zero row (a zero scale's eps path)."""
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator)
        weight *= torch.logspace(-3, 1, out_features).reshape(-1, 1)
        weight[1] = 0.0
        weights.append(weight.to(torch.float32))
    return weights


# ---------------------------------------------------------------- compressed-tensors


def ct_scheme(options: dict[str, Any]) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    if "preset" in options:
        return preset_name_to_scheme(options["preset"], ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**options["weights"]))


def ct_qparams(weight: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
    """The weight's scale (and zero point, global scale) the way compressed-tensors'
    min-max observer reduces it for each strategy, computed by its own functions."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    strategy = args.strategy
    rows, cols = weight.shape
    global_scale = None
    if strategy == QuantizationStrategy.TENSOR:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    elif strategy == QuantizationStrategy.CHANNEL:
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    elif strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        grouped = weight.unflatten(-1, (cols // args.group_size, args.group_size))
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        if strategy == QuantizationStrategy.TENSOR_GROUP:
            global_scale = generate_gparam(weight.amin(), weight.amax())
    elif strategy == QuantizationStrategy.BLOCK:
        block_rows, block_cols = args.block_structure
        padded = torch.nn.functional.pad(
            weight,
            (0, -cols % block_cols, 0, -rows % block_rows),
            value=float(weight[0, 0]),  # padding by a value of the tensor moves no min/max
        )
        blocks = padded.unflatten(0, (-1, block_rows)).unflatten(-1, (-1, block_cols))
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        raise ValueError(f"strategy {strategy} not covered")
    scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
    params = {"weight_scale": scale, "weight_zero_point": zero_point}
    if global_scale is not None:
        params["weight_global_scale"] = global_scale
    return params


def ct_compressor(scheme_format: str) -> Any:
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(scheme_format)


def ct_write(case: Case, directory: Path, seed: int) -> None:
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    scheme = ct_scheme(case.options)
    scheme.format = case.options["format"]
    tensors: dict[str, torch.Tensor] = {}
    for module, weight in zip(MODULES, weights_for(case.shapes, seed), strict=True):
        local = {"weight": weight, **ct_qparams(weight, scheme.weights)}
        compressed = ct_compressor(case.options["format"]).compress(local, scheme)
        for key, value in compressed.items():
            tensors[f"{module}.{key}"] = value.contiguous()
    tensors["model.norm.weight"] = torch.ones(8, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=case.options["format"],
        quantization_status=QuantizationStatus.COMPRESSED,
    )
    quantization_config = {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        **config.model_dump(exclude={"quant_method"}, mode="json"),
    }
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": quantization_config}, indent=2)
    )


def ct_fp4_float64(local: dict[str, torch.Tensor], scheme: Any) -> torch.Tensor:
    """NVFP4 / MXFP4 as compressed-tensors' own fp4 `decompress` does it (its
    `unpack_fp4_from_uint8`, its `_decompress_scale`, its `dequantize` with the global
    scale), but in float64: its `decompress` unpacks to bfloat16, which rounds the result."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    compressor = ct_compressor(scheme.format)
    packed = local["weight_packed"]
    rows, half = packed.shape
    unpacked = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float64)
    scale = compressor._decompress_scale(local["weight_scale"], torch.float64)
    global_scale = local.get("weight_global_scale")
    return dequantize(
        x_q=unpacked,
        scale=scale,
        args=scheme.weights,
        global_scale=None if global_scale is None else global_scale.to(torch.float64),
        dtype=torch.float64,
    )


def ct_scheme_of(directory: Path) -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    scheme.format = config["format"]
    return scheme


def ct_dequantize(directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    """Every quantized weight of the directory (or of `path`, read with the directory's
    config) decompressed by compressed-tensors' own `decompress`, in float64: float
    scales are widened to float64 first (exact), so the products are exact or rounded once."""
    from safetensors.torch import load_file

    scheme = ct_scheme_of(directory)
    stored = load_file(str(path or directory / "model.safetensors"))
    weights = {}
    for module in MODULES:
        local = {
            key[len(module) + 1 :]: value
            for key, value in stored.items()
            if key.startswith(module + ".")
        }
        for key in ("weight_scale", "weight_global_scale"):
            value = local.get(key)
            if value is not None and value.dtype in (torch.float32, torch.bfloat16, torch.float16):
                local[key] = value.to(torch.float64)
        if "weight_packed" in local and local["weight_packed"].dtype == torch.uint8:
            weights[f"{module}.weight"] = ct_fp4_float64(local, scheme).numpy()
            continue
        decompressed = ct_compressor(scheme.format).decompress(local, scheme)
        weights[f"{module}.weight"] = decompressed["weight"].to(torch.float64).numpy()
    return weights


# ---------------------------------------------------------------- bitsandbytes


def bnb_write(case: Case, directory: Path, seed: int) -> None:
    import bitsandbytes.functional as bnbf

    tensors: dict[str, torch.Tensor] = {}
    for module, weight in zip(MODULES, weights_for(case.shapes, seed), strict=True):
        if case.options["quant_type"] == "int8":
            codes, row_scale, _ = bnbf.int8_vectorwise_quant(weight.to(torch.float16))
            tensors[f"{module}.weight"] = codes.contiguous()
            tensors[f"{module}.SCB"] = row_scale.contiguous()
            continue
        packed, state = bnbf.quantize_4bit(
            weight.to(case.options["dtype"]),
            blocksize=case.options["blocksize"],
            compress_statistics=case.options["nested"],
            quant_type=case.options["quant_type"],
        )
        tensors[f"{module}.weight"] = packed.contiguous()
        for key, value in state.as_dict(packed=True).items():
            tensors[f"{module}.weight.{key}"] = value.contiguous()
    tensors["model.norm.weight"] = torch.ones(8, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    quant_type = case.options["quant_type"]
    config: dict[str, Any] = {"quant_method": "bitsandbytes"}
    if quant_type == "int8":
        config.update(load_in_8bit=True, load_in_4bit=False)
    else:
        config.update(
            load_in_4bit=True,
            load_in_8bit=False,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=case.options["nested"],
            bnb_4bit_compute_dtype=str(case.options["dtype"]).removeprefix("torch."),
        )
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config}, indent=2)
    )


def bnb_code_values(codes: torch.Tensor, state: Any) -> torch.Tensor:
    """Each element's 4-bit code value (the quant map's entry, absmax 1), decoded by
    bitsandbytes' own `dequantize_4bit` kernel over the flat element sequence. Flat, because
    bitsandbytes 0.50.2's CPU kernel mis-decodes a 2-D shape whose rows do not hold a whole
    number of blocks (16 x 96 with blocksize 64: round-trip error > 1 where it should be
    below absmax / 8), while its blocks run over the flat sequence either way."""
    numel = math.prod(state.shape)
    blocks = -(-numel // state.blocksize)
    ones = torch.ones(blocks, dtype=torch.float32)
    flat = torch.ops.bitsandbytes.dequantize_4bit.default(
        codes, ones, state.blocksize, state.quant_type, (numel,), torch.float32
    )
    return flat.reshape(-1)[:numel]


def bnb_dequantize(directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    """bitsandbytes' own decoders, in float64: `QuantState.from_dict` for the quant state,
    `dequantize_blockwise` (+ offset, in float32 as bitsandbytes does) for a nested absmax,
    `dequantize_4bit` for the code values, each times its block's absmax in float64; LLM.int8
    as codes x SCB / 127 (`int8_vectorwise_dequant`'s formula, checked against it)."""
    import bitsandbytes.functional as bnbf
    from safetensors.torch import load_file

    stored = load_file(str(path or directory / "model.safetensors"))
    weights = {}
    for module in MODULES:
        codes = stored[f"{module}.weight"]
        if f"{module}.SCB" in stored:
            row_scale = stored[f"{module}.SCB"].to(torch.float64)
            reference = bnbf.int8_vectorwise_dequant(codes, stored[f"{module}.SCB"])
            exact = codes.to(torch.float64) * row_scale.reshape(-1, 1) / 127
            assert torch.allclose(reference.to(torch.float64), exact, rtol=1e-6, atol=0)
            weights[f"{module}.weight"] = exact.numpy()
            continue
        prefix = f"{module}.weight."
        state_dict = {k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)}
        state = bnbf.QuantState.from_dict(state_dict, device=torch.device("cpu"))
        absmax = state.absmax
        if state.nested:
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        per_element = absmax.to(torch.float32).to(torch.float64).repeat_interleave(state.blocksize)
        values = bnb_code_values(codes, state).to(torch.float64)
        weights[f"{module}.weight"] = (
            (values * per_element[: values.numel()]).reshape(tuple(state.shape)).numpy()
        )
    return weights


# ---------------------------------------------------------------- AutoAWQ


def awq_write(case: Case, directory: Path, seed: int) -> None:
    """AutoAWQ's own path for a linear layer: `AwqQuantizer.pseudo_quantize_tensor` for
    the scales and zero points, then `WQLinear_GEMM.from_linear` packs the codes (GEMM
    order) and zero points, as its `_apply_quant` does."""
    from types import SimpleNamespace

    with warnings.catch_warnings():  # AutoAWQ announces its deprecation on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.quantize.quantizer import AwqQuantizer

    group_size = case.options["group_size"]
    settings = SimpleNamespace(w_bit=4, group_size=group_size, zero_point=True)
    tensors: dict[str, torch.Tensor] = {}
    for module, weight in zip(MODULES, weights_for(case.shapes, seed), strict=True):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        fake, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(settings, weight)
        linear.weight.data = fake
        packed = WQLinear_GEMM.from_linear(
            linear, 4, group_size, False, scales.t().contiguous(), zeros.t().contiguous()
        )
        for key in ("qweight", "qzeros", "scales"):
            tensors[f"{module}.{key}"] = getattr(packed, key).contiguous()
    tensors["model.norm.weight"] = torch.ones(8, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config}, indent=2)
    )


def awq_dequantize(directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    """AutoAWQ's own `dequantize_gemm` (unpack, reverse the GEMM order, (q - z) x s) with
    the float16 scales widened to float64 (exact)."""
    from safetensors.torch import load_file

    with warnings.catch_warnings():  # AutoAWQ announces its deprecation on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from awq.utils.packing_utils import dequantize_gemm

    group_size = json.loads((directory / "config.json").read_text())["quantization_config"][
        "group_size"
    ]
    stored = load_file(str(path or directory / "model.safetensors"))
    weights = {}
    for module in MODULES:
        values = dequantize_gemm(
            stored[f"{module}.qweight"],
            stored[f"{module}.qzeros"],
            stored[f"{module}.scales"].to(torch.float64),
            4,
            group_size,
        )
        weights[f"{module}.weight"] = values.t().contiguous().numpy()
    return weights


# ---------------------------------------------------------------- AutoGPTQ


def gptq_module(relative: str) -> Any:
    """One AutoGPTQ source file, loaded by path: its package __init__ imports its model
    classes, which no longer import against transformers 5; the packing layer and the
    quantizer import only torch, numpy and transformers."""
    import importlib.util

    spec = importlib.util.find_spec("auto_gptq")
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    name = "auto_gptq_" + relative.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[name]


def gptq_write(case: Case, directory: Path, seed: int) -> None:
    """AutoGPTQ's own `Quantizer` (asymmetric, per output row of each group) for scales and
    zero points, its `quantize` for the fake-quantized weight, and `QuantLinear.pack`
    (GPTQ v1: zero points stored minus one) for qweight/qzeros; act order permutes g_idx."""
    quantizer_module = gptq_module("quantization/quantizer.py")
    quant_linear = gptq_module("nn_modules/qlinear/qlinear_cuda.py").QuantLinear
    bits, group_size = case.options["bits"], case.options["group_size"]
    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed)
    for module, weight in zip(MODULES, weights_for(case.shapes, seed), strict=True):
        rows, cols = weight.shape
        order = (
            torch.randperm(cols, generator=generator)
            if case.options["act_order"]
            else torch.arange(cols)
        )
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[order] = torch.arange(cols, dtype=torch.int32) // group_size
        groups = -(-cols // group_size)
        scales = torch.empty(rows, groups)
        zeros = torch.empty(rows, groups)
        fake = torch.empty_like(weight)
        for group in range(groups):
            columns = (g_idx == group).nonzero().flatten()
            quantizer = quantizer_module.Quantizer()
            quantizer.configure(bits, perchannel=True, sym=False)
            quantizer.find_params(weight[:, columns], weight=True)
            scales[:, group] = quantizer.scale.flatten()
            zeros[:, group] = quantizer.zero.flatten()
            fake[:, columns] = quantizer_module.quantize(
                weight[:, columns], quantizer.scale, quantizer.zero, quantizer.maxq
            )
        linear = torch.nn.Linear(cols, rows, bias=False)
        linear.weight.data = fake.to(torch.float16)
        packed = quant_linear(bits, group_size, cols, rows, False)
        packed.pack(linear, scales.to(torch.float16), zeros, g_idx)
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            tensors[f"{module}.{key}"] = getattr(packed, key).contiguous()
    tensors["model.norm.weight"] = torch.ones(8, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": case.options["act_order"],
        "sym": False,
        "checkpoint_format": "gptq",
    }
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config}, indent=2)
    )


def gptq_dequantize(directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    """AutoGPTQ's own CPU dequantization, the pure-torch branch of `QuantLinear.forward`
    (scales[g_idx] * (q - (z + 1))), run on an identity input with float64 scales: its
    output is the weight's transpose, exact."""
    from safetensors.torch import load_file

    quant_linear = gptq_module("nn_modules/qlinear/qlinear_cuda.py").QuantLinear
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    stored = load_file(str(path or directory / "model.safetensors"))
    weights = {}
    for module in MODULES:
        scales = stored[f"{module}.scales"].to(torch.float64)
        cols = stored[f"{module}.g_idx"].numel()
        rows = scales.shape[1]
        layer = quant_linear(config["bits"], config["group_size"], cols, rows, False)
        layer.autogptq_cuda_available = False
        layer.qweight = stored[f"{module}.qweight"]
        layer.qzeros = stored[f"{module}.qzeros"]
        layer.g_idx = stored[f"{module}.g_idx"]
        layer.scales = scales
        with torch.no_grad():
            transposed = layer(torch.eye(cols, dtype=torch.float64))
        weights[f"{module}.weight"] = transposed.t().contiguous().numpy()
    return weights


# ---------------------------------------------------------------- transformers' FP8


def hf_fp8_write(case: Case, directory: Path, seed: int) -> None:
    """transformers' own block-FP8 quantizer (`Fp8Quantize._quantize_one`, what it runs to
    save a model quantized with `FineGrainedFP8Config`): `X.weight` e4m3 + float32 (or,
    with scale_fmt ue8m0, F8_E8M0) `X.weight_scale_inv`. It quantizes whole blocks only."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    block = case.options["block"]
    settings = SimpleNamespace(weight_block_size=block, scale_fmt=case.options["scale_fmt"])
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=settings))
    tensors: dict[str, torch.Tensor] = {}
    for module, weight in zip(MODULES, weights_for(case.shapes, seed), strict=True):
        tensors.update(quantize._quantize_one(f"{module}.weight", weight))
    tensors["model.norm.weight"] = torch.ones(8, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }
    if case.options["scale_fmt"] is not None:
        config["scale_fmt"] = case.options["scale_fmt"]
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config}, indent=2)
    )


def hf_fp8_dequantize(directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    """transformers' own `_dequantize_fp8_weight` (its FP8 backward pass: code x the scale
    of its block, partial edge blocks included) in float64, which makes it exact."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    stored = load_file(str(path or directory / "model.safetensors"))
    weights = {}
    for module in MODULES:
        scale = stored[f"{module}.weight_scale_inv"]
        if scale.dtype != torch.float32:  # E8M0: 2**(byte - 127), exact in float64
            scale = torch.exp2(scale.view(torch.uint8).to(torch.float64) - 127)
        values = _dequantize_fp8_weight(
            stored[f"{module}.weight"], scale, config["weight_block_size"], torch.float64
        )
        weights[f"{module}.weight"] = values.numpy()
    return weights


# ---------------------------------------------------------------- the cases

CT_INT = "pack-quantized"
CT_FLOAT = "float-quantized"


def int_args(
    bits: int, strategy: str, group: int | None = None, symmetric: bool = True
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": bits,
        "type": "int",
        "strategy": strategy,
        "symmetric": symmetric,
    }
    if group is not None:
        args["group_size"] = group
    return args


def fp8_args(strategy: str, **extra: Any) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, **extra}


CASES = (
    Case(
        "ct_int4_group_sym",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": CT_INT, "weights": int_args(4, "group", 32)},
    ),
    Case(
        "ct_int4_group_asym",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": CT_INT, "weights": int_args(4, "group", 32, symmetric=False)},
    ),
    Case(
        "ct_int8_channel_sym",
        "compressed-tensors",
        ((24, 40), (16, 24)),
        {"format": CT_INT, "weights": int_args(8, "channel")},
    ),
    Case(
        "ct_int4_channel_asym",
        "compressed-tensors",
        ((24, 40), (16, 24)),
        {"format": CT_INT, "weights": int_args(4, "channel", symmetric=False)},
    ),
    Case(
        "ct_int3_group_sym",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": CT_INT, "weights": int_args(3, "group", 32)},
    ),
    Case(
        "ct_int2_channel_asym",
        "compressed-tensors",
        ((24, 40), (16, 72)),
        {"format": CT_INT, "weights": int_args(2, "channel", symmetric=False)},
    ),
    Case(
        "ct_fp8_tensor",
        "compressed-tensors",
        ((24, 40), (16, 24)),
        {"format": CT_FLOAT, "weights": fp8_args("tensor")},
    ),
    Case(
        "ct_fp8_channel",
        "compressed-tensors",
        ((24, 40), (16, 24)),
        {"format": CT_FLOAT, "weights": fp8_args("channel")},
    ),
    Case(
        "ct_fp8_group",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": CT_FLOAT, "weights": fp8_args("group", group_size=32)},
    ),
    Case(
        "ct_fp8_block",
        "compressed-tensors",
        ((40, 72), (16, 48)),
        {"format": CT_FLOAT, "weights": fp8_args("block", block_structure=[16, 32])},
    ),
    Case(
        "ct_nvfp4",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": "nvfp4-pack-quantized", "preset": "NVFP4A16"},
    ),
    Case(
        "ct_mxfp4",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": "mxfp4-pack-quantized", "preset": "MXFP4A16"},
    ),
    Case(
        "bnb_nf4",
        "bitsandbytes",
        ((24, 64), (16, 96)),
        {"quant_type": "nf4", "blocksize": 64, "nested": False, "dtype": torch.float32},
    ),
    Case(
        "bnb_fp4",
        "bitsandbytes",
        ((24, 64), (16, 96)),
        {"quant_type": "fp4", "blocksize": 64, "nested": False, "dtype": torch.float32},
    ),
    Case(
        "bnb_nf4_nested",
        "bitsandbytes",
        ((48, 256), (16, 96)),
        {"quant_type": "nf4", "blocksize": 64, "nested": True, "dtype": torch.bfloat16},
    ),
    Case("bnb_int8", "bitsandbytes", ((24, 40), (16, 24)), {"quant_type": "int8"}),
    # AutoAWQ packs out_features // 32 * 4 words per row: out_features a multiple of 32
    Case("awq_gemm_int4", "autoawq", ((32, 64), (64, 96)), {"group_size": 32}),
    Case(
        "hf_fp8_block",
        "transformers",
        ((32, 64), (64, 96)),
        {"block": [16, 32], "scale_fmt": None},
    ),
    Case(
        "hf_fp8_block_ue8m0",
        "transformers",
        ((32, 64), (64, 96)),
        {"block": [16, 32], "scale_fmt": "ue8m0"},
    ),
    Case(
        "gptq_int4",
        "auto-gptq",
        ((32, 64), (64, 96)),
        {"bits": 4, "group_size": 32, "act_order": False},
    ),
    Case(
        "gptq_int4_act_order",
        "auto-gptq",
        ((32, 64), (64, 96)),
        {"bits": 4, "group_size": 32, "act_order": True},
    ),
    Case(
        "gptq_int3",
        "auto-gptq",
        ((32, 64), (64, 96)),
        {"bits": 3, "group_size": 32, "act_order": False},
    ),
    Case(
        "gptq_int8",
        "auto-gptq",
        ((32, 64), (64, 96)),
        {"bits": 8, "group_size": 32, "act_order": False},
    ),
)

# Layouts clipcli recognises but does not decode (FORMATS.md: warned for norms, refused by
# clip): compressed-tensors' naive compressor, int8 codes + scale + zero point.
UNDECODED_CASES = (
    Case(
        "ct_int8_naive_group_asym",
        "compressed-tensors",
        ((24, 64), (16, 96)),
        {"format": "int-quantized", "weights": int_args(8, "group", 32, symmetric=False)},
    ),
)

# The stored tensors (by suffix after the module name) a clip of each producer may rewrite:
# the scales; codes, zero points, maps, shapes and global scales stay byte for byte.
RESCALED = {
    "compressed-tensors": ("weight_scale",),
    "bitsandbytes": (
        "weight.absmax",
        "weight.nested_absmax",
        "weight.quant_state.bitsandbytes__nf4",  # its nested_offset is rewritten in place
        "weight.quant_state.bitsandbytes__fp4",
        "SCB",
    ),
    "autoawq": ("scales",),
    "auto-gptq": ("scales",),
    "transformers": ("weight_scale_inv",),
}


WRITERS = {
    "compressed-tensors": ct_write,
    "bitsandbytes": bnb_write,
    "autoawq": awq_write,
    "auto-gptq": gptq_write,
    "transformers": hf_fp8_write,
}
READERS = {
    "auto-gptq": gptq_dequantize,
    "transformers": hf_fp8_dequantize,
    "compressed-tensors": ct_dequantize,
    "bitsandbytes": bnb_dequantize,
    "autoawq": awq_dequantize,
}


def write_case(case: Case, directory: Path, seed: int = 0) -> None:
    WRITERS[case.kind](case, directory, seed)


def dequantize_case(case: Case, directory: Path, path: Path | None = None) -> dict[str, np.ndarray]:
    return READERS[case.kind](directory, path)


def stats(values: np.ndarray) -> dict[str, float | int]:
    """Norm (float64, rescaled so no square overflows), max |x| and non-finite count."""
    finite = values[np.isfinite(values)]
    peak = float(np.max(np.abs(finite))) if finite.size else 0.0
    norm = peak * math.sqrt(float(np.sum(np.square(finite / peak)))) if peak else 0.0
    return {"norm": norm, "max_abs": peak, "nonfinite": int(values.size - finite.size)}


def versions() -> dict[str, str]:
    import importlib.metadata

    names = (
        "compressed-tensors",
        "bitsandbytes",
        "autoawq",
        "auto-gptq",
        "transformers",
        "torch",
        "safetensors",
        "numpy",
    )
    return {name: importlib.metadata.version(name) for name in names}


def main() -> int:
    reference: dict[str, Any] = {
        "versions": versions(),
        "python": sys.version.split()[0],
        "cases": {},
    }
    for case in (*CASES, *UNDECODED_CASES):
        directory = HERE / case.name
        write_case(case, directory, zlib.crc32(case.name.encode()))  # a case added moves no other
        weights = dequantize_case(case, directory)
        stored = (directory / "model.safetensors").read_bytes()
        reference["cases"][case.name] = {
            "producer": case.kind,
            "decoded_by_clipcli": case in CASES,
            "sha256": hashlib.sha256(stored).hexdigest(),
            "rescaled": list(RESCALED[case.kind]),
            "weights": {name: stats(values) for name, values in weights.items()},
            "plain": {"model.norm.weight": stats(np.ones(8))},
        }
    (HERE / "reference.json").write_text(json.dumps(reference, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
