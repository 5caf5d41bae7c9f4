"""The streaming passes: measure, write, compare two checkpoints.

Every pass has the same shape (`reduce_stream`): chunks are read in order in this thread,
reduced to a few numbers in worker threads (clipcli.system.parallel.ordered_map), merged per
tensor in order, with progress and signal checks between chunks. `write_tensors` is the
one loop through which tensors reach a writer; clipcli.jobs.execution carries a clip plan out
through it (kept apart so that measuring imports no plan or rounding module).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from clipcli.dtypes import is_small_float
from clipcli.errors import UsageError
from clipcli.formats.base import RangeLoader, Reader, TensorInfo, Writer
from clipcli.jobs.measurement import Measurement, TensorStats
from clipcli.jobs.progress import SILENT, LockedProgress, Progress
from clipcli.jobs.selection import EVERY_TENSOR, Selection
from clipcli.numerics import lookup
from clipcli.numerics.norms import NormAccumulator
from clipcli.system import interrupts
from clipcli.system.heap import give_back_freed_memory
from clipcli.system.parallel import ordered_map, sharing, start_threads, worker_count

if TYPE_CHECKING:  # the comparison is imported by compare() only
    from clipcli.jobs import diff
    from clipcli.system.counting import CountingProcesses

R = TypeVar("R")
W = TypeVar("W")
P = TypeVar("P")


class _Stored(Protocol):
    """What small_runs needs of a tensor (or a pair of them): its bytes."""

    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=_Stored)

# Less than this in all is measured in this thread: handing small chunks to threads costs
# more than it saves (norms of 1-16 MiB: 3-7 ms more CPU, no less wall time, 2 cores), and
# a run that starts no pool imports no concurrent.futures (start-up, issue 12 item 7).
INLINE_BELOW_BYTES = 16 << 20


# ---------------------------------------------------------------- the common stream


def chunk_sources(reader: Reader, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
    """Loaders of the tensor's chunks: parallel reads where the reader allows them, else
    chunks read here in order and handed over as they are."""
    loaders = reader.chunk_loaders(info)
    if loaders is not None:
        return loaders
    return (functools.partial(_identity, chunk) for chunk in reader.chunks(info))


def _identity(chunk: np.ndarray) -> np.ndarray:
    return chunk


def _held(load: Callable[[], Any]) -> bool:
    """Whether `load` hands over a chunk already read (chunk_sources without random
    access), rather than reading it."""
    return isinstance(load, functools.partial) and load.func is _identity


def map_chunks(reader: Reader, info: TensorInfo, fn: Callable[[np.ndarray], R]) -> Iterator[R]:
    """fn over the tensor's chunks in worker threads, results in order."""
    return ordered_map(lambda load: fn(load()), chunk_sources(reader, info))


def reduce_stream(
    work: Iterable[W],
    reduce: Callable[[W], tuple[int, P, int]],
    merge: Callable[[int, P], None],
    count: int,
    progress: Progress,
    label: str,
    total_bytes: int,
    *,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> None:
    """reduce(item) -> (tensor index, partial result, bytes) over `work` in worker threads;
    merge(index, partial) in order, here. on_done(index) is called for each of the `count`
    tensors, in order, as soon as its last item is merged (empty tensors have none)."""
    done_until = 0  # tensors before this index are complete
    finished = on_done or _ignore
    progress.start(label, total_bytes)
    for index, partial, nbytes in ordered_map(reduce, work, workers):
        for complete in range(done_until, index):
            finished(complete)
        done_until = index
        interrupts.check()
        merge(index, partial)
        progress.advance(nbytes)
    for complete in range(done_until, count):
        finished(complete)
    progress.finish()


def _ignore(_index: int) -> None:
    pass


# ---------------------------------------------------------------- measuring


def measure(
    reader: Reader,
    infos: Sequence[TensorInfo],
    describe: Callable[[TensorInfo, NormAccumulator], TensorStats],
    progress: Progress = SILENT,
    *,
    histograms: Callable[[TensorInfo], bool] | None = None,
    on_measured: Callable[[TensorStats], None] | None = None,
    count_once_over: CountOnceOver | None = None,
) -> Measurement:
    """Statistics of `infos`, chunks measured in worker threads across tensor bounds;
    describe() says how each tensor counts (clipcli.jobs.selection). on_measured is told of
    each tensor, in order, as soon as it is done. The 8- and 16-bit float tensors for
    which `histograms` holds (those a clip may scale) also count their bit patterns (for
    the factor search), from the start or, given count_once_over, once a clip of them is
    certain. Small tensors that the reader reads together are measured together
    (clipcli.numerics.many)."""
    # What came before works on names alone: the selection, the checks of training state
    # and quantized markers, OUT's header. For 200,000 tensors those are a one-off peak
    # of ~30 MB of freed heap that would stay resident through both passes (system.heap).
    give_back_freed_memory()
    stats: list[NormAccumulator | None] = [None] * len(infos)
    rows: list[TensorStats] = []
    counted = frozenset(
        index
        for index, info in enumerate(infos)
        if histograms is not None and is_small_float(info.dtype) and histograms(info)
    )
    counting = _Counting(count_once_over, reader, infos, counted, histograms)
    total = sum(info.nbytes for info in infos)
    workers = 1 if total < INLINE_BELOW_BYTES else None
    helpers = _counting_processes(reader, infos, counted, workers)

    def reduce(item: _Piece) -> tuple[int, NormAccumulator | list[NormAccumulator] | _Skipped, int]:
        index, load, repeat = item
        if (
            helpers is not None
            and not repeat
            and isinstance(load, RangeLoader)
            and index in counted
            and load.dtype == infos[index].dtype  # its bytes are the chunk as it is
            and counting.counts(index, load)
        ):
            # Counted where it lies, by a helper process (no GIL of ours held while it
            # counts); None: it could not, and the chunk is read and counted here.
            dtype = infos[index].dtype
            counts = helpers.count(load.where, dtype.itemsize)
            if counts is not None:
                nbytes = load.where.stop - load.where.start
                partial = NormAccumulator(keep_histogram=True)
                partial.add_counts(counts, dtype, nbytes // dtype.itemsize)
                return index, partial, nbytes
        if repeat == _MANY:  # whole small tensors from index on
            from clipcli.numerics.many import accumulate_each

            arrays = load()
            return index, accumulate_each(arrays), sum(a.nbytes for a in arrays)
        if repeat == _MEASURED:  # statistics measured by the loader itself
            measured: NormAccumulator = load()
            return index, measured, measured.numel * infos[index].dtype.itemsize
        chunk = load()
        if not repeat and not counting.counts(index, load):
            skipped = NormAccumulator()
            skipped.add(chunk)
            return index, _Skipped(skipped, load), chunk.nbytes
        partial = NormAccumulator(keep_histogram=index in counted)
        if repeat:
            partial.add_repeated(chunk, repeat)
        else:
            partial.add(chunk)
        return index, partial, chunk.nbytes * max(repeat, 1)

    def merge(index: int, partial: NormAccumulator | list[NormAccumulator] | _Skipped) -> None:
        if isinstance(partial, _Skipped):
            counting.skipped(index, partial)
            return
        if isinstance(partial, list):
            stats[index : index + len(partial)] = partial
            for offset, each in enumerate(partial):
                counting.measured(index + offset, each)
            return
        counting.measured(index, partial)
        so_far = stats[index]
        if so_far is None:
            stats[index] = partial
        else:
            so_far.merge(partial)

    def done(index: int) -> None:
        acc = counting.complete(index, stats[index])
        if acc is None:  # an empty tensor
            acc = NormAccumulator()
        acc.finish()
        acc = stats[index] = counting.finished(index, acc)
        rows.append(describe(infos[index], acc))
        if on_measured is not None:
            on_measured(rows[-1])

    try:
        reduce_stream(
            _measure_work(reader, infos, counted),
            reduce,
            merge,
            len(infos),
            progress,
            "measuring",
            total,
            workers=workers,
            on_done=done,
        )
    finally:
        if helpers is not None:
            helpers.close()
    again = counting.to_count_again(rows)
    if again:
        # Measured without their counts, and a clip of them is not ruled out after all (a
        # global norm crossed the limit after they were done, or one close to it): counted
        # now, each in a pass of its own, so that the search has every histogram it needs.
        counted_now = measure(
            reader, [infos[i] for i in again], describe, progress, histograms=_always
        )
        for index, row in zip(again, counted_now.tensors, strict=True):
            rows[index] = row
    return Measurement(reader.path, reader.format_name, dict(reader.metadata), rows)


# Bytes of counted tensors from which their chunks are counted in helper processes
# (system.counting): forking one costs a few milliseconds, counting 64 MiB of bfloat16
# ~40 ms of CPU.
COUNTING_PROCESSES_FROM = 64 << 20


def _counting_processes(
    reader: Reader, infos: Sequence[TensorInfo], counted: frozenset[int], workers: int | None
) -> CountingProcesses | None:
    """Helper processes to count the chunks of the `counted` tensors, one per worker
    thread, where the measuring pass runs in threads (`workers` None), counts at least
    COUNTING_PROCESSES_FROM bytes, the reader's tensors lie in files as they are (their
    loaders are RangeLoaders: measure() uses the helpers for those alone) and this
    platform can fork and pass descriptors; None otherwise, and where the knob
    (CLIPCLI_COUNTING_PROCESSES=0) or RLIMIT_NPROC leaves none."""
    try:
        from clipcli.system import counting
    except ImportError:  # (under a tight address-space limit): the threads count
        return None
    threads = worker_count()
    if (
        workers is not None
        or threads < 2
        or os.environ.get(counting.KNOB) == "0"
        or not counting.available()
        or sum(infos[i].nbytes for i in counted) < COUNTING_PROCESSES_FROM
    ):
        return None
    # Tensors stored as a file's bytes (safetensors, plain GGUF, little-endian PyTorch),
    # whose chunk loaders are RangeLoaders: stored_bytes first, since asking a reader that
    # streams for a loader could start a read; then the loaders themselves (a .npy file
    # has stored bytes and reads its chunks in one go: helpers forked for it would count
    # nothing).
    first = next((i for i in sorted(counted) if infos[i].numel), None)
    if first is None or reader.stored_bytes(infos[first]) is None:
        return None
    loaders = reader.chunk_loaders(infos[first])
    if loaders is None or not isinstance(next(iter(loaders), None), RangeLoader):
        return None
    helpers = counting.CountingProcesses(lookup.bit_pattern_counts, threads)
    if not helpers.size:
        return None
    return helpers


def _always(_info: TensorInfo) -> bool:
    return True


@dataclass(frozen=True)
class CountOnceOver:
    """When a clip's 8/16-bit float tensors count their bit patterns: only once a clip of
    them is certain, their own norm (per_tensor: --norm) or the norm of all the tensors
    measured so far (--global) over `limit`. Counting (np.bincount, ~1.2 ns an element)
    costs three times the measuring it replaces (~0.4 ns), and a clip that leaves a
    tensor alone never looks at its histogram."""

    limit: float
    per_tensor: bool
    # --skip-nonfinite: a tensor with NaN/Inf is left alone and out of the global norm,
    # so the global norm so far is its finite tensors' (without it, NaN/Inf refuses the
    # clip, and any may be over: counted, as the plan's refusal sees them).
    skip_nonfinite: bool = False


# A tensor measured without its counts is left so only where its norm is certainly within
# the limit: under it by this share of the limit, far past the measured norms' error
# (<= 1e-7 relative for any size, NUMERICS.md; the float64 sums of exact squares err by a
# few float64 roundings per block and per chunk, under 1e-9 for 2**40 elements).
_CLEARLY_WITHIN = 2.0**-16


class _Skipped(NamedTuple):
    """A chunk of a tensor that counts its bit patterns, measured without counting them
    (CountOnceOver): its statistics, and its loader to count it later if need be."""

    stats: NormAccumulator
    load: Callable[[], Any]


class _Counting:
    """Which chunks of the tensors measure() counts into histograms count them, under a
    CountOnceOver policy (without one: every chunk). Only chunks the reader can read again
    at random (Reader.chunk_loaders) defer their counting; each is counted once its
    tensor's (per_tensor) or all the tensors' norm so far may be over the limit. A tensor
    done with some chunks counted and some not counts the others then (their loaders were
    kept: they read again, a few chunks in flight when the norm crossed); one with none
    counted keeps its plain statistics, and to_count_again names those the limit does not
    clearly leave alone. Every tensor a clip may scale thus ends with the histogram of all
    its elements, as when every chunk was counted: what its search finds and the
    statistics it reports are the same.

    Per tensor, a tensor of the shape of one found over the limit is counted from its first
    chunk: a model's tensors of one shape (each layer's q_proj) have like norms, and a
    tensor of one chunk found over it is otherwise measured twice. Whether the guess is
    made in time depends on the threads (the tensor before may not be done), so a tensor it
    counted that is clearly within the limit is measured again without counting: what a
    tensor reports depends on its values and the limit alone (attack s44b: the same clip
    reported 3 ways in 16 runs). A guess never changes what is found, only what is read."""

    def __init__(
        self,
        policy: CountOnceOver | None,
        reader: Reader,
        infos: Sequence[TensorInfo],
        counted: frozenset[int],
        histograms: Callable[[TensorInfo], bool] | None,
    ) -> None:
        self.policy = policy
        self.deferred = counted if policy is not None else frozenset()
        # The tensors in the global norm as far as the policy is concerned (all are in
        # to_count_again's check; these only make counting start sooner): none where no
        # tensor defers its counting (200,000 float32 tensors: a merge each, for nothing).
        self.grouped = (
            frozenset(i for i, info in enumerate(infos) if histograms(info))
            if self.deferred
            and policy is not None
            and not policy.per_tensor
            and histograms is not None
            else frozenset()
        )
        self.over: set[int] = set()  # tensors (per_tensor), or _ALL, that may be over
        self.so_far = NormAccumulator()  # all tensors' plain statistics so far (global)
        self.plain: dict[int, NormAccumulator] = {}  # per deferred tensor, its skipped chunks'
        self.loads: dict[int, list[Callable[[], Any]]] = {}
        self.uncounted: list[int] = []  # done with none of their chunks counted
        self.reader, self.infos = reader, infos
        self.shapes_over: set[tuple[int, ...]] = set()  # per tensor: the last of each shape
        self.held: set[int] = set()  # deferred tensors with a chunk handed over already read

    def counts(self, index: int, load: Callable[[], Any]) -> bool:
        """Whether this chunk of tensor `index` counts its bit patterns now (worker threads:
        `over` only grows, and a chunk that misses its growth is counted when its tensor
        is done). A chunk the reader handed over already read (no random access) is
        counted now: it could not be read again."""
        if index not in self.deferred:
            return True
        if _held(load):
            self.held.add(index)
            return True
        assert self.policy is not None
        if self.policy.per_tensor:
            return index in self.over or self.infos[index].shape in self.shapes_over
        return _ALL in self.over

    def skipped(self, index: int, chunk: _Skipped) -> None:
        plain = self.plain.get(index)
        if plain is None:
            self.plain[index], self.loads[index] = chunk.stats, [chunk.load]
        else:
            plain.merge(chunk.stats)
            self.loads[index].append(chunk.load)
        assert self.policy is not None
        if self.policy.per_tensor:
            if _may_be_over(self.plain[index], self.policy.limit):
                self.over.add(index)
        else:
            self.measured(index, chunk.stats)

    def measured(self, index: int, stats: NormAccumulator) -> None:
        """A piece of tensor `index` measured (global: its plain statistics count towards
        the norm so far)."""
        if index not in self.grouped or _ALL in self.over:
            return
        assert self.policy is not None
        if self.policy.skip_nonfinite and stats.nonfinite:
            return  # the plan leaves its tensor out of the global norm
        self.so_far.merge(stats)
        if _may_be_over(self.so_far, self.policy.limit):
            self.over.add(_ALL)

    def complete(self, index: int, counted: NormAccumulator | None) -> NormAccumulator | None:
        """Tensor `index` done: its statistics, with the chunks it skipped counted now where
        any of its chunks was counted or a clip of it is certain."""
        loads = self.loads.pop(index, None)
        if loads is None:
            return counted
        plain = self.plain.pop(index)
        assert self.policy is not None
        key = index if self.policy.per_tensor else _ALL
        if counted is None and key not in self.over:
            self.uncounted.append(index)
            return plain
        return _measured_in_order(loads, True, counted)

    def finished(self, index: int, stats: NormAccumulator) -> NormAccumulator:
        """Tensor `index` measured and finished: the guess for the next of its shape, and
        the statistics it reports (measured again without counting where a guess counted
        it and it is clearly within the limit)."""
        if self.policy is None or not self.policy.per_tensor or index not in self.deferred:
            return stats
        info, limit = self.infos[index], self.policy.limit
        if _may_be_over(stats, limit):
            self.shapes_over.add(info.shape)
        else:
            self.shapes_over.discard(info.shape)
        if (
            stats.histogram is None  # not counted
            or index in self.held  # counted from the start whatever the guess
            or index in self.over  # its own chunks' norm may be over: counted either way
            or self.reader.constant(info) is not None
            or stats.nonfinite
            or not stats.limit_ratio(limit) > 1 + _CLEARLY_WITHIN / 2
        ):
            return stats
        # Counted on a guess, and perhaps clearly within: decided as an uncounted tensor is
        # (on its plain statistics), and reported as one if it is. Under 2**-17 the plain
        # statistics, a few roundings away, cannot be clearly within (2**-16): not read.
        plain = _measured_plainly(self.reader, info)
        return stats if _may_be_over(plain, limit) else plain

    def to_count_again(self, rows: Sequence[TensorStats]) -> list[int]:
        """The tensors done without counts that a clip may still scale: per tensor, those
        not clearly within the limit (none: a tensor's counting starts as soon as its own
        norm may be over); global, all of them once counting started or unless the global
        norm (of finite tensors, with --skip-nonfinite) is clearly within."""
        if not self.uncounted:
            return []
        assert self.policy is not None
        if self.policy.per_tensor:
            return [i for i in self.uncounted if _may_be_over(rows[i].stats, self.policy.limit)]
        if _ALL in self.over:
            # Counting started: every tensor is counted, whichever chunks the threads
            # counted first, so that what each reports does not depend on their timing.
            return list(self.uncounted)
        together = NormAccumulator()
        skipped = self.policy.skip_nonfinite
        for row in rows:
            if row.in_global and not (skipped and row.stats.nonfinite):
                together.merge(row.stats)
        return list(self.uncounted) if _may_be_over(together, self.policy.limit) else []


_ALL = -1  # `over`'s key for all the tensors together (global)


def _measured_plainly(reader: Reader, info: TensorInfo) -> NormAccumulator:
    """The tensor's statistics measured without counting, bit for bit as measure() makes
    them."""
    whole = _measured_in_order(chunk_sources(reader, info), False)
    return whole if whole is not None else NormAccumulator()


def _measured_in_order(
    loads: Iterable[Callable[[], Any]], keep_histogram: bool, whole: NormAccumulator | None = None
) -> NormAccumulator | None:
    """Each loaded chunk measured on its own and merged in order into `whole` (None: into
    the first), as measure() merges its partials."""
    for load in loads:
        interrupts.check()
        part = NormAccumulator(keep_histogram=keep_histogram)
        part.add(load())
        if whole is None:
            whole = part
        else:
            whole.merge(part)
    return whole


def _may_be_over(stats: NormAccumulator, limit: float) -> bool:
    """Whether the norm measured may be over the limit once its rounding is accounted for
    (any non-finite value: the plan decides what that means, on counts)."""
    return bool(stats.nonfinite) or not stats.limit_ratio(limit) > 1 + _CLEARLY_WITHIN


# (tensor index, loader, repeat): repeat 0 is a chunk of the tensor, a positive repeat a
# constant tensor's one value, _MANY whole tensors from the index on (a list of arrays),
# _MEASURED a piece's statistics (a NormAccumulator, from Reader.measured_loaders).
_Piece = tuple[int, Callable[[], Any], int]
_MANY = -1
_MEASURED = -2
# Tensors of at most SMALL_TENSOR_BYTES are read and measured MANY_TENSORS at a time (at
# most MANY_BYTES): per tensor, a read, a task and a NormAccumulator.add cost ~30 us,
# which 200,000 one-element tensors turned into most of a minute.
SMALL_TENSOR_BYTES = 64 << 10
MANY_TENSORS = 4096
MANY_BYTES = 2 << 20


def small_runs(infos: Sequence[S], joins: Callable[[S], bool]) -> Iterator[list[int]]:
    """The indices of `infos` in order, cut into runs: consecutive tensors of at most
    SMALL_TENSOR_BYTES for which joins() holds, MANY_TENSORS and MANY_BYTES at most
    together; every other tensor is a run of its own. (`diff` runs pairs of tensors:
    diff.Pair.nbytes is their larger side's, each side being one read.)"""
    run: list[int] = []
    run_bytes = 0
    for index, info in enumerate(infos):
        size = info.nbytes
        if size <= SMALL_TENSOR_BYTES and joins(info):
            if run and (len(run) == MANY_TENSORS or run_bytes + size > MANY_BYTES):
                yield run
                run, run_bytes = [], 0
            run.append(index)
            run_bytes += size
            continue
        if run:
            yield run
            run, run_bytes = [], 0
        yield [index]
    if run:
        yield run


def _measure_work(
    reader: Reader, infos: Sequence[TensorInfo], counted: frozenset[int]
) -> Iterator[_Piece]:
    """The pieces to measure, in order: runs of small tensors together where the reader
    can read them so, every other tensor as _measured_pieces gives it. The tensors
    counted into histograms (their indices) stay apart (each needs its bit-pattern
    counts)."""
    apart = {id(infos[index]) for index in counted}

    def joins(info: TensorInfo) -> bool:
        return id(info) not in apart

    for run in small_runs(infos, joins):
        load = reader.loader_of_many([infos[i] for i in run]) if len(run) > 1 else None
        if load is not None:
            yield run[0], load, _MANY
            continue
        for index in run:  # one by one
            for piece_load, repeat in _measured_pieces(reader, infos[index]):
                yield index, piece_load, repeat


def _measured_pieces(reader: Reader, info: TensorInfo) -> Iterator[tuple[Callable[[], Any], int]]:
    """(loader, repeat) for each piece to measure: a tensor the reader knows to hold one
    value throughout (an unallocated HDF5 dataset) is that value repeated numel times,
    measured without reading or making its elements; a tensor the reader measures itself
    (a quantized weight) its pieces' statistics (_MEASURED); otherwise its chunks."""
    value = reader.constant(info) if info.numel else None
    if value is not None:
        yield functools.partial(_identity, value.reshape(1)), info.numel
        return
    measured = reader.measured_loaders(info)
    if measured is not None:
        for load in measured:
            yield load, _MEASURED
        return
    for chunk_load in chunk_sources(reader, info):
        yield chunk_load, 0


# ---------------------------------------------------------------- writing

# What write_tensors may do with small tensors together: which ones join (joins), which
# are written as they are (kept), and what to write of them given their data (outputs:
# whole flat arrays, in order).
Many = tuple[
    Callable[[TensorInfo], bool],
    Callable[[TensorInfo], bool],
    Callable[[list[TensorInfo], list[np.ndarray]], list[np.ndarray]],
]


def write_tensors(
    reader: Reader,
    writer: Writer,
    chunks_of: Callable[[TensorInfo], Iterable[np.ndarray] | None],
    progress: Progress = SILENT,
    chunk_elems: int | None = None,
    *,
    many: Many | None = None,
) -> None:
    """The write loop, the one place tensors reach a writer: every tensor of the reader in
    order, as chunks_of gives it, or, where chunks_of gives None, copied as it is (a kernel
    copy where the writer can, else the reader's chunks of chunk_elems elements; the
    reader's default when None). abort() on any failure, close() after the last tensor.

    many = (joins, kept, outputs): small tensors for which joins() holds are copied in one
    go when every one is kept as it is and the writer can (Writer.copy_unchanged_many),
    else read together where the reader can (small_runs, Reader.loader_of_many), and
    outputs(infos, arrays) gives what to write of them, whole, handed to the writer
    together (Writer.write_many); outputs(infos, []) for tensors copied.

    A writer with parts (a model directory's shards, Writer.parts) has them written side
    by side, up to one per worker thread (_write_parts): chunks_of and outputs are then
    called from several threads, each part's tensors in order."""
    try:
        parts = writer.parts()
        slots = _part_slots(reader, parts)
        if parts is not None and slots > 1:
            _write_parts(reader, writer, parts, slots, chunks_of, progress, chunk_elems, many)
        else:
            _write_in_order(reader, writer, reader.infos, chunks_of, progress, chunk_elems, many)
        interrupts.check()
        writer.close()
    except BaseException:
        writer.abort()
        raise


# Parts written at once, at most: each holds a shard of the reader open, which keeps at
# most MAX_OPEN_SHARDS (64) descriptors and must never release one that is being read.
MAX_PARALLEL_PARTS = 16


def _part_slots(reader: Reader, parts: list[list[TensorInfo]] | None) -> int:
    """How many parts to write at once: one per worker thread, at most one per part and
    MAX_PARALLEL_PARTS; 1 (in order) where the parts are not the reader's tensors in
    order (the writer then refuses the first one out of order, as it always has)."""
    if parts is None or len(parts) < 2:
        return 1
    names = [info.name for part in parts for info in part]
    if names != [info.name for info in reader.infos]:
        return 1
    return min(worker_count(), len(parts), MAX_PARALLEL_PARTS)


def _write_parts(
    reader: Reader,
    writer: Writer,
    parts: list[list[TensorInfo]],
    slots: int,
    chunks_of: Callable[[TensorInfo], Iterable[np.ndarray] | None],
    progress: Progress,
    chunk_elems: int | None,
    many: Many | None,
) -> None:
    """The writer's parts written by `slots` threads (this one among them), each taking the
    next part not yet begun, in order. The threads share the workers (parallel.sharing):
    all of them together keep at most 2 chunks per worker in flight, as one stream does,
    whatever the number of parts. Each part's file is made exactly as in order (its own
    writer, the same tensors, the same bytes). On the first failure, the other threads
    stop at their next chunk (interrupts.halting) and are waited for before the failure
    is raised, so nothing is written after the caller's abort() and cleanup."""
    lock = threading.Lock()
    numbers = iter(range(len(parts)))
    failures: list[BaseException] = []
    halt = threading.Event()
    shared_progress = LockedProgress(progress)

    def slot() -> None:
        with sharing(slots):
            while not halt.is_set():
                with lock:
                    number = next(numbers, None)
                if number is None:
                    return
                try:
                    part = writer.part_writer(number)
                    _write_in_order(
                        reader, part, parts[number], chunks_of, shared_progress, chunk_elems, many
                    )
                    interrupts.check()
                    writer.close_part(number)
                except BaseException as exc:  # raised by the caller, below
                    with lock:
                        if not failures:
                            failures.append(exc)
                        halt.set()
                    return

    with interrupts.halting(halt):
        helpers = start_threads(slot, slots - 1, "clipcli_part")
        slot()
        for helper in helpers:
            helper.join()
    if failures:
        raise failures[0]


def _write_in_order(
    reader: Reader,
    writer: Writer,
    infos: Sequence[TensorInfo],
    chunks_of: Callable[[TensorInfo], Iterable[np.ndarray] | None],
    progress: Progress,
    chunk_elems: int | None,
    many: Many | None,
) -> None:
    """`infos` (the writer's tensors, in order) into the writer, which is left open."""
    runs = small_runs(infos, many[0]) if many is not None else ([i] for i in range(len(infos)))
    for run in runs:
        interrupts.check()
        together = [infos[i] for i in run]
        if many is not None and len(run) > 1:
            _, kept, outputs = many
            nbytes = sum(info.nbytes for info in together)
            if all(map(kept, together)) and writer.copy_unchanged_many(reader, together):
                outputs(together, [])  # (their outcomes: unchanged)
                progress.advance(nbytes)
                continue
            load = reader.loader_of_many(together)
            if load is not None:
                writer.write_many(together, outputs(together, load()))
                progress.advance(nbytes)
                continue
        for index in run:
            _write_one(reader, writer, infos[index], chunks_of, progress, chunk_elems)


def _write_one(
    reader: Reader,
    writer: Writer,
    info: TensorInfo,
    chunks_of: Callable[[TensorInfo], Iterable[np.ndarray] | None],
    progress: Progress,
    chunk_elems: int | None,
) -> None:
    """One tensor as chunks_of gives it, or copied as it is (see write_tensors)."""
    interrupts.check()
    chunks = chunks_of(info)
    if chunks is None:
        if writer.copy_unchanged(reader, info):
            progress.advance(info.nbytes)
            return
        chunks = _counted(reader.chunks(info, chunk_elems), progress)
    writer.write(info, chunks)


def _counted(chunks: Iterable[np.ndarray], progress: Progress) -> Iterator[np.ndarray]:
    for chunk in chunks:
        interrupts.check()
        progress.advance(chunk.nbytes)
        yield chunk


# ---------------------------------------------------------------- comparing


def compare(
    a: Reader,
    b: Reader,
    selection: Callable[[str], bool] | None = None,
    *,
    chunk_elems: int | None = None,
    progress: Progress = SILENT,
    workers: int | None = None,
) -> diff.DiffResult:
    """Compare two open readers; `selection` (e.g. a Selection) filters tensor names.

    chunk_elems: elements per piece read from each side (default: 1 MiB of the wider
    dtype). workers: threads for the arithmetic (default parallel.worker_count()).
    """
    # Imported here: `norms` and `clip` should not load the comparison's modules.
    from clipcli.jobs import diff_math
    from clipcli.jobs.diff import ManyPairs, PieceWork, pair_tensors, piece_work

    if chunk_elems is not None and chunk_elems < 1:
        raise UsageError(f"chunk_elems must be positive, got {chunk_elems}")
    pairs = pair_tensors(a, b, selection if selection is not None else _everything)
    # The global figures mean what they mean in `norms`: model weights only, training state
    # left out by name unless the selection says --all-tensors (a plain callable: the
    # default rules), floating point only (diff_math).
    left_out = selection.left_out if isinstance(selection, Selection) else EVERY_TENSOR.left_out
    weights = [left_out(p.name) is None for p in pairs]
    # Each tensor's sums while its pieces come, then its figures as soon as it is done: a
    # Running each for the whole run was ~150 MB of 200,000 tensors' accumulators.
    running: list[diff_math.Running | None] = [None] * len(pairs)
    tensors: list[diff.TensorDiff] = []
    total = sum(
        (p.info_a.nbytes if p.info_a else 0) + (p.info_b.nbytes if p.info_b else 0) for p in pairs
    )

    def reduce(
        item: PieceWork | ManyPairs,
    ) -> tuple[int, diff_math.Partial | list[diff_math.Partial], int]:
        if isinstance(item, ManyPairs):
            partials = diff_math.reduce_many(item)
            return item.index, partials, sum(p.nbytes for p in partials)
        index, partial = diff_math.reduce_piece(item)
        return index, partial, partial.nbytes

    def merge(index: int, partial: diff_math.Partial | list[diff_math.Partial]) -> None:
        parts = partial if isinstance(partial, list) else [partial]
        for at, part in enumerate(parts, index):
            run = running[at]
            if run is None:
                run = running[at] = diff_math.Running()
            run.merge(part)

    def done(index: int) -> None:
        run, running[index] = running[index], None
        tensors.append(diff_math.finish(pairs[index], run or diff_math.Running(), weights[index]))

    def runs(jobs: Sequence[diff.Pair]) -> Iterator[list[int]]:
        return small_runs(jobs, _pairs_join)

    reduce_stream(
        piece_work(a, b, pairs, chunk_elems, runs),
        reduce,
        merge,
        len(pairs),
        progress,
        "comparing",
        total,
        workers=workers,
        on_done=done,
    )
    # Tied tensors (one storage: PyTorch's tied weights) count once, as in `norms`: a
    # logical reader's `tied` map (a bare PyTorchReader has a method of that name, and no
    # view over it because it has no ties).
    tied_a, tied_b = (_tied(r) for r in (a, b))
    return diff_math.result(a, b, pairs, tensors, weights, tied_a, tied_b)


def _pairs_join(pair: diff.Pair) -> bool:
    return pair.paired


def _tied(reader: Reader) -> Mapping[str, str]:
    tied = getattr(reader, "tied", None)
    return tied if isinstance(tied, Mapping) else {}


def _everything(_name: str) -> bool:
    return True
