"""Tensor groups for --group-by and natural name order: pure functions of names."""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from clipcli.errors import UsageError

# `--group-by layer`: one alternative per layout (FORMATS.md, "Layouts met in real
# checkpoints"); the first that matches names the group. Anchored ones come first.
LAYER_PRESET = (
    # legacy Keras full model: model_weights/dense_1/dense_1/kernel:0 -> dense_1
    r"^model_weights/([^/]+)/"
    # Keras 3, flat and nested: layers/dense/vars/0 -> dense,
    # block1/layers/conv2d/vars/0 -> block1/layers/conv2d
    r"|^(?:layers/)?((?:[^/]+/)*?[^/]+)/vars/\d+$"
    # Keras 2 save_weights: dense_1/dense_1/kernel:0 at the root -> dense_1
    r"|^([^/]+)/.+:\d+$"
    # HF/PyTorch: model.layers.3.mlp..., transformer.h.3..., encoder.layer.3..., blocks.3...
    r"|^(.*?\b(?:layers|layer|blocks|block|h)[._/]\d+)(?=[._/])"
)
OTHER_GROUP = "(other)"


def compile_group_by(text: str) -> re.Pattern[str]:
    """The --group-by regex ('layer' is the built-in preset); a bad regex is a usage error."""
    try:
        return re.compile(LAYER_PRESET if text == "layer" else text)
    except re.error as exc:
        raise UsageError(f"--group-by {text!r} is not a valid regex: {exc}") from None


def group_key(name: str, pattern: re.Pattern[str]) -> str:
    """The first capture group that matched, else the whole match; OTHER_GROUP if none."""
    match = pattern.search(name)
    if match is None:
        return OTHER_GROUP
    for captured in match.groups():
        if captured is not None:
            return captured
    return match.group(0)


NaturalKey = tuple[str | tuple[int, str, int], ...]


def natural_key(name: str) -> NaturalKey:
    """Sort key that compares digit runs as numbers: layers.2 before layers.10.

    A run is compared by (digit count without leading zeros, those digits, full length),
    which orders numbers of any length without int(): Python refuses to convert more than
    4300 digits, and a tensor name is data that may hold a 5,000-digit layer number. Only
    ASCII digits form runs; '²' or '٣' stay text. split() with one group alternates text
    (even positions) and runs (odd positions), so equal positions always hold equal types.
    """
    key: list[Any] = _DIGITS.split(name)
    for position in range(1, len(key), 2):  # the runs, replaced in place
        run = key[position]
        digits = run.lstrip("0")
        key[position] = (len(digits), digits, len(run))
    return tuple(key)


def packed_natural_key(name: str) -> bytes:
    """natural_key packed into bytes that sort the same way, in about a third of the
    memory (a report sorts all its names at once: 200,000 tuple keys were ~36 MB).

    Text is UTF-8 (whose byte order is code point order; lone surrogates as UTF-8 would
    spell them; no byte of a multi-byte character is an ASCII digit, so the runs are cut
    as in the text), with NUL and \x01 escaped as \x01\x01 and \x01\x02 so that the
    NUL ending each text sorts below every character: a text that is a prefix of another
    sorts first, as in the tuple. A run is its digit count, its digits and its length,
    each count as one byte of size then big-endian bytes (larger numbers sort later)."""
    raw = name.encode("utf-8", "surrogatepass")
    if b"\x00" in raw or b"\x01" in raw:
        raw = raw.replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01")
    parts = _DIGIT_BYTES.split(raw)  # text, run, text, ..., text
    for position in range(1, len(parts), 2):
        run = parts[position]
        digits = run.lstrip(b"0")
        # The NUL that ends the text before the run, then the run.
        parts[position] = b"\x00" + _packed_count(len(digits)) + digits + _packed_count(len(run))
    parts.append(b"\x00")  # the end of the last text
    return b"".join(parts)


def _packed_count(n: int) -> bytes:
    if n < 256:
        return _SMALL_COUNTS[n]
    size = (n.bit_length() + 7) // 8
    return bytes((size,)) + n.to_bytes(size, "big")


_SMALL_COUNTS = (b"\x00", *(bytes((1, n)) for n in range(1, 256)))
_DIGIT_BYTES = re.compile(rb"([0-9]+)")


# natural_order packs keys this many names at a time; fewer names are sorted by their
# tuple keys.
NATURAL_ORDER_BLOCK = 4096
# ... and sorts them as fixed-width byte strings while the widest key is at most this many
# bytes longer than the mean: a bytes object costs about that much more than its bytes.
FIXED_WIDTH_SLACK = 80


def natural_order(count: int, name: Callable[[int], str]) -> Sequence[int]:
    """The positions 0 .. count-1 in natural order of name(position), stable.

    The packed keys are made a block at a time into numpy fixed-width byte strings and
    sorted there: 200,000 short names' tuple keys, with the int of each position, were
    ~40 MB at once; as fixed-width strings they are ~3 MB, for ~1 us more a name. numpy
    compares them as unsigned bytes padded with NULs, which orders packed keys as Python
    does: two keys never differ by trailing NULs alone (a key that goes on past another
    holds a run's length, never zero). For a few names, where one long name would make
    every key as long, and where numpy is not loaded, the tuple keys are sorted as Python
    objects: the same order."""
    if count > NATURAL_ORDER_BLOCK and "numpy" in sys.modules:
        order = _fixed_width_order(count, name)
        if order is not None:
            return order
    return sorted(range(count), key=lambda k: natural_key(name(k)))


def _fixed_width_order(count: int, name: Callable[[int], str]) -> Sequence[int] | None:
    import numpy as np

    blocks = []
    total = widest = 0  # bytes of the keys so far, of the longest
    for start in range(0, count, NATURAL_ORDER_BLOCK):
        stop = min(count, start + NATURAL_ORDER_BLOCK)
        keys = [packed_natural_key(name(k)) for k in range(start, stop)]
        total += sum(map(len, keys))
        widest = max(widest, *map(len, keys))
        if widest > total / stop + FIXED_WIDTH_SLACK:
            return None  # checked before the block's array is made as wide
        blocks.append(np.array(keys, dtype=np.bytes_))
    order = array("q")
    order.frombytes(np.argsort(np.concatenate(blocks), kind="stable").astype(np.int64).tobytes())
    return order


def group_order(name: str) -> tuple[bool, NaturalKey]:
    """Groups in natural name order, with the tensors that matched no group last."""
    return name == OTHER_GROUP, natural_key(name)


_DIGITS = re.compile(r"([0-9]+)")
