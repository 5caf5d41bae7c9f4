"""Checks every scheme module makes before a shape or size it derives from a quantization
config or a tensor's name decides an allocation or a read (docs/THREAT_MODEL.md: the config
and the names are input)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.errors import InputError

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo
    from clipcli.logical.quantized.scheme import Recognised
    from clipcli.numerics.norms import NormAccumulator

# A block or group larger than this is no real layout (real ones are 16 to 128): refused
# before it sizes anything.
MAX_BLOCK = 1 << 24

# Scale dtypes whose product with an fp8/fp4 code is a float64 exactly (24 + 4 bits at
# most, exponents far inside float64's range): the decoded values and their norms stay exact.
EXACT_SCALE_DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"}
)
FP8_CODE_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})


# What a refusal of a quantized set missing a part suggests: the stored tensors as they are.
STORED_HINT = "`ls --stored` and `norms --stored` show the stored tensors as they are"


def refuse(where: str, problem: str) -> InputError:
    """The one-line refusal (exit 3) for a quantized weight whose layout does not hold."""
    return InputError(where, problem)


def incomplete(where: str, problem: str) -> InputError:
    """The refusal (exit 3) of a quantized set missing a part (`problem` names the weight
    and the part): its real values are unknown, and the stored tensors are not it."""
    return InputError(where, f"{problem}; {STORED_HINT}")


def module_prefix(name: str, part: str) -> str | None:
    """`name` read as the part `part` ("qweight", "weight_scale_inv", "weight.absmax") of a
    module: the module's prefix with its dot ("model.layers.0.q_proj."), "" for a part of
    the root module (a bare "qweight": a checkpoint of one layer stores its parts without
    a prefix, and they are a quantized set like any other), None when `name` is not that
    part. Companions are then `prefix + "qzeros"`, the weight `prefix + "weight"`."""
    if name == part:
        return ""
    if name.endswith(part) and name[-len(part) - 1 : -len(part)] == ".":
        return name[: -len(part)]
    return None


def bare_parts(dotted: tuple[str, ...]) -> frozenset[str]:
    """The root module's names of the `dotted` parts: ".qweight" -> "qweight". A name is
    one of those parts when `name.endswith(dotted) or name in bare_parts(dotted)` (tested
    inline where 200,000 names pass: a call per name costs tens of ms)."""
    return frozenset(s[1:] for s in dotted if s.startswith("."))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_not_empty(weight: str, *parts: TensorInfo, shape: Sequence[int] = (1,)) -> None:
    """A quantized weight with a zero dimension (in any stored part, or in the real shape
    a record gives) is refused before its sizes divide anything: no quantizer writes one,
    and a group or block count of 0 has no meaning."""
    for info in parts:
        if 0 in tuple(info.shape):
            raise refuse(info.name, f"a part of {weight} of shape {shown(info.shape)}: empty")
    if 0 in tuple(shape):
        raise refuse(weight, f"a quantized weight of shape {shown(shape)}: empty")


def block_size(value: object, where: str, what: str) -> int:
    """A block or group size from a config: an int in [1, MAX_BLOCK] (bool is no int here)."""
    if type(value) is not int or not 1 <= value <= MAX_BLOCK:
        raise refuse(where, f"{what} {value!r} is not a whole number from 1 to {MAX_BLOCK}")
    return value


def block_sizes(value: object, where: str, what: str, count: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != count:
        raise refuse(where, f"{what} {value!r} is not a list of {count} block sizes")
    return tuple(block_size(v, where, what) for v in value)


def dtype_name(info: TensorInfo) -> str:
    # TensorInfo.dtype_name: cached per dtype (numpy's dtype.name costs ~10 us, and every
    # scheme asks it of every stored tensor: 200,000 tensors, seconds)
    return info.dtype_name


def shown(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_shape(info: TensorInfo, expected: Sequence[int], weight: str, role: str) -> None:
    if tuple(info.shape) != tuple(expected):
        raise refuse(
            info.name,
            f"{role} of shape {shown(info.shape)} does not fit {weight} "
            f"(expected {shown(expected)})",
        )


def check_scale_dtype(info: TensorInfo, allowed: frozenset[str] = EXACT_SCALE_DTYPES) -> None:
    if dtype_name(info) not in allowed:
        raise refuse(
            info.name,
            f"a scale of dtype {dtype_name(info)} is not one clipcli decodes "
            f"({', '.join(sorted(allowed))})",
        )


def method_of(config: Mapping[str, Any] | None) -> str | None:
    """quantization_config's quant_method, or None."""
    if config is None:
        return None
    method = config.get("quant_method")
    return method if isinstance(method, str) else None


def declares_format(config: Mapping[str, Any], fmt: str) -> bool:
    """Whether a compressed-tensors config stores some weights as `fmt`: its own `format`,
    or that of one of its config_groups."""
    if config.get("format") == fmt:
        return True
    groups = config.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and g.get("format") == fmt for g in groups.values()
    )


def widened(array: np.ndarray) -> np.ndarray:
    """A scale array as float64, exactly (an fp8 or E8M0 scale through its value table)."""
    import numpy as np

    from clipcli.dtypes import float64_values, is_small_float

    if is_small_float(array.dtype) and array.dtype.itemsize == 1:
        return float64_values(array.dtype)[array.view(np.uint8)]
    with np.errstate(invalid="ignore"):
        return array.astype(np.float64)


def code_values(codes: np.ndarray) -> np.ndarray:
    """fp8 codes as float64, through the table of all 256 values (NaN codes stay NaN)."""
    import numpy as np

    from clipcli.dtypes import float64_values

    return float64_values(codes.dtype)[codes.view(np.uint8)]


# e2m1 (FP4), by code: 0-7 positive, 8-15 their negatives (OCP MX; NVFP4 uses the same).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp4_low_first(packed: np.ndarray) -> np.ndarray:
    """Bytes [rows, n] holding two e2m1 codes each, low nibble = even element, as float64
    values [rows, 2n]."""
    import numpy as np

    table = np.array(E2M1, dtype=np.float64)
    raw = packed.view(np.uint8)
    out = np.empty((raw.shape[0], raw.shape[1] * 2), dtype=np.float64)
    out[:, 0::2] = table[raw & 0x0F]
    out[:, 1::2] = table[raw >> 4]
    return out


def e8m0_values(codes: np.ndarray) -> np.ndarray:
    """E8M0 exponents (uint8 or float8_e8m0fnu bytes) as float64: 2**(s - 127), 0xFF NaN
    (OCP MX)."""
    import numpy as np

    looked_up: np.ndarray = _e8m0_table()[codes.view(np.uint8)]
    return looked_up


@functools.cache
def _e8m0_table() -> np.ndarray:
    """The 256 E8M0 values (np.ldexp with an int64 array of exponents costs ~1 us an
    element; a lookup, a nanosecond)."""
    import numpy as np

    table = np.ldexp(1.0, np.arange(256, dtype=np.int64) - 127)
    table[0xFF] = np.nan
    table.flags.writeable = False
    return table


E8M0_NAN = 0xFF


def lower_e8m0_exponents(chunk: np.ndarray, mantissa: float, exponent: int) -> np.ndarray:
    """E8M0 scale bytes (uint8 or float8_e8m0fnu) for the factor mantissa * 2**exponent
    rounded down to 2**-k: each byte s >= k becomes s - k (its value times 2**-k, exactly);
    a byte below k and the NaN byte 0xFF stay as they are: the view refuses a clip that
    would need them moved (QuantizedView.refused_factor)."""
    import numpy as np

    from clipcli.numerics.rounding import power_of_two_steps

    steps = power_of_two_steps(mantissa, exponent)
    raw = np.ascontiguousarray(chunk).view(np.uint8)
    movable = (raw >= steps) & (raw != E8M0_NAN)
    lowered = np.where(movable, raw.astype(np.int64) - steps, raw).astype(np.uint8)
    return lowered.view(chunk.dtype).reshape(chunk.shape)


def halve_float_scales(chunk: np.ndarray, mantissa: float, exponent: int) -> np.ndarray:
    """Float scales that must stay powers of two (block FP8 with scale_fmt "ue8m0" in
    float32: the kernels that run them read only the exponent) times the factor rounded
    down to 2**-k, exactly wherever the result is a normal number of the chunk's dtype
    (the view refuses a clip that would leave one that is not: refused_factor)."""
    import numpy as np

    from clipcli.numerics.rounding import power_of_two_steps

    steps = power_of_two_steps(mantissa, exponent)
    with np.errstate(all="ignore"):
        moved: np.ndarray = np.ldexp(chunk, -steps).astype(chunk.dtype)
    return moved


def measured_through(
    code_tables: Callable[..., tuple[np.ndarray, np.ndarray] | None],
) -> Callable[..., NormAccumulator | None]:
    """A scheme's measure_rows from its code_tables: the statistics of real rows [start,
    stop), as NormAccumulator.add gives them for decode_rows' values, through the
    scheme's tables; None where they do not pay (decoded)."""

    def measure_rows(
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
    ) -> NormAccumulator | None:
        from clipcli.numerics import coded

        tables = code_tables(weight, codes, start, stop, small)
        return None if tables is None else coded.table_statistics(*tables)

    return measure_rows
