"""GPTQ (AutoGPTQ, GPTQModel; quant_method "gptq"), v1 and v2.

`X.qweight` I32 [ceil(in*b/32), out]: the codes of the weight's transpose [in, out],
packed down each column (input i at bit i*b of its column, least significant first: the
same as floor(32/b) per word for b = 2, 4, 8; GPTQ's 3-bit layout is that dense stream).
`X.qzeros` I32 [groups, ceil(out*b/32)], packed along each row the same way;
`X.scales` [groups, out] (float16 in practice); `X.g_idx` [in], the group of each input
(act-order permutes it; without it, input i is in group i // group_size).

    v1 (checkpoint_format "gptq", or none): W[i, j] = scales[g, j] * (q[i, j] - (z[g, j] + 1))
    v2 (checkpoint_format "gptq_v2"):       W[i, j] = scales[g, j] * (q[i, j] - z[g, j])

with g = g_idx[i]; the +1 is not masked (a stored 15 means 16 at 4 bits), as AutoGPTQ's
kernels read it. A file without a config.json is v1: v2 exists only where a config
declares it. The real weight is the transpose, [out, in] (Recognised.transposed).

Without a config, the bits are those the packed widths agree on, and the group of each
input is its g_idx (or one group): a group size cannot be told from shapes alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import intcodes, rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("gptq",)
METHOD = "gptq"
BITS = (2, 3, 4, 8)
FORMATS = {"gptq": 1, "gptq_v2": 2}


class _Declared:
    """What config.json's quantization_config says, checked."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        where = "config.json"
        bits = config.get("bits")
        if bits not in BITS or type(bits) is not int:
            raise rules.refuse(where, f"GPTQ bits {bits!r} is not one of {list(BITS)}")
        self.bits: int = bits
        group = config.get("group_size", -1)
        self.group: int | None = (
            None
            if group == -1 and type(group) is int
            else intcodes.whole_number(group, where, "GPTQ group_size", 1, intcodes.MAX_GROUP)
        )
        layout = config.get("checkpoint_format", "gptq")
        if layout not in FORMATS:
            raise rules.refuse(
                where,
                f"GPTQ checkpoint_format {layout!r} is not one clipcli decodes "
                f"({', '.join(FORMATS)})",
            )
        if config.get("is_marlin_format") is True:
            raise rules.refuse(where, "GPTQ in Marlin's layout is not one clipcli decodes")
        self.version = FORMATS[layout]


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    method = rules.method_of(config)
    if config is not None and method != METHOD:
        return []
    declared = _Declared(config) if config is not None else None
    found = []
    sets = intcodes.qweight_sets(stored, declared is not None, "GPTQ")
    for module, info, qzeros, scales in sets:
        if declared is None and not _gptq_shaped(info, scales):
            continue  # AWQ's layout, or not a quantized weight at all
        found.append(_recognised(module, info, qzeros, scales, stored, declared))
    return found


def _gptq_shaped(qweight: TensorInfo, scales: TensorInfo) -> bool:
    """GPTQ packs down the columns (qweight has `out` columns, as scales do); AWQ packs
    along the rows."""
    return len(qweight.shape) == 2 == len(scales.shape) and qweight.shape[1] == scales.shape[1]


def _recognised(
    module: str,
    qweight: TensorInfo,
    qzeros: TensorInfo,
    scales: TensorInfo,
    stored: Mapping[str, TensorInfo],
    declared: _Declared | None,
) -> Recognised:
    g_idx = stored.get(module + "g_idx")
    stored_parts = [qweight, qzeros, scales] + ([] if g_idx is None else [g_idx])
    rules.check_not_empty(module + "weight", *stored_parts)
    for info, role in ((qweight, "GPTQ qweight"), (qzeros, "GPTQ qzeros")):
        intcodes.check_dtype(info, intcodes.WORD_DTYPES, role)
        if len(info.shape) != 2:
            raise rules.refuse(info.name, f"{role} of rank {len(info.shape)}, not 2")
    intcodes.check_dtype(scales, intcodes.FLOAT_SCALE_DTYPES, "GPTQ scale")
    if len(scales.shape) != 2:
        raise rules.refuse(scales.name, f"GPTQ scales of rank {len(scales.shape)}, not 2")
    groups, out = scales.shape
    bits = declared.bits if declared is not None else _bits_from_shapes(qweight, qzeros, g_idx, out)
    inputs = _inputs(qweight, g_idx, bits)
    weight = module + "weight"
    rules.check_shape(qweight, (intcodes.words_for(inputs, bits, True), out), weight, "qweight")
    rules.check_shape(qzeros, (groups, intcodes.words_for(out, bits, True)), weight, "qzeros")
    group = _group(declared, g_idx, groups, inputs, weight)
    parts = [Part(qweight.name, "codes"), Part(scales.name, "scale")]
    parts.append(Part(qzeros.name, "zero_point"))
    if g_idx is not None:
        parts.append(Part(g_idx.name, "group_index"))
    version = declared.version if declared is not None else 1
    return Recognised(
        name=weight,
        scheme=f"gptq-int{bits}" + ("-v2" if version == 2 else ""),
        shape=(out, inputs),
        codes=qweight.name,
        parts=tuple(parts),
        params={
            "bits": bits,
            "group": group,
            "groups": groups,
            "version": version,
            "scales": scales.name,
            "zeros": qzeros.name,
            "g_idx": g_idx.name if g_idx is not None else None,
            "dtype": scales.dtype.name,
        },
        transposed=True,
    )


def _bits_from_shapes(
    qweight: TensorInfo, qzeros: TensorInfo, g_idx: TensorInfo | None, out: int
) -> int:
    """The one bit width both packed widths agree on (qweight's only where g_idx says how
    many inputs there are)."""
    fits = [
        b
        for b in BITS
        if intcodes.words_for(out, b, True) == qzeros.shape[1]
        and (
            g_idx is None
            or len(g_idx.shape) != 1
            or intcodes.words_for(g_idx.shape[0], b, True) == qweight.shape[0]
        )
    ]
    if len(fits) != 1:
        raise rules.refuse(
            qweight.name,
            "the GPTQ bit width cannot be told from the shapes (they fit "
            f"{fits or 'none'} of {list(BITS)}); give the model directory with its config.json",
        )
    return fits[0]


def _inputs(qweight: TensorInfo, g_idx: TensorInfo | None, bits: int) -> int:
    """The real weight's input size: g_idx's length, else every packed bit used (GPTQ
    writers pack whole multiples of 32 inputs)."""
    if g_idx is not None:
        intcodes.check_dtype(g_idx, intcodes.INDEX_DTYPES, "GPTQ g_idx")
        if len(g_idx.shape) != 1:
            raise rules.refuse(
                g_idx.name, f"GPTQ g_idx of shape {rules.shown(g_idx.shape)}, not 1-D"
            )
        return g_idx.shape[0]
    total = qweight.shape[0] * intcodes.WORD_BITS
    if total % bits:
        raise rules.refuse(
            qweight.name,
            f"{qweight.shape[0]} packed rows do not hold a whole number of {bits}-bit inputs "
            "and no g_idx says how many there are",
        )
    return total // bits


def _group(
    declared: _Declared | None, g_idx: TensorInfo | None, groups: int, inputs: int, weight: str
) -> int:
    """The group size when no g_idx is stored (with one stored, g_idx decides; the size
    returned is then only informative)."""
    if declared is not None and declared.group is not None:
        group = declared.group
    elif declared is not None or groups == 1:
        group = max(inputs, 1)  # group_size -1: one group over every input
    elif g_idx is not None:
        return rules.ceil_div(inputs, groups)
    else:
        raise rules.refuse(
            weight,
            f"{groups} GPTQ groups over {inputs} inputs without a g_idx: the group size "
            "cannot be told from the shapes; give the model directory with its config.json",
        )
    if rules.ceil_div(inputs, group) != groups:
        # With a g_idx stored it still decides each input's group, but a config whose
        # group_size disagrees with the stored groups is a record that does not hold (R5).
        source = ""
        if declared is not None:
            size = -1 if declared.group is None else declared.group
            source = f" (config.json's group_size is {size})"
        raise rules.refuse(
            weight,
            f"{groups} groups of scales do not fit {inputs} inputs in groups of {group}{source}",
        )
    return group


def code_rows(weight: Recognised, start: int, stop: int) -> tuple[int, int]:
    bits = weight.params["bits"]
    return intcodes.first_word(start, bits, True), intcodes.words_for(stop, bits, True)


def _terms(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
    columns: tuple[int, int] | None = None,
) -> intcodes.CodeTerms:
    """Inputs [start, stop) (of outputs [first, last) when given) as code - zero point
    (v1: zero point + 1), and each one's scale: its input's group (g_idx, else input //
    group size), its output."""
    import numpy as np

    params = weight.params
    bits = params["bits"]
    out = weight.shape[0]
    first, last = columns if columns is not None else (0, out)
    outputs = np.arange(first, last, dtype=np.int64)
    rows = np.arange(start, stop, dtype=np.int64)
    base = intcodes.first_word(start, bits, True) * intcodes.WORD_BITS
    words = codes.reshape(-1, out)[:, first:last]
    q = intcodes.extract(words, rows * bits - base, bits, axis=0)
    zero_words = small[params["zeros"]].reshape(params["groups"], -1)
    zeros = intcodes.extract(zero_words, outputs * bits, bits, axis=1)
    g_idx = small[params["g_idx"]] if params["g_idx"] is not None else None
    group = intcodes.group_of_rows(
        g_idx, start, stop, params["group"], params["groups"], weight.name
    )
    offset = zeros[group].astype(np.int64) + (1 if params["version"] == 1 else 0)
    scale_at = group[:, None] * out + outputs[None, :]
    return intcodes.CodeTerms(q.astype(np.int64) - offset, scale_at)


decode_rows, decode_columns, scale_energies, code_energies = intcodes.term_hooks(_terms, "scales")
ENERGY_UNIT = intcodes.ENERGY_UNIT


def scaled_parts(weight: Recognised) -> list[str]:
    return [weight.params["scales"]]
