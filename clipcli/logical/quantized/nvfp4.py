"""NVFP4 (compressed-tensors `nvfp4-pack-quantized`): `X.weight_packed` U8 [out, in/2]
(low nibble = even element), `X.weight_scale` F8_E4M3 [out, ceil(in/16)],
`X.weight_global_scale` F32 [1]; weight = fp4 x scale / global_scale.

fp4 x scale is a float64 exactly; the division by the global scale is rounded once per
value (to nearest float64: a relative error of at most 2**-53 per value, so the norm is
within about an ulp of the exact one). `X.input_global_scale` and `X.input_scale` are
activation scales: side tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised, row_for_row
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("nvfp4",)
FORMAT = "nvfp4-pack-quantized"
GROUP = 16
# Parts of the weight's module (rules.module_prefix: "X." or "" for the root module).
ACTIVATION_SCALES = ("input_global_scale", "input_scale")


def _declared(config: Mapping[str, Any]) -> bool:
    return rules.method_of(config) == "compressed-tensors" and rules.declares_format(config, FORMAT)


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    if config is not None and not _declared(config):
        return []
    found = []
    for name, info in stored.items():
        if rules.dtype_name(info) != "uint8":
            continue
        stem = rules.module_prefix(name, "weight_packed")  # "X.", or "" for the root
        if stem is None:
            continue
        scale = stored.get(stem + "weight_scale")
        global_scale = stored.get(stem + "weight_global_scale")
        if scale is None or global_scale is None:
            if config is not None:
                parts = (("weight_scale", scale), ("weight_global_scale", global_scale))
                missing = [stem + s for s, part in parts if part is None]
                raise rules.incomplete(
                    name,
                    f"NVFP4 codes without their {' and '.join(missing)}: the real values are "
                    "unknown",
                )
            continue
        found.append(_recognised(stored, info, scale, global_scale, stem))
    return found


def _recognised(
    stored: Mapping[str, TensorInfo],
    packed: TensorInfo,
    scale: TensorInfo,
    global_scale: TensorInfo,
    stem: str,
) -> Recognised:
    rules.check_not_empty(packed.name, packed, scale, global_scale)
    if len(packed.shape) != 2:
        raise rules.refuse(packed.name, f"NVFP4 weight of rank {len(packed.shape)}, not 2")
    rows, columns = packed.shape[0], packed.shape[1] * 2
    rules.check_scale_dtype(scale, frozenset({"float8_e4m3fn"}))
    rules.check_shape(scale, (rows, rules.ceil_div(columns, GROUP)), packed.name, "scale")
    rules.check_scale_dtype(global_scale, frozenset({"float32"}))
    if global_scale.numel != 1:
        raise rules.refuse(
            global_scale.name, f"global scale of {global_scale.numel} elements, not 1"
        )
    side = tuple(Part(stem + s, "input_scale") for s in ACTIVATION_SCALES if stem + s in stored)
    return Recognised(
        name=stem + "weight",
        scheme=NAMES[0],
        shape=(rows, columns),
        codes=packed.name,
        parts=(
            Part(packed.name, "codes"),
            Part(scale.name, "scale"),
            Part(global_scale.name, "global_scale"),
        ),
        side=side,
    )


code_rows = row_for_row  # one real row per stored row of codes


def decode_rows(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> np.ndarray:
    import numpy as np

    columns = weight.shape[1]
    values = rules.fp4_low_first(codes)
    scales = rules.widened(small[weight.parts[1].name]).reshape(-1, rules.ceil_div(columns, GROUP))
    global_scale = float(rules.widened(small[weight.parts[2].name]).reshape(-1)[0])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        values *= np.repeat(scales[start:stop], GROUP, axis=1)[:, :columns]
        values /= global_scale
    return values


def code_tables(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray] | None:
    """Real rows [start, stop) as how often each (fp8 scale code, e2m1 code) pair occurs
    and one table of their 256 x 16 values, each fp4 x scale / global scale as decode_rows
    divides it: (counts, values). None where the run holds fewer values than the table
    (decoded)."""
    import numpy as np

    from clipcli.dtypes import float64_values
    from clipcli.numerics import coded

    columns = weight.shape[1]
    packed = codes.reshape(stop - start, -1).view(np.uint8)
    if packed.shape[1] * 2 != columns or not coded.tables_pay(16, (stop - start) * columns):
        return None
    stored_scales = small[weight.parts[1].name]
    scale_codes = stored_scales.view(np.uint8).reshape(-1, rules.ceil_div(columns, GROUP))
    counts = coded.nibble_counts(packed, scale_codes[start:stop], GROUP)
    global_scale = float(rules.widened(small[weight.parts[2].name]).reshape(-1)[0])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        tables = float64_values(stored_scales.dtype)[:, None] * np.array(rules.E2M1)
        tables /= global_scale
    return counts, tables


measure_rows = rules.measured_through(code_tables)


def scaled_parts(weight: Recognised) -> list[str]:
    # The block scales: the global scale may be shared by fused q/k/v or gate/up.
    return [weight.parts[1].name]
