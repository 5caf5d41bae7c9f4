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
groups), never read with a guessed scheme.

The regular expressions come from a file: they are run by a small automaton here (a
subset of Python's syntax, linear in the name's length), never by Python's backtracking
`re`, whose worst case a hostile pattern could make take hours.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.logical.quantized import rules

if TYPE_CHECKING:
    from clipcli.formats.base import TensorInfo

MAX_PATTERN = 1000  # characters of one `re:` target
MAX_PROGRAM = 5000  # automaton states of one pattern (counted repeats expand)
MAX_REPEAT = 100  # the largest count of {m,n}
MAX_CACHED = 4096  # state sets remembered per pattern (a lazy DFA); past it, computed again

EXACT, REGEX, CLASS = 0, 1, 2  # match ranks: lower wins (compressed-tensors' order)


# ------------------------------------------------------------------ regular expressions


class _Nfa:
    """A Thompson automaton: `edges[s]` (test, next) consume one character, `eps[s]` the
    states reached without one; `end_only[s]`: `$`, passed only at the end."""

    def __init__(self) -> None:
        self.edges: list[tuple[Any, int] | None] = []
        self.eps: list[list[int]] = []
        self.end_only: list[int | None] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_PROGRAM:
            raise ValueError(f"more than {MAX_PROGRAM} states")
        self.edges.append(None)
        self.eps.append([])
        self.end_only.append(None)
        return len(self.edges) - 1


Test = Callable[[str], bool]  # does one character pass


def _digit(c: str) -> bool:
    return c.isdigit() and c.isascii()


def _word(c: str) -> bool:
    return (c.isalnum() and c.isascii()) or c == "_"


def _space(c: str) -> bool:
    return c in " \t\n\r\f\v"


_CLASSES: dict[str, Test] = {"d": _digit, "w": _word, "s": _space}


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.nfa = _Nfa()

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise ValueError("ends early")
        c = self.p[self.i]
        self.i += 1
        return c

    # Each parse_* returns a fragment (start, end) of states; end has no edges yet.
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
            f_start, f_end = self.atom()
            f_start, f_end = self.quantified(begin, f_start, f_end)
            self.nfa.eps[end].append(f_start)
            end = f_end
        return start, end

    def atom(self) -> tuple[int, int]:
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise ValueError("only (...) and (?:...) groups")
            inner = self.alternation()
            if self.take() != ")":
                raise ValueError("unbalanced parenthesis")
            return inner
        if c == "$":
            start, end = self.nfa.state(), self.nfa.state()
            self.nfa.end_only[start] = end
            return start, end
        if c == "^":
            if self.i != 1:
                raise ValueError("^ only at the start")
            s = self.nfa.state()
            return s, s
        if c in "*+?{":
            raise ValueError(f"nothing to repeat at {self.i - 1}")
        if c in ")]":
            raise ValueError(f"unbalanced {c}")
        return self.edge(self.char_test(c))

    def edge(self, test: Any) -> tuple[int, int]:
        start, end = self.nfa.state(), self.nfa.state()
        self.nfa.edges[start] = (test, end)
        return start, end

    def char_test(self, c: str) -> Any:
        if c == ".":
            return lambda x: x != "\n"
        if c == "[":
            return self.bracket()
        if c == "\\":
            return self.escape()
        return c.__eq__

    def escape(self) -> Any:
        e = self.take()
        if e.lower() in _CLASSES:
            test = _CLASSES[e.lower()]
            return test if e.islower() else (lambda x: not test(x))
        if e.isalnum():
            raise ValueError(f"escape \\{e} is not supported")
        return e.__eq__

    def bracket(self) -> Any:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        tests: list[Any] = []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                tests.append(self.escape())
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                high = self.take()
                if high == "\\":
                    high = self.take()
                low = c
                tests.append(lambda x, lo=low, hi=high: lo <= x <= hi)
            else:
                tests.append(c.__eq__)
        return lambda x: any(t(x) for t in tests) != negate

    def quantified(self, begin: int, start: int, end: int) -> tuple[int, int]:
        c = self.peek()
        if c is None or c not in "*+?{":
            return start, end
        if c == "{":
            low, high = self.counts()
        else:
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":  # lazy: the same matches, for a yes/no answer
            self.i += 1
        return self.repeat(begin, (start, end), low, high)

    def counts(self) -> tuple[int, int | None]:
        close = self.p.find("}", self.i)
        if close < 0:
            raise ValueError("unclosed {")
        body = self.p[self.i + 1 : close]
        self.i = close + 1
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text)
            high = low if not comma else (int(high_text) if high_text else None)
        except ValueError:
            raise ValueError(f"{{{body}}} is not a count") from None
        if low > MAX_REPEAT or (high is not None and not low <= high <= MAX_REPEAT):
            raise ValueError(f"{{{body}}}: counts up to {MAX_REPEAT}")
        return low, high

    def copy(self, begin: int) -> tuple[int, int]:
        """A fresh fragment for the atom at pattern position `begin` (counted repeats)."""
        saved = self.i
        self.i = begin
        fragment = self.atom()
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

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"longer than {MAX_PATTERN} characters")
        parser = _Parser(pattern)
        start, self._accept = parser.alternation()
        if parser.i != len(pattern):
            raise ValueError(f"unbalanced ) at {parser.i}")
        self._nfa = parser.nfa
        self._start = self._closure({start}, at_end=False)
        self._start_end = self._closure({start}, at_end=True)
        self._steps: dict[tuple[frozenset[int], str, bool], frozenset[int]] = {}

    def _closure(self, states: set[int], at_end: bool) -> frozenset[int]:
        seen = set(states)
        todo = list(states)
        while todo:
            s = todo.pop()
            nxt = list(self._nfa.eps[s])
            if at_end and self._nfa.end_only[s] is not None:
                nxt.append(self._nfa.end_only[s])  # type: ignore[arg-type]
            for t in nxt:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def match(self, name: str) -> bool:
        current = self._start_end if not name else self._start
        last = len(name) - 1
        for index, c in enumerate(name):
            if self._accept in current:
                return True
            key = (current, c, index == last)
            step = self._steps.get(key)
            if step is None:
                moved = set()
                for state in current:
                    edge = self._nfa.edges[state]
                    if edge is not None and edge[0](c):
                        moved.add(edge[1])
                step = self._closure(moved, at_end=index == last)
                if len(self._steps) < MAX_CACHED:
                    self._steps[key] = step
            current = step
            if not current:
                return False
        return self._accept in current


# ------------------------------------------------------------------ groups


class _Target(NamedTuple):
    group: str
    rank: int  # EXACT, REGEX or CLASS
    text: str
    pattern: Pattern | None


def _is_class(target: str) -> bool:
    return "." not in target and target[:1].isupper() and target.isidentifier()


def _compiled(text: str, where: str) -> Pattern:
    try:
        return Pattern(text)
    except ValueError as exc:
        raise rules.refuse(where, f"target {'re:' + text!r}: {exc}") from None


def _targets(value: object, where: str, group: str) -> list[_Target]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise rules.refuse(where, "is not a list of strings")
    found = []
    for text in value:
        if text.startswith("re:"):
            found.append(_Target(group, REGEX, text, _compiled(text[3:], where)))
        else:
            found.append(_Target(group, CLASS if _is_class(text) else EXACT, text, None))
    return found


def _matches(target: _Target, module: str) -> bool:
    if target.rank == REGEX:
        assert target.pattern is not None
        return target.pattern.match(module)
    return target.rank == CLASS or target.text == module


class Assignment(NamedTuple):
    """Stored tensors split by the group their module takes, and those whose module no
    group (or two groups) decide, with why."""

    by_group: dict[str, tuple[dict[str, TensorInfo], dict[str, Any]]]
    undecided: dict[str, tuple[dict[str, TensorInfo], str]]  # module -> (tensors, why)


def assign(stored: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> Assignment | None:
    """The tensors of each config group's modules with a config of that group alone, or
    None where the config has fewer than two groups (every module then takes the one
    group's scheme, as it always did) or is not compressed-tensors'."""
    groups = config.get("config_groups")
    if rules.method_of(config) != "compressed-tensors" or not isinstance(groups, dict):
        return None
    if len(groups) < 2 or not all(isinstance(g, dict) for g in groups.values()):
        return None  # a malformed group: the schemes' own checks refuse it
    targets: list[_Target] = []
    for key, group in groups.items():
        targets += _targets(
            group.get("targets"), f"config.json: config_groups[{key!r}].targets", key
        )
    ignore_value = config.get("ignore", [])
    ignored = _targets([] if ignore_value is None else ignore_value, "config.json: ignore", "")
    ignored = [t for t in ignored if t.rank != CLASS]  # a quantized module is no ignored class
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for name, info in stored.items():
        by_module.setdefault(name.rpartition(".")[0], {})[name] = info
    top = config.get("format")
    out = Assignment(
        {
            key: ({}, {**config, "config_groups": {key: group}, "format": group.get("format", top)})
            for key, group in groups.items()
        },
        {},
    )
    for module, tensors in by_module.items():
        hit = next((t for t in ignored if _matches(t, module)), None)
        if hit is not None:
            out.undecided[module] = (tensors, f"config.json's ignore entry {hit.text!r} names it")
            continue
        matched = [t for t in targets if _matches(t, module)]
        if not matched:
            out.undecided[module] = (tensors, "no config group of config.json targets it")
            continue
        best = min(t.rank for t in matched)
        winners = list(dict.fromkeys(t.group for t in matched if t.rank == best))
        if len(winners) > 1:
            said = " and ".join(
                f"{g!r} ({next(t.text for t in matched if t.group == g and t.rank == best)!r})"
                for g in winners
            )
            out.undecided[module] = (tensors, f"config groups {said} both target it: ambiguous")
            continue
        out.by_group[winners[0]][0].update(tensors)
    return out
