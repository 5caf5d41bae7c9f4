"""Pure: recognise quantized weights, whose stored tensor is not the weight by itself.

A quantized weight is a tensor of codes plus a scale tensor stored beside it (FORMATS.md,
"Quantized safetensors"); its real value is their product. Measuring or scaling the codes
alone is meaningless, and a global clip would rescale codes and scales alike. Until such
checkpoints are supported in full, clipcli names them: a warning for norms and diff, a
refusal (exit 4) for any clip that would touch one.

Conventions recognised, by name and dtype:
- block-scaled FP8 (DeepSeek-V3, Qwen3-FP8): `X.weight` (8-bit) + `X.weight_scale_inv`;
- per-tensor / per-channel FP8 (compressed-tensors, fbgemm_fp8): `X.weight` (8-bit) +
  `X.weight_scale`, with `X.input_scale` / `X.input_scale_ub` for activations;
- int8 codes + `X.weight_scale` (compressed-tensors int-quantized);
- MXFP4 (gpt-oss): `X_blocks` (uint8) + `X_scales` (uint8).
A model directory whose config.json has a `quantization_config` is quantized as a whole.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from clipcli.formats.base import TensorInfo

BLOCK_FP8 = "block-scaled fp8"
CHANNEL_FP8 = "per-tensor/channel fp8"
# compressed-tensors int-quantized (its naive compressor): int8 codes + `X.weight_scale`
# (+ zero point), per tensor, channel or group; not fp8, so the message must not say fp8.
SCALED_INT8 = "int8 codes with scales"
MXFP4 = "mxfp4"

CONFIG_LIMIT = 16 << 20  # bytes: a config.json is a few KB; never slurp a huge one


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class QuantizedWeight(NamedTuple):
    """One quantized weight: its codes, its scales and any companions (all stored tensors)."""

    codes: str
    scheme: str
    members: tuple[str, ...]  # codes, scales, activation scales: none of them is a weight


def _is_8bit_or_less(info: TensorInfo) -> bool:
    return info.dtype.itemsize == 1


def detect(infos: Sequence[TensorInfo]) -> list[QuantizedWeight]:
    """Every quantized weight among `infos`, in file order of their codes."""
    by_name = {info.name: info for info in infos}
    found = []
    for info in infos:
        name = info.name
        if name.endswith("_blocks") and info.dtype.kind == "u" and _is_8bit_or_less(info):
            scales = name[: -len("_blocks")] + "_scales"
            if scales in by_name:
                found.append(QuantizedWeight(name, MXFP4, (name, scales)))
            continue
        if not _is_8bit_or_less(info):
            continue
        scaled = SCALED_INT8 if info.dtype.kind in "iu" else CHANNEL_FP8
        for suffix, scheme in (("_scale_inv", BLOCK_FP8), ("_scale", scaled)):
            if name + suffix in by_name:
                # the module's prefix with its dot; "" for the root module's bare "weight"
                module = name[: name.rfind(".") + 1]
                extra = tuple(
                    n for n in (f"{module}input_scale", f"{module}input_scale_ub") if n in by_name
                )
                found.append(QuantizedWeight(name, scheme, (name, name + suffix, *extra)))
                break
    return found


def declared_method(directory: Path) -> str | None:
    """config.json's quantization_config.quant_method ('?' when unnamed), or None when the
    directory declares no quantization (or has no readable config.json)."""
    config = directory / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > CONFIG_LIMIT:
            return None
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    quant = data.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return str(method) if method is not None else "?"
