"""markers.may_hold_quantized searches every marker once through all names joined (a
checkpoint of 200,000 names: milliseconds): it must answer as a name-by-name search does,
and never say no where that one says yes (a name holding a newline may only make it say
yes more often, which costs a look, never a missed quantized weight)."""

from __future__ import annotations

import itertools

from clipcli.logical.quantized.markers import END_MARKERS, MARKERS, may_hold_quantized


def one_by_one(names: list[str]) -> bool:
    return any(any(m in name for m in MARKERS) or name.endswith(END_MARKERS) for name in names)


def test_joined_search_answers_as_name_by_name() -> None:
    pieces = ["model.layers.0", ".weight", "_scale_inv", "_blocks", ".0", "down_blocks", "x"]
    pieces += [m[: len(m) // 2] for m in (*MARKERS, *END_MARKERS)]  # halves: no marker alone
    pieces += [m[len(m) // 2 :] for m in (*MARKERS, *END_MARKERS)]
    names = ["".join(p) for p in itertools.product(pieces, repeat=2)]
    for i in range(0, len(names), 7):
        group = names[i : i + 7]
        assert may_hold_quantized(group) == one_by_one(group)
        assert may_hold_quantized(iter(group)) == one_by_one(group)  # any iterable
    for name in names:  # a marker cut in two across neighbours is not found
        assert may_hold_quantized([name]) == one_by_one([name])
    assert not may_hold_quantized([])
    assert not may_hold_quantized(["a_sc", "ale_inv", "x_blo", "cks"])


def test_a_newline_in_a_name_never_hides_a_marker() -> None:
    for names in (["a\n_scale_inv"], ["x_blocks\ny"], ["a_blocks", "b\n"], ["\n", "c.SCB"]):
        assert may_hold_quantized(names) or not one_by_one(names)
        if one_by_one(names):
            assert may_hold_quantized(names)
