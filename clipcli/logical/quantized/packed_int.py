"""compressed-tensors `pack-quantized` integers, 1 to 8 bits (llm-compressor's W4A16,
W8A16 and kin; quant_method "compressed-tensors").

`X.weight_packed` I32 [..., out, words]: each row of the real weight is one bit stream
of unsigned codes Q = q + 2^(b-1) (intcodes: dense from version 0.17, floor(32/b) per word
before; the same for 1/2/4/8 bits). `X.weight_shape` holds the real shape as data (2-D,
or 3-D for stacked experts). `X.weight_scale` [..., out, groups] (tensor strategy: one
value; channel: one group; group: ceil(in/g) groups). `X.weight_zero_point`, when the
scheme is asymmetric, is packed the same way down each column: [..., words(out), groups].
`X.weight_g_idx` [in] gives each input's group (act-order), else input j is in group
j // group_size. W = (Q - Z) * scale, with Z = 2^(b-1) when no zero point is stored.

What decides the bits and the layout: the config's weights args (num_bits, strategy,
group_size) and version, each checked against the packed widths; without a config, the
one (bits, layout) the widths allow. Where two remain, or a group size would have to be
guessed, the weight is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.logical.quantized import intcodes, rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised, row_for_row
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("pack-quantized",)
METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
PART = "weight_packed"  # of module "X." (or "" for the root: rules.module_prefix)
DENSE_FROM = (0, 17)  # compressed-tensors version from which 3/5/6/7 bits pack densely
MAX_RANK = 3
MAX_DIM = 1 << 40  # no real dimension is near this; checked before any product is taken
SHAPE_DTYPES = frozenset({"int32", "int64"})


class Args(NamedTuple):
    """One config group's weight args (or what the shapes tell without a config)."""

    bits: int
    group: int | None  # None: tensor or channel strategy, or g_idx decides
    strategy: str | None  # "tensor", "channel", "group"; None: unknown (no config)


def _version(config: Mapping[str, Any]) -> tuple[int, int] | None:
    raw = config.get("version")
    if not isinstance(raw, str):
        return None
    head = raw.split(".")
    try:
        return int(head[0]), int(head[1].split("+")[0].rstrip("abcdefghijklmnopqrstuvwxyz"))
    except (ValueError, IndexError):
        return None


def _declared(config: Mapping[str, Any]) -> list[Args]:
    """The int weight args of every config group stored as pack-quantized."""
    where = "config.json"
    top = config.get("format")
    groups = config.get("config_groups")
    if not isinstance(groups, dict):
        raise rules.refuse(where, "compressed-tensors config_groups is not a mapping")
    found: list[Args] = []
    for key, group in groups.items():
        if not isinstance(group, dict):
            raise rules.refuse(where, f"config group {key!r} is not a mapping")
        if group.get("format", top) != FORMAT:
            continue
        weights = group.get("weights")
        if not isinstance(weights, dict) or weights.get("type", "int") != "int":
            continue
        what = f"config group {key!r}"
        bits = intcodes.whole_number(weights.get("num_bits"), where, f"{what} num_bits", 1, 8)
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "group"):
            raise rules.refuse(
                where,
                f"{what} strategy {strategy!r} is not one clipcli decodes for packed integers",
            )
        size = None
        if strategy == "group":
            size = intcodes.whole_number(
                weights.get("group_size"), where, f"{what} group_size", 1, intcodes.MAX_GROUP
            )
        found.append(Args(bits, size, strategy))
    return found


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,
) -> list[Recognised]:
    if config is not None and rules.method_of(config) != METHOD:
        return []
    declared = _declared(config) if config is not None else None
    version = _version(config) if config is not None else None
    found = []
    for name, info in stored.items():
        if rules.dtype_name(info) not in intcodes.WORD_DTYPES:
            continue
        module = rules.module_prefix(name, PART)
        if module is None:
            continue
        scale = stored.get(module + "weight_scale")
        shape_info = stored.get(module + "weight_shape")
        if scale is None or shape_info is None:
            missing = module + ("weight_scale" if scale is None else "weight_shape")
            raise rules.incomplete(
                name, f"packed integer codes without their {missing}: the real values are unknown"
            )
        if declared is not None and not declared:
            raise rules.refuse(
                name, "packed integer codes, but config.json declares no pack-quantized int group"
            )
        if read is None:
            raise rules.refuse(name, "the real shape is stored as data and was not read")
        real = _real_shape(shape_info, info, read)
        found.append(_recognised(module, info, scale, real, stored, declared, version))
    return found


def _real_shape(shape_info: TensorInfo, packed: TensorInfo, read: ReadSmall) -> tuple[int, ...]:
    """weight_shape's values, checked against the packed tensor before they size anything."""
    intcodes.check_dtype(shape_info, SHAPE_DTYPES, "weight_shape")
    if len(shape_info.shape) != 1 or not 2 <= shape_info.shape[0] <= MAX_RANK:
        raise rules.refuse(
            shape_info.name,
            f"weight_shape of shape {rules.shown(shape_info.shape)} is no real shape "
            f"(rank 2 to {MAX_RANK})",
        )
    values = [int(v) for v in read(shape_info.name).reshape(-1)]
    if len(values) != shape_info.shape[0] or any(not 0 <= v <= MAX_DIM for v in values):
        raise rules.refuse(shape_info.name, f"weight_shape {values} is no real shape")
    if len(packed.shape) != len(values) or tuple(packed.shape[:-1]) != tuple(values[:-1]):
        raise rules.refuse(
            packed.name,
            f"packed codes of shape {rules.shown(packed.shape)} do not hold a weight of "
            f"shape {rules.shown(values)}",
        )
    return tuple(values)


def _layouts(bits: int, version: tuple[int, int] | None) -> list[bool]:
    """The layouts (dense or not) a width may be read in: both are one for 1/2/4/8 bits."""
    if intcodes.WORD_BITS % bits == 0:
        return [True]
    if version is None:
        return [True, False]
    return [version >= DENSE_FROM]


def _recognised(
    module: str,
    packed: TensorInfo,
    scale: TensorInfo,
    real: tuple[int, ...],
    stored: Mapping[str, TensorInfo],
    declared: list[Args] | None,
    version: tuple[int, int] | None,
) -> Recognised:
    rules.check_not_empty(module + "weight", packed, scale, shape=real)
    weight = module + "weight"
    intcodes.check_dtype(scale, intcodes.FLOAT_SCALE_DTYPES, "weight scale")
    rows_shape, columns = real[:-1], real[-1]
    zero = stored.get(module + "weight_zero_point")
    g_idx = stored.get(module + "weight_g_idx")
    candidates = declared or [Args(b, None, None) for b in range(1, 9)]
    fits = {
        (args, dense)
        for args in candidates
        for dense in _layouts(args.bits, version)
        if intcodes.words_for(columns, args.bits, dense) == packed.shape[-1]
    }
    if len(fits) != 1:
        told = sorted({(a.bits, "dense" if d else "per word") for a, d in fits})
        raise rules.refuse(
            packed.name,
            f"packed width {packed.shape[-1]} for {columns} inputs fits "
            f"{told or 'no'} (bits, layout) of the {'config' if declared else 'possible'} ones"
            + ("; give the model directory with its config.json" if fits and not declared else ""),
        )
    ((args, dense),) = fits
    groups = _groups(scale, rows_shape, weight)
    group = _group(args, g_idx, groups, columns, weight)
    parts = [Part(packed.name, "codes"), Part(scale.name, "scale")]
    if zero is not None:
        if groups == 0:
            raise rules.refuse(zero.name, "a zero point beside one scale for the whole tensor")
        intcodes.check_dtype(zero, intcodes.WORD_DTYPES, "weight zero point")
        expected = (*rows_shape[:-1], intcodes.words_for(rows_shape[-1], args.bits, dense), groups)
        rules.check_shape(zero, expected, weight, "zero point")
        parts.append(Part(zero.name, "zero_point"))
    if g_idx is not None:
        parts.append(Part(g_idx.name, "group_index"))
    parts.append(Part(module + "weight_shape", "shape"))
    return Recognised(
        name=weight,
        scheme=f"pack-quantized-int{args.bits}",
        shape=real,
        codes=packed.name,
        parts=tuple(parts),
        params={
            "bits": args.bits,
            "dense": dense,
            "group": group,
            "groups": groups,
            "scale": scale.name,
            "zero_point": zero.name if zero is not None else None,
            "g_idx": g_idx.name if g_idx is not None else None,
            "dtype": scale.dtype.name,
        },
    )


def _groups(scale: TensorInfo, rows_shape: tuple[int, ...], weight: str) -> int:
    """How many groups each row has: 0 for one scale over the whole tensor."""
    if scale.numel == 1 and len(scale.shape) <= 1:
        return 0
    if len(scale.shape) != len(rows_shape) + 1 or tuple(scale.shape[:-1]) != rows_shape:
        raise rules.refuse(
            scale.name,
            f"scale of shape {rules.shown(scale.shape)} does not fit {weight} "
            f"(rows {rules.shown(rows_shape)})",
        )
    return scale.shape[-1]


def _group(args: Args, g_idx: TensorInfo | None, groups: int, columns: int, weight: str) -> int:
    """Inputs per group (with a g_idx stored, g_idx decides and this is only informative)."""
    if args.strategy == "tensor" and groups != 0:
        raise rules.refuse(weight, "tensor strategy, but the scale has more than one value")
    if groups <= 1:
        if g_idx is not None and groups == 0:
            raise rules.refuse(weight, "a g_idx beside one scale for the whole tensor")
        return max(columns, 1)
    if args.strategy == "channel":
        raise rules.refuse(weight, f"channel strategy, but the scale has {groups} groups")
    if g_idx is not None:
        intcodes.check_dtype(g_idx, intcodes.INDEX_DTYPES, "weight g_idx")
        rules.check_shape(g_idx, (columns,), weight, "g_idx")
        if args.group is not None and rules.ceil_div(columns, args.group) != groups:
            # g_idx decides each input's group, but a declared group_size that disagrees
            # with the stored groups is a record that does not hold (R5): refused.
            raise rules.refuse(
                weight,
                f"{groups} groups of scales do not fit {columns} inputs in groups of "
                f"{args.group} (config.json's group_size)",
            )
        return rules.ceil_div(columns, groups)
    if args.group is None:
        raise rules.refuse(
            weight,
            f"{groups} groups over {columns} inputs without a g_idx: the group size cannot be "
            "told from the shapes; give the model directory with its config.json",
        )
    if rules.ceil_div(columns, args.group) != groups:
        raise rules.refuse(
            weight,
            f"{groups} groups of scales do not fit {columns} inputs in groups of {args.group}",
        )
    return args.group


code_rows = row_for_row  # one real row per stored row of codes


def _terms(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> intcodes.CodeTerms:
    """Real rows [start, stop) as code - zero point, and each one's scale."""
    import numpy as np

    params = weight.params
    bits, dense, groups = params["bits"], params["dense"], params["groups"]
    columns = weight.shape[-1]
    count = stop - start
    positions = intcodes.bit_positions(np.arange(columns, dtype=np.int64), bits, dense)
    q = intcodes.extract(codes.reshape(count, -1), positions, bits, axis=1).astype(np.int64)
    if groups == 0:
        column_group = np.zeros(columns, dtype=np.int64)
        index = np.zeros((count, columns), dtype=np.int64)  # one scale for the tensor
    else:
        g_idx = small[params["g_idx"]] if params["g_idx"] is not None else None
        column_group = intcodes.group_of_rows(
            g_idx, 0, columns, params["group"], groups, weight.name
        )
        rows = np.arange(start, stop, dtype=np.int64)[:, None]
        index = rows * groups + column_group[None, :]
    if params["zero_point"] is None:
        zeros = np.full((count, 1), 1 << (bits - 1), dtype=np.int64)
    else:
        zeros = _zero_rows(weight, small[params["zero_point"]], start, stop)
    centred = q - zeros[:, column_group if zeros.shape[1] > 1 else np.zeros_like(column_group)]
    return intcodes.CodeTerms(centred, index)


decode_rows, _, scale_energies, code_energies = intcodes.term_hooks(_terms, "scale")
ENERGY_UNIT = intcodes.ENERGY_UNIT


def _zero_rows(weight: Recognised, packed: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The zero points of real rows [start, stop): [stop - start, groups] int64. Each 2-D
    slice's zero points are packed down its columns."""
    import numpy as np

    bits, dense, groups = weight.params["bits"], weight.params["dense"], weight.params["groups"]
    out = weight.shape[-2]
    slices = packed.reshape(-1, packed.shape[-2], groups)
    pieces = []
    row = start
    while row < stop:
        index, channel = divmod(row, out)
        last = min(stop, (index + 1) * out)
        channels = np.arange(channel, channel + last - row, dtype=np.int64)
        positions = intcodes.bit_positions(channels, bits, dense)
        pieces.append(intcodes.extract(slices[index], positions, bits, axis=0))
        row = last
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros((0, groups), np.int64)


def scaled_parts(weight: Recognised) -> list[str]:
    return [weight.params["scale"]]
