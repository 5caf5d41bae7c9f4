"""bitsandbytes: 4-bit nf4/fp4 (nested absmax too) and LLM.int8 (quant_method
"bitsandbytes").

4-bit: `X.weight` holds the codes of the flattened weight, two to a byte, the HIGH nibble
first (element 2k is byte k's high nibble); its dtype may be any (`quant_storage`), so the
weight is recognised by its companions: `X.weight.quant_state.bitsandbytes__nf4` (or
`__fp4`), a U8 tensor holding JSON (quant_type, blocksize, dtype, shape, and for nested
absmax nested_blocksize and nested_offset); `X.weight.absmax` [ceil(n / blocksize)];
`X.weight.quant_map` F32 [16]. W[k] = quant_map[nibble k] * absmax[k // blocksize], a
float64 exactly. Nested: `absmax` is U8 codes with `X.weight.nested_absmax` F32 and
`X.weight.nested_quant_map` F32 [256], absmax[b] = nested_map[a[b]] *
nested_absmax[b // nested_blocksize] + nested_offset, computed in float32 as bitsandbytes
computes it (the absmax its kernels use), then widened exactly. The offset is read from
the quant state's bytes each time they are decoded (QuantState.from_dict: float(...) as a
float32 tensor), so the values checked after a clip are those of the bytes written.

A clip by f scales nested_absmax (rounded in float32, as any scale) and nested_offset,
whose number is rewritten inside the JSON in place (stored_scaler): the same key order and
every other byte kept, the new number padded with JSON whitespace to the old length (json
.loads, bitsandbytes' own parser, reads it alike). Its text is the shortest that reads
back as f * offset rounded to float32; where even that is longer than the old number, the
nearest shorter decimal is written, and the factor search checks the values it gives.

LLM.int8: `X.weight` I8 [out, in] + `X.SCB` F32 [out]; W = q * SCB[row] / 127, rounded
once to float64 (the one value here that is not a float64 exactly: a relative error of
2^-53 per value). An `X.weight_format` other than 0 (row-major) is refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import intcodes, rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("bnb-nf4", "bnb-fp4", "bnb-int8")
METHOD = "bitsandbytes"
STATE = ".quant_state.bitsandbytes__"
QUANT_TYPES = ("nf4", "fp4")
MAX_STATE_BYTES = 1 << 16  # the JSON is ~200 bytes; a larger one is not read
MAX_RANK = 8
MAX_DIM = 1 << 40
FLOAT32 = frozenset({"float32"})
# The dtypes a bitsandbytes quant state names (its QuantState.as_dict: str(torch dtype)).
STATE_DTYPES = frozenset({"float16", "bfloat16", "float32"})
OFFSET_KEY = '"nested_offset"'
# The key, the colon, and a JSON number (RFC 8259), then the whitespace after it: the span
# a clip rewrites. Only where the key's text occurs exactly once.
OFFSET_FIELD = re.compile(
    r'"nested_offset"[ \t\n\r]*:[ \t\n\r]*'
    r"(?P<number>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)(?P<space>[ \t\n\r]*)"
)
JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,
) -> list[Recognised]:
    if config is not None and rules.method_of(config) != METHOD:
        return []
    found = []
    for name, info in stored.items():
        head, sep, kind = name.rpartition(STATE)
        # "X.weight" or the root module's "weight" (rules.module_prefix)
        if sep and rules.module_prefix(head, "weight") is not None:
            if read is None:
                raise rules.refuse(name, "the real shape is stored as data and was not read")
            found.append(_four_bit(head, kind, info, stored, read))
            continue
        module = rules.module_prefix(name, "weight")
        if module is not None and module + "SCB" in stored:
            found.append(_int8(name, module, info, stored, read))
    return found


def _state(info: TensorInfo, kind: str, read: ReadSmall) -> dict[str, Any]:
    """The JSON quant state, size-checked before it is read, type-checked after."""
    if kind not in QUANT_TYPES:
        raise rules.refuse(info.name, f"bitsandbytes quant type {kind!r} is not nf4 or fp4")
    intcodes.check_dtype(info, frozenset({"uint8"}), "bitsandbytes quant state")
    if info.nbytes > MAX_STATE_BYTES:
        raise rules.refuse(
            info.name, f"a quant state of {info.nbytes} bytes (more than {MAX_STATE_BYTES})"
        )
    try:
        state = json.loads(read(info.name).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise rules.refuse(info.name, f"the quant state is not JSON ({error})") from None
    if not isinstance(state, dict):
        raise rules.refuse(info.name, "the quant state is not a JSON object")
    if state.get("quant_type") != kind:
        raise rules.refuse(
            info.name, f"quant_type {state.get('quant_type')!r} in a {kind} quant state"
        )
    return state


def _shape(state: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = state.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_RANK
        or any(type(d) is not int or not 0 <= d <= MAX_DIM for d in shape)
    ):
        raise rules.refuse(where, f"quant state shape {shape!r} is no real shape")
    return tuple(shape)


def _dtype(state: Mapping[str, Any], where: str) -> str | None:
    """The dtype bitsandbytes dequantizes to, as its quant state says (None when it says
    none): only one it writes, never a guess reported as float32."""
    dtype = state.get("dtype")
    if dtype is None:
        return None
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in STATE_DTYPES:
        raise rules.refuse(
            where,
            f"quant state dtype {dtype!r} is not one bitsandbytes writes "
            f"({', '.join(sorted(STATE_DTYPES))})",
        )
    return dtype.removeprefix("torch.")


def _companion(stored: Mapping[str, TensorInfo], name: str, where: str) -> TensorInfo:
    info = stored.get(name)
    if info is None:
        raise rules.incomplete(where, f"a quant state without its {name}")
    return info


def _four_bit(
    weight: str,
    kind: str,
    state_info: TensorInfo,
    stored: Mapping[str, TensorInfo],
    read: ReadSmall,
) -> Recognised:
    state = _state(state_info, kind, read)
    where = state_info.name
    shape = _shape(state, where)
    count = math.prod(shape)
    block = intcodes.whole_number(state.get("blocksize"), where, "blocksize", 1, intcodes.MAX_GROUP)
    codes = _companion(stored, weight, where)
    absmax = _companion(stored, weight + ".absmax", where)
    quant_map = _companion(stored, weight + ".quant_map", where)
    rules.check_not_empty(weight, codes, absmax, shape=shape)
    packed = rules.ceil_div(count, 2)
    item = codes.dtype.itemsize
    if (
        codes.nbytes != rules.ceil_div(packed, item) * item
        or len(codes.shape) > 2
        or (len(codes.shape) == 2 and codes.shape[1] != 1)
    ):
        raise rules.refuse(
            weight,
            f"codes of shape {rules.shown(codes.shape)} ({codes.nbytes} bytes) do not hold "
            f"{count} 4-bit values ({packed} bytes) as [n, 1]",
        )
    blocks = rules.ceil_div(count, block)
    intcodes.check_dtype(quant_map, FLOAT32, "quant map")
    rules.check_shape(quant_map, (16,), weight, "quant map")
    parts = [Part(weight, "codes"), Part(absmax.name, "scale"), Part(quant_map.name, "quant_map")]
    params: dict[str, Any] = {
        "block": block,
        "absmax": absmax.name,
        "quant_map": quant_map.name,
        "dtype": _dtype(state, where),
        "nested": None,
        "item": item,
    }
    scaled = [absmax.name]
    nested_absmax = stored.get(weight + ".nested_absmax")
    if nested_absmax is None:
        intcodes.check_dtype(absmax, FLOAT32, "absmax")
        rules.check_shape(absmax, (blocks,), weight, f"absmax for blocks of {block}")
    else:
        nested_map = stored.get(weight + ".nested_quant_map")
        if nested_map is None:
            raise rules.incomplete(
                where, f"a nested absmax without its .nested_quant_map ({weight}.nested_quant_map)"
            )
        nested_block = intcodes.whole_number(
            state.get("nested_blocksize"), where, "nested_blocksize", 1, intcodes.MAX_GROUP
        )
        offset = state.get("nested_offset")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise rules.refuse(where, f"nested_offset {offset!r} is not a number")
        if not math.isfinite(offset):
            raise rules.refuse(where, f"nested_offset {offset!r} is not finite")
        intcodes.check_dtype(absmax, frozenset({"uint8"}), "nested absmax codes")
        rules.check_shape(absmax, (blocks,), weight, f"absmax for blocks of {block}")
        intcodes.check_dtype(nested_absmax, FLOAT32, "nested absmax")
        rules.check_shape(
            nested_absmax, (rules.ceil_div(blocks, nested_block),), weight, "nested absmax"
        )
        intcodes.check_dtype(nested_map, FLOAT32, "nested quant map")
        rules.check_shape(nested_map, (256,), weight, "nested quant map")
        parts += [Part(nested_absmax.name, "scale"), Part(nested_map.name, "quant_map")]
        params["nested"] = (nested_absmax.name, nested_map.name, nested_block, state_info.name)
        scaled = [nested_absmax.name]
        if offset != 0:
            # absmax = map[q] * nested_absmax + offset: a factor scales the offset too, a
            # number rewritten inside the JSON text (stored_scaler), where it can be found.
            why = _offset_unwritable(read(state_info.name).tobytes().decode("utf-8"), offset)
            if why is None:
                scaled.append(state_info.name)
            else:
                params["clip_refused"] = (
                    f"{weight}: its absmax is nested with nested_offset {offset!r} in the JSON "
                    f"quant state {state_info.name}, which a clip cannot rewrite: {why}"
                )
    parts.append(Part(state_info.name, "quant_state"))
    params["scaled"] = scaled
    return Recognised(
        name=weight,
        scheme=f"bnb-{kind}",
        shape=shape,
        codes=weight,
        parts=tuple(parts),
        params=params,
    )


def _int8(
    name: str,
    module: str,
    info: TensorInfo,
    stored: Mapping[str, TensorInfo],
    read: ReadSmall | None,
) -> Recognised:
    scb = stored[module + "SCB"]
    rules.check_not_empty(name, info, scb)
    intcodes.check_dtype(info, frozenset({"int8"}), "LLM.int8 weight")
    if len(info.shape) != 2:
        raise rules.refuse(name, f"LLM.int8 weight of rank {len(info.shape)}, not 2")
    intcodes.check_dtype(scb, FLOAT32, "SCB")
    rules.check_shape(scb, (info.shape[0],), name, "SCB")
    parts = [Part(name, "codes"), Part(scb.name, "scale")]
    layout = stored.get(module + "weight_format")
    if layout is not None:
        if layout.numel != 1 or read is None or int(read(layout.name).reshape(-1)[0]) != 0:
            raise rules.refuse(
                layout.name, "an LLM.int8 weight_format other than 0 (row-major) is not decoded"
            )
        parts.append(Part(layout.name, "format"))
    return Recognised(
        name=name,
        scheme="bnb-int8",
        shape=tuple(info.shape),
        codes=name,
        parts=tuple(parts),
        params={"scb": scb.name, "dtype": None},
    )


def code_rows(weight: Recognised, start: int, stop: int) -> tuple[int, int]:
    if weight.scheme == "bnb-int8":
        return start, stop
    columns = weight.shape[-1]
    item = weight.params["item"]
    first_byte = start * columns // 2
    end_byte = rules.ceil_div(stop * columns, 2)
    return first_byte // item, rules.ceil_div(end_byte, item)


def decode_rows(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> np.ndarray:
    import numpy as np

    params = weight.params
    if weight.scheme == "bnb-int8":
        scb = small[params["scb"]].astype(np.float64)[start:stop, None]
        decoded: np.ndarray = codes.reshape(stop - start, -1).astype(np.float64) * scb / 127
        return decoded
    columns = weight.shape[-1]
    data = np.ascontiguousarray(codes).reshape(-1).view(np.uint8)
    item = codes.dtype.itemsize
    first = start * columns
    elements = np.arange(first, stop * columns, dtype=np.int64)
    byte = elements // 2 - (first // 2 // item) * item
    nibble = np.where(elements % 2 == 0, data[byte] >> 4, data[byte] & 0x0F)
    table = small[params["quant_map"]].astype(np.float64)
    values = table[nibble] * _absmax(params, small)[elements // params["block"]]
    decoded = values.reshape(stop - start, columns)
    return decoded


def _absmax(params: Mapping[str, Any], small: Mapping[str, np.ndarray]) -> np.ndarray:
    """Every block's absmax as float64 (nested: decoded in float32 first, as bitsandbytes
    does)."""
    import numpy as np

    absmax = small[params["absmax"]].reshape(-1)
    if params["nested"] is None:
        return absmax.astype(np.float64)
    nested_absmax, nested_map, nested_block, state = params["nested"]
    offset = _offset_of(small[state])
    blocks = np.arange(absmax.size, dtype=np.int64)
    scaled = (
        small[nested_map].astype(np.float32)[absmax]
        * small[nested_absmax].astype(np.float32)[blocks // nested_block]
    )
    widened: np.ndarray = (scaled + np.float32(offset)).astype(np.float64)
    return widened


def scaled_parts(weight: Recognised) -> list[str]:
    if weight.scheme == "bnb-int8":
        return [weight.params["scb"]]
    return list(weight.params["scaled"])


def stored_scaler(
    weight: Recognised, part: str
) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
    """The quant state of a nested absmax with a nonzero offset: its nested_offset scaled
    in place inside the JSON bytes (scale_offset); None for every other part."""
    nested = weight.params.get("nested")
    if nested is not None and part == nested[3] and part in weight.params["scaled"]:
        return scale_offset
    return None


def _offset_of(state: np.ndarray) -> float:
    """nested_offset as bitsandbytes reads it: the JSON number as a float64, then a float32
    tensor (QuantState.from_dict), widened exactly."""
    import numpy as np

    document = json.loads(np.ascontiguousarray(state).view(np.uint8).tobytes().decode("utf-8"))
    return float(np.float32(float(document["nested_offset"])))


def _offset_unwritable(text: str, offset: float) -> str | None:
    """Why nested_offset's number cannot be rewritten in place in `text`, or None."""
    if text.count(OFFSET_KEY) != 1:
        return f"its key's text occurs {text.count(OFFSET_KEY)} times, not once"
    found = OFFSET_FIELD.search(text)
    if found is None or float(found["number"]) != offset:
        return "its value is not a plain JSON number after the key"
    return None


def scale_offset(chunk: np.ndarray, mantissa: float, exponent: int) -> np.ndarray:
    """The JSON quant state `chunk` (its whole bytes) with nested_offset multiplied by
    mantissa * 2**exponent, rounded to float32 as a scale is (rounding.scale_chunk), and
    written in the old number's place: every other byte as it was, the length too."""
    import numpy as np

    from clipcli.numerics import rounding

    raw = np.ascontiguousarray(chunk).view(np.uint8)
    text = raw.tobytes().decode("utf-8")
    before = json.loads(text)
    # The chunk is the whole state: at most MAX_STATE_BYTES, less than a chunk's bytes.
    if _offset_unwritable(text, before.get("nested_offset")) is not None:
        raise AssertionError("a quant state recognise() found rewritable is not")
    found = OFFSET_FIELD.search(text)
    assert found is not None
    start, end = found.start("number"), found.end("space")
    old = np.array([_offset_of(raw)], np.float32)
    with np.errstate(all="ignore"):
        target = rounding.scale_chunk(old, mantissa, exponent)[0]
    number = _number_within(float(target), end - start)
    rewritten = text[:start] + number.ljust(end - start) + text[end:]
    after = json.loads(rewritten)
    if list(after) != list(before) or {**before, "nested_offset": after["nested_offset"]} != after:
        raise AssertionError("rewriting nested_offset changed more than its value")
    out = np.frombuffer(rewritten.encode("utf-8"), np.uint8)
    if out.size != raw.size:
        raise AssertionError("rewriting nested_offset changed the quant state's length")
    return out.view(chunk.dtype).reshape(chunk.shape).copy()


def _number_within(value: float, room: int) -> str:
    """A JSON number of at most `room` characters that bitsandbytes reads as `value` (a
    float32; read as a float64, then rounded to float32), the shortest such; else the
    closest one with fewer significant digits that reads as a finite float32 of the same
    sign (the factor search checks the values it gives)."""
    import numpy as np

    def reads_as(text: str) -> float:
        return float(np.float32(float(text)))

    def fits(text: str) -> bool:
        if len(text) > room or not JSON_NUMBER.fullmatch(text):
            return False
        read = reads_as(text)
        return math.isfinite(read) and math.copysign(1.0, read) == math.copysign(1.0, value)

    exact = [
        text
        for digits in range(1, 10)
        for text in _decimals(value, digits)
        if JSON_NUMBER.fullmatch(text) and reads_as(text) == value
    ]
    exact += [str(np.float32(value)), repr(value)]
    shortest = min((t for t in exact if JSON_NUMBER.fullmatch(t)), key=len)
    if len(shortest) <= room:
        return shortest
    for digits in range(8, 0, -1):
        for text in _decimals(value, digits):
            if fits(text):
                return text
    from clipcli.errors import DataRefusedError

    raise DataRefusedError(
        f"nested_offset {value!r} does not fit the {room} characters its JSON quant state "
        "holds, and clipcli keeps a stored tensor's length; leave the weight out with --exclude"
    )


def _decimals(value: float, digits: int) -> tuple[str, ...]:
    """`value` rounded to `digits` significant digits, positional and with a compact
    exponent (no '+', no leading zeros: 2.5e-4), each a JSON number."""
    positional = f"{value:.{digits}g}"
    mantissa, _, exponent = f"{value:.{digits - 1}e}".partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    compact = f"{mantissa}e{int(exponent)}"
    return (positional, compact) if "e" not in positional else (compact,)
