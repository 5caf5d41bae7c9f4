"""FP8 weights with a `weight_scale` (multiplied): compressed-tensors `float-quantized`
(strategy tensor, channel, group or block), fbgemm_fp8 per-row, and ComfyUI's
`X.scale_weight` (one scale per tensor).

`X.weight` F8 [M, N] x `X.weight_scale` of shape [1] or [] (tensor), [M, 1] (channel or
fbgemm row), [M, ceil(N/g)] (group g) or [ceil(M/bh), ceil(N/bw)] (block): every layout is
one scale per tile of the weight, decoded as fp8_block decodes its blocks. `X.input_scale`
(and fbgemm's `X.input_scale_ub`, ComfyUI's `X.scale_input`) scale activations: side
tensors, never values, never clipped. Without a config.json only what the shapes tell for
certain is read (one scale, or one per row); a group or block size must come from the
config, else it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import fp8_block, rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised
from clipcli.logical.view import Part

if TYPE_CHECKING:
    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("fp8-tensor", "fp8-channel", "fp8-group", "fp8-block", "fp8-row")
COMPRESSED_TENSORS = "compressed-tensors"
FBGEMM = "fbgemm_fp8"
FLOAT_FORMATS = frozenset({"float-quantized", "naive-quantized"})
# Parts of the weight's module (rules.module_prefix: "X." or "" for the root module).
SCALE_NAMES = ("weight_scale", "scale_weight")  # compressed-tensors/fbgemm, ComfyUI
ACTIVATION_SCALES = ("input_scale", "input_scale_ub", "scale_input")

# A tile: rows x columns of the weight one scale covers; None stands for the whole extent.
Tile = tuple[int | None, int | None]


def _strategies(config: Mapping[str, Any]) -> list[tuple[str, Tile]]:
    """The float-8 weight layouts a compressed-tensors config declares."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict):
        raise rules.refuse("config.json", "quantization_config.config_groups is not an object")
    fmt = config.get("format")
    found: list[tuple[str, Tile]] = []
    for key, group in groups.items():
        where = f"config.json: config_groups[{key!r}]"
        if not isinstance(group, dict):
            raise rules.refuse(where, "is not an object")
        weights = group.get("weights")
        if weights is None:
            continue
        if not isinstance(weights, dict):
            raise rules.refuse(where, "weights is not an object")
        group_format = group.get("format", fmt)
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            continue
        if group_format not in FLOAT_FORMATS:
            continue
        strategy = weights.get("strategy")
        if strategy == "tensor":
            found.append(("fp8-tensor", (None, None)))
        elif strategy == "channel":
            found.append(("fp8-channel", (1, None)))
        elif strategy == "group":
            size = rules.block_size(weights.get("group_size"), where, "group_size")
            found.append(("fp8-group", (1, size)))
        elif strategy == "block":
            bh, bw = rules.block_sizes(weights.get("block_structure"), where, "block_structure", 2)
            found.append(("fp8-block", (bh, bw)))
        else:
            raise rules.refuse(where, f"weight strategy {strategy!r} is not one clipcli reads")
    return found


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    method = rules.method_of(config)
    if config is not None and method not in (COMPRESSED_TENSORS, FBGEMM):
        return []
    if method == COMPRESSED_TENSORS:
        assert config is not None
        candidates = _strategies(config)
        if not candidates:
            return []
    elif method == FBGEMM:
        candidates = [("fp8-row", (1, None))]
    else:  # names alone: only what shapes tell for certain
        candidates = [("fp8-tensor", (None, None)), ("fp8-channel", (1, None))]
    found = []
    for name, info in stored.items():
        if rules.dtype_name(info) not in rules.FP8_CODE_DTYPES:
            continue
        stem = rules.module_prefix(name, "weight")  # "X." for X.weight, "" for the root's
        if stem is None:
            continue
        scales = [stored[stem + s] for s in SCALE_NAMES if stem + s in stored]
        if not scales:
            if config is not None:
                raise rules.incomplete(
                    name,
                    f"fp8 codes without their {stem}weight_scale (config.json declares "
                    f"quant_method {method!r}): its real values cannot be known",
                )
            continue
        if len(scales) > 1:
            raise rules.refuse(name, "has two scales (weight_scale and scale_weight): ambiguous")
        found.append(_recognised(stored, info, scales[0], candidates, stem))
    return found


def _tile_scale_shape(shape: tuple[int, ...], tile: Tile) -> tuple[int, int]:
    rows, columns = shape
    return (
        1 if tile[0] is None else rules.ceil_div(rows, tile[0]),
        1 if tile[1] is None else rules.ceil_div(columns, tile[1]),
    )


def _recognised(
    stored: Mapping[str, TensorInfo],
    info: TensorInfo,
    scale: TensorInfo,
    candidates: list[tuple[str, Tile]],
    stem: str,
) -> Recognised:
    rules.check_not_empty(info.name, info, scale)
    if len(info.shape) != 2:
        raise rules.refuse(info.name, f"scaled fp8 weight of rank {len(info.shape)}, not 2")
    rules.check_scale_dtype(scale)
    fits = []
    for scheme, tile in candidates:
        expected = _tile_scale_shape(info.shape, tile)
        if scale.numel == 1 and expected == (1, 1) or tuple(scale.shape) == expected:
            fits.append((scheme, tile))
    if not fits:
        shapes = " or ".join(rules.shown(_tile_scale_shape(info.shape, t)) for _, t in candidates)
        raise rules.refuse(
            scale.name,
            f"scale of shape {rules.shown(scale.shape)} does not fit {info.name} "
            f"{rules.shown(info.shape)} (expected {shapes})",
        )
    blocks = {_block(info.shape, tile) for _, tile in fits}
    if len(blocks) > 1:
        raise rules.refuse(
            scale.name,
            f"scale of shape {rules.shown(scale.shape)} fits {len(blocks)} layouts of "
            f"config.json's config_groups: ambiguous",
        )
    scheme, tile = fits[0]
    side = tuple(Part(stem + s, "input_scale") for s in ACTIVATION_SCALES if stem + s in stored)
    return Recognised(
        name=info.name,
        scheme=scheme,
        shape=tuple(info.shape),
        codes=info.name,
        parts=(Part(info.name, "codes"), Part(scale.name, "scale")),
        side=side,
        params={"block": _block(info.shape, tile)},
    )


def _block(shape: tuple[int, ...], tile: Tile) -> tuple[int, int]:
    rows, columns = shape
    return (
        max(1, rows) if tile[0] is None else tile[0],
        max(1, columns) if tile[1] is None else tile[1],
    )


code_rows = fp8_block.code_rows
decode_rows = fp8_block.decode_rows
measure_rows = fp8_block.measure_rows
code_tables = fp8_block.code_tables
code_energies = fp8_block.code_energies
ENERGY_UNIT = fp8_block.ENERGY_UNIT
scaled_parts = fp8_block.scaled_parts
