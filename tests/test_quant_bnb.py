"""bitsandbytes 4-bit (nf4, fp4, nested absmax, any quant_storage dtype) and LLM.int8:
recognised by their companions, the JSON quant state checked before it sizes anything,
decoded by rows.

Fixtures pack nibbles high-first with Python integers (bitsandbytes' published layout);
values are compared with Fractions (4-bit: exactly; LLM.int8's q * SCB / 127: correctly
rounded), norms with the exact square root of a Fraction sum of squares."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from quant_int_reference import assert_exact, decode_all, exact_sqrt, infos

from clipcli.errors import ExitCode, InputError
from clipcli.logical.quantized import bnb, intcodes
from clipcli.numerics.norms import accumulate

NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def four_bit(
    shape: tuple[int, ...],
    block: int,
    *,
    kind: str = "nf4",
    storage: Any = np.uint8,
    nested_block: int | None = None,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], list[Fraction]]:
    rng = random.Random(seed)
    count = math.prod(shape)
    nibbles = [rng.randint(0, 15) for _ in range(count)]
    packed = bytearray()
    for k in range(0, count, 2):  # element 2k: the HIGH nibble
        low = nibbles[k + 1] if k + 1 < count else 0
        packed.append((nibbles[k] << 4) | low)
    item = np.dtype(storage).itemsize
    packed += bytes(-len(packed) % item)
    table = np.array(NF4 if kind == "nf4" else [rng.uniform(-1, 1) for _ in range(16)], np.float32)
    blocks = -(-count // block)
    state: dict[str, Any] = {
        "quant_type": kind,
        "blocksize": block,
        "dtype": "bfloat16",
        "shape": list(shape),
    }
    arrays: dict[str, np.ndarray] = {
        "m.weight": np.frombuffer(bytes(packed), dtype=storage).reshape(-1, 1),
        "m.weight.quant_map": table,
    }
    if nested_block is None:
        absmax = np.array([rng.uniform(0.01, 5.0) for _ in range(blocks)], np.float32)
        arrays["m.weight.absmax"] = absmax
        effective = [Fraction(float(a)) for a in absmax]
    else:
        codes = np.array([rng.randint(0, 255) for _ in range(blocks)], np.uint8)
        nested_map = np.array([rng.uniform(-1, 1) for _ in range(256)], np.float32)
        nested_absmax = np.array(
            [rng.uniform(0.1, 3) for _ in range(-(-blocks // nested_block))], np.float32
        )
        offset = 0.0371
        state.update(nested_blocksize=nested_block, nested_offset=offset)
        arrays.update({
            "m.weight.absmax": codes,
            "m.weight.nested_absmax": nested_absmax,
            "m.weight.nested_quant_map": nested_map,
        })  # fmt: skip
        # bitsandbytes' float32 arithmetic: the product of two float32 is exact in float64,
        # rounded once to float32; then the float32 sum with the offset
        effective = []
        for b in range(blocks):
            product = np.float32(
                float(nested_map[codes[b]]) * float(nested_absmax[b // nested_block])
            )
            effective.append(Fraction(float(product + np.float32(offset))))
    arrays[f"m.weight.quant_state.bitsandbytes__{kind}"] = np.frombuffer(
        json.dumps(state).encode(), np.uint8
    )
    reference = [Fraction(float(table[nibbles[k]])) * effective[k // block] for k in range(count)]
    return arrays, reference


def found(arrays: dict[str, np.ndarray], config: dict[str, Any] | None = None) -> Any:
    (weight,) = bnb.recognise(infos(arrays), config, arrays.__getitem__)
    return weight


@pytest.mark.parametrize("step", [1, 2, 5])
def test_nf4_odd_count_partial_block(step: int) -> None:
    arrays, reference = four_bit((5, 13), 16, seed=step)
    weight = found(arrays, {"quant_method": "bitsandbytes"})
    assert weight.name == "m.weight"
    assert weight.shape == (5, 13)
    assert weight.scheme == "bnb-nf4"
    assert bnb.scaled_parts(weight) == ["m.weight.absmax"]
    assert_exact(decode_all(bnb, weight, arrays, step), reference)


@pytest.mark.parametrize("storage", [ml_dtypes.bfloat16, np.float32, np.uint8])
@pytest.mark.parametrize("step", [1, 3])
def test_fp4_any_quant_storage(storage: Any, step: int) -> None:
    arrays, reference = four_bit((3, 11), 8, kind="fp4", storage=storage, seed=1)
    weight = found(arrays)
    assert weight.scheme == "bnb-fp4"
    assert_exact(decode_all(bnb, weight, arrays, step), reference)


@pytest.mark.parametrize("step", [1, 4, 100])
def test_nested_absmax(step: int) -> None:
    arrays, reference = four_bit((6, 10), 4, nested_block=3, seed=2)
    weight = found(arrays)
    # A clip scales nested_absmax and rewrites nested_offset inside the JSON quant state
    # (tests/test_quant_bnb_nested_clip.py).
    assert bnb.scaled_parts(weight) == [
        "m.weight.nested_absmax",
        "m.weight.quant_state.bitsandbytes__nf4",
    ]
    assert "clip_refused" not in weight.params
    assert_exact(decode_all(bnb, weight, arrays, step), reference)


def test_llm_int8() -> None:
    rng = random.Random(3)
    q = np.array([[rng.randint(-127, 127) for _ in range(6)] for _ in range(4)], np.int8)
    scb = np.array([rng.uniform(0.01, 9.0) for _ in range(4)], np.float32)
    arrays: dict[str, np.ndarray] = {
        "m.weight": q,
        "m.SCB": scb,
        "m.weight_format": np.zeros((), np.uint8),
    }
    weight = found(arrays)
    assert weight.scheme == "bnb-int8"
    assert bnb.scaled_parts(weight) == ["m.SCB"]
    reference = [
        Fraction(int(q[i, j])) * Fraction(float(scb[i])) / 127 for i in range(4) for j in range(6)
    ]
    decoded = decode_all(bnb, weight, arrays, 3).reshape(-1)
    assert decoded.tolist() == [float(v) for v in reference]  # each correctly rounded
    exact = exact_sqrt(sum((v * v for v in reference), Fraction(0)))
    assert math.isclose(accumulate([decoded]).norm, exact, rel_tol=4 * 2.0**-53)
    arrays["m.weight_format"] = np.ones((), np.uint8)
    with pytest.raises(InputError, match="weight_format other than 0"):
        found(arrays)


def test_quant_state_size_limit() -> None:
    arrays, _ = four_bit((2, 4), 4)
    name = "m.weight.quant_state.bitsandbytes__nf4"
    text = arrays[name].tobytes()
    at_limit = text[:-1] + b" " * (bnb.MAX_STATE_BYTES - len(text)) + b"}"
    arrays[name] = np.frombuffer(at_limit, np.uint8)
    found(arrays)
    arrays[name] = np.frombuffer(at_limit + b" ", np.uint8)
    with pytest.raises(InputError, match="a quant state of 65537 bytes") as caught:
        found(arrays)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shape": [2, 5]}, r"codes of shape \[4, 1\] \(4 bytes\) do not hold 10"),
        ({"shape": [2, -4]}, "is no real shape"),
        ({"shape": "2x4"}, "is no real shape"),
        ({"shape": [2, 4.0]}, "is no real shape"),
        ({"shape": [1 << 41]}, "is no real shape"),
        ({"blocksize": 0}, "blocksize 0 is not a whole number"),
        ({"blocksize": intcodes.MAX_GROUP + 1}, "blocksize 16777217"),
        ({"blocksize": 3}, r"absmax for blocks of 3 of shape \[2\] does not fit"),
        ({"quant_type": "fp4"}, "quant_type 'fp4' in a nf4 quant state"),
    ],
)
def test_quant_state_is_checked(change: dict[str, Any], message: str) -> None:
    arrays, _ = four_bit((2, 4), 4)
    name = "m.weight.quant_state.bitsandbytes__nf4"
    state = {**json.loads(arrays[name].tobytes()), **change}
    arrays[name] = np.frombuffer(json.dumps(state).encode(), np.uint8)
    with pytest.raises(InputError, match=message):
        found(arrays)


def test_quant_state_that_is_not_json_or_misses_parts() -> None:
    arrays, _ = four_bit((2, 4), 4)
    name = "m.weight.quant_state.bitsandbytes__nf4"
    for text in (b"\xff{", b"[1]", b"[" * 100000):
        broken = dict(arrays)
        broken[name] = np.frombuffer(text, np.uint8)
        with pytest.raises(InputError, match="quant state"):
            found(broken)
    broken = dict(arrays)
    del broken["m.weight.absmax"]
    with pytest.raises(InputError, match="without its m.weight.absmax"):
        found(broken)
    nested, _ = four_bit((2, 8), 4, nested_block=2)
    del nested["m.weight.nested_quant_map"]
    with pytest.raises(InputError, match="without its .nested_quant_map"):
        found(nested)


def test_another_method_is_not_bnb() -> None:
    arrays, _ = four_bit((2, 4), 4)
    assert bnb.recognise(infos(arrays), {"quant_method": "gptq"}, arrays.__getitem__) == []


@pytest.mark.parametrize(
    ("offset", "message"),
    [("Infinity", "is not finite"), ("NaN", "is not finite"), ("true", "is not a number")],
)
def test_nested_offset_is_checked(offset: str, message: str) -> None:
    arrays, _ = four_bit((2, 8), 4, nested_block=2)
    name = "m.weight.quant_state.bitsandbytes__nf4"
    text = (
        arrays[name]
        .tobytes()
        .decode()
        .replace('"nested_offset": 0.0371', f'"nested_offset": {offset}')
    )
    arrays[name] = np.frombuffer(text.encode(), np.uint8)
    with pytest.raises(InputError, match=message):
        found(arrays)
