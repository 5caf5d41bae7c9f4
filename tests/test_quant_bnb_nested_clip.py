"""Issue 21: clip of a bitsandbytes 4-bit weight whose absmax is nested with a nonzero
nested_offset. absmax[b] = nested_map[q[b]] * nested_absmax[b // nb] + nested_offset in
float32 (bitsandbytes: dequantize_blockwise, then `absmax += offset`, the offset read by
QuantState.from_dict as float(json) in a float32 tensor). A clip by f scales
nested_absmax (float32) and rewrites nested_offset inside the JSON quant state, in place:
same length, same key order, every other byte kept.

The fixtures come from an encoder written here from bitsandbytes' published layout (high
nibble first, JSON via json.dumps as bitsandbytes' pack_dict_to_tensor writes it); the
reference decodes what was written with json.loads (bitsandbytes' own parser),
numpy float32 scalars for bitsandbytes' float32 steps, and Fractions for the sum of squares.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_int_reference import exact_sqrt
from safetensors.numpy import load_file, save_file

from clipcli.errors import DataRefusedError
from clipcli.logical.quantized import bnb

STATE = "m.weight.quant_state.bitsandbytes__nf4"
KEPT = ("m.weight", "m.weight.absmax", "m.weight.quant_map", "m.weight.nested_quant_map")


def encode(offset_text: str, seed: int = 5, shape: tuple[int, int] = (8, 12)) -> dict[str, Any]:
    """A nested nf4 weight: blocks of 4, nested blocks of 3, the quant state's JSON with
    nested_offset written as `offset_text`."""
    rng = random.Random(seed)
    count = shape[0] * shape[1]
    nibbles = [rng.randint(0, 15) for _ in range(count)]
    packed = bytes(
        (nibbles[k] << 4) | (nibbles[k + 1] if k + 1 < count else 0) for k in range(0, count, 2)
    )
    blocks = -(-count // 4)
    state = (
        '{"quant_type": "nf4", "blocksize": 4, "dtype": "bfloat16", "shape": '
        f'[{shape[0]}, {shape[1]}], "nested_blocksize": 3, "nested_offset": {offset_text}, '
        '"nested_dtype": "float32"}'
    )
    return {
        "m.weight": np.frombuffer(packed, np.uint8).reshape(-1, 1),
        "m.weight.absmax": np.array([rng.randint(0, 255) for _ in range(blocks)], np.uint8),
        "m.weight.quant_map": np.array([rng.uniform(-1, 1) for _ in range(16)], np.float32),
        "m.weight.nested_absmax": np.array(
            [rng.uniform(0.2, 2) for _ in range(-(-blocks // 3))], np.float32
        ),
        "m.weight.nested_quant_map": np.array([rng.uniform(-1, 1) for _ in range(256)], np.float32),
        STATE: np.frombuffer(state.encode(), np.uint8),
    }


def real_values(arrays: dict[str, Any]) -> list[Fraction]:
    """The weight's values as bitsandbytes computes them, each an exact Fraction."""
    state = json.loads(bytes(arrays[STATE]).decode("utf-8"))
    offset = np.float32(float(state["nested_offset"]))
    codes = bytes(arrays["m.weight"].reshape(-1))
    count = math.prod(state["shape"])
    nested_map = arrays["m.weight.nested_quant_map"]
    nested_absmax = arrays["m.weight.nested_absmax"]
    absmax = [
        np.float32(nested_map[q] * nested_absmax[b // state["nested_blocksize"]]) + offset
        for b, q in enumerate(arrays["m.weight.absmax"].tolist())
    ]
    values = []
    for k in range(count):
        nibble = codes[k // 2] >> 4 if k % 2 == 0 else codes[k // 2] & 0x0F
        scale = absmax[k // state["blocksize"]]
        code = Fraction(float(arrays["m.weight.quant_map"][nibble]))
        values.append(code * Fraction(float(scale)))
    return values


def sumsq(values: list[Fraction]) -> Fraction:
    return sum((v * v for v in values), Fraction(0))


def norm_up(exact: Fraction) -> float:
    """The least float64 whose square is at or above `exact`."""
    up = exact_sqrt(exact)
    while Fraction(up) ** 2 < exact:
        up = math.nextafter(up, math.inf)
    while Fraction(math.nextafter(up, 0)) ** 2 >= exact:
        up = math.nextafter(up, 0)
    return up


def offset_span(text: str) -> tuple[int, int]:
    """Where nested_offset's number and the spaces after it lie in the JSON."""
    start = text.index('"nested_offset": ') + len('"nested_offset": ')
    end = text.index(", ", start)
    return start, end


# A real file's offset: json.dumps of a float32 mean read back as a Python float (long).
REAL_OFFSET = repr(float(np.float32(0.0371)))


@pytest.mark.parametrize("offset_text", [REAL_OFFSET, "0.0371", "-0.25"])
@pytest.mark.parametrize("where", ["above", "at", "just-below", "far-below"])
def test_clip_scales_nested_absmax_and_the_offset(
    tmp_path: Path, run_main: Any, where: str, offset_text: str
) -> None:
    arrays = encode(offset_text)
    src, out = tmp_path / "q.safetensors", tmp_path / "o.safetensors"
    save_file(arrays, str(src))
    exact = sumsq(real_values(arrays))
    up = norm_up(exact)
    limit = {
        "above": up * 2,
        "at": up,
        "just-below": math.nextafter(math.nextafter(up, 0), 0),
        "far-below": up / 1000,
    }[where]
    result = run_main("clip", "--global", repr(limit), src, out, "-q")
    assert result.code == 0, result.stderr
    written = load_file(str(out))
    for name in KEPT:  # codes, absmax codes, maps: byte for byte
        assert written[name].tobytes() == arrays[name].tobytes(), name
    after = sumsq(real_values(written))
    assert after <= Fraction(limit) ** 2  # the promise, exactly, on what was written
    before_text = bytes(arrays[STATE]).decode()
    after_text = bytes(written[STATE]).decode()
    assert len(after_text) == len(before_text)
    if where in ("above", "at"):
        assert written[STATE].tobytes() == arrays[STATE].tobytes()
        assert written["m.weight.nested_absmax"].tobytes() == (
            arrays["m.weight.nested_absmax"].tobytes()
        )
        return
    start, end = offset_span(before_text)
    assert after_text[:start] == before_text[:start]  # every other byte as it was
    assert after_text[end:] == before_text[end:]
    before_state, after_state = json.loads(before_text), json.loads(after_text)
    assert list(after_state) == list(before_state)  # key order
    assert {**before_state, "nested_offset": after_state["nested_offset"]} == after_state
    ratio = Fraction(json_reads(after_state["nested_offset"])) / Fraction(
        json_reads(before_state["nested_offset"])
    )  # as float32, what bitsandbytes reads (a shorter text may read as the same float32)
    assert 0 < ratio <= 1  # the offset scaled with the weight, same sign
    if offset_text == REAL_OFFSET:  # room for the exact float32 product: tight
        assert after >= (Fraction(limit) * Fraction(999_99, 100_000)) ** 2
    else:
        assert after >= Fraction(limit) ** 2 / 4
    again = run_main("norms", "--format", "json", out)  # clipcli reads the padded JSON
    assert again.code == 0, again.stderr
    assert json.loads(again.stdout)["global_norm"] == pytest.approx(exact_sqrt(after), rel=1e-12)


def test_a_clipped_output_clips_again(tmp_path: Path, run_main: Any) -> None:
    """The spaces a first clip left after the number are room for the second."""
    arrays = encode("0.0371")
    src, mid, out = (tmp_path / n for n in ("q.safetensors", "m.safetensors", "o.safetensors"))
    save_file(arrays, str(src))
    norm = exact_sqrt(sumsq(real_values(arrays)))
    assert run_main("clip", "--global", repr(norm / 3), src, mid, "-q").code == 0
    assert run_main("clip", "--global", repr(norm / 300), mid, out, "-q").code == 0
    written = load_file(str(out))
    assert sumsq(real_values(written)) <= Fraction(norm / 300) ** 2
    assert len(written[STATE]) == len(arrays[STATE])


@pytest.mark.parametrize(
    ("state_text", "why"),
    [
        (  # json.loads takes the last of two keys: which one to rewrite is not certain
            '{"quant_type": "nf4", "blocksize": 4, "dtype": "bfloat16", "shape": [8, 12], '
            '"nested_blocksize": 3, "nested_offset": 0.5, "nested_offset": 0.0371}',
            "occurs 2 times",
        ),
        (  # an escaped key: the text "nested_offset" is not there
            '{"quant_type": "nf4", "blocksize": 4, "dtype": "bfloat16", "shape": [8, 12], '
            '"nested_blocksize": 3, "nested\\u005foffset": 0.0371}',
            "occurs 0 times",
        ),
    ],
)
def test_an_offset_that_cannot_be_found_is_refused(
    tmp_path: Path, run_main: Any, state_text: str, why: str
) -> None:
    arrays = encode("0.0371")
    arrays[STATE] = np.frombuffer(state_text.encode(), np.uint8)
    src, out = tmp_path / "q.safetensors", tmp_path / "o.safetensors"
    save_file(arrays, str(src))
    result = run_main("clip", "--global", "0.001", src, out)
    assert result.code == 4, result.stderr
    (line,) = result.stderr.splitlines()
    assert "m.weight: its absmax is nested with nested_offset" in line
    assert why in line
    assert not out.exists()
    assert run_main("norms", src, "-q").code == 0  # measured all the same


def test_an_offset_without_room_for_the_scaled_number_is_refused(
    tmp_path: Path, run_main: Any
) -> None:
    """An integer offset "1" has one character: 1/1000 of it cannot be written there."""
    arrays = encode("1")
    src, out = tmp_path / "q.safetensors", tmp_path / "o.safetensors"
    save_file(arrays, str(src))
    norm = exact_sqrt(sumsq(real_values(arrays)))
    result = run_main("clip", "--global", repr(norm / 1000), src, out)
    assert result.code == 4, result.stderr
    (line,) = result.stderr.splitlines()
    assert "does not fit the 1 characters" in line
    assert not out.exists()


def test_value_mode_is_still_refused(tmp_path: Path, run_main: Any) -> None:
    arrays = encode(REAL_OFFSET)
    src, out = tmp_path / "q.safetensors", tmp_path / "o.safetensors"
    save_file(arrays, str(src))
    result = run_main("clip", "--value", "0.1", src, out)
    assert result.code == 4
    assert "not linear" in result.stderr
    assert not out.exists()


def json_reads(number: str | float) -> float:
    """What bitsandbytes makes of a JSON number: float(), then a float32 tensor."""
    value = json.loads(number) if isinstance(number, str) else number
    return float(np.float32(float(value)))


@pytest.mark.parametrize("value", [0.0172, -3.5e-7, 1.0e-38, 12345.678, 0.5])
def test_the_number_written_at_and_past_its_room(value: float) -> None:
    target = float(np.float32(value))
    shortest = bnb._number_within(target, 64)
    assert json_reads(shortest) == target
    # exactly at the room: the exact number; one past (a character less): a shorter one
    assert bnb._number_within(target, len(shortest)) == shortest
    try:
        shorter = bnb._number_within(target, len(shortest) - 1)
    except DataRefusedError:  # no decimal of fewer digits fits (0.5 in 2 characters)
        assert len(shortest) <= 5
        return
    assert len(shorter) <= len(shortest) - 1
    read = json_reads(shorter)
    assert read != target
    assert math.isfinite(read)
    assert math.copysign(1, read) == math.copysign(1, target)


def test_no_room_at_all_is_a_refusal() -> None:
    with pytest.raises(DataRefusedError, match="does not fit the 2 characters"):
        bnb._number_within(float(np.float32(0.0172)), 2)
