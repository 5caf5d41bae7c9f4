"""Carrying out a clip: the factor search's data pass (output_check), the early copy of
tensors the plan will leave alone (copy_ahead_hook), and execute(plan) -> outcomes, every
tensor streamed through pipeline.write_tensors. A dry run executes into DiscardingWriter.

Apart from clipcli.jobs.pipeline (the streaming passes that norms uses too) so that measuring
imports no plan, rounding or --axes module: `clipcli norms` in a shell loop pays only for
what it runs (issue 12, item 7).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer
from clipcli.formats.names import NamePositions
from clipcli.jobs.factor import OutputCheck
from clipcli.jobs.measurement import TensorStats
from clipcli.jobs.pipeline import map_chunks, small_runs, write_tensors
from clipcli.jobs.plan import (
    NOTHING_FLUSHED,
    Action,
    EarlyVerdict,
    Flushes,
    Outcome,
    Plan,
    TensorPlan,
)
from clipcli.jobs.progress import SILENT, LockedProgress, Progress
from clipcli.jobs.spec import ClipSpec
from clipcli.logical.reader import LogicalReader
from clipcli.numerics import rounding, slices
from clipcli.numerics.certain import CertainSumsq, sumsq_each
from clipcli.numerics.many import norms_each
from clipcli.numerics.norms import KnownNorm, NormAccumulator, accumulate, accumulate_array
from clipcli.system import interrupts
from clipcli.system.parallel import loaded, machine_worker_count, ordered_map, worker_count

# ---------------------------------------------------------------- while measuring


def copy_ahead_hook(
    spec: ClipSpec, reader: Reader, writer: Writer
) -> Callable[[TensorStats], None]:
    """Hands the writer each measured tensor that the plan will most likely leave alone."""
    verdict = EarlyVerdict(spec)

    def on_measured(t: TensorStats) -> None:
        if verdict.unchanged(t):
            writer.copy_ahead(reader, t.info)

    return on_measured


def output_check(reader: Reader) -> OutputCheck:
    """The factor search's data pass: the certain sum of squares of the tensors scaled by
    mantissa * 2**exponent and rounded (clipcli.jobs.factor.OutputCheck). Only a logical
    reader's check asks the optional questions (rounded_elsewhere, power_of_two): of a
    stored tensor the answer is always no, and the search then skips 200,000 of them."""
    if isinstance(reader, LogicalReader):
        return _LogicalOutputCheck(reader)
    return _OutputCheck(reader)


class _OutputCheck:
    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    def __call__(self, infos: Sequence[TensorInfo], mantissa: float, exponent: int) -> CertainSumsq:
        total = CertainSumsq()
        reader = self._reader
        together: frozenset[str] = frozenset()
        rounded = [info for info in infos if self._rounded_elsewhere(info)]
        if rounded:  # the weights whose code energies are kept: one sum for them all
            assert isinstance(reader, LogicalReader)
            together, energy = reader.energy_sumsq_together(rounded, mantissa, exponent)
            if energy is not None:
                each = [info for info in rounded if info.name in together]
                of_each = functools.partial(_decoded_sumsq_of, reader, each, mantissa, exponent)
                total.add_bounded(energy[0], energy[1], of_each)
        plain = []
        for info in infos:
            if info.name in together:
                continue
            if self._rounded_elsewhere(info):
                assert isinstance(reader, LogicalReader)
                total.merge(_scaled_sumsq(reader, info, mantissa, exponent))
                continue
            plain.append(info)
        self._add_plain([plain], [total], mantissa, exponent)
        return total

    def each(
        self, groups: Sequence[Sequence[TensorInfo]], mantissa: float, exponent: int
    ) -> list[CertainSumsq]:
        """self(group, mantissa, exponent) of each group, in order, in one go. For a plain
        check only (nothing rounded elsewhere)."""
        totals = [CertainSumsq() for _ in groups]
        self._add_plain(groups, totals, mantissa, exponent)
        return totals

    def _add_plain(
        self,
        groups: Sequence[Sequence[TensorInfo]],
        totals: Sequence[CertainSumsq],
        mantissa: float,
        exponent: int,
    ) -> None:
        """Add to each group's total the certain sum of squares of its tensors scaled and
        rounded. Small tensors are read many at a time (pipeline.small_runs,
        Reader.loader_of_many): consecutive members of one group summed as one array,
        a member alone in its group with the others so (certain.sumsq_each), the rest
        chunk by chunk. A read and a task per tensor cost ~100 us: a float64 checkpoint
        of 193,600 tensors took 20 s a check. A sum with a bound comes with the way to work
        it out exactly (exact_on_demand): the decisions are exact whichever way it was
        summed."""
        infos = [info for group in groups for info in group]
        owner = [g for g, group in enumerate(groups) for _ in group]
        for run in small_runs(infos, _always):
            load = self._reader.loader_of_many([infos[i] for i in run]) if len(run) > 1 else None
            if load is None:
                for i in run:
                    totals[owner[i]].merge(self._chunk_by_chunk(infos[i], mantissa, exponent))
                continue
            interrupts.check()  # a pass over the data: a signal must not wait for its end
            arrays = load()
            if (mantissa, exponent) != (1.0, 0):  # by 1, each value rounds to itself
                arrays = [rounding.scale_chunk(array, mantissa, exponent) for array in arrays]
            alone: list[int] = []
            for _, members in itertools.groupby(range(len(run)), key=lambda k: owner[run[k]]):
                ks = list(members)
                if len(ks) == 1:
                    alone.append(ks[0])
                    continue
                part = _sumsq_together([arrays[k] for k in ks])
                these = [infos[run[k]] for k in ks]
                exactly = functools.partial(self._exactly, these, mantissa, exponent)
                totals[owner[run[ks[0]]]].merge(exact_on_demand(part, exactly))
            for k, part in zip(alone, sumsq_each([arrays[k] for k in alone]), strict=True):
                exactly = functools.partial(self._exactly, [infos[run[k]]], mantissa, exponent)
                totals[owner[run[k]]].merge(exact_on_demand(part, exactly))

    def _chunk_by_chunk(self, info: TensorInfo, mantissa: float, exponent: int) -> CertainSumsq:
        def scaled(chunk: np.ndarray) -> CertainSumsq:
            partial = CertainSumsq()
            partial.add(rounding.scale_chunk(chunk, mantissa, exponent))
            return partial

        tensor = CertainSumsq()
        for partial in map_chunks(self._reader, info, scaled):
            interrupts.check()  # a pass over the data: a signal must not wait for its end
            tensor.merge(partial)
        exactly = functools.partial(self._exactly, [info], mantissa, exponent)
        return exact_on_demand(tensor, exactly)

    def _exactly(self, infos: Sequence[TensorInfo], mantissa: float, exponent: int) -> CertainSumsq:
        """The tensors scaled and rounded, their sum of squares exactly: read again, only
        for a decision a bound could not make (many at a time where they were so read)."""
        return self._read_sumsq(infos, mantissa, exponent, exact=True)

    def _read_sumsq(
        self, infos: Sequence[TensorInfo], mantissa: float, exponent: int, exact: bool
    ) -> CertainSumsq:
        """The tensors read in this thread, scaled and rounded, their sum of squares
        (CertainSumsq.add_exactly where `exact`, else add)."""
        total = CertainSumsq()
        add = total.add_exactly if exact else total.add
        load = self._reader.loader_of_many(infos) if len(infos) > 1 else None
        chunks = (
            load()
            if load is not None
            else itertools.chain.from_iterable(self._reader.chunks(info) for info in infos)
        )
        for chunk in chunks:
            interrupts.check()
            add(rounding.scale_chunk(chunk, mantissa, exponent))
        return total

    def _rounded_elsewhere(self, info: TensorInfo) -> bool:  # noqa: ARG002
        return False


def _always(_info: TensorInfo) -> bool:
    return True


def exact_on_demand(part: CertainSumsq, exactly: Callable[[], CertainSumsq]) -> CertainSumsq:
    """`part` (sums from CertainSumsq.add), or where its bound is not 0, the same total and
    bound with `exactly` (the same values summed with add_exactly) to work it out when a
    decision falls within the bound: a tensor of over 2,048 values whose norm is exactly C
    read as over and was clipped (attack s37b)."""
    if part.exact:
        return part
    result = CertainSumsq()
    result.add_bounded(part.total, part.bound, exactly)
    return result


def _scaled_sumsq(
    reader: LogicalReader, info: TensorInfo, mantissa: float, exponent: int
) -> CertainSumsq:
    """A logical tensor rounded in its stored scales: from its code counts where its
    scheme has them (each run in a worker, within a bound of about 2**-48 of the sum),
    summed exactly from its decoded values only when a decision falls within that bound
    (CertainSumsq.add_bounded): the search's checks land within about 1e-11 of the limit,
    so that is rare, and each check is a counting pass instead of a decoding one."""
    exactly = functools.partial(_decoded_sumsq, reader, info, mantissa, exponent, exact=True)

    def decoded() -> CertainSumsq:
        return exact_on_demand(_decoded_sumsq(reader, info, mantissa, exponent), exactly)

    loaders = reader.scaled_sumsq_loaders(info, mantissa, exponent)
    if loaders is None:
        return decoded()
    total, bound = Fraction(0), Fraction(0)
    for piece in loaded(loaders):
        if piece is None:  # NaN or infinity: as before, from the decoded values
            return decoded()
        total += piece[0]
        bound += piece[1]
    result = CertainSumsq()
    result.add_bounded(total, bound, exactly)
    return result


def _decoded_sumsq(
    reader: LogicalReader, info: TensorInfo, mantissa: float, exponent: int, exact: bool = False
) -> CertainSumsq:
    total = CertainSumsq()
    for chunk in reader.scaled_chunks(info, mantissa, exponent):
        interrupts.check()
        if exact:
            total.add_exactly(chunk)
        else:
            total.add(chunk)
    return total


def _decoded_sumsq_of(
    reader: LogicalReader, infos: Sequence[TensorInfo], mantissa: float, exponent: int
) -> CertainSumsq:
    """The weights' decoded values scaled and rounded, their sum of squares exactly."""
    total = CertainSumsq()
    for info in infos:
        total.merge(_decoded_sumsq(reader, info, mantissa, exponent, exact=True))
    return total


def _sumsq_together(arrays: Sequence[np.ndarray]) -> CertainSumsq:
    """The certain sum of squares of the arrays, those of one dtype laid end to end and
    summed in one go."""
    total = CertainSumsq()
    by_dtype: dict[np.dtype[Any], list[np.ndarray]] = {}
    for array in arrays:
        by_dtype.setdefault(array.dtype, []).append(array.reshape(-1))
    for same in by_dtype.values():
        total.add(np.concatenate(same) if len(same) > 1 else same[0])
    return total


class _LogicalOutputCheck(_OutputCheck):
    def rounded_elsewhere(self, info: TensorInfo) -> bool:
        """A logical tensor made of parts: the rounding is of its stored scales."""
        reader = self._reader
        return isinstance(reader, LogicalReader) and not reader.stored_as_is(info)

    _rounded_elsewhere = rounded_elsewhere

    def power_of_two(self, info: TensorInfo) -> bool:
        """A logical tensor whose stored scales hold powers of two only (E8M0): it takes
        the factor rounded down to a power of two (View.power_of_two_factors)."""
        reader = self._reader
        if not isinstance(reader, LogicalReader):
            return False
        t = reader.by_name.get(info.name)
        return t is not None and reader.view.power_of_two_factors(t)

    def as_values(
        self, infos: Sequence[TensorInfo], mantissa: float, exponent: int
    ) -> CertainSumsq:
        """The tensors' real values (float64) scaled and rounded as a float64 tensor's
        are: how a power-of-two tensor counts in a group with other tensors
        (clipcli.jobs.factor.search_factor)."""
        total = CertainSumsq()
        for info in infos:
            part = self._read_sumsq([info], mantissa, exponent, exact=False)
            exactly = functools.partial(self._exactly, [info], mantissa, exponent)
            total.merge(exact_on_demand(part, exactly))
        return total


# ---------------------------------------------------------------- executing


class DiscardingWriter(Writer):
    """A dry run's writer: takes every tensor (so its output is computed and measured)
    and writes nothing."""

    format_name = "none"

    def __init__(self) -> None:
        super().__init__(Path(os.devnull), Checkpoint([]))

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:  # noqa: ARG002
        for _ in chunks:
            pass

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:  # noqa: ARG002
        return True

    def copy_unchanged_many(self, source: Reader, infos: Sequence[TensorInfo]) -> bool:  # noqa: ARG002
        return True

    def close(self) -> None:
        pass


def execute(
    plan: Plan,
    reader: Reader,
    writer: Writer,
    progress: Progress = SILENT,
    label: str = "writing",
    scalers: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
) -> list[Outcome]:
    """Carry the plan out into the writer (closed at the end); what happened to each
    tensor, in plan order. The plan is not touched. `scalers`: stored tensors whose SCALE
    rewrites fields inside their bytes (clipcli.jobs.lowering.stored_scalers), by name."""
    # Where each tensor stands in the plan, by name (a dict was 7.5 MB on 200,000 tensors).
    position = NamePositions([p.info.name for p in plan.tensors])
    scalers = scalers or {}
    if writer.parts() is not None:  # told from the threads that write the parts
        progress = LockedProgress(progress)
    # Each tensor's outcome at its place in the plan (a dict by name was 7.5 MB of the
    # write pass's peak on 200,000 tensors); every place is filled by the end.
    outcomes: list[Outcome | None] = [None] * len(plan.tensors)

    def chunks_of(info: TensorInfo) -> Iterable[np.ndarray] | None:
        at = position(info.name)
        tensor = plan.tensors[at]
        if tensor.action is Action.AXES:
            if len(slices.box_indices(info.shape, slices.box_elements(info.dtype))) > 1:
                outcomes[at], scaled = _clip_slices_streamed(
                    reader, tensor, plan.spec, functools.partial(outcomes.__setitem__, at)
                )
                return None if scaled is None else _counted_out(scaled, progress)
            array, outcomes[at] = _clip_slices(reader, tensor, plan.spec)
            progress.advance(info.nbytes)
            return [array.reshape(-1)]
        transform = _transform(tensor, plan.spec)
        if transform is None:
            outcomes[at] = Outcome(tensor.before, changed=False)
            return None
        known = _scaled_outcome(tensor) if info.name not in scalers else None
        if known is not None:  # its statistics known already: the pass only scales
            outcomes[at] = known
            return _counted_out(map_chunks(reader, info, transform), progress)
        after, flushes = NormAccumulator(), Flushes()
        outcomes[at] = Outcome(after, True, 0, 0, flushes)
        count = tensor.action is Action.SCALE
        if tensor.action is Action.SCALE and info.name in scalers:
            transform, count = scalers[info.name], False  # bytes, not values
        pairs = map_chunks(reader, info, functools.partial(_with_stats, transform, count))
        return _measured(pairs, after, flushes, progress)

    def joins(info: TensorInfo) -> bool:  # --axes reads each tensor whole, on its own
        tensor = plan.tensors[position(info.name)]
        return tensor.action is not Action.AXES and info.name not in scalers

    def kept(info: TensorInfo) -> bool:
        return plan.tensors[position(info.name)].action is Action.KEEP

    def outputs(infos: list[TensorInfo], arrays: list[np.ndarray]) -> list[np.ndarray]:
        places = position.of_run([i.name for i in infos])
        if not arrays:  # copied as they are
            for at in places:
                outcomes[at] = Outcome(plan.tensors[at].before, changed=False)
            return []
        return _carry_out_many(places, plan.tensors, arrays, plan.spec, outcomes)

    progress.start(label, sum(p.info.nbytes for p in plan.tensors))
    write_tensors(reader, writer, chunks_of, progress, many=(joins, kept, outputs))
    progress.finish()
    missing = [p.info.name for p, o in zip(plan.tensors, outcomes, strict=True) if o is None]
    if missing:  # a tensor of the plan that the writer never reached: a fault of ours
        raise RuntimeError(f"no outcome for {len(missing)} tensors of the plan: {missing[:3]}")
    return outcomes  # type: ignore[return-value]  # every place is filled (checked above)


def _carry_out_many(
    places: list[int],
    plans: Sequence[TensorPlan],
    arrays: list[np.ndarray],
    spec: ClipSpec | None,
    outcomes: list[Outcome | None],
) -> list[np.ndarray]:
    """What to write of small whole tensors, the plans at `places` (their outcomes go to
    the same places in `outcomes`): those with the same transform and dtype are
    transformed as one array, then measured together (numerics.many). Scaling and
    clamping act on each value alone, so the output is the one each tensor gets on its
    own, bit for bit. Each outcome keeps the norm of what was written alone (KnownNorm),
    and shares NOTHING_FLUSHED where nothing was flushed: a NormAccumulator and Flushes of
    each were ~40 MB of a 200,000-tensor clip's peak."""
    written = list(arrays)
    together: dict[tuple[object, ...], list[int]] = {}
    for k, at in enumerate(places):
        tensor = plans[at]
        if tensor.action is Action.SCALE:
            key: tuple[object, ...] = (tensor.info.dtype, tensor.factor, tensor.exponent)
        elif tensor.action is Action.CLAMP:
            key = (tensor.info.dtype,)
        else:
            outcomes[at] = Outcome(tensor.before, changed=False)
            continue
        together.setdefault((tensor.action, *key), []).append(k)
    for members in together.values():
        first = plans[places[members[0]]]
        transform = _transform(first, spec)
        assert transform is not None
        before = [arrays[k] for k in members]
        flat = np.concatenate(before)
        flat_after = transform(flat)
        after = _split(flat_after, before)
        flushed = [NOTHING_FLUSHED] * len(members)
        if first.action is Action.SCALE and rounding.flushes(flat, flat_after) != (0, 0):
            flushed = [_flushes_of(b, a) for b, a in zip(before, after, strict=True)]
        for k, out, norm, flushes in zip(members, after, norms_each(after), flushed, strict=True):
            # Every field given: the defaults' factories cost ~0.8 us a tensor.
            outcomes[places[k]] = Outcome(KnownNorm(norm), True, 0, 0, flushes)
            written[k] = out
    return written


def _flushes_of(before: np.ndarray, after: np.ndarray) -> Flushes:
    to_zero, to_subnormal = rounding.flushes(before, after)
    return Flushes(to_zero, to_subnormal) if to_zero or to_subnormal else NOTHING_FLUSHED


def _split(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """`flat` cut into pieces as long as the arrays of `like`, in order."""
    pieces, start = [], 0
    for array in like:
        pieces.append(flat[start : start + array.size])
        start += array.size
    return pieces


def _counted_out(chunks: Iterator[np.ndarray], progress: Progress) -> Iterator[np.ndarray]:
    for chunk in chunks:
        interrupts.check()
        progress.advance(chunk.nbytes)
        yield chunk


# Elements from which a scaled tensor's outcome is read off its histogram: the work is a
# few passes over the 65,536 patterns of a 16-bit float, a fraction of a pass over the
# tensor from here on (and nothing to 200,000 tiny tensors, which go together anyway).
HISTOGRAM_OUTCOME_MIN = 1 << 18


def _scaled_outcome(tensor: TensorPlan) -> Outcome | None:
    """A SCALE of an 8- or 16-bit float tensor whose histogram the measuring pass kept:
    its outcome (statistics, flushes) from the histogram (rounding.scaled_statistics),
    sparing the write pass a statistics pass and a flush pass over every chunk (0.7 of
    its ~2.5 ns/element for bfloat16). None: counted from the data as it is written."""
    if tensor.action is not Action.SCALE or tensor.info.numel < HISTOGRAM_OUTCOME_MIN:
        return None
    assert tensor.factor is not None
    known = rounding.scaled_statistics(
        tensor.before, tensor.info.dtype, tensor.factor, tensor.exponent
    )
    if known is None:
        return None
    after, (to_zero, to_subnormal) = known
    return Outcome(after, True, 0, 0, Flushes(to_zero, to_subnormal))


def _transform(
    tensor: TensorPlan, spec: ClipSpec | None
) -> Callable[[np.ndarray], np.ndarray] | None:
    """What the write pass applies to each chunk of this tensor; None copies it as it is."""
    if tensor.action is Action.SCALE:
        assert tensor.factor is not None
        factor, exponent = tensor.factor, tensor.exponent
        return lambda chunk: rounding.scale_chunk(chunk, factor, exponent)
    if tensor.action is Action.CLAMP:
        assert spec is not None
        low, high = rounding.value_bounds(tensor.info.dtype, spec.low, spec.high)
        return lambda chunk: rounding.clamp_chunk(chunk, low, high)
    return None


def _clip_slices_streamed(
    reader: Reader, tensor: TensorPlan, spec: ClipSpec | None, settle: Callable[[Outcome], None]
) -> tuple[Outcome, Iterator[np.ndarray] | None]:
    """--axes on a tensor read box by box (numerics.slices: a pass for the slices' norms,
    then one that scales): memory stays flat whatever its size. The outcome, and the
    scaled chunks (None if no slice changes: the tensor is copied as it is), which fill in
    the outcome's statistics as they go; where the count of clipped slices is known only
    at the end, the chunks hand the finished outcome to `settle`."""
    assert spec is not None
    info = tensor.info
    boxes = _boxes_of(reader, info)
    budget = slices.box_elements(info.dtype)
    if slices.boxes_hold_whole_slices(info.shape, tensor.axes, budget):
        return _clip_slices_box_by_box(boxes, tensor, spec.limit, settle)
    if reader.elements_loader(info, 0, 0) is not None:  # a group's boxes read on their own
        groups = slices.slice_groups(info.shape, tensor.axes, info.dtype)
        if len(groups) > 1:
            return _clip_slices_by_groups(boxes, groups, tensor, spec.limit)
    scales = slices.streamed_axes_scales(
        boxes,
        info.shape,
        tensor.axes,
        info.dtype,
        spec.limit,
        interrupts.check,
        info.name,
        side_by_side=_pieces_side_by_side(info, tensor.axes),
    )
    clipped = int(np.count_nonzero(scales != 1.0))
    if not clipped:
        return Outcome(tensor.before, False, 0, int(scales.size)), None
    after, flushes = NormAccumulator(), Flushes()
    outcome = Outcome(after, True, clipped, int(scales.size), flushes)

    def factors_of(_box: np.ndarray, index: slices.BoxIndex) -> np.ndarray:
        return scales[slices.box_region(index, tensor.axes)]

    return outcome, _scaled_boxes(boxes, factors_of, after, flushes)


# Threads that work out a tensor's boxes (or pieces of slices) side by side, at most, each
# box (piece) cut into as many parts: the parts in flight then hold about two boxes
# whatever CLIPCLI_THREADS says. Each running part's search holds its own working set,
# ~20 bytes a value for bfloat16 rows and ~40 for float16 ones (more distinct values): a
# 1 GiB float16 [2**17, 4096] with --axes 1 peaked at 126 MiB on one thread, 197 with two
# parts, 228 with four (attack s48b: pieces of four took 1 GiB bfloat16 columns to 206 MiB).
SIDE_BY_SIDE_SHARE = 2


# Values a slice holds, at least, for its tensor's boxes (pieces) to be worked out side by
# side. Shorter slices of 8/16-bit floats are searched on ~100 bytes a value (a histogram
# entry and its search state per value, where a long slice's values share entries): float16
# pairs [2**24, 2] took 105 MiB on one thread, 175 on two, 272 on four, for no gain.
SIDE_BY_SIDE_FROM = 1024


def _side_by_side_share(info: TensorInfo, axes: tuple[int, ...]) -> int:
    """How many threads work out the tensor's boxes (pieces) side by side: one for short
    slices; for float16, whose rows hold nearly every value apart (~40 bytes a value in a
    part's search: 1 GiB of rows of 4,096 peaked at 126 MiB on one thread, 197 on two,
    attack s48c); and where the writer's shards are already written side by side (a
    directory's two shards, --axes 0: 136 MiB on one thread, 271-280 on sixteen, each
    shard's pieces searched two at a time; attack s48c)."""
    if math.prod(info.shape[a] for a in axes) < SIDE_BY_SIDE_FROM:
        return 1
    if info.dtype == np.float16 or worker_count() < machine_worker_count():
        return 1
    return min(worker_count(), SIDE_BY_SIDE_SHARE)


def _pieces_side_by_side(info: TensorInfo, axes: tuple[int, ...]) -> tuple[slices.PieceMap, int]:
    """How streamed_axes_scales works out its pieces of slices: in up to SIDE_BY_SIDE_SHARE
    worker threads, in order, each piece that share of the values."""
    share = _side_by_side_share(info, axes)
    return functools.partial(ordered_map, workers=share), share


def _clip_slices_by_groups(
    boxes: slices.Boxes, groups: list[slice], tensor: TensorPlan, limit: float
) -> tuple[Outcome, Iterator[np.ndarray] | None]:
    """_clip_slices_streamed for a tensor of more slices than one group holds
    (slices.slice_groups: two-element columns of a [2, 2**28] tensor are 2**28 slices):
    each group's factors are worked out from the boxes that hold its slices and kept in a
    temporary file (SpilledFactors), from which the writing pass reads each box's. The
    memory stays that of one group whatever the number of slices; the factors are those
    of the whole tensor at once, slice by slice (each depends on its own slice alone)."""
    from clipcli.jobs.spilled_factors import SpilledFactors

    info, axes = tensor.info, tensor.axes
    spilled = SpilledFactors(groups, info.name)
    try:
        clipped = 0
        for group in groups:
            factors = slices.streamed_axes_scales(
                boxes,
                info.shape,
                axes,
                info.dtype,
                limit,
                interrupts.check,
                info.name,
                span=group,
                side_by_side=_pieces_side_by_side(info, axes),
            )
            clipped += int(np.count_nonzero(factors != 1.0))
            spilled.put(factors)
    except BaseException:
        spilled.close()
        raise
    count = groups[-1].stop
    if not clipped:
        spilled.close()
        return Outcome(tensor.before, False, 0, count), None
    after, flushes = NormAccumulator(), Flushes()
    outcome = Outcome(after, True, clipped, count, flushes)

    def factors_of(box: np.ndarray, index: slices.BoxIndex) -> np.ndarray:
        factors = spilled.of(slices.box_slices(index, info.shape, axes))
        return factors.reshape(slices.keepdims_shape(box.shape, axes))

    def scaled() -> Iterator[np.ndarray]:
        with spilled:
            yield from _scaled_boxes(boxes, factors_of, after, flushes)

    return outcome, scaled()


def _clip_slices_box_by_box(
    boxes: slices.Boxes, tensor: TensorPlan, limit: float, settle: Callable[[Outcome], None]
) -> tuple[Outcome, Iterator[np.ndarray] | None]:
    """_clip_slices_streamed where each box holds whole slices: a box's factors are found
    from the box alone and used at once, so no per-slice array outlives its box. A first
    pass stops at the first box with a slice over the limit (none: the tensor is copied as
    it is) and keeps that box's factors; the writing pass finds the factors of the boxes
    after it (those before are all 1), counts the clipped slices and settles the outcome
    with their number once the last box is out. Each box's factors are searched once."""
    info, axes = tensor.info, tensor.axes
    slice_count = info.numel // math.prod(info.shape[a] for a in axes)

    keepdims = slices.keepdims_shape(info.shape, axes)

    def factors(box: np.ndarray, index: tuple[int | slice, ...]) -> np.ndarray:
        # A whole axis's part is slice(None): its start is None, that is 0 (a box of a
        # conv weight with --axes 2,3 keeps its later axes whole: exit 70, attack s42b).
        starts = [part.start or 0 for part in slices.box_region(index, axes)]
        first = int(np.ravel_multi_index(starts, keepdims))  # the box's first slice
        return slices.box_axes_scales(box, axes, info.dtype, limit, info.name, first)

    first: tuple[int, np.ndarray] | None = None  # the first box with a clipped slice
    for k, (box, index) in enumerate(boxes()):
        scales = factors(box, index)
        if np.any(scales != 1.0):
            first = k, scales
            break
    if first is None:
        return Outcome(tensor.before, False, 0, slice_count), None
    after, flushes = NormAccumulator(), Flushes()
    outcome = Outcome(after, True, 0, slice_count, flushes)

    def scaled_part(
        part: tuple[int, int, slices.BoxPart, np.ndarray | None],
    ) -> tuple[int, int, int, np.ndarray, tuple[int, int]]:
        k, axis, piece, known = part
        scales = factors(piece.values, piece.at) if known is None else known
        scaled = rounding.scale_chunk(piece.values, scales)
        flushed = rounding.flushes(piece.values, scaled)
        return k, axis, int(np.count_nonzero(scales != 1.0)), scaled, flushed

    def scaled_boxes(first_clipped: int, its_scales: np.ndarray) -> Iterator[np.ndarray]:
        # Each box is cut into parts (whole slices each) that the worker threads work out
        # side by side (each depends on its own values alone: a bfloat16 box's factor
        # search is ~15 ms of numpy calls on arrays of ~200,000, which let go of the
        # GIL); the parts come back in order and are joined again, so the boxes, their
        # statistics and the order they are summed in are those of one thread (boxes cut
        # smaller for the threads changed the reported norms' last bits: attack s48). At
        # most SIDE_BY_SIDE_SHARE threads, each box cut into as many parts: the parts in
        # flight hold about two boxes, whatever CLIPCLI_THREADS says.
        share = _side_by_side_share(info, axes)

        def parts() -> Iterator[tuple[int, int, slices.BoxPart, np.ndarray | None]]:
            for k, (box, index) in enumerate(boxes()):
                axis, pieces = slices.split_box(box, index, axes, share)
                for piece in pieces:
                    known: np.ndarray | None = None
                    if k < first_clipped:
                        known = np.ones(slices.keepdims_shape(piece.values.shape, axes))
                    elif k == first_clipped:
                        known = its_scales[piece.within]
                    yield k, axis, piece, known

        clipped = 0
        joined: list[np.ndarray] = []
        box_number, box_axis = 0, -1

        def whole_box() -> np.ndarray:
            box = joined[0] if len(joined) == 1 else np.concatenate(joined, axis=box_axis)
            flat = box.reshape(-1)
            after.add(flat)
            return flat

        for k, axis, count, scaled, flushed in ordered_map(scaled_part, parts(), share):
            if k != box_number:
                yield whole_box()
                joined = []
            box_number, box_axis = k, axis
            clipped += count
            flushes.add(*flushed)
            joined.append(scaled)
        if joined:
            yield whole_box()
        settle(dataclasses.replace(outcome, slices_clipped=clipped))

    return outcome, scaled_boxes(*first)


def _scaled_boxes(
    boxes: slices.Boxes,
    factors_of: Callable[[np.ndarray, slices.BoxIndex], np.ndarray],
    after: NormAccumulator,
    flushes: Flushes,
) -> Iterator[np.ndarray]:
    """The boxes scaled by their slices' factors (keepdims on the box), their statistics
    and flushes counted into after and flushes. (In order, on this thread: boxes read
    whole for long slices, complex64 rows of 8 MiB, took 235 MiB scaled two at a time.)"""
    for box, index in boxes():
        scaled = rounding.scale_chunk(box, factors_of(box, index))
        flushes.add(*rounding.flushes(box, scaled))
        flat = scaled.reshape(-1)
        after.add(flat)
        yield flat


def _boxes_of(reader: Reader, info: TensorInfo) -> slices.Boxes:
    """The tensor's boxes (numerics.slices.box_indices), read anew on each call: the
    reader's chunks cut or joined to the boxes' sizes, at most a chunk and a box at once.
    A pass asked for `only` some boxes reads just those where the reader has random
    access (Reader.elements_loader), else reads through and leaves the others out."""
    budget = slices.box_elements(info.dtype)
    indices = slices.box_indices(info.shape, budget)

    def one_pass(only: Callable[[slices.BoxIndex], bool] | None = None) -> Iterator[slices.Box]:
        if only is not None and reader.elements_loader(info, 0, 0) is not None:
            return _boxes_at(reader, info, indices, only)
        return slices.accepted(in_order(), only)

    def in_order() -> Iterator[slices.Box]:
        chunks = reader.chunks(info, budget)
        left = np.empty(0, info.dtype)
        for index in indices:
            shape = slices.box_shape(info.shape, index)
            size = math.prod(shape)
            parts = []
            while size:
                interrupts.check()
                if not left.size:
                    left = next(chunks, left)
                    if not left.size:
                        raise ValueError(f"tensor {info.name!r} ended early")
                parts.append(left[:size])
                size -= parts[-1].size
                left = left[parts[-1].size :]
            box = parts[0] if len(parts) == 1 else np.concatenate(parts)
            yield box.reshape(shape), index

    return one_pass


def _boxes_at(
    reader: Reader,
    info: TensorInfo,
    indices: list[slices.BoxIndex],
    only: Callable[[slices.BoxIndex], bool],
) -> Iterator[slices.Box]:
    """The boxes whose index `only` accepts, each read at its own place in the tensor."""
    start = 0
    for index in indices:
        shape = slices.box_shape(info.shape, index)
        size = math.prod(shape)
        if only(index):
            interrupts.check()
            load = reader.elements_loader(info, start, start + size)
            assert load is not None  # the reader said it reads at any offset
            yield load().reshape(shape), index
        start += size


def _clip_slices(
    reader: Reader, tensor: TensorPlan, spec: ClipSpec | None
) -> tuple[np.ndarray, Outcome]:
    """--axes: the whole tensor in memory (one box at most), each slice scaled on its own."""
    assert spec is not None
    array = reader.read(tensor.info)
    scales = slices.held_axes_scales(array, tensor.axes, spec.limit, tensor.info.name)
    clipped = int(np.count_nonzero(scales != 1.0))
    if not clipped:
        return array, Outcome(tensor.before, False, 0, int(scales.size))
    scaled = slices.scale_slices(array, scales, tensor.axes)
    flushes = Flushes(*rounding.flushes(array, scaled))
    return scaled, Outcome(accumulate_array(scaled), True, clipped, int(scales.size), flushes)


def _measured(
    chunks: Iterator[tuple[np.ndarray, NormAccumulator, tuple[int, int]]],
    after: NormAccumulator,
    flushes: Flushes,
    progress: Progress,
) -> Iterator[np.ndarray]:
    """The chunks, their statistics and flushes counted into after and flushes."""
    for chunk, partial, (to_zero, to_subnormal) in chunks:
        interrupts.check()
        after.merge(partial)
        flushes.add(to_zero, to_subnormal)
        progress.advance(chunk.nbytes)
        yield chunk


def _with_stats(
    transform: Callable[[np.ndarray], np.ndarray], count_flushes: bool, chunk: np.ndarray
) -> tuple[np.ndarray, NormAccumulator, tuple[int, int]]:
    """The transformed chunk, its statistics, and (for scaling) what the rounding flushed."""
    out = transform(chunk)
    flushed = rounding.flushes(chunk, out) if count_flushes else (0, 0)
    return out, accumulate([out]), flushed
