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


def group_order(name: str) -> tuple[bool, NaturalKey]:
    """Groups in natural name order, with the tensors that matched no group last."""
    return name == OTHER_GROUP, natural_key(name)


_DIGITS = re.compile(r"([0-9]+)")
