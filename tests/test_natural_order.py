"""The natural name order (jobs/groups.natural_key, the default --sort of every report):
digit runs compare as numbers, then by their length with leading zeros (`a1` before
`a01`), text as text. Checked against a reference written apart from it: each name cut
into ASCII digit runs by hand, the runs compared as Python ints (no digit limit).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from clipcli.jobs.groups import natural_key, packed_natural_key


def reference_key(name: str) -> tuple[object, ...]:
    parts: list[object] = []
    text, run = "", ""
    for ch in name:
        if ch in "0123456789":
            run += ch
            continue
        if run:
            parts += [text, (int(run), len(run))]
            text, run = "", ""
        text += ch
    if run:
        parts += [text, (int(run), len(run))]
        text = ""
    parts.append(text)
    return tuple(parts)


def test_natural_order_matches_the_reference() -> None:
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        rng = np.random.default_rng(11)
        alphabet = list("ab.0123456789_²٣é")
        names = [
            "",
            "0",
            "00",
            "a",
            "a1",
            "a01",
            "a001",
            "a1b",
            "a10",
            "a9",
            "layers.10",
            "layers.2",
            "1" * 5000,
            "1" * 4999 + "2",
            "0" + "9" * 5000,
        ]
        names += ["".join(rng.choice(alphabet, size=int(rng.integers(0, 12)))) for _ in range(3000)]
        assert sorted(names, key=natural_key) == sorted(names, key=reference_key)
        for name in names:  # the key is rebuilt around the runs, text kept as it is
            assert (
                "".join(
                    p if isinstance(p, str) else "0" * (p[2] - p[0]) + p[1]
                    for p in natural_key(name)
                )
                == name
            )
    finally:
        sys.set_int_max_str_digits(limit)


def _sign(a: Any, b: Any) -> int:
    return int(a > b) - int(a < b)


def test_packed_key_orders_as_the_tuple_key() -> None:
    """packed_natural_key (the report's sort) against natural_key on every pair: the same
    sign of comparison, for texts with NUL, \\x01 and \\x02 (the escapes and the text's
    end), characters past the BMP and U+10FFFF, lone surrogates, prefixes, runs with
    leading zeros and counts that need more than one byte (256 digits, 65,536 digits)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        rng = np.random.default_rng(12)
        alphabet = ["a", "b", ".", "0", "1", "9", "\x00", "\x01", "\x02", "\x7f", "é", "\ud800"]
        alphabet += ["\udfff", "\ue000", "\U0001f600", "\U0010ffff", "²", "\uffff"]
        names = ["", "\x00", "\x01", "\x02", "a", "a\x00", "a\x01", "a\x00b", "a0", "a\x000"]
        names += ["1" * 256, "1" * 255 + "2", "0" + "1" * 256, "9" * 65_536, "1" + "0" * 65_535]
        names += ["x" + "0" * 256 + "1", "x" + "0" * 255 + "1", "layers.10", "layers.2"]
        for _ in range(700):
            size = int(rng.integers(0, 8))
            names.append("".join(rng.choice(alphabet, size=size)))
        tuples = [natural_key(name) for name in names]
        packed = [packed_natural_key(name) for name in names]
        for i in range(len(names)):
            for j in range(len(names)):
                assert _sign(packed[i], packed[j]) == _sign(tuples[i], tuples[j]), (
                    names[i][:20],
                    names[j][:20],
                )
        assert sorted(names, key=packed_natural_key) == sorted(names, key=reference_key)
    finally:
        sys.set_int_max_str_digits(limit)
