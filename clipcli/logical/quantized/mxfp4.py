"""MXFP4: e2m1 codes in blocks of 32 sharing one E8M0 scale 2**(s - 127).

- gpt-oss (quant_method "mxfp4"; names alone too): `X_blocks` U8 [..., nb, 16] and
  `X_scales` U8 [..., nb]; the weight is `X` [..., nb * 32]. Each byte holds two codes,
  low nibble = even element.
- compressed-tensors `mxfp4-pack-quantized`: `X.weight_packed` U8 [out, in/2] and
  `X.weight_scale` U8 (or F8_E8M0) [out, ceil(in/32)], low nibble = even element.
Every value is an e2m1 code times a power of two: a float64 exactly. Scale 0xFF is NaN.

A clip multiplies by a power of two 2**-k only (the factor rounded down,
rounding.power_of_two_steps): every scale byte s becomes s - k, exactly, and the codes stay
byte for byte. A byte below k has no E8M0 value to go to (2**(s - k - 127) is below
2**-127): such a block is left as it is, which changes nothing only when its codes are all
zero; the view refuses the clip otherwise (QuantizedView.refused_factor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("mxfp4",)
METHOD = "mxfp4"
PACK_FORMAT = "mxfp4-pack-quantized"
BLOCK = 32
SCALE_DTYPES = frozenset({"uint8", "float8_e8m0fnu"})


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    method = rules.method_of(config)
    gpt_oss = config is None or method == METHOD
    pack = config is None or (
        method == "compressed-tensors" and rules.declares_format(config, PACK_FORMAT)
    )
    found = []
    for name, info in stored.items():
        if gpt_oss and name.endswith("_blocks") and rules.dtype_name(info) == "uint8":
            scales = stored.get(name[: -len("_blocks")] + "_scales")
            if scales is not None:
                found.append(_gpt_oss(info, scales))
            elif config is not None:
                missing = name[: -len("_blocks")] + "_scales"
                raise rules.incomplete(
                    name, f"MXFP4 blocks without their {missing}: the real values are unknown"
                )
        elif pack and rules.dtype_name(info) == "uint8":
            stem = rules.module_prefix(name, "weight_packed")  # "X.", or "" for the root
            if stem is None:
                continue
            scale = stored.get(stem + "weight_scale")
            if scale is None or rules.dtype_name(scale) not in SCALE_DTYPES:
                continue  # another scheme's (NVFP4: an fp8 scale)
            if stem + "weight_global_scale" in stored:
                continue
            found.append(_packed(info, scale, stem))
    return found


def _gpt_oss(blocks: TensorInfo, scales: TensorInfo) -> Recognised:
    rules.check_not_empty(blocks.name, blocks, scales)
    if len(blocks.shape) < 2 or blocks.shape[-1] != BLOCK // 2:
        raise rules.refuse(
            blocks.name, f"MXFP4 blocks of shape {rules.shown(blocks.shape)}: the last is not 16"
        )
    rules.check_shape(scales, blocks.shape[:-1], blocks.name, "MXFP4 scales")
    if rules.dtype_name(scales) not in SCALE_DTYPES:
        raise rules.refuse(scales.name, f"MXFP4 scales of dtype {rules.dtype_name(scales)}")
    weight = blocks.name[: -len("_blocks")]
    shape = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    return Recognised(
        name=weight,
        scheme=NAMES[0],
        shape=shape,
        codes=blocks.name,
        parts=(Part(blocks.name, "codes"), Part(scales.name, "scale")),
        params={"power_of_two": True, "scale_block": BLOCK, "codes_per_row": blocks.shape[-2]},
    )


def _packed(packed: TensorInfo, scale: TensorInfo, stem: str) -> Recognised:
    rules.check_not_empty(packed.name, packed, scale)
    if len(packed.shape) != 2:
        raise rules.refuse(packed.name, f"packed MXFP4 weight of rank {len(packed.shape)}, not 2")
    rows, columns = packed.shape[0], packed.shape[1] * 2
    rules.check_shape(scale, (rows, rules.ceil_div(columns, BLOCK)), packed.name, "scale")
    return Recognised(
        name=stem + "weight",
        scheme=NAMES[0],
        shape=(rows, columns),
        codes=packed.name,
        parts=(Part(packed.name, "codes"), Part(scale.name, "scale")),
        params={"power_of_two": True, "scale_block": BLOCK, "codes_per_row": 1},
    )


def code_rows(weight: Recognised, start: int, stop: int) -> tuple[int, int]:
    per_row: int = weight.params["codes_per_row"]
    return start * per_row, stop * per_row


def decode_rows(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> np.ndarray:
    import numpy as np

    columns = weight.shape[-1]
    values = rules.fp4_low_first(codes.reshape(stop - start, -1))[:, :columns]
    stored = small[weight.parts[1].name].reshape(-1, rules.ceil_div(columns, BLOCK))
    scales = rules.e8m0_values(stored[start:stop])  # these rows' only
    with np.errstate(invalid="ignore"):
        values *= np.repeat(scales, BLOCK, axis=1)[:, :columns]
    return values


def code_tables(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray] | None:
    """Real rows [start, stop) as how often each (E8M0 scale code, e2m1 code) pair occurs
    and one table of their 256 x 16 products (decode_rows' own): (counts, values). None
    where the run holds fewer values than the table (the caller decodes)."""
    import numpy as np

    from clipcli.numerics import coded

    columns = weight.shape[-1]
    packed = codes.reshape(stop - start, -1).view(np.uint8)
    if packed.shape[1] * 2 != columns or not coded.tables_pay(16, (stop - start) * columns):
        return None
    scale_codes = small[weight.parts[1].name].view(np.uint8)
    scale_codes = scale_codes.reshape(-1, rules.ceil_div(columns, BLOCK))[start:stop]
    counts = coded.nibble_counts(packed, scale_codes, BLOCK)
    scales = rules.e8m0_values(np.arange(coded.CODES, dtype=np.uint8))
    with np.errstate(invalid="ignore"):
        tables = scales[:, None] * np.array(rules.E2M1, dtype=np.float64)
    return counts, tables


measure_rows = rules.measured_through(code_tables)


# e2m1 values are multiples of 1/2: their squares, in units of 2**-2, are integers.
ENERGY_UNIT = 2


def energy_slots(weight: Recognised) -> np.ndarray:  # noqa: ARG001 - the hook's signature
    """The scale each energy of code_energies stands under: one slot per finite E8M0 code
    (0 to 254), as float8_e8m0fnu (the view reads it as 2**(code - 127)). A weight's
    energies are per scale code, not per block: 255 integers whatever its size."""
    import ml_dtypes
    import numpy as np

    return np.arange(255, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


def code_energies(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> tuple[int, np.ndarray] | None:
    """Real rows [start, stop) as the sum of their e2m1 values squared (units of 2**-2)
    under each scale code (energy_slots): what every check of a factor 2**-k needs, as
    the scale bytes are lowered by k and the codes kept. None for a run with a NaN scale
    (0xFF) or a layout code_tables does not read."""
    import numpy as np

    from clipcli.numerics import coded

    columns = weight.shape[-1]
    packed = codes.reshape(stop - start, -1).view(np.uint8)
    if packed.shape[1] * 2 != columns:
        return None
    scale_codes = small[weight.parts[1].name].view(np.uint8)
    scale_codes = scale_codes.reshape(-1, rules.ceil_div(columns, BLOCK))[start:stop]
    counts = coded.nibble_counts(packed, scale_codes, BLOCK)
    if counts[rules.E8M0_NAN].any():
        return None
    units = (np.array(rules.E2M1, dtype=np.float64) * 2) ** 2  # exact small integers
    return 0, counts[: rules.E8M0_NAN] @ units.astype(np.int64)


def scaled_parts(weight: Recognised) -> list[str]:
    return [weight.parts[1].name]


def stored_scaler(
    weight: Recognised, part: str
) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
    """The optional scheme hook (scheme.Scheme): a scale part's bytes are E8M0 exponents,
    scaled by rules.lower_e8m0_exponents, never value by value."""
    return rules.lower_e8m0_exponents if part == weight.parts[1].name else None
