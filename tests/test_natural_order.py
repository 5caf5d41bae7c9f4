"""The natural name order (jobs/groups.natural_key, the default --sort of every report):
digit runs compare as numbers, then by their length with leading zeros (`a1` before
`a01`), text as text. Checked against a reference written apart from it: each name cut
into ASCII digit runs by hand, the runs compared as Python ints (no digit limit).
"""

from __future__ import annotations

import sys

import numpy as np

from clipcli.jobs.groups import natural_key


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
