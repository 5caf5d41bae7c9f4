"""The natural name order (jobs/groups.natural_key, the default --sort of every report):
digit runs compare as numbers, then by their length with leading zeros (`a1` before
`a01`), text as text. Checked against a reference written apart from it: each name cut
into ASCII digit runs by hand, the runs compared as Python ints (no digit limit).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import numpy as np
import pytest

from clipcli.jobs.groups import (
    NATURAL_ORDER_BLOCK,
    natural_key,
    natural_order,
    packed_natural_key,
)
from clipcli.report.builders import ordered, ordered_positions
from clipcli.report.model import SortKey


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


@pytest.mark.parametrize("count", [0, 1, 4096, 4097, 9000])
@pytest.mark.parametrize("long_at", [None, 0, 8999])
def test_natural_order_is_the_stable_sort_by_natural_key(count: int, long_at: int | None) -> None:
    """natural_order (fixed-width packed keys past a block of names, tuple keys below it
    or where one long name would widen every key, wherever it stands) against sorted()
    by natural_key: the same positions, repeated names in their own order."""
    rng = np.random.default_rng(count)
    alphabet = ["a", ".", "0", "1", "7", "\x00", "\x01", "é", "\ud800", "\U0010ffff", "漢"]
    names = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 7)))) for _ in range(count)]
    names[: count // 10] = [f"layers.{k % 12}.w" for k in range(count // 10)]  # repeats
    if long_at is not None and long_at < count:
        names[long_at] = "x" + "1" * 3000  # its digits are kept (leading zeros are not)
    expected = sorted(range(count), key=lambda k: natural_key(names[k]))
    found = natural_order(count, names.__getitem__)
    assert list(found) == expected
    fixed = count > NATURAL_ORDER_BLOCK and (long_at is None or long_at >= count)
    assert isinstance(found, array) == fixed


@pytest.mark.parametrize("sort", list(SortKey))
@pytest.mark.parametrize("top", [None, 0, 1, 4097, 10**6])
def test_clip_report_positions_are_the_ordered_rows(sort: SortKey, top: int | None) -> None:
    """ordered_positions (clip's report: packed keys, positions in an array) gives what
    ordered gives of range(count), for every --sort and --top: ties in norm and size
    broken by name, NaN and figures that do not apply after every number."""
    rng = np.random.default_rng(5)
    count = 6000
    names = [f"layers.{int(k)}.w{'é' if k % 3 else ''}" for k in rng.integers(0, 900, count)]
    norms = [
        None if k % 17 == 0 else float("nan") if k % 13 == 0 else float(k % 50)
        for k in range(count)
    ]
    counted = [bool(k % 5) for k in range(count)]
    sizes = [int(k % 7) * 4 for k in range(count)]
    figures = (names.__getitem__, norms.__getitem__, counted.__getitem__, sizes.__getitem__)
    expected = ordered(range(count), sort, top, *figures)
    assert list(ordered_positions(count, sort, top, *figures)) == expected
