"""Where each tensor of a safetensors file begins, found by name.

A dict of name -> int held ~70 bytes a tensor (the dict's entry and an int object): 13.7 MB
of a 200,000-tensor clip's peak. Here the begins are one array in file order (8 bytes a
tensor), and a name is found by bisection in the names sorted once (lists of the names the
listing already holds, in both orders, 16 bytes a tensor, and a 4-byte position each).
A lookup costs ~0.3 us; tensors asked for in file order, as a batch of small ones is, cost
one lookup in all.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence


class TensorOffsets:
    def __init__(self, names: Sequence[str], begins: Sequence[int]) -> None:
        """names and their begins in file order; names are unique (the header's rules)."""
        self._begins = array("q", begins)
        order = sorted(range(len(names)), key=names.__getitem__)
        self._sorted_names = [names[i] for i in order]
        self._positions = array("i", order)  # file position of each sorted name (< 2**31)
        self._file_names = names  # what next_in_file() compares with (not copied)

    def __len__(self) -> int:
        return len(self._begins)

    def __eq__(self, other: object) -> bool:
        """The same names beginning at the same offsets, in the same file order."""
        if not isinstance(other, TensorOffsets):
            return NotImplemented
        return list(self._file_names) == list(other._file_names) and self._begins == other._begins

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the dict it replaced

    def __repr__(self) -> str:
        return f"TensorOffsets({dict(zip(self._file_names, self._begins, strict=True))!r})"

    def position(self, name: str) -> int:
        """The tensor's position in file order; KeyError for a name the file lacks."""
        at = bisect.bisect_left(self._sorted_names, name)
        if at == len(self._sorted_names) or self._sorted_names[at] != name:
            raise KeyError(name)
        return self._positions[at]

    def begin(self, name: str) -> int:
        return self._begins[self.position(name)]

    def begins(self, names: Sequence[str]) -> list[int]:
        """Each name's begin: one bisection for the first, then each following name that
        is the next in the file is taken from there (a run of tensors in file order)."""
        if not names:
            return []
        at = self.position(names[0])
        found = [self._begins[at]]
        file_names, count = self._file_names, len(self._begins)
        for name in names[1:]:
            at += 1
            if at >= count or file_names[at] != name:
                at = self.position(name)
            found.append(self._begins[at])
        return found
