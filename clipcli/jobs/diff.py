"""Compare two checkpoints tensor by tensor: norms, ‖A−B‖, relative change, cosine.

Works across formats (an npz against a safetensors file, HDF5 against a model directory):
tensors are matched by name, metadata by key. Memory stays bounded: both tensors are
streamed in chunks of the same element count, re-cut where a reader's pieces do not line
up (the HDF5 reader rounds pieces to whole rows), and every pair of pieces is reduced to a
few numbers in worker threads (`parallel.ordered_map`); reading stays in the calling thread,
but for small tensors, read many at a time by the worker that compares them (ManyPairs).

This module holds the results and the pairing (which tensors meet, in aligned pieces);
clipcli.jobs.diff_math reduces each pair of pieces and gives the final figures, and
clipcli.jobs.pipeline.compare streams them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from clipcli.errors import InputError
from clipcli.formats.base import Reader, TensorInfo, default_chunk_elems

Status = Literal["same", "changed", "dtype changed", "shape changed", "only in A", "only in B"]

SAME: Status = "same"
CHANGED: Status = "changed"
DTYPE_CHANGED: Status = "dtype changed"
SHAPE_CHANGED: Status = "shape changed"
ONLY_IN_A: Status = "only in A"
ONLY_IN_B: Status = "only in B"
STATUSES: tuple[Status, ...] = (SAME, CHANGED, DTYPE_CHANGED, SHAPE_CHANGED, ONLY_IN_A, ONLY_IN_B)
# Statuses where the two tensors do not correspond element for element.
STRUCTURAL: frozenset[Status] = frozenset({SHAPE_CHANGED, ONLY_IN_A, ONLY_IN_B})


@dataclass(frozen=True)
class TensorDiff:
    """One tensor name's comparison. Figures that do not apply are None.

    Numeric figures (diff_norm, rel_change, max_abs_diff, cosine, norm_ratio) exist when
    both sides have the tensor with the same shape (status same, changed, dtype changed);
    norms exist for every side that has the tensor.
    """

    name: str
    status: Status
    dtype_a: str | None  # numpy's name (float32, bfloat16, ...), byte order ignored
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    norm_a: float | None  # ‖A‖, as `clipcli norms` reports it
    norm_b: float | None
    diff_norm: float | None  # ‖A−B‖
    rel_change: float | None  # ‖A−B‖/‖A‖: 0 if nothing changed, inf if ‖A‖ = 0 < ‖A−B‖
    max_abs_diff: float | None  # max |A−B| (modulus for complex)
    cosine: float | None  # A·B/(‖A‖‖B‖); None if a norm is 0, nan if one is not finite
    norm_ratio: float | None  # ‖B‖/‖A‖ (the scale a norm clip applied); None if ‖A‖ = 0
    nonfinite_a: int = 0  # NaN/Inf elements of A
    nonfinite_b: int = 0
    # A model weight by name (training state only with --all-tensors), floating point in A
    # and compared: counts in global_diff_norm, as `clipcli norms` counts it in the global norm
    in_global: bool = False
    # A part of a logical tensor on a side that has it (a quantized weight's scale): listed
    # apart, compared through its weight, out of the counts, `identical` and the figures
    part: bool = False
    # Tied on both sides to this earlier tensor (one storage, as `norms` shows "tied to"):
    # its difference is its first one's, counted once in the global figures
    tied_to: str | None = None

    @property
    def compared(self) -> bool:
        """Both sides compared element by element (numeric figures present)."""
        return self.diff_norm is not None

    @property
    def structural(self) -> bool:
        return self.status in STRUCTURAL


@dataclass(frozen=True)
class DiffResult:
    path_a: Path
    path_b: Path
    format_a: str
    format_b: str
    tensors: list[TensorDiff]  # A's order, then the tensors only B has, in B's order
    metadata_changes: list[tuple[str, str | None, str | None]]  # (key, in A, in B)
    global_norm_a: float  # over A's floating-point model weights (selected), as `clipcli norms`
    global_norm_b: float  # over B's floating-point model weights (selected)
    global_diff_norm: float  # sqrt(Σ ‖A−B‖²) over compared tensors that are floating in A
    global_rel_change: float  # global_diff_norm / global_norm_a (0 if nothing changed)
    training_state: int = 0  # tensors compared but left out of the global figures by role
    # name -> the earlier tensor it shares one storage with, per side: counted once in that
    # side's global norm (and in global_diff_norm where tied alike on both sides), as `norms`
    tied_a: Mapping[str, str] = field(default_factory=dict)
    tied_b: Mapping[str, str] = field(default_factory=dict)

    @property
    def max_rel_change(self) -> float | None:
        """Largest rel_change of any compared tensor (nan if one is nan); None if none."""
        largest = self.largest_change
        return None if largest is None else largest.rel_change

    @property
    def largest_change(self) -> TensorDiff | None:
        """The compared tensor with the largest rel_change (a nan one wins)."""
        best: TensorDiff | None = None
        for t in self.counted:
            if t.rel_change is None:
                continue
            if math.isnan(t.rel_change):
                return t
            if best is None or t.rel_change > (best.rel_change or 0.0):
                best = t
        return best

    @property
    def counted(self) -> list[TensorDiff]:
        """The tensors the counts and verdicts are about: every one but parts."""
        return [t for t in self.tensors if not t.part]

    @property
    def tied(self) -> set[str]:
        """Names tied (one storage with an earlier tensor) on either side."""
        return set(self.tied_a) | set(self.tied_b)

    @property
    def n_parts(self) -> int:
        """Parts of logical tensors (quantized weights' scales), listed apart."""
        return sum(t.part for t in self.tensors)

    @property
    def counts(self) -> dict[Status, int]:
        """Tensors per status (parts aside); every status is a key."""
        result: dict[Status, int] = dict.fromkeys(STATUSES, 0)
        for t in self.counted:
            result[t.status] += 1
        return result

    @property
    def n_same(self) -> int:
        return sum(t.status == SAME for t in self.counted)

    @property
    def n_changed(self) -> int:
        """Compared tensors whose bits differ (status changed or dtype changed)."""
        return sum(t.status in (CHANGED, DTYPE_CHANGED) for t in self.counted)

    @property
    def n_structural(self) -> int:
        """Tensors missing on one side or reshaped."""
        return sum(t.structural for t in self.counted)

    @property
    def n_dtype_changed(self) -> int:
        """Tensors stored in another dtype (a change a value comparison may not show)."""
        return sum(t.status == DTYPE_CHANGED for t in self.counted)

    @property
    def identical(self) -> bool:
        """Every tensor bit-identical (a logical one: the same values) and no metadata
        change; parts are compared through their logical tensors."""
        return not self.metadata_changes and all(t.status == SAME for t in self.counted)


# ---------------------------------------------------------------------------------------
# pairing


def metadata_changes(
    meta_a: Mapping[str, str], meta_b: Mapping[str, str]
) -> list[tuple[str, str | None, str | None]]:
    """Keys whose values differ, A's key order then B's new keys; None marks a missing key."""
    changes: list[tuple[str, str | None, str | None]] = []
    for key, value in meta_a.items():
        other = meta_b.get(key)
        if other != value:
            changes.append((key, value, other))
    changes.extend((key, None, value) for key, value in meta_b.items() if key not in meta_a)
    return changes


# ---------------------------------------------------------------------------------------
# work items: what one worker reduces


def pair_tensors(a: Reader, b: Reader, keep: Callable[[str], bool]) -> list[Pair]:
    """The tensors to compare, matched by name: A's order, then those only B has. A
    logical tensor made of parts (a quantized weight) has no bits of its own: it is
    compared by value; its parts are marked, listed apart from the figures."""
    infos_a = [info for info in a.infos if keep(info.name)]
    infos_b = [info for info in b.infos if keep(info.name)]
    by_name_b = {info.name: info for info in infos_b}
    names_a = {info.name for info in infos_a}
    parts = set(_parts(a)) | set(_parts(b))

    def pair(info_a: TensorInfo | None, info_b: TensorInfo | None) -> Pair:
        by_value = _made_of_parts(a, info_a) or _made_of_parts(b, info_b)
        name = (info_a or info_b).name  # type: ignore[union-attr]  # one side at least
        return Pair(info_a, info_b, part=name in parts, by_value=by_value)

    pairs = [pair(info, by_name_b.get(info.name)) for info in infos_a]
    return pairs + [pair(None, info) for info in infos_b if info.name not in names_a]


def _parts(reader: Reader) -> Mapping[str, str]:
    """A logical reader's parts listed beside its logical tensors (name -> role)."""
    from clipcli.logical.reader import LogicalReader

    return reader.part_roles if isinstance(reader, LogicalReader) else {}


def _made_of_parts(reader: Reader, info: TensorInfo | None) -> bool:
    from clipcli.logical.reader import LogicalReader

    return (
        info is not None
        and isinstance(reader, LogicalReader)
        and info.name in reader.by_name
        and not reader.stored_as_is(info)
    )


@dataclass(frozen=True)
class Pair:
    info_a: TensorInfo | None
    info_b: TensorInfo | None
    part: bool = False  # a part of a logical tensor (listed apart)
    by_value: bool = False  # a logical tensor on a side: equal values are the same

    @property
    def name(self) -> str:
        info = self.info_a if self.info_a is not None else self.info_b
        assert info is not None
        return info.name

    @property
    def nbytes(self) -> int:
        """The larger side's bytes (what one read of a side holds)."""
        return max(info.nbytes for info in (self.info_a, self.info_b) if info is not None)

    @property
    def paired(self) -> bool:
        """Both present with the same shape: compared element by element."""
        return (
            self.info_a is not None
            and self.info_b is not None
            and self.info_a.shape == self.info_b.shape
        )

    @property
    def same_dtype(self) -> bool:
        return (
            self.info_a is not None
            and self.info_b is not None
            and self.info_a.dtype_name == self.info_b.dtype_name
        )

    @property
    def as_complex(self) -> bool:
        return any(i is not None and i.dtype.kind == "c" for i in (self.info_a, self.info_b))


@dataclass(frozen=True)
class PieceWork:
    """Aligned pieces of A and B (paired tensors), or a piece of one side only."""

    index: int
    a: np.ndarray | None
    b: np.ndarray | None
    same_dtype: bool = False
    as_complex: bool = False
    by_value: bool = False


@dataclass(frozen=True)
class ManyPairs:
    """Whole small paired tensors, jobs[index] onwards, read together: load() gives A's
    and B's, each flat, in order (Reader.loader_of_many, one read a side), checked to hold
    their shapes' elements."""

    index: int
    load: Callable[[], tuple[list[np.ndarray], list[np.ndarray]]]
    jobs: Sequence[Pair]


def piece_work(
    a: Reader,
    b: Reader,
    jobs: Sequence[Pair],
    chunk_elems: int | None,
    runs: Callable[[Sequence[Pair]], Iterable[list[int]]] | None = None,
) -> Iterator[PieceWork | ManyPairs]:
    """The work of comparing `jobs`, in order. Given `runs` (the pipeline's small_runs)
    and no chunk_elems, paired tensors small enough are read and compared many at a time
    where both readers can read them so: per tensor, two reads and a task cost ~100 us,
    and 200,000 one-element tensors took 22 s. Each small tensor is one piece either way
    (at most one chunk), so the figures are the same."""
    if runs is None or chunk_elems is not None:
        for index in range(len(jobs)):
            yield from _pieces(a, b, jobs, index, chunk_elems)
        return
    for run in runs(jobs):
        many = _many_pairs(a, b, [jobs[i] for i in run], run[0]) if len(run) > 1 else None
        if many is not None:
            yield many
            continue
        for index in run:
            yield from _pieces(a, b, jobs, index, chunk_elems)


def _many_pairs(a: Reader, b: Reader, jobs: list[Pair], index: int) -> ManyPairs | None:
    infos_a = [job.info_a for job in jobs if job.info_a is not None]
    infos_b = [job.info_b for job in jobs if job.info_b is not None]
    load_a = a.loader_of_many(infos_a) if len(infos_a) == len(jobs) else None
    load_b = b.loader_of_many(infos_b) if len(infos_b) == len(jobs) else None
    if load_a is None or load_b is None:
        return None

    def load() -> tuple[list[np.ndarray], list[np.ndarray]]:
        arrays_a, arrays_b = load_a(), load_b()
        for info, array_a, array_b in zip(infos_a, arrays_a, arrays_b, strict=True):
            if array_a.size != info.numel or array_b.size != info.numel:
                raise InputError(
                    f"{a.path} vs {b.path}",
                    f"read {array_a.size} and {array_b.size} elements, "
                    f"the shape holds {info.numel}",
                    info.name,
                )
        return arrays_a, arrays_b

    return ManyPairs(index, load, jobs)


def _pieces(
    a: Reader, b: Reader, jobs: Sequence[Pair], index: int, chunk_elems: int | None
) -> Iterator[PieceWork]:
    """The pieces of jobs[index], one pair of aligned chunks (or one side's chunk) each."""
    job = jobs[index]
    info_a, info_b = job.info_a, job.info_b
    if job.paired:
        assert info_a is not None
        assert info_b is not None
        n = chunk_elems or min(default_chunk_elems(info_a.dtype), default_chunk_elems(info_b.dtype))
        pieces = aligned_pieces(a.chunks(info_a, n), b.chunks(info_b, n))
        count = 0
        try:
            for piece_a, piece_b in pieces:
                count += piece_a.size
                yield PieceWork(
                    index, piece_a, piece_b, job.same_dtype, job.as_complex, job.by_value
                )
        except ValueError as exc:
            raise InputError(f"{a.path} vs {b.path}", str(exc), info_a.name) from None
        if count != info_a.numel:
            raise InputError(
                f"{a.path} vs {b.path}",
                f"read {count} elements, the shape holds {info_a.numel}",
                info_a.name,
            )
        return
    if info_a is not None:
        for piece in a.chunks(info_a, chunk_elems):
            yield PieceWork(index, piece, None)
    if info_b is not None:
        for piece in b.chunks(info_b, chunk_elems):
            yield PieceWork(index, None, piece)


def aligned_pieces(
    chunks_a: Iterable[np.ndarray], chunks_b: Iterable[np.ndarray]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pairs of equally long consecutive pieces of two flat element streams.

    Readers asked for the same chunk_elems usually return equal pieces (then they pass
    through unsplit); where they do not (HDF5 rounds pieces to whole rows), the longer
    piece is cut, so at most one piece per side is held at a time. Raises ValueError if one
    stream ends before the other.
    """
    iter_a, iter_b = iter(chunks_a), iter(chunks_b)
    rest_a = rest_b = _EMPTY
    while True:
        if rest_a.size == 0:
            rest_a = _next_piece(iter_a)
        if rest_b.size == 0:
            rest_b = _next_piece(iter_b)
        if rest_a.size == 0 or rest_b.size == 0:
            if rest_a.size or rest_b.size:
                raise ValueError("the two sides yielded different numbers of elements")
            return
        n = min(rest_a.size, rest_b.size)
        yield rest_a[:n], rest_b[:n]
        rest_a, rest_b = rest_a[n:], rest_b[n:]


_EMPTY = np.empty(0)


def _next_piece(chunks: Iterator[np.ndarray]) -> np.ndarray:
    """The next non-empty piece, flattened; empty at the end of the stream."""
    for chunk in chunks:
        if chunk.size:
            return chunk.reshape(-1)
    return _EMPTY
