"""Tensor groups for --group-by and natural name order: pure functions of names."""

from __future__ import annotations

import re
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
    spell them), with NUL and \x01 escaped as \x01\x01 and \x01\x02 so that the NUL
    ending each text sorts below every character: a text that is a prefix of another
    sorts first, as in the tuple. A run is its digit count, its digits and its length,
    each count as one byte of size then big-endian bytes (larger numbers sort later)."""
    parts = _DIGITS.split(name)
    packed = []
    for position, part in enumerate(parts):
        if position % 2 == 0:
            text = part.encode("utf-8", "surrogatepass")
            packed.append(text.replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01"))
            packed.append(b"\x00")
        else:
            digits = part.lstrip("0")
            packed += (_packed_count(len(digits)), digits.encode("ascii"), _packed_count(len(part)))
    return b"".join(packed)


def _packed_count(n: int) -> bytes:
    size = (n.bit_length() + 7) // 8
    return bytes((size,)) + n.to_bytes(size, "big")


def group_order(name: str) -> tuple[bool, NaturalKey]:
    """Groups in natural name order, with the tensors that matched no group last."""
    return name == OTHER_GROUP, natural_key(name)


_DIGITS = re.compile(r"([0-9]+)")
