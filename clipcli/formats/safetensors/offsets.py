"""Where each tensor of a safetensors file begins, found by name: one array of begins in
file order (8 bytes a tensor) and the names' positions (formats.names), where a dict of
name -> int held ~70 bytes a tensor (13.7 MB of a 200,000-tensor clip's peak)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from clipcli.formats.names import NamePositions


class TensorOffsets:
    def __init__(self, names: Sequence[str], begins: Iterable[int]) -> None:
        """names and their begins in file order; names are distinct (the header's rules).
        The names are sorted on the first lookup: `ls` never makes one."""
        self._names = names
        self._found: NamePositions | None = None
        self._begins = array("q", begins)

    @property
    def _position(self) -> NamePositions:
        found = self._found
        if found is None:  # two threads may both make it: the same, and either is kept
            found = self._found = NamePositions(self._names)
        return found

    def __len__(self) -> int:
        return len(self._begins)

    def __eq__(self, other: object) -> bool:
        """The same names beginning at the same offsets, in the same file order."""
        if not isinstance(other, TensorOffsets):
            return NotImplemented
        same_names = list(self._names) == list(other._names)
        return same_names and self._begins == other._begins

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the dict it replaced

    def __repr__(self) -> str:
        pairs = zip(self._names, self._begins, strict=True)
        return f"TensorOffsets({dict(pairs)!r})"

    def position(self, name: str) -> int:
        """The tensor's position in file order; KeyError for a name the file lacks."""
        return self._position(name)

    def begin(self, name: str) -> int:
        return self._begins[self._position(name)]

    def begins(self, names: Sequence[str]) -> list[int]:
        """Each name's begin (a run of tensors in file order costs one lookup)."""
        begins = self._begins
        return [begins[at] for at in self._position.of_run(names)]
