"""compressed-tensors `config_groups` targets as compressed-tensors reads them (issue 21,
fourth attack round): a `re:P` target matches where Python's `re.match(P, module)` does.

1. Every pattern clipcli's automaton accepts matches exactly as Python's `re` on any name
   (Unicode \\d \\w \\s, `$` before a final "\\n", `.` and "\\n", classes and ranges),
   and every pattern Python's re.compile rejects (or warns may change meaning) is refused:
   a differential test, Python's `re` the reference (run here on small inputs only).
2. Groups nest at most MAX_NESTING deep: at the bound read, one past exit 3 (was exit 70,
   RecursionError, at 330).
3. One config group is matched as two are: a module `ignore` names, or no group targets,
   holding codes is exit 3 (was decoded with the one group's scheme and clipped).

References: Python's `re` for the verdicts; values of int codes times float32 scales as
Fractions, decoded here from the published packing (8 // bits codes per int32, lowest first,
stored unsigned with an offset of 2**(bits-1)).
"""

from __future__ import annotations

import json
import random
import re
import struct
import sys
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from quant_reference import sqrt_fraction, write_model_directory
from safetensors.numpy import load_file

from clipcli.logical.quantized.targets import MAX_NESTING, Pattern

# ------------------------------------------------------------------ the reference


def python_compiles(pattern: str) -> re.Pattern[str] | None:
    """Python's compiled pattern, or None where re.compile rejects it or warns that its
    meaning may change (a nested set, `--` `&&` `~~` `||` in a class)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            return re.compile(pattern)
        except (re.error, FutureWarning, DeprecationWarning, OverflowError):
            return None


def ours(pattern: str) -> Pattern | None:
    try:
        return Pattern(pattern)
    except ValueError:
        return None


ATOMS = [
    *("a", "b", "K", "x", ".", "{", "}", "]", "|", "\n", "\u0663", "\u00e9", "\u212a"),
    *(r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"\n", r"\.", "\\\\", "\\\u00e9", "\\\u0663"),
    *("[a-c]", "[^a]", "[]a]", "[^]a]", "[a-]", "[-a]", r"[\d-]", r"[\w]", r"[^\s]", r"[\n]"),
    *("[\u0660-\u0669]", "[\u00e0-\u00ff]", "[^\n]", r"[\b]", "[a-z]", "[A-z]"),
    *("$", "^", "(a|b)", "(?:a)", "()", "(?:)", "(?:$)", "(^)"),
]
QUANTIFIERS = [
    *("", "*", "+", "?", "*?", "{2}", "{,2}", "{1,}", "{,}", "{}", "{x", "{1,2}?"),
    *("{2,1}", "++", "**", "{\u0663}", "{ 1}"),
]
NAMES = [
    *("", "a", "b", "ab", "aa", "aab", "ab\n", "aa\n", "a\n", "\n", "\n\n", "a\nb", "_", "1"),
    *("\u0663", "\u0661\u0662", "\u00b2", "\u00e9", "\u00e9t\u00e9", "\u00e0", "\u00ff", "\u0100"),
    *("a\u00a0b", "a\x1cb", "\u2028", "\t", "\b", "a b", "K", "\u212a", "k", "-", "a-b", "["),
    *("{", "}", "]", "{x", "{,}", "x{2}", "a.b", "model.layers.\u0663.q_proj", "m.q_proj\n"),
]
# The attacker's cases (a01_targets.py, r1_unicode_regex.py) and Python's refusals.
CASES = [
    (r"model\.layers\.\d+\.q_proj", "model.layers.\u0663.q_proj"),
    (r"\w+\.q_proj", "\u00e9t\u00e9.q_proj"),
    (r"a\sb", "a\u00a0b.q_proj"),
    (r"a\sb", "a\x1cb.q_proj"),
    (r"m\.q_proj$", "m.q_proj\n"),
    (r"a.b", "a\nb.q_proj"),
    (r"a[^x]b", "a\nb.q_proj"),
    (r"a[A-z]b", "a_b.q_proj"),
    ("", "m.q_proj"),
    (r"a{,2}\.q", "aaa.q_proj"),
    (r"a{2,}\.q", "aaa.q_proj"),
    (r"a{x", "a{x.q_proj"),
    (r"a{,}", "a{,}.q_proj"),
    (r".*^q\.q", "q.q_proj"),
    (r"m$|zz", "m.q_proj"),
    (r"zz|m\.q", "m.q_proj"),
    (r"a[]]b", "a]b.q_proj"),
    (r"a[a-]b", "a-b.q_proj"),
    (r"a[\d]b", "a5b.q_proj"),
    (r"m.*?q", "m.q_proj"),
    (r"a\nb", "a\nb.q_proj"),
    (r"[\w]\.", "\u00e9.q_proj"),
    (r"l\d", "l\u00b2.q_proj"),
    (r"()*m", "m.q_proj"),
    (r"(?:m)\.q", "m.q_proj"),
    (r"^*a", "a"),
    (r"a$*", "a"),
    (r"[z-a]", "a"),
    (r"[\d-z]", "a"),
    (r"[a-\d]", "a"),
    (r"a{2,1}", "aa"),
    (r"[[:a]+", "[:a"),
    (r"[a--b]", "a"),
    (r"[a&&b]", "a"),
    (r"a)", "a"),
    (r"(a", "a"),
    ("\\", "a"),
]


def agreement(patterns: list[str], names: list[str]) -> list[str]:
    """Where the automaton and Python's re.match disagree: accepted patterns Python
    rejects, and (pattern, name) pairs matched one way and not the other."""
    problems = []
    for pattern in patterns:
        mine = ours(pattern)
        if mine is None:
            continue
        python = python_compiles(pattern)
        if python is None:
            problems.append(f"accepted {pattern!r}, which Python rejects")
            continue
        for name in names:
            if (python.match(name) is not None) != mine.match(name):
                problems.append(f"{pattern!r} on {name!r}: Python {python.match(name)}")
    return problems


def test_each_atom_and_repeat_matches_as_python() -> None:
    patterns = [a + q for a in ATOMS for q in QUANTIFIERS]
    assert agreement(patterns, NAMES) == []


def test_random_patterns_match_as_python() -> None:
    rng = random.Random(21)
    quantifiers = QUANTIFIERS[:8] + [""] * 8
    patterns = [
        "".join(rng.choice(ATOMS) + rng.choice(quantifiers) for _ in range(rng.randint(1, 4)))
        for _ in range(4000)
    ]
    assert agreement(patterns, NAMES) == []


@pytest.mark.parametrize(("pattern", "name"), CASES)
def test_the_attackers_cases_match_as_python_or_are_refused(pattern: str, name: str) -> None:
    assert agreement([pattern], [name, name[:1], name + "\n", ""]) == []


@pytest.mark.parametrize("pattern", [r"^*a", r"a$*", r"^+", r"$?", r"a{2,1}", r"[z-a]"])
def test_what_python_rejects_is_refused(pattern: str) -> None:
    assert python_compiles(pattern) is None
    assert ours(pattern) is None


def chosen_code_points() -> list[str]:
    """Every character of the Basic Multilingual Plane (surrogates included: a str may hold
    them), and above it every one Python's \\d, \\w or \\s holds, plus every 97th."""
    above = "".join(map(chr, range(0x10000, sys.maxunicode + 1)))
    held = set(re.findall(r"[\d\w\s]", above))
    return [*map(chr, range(0x10000)), *sorted(held | set(above[::97]))]


CODE_POINTS = chosen_code_points()


@pytest.mark.parametrize("pattern", [r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", ".", r"[^\d]"])
def test_classes_match_as_python_on_every_code_point(pattern: str) -> None:
    python = re.compile(pattern)
    mine = ours(pattern)
    assert mine is not None
    wrong = [c for c in CODE_POINTS if mine.match(c) != (python.match(c) is not None)]
    assert wrong == []


# ------------------------------------------------------------------ nesting


def nested(depth: int, inner: str = "m", repeat: str = "") -> str:
    return "(" * depth + inner + (")" + repeat) * depth


def test_groups_nest_to_the_bound_and_no_further() -> None:
    assert MAX_NESTING == 32
    at_bound = ours(nested(MAX_NESTING))
    assert at_bound is not None
    assert at_bound.match("m.x")
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_NESTING}"):
        Pattern(nested(MAX_NESTING + 1))
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_NESTING}"):
        Pattern(nested(330, ""))


def test_counted_repeats_at_the_bound_stop_at_the_state_limit() -> None:
    """Each counted level copies its group: 2**32 copies stop at MAX_PROGRAM, not in a
    RecursionError (the copies recurse no deeper than the first parse)."""
    with pytest.raises(ValueError, match="states"):
        Pattern(nested(MAX_NESTING, repeat="{2}"))
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_NESTING}"):
        Pattern(nested(MAX_NESTING + 1, repeat="{2}"))


# ------------------------------------------------------------------ through the CLI

ROWS, COLUMNS = 2, 8
SCALE_BITS = [0x3FC00000, 0x40200000]  # float32 1.5, 2.5 per row
WORDS = [0x9A3F_C1E7, 0x0B5D_84F2]  # one int32 word per row: 8 int4 or 16 int2 codes


def int_group(bits: int, targets: list[str]) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel"}
    return {"targets": targets, "format": "pack-quantized", "weights": weights}


def stored(module: str) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        module + ".weight_packed": ("I32", [ROWS, 1], struct.pack("<2I", *WORDS)),
        module + ".weight_scale": ("F32", [ROWS, 1], struct.pack("<2I", *SCALE_BITS)),
        module + ".weight_shape": ("I64", [2], struct.pack("<2q", ROWS, COLUMNS)),
    }


def exact_norm(words: list[int], scales: list[Fraction], bits: int) -> Fraction:
    """The weight's squared norm as `bits`-wide codes, lowest first, offset 2**(bits-1)."""
    total = Fraction(0)
    for word, scale in zip(words, scales, strict=True):
        for j in range(COLUMNS):
            code = (word >> (bits * j)) & ((1 << bits) - 1)
            total += ((code - (1 << (bits - 1))) * scale) ** 2
    return total


SCALES = [Fraction(3, 2), Fraction(5, 2)]


def model(tmp: Path, module: str, groups: dict[str, Any], ignore: list[str]) -> Path:
    conf = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "ignore": ignore,
            "config_groups": groups,
        }
    }
    return write_model_directory(tmp, {"model.safetensors": stored(module)}, conf)


UNICODE_MODULES = [
    ("model.layers.\u0663.q_proj", r"re:model\.layers\.\d+\.q_proj"),
    ("\u00e9t\u00e9.q_proj", r"re:\w+\.q_proj"),
    ("a\u00a0b.q_proj", r"re:a\sb"),
    ("m.q_proj\n", r"re:m\.q_proj$"),
]


@pytest.mark.parametrize(("module", "target"), UNICODE_MODULES)
def test_a_unicode_name_takes_the_group_python_matches(
    tmp_path: Path, run_main: Any, module: str, target: str
) -> None:
    """The regex group (int4) wins over the class group (int2), as under compressed-tensors;
    a clip between the two readings' norms then brings the int4 reading to the limit."""
    assert re.match(target[3:], module)
    groups = {"group_0": int_group(4, [target]), "group_1": int_group(2, ["Linear"])}
    directory = model(tmp_path / "m", module, groups, [])
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    row = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}[module + ".weight"]
    assert row["quantization"]["scheme"] == "pack-quantized-int4"
    exact = sqrt_fraction(exact_norm(WORDS, SCALES, 4))
    assert abs(row["norm"] - exact) <= 2 * exact * 2**-52
    assert sqrt_fraction(exact_norm(WORDS, SCALES, 2)) < 20 < exact
    out = tmp_path / "out"
    result = run_main("clip", "--global", "20", directory, out)
    assert result.code == 0, result.stderr
    clipped = load_file(str(out / "model.safetensors"))
    assert clipped[module + ".weight_packed"].tobytes() == struct.pack("<2I", *WORDS)
    scales = [Fraction(float(s)) for s in clipped[module + ".weight_scale"].reshape(-1)]
    assert sqrt_fraction(exact_norm(WORDS, scales, 4)) <= 20 * (1 + 2**-20)


def refused(run_main: Any, *argv: str | Path, needles: tuple[str, ...]) -> None:
    result = run_main(*argv)
    assert result.code == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("clipcli: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


MLP = "model.layers.0.mlp.down_proj"
UNDECIDED = {
    "ignored-exact": (["Linear"], [MLP], f"ignore entry {MLP!r} names it"),
    "ignored-regex": (["Linear"], ["re:.*down_proj"], "ignore entry 're:.*down_proj' names it"),
    "ignored-over-exact": ([MLP], [MLP], f"ignore entry {MLP!r} names it"),
    "no-regex-target": (["re:.*self_attn.*"], [], "no config group of config.json targets it"),
    "no-exact-target": (["lm_head"], [], "no config group of config.json targets it"),
}


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("case", list(UNDECIDED))
def test_one_group_refuses_what_two_groups_refuse(
    tmp_path: Path, run_main: Any, case: str, groups: int
) -> None:
    targets, ignore, why = UNDECIDED[case]
    config_groups = {"group_0": int_group(4, targets)}
    if groups == 2:
        config_groups["group_1"] = int_group(2, ["re:.*never"])
    directory = model(tmp_path / "m", MLP, config_groups, ignore)
    refused(run_main, "norms", directory, needles=(MLP, why))
    out = tmp_path / "out"
    refused(run_main, "clip", "--global", "1", directory, out, needles=(MLP, why))
    assert not out.exists()


@pytest.mark.parametrize("target", ["Linear", MLP, "re:.*mlp", "re:model"])
def test_one_group_reads_the_module_it_targets(tmp_path: Path, run_main: Any, target: str) -> None:
    directory = model(tmp_path / "m", MLP, {"group_0": int_group(4, [target])}, ["lm_head"])
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    row = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}[MLP + ".weight"]
    exact = sqrt_fraction(exact_norm(WORDS, SCALES, 4))
    assert abs(row["norm"] - exact) <= 2 * exact * 2**-52


def test_nesting_through_the_cli(tmp_path: Path, run_main: Any) -> None:
    """At the bound the target is read (its group decodes the module); one past, and at
    the attacker's 330, exit 3 in one line naming the target and the bound."""
    at_bound = "re:" + nested(MAX_NESTING, "model")
    groups = {"group_0": int_group(4, [at_bound]), "group_1": int_group(2, ["Linear"])}
    result = run_main("norms", model(tmp_path / "a", MLP, groups, []), "--format", "json")
    assert result.code == 0, result.stderr
    for depth, name in ((MAX_NESTING + 1, "b"), (330, "c")):
        target = "re:" + nested(depth, "")
        groups = {"group_0": int_group(4, [target]), "group_1": int_group(2, ["Linear"])}
        directory = model(tmp_path / name, MLP, groups, [])
        needles = ("config_groups['group_0'].targets", f"nested deeper than {MAX_NESTING}")
        refused(run_main, "norms", directory, needles=needles)
