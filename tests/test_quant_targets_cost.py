"""Issue 21, fifth attack round, break 1: `re:` targets within every limit on a pattern
(1000 characters, 5000 states, counts 100, nesting 32) took minutes and gigabytes on long
module names: `(?:(?:a{2})*|(?:a{3})*|...|(?:a{97})*)` twice, then `x`, against a name of
100,000 a's, keeps hundreds of states alive at each character, and a lazy DFA cache of
4096 such sets held ~0.5 GB per pattern.

The matching work a config asks for is now counted (targets.Budget: a unit per character
read, the states of each step not remembered) and refused past a budget that grows with
the names and targets (exit 3, one line, naming the target); the remembered steps are
capped by the states they hold. These tests count work and states, never time.

References: Python's `re.match` for every answer that is given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_reference import write_model_directory
from test_quant_config_groups import assert_norm, config, module, norms

from clipcli.errors import InputError
from clipcli.formats.base import TensorInfo
from clipcli.logical.quantized import targets

PRIMES = [p for p in range(2, 101) if all(p % q for q in range(2, int(p**0.5) + 1))]
ALTERNATION = "(?:" + "|".join(f"(?:a{{{p}}})*" for p in PRIMES) + ")"
HOSTILE = ALTERNATION + ALTERNATION + "x"  # the attacker's pattern, 549 characters


def remembered(compiled: targets.Pattern) -> int:
    """The states a pattern's remembered steps hold."""
    return sum(len(step) for step in compiled._steps.values())


def used(pattern: str, names: list[str]) -> tuple[int, list[bool]]:
    """The work a fresh automaton spends matching `names`, and its answers."""
    compiled, budget = targets.Pattern(pattern), targets.Budget(10**12)
    answers = [compiled.match(name, budget) for name in names]
    return budget.limit - budget.left, answers


def test_the_hostile_pattern_is_within_the_pattern_limits() -> None:
    """The attack needs no limit broken: the budget, not a pattern limit, stops it."""
    assert len(HOSTILE) <= targets.MAX_PATTERN
    targets.Pattern(HOSTILE)  # read


# Python's `re` would backtrack for hours on the hostile pattern without an "x": its
# answers are worked out (299 = 13 x 23 a's, 6 = 2 x 3) and checked by `re` where short.
@pytest.mark.parametrize(
    ("pattern", "names", "answers"),
    [
        (HOSTILE, ["a" * 300, "a" * 299 + "x", "a" * 6 + "x"], [False, True, True]),
        (r".*q_proj", ["model.layers.0.self_attn.q_proj", "x" * 500], [True, False]),
        (r"(a+)+$", ["a" * 200, "ab"], [True, False]),
    ],
)
def test_a_budget_of_exactly_the_work_answers_and_one_less_refuses(
    pattern: str, names: list[str], answers: list[bool]
) -> None:
    for name, answer in zip(names, answers, strict=True):
        assert "x" not in name or answer is (re.match(pattern, name) is not None)
    work, given = used(pattern, names)
    assert given == answers
    compiled, exact = targets.Pattern(pattern), targets.Budget(work)
    assert [compiled.match(n, exact) for n in names] == answers
    assert exact.left == 0
    compiled, short = targets.Pattern(pattern), targets.Budget(work - 1)
    for name in names[:-1]:
        compiled.match(name, short)
    with pytest.raises(targets.OverBudget):
        compiled.match(names[-1], short)


def test_the_hostile_pattern_costs_what_its_states_cost_and_stops_at_the_budget() -> None:
    """Each step not remembered is charged as it is taken: a budget far below the name's
    work stops after that much work, not at the end of the name."""
    compiled, budget = targets.Pattern(HOSTILE), targets.Budget(100_000)
    with pytest.raises(targets.OverBudget):
        compiled.match("a" * 100_000, budget)
    states = len(compiled._nfa.edges)  # the most one step can charge is twice this
    assert -budget.left <= 2 * states + 100_000 + 1


def test_remembered_steps_are_capped_by_their_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap a step is computed again, not remembered; the answers do not change."""
    monkeypatch.setattr(targets, "MAX_CACHED_STATES", 5_000)
    name = "a" * 400  # no "x": no match (Python's `re` backtracks for hours here)
    compiled = targets.Pattern(HOSTILE)
    assert compiled.match(name) is False
    assert compiled.match(name + "x") is (re.match(HOSTILE, name + "x") is not None)
    assert 0 < remembered(compiled) <= 5_000


def test_the_remembered_steps_of_one_config_share_one_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many hostile patterns in one config: their remembered steps together stay within
    MAX_CACHED_STATES (each its own cap let 80 patterns hold ~8 MB each)."""
    monkeypatch.setattr(targets, "MAX_CACHED_STATES", 6_000)
    made: list[targets.Pattern] = []

    class Recorded(targets.Pattern):
        def __init__(self, pattern: str, remembered: targets.Budget | None = None) -> None:
            super().__init__(pattern, remembered)
            made.append(self)

    monkeypatch.setattr(targets, "Pattern", Recorded)
    hostile = ["re:" + HOSTILE[:-1] + end for end in "xyzvw"]
    conf = {**CT, "config_groups": {"g": {"targets": hostile}, "h": {"targets": ["Linear"]}}}
    assigned = targets.assign(infos(["a" * 300 + ".weight_packed"]), conf)
    assert assigned is not None
    assert len(made) == 5
    assert remembered(made[0]) > 0
    assert sum(remembered(p) for p in made) <= 6_000


def test_every_pair_costs_its_fixed_units() -> None:
    """A name against a target costs PAIR_UNITS however soon it stops: 4,500 one-letter
    patterns x 4,500 short names (~1 µs a pair) are not nearly free."""
    work, answers = used("c", ["m"] * 1_000)
    assert not any(answers)
    assert work >= 1_000 * (targets.PAIR_UNITS + 1)
    assert targets.PAIR_UNITS >= 8


def test_a_large_character_set_costs_what_a_small_one_does() -> None:
    """[^...] of 990 characters against names of distinct characters: each test a set
    lookup and a bisection, not one comparison per item; answers as Python's."""
    members = "".join(chr(0x4E00 + 2 * i) for i in range(990))
    ranges = "".join(chr(0x4E00 + 4 * i) + "-" + chr(0x4E01 + 4 * i) for i in range(330))
    name = "".join(chr(0x4E01 + 2 * i) for i in range(3_000))
    for body in (members, ranges, "\\d\\D\\w" * 50 + "a-c"):
        for negate in ("", "^"):
            pattern = f"[{negate}{body}]*z"
            compiled = targets.Pattern(pattern)
            test = compiled._nfa.edges[next(i for i, e in enumerate(compiled._nfa.edges) if e)]
            assert test is not None
            assert len(getattr(test[0], "_classes", [])) <= 6
            for probe in (name, name[:50] + "z", "z", "\u4e00z", "5z"):
                assert compiled.match(probe) is (re.match(pattern, probe) is not None)


def test_long_ordinary_names_are_matched_as_python_does() -> None:
    """A 100,000-character name and an ordinary pattern: read once, as Python answers."""
    name = "m" * 100_000 + ".self_attn.q_proj"
    for pattern in (r".*q_proj", r".*k_proj", r"m+\.self_attn\.(q|k)_proj$", r"m{100}"):
        work, [answer] = used(pattern, [name])
        assert answer is (re.match(pattern, name) is not None)
        assert work <= 2 * len(name) + 1_000


def infos(names: list[str]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, np.dtype(np.uint8), (1,), 1) for n in names}


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized"}


def test_exact_names_cost_no_matching_work() -> None:
    """An `ignore` list of 5,000 exact names and 2,000 modules: a lookup each, no work."""
    modules = [f"model.layers.{i}.mlp.experts.0.down_proj" for i in range(2_000)]
    ignore = [f"model.layers.{i}.mlp.gate" for i in range(5_000)] + [modules[7]]
    conf = {**CT, "ignore": ignore, "config_groups": {"g": {"targets": ["Linear"]}}}
    stored = infos([m + ".weight_packed" for m in modules])
    assigned = targets.assign(stored, conf, targets.Budget(0))
    assert assigned is not None
    assert list(assigned.undecided) == [modules[7]]
    assert len(assigned.by_group["g"][0]) == 1_999


def test_the_first_ignore_entry_in_order_is_named() -> None:
    """An exact entry after a matching `re:` entry: the `re:` entry, first, is named."""
    name = "model.layers.0.mlp.gate"
    for ignore, named in (
        (["re:.*gate$", name], "re:.*gate$"),
        ([name, "re:.*gate$"], name),
    ):
        conf = {**CT, "ignore": ignore, "config_groups": {"g": {"targets": ["Linear"]}}}
        assigned = targets.assign(infos([name + ".weight"]), conf)
        assert assigned is not None
        assert assigned.undecided[name][1] == f"config.json's ignore entry {named!r} names it"


def test_the_budget_at_exactly_a_configs_work_and_one_less() -> None:
    modules = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(50) for p in "qkvo"]
    conf = {
        **CT,
        "ignore": ["re:.*o_proj$"],
        "config_groups": {"g": {"targets": ["re:.*(q|k)_proj"]}, "h": {"targets": ["re:.*v_"]}},
    }
    stored = infos([m + ".weight_packed" for m in modules])
    full = targets.Budget(10**12)
    assigned = targets.assign(stored, conf, full)
    work = full.limit - full.left
    assert assigned is not None
    assert len(assigned.by_group["g"][0]) == 100
    assert len(assigned.by_group["h"][0]) == 50
    assert targets.assign(stored, conf, targets.Budget(work)) == assigned
    with pytest.raises(InputError, match="budget"):
        targets.assign(stored, conf, targets.Budget(work - 1))


def test_the_default_budget_grows_with_the_names_and_targets() -> None:
    plain = targets._targets(["re:a"], "w", "g", targets.Budget(10), targets.Budget(10))
    small = targets.work_budget(["m"], plain).limit
    assert small == targets.WORK_BASE + targets.WORK_PER_CHARACTER * (1 + len("re:a"))
    bigger = targets.work_budget(["m" * 1001], plain).limit
    assert bigger - small == targets.WORK_PER_CHARACTER * 1000


def test_the_attack_through_the_cli_is_one_line_exit_3(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker's file (a quantized module of 20,000 a's, the hostile target): refused
    with one line naming the target and the budget. WORK_BASE is lowered so the refusal
    comes after less work; the default refuses the same file after ~10 million units."""
    monkeypatch.setattr(targets, "WORK_BASE", 200_000)
    stem = "a" * 20_000
    stored, _ = module("int4", stem)
    conf = config({"group_0": (["re:" + HOSTILE], "int4"), "group_1": (["Linear"], "int4")})
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    result = run_main("norms", directory)
    assert result.code == 3, result.stderr
    assert result.stderr.count("\n") == 1
    assert "config_groups['group_0'].targets" in result.stderr
    assert "budget" in result.stderr
    assert "re:(?:(?:a{2})*" in result.stderr


def test_an_ordinary_config_on_a_long_name_is_read(tmp_path: Path, run_main: Any) -> None:
    stem = "model." + "m" * 50_000 + ".mlp.down_proj"
    stored, values = module("mxfp4", stem)
    conf = config({"group_0": (["re:.*down_proj"], "mxfp4"), "group_1": (["re:.*up_proj"], "fp8")})
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    assert_norm(norms(run_main, directory)[stem + ".weight"], values)


def test_the_automata_of_one_config_are_bounded_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each pattern within its own limit, many of them: their states are counted together
    (a 16 MB config.json of 5000-state patterns would otherwise build ~100 GB). Exactly at
    the bound read, one state past refused, naming the target that crossed it."""
    heavy = "re:" + ".{100}" * 24  # 144 characters
    per = targets.Pattern(heavy[3:]).size
    assert 4_000 < per <= targets.MAX_PROGRAM
    light = targets.Pattern("ab").size
    stored = infos(["model.layers.0.mlp.down_proj.weight_packed"])

    def conf(count: int, extra: list[str]) -> dict[str, Any]:
        groups = {"g": {"targets": [heavy] * count + ["Linear"]}}
        return {**CT, "ignore": extra, "config_groups": groups}

    monkeypatch.setattr(targets, "MAX_CONFIG_SIZE", 3 * per + light)
    assert targets.assign(stored, conf(3, ["re:ab"])) is not None
    monkeypatch.setattr(targets, "MAX_CONFIG_SIZE", 3 * per + light - 1)
    with pytest.raises(InputError, match=r"ignore.*'re:ab'.*states and set items together"):
        targets.assign(stored, conf(3, ["re:ab"]))
    monkeypatch.undo()
    count = targets.MAX_CONFIG_SIZE // per + 1
    with pytest.raises(InputError, match="100,000 automaton states"):
        targets.assign(stored, conf(count, []))


def test_the_items_of_character_sets_count_toward_the_configs_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A [...] of 990 characters is 2 states but ~110 KB (seventh attack: 7,900 of them,
    0.9 GB, from a 16 MB config.json): each item counts, in every copy a counted repeat
    makes; at the bound read, one item past refused."""
    body = "".join(chr(0x100 + i) for i in range(990))
    alone = targets.Pattern("[" + body + "]")
    assert alone.size == targets.Pattern("a").size + 990
    assert targets.Pattern("[a-z\\d" + body + "]").size == alone.size + 2
    repeated = targets.Pattern("[" + body + "]{3}")
    assert repeated.size > 3 * 990
    stored = infos(["b.weight_packed"])

    def conf(patterns: list[str]) -> dict[str, Any]:
        groups = {"g": {"targets": patterns}, "h": {"targets": ["Linear"]}}
        return {**CT, "config_groups": groups}

    sets = ["re:[" + body[i:] + body[:i] + "]" for i in range(3)]
    monkeypatch.setattr(targets, "MAX_CONFIG_SIZE", 3 * alone.size)
    assert targets.assign(stored, conf(sets)) is not None
    monkeypatch.setattr(targets, "MAX_CONFIG_SIZE", 3 * alone.size - 1)
    with pytest.raises(InputError, match="states and set items together"):
        targets.assign(stored, conf(sets))
    monkeypatch.undo()
    many = ["re:[" + body[i % 990 :] + body[: i % 990] + "]" for i in range(102)]
    with pytest.raises(InputError, match="100,000 automaton states and set items"):
        targets.assign(stored, conf(many))


def test_class_targets_are_decided_once_for_every_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eighth attack: 1,000 groups of a class name each x 1,000 modules took 14 s (the
    ambiguity text looked each group up again, quadratic). A module matched only by class
    names is decided once for all of them, in one pass over the targets."""
    calls: list[int] = []
    decide = targets._decide

    def counted(matched: list[Any]) -> tuple[str | None, str]:
        calls.append(len(matched))
        return decide(matched)

    monkeypatch.setattr(targets, "_decide", counted)
    groups = {f"group_{i}": {"targets": [f"C{i}"]} for i in range(1_000)}
    stored = infos([f"m{i}.weight_packed" for i in range(1_000)])
    assigned = targets.assign(stored, {**CT, "config_groups": groups})
    assert assigned is not None
    assert calls == [1_000]
    why = assigned.undecided["m7"][1]
    assert why == (
        "config groups 'group_0' ('C0') and 'group_1' ('C1') and 'group_2' ('C2') and 997 more"
        " both target it: ambiguous"
    )
    assert all(w == why for _, w in assigned.undecided.values())


def test_an_ambiguity_names_three_groups_and_counts_the_rest() -> None:
    """Exactly three groups are all named; a fourth is counted, never a line per group."""
    for count, tail in ((2, ""), (3, ""), (4, " and 1 more")):
        groups = {f"g{i}": {"targets": ["re:m", "re:.*"]} for i in range(count)}
        assigned = targets.assign(infos(["m.weight_packed"]), {**CT, "config_groups": groups})
        assert assigned is not None
        named = " and ".join(f"'g{i}' ('re:m')" for i in range(min(count, 3)))
        assert assigned.undecided["m"][1] == (
            f"config groups {named}{tail} both target it: ambiguous"
        )


def test_one_group_among_class_names_still_wins_by_rank() -> None:
    """The shortcut keeps the ranks: an exact name over a `re:` target over class names."""
    groups = {
        "by_class": {"targets": ["Linear"]},
        "by_regex": {"targets": ["re:.*q_proj"]},
        "by_name": {"targets": ["a.k_proj"]},
    }
    names = ["a.q_proj", "a.k_proj", "a.v_proj"]
    assigned = targets.assign(infos([n + ".w" for n in names]), {**CT, "config_groups": groups})
    assert assigned is not None
    assert {g: sorted(t) for g, (t, _) in assigned.by_group.items()} == {
        "by_class": ["a.v_proj.w"],
        "by_regex": ["a.q_proj.w"],
        "by_name": ["a.k_proj.w"],
    }


def test_the_remembered_steps_at_exactly_the_cap_and_one_state_short() -> None:
    """A cap of exactly the states a match remembers keeps every step; one state less
    leaves a step out (computed again, charged again), and the answer is the same."""
    name = "a" * 40 + "x"
    full = targets.Pattern(HOSTILE, targets.Budget(10**9))
    assert full.match(name) is (re.match(HOSTILE, name) is not None)
    needed = remembered(full)
    at = targets.Pattern(HOSTILE, targets.Budget(needed))
    assert at.match(name) is full.match(name)
    assert remembered(at) == needed
    short = targets.Pattern(HOSTILE, targets.Budget(needed - 1))
    assert short.match(name) is full.match(name)
    assert remembered(short) < needed
