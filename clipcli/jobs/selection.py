"""--include/--exclude/--all-tensors: which tensors a command acts on, by name alone."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from clipcli.jobs import roles, scope

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo
    from clipcli.jobs.measurement import TensorStats
    from clipcli.numerics.norms import NormAccumulator


class Named(Protocol):
    """Anything with a tensor's name: a TensorInfo, or what `ls` lists (formats.base.Listed)."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)


@dataclass(frozen=True)
class Selection:
    """--include/--exclude globs on tensor names; exclude wins."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    all_tensors: bool = False  # --all-tensors: training state counts too (clipcli.jobs.roles)
    # Stored tensors that are parts of a logical tensor without being values (scales):
    # kept apart whatever the flags (clipcli.logical).
    parts: frozenset[str] = frozenset()
    # Tied tensors (clipcli.logical: one view of one storage under two names) -> the first
    # name: measured and acted on as selected, but counted once, as the first.
    tied: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not self.exclude or not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)

    def left_out(self, name: str) -> roles.Role | None:
        """The role that keeps a tensor out of norms and clipping, None if it counts."""
        if name in self.parts:
            return roles.Role.QUANTIZATION
        if self.all_tensors:
            return None
        role = roles.classify(name)
        return None if role is roles.Role.WEIGHT else role

    def check(self, infos: Sequence[N], notify: scope.Notify) -> list[N]:
        """The selected tensors; an empty selection is refused (exit 2) before any data is
        read, and patterns that match nothing are warned about."""
        selected = [info for info in infos if self(info.name)]
        names = [info.name for info in infos]
        scope.check_patterns(names, self.include, self.exclude, [i.name for i in selected], notify)
        return selected

    def check_weights(
        self, selected: Sequence[TensorInfo], notify: scope.Notify, writes: bool = False
    ) -> list[TensorInfo]:
        """Training state is left out (one note line, worded for a command that `writes`
        or only measures); a selection of nothing else is refused (exit 2). The selected
        tensors acted on, in order: those left_out() lets through (each name classified
        once: 200,000 tensors)."""
        kept_out = scope.left_out(selected, self.all_tensors)
        scope.check_roles(selected, kept_out)
        note = scope.left_out_note(kept_out, writes)
        if note is not None:
            notify("note", note)
        parts = self.parts
        return [i for i in selected if i.name not in parts and i.name not in kept_out]

    def describe(self, info: TensorInfo, stats: NormAccumulator) -> TensorStats:
        """How a measured tensor counts: selected or not, its role, in the global norm."""
        is_floating, TensorStats = _measuring()
        selected = self(info.name)
        floating = is_floating(info.dtype)
        kept_out = self.left_out(info.name) if selected else None
        tied_to = self.tied.get(info.name)
        counts = selected and kept_out is None and floating and tied_to is None
        role = kept_out or (roles.Role.WEIGHT if floating else roles.Role.NON_FLOAT)
        return TensorStats(info, stats, stats.norm, counts, role, selected, tied_to)


@functools.cache
def _measuring() -> tuple[Callable[[np.dtype[Any]], bool], type[TensorStats]]:
    """What describe() needs, imported on its first call (selecting by name, as in
    `ls --include`, needs no numpy), then kept: an import statement costs ~1 us, and
    describe() runs once per tensor."""
    from clipcli.dtypes import is_floating
    from clipcli.jobs.measurement import TensorStats

    return is_floating, TensorStats


EVERY_TENSOR = Selection()  # no patterns: every tensor, training state left out
