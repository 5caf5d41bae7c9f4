"""compressed-tensors' `config_groups`: which group's scheme each module takes.

compressed-tensors (utils/match.py) matches a group's `targets` against module names: a
target `re:P` matches when the regular expression P matches at the start of the name
(Python's re.match), any other target when it equals the name or names a class of the
module (`Linear`). An exact name wins over a regex, a regex over a class; a module the
`ignore` list matches is not quantized. A checkpoint names no module classes, so a class
target (a dotless name starting with a capital) is taken to match every module: a module
whose codes are stored was quantized, so it is of the class a group quantized.

Where two groups match a module at the same rank, or none does, the module's scheme is
not known: a module that holds quantized codes there is refused (exit 3, naming it and the
groups), never read with a guessed scheme. One group is matched as several are.

The regular expressions come from a file: they are run by a small automaton here (a
subset of Python's syntax, linear in the name's length), never by Python's backtracking
`re`, whose worst case a hostile pattern could make take hours. What the automaton accepts
matches exactly as Python's `re` does on any str (tests/test_quant_targets_python_re.py
compares the two); the rest is refused.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.logical.quantized import rules

if TYPE_CHECKING:
    from clipcli.formats.base import TensorInfo

MAX_PATTERN = 1000  # characters of one `re:` target
MAX_PROGRAM = 5000  # automaton states of one pattern (counted repeats expand)
MAX_REPEAT = 100  # the largest count of {m,n}
MAX_NESTING = 32  # groups inside groups: the parser recurses once per level
# The size of all the `re:` targets of one config: automaton states (~220 bytes each) and
# the items of their [...] sets (a character ~110 bytes), each copy of a counted repeat
# counted. Without it a 16 MB config.json of 5000-state patterns built ~100 GB of automata,
# and one of 990-character sets ~0.9 GB.
MAX_CONFIG_SIZE = 100_000
# Steps remembered (a lazy DFA) by all the patterns of one config together, counted in
# the states the remembered sets hold (~40 bytes each: ~10 MB); past it a step is computed
# again, each time charged to the work budget.
MAX_CACHED_STATES = 1 << 18
# The matching work one config may ask for, in units: a character of a module name read
# against one `re:` target is one unit, a step not remembered costs the states it touches.
# An ordinary target reads a name's characters once, about a unit each (4 million for
# 100,000 expert modules), ~0.1 to 0.3 µs a unit. Past the budget the file is refused
# (exit 3), never matched for minutes. The budget grows with the text it is asked about
# (~1 to 3 s, plus 2 to 5 s per MB of names), as the other budgets grow with the input.
WORK_BASE = 10_000_000
WORK_PER_CHARACTER = 16  # per character of the module names and of the targets
PAIR_UNITS = 8  # the fixed cost of matching one name against one target, ~1 µs

EXACT, REGEX, CLASS = 0, 1, 2  # match ranks: lower wins (compressed-tensors' order)


# ------------------------------------------------------------------ regular expressions
#
# What Python 3's `re` (re._parser) makes of a str pattern without flags, for the subset
# read here; anything else is refused, never read another way:
#   \d: str.isdecimal (Unicode Nd)  \w: str.isalnum or "_"  \s: str.isspace  (\D \W \S not)
#   . : any character but "\n"      $ : at the end, or before a "\n" that ends the name
#   ^ : at the start only           [..]: code point ranges, "]" first is a literal
#   {m,n} {m,} {,n} {m}: ASCII digits only; a "{" that is not one of them is a literal.


class _Nfa:
    """A Thompson automaton: `edges[s]` (test, next) consume one character, `eps[s]` the
    states reached without one; `assertion[s]` ("^" or "$", next): passed without a
    character where the position allows it."""

    def __init__(self) -> None:
        self.edges: list[tuple[Test, int] | None] = []
        self.eps: list[list[int]] = []
        self.assertion: list[tuple[str, int] | None] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_PROGRAM:
            raise ValueError(f"more than {MAX_PROGRAM} states")
        self.edges.append(None)
        self.eps.append([])
        self.assertion.append(None)
        return len(self.edges) - 1


Test = Callable[[str], bool]  # does one character pass


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


# Python's CATEGORY_UNI_DIGIT / _WORD / _SPACE: Py_UNICODE_ISDECIMAL, ISALNUM or "_",
# ISSPACE, which str.isdecimal, str.isalnum and str.isspace test.
_CLASSES: dict[str, Test] = {"d": str.isdecimal, "w": _word, "s": str.isspace}
# re._parser.ESCAPES: control characters; "\b" is one only inside [...] (else a boundary).
_CONTROL = {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ASCII_DIGITS = "0123456789"
_ALL = "all"  # an atom that consumes characters
_ASSERT = "assert"  # ^ or $: Python refuses to repeat it


def _negated(test: Test) -> Test:
    return lambda x: not test(x)


def _literal(c: str) -> Test:
    return lambda x: x == c


class _CharSet:
    """The test of a [...]: its characters in a set, its ranges merged into disjoint
    intervals found by bisection, its classes (\\d \\W ...) one by one, at most six. A
    character costs about the same against a set of 1000 items as of 1, so a step's work
    is the states it touches (what the budget charges), not the sizes of their sets."""

    def __init__(
        self, singles: set[str], ranges: list[tuple[int, int]], classes: list[Test], negate: bool
    ) -> None:
        merged: list[list[int]] = []
        for low, high in sorted(ranges):
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        self._singles = frozenset(singles)
        self._starts = [low for low, _ in merged]
        self._ends = [high for _, high in merged]
        self._classes = classes
        self._negate = negate

    def __call__(self, x: str) -> bool:
        return self._admits(x) != self._negate

    def _admits(self, x: str) -> bool:
        if x in self._singles:
            return True
        at = bisect.bisect_right(self._starts, ord(x)) - 1
        if at >= 0 and ord(x) <= self._ends[at]:
            return True
        return any(test(x) for test in self._classes)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.depth = 0
        self.nfa = _Nfa()
        self.set_items = 0  # items of the [...] sets built, every copy counted

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise ValueError("ends early")
        c = self.p[self.i]
        self.i += 1
        return c

    # Each fragment is (start, end) of states; end has no edges yet.
    def alternation(self) -> tuple[int, int]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        start, end = self.nfa.state(), self.nfa.state()
        for b_start, b_end in branches:
            self.nfa.eps[start].append(b_start)
            self.nfa.eps[b_end].append(end)
        return start, end

    def sequence(self) -> tuple[int, int]:
        start = end = self.nfa.state()
        while self.peek() not in (None, "|", ")"):
            begin = self.i
            if self.count_at(begin) is not None:
                raise ValueError(f"nothing to repeat at {begin}")
            fragment, kind = self.atom()
            count = self.count_at(self.i)
            if count is not None:
                if kind == _ASSERT:
                    raise ValueError(f"nothing to repeat at {self.i}")
                low, high, self.i = count
                if self.peek() == "?":  # lazy: the same matches, for a yes/no answer
                    self.i += 1
                fragment = self.repeat(begin, fragment, low, high)
                if self.count_at(self.i) is not None:  # also a possessive "+"
                    raise ValueError(f"multiple repeat at {self.i}")
            self.nfa.eps[end].append(fragment[0])
            end = fragment[1]
        return start, end

    def count_at(self, i: int) -> tuple[int, int | None, int] | None:
        """The repeat (low, high or None, where it ends) that starts at `i`, if one does:
        `* + ?`, or `{m,n}` `{m,}` `{,n}` `{,}` `{m}` of ASCII digits (else "{" is a
        literal, as in Python)."""
        c = self.p[i] if i < len(self.p) else None
        if c in ("*", "+", "?"):
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            return low, high, i + 1
        if c != "{":
            return None
        j = i + 1
        while j < len(self.p) and self.p[j] in _ASCII_DIGITS:
            j += 1
        low_text, high_text, comma = self.p[i + 1 : j], None, False
        if j < len(self.p) and self.p[j] == ",":
            comma = True
            k = j + 1
            while k < len(self.p) and self.p[k] in _ASCII_DIGITS:
                k += 1
            high_text, j = self.p[j + 1 : k], k
        if j >= len(self.p) or self.p[j] != "}" or (not low_text and not comma):
            return None  # "{", "{}", "{x": literal
        if len(low_text) > 3 or len(high_text or "") > 3:
            raise ValueError(f"{self.p[i : j + 1]}: counts up to {MAX_REPEAT}")
        low = int(low_text) if low_text else 0
        high = None if comma and not high_text else int(high_text or low_text)
        if high is not None and high < low:
            raise ValueError(f"{self.p[i : j + 1]}: min repeat greater than max repeat")
        if low > MAX_REPEAT or (high is not None and high > MAX_REPEAT):
            raise ValueError(f"{self.p[i : j + 1]}: counts up to {MAX_REPEAT}")
        return low, high, j + 1

    def atom(self) -> tuple[tuple[int, int], str]:
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise ValueError("only (...) and (?:...) groups")
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise ValueError(f"groups nested deeper than {MAX_NESTING}")
            inner = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                raise ValueError("missing ), unterminated subpattern")
            self.i += 1
            return inner, _ALL
        if c in "^$":
            start, end = self.nfa.state(), self.nfa.state()
            self.nfa.assertion[start] = (c, end)
            return (start, end), _ASSERT
        return self.edge(self.char_test(c)), _ALL

    def edge(self, test: Test) -> tuple[int, int]:
        start, end = self.nfa.state(), self.nfa.state()
        self.nfa.edges[start] = (test, end)
        return start, end

    def char_test(self, c: str) -> Test:
        if c == ".":
            return lambda x: x != "\n"
        if c == "[":
            return self.bracket()
        if c == "\\":
            return self.escape(in_class=False)[0]
        return _literal(c)

    def escape(self, in_class: bool) -> tuple[Test, str | None]:
        """After a backslash: its test, and the one character it stands for (None: a
        class such as \\d, which cannot end a range)."""
        if self.i >= len(self.p):
            raise ValueError("bad escape (end of pattern)")
        e = self.take()
        if e.lower() in _CLASSES:
            test = _CLASSES[e.lower()]
            return (test if e.islower() else _negated(test)), None
        if e in _CONTROL:
            return _literal(_CONTROL[e]), _CONTROL[e]
        if e == "b" and in_class:
            return _literal("\b"), "\b"
        if e.isascii() and e.isalnum():  # \b \A \Z, \x \u, octal, backreferences
            raise ValueError(f"escape \\{e} is not supported")
        return _literal(e), e  # Python: any other escaped character is itself

    def class_item(self, c: str) -> tuple[Test, str | None]:
        return self.escape(in_class=True) if c == "\\" else (_literal(c), c)

    def bracket(self) -> Test:
        """[...] as re._parser reads it; what Python warns may change meaning is refused."""
        if self.peek() == "[":
            raise ValueError("'[' at the start of [...] (Python warns: a nested set)")
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        singles: set[str] = set()
        ranges: list[tuple[int, int]] = []
        classes: dict[str, Test] = {}  # "d", "W", ...: at most six, however often written
        items = 0

        def add(test: Test, char: str | None, letter: str | None) -> None:
            if char is None:  # a class: \d \W ...
                classes[letter or ""] = test
            else:
                singles.add(char)

        while True:
            if self.i >= len(self.p):
                raise ValueError("unterminated character set")
            c = self.take()
            if c == "]" and items:
                break
            if c != "\\" and items and c in "-&~|" and self.peek() == c:
                raise ValueError(f"{c + c!r} in [...] (Python warns: a set operation)")
            items += 1
            letter = self.peek() if c == "\\" else None
            low_test, low = self.class_item(c)
            if self.peek() != "-" or self.i + 1 >= len(self.p):
                add(low_test, low, letter)
                continue
            self.i += 1  # "-"
            that = self.take()
            if that == "]":
                add(low_test, low, letter)
                singles.add("-")
                break
            if that == "-":
                raise ValueError("'--' in [...] (Python warns: a set difference)")
            _, high = self.class_item(that)
            if low is None or high is None or high < low:
                raise ValueError(f"bad character range at {self.i}")
            ranges.append((ord(low), ord(high)))
        self.set_items += items
        return _CharSet(singles, ranges, list(classes.values()), negate)

    def copy(self, begin: int) -> tuple[int, int]:
        """A fresh fragment for the atom at pattern position `begin` (counted repeats)."""
        saved = self.i
        self.i = begin
        fragment, _ = self.atom()
        self.i = saved
        return fragment

    def repeat(
        self, begin: int, first: tuple[int, int], low: int, high: int | None
    ) -> tuple[int, int]:
        """The atom at `begin` (its first fragment `first`) low to high times (None: no
        bound), each further time a fresh copy of its states."""
        eps = self.nfa.eps
        used = 0

        def fresh() -> tuple[int, int]:
            nonlocal used
            used += 1
            return first if used == 1 else self.copy(begin)

        out_start, out_end = self.nfa.state(), self.nfa.state()
        cursor = out_start
        for _ in range(low):
            start, end = fresh()
            eps[cursor].append(start)
            cursor = end
        if high is None:  # a loop: enter it or go on, again after each pass
            start, end = fresh()
            eps[cursor] += [start, out_end]
            eps[end] += [start, out_end]
            return out_start, out_end
        for _ in range(high - low):
            start, end = fresh()
            eps[cursor] += [start, out_end]
            cursor = end
        eps[cursor].append(out_end)
        return out_start, out_end


class Pattern:
    """A `re:` target, matched like Python's re.match (at the start, not to the end)."""

    def __init__(self, pattern: str, remembered: Budget | None = None) -> None:
        """`remembered`: the states its remembered steps may hold, shared by the patterns
        of one config (default: MAX_CACHED_STATES of its own)."""
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"longer than {MAX_PATTERN} characters")
        parser = _Parser(pattern)
        start, self._accept = parser.alternation()
        if parser.i != len(pattern):
            raise ValueError(f"unbalanced ) at {parser.i}")
        self._nfa = parser.nfa
        self.size = len(parser.nfa.edges) + parser.set_items  # what MAX_CONFIG_SIZE counts
        # At the start "^" passes; "$" too where the name is "" or "\n".
        self._starts = {
            at_end: self._closure({start}, at_start=True, at_end=at_end) for at_end in (False, True)
        }
        self._steps: dict[tuple[frozenset[int], str, bool], frozenset[int]] = {}
        self._remembered = Budget(MAX_CACHED_STATES) if remembered is None else remembered

    def _closure(self, states: set[int], at_start: bool, at_end: bool) -> frozenset[int]:
        seen = set(states)
        todo = list(states)
        while todo:
            s = todo.pop()
            nxt = list(self._nfa.eps[s])
            assertion = self._nfa.assertion[s]
            if assertion is not None and (at_start if assertion[0] == "^" else at_end):
                nxt.append(assertion[1])
            for t in nxt:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def match(self, name: str, budget: Budget | None = None) -> bool:
        """re.match(pattern, name) is not None. Charged to `budget`: PAIR_UNITS a call, a
        unit per character read, and the states each step not remembered touches (charged as
        it is taken, so a costly pattern stops at the budget, not after the name)."""
        matched, read = self._run(name, budget)
        if budget is not None:
            budget.spend(read + PAIR_UNITS)
        return matched

    def _run(self, name: str, budget: Budget | None) -> tuple[bool, int]:
        """Whether the pattern matches at the start of `name`, and how many characters
        that took."""
        size = len(name)

        def at_end(position: int) -> bool:  # where Python's "$" (no MULTILINE) passes
            return position == size or (position == size - 1 and name[position] == "\n")

        current = self._starts[at_end(0)]
        for index, c in enumerate(name):
            if self._accept in current:
                return True, index
            end = at_end(index + 1)
            key = (current, c, end)
            step = self._steps.get(key)
            if step is None:
                moved = set()
                for state in current:
                    edge = self._nfa.edges[state]
                    if edge is not None and edge[0](c):
                        moved.add(edge[1])
                step = self._closure(moved, at_start=False, at_end=end)
                if budget is not None:
                    budget.spend(len(current) + len(step))
                if len(step) <= self._remembered.left:
                    self._remembered.left -= len(step)
                    self._steps[key] = step
            current = step
            if not current:
                return False, index + 1
        return self._accept in current, size


class OverBudget(Exception):
    """Matching asked for more work than the budget allows."""


class Budget:
    """Units left of matching work (WORK_BASE) or of patterns' size (MAX_CONFIG_SIZE):
    spending past them raises OverBudget, spending exactly all of them does not."""

    def __init__(self, units: int) -> None:
        self.limit = units
        self.left = units

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise OverBudget


# ------------------------------------------------------------------ groups


class _Target(NamedTuple):
    group: str
    rank: int  # EXACT, REGEX or CLASS
    text: str
    pattern: Pattern | None
    where: str  # the config field it came from


def _is_class(target: str) -> bool:
    return "." not in target and target[:1].isupper() and target.isidentifier()


def _compiled(text: str, where: str, remembered: Budget) -> Pattern:
    try:
        return Pattern(text, remembered)
    except ValueError as exc:
        raise rules.refuse(where, f"target {'re:' + text!r}: {exc}") from None


def _targets(
    value: object, where: str, group: str, sizes: Budget, remembered: Budget
) -> list[_Target]:
    """The targets of one config field; each `re:` target's size charged to `sizes`
    (refused past it), its remembered steps to `remembered`."""
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise rules.refuse(where, "is not a list of strings")
    found = []
    for text in value:
        if text.startswith("re:"):
            pattern = _compiled(text[3:], where, remembered)
            try:
                sizes.spend(pattern.size)
            except OverBudget:
                raise rules.refuse(
                    where,
                    f"target {text!r}: the `re:` targets of config.json need more than "
                    f"{sizes.limit:,} automaton states and set items together",
                ) from None
            found.append(_Target(group, REGEX, text, pattern, where))
        else:
            rank = CLASS if _is_class(text) else EXACT
            found.append(_Target(group, rank, text, None, where))
    return found


class _Matcher:
    """Which of `targets` match a module: exact names by one lookup (an `ignore` list of
    thousands of names costs no more per module than one), `re:` targets by the automaton
    within `budget`, class targets always (worked out once, not per module)."""

    def __init__(self, targets: list[_Target], budget: Budget) -> None:
        self._targets = targets
        self._exact: dict[str, list[int]] = {}
        for index, target in enumerate(targets):
            if target.rank == EXACT:
                self._exact.setdefault(target.text, []).append(index)
        self._others = [i for i, t in enumerate(targets) if t.rank != EXACT]
        self._regexes = [t for t in targets if t.rank == REGEX]
        self.classes = [t for t in targets if t.rank == CLASS]
        self._budget = budget

    def _hits(self, index: int, module: str) -> bool:
        target = self._targets[index]
        return target.rank == CLASS or self._matches(target, module)

    def first(self, module: str) -> _Target | None:
        """The first target, in the list's order, that matches `module`."""
        exact = self._exact.get(module, [len(self._targets)])[0]
        for index in self._others:
            if index > exact:
                break
            if self._hits(index, module):
                return self._targets[index]
        return self._targets[exact] if exact < len(self._targets) else None

    def best(self, module: str) -> tuple[int, list[_Target]]:
        """The best rank at which targets match `module` and those targets, in the list's
        order: the exact names, else the `re:` targets (not run where an exact name, which
        outranks them, matches), else the class names (`self.classes`, for every module)."""
        exact = self._exact.get(module)
        if exact:
            return EXACT, [self._targets[i] for i in exact]
        hits = [t for t in self._regexes if self._matches(t, module)]
        return (REGEX, hits) if hits else (CLASS, self.classes)

    def _matches(self, target: _Target, module: str) -> bool:
        assert target.pattern is not None
        try:
            return target.pattern.match(module, self._budget)
        except OverBudget:
            raise rules.refuse(
                target.where,
                f"target {target.text!r}: matching the module names needs more than "
                f"{self._budget.limit:,} steps, the budget for this config and these names",
            ) from None


SHOWN_GROUPS = 3  # groups an ambiguity names; the rest counted (one line, however many)


def _decide(matched: list[_Target]) -> tuple[str | None, str]:
    """The group that targets at one rank decide, or None and why: none, or two or more
    (named by their first target at that rank)."""
    if not matched:
        return None, "no config group of config.json targets it"
    first_text: dict[str, str] = {}
    for target in matched:
        first_text.setdefault(target.group, target.text)
    if len(first_text) == 1:
        return next(iter(first_text)), ""
    said = " and ".join(f"{g!r} ({t!r})" for g, t in list(first_text.items())[:SHOWN_GROUPS])
    if len(first_text) > SHOWN_GROUPS:
        said += f" and {len(first_text) - SHOWN_GROUPS:,} more"
    return None, f"config groups {said} both target it: ambiguous"


def work_budget(modules: list[str], targets: list[_Target]) -> Budget:
    """WORK_BASE, plus WORK_PER_CHARACTER for each character of the module names and of
    the targets: the text the matching is asked about."""
    characters = sum(len(m) for m in modules) + sum(len(t.text) for t in targets)
    return Budget(WORK_BASE + WORK_PER_CHARACTER * characters)


class Assignment(NamedTuple):
    """Stored tensors split by the group their module takes, and those whose module no
    group (or two groups) decide, with why."""

    by_group: dict[str, tuple[dict[str, TensorInfo], dict[str, Any]]]
    undecided: dict[str, tuple[dict[str, TensorInfo], str]]  # module -> (tensors, why)


def assign(
    stored: Mapping[str, TensorInfo], config: Mapping[str, Any], budget: Budget | None = None
) -> Assignment | None:
    """The tensors of each config group's modules with a config of that group alone, or
    None where the config is not compressed-tensors' or names no group (the top-level
    `format` then describes every tensor). One group is matched as two are: compressed-
    tensors quantizes no module that `ignore` names or no group targets. Matching that
    would need more than `budget` (default: work_budget) is refused, exit 3."""
    groups = config.get("config_groups")
    if rules.method_of(config) != "compressed-tensors" or not isinstance(groups, dict):
        return None
    if not groups or not all(isinstance(g, dict) for g in groups.values()):
        return None  # a malformed group: the schemes' own checks refuse it
    sizes, remembered = Budget(MAX_CONFIG_SIZE), Budget(MAX_CACHED_STATES)
    targets: list[_Target] = []
    for key, group in groups.items():
        where = f"config.json: config_groups[{key!r}].targets"
        targets += _targets(group.get("targets"), where, key, sizes, remembered)
    ignore_value = config.get("ignore", [])
    ignore_list = [] if ignore_value is None else ignore_value
    ignored = _targets(ignore_list, "config.json: ignore", "", sizes, remembered)
    ignored = [t for t in ignored if t.rank != CLASS]  # a quantized module is no ignored class
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for name, info in stored.items():
        by_module.setdefault(name.rpartition(".")[0], {})[name] = info
    if budget is None:
        budget = work_budget(list(by_module), targets + ignored)
    ignore_matcher, target_matcher = _Matcher(ignored, budget), _Matcher(targets, budget)
    top = config.get("format")
    out = Assignment(
        {
            key: ({}, {**config, "config_groups": {key: group}, "format": group.get("format", top)})
            for key, group in groups.items()
        },
        {},
    )
    by_class: tuple[str | None, str] | None = None
    for module, tensors in by_module.items():
        hit = ignore_matcher.first(module)
        if hit is not None:
            out.undecided[module] = (tensors, f"config.json's ignore entry {hit.text!r} names it")
            continue
        rank, matched = target_matcher.best(module)
        if rank == CLASS:  # the same targets for every module: decided once
            if by_class is None:
                by_class = _decide(matched)
            winner, why = by_class
        else:
            winner, why = _decide(matched)
        if winner is None:
            out.undecided[module] = (tensors, why)
            continue
        out.by_group[winner][0].update(tensors)
    return out
