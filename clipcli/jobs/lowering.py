"""A plan on logical tensors, lowered to a plan on the stored tensors the write pass
writes; and what the write pass did, lifted back to the logical tensors the report shows.

A plain logical tensor is its stored tensor: its TensorPlan is carried over as it is. A
logical tensor made of several stored ones (a quantized weight, a toy "two halves"):
- KEEP: every part kept byte for byte;
- SCALE by f: the view's scaled_parts() scaled by f (each rounded once, as the factor
  search's check assumed), the other parts (codes, zero points) kept byte for byte; a
  part whose scales are fields inside its bytes (GGUF blocks) is rewritten by the view's
  stored_scaler (stored_scalers), the rest of its bytes kept;
- anything else (CLAMP, AXES) cannot act through the parts: refused, exit 4, before
  anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from clipcli.errors import DataRefusedError
from clipcli.jobs.plan import Action, Outcome, Plan, TensorPlan
from clipcli.logical.reader import LogicalReader
from clipcli.numerics.norms import NormAccumulator, accumulate

if TYPE_CHECKING:
    import numpy as np

ChunkScaler = Callable[["np.ndarray", float, int], "np.ndarray"]
ChunkFunction = Callable[["np.ndarray"], "np.ndarray"]


def check_lowerable(plan: Plan, reader: LogicalReader) -> None:
    """Refuse (exit 4) an action no stored tensor can carry out, before OUT exists."""
    for p in plan.tensors:
        t = reader.by_name.get(p.info.name)
        if t is None or t.plain or p.action is Action.KEEP:
            continue
        if p.action is Action.SCALE:
            assert p.factor is not None
            why = reader.view.refused_factor(reader.stored, t, p.factor, p.exponent)
            if why is not None:
                raise DataRefusedError(
                    f"{why}; nothing was written: choose a larger limit, or leave the weight "
                    "out with --exclude"
                )
            continue
        raise DataRefusedError(
            f"{p.info.name}: a {t.scheme} weight cannot be clipped by {p.action.value}"
            " through its stored tensors (only by one factor per tensor, group or checkpoint)"
        )


def lower(plan: Plan, reader: LogicalReader) -> Plan:
    """`plan` as actions on every stored tensor, in stored order."""
    check_lowerable(plan, reader)
    stored = {info.name: info for info in reader.stored.infos}
    empty = NormAccumulator()
    lowered: dict[str, TensorPlan] = {}
    # A side tensor may also be a part (a quantized weight's scale, listed with its role):
    # the logical tensor's action on it wins over the listing's KEEP, in either order.
    parts = {part.name for t in reader.logical if not t.plain for part in t.parts}
    # A part listed as a side tensor was measured as stored: a part kept byte for byte is
    # reported with those figures before and after, never with an empty measurement.
    measured = {p.info.name: p.before for p in plan.tensors if p.info.name in parts}
    for p in plan.tensors:
        t = reader.by_name.get(p.info.name)
        if t is None:  # a side tensor: stored as it is listed
            if p.info.name not in parts:
                lowered[p.info.name] = replace(p, info=stored[p.info.name])
            continue
        if t.plain and len(t.parts) == 1:
            lowered[t.parts[0].name] = replace(p, info=stored[t.parts[0].name])
            continue
        scaled = set(reader.view.scaled_parts(t)) if p.action is Action.SCALE else set()
        for part in t.parts:
            info = stored[part.name]
            before = measured.get(part.name, empty)
            if part.name in scaled:
                lowered[part.name] = replace(p, info=info, before=before, group=None)
            else:
                lowered[part.name] = TensorPlan(info, before, Action.KEEP, p.reason, p.role)
    missing = [name for name in stored if name not in lowered]
    if missing:  # a view that forgot a stored tensor would drop it from OUT
        raise AssertionError(f"the view left stored tensors out: {missing[:3]}")
    return Plan(plan.spec, tuple(lowered[name] for name in stored), plan.used_norm)


def stored_scalers(plan: Plan, reader: LogicalReader) -> dict[str, ChunkFunction]:
    """The stored tensors of the lowered `plan` whose SCALE rewrites fields inside their
    bytes (View.stored_scaler: GGUF's block scales), each with its chunk function; every
    other scaled stored tensor is scaled value by value."""
    scalers: dict[str, ChunkFunction] = {}
    for p in plan.tensors:
        t = reader.by_name.get(p.info.name)
        if t is None or t.plain or p.action is not Action.SCALE or p.factor is None:
            continue
        for part in reader.view.scaled_parts(t):
            scale = reader.view.stored_scaler(t, part)
            if scale is not None:
                scalers[part] = _bound(scale, p.factor, p.exponent)
    return scalers


def _bound(scale: ChunkScaler, mantissa: float, exponent: int) -> ChunkFunction:
    return lambda chunk: scale(chunk, mantissa, exponent)


def lift(
    plan: Plan, lowered: Plan, outcomes: list[Outcome], reader: LogicalReader
) -> list[Outcome]:
    """One Outcome per logical tensor of `plan`, from the stored tensors' outcomes. A
    scaled logical tensor's norm after is measured from what was written (its real values
    under the rounded stored scales)."""
    by_stored = {p.info.name: o for p, o in zip(lowered.tensors, outcomes, strict=True)}
    lifted = []
    for p in plan.tensors:
        t = reader.by_name.get(p.info.name)
        if t is None:
            lifted.append(by_stored[p.info.name])
        elif t.plain and len(t.parts) == 1:
            lifted.append(by_stored[t.parts[0].name])
        elif p.action is Action.SCALE and p.factor is not None:
            changed = any(by_stored[part.name].changed for part in t.parts)
            lifted.append(Outcome(_scaled_statistics(reader, p), changed=changed))
        else:
            lifted.append(Outcome(p.before, changed=False))
    return lifted


def _scaled_statistics(reader: LogicalReader, p: TensorPlan) -> NormAccumulator:
    """The statistics of a scaled logical tensor's values as written: its view's
    measured pieces under the factor (code tables, one decoding pass) in worker threads
    where it has them, else its scaled chunks."""
    from clipcli.system.parallel import loaded

    assert p.factor is not None
    loaders = reader.scaled_measured_loaders(p.info, p.factor, p.exponent)
    if loaders is None:
        return accumulate(reader.scaled_chunks(p.info, p.factor, p.exponent))
    total = NormAccumulator()
    for piece in loaded(loaders):
        total.merge(piece)
    return total
