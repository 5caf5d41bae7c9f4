"""What the measuring pass found: per-tensor statistics, the global norm, group shares.

Plain data, computed by clipcli.jobs.pipeline and read by the planner and the report.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.formats.base import TensorInfo
from clipcli.jobs import roles
from clipcli.jobs.groups import compile_group_by, group_key, group_order
from clipcli.numerics.norms import NormAccumulator, global_norm

if TYPE_CHECKING:
    import numpy as np

    from clipcli.logical.view import QuantizedRows


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class TensorStats(NamedTuple):
    info: TensorInfo
    stats: NormAccumulator  # finished: nothing adds to it any more
    # stats.norm, worked out once: the row, the global norm, the plan and the clip report
    # each ask it of every tensor (checkpoints of 200,000 tensors).
    norm: float
    in_global: bool  # selected, a model weight (or --all-tensors) and floating point
    role: roles.Role = roles.Role.WEIGHT
    selected: bool = True  # by --include/--exclude
    tied_to: str | None = None  # the same values as this earlier tensor: not in_global

    # What the factor search reads of a member (numerics.scaling.Measured): a tensor
    # as it is stored, its output its own values rounded to its own dtype.
    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.info.dtype

    @property
    def numel(self) -> int:
        return self.info.numel

    @property
    def rounded_elsewhere(self) -> bool:
        return False

    @property
    def power_of_two(self) -> bool:
        return False


class GroupStats(NamedTuple):
    name: str
    tensors: int
    norm: float
    share: float  # of the global norm squared


class Measurement(NamedTuple):
    path: Path
    format: str
    metadata: dict[str, str]
    tensors: list[TensorStats]
    quantized: QuantizedRows | None = None  # what rows say of quantized weights

    @property
    def global_norm(self) -> float:
        return global_norm(t.norm for t in self.tensors if t.in_global)

    def groups(self, group_by: str) -> list[GroupStats]:
        """Floating-point tensors aggregated by --group-by, in natural name order (layer 2
        before layer 10; file order is no guide: safetensors and h5py sort names as text)."""
        pattern = compile_group_by(group_by)
        members: dict[str, list[float]] = {}
        for t in self.tensors:
            if t.in_global:
                members.setdefault(group_key(t.info.name, pattern), []).append(t.norm)
        total = self.global_norm
        result = []
        for name, norms in sorted(members.items(), key=lambda item: group_order(item[0])):
            norm = global_norm(norms)
            share = (norm / total) ** 2 if total > 0 and math.isfinite(total) else math.nan
            result.append(GroupStats(name, len(norms), norm, share))
        return result
