"""Where each of many distinct names stands in a list, found by name.

A dict of name -> position holds ~70 bytes a name (its entry and an int object): for a
checkpoint of 200,000 tensors, 13 MB for each map kept through a clip. Here the names are
sorted once beside their positions (8 bytes of list and 4 of position a name, beside the
list of names itself), and a name is found by bisection, ~0.3 us. Callers mostly ask in
list order, a few times about each name in turn, so the place last found and the one after
it are tried first: a run asked in order costs one bisection.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from array import array
from collections.abc import Sequence


class NamePositions:
    def __init__(self, names: Sequence[str]) -> None:
        """names, in their order (kept, not copied); ValueError if one is repeated (the
        bisection would find one of them: a dict kept the last)."""
        order = sorted(range(len(names)), key=names.__getitem__)
        self._names = names
        self._sorted = [names[i] for i in order]
        if any(map(operator.eq, self._sorted, itertools.islice(self._sorted, 1, None))):
            raise ValueError("a name is listed twice")
        self._places = array("i", order)  # the position of each sorted name (< 2**31)
        self._last = 0  # a hint only: each use checks it, so threads may race on it

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> Sequence[str]:
        return self._names

    def __call__(self, name: str) -> int:
        """The name's position; KeyError for a name not in the list."""
        names, last = self._names, self._last
        if last < len(names) and names[last] == name:
            return last
        if last + 1 < len(names) and names[last + 1] == name:
            self._last = last + 1
            return last + 1
        at = bisect.bisect_left(self._sorted, name)
        if at == len(self._sorted) or self._sorted[at] != name:
            raise KeyError(name)
        found = self._last = self._places[at]
        return found

    def of_run(self, names: Sequence[str]) -> list[int]:
        """Each name's position: the first one looked up, then each name that is the next
        in the list taken from the one before (a batch of small tensors is a run in order:
        one comparison a name, ~4x cheaper than a lookup each), a lookup where it breaks."""
        if not names:
            return []
        listed = self._names
        at = self(names[0])
        found = [at]
        for name in itertools.islice(names, 1, None):
            at += 1
            if at >= len(listed) or listed[at] != name:
                at = self(name)
            found.append(at)
        return found
