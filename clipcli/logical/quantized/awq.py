"""AWQ, GEMM layout (AutoAWQ; quant_method "awq", version "gemm"), 4-bit.

`X.qweight` I32 [in, out/8] and `X.qzeros` I32 [in/g, out/8] hold the codes of the
weight's transpose [in, out] and its zero points, 8 to a word along the output dim in
the order [0, 2, 4, 6, 1, 3, 5, 7]: nibble k (bits 4k..4k+3) holds output
8*(j // 8) + ORDER[k], so output j sits in nibble REVERSE[j % 8]. `X.scales` [in/g, out]
(float16 in practice). W[i, j] = (q[i, j] - z[i // g, j]) * scales[i // g, j]; the real
weight is the transpose, [out, in] (Recognised.transposed).

AutoAWQ packs only whole words (out % 8 == 0) and whole groups (in % g == 0), so without
a config the group size is in / groups. The GEMV, Marlin and other layouts are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import intcodes, rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised, row_for_row
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("awq",)
METHOD = "awq"
BITS = 4
PER_WORD = 8
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k holds output ORDER[k] of its 8
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output e sits in nibble REVERSE[e]


def _declared(config: Mapping[str, Any]) -> int | None:
    """The group size config.json declares (None: one group), after checking that its
    layout is GEMM at 4 bits."""
    where = "config.json"
    version = config.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise rules.refuse(where, f"AWQ version {version!r} is not one clipcli decodes (only gemm)")
    bits = config.get("bits", config.get("w_bit", BITS))
    if bits != BITS or type(bits) is not int:
        raise rules.refuse(where, f"AWQ bits {bits!r}: only 4-bit GEMM is defined")
    if config.get("zero_point", True) is not True:
        raise rules.refuse(where, "AWQ without zero points is not one clipcli decodes")
    group = config.get("group_size", config.get("q_group_size", -1))
    if group == -1 and type(group) is int:
        return None
    return intcodes.whole_number(group, where, "AWQ group_size", 1, intcodes.MAX_GROUP)


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    if config is not None and rules.method_of(config) != METHOD:
        return []
    declared = _declared(config) if config is not None else None
    found = []
    for module, info, qzeros, scales in intcodes.qweight_sets(stored, config is not None, "AWQ"):
        if config is None and not _awq_shaped(info, qzeros, scales):
            continue  # GPTQ's layout, or not a quantized weight at all
        found.append(_recognised(module, info, qzeros, scales, declared, config is not None))
    return found


def _awq_shaped(qweight: TensorInfo, qzeros: TensorInfo, scales: TensorInfo) -> bool:
    """AWQ packs along the rows: qweight and qzeros have out/8 columns, scales out."""
    shapes = (qweight.shape, qzeros.shape, scales.shape)
    return (
        all(len(s) == 2 for s in shapes)
        and qweight.shape[1] == qzeros.shape[1]
        and qweight.shape[1] * PER_WORD == scales.shape[1]
    )


def _recognised(
    module: str,
    qweight: TensorInfo,
    qzeros: TensorInfo,
    scales: TensorInfo,
    declared: int | None,
    configured: bool,
) -> Recognised:
    rules.check_not_empty(module + "weight", qweight, qzeros, scales)
    for info, role in ((qweight, "AWQ qweight"), (qzeros, "AWQ qzeros")):
        intcodes.check_dtype(info, intcodes.WORD_DTYPES, role)
        if len(info.shape) != 2:
            raise rules.refuse(info.name, f"{role} of rank {len(info.shape)}, not 2")
    intcodes.check_dtype(scales, intcodes.FLOAT_SCALE_DTYPES, "AWQ scale")
    if len(scales.shape) != 2:
        raise rules.refuse(scales.name, f"AWQ scales of rank {len(scales.shape)}, not 2")
    groups, out = scales.shape
    inputs = qweight.shape[0]
    weight = module + "weight"
    if out % PER_WORD:
        raise rules.refuse(
            scales.name, f"{out} outputs are not whole words of {PER_WORD} AWQ codes"
        )
    rules.check_shape(qweight, (inputs, out // PER_WORD), weight, "qweight")
    if configured:
        group = declared if declared is not None else max(inputs, 1)
    elif groups and inputs % groups == 0:
        group = inputs // groups
    else:
        raise rules.refuse(
            weight, f"{groups} AWQ groups do not divide {inputs} inputs into whole groups"
        )
    if inputs % group or inputs // group != groups:
        raise rules.refuse(
            scales.name,
            f"{groups} groups of scales do not fit {inputs} inputs in groups of {group}",
        )
    rules.check_shape(qzeros, (groups, out // PER_WORD), weight, "qzeros")
    return Recognised(
        name=weight,
        scheme="awq-int4",
        shape=(out, inputs),
        codes=qweight.name,
        parts=(
            Part(qweight.name, "codes"),
            Part(scales.name, "scale"),
            Part(qzeros.name, "zero_point"),
        ),
        params={
            "bits": BITS,
            "group": group,
            "groups": groups,
            "scales": scales.name,
            "zeros": qzeros.name,
            "dtype": scales.dtype.name,
        },
        transposed=True,
    )


def _positions(count: int) -> np.ndarray:
    """Bit positions of outputs 0..count-1 in a row of AWQ words."""
    import numpy as np

    outputs = np.arange(count, dtype=np.int64)
    reverse = np.asarray(REVERSE, dtype=np.int64)
    return (outputs // PER_WORD) * intcodes.WORD_BITS + reverse[outputs % PER_WORD] * BITS


code_rows = row_for_row  # one real row per stored row of codes


def _terms(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
    columns: tuple[int, int] | None = None,
) -> intcodes.CodeTerms:
    """Inputs [start, stop) (of outputs [first, last) when given) as code - zero point,
    and each one's scale: its input's group (input // group size), its output."""
    import numpy as np

    params = weight.params
    out = weight.shape[0]
    first, last = columns if columns is not None else (0, out)
    positions = _positions(out)[first:last]
    # only the words that hold these outputs (4-bit fields never straddle two words)
    low = int(positions.min()) // intcodes.WORD_BITS if positions.size else 0
    high = int(positions.max()) // intcodes.WORD_BITS + 1 if positions.size else 0
    positions = positions - low * intcodes.WORD_BITS
    words = codes.reshape(stop - start, -1)[:, low:high]
    q = intcodes.extract(words, positions, BITS, axis=1)
    zero_words = small[params["zeros"]].reshape(params["groups"], -1)[:, low:high]
    group = np.arange(start, stop, dtype=np.int64) // params["group"]
    zeros = intcodes.extract(zero_words[np.unique(group)], positions, BITS, axis=1)
    local = group - group[0] if group.size else group
    scale_at = group[:, None] * out + np.arange(first, last, dtype=np.int64)[None, :]
    return intcodes.CodeTerms(q.astype(np.int64) - zeros[local].astype(np.int64), scale_at)


decode_rows, decode_columns, scale_energies, code_energies = intcodes.term_hooks(_terms, "scales")
ENERGY_UNIT = intcodes.ENERGY_UNIT


def scaled_parts(weight: Recognised) -> list[str]:
    return [weight.params["scales"]]
