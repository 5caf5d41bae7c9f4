"""Compare two checkpoints tensor by tensor: norms, ‖A−B‖, relative change, cosine.

Works across formats (an npz against a safetensors file, HDF5 against a model directory):
tensors are matched by name, metadata by key. Memory stays bounded: both tensors are
streamed in chunks of the same element count, re-cut where a reader's pieces do not line
up (the HDF5 reader rounds pieces to whole rows), and every pair of pieces is reduced to a
few numbers in worker threads (`parallel.ordered_map`); reading stays in the calling thread.

Numerics
--------
* Every piece is widened to float64 (complex to complex128, compared through its real
  view, so |z|² = re² + im² and A·B is the real inner product Re Σ conj(a)·b). Integer
  and bool tensors are compared the same way (exact up to 2**53) but, as for norms, only
  floating-point tensors enter the global figures.
* ‖A‖, ‖B‖ and ‖A−B‖ are `norms.NormAccumulator` sums: exact float64 sums of squares with
  power-of-two rescaling, so 1e300 or 1e-300 values neither overflow nor underflow. ‖A‖ is
  the very number `clipcli norms` reports for A.
* A·B is a float64 dot product per piece. A piece whose largest |value| lies outside
  [2**-400, 2**400] is first scaled by a power of two (exact), and the pieces' sums are
  carried as mantissa * 2**exponent, so the dot product cannot overflow, and underflow
  only drops products below 2**-1074 of a sum that is at least 2**-800: the cosine keeps
  an absolute error of a few ulps. It is not compensated: for nearly orthogonal tensors
  the cosine is accurate in absolute (~1e-16 · sqrt(n)), not relative, terms.
* Non-finite values never raise. ‖A‖ and ‖B‖ are nan if the tensor holds a NaN, inf if an
  Inf (as in `clipcli norms`). For the difference, positions holding the same value on both
  sides (including the same infinity, and NaN on both sides) count as unchanged (0);
  elsewhere IEEE arithmetic applies: a NaN on one side only makes diff_norm and
  max_abs_diff nan, an Inf against anything else makes them inf. The cosine is nan
  whenever a norm is not finite. So a file compared with itself is all zeros even when it
  holds NaN/Inf, and a NaN that appears or disappears shows as nan.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clipcli.dtypes import is_floating
from clipcli.errors import InputError, UsageError
from clipcli.formats.base import Reader, TensorInfo, default_chunk_elems
from clipcli.formats.compare import file_changes
from clipcli.formats.sharded import ShardedReader
from clipcli.io import open_reader
from clipcli.numerics.norms import NormAccumulator, accumulate, global_norm, widen
from clipcli.parallel import ordered_map
from clipcli.progress import SILENT, Progress
from clipcli.scope import Notify, check_patterns, ignore, warn_quantized

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

# A piece whose largest |value| lies in this range needs no rescaling for the dot product:
# products stay within 2**±800 and a sum of them cannot overflow.
_DOT_SAFE_HI = 2.0**400
_DOT_SAFE_LO = 2.0**-400


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
    in_global: bool = False  # A is floating point and compared: counts in global_diff_norm

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
    global_norm_a: float  # over A's floating-point tensors (selected), like `clipcli norms`
    global_norm_b: float  # over B's floating-point tensors (selected)
    global_diff_norm: float  # sqrt(Σ ‖A−B‖²) over compared tensors that are floating in A
    global_rel_change: float  # global_diff_norm / global_norm_a (0 if nothing changed)

    @property
    def max_rel_change(self) -> float | None:
        """Largest rel_change of any compared tensor (nan if one is nan); None if none."""
        largest = self.largest_change
        return None if largest is None else largest.rel_change

    @property
    def largest_change(self) -> TensorDiff | None:
        """The compared tensor with the largest rel_change (a nan one wins)."""
        best: TensorDiff | None = None
        for t in self.tensors:
            if t.rel_change is None:
                continue
            if math.isnan(t.rel_change):
                return t
            if best is None or t.rel_change > (best.rel_change or 0.0):
                best = t
        return best

    @property
    def counts(self) -> dict[Status, int]:
        """Tensors per status; every status is a key."""
        result: dict[Status, int] = dict.fromkeys(STATUSES, 0)
        for t in self.tensors:
            result[t.status] += 1
        return result

    @property
    def n_same(self) -> int:
        return sum(t.status == SAME for t in self.tensors)

    @property
    def n_changed(self) -> int:
        """Compared tensors whose bits differ (status changed or dtype changed)."""
        return sum(t.status in (CHANGED, DTYPE_CHANGED) for t in self.tensors)

    @property
    def n_structural(self) -> int:
        """Tensors missing on one side or reshaped."""
        return sum(t.structural for t in self.tensors)

    @property
    def identical(self) -> bool:
        """Every tensor bit-identical and no metadata change."""
        return not self.metadata_changes and all(t.status == SAME for t in self.tensors)


# ---------------------------------------------------------------------------------------
# public entry points


def diff_checkpoints(
    path_a: Path,
    path_b: Path,
    selection: Callable[[str], bool] | None = None,
    *,
    chunk_elems: int | None = None,
    progress: Progress = SILENT,
    workers: int | None = None,
    notify: Notify = ignore,
) -> DiffResult:
    """Compare the checkpoints at path_a (the reference) and path_b, of any formats."""
    with open_reader(path_a) as reader_a, open_reader(path_b) as reader_b:
        check_scope(reader_a, reader_b, selection, notify)
        return diff_readers(
            reader_a,
            reader_b,
            selection,
            chunk_elems=chunk_elems,
            progress=progress,
            workers=workers,
        )


def diff_readers(
    a: Reader,
    b: Reader,
    selection: Callable[[str], bool] | None = None,
    *,
    chunk_elems: int | None = None,
    progress: Progress = SILENT,
    workers: int | None = None,
) -> DiffResult:
    """Compare two open readers; `selection` (e.g. engine.Selection) filters tensor names.

    chunk_elems: elements per piece read from each side (default: 1 MiB of the wider
    dtype). workers: threads for the arithmetic (default parallel.worker_count()).
    """
    if chunk_elems is not None and chunk_elems < 1:
        raise UsageError(f"chunk_elems must be positive, got {chunk_elems}")
    keep = selection if selection is not None else _everything
    infos_a = [info for info in a.infos if keep(info.name)]
    infos_b = [info for info in b.infos if keep(info.name)]
    by_name_b = {info.name: info for info in infos_b}
    names_a = {info.name for info in infos_a}
    jobs = [_Job(info, by_name_b.get(info.name)) for info in infos_a]
    jobs += [_Job(None, info) for info in infos_b if info.name not in names_a]

    running = [_Running() for _ in jobs]
    total = sum(
        (j.info_a.nbytes if j.info_a else 0) + (j.info_b.nbytes if j.info_b else 0) for j in jobs
    )
    progress.start("comparing", total)
    stream = _work_items(a, b, jobs, chunk_elems)
    for index, partial in ordered_map(_reduce_item, stream, workers):
        running[index].merge(partial)
        progress.advance(partial.nbytes)
    progress.finish()

    tensors = [_finish(job, run) for job, run in zip(jobs, running, strict=True)]
    return _result(a, b, jobs, tensors)


def check_scope(
    a: Reader, b: Reader, selection: Callable[[str], bool] | None, notify: Notify
) -> None:
    """Before reading data: refuse an empty selection over both files' names (exit 2), warn
    about patterns matching nothing and about quantized weights (compared as codes)."""
    include, exclude = getattr(selection, "include", ()), getattr(selection, "exclude", ())
    keep = selection if selection is not None else _everything
    names = list(dict.fromkeys([i.name for i in a.infos] + [i.name for i in b.infos]))
    check_patterns(names, include, exclude, [n for n in names if keep(n)], notify)
    said: list[tuple[str, str]] = []  # A and B alike (e.g. a file and its copy): once
    for reader in (a, b):
        directory = reader.directory if isinstance(reader, ShardedReader) else None
        warn_quantized(reader.infos, directory, lambda *message: said.append(message))
    for level, text in dict.fromkeys(said):
        notify(level, text)


def _everything(name: str) -> bool:
    return True


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


@dataclass(frozen=True)
class _Job:
    info_a: TensorInfo | None
    info_b: TensorInfo | None

    @property
    def name(self) -> str:
        info = self.info_a if self.info_a is not None else self.info_b
        assert info is not None
        return info.name

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
class _Item:
    """Aligned pieces of A and B (paired tensors), or a piece of one side only."""

    index: int
    a: np.ndarray | None
    b: np.ndarray | None
    same_dtype: bool = False
    as_complex: bool = False


def _work_items(
    a: Reader, b: Reader, jobs: Sequence[_Job], chunk_elems: int | None
) -> Iterator[_Item]:
    for index, job in enumerate(jobs):
        info_a, info_b = job.info_a, job.info_b
        if job.paired:
            assert info_a is not None and info_b is not None
            n = chunk_elems or min(
                default_chunk_elems(info_a.dtype), default_chunk_elems(info_b.dtype)
            )
            pieces = aligned_pieces(a.chunks(info_a, n), b.chunks(info_b, n))
            count = 0
            try:
                for piece_a, piece_b in pieces:
                    count += piece_a.size
                    yield _Item(index, piece_a, piece_b, job.same_dtype, job.as_complex)
            except ValueError as exc:
                raise InputError(f"{a.path} vs {b.path}", str(exc), info_a.name) from None
            if count != info_a.numel:
                raise InputError(
                    f"{a.path} vs {b.path}",
                    f"read {count} elements, the shape holds {info_a.numel}",
                    info_a.name,
                )
            continue
        if info_a is not None:
            for piece in a.chunks(info_a, chunk_elems):
                yield _Item(index, piece, None)
        if info_b is not None:
            for piece in b.chunks(info_b, chunk_elems):
                yield _Item(index, None, piece)


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


# ---------------------------------------------------------------------------------------
# per-piece reduction (runs in worker threads) and per-tensor merge


@dataclass
class _ScaledSum:
    """A signed sum carried as mant * 2**exp, mant normalised to [0.5, 1)."""

    mant: float = 0.0
    exp: int = 0

    def add(self, mant: float, exp: int) -> None:
        if mant == 0.0:
            return
        if self.mant == 0.0:
            total, at = mant, exp
        elif exp > self.exp:
            total, at = mant + math.ldexp(self.mant, self.exp - exp), exp
        else:
            total, at = self.mant + math.ldexp(mant, exp - self.exp), self.exp
        if math.isfinite(total) and total != 0.0:
            frac, shift = math.frexp(total)
            self.mant, self.exp = frac, at + shift
        else:
            self.mant, self.exp = total, at


@dataclass
class _Partial:
    acc_a: NormAccumulator | None = None
    acc_b: NormAccumulator | None = None
    acc_d: NormAccumulator | None = None
    dot: tuple[float, int] = (0.0, 0)
    identical: bool = True
    nbytes: int = 0


@dataclass
class _Running:
    acc_a: NormAccumulator = field(default_factory=NormAccumulator)
    acc_b: NormAccumulator = field(default_factory=NormAccumulator)
    acc_d: NormAccumulator = field(default_factory=NormAccumulator)
    dot: _ScaledSum = field(default_factory=_ScaledSum)
    identical: bool = True

    def merge(self, part: _Partial) -> None:
        if part.acc_a is not None:
            self.acc_a.merge(part.acc_a)
        if part.acc_b is not None:
            self.acc_b.merge(part.acc_b)
        if part.acc_d is not None:
            self.acc_d.merge(part.acc_d)
        self.dot.add(*part.dot)
        self.identical = self.identical and part.identical


def _reduce_item(item: _Item) -> tuple[int, _Partial]:
    if item.a is None or item.b is None:
        piece = item.a if item.a is not None else item.b
        assert piece is not None
        stats = accumulate([piece])
        if item.a is not None:
            return item.index, _Partial(acc_a=stats, nbytes=piece.nbytes)
        return item.index, _Partial(acc_b=stats, nbytes=piece.nbytes)
    return item.index, _compare(item.a, item.b, item.same_dtype, item.as_complex)


def _compare(a: np.ndarray, b: np.ndarray, same_dtype: bool, as_complex: bool) -> _Partial:
    nbytes = a.nbytes + b.nbytes
    acc_a = accumulate([a])
    if same_dtype and np.array_equal(_bits(a), _bits(b)):
        # Bit-identical: B's statistics are A's, the difference is zero, A·B = ‖A‖².
        dot = (acc_a.ssq, 2 * acc_a.exp) if not acc_a.nonfinite else (0.0, 0)
        return _Partial(acc_a, copy.copy(acc_a), NormAccumulator(), dot, True, nbytes)
    acc_b = accumulate([b])
    wide_a, wide_b = _wide(a, as_complex), _wide(b, as_complex)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 1e308 - -1e308
        diff = wide_a - wide_b
    finite = not (acc_a.nonfinite or acc_b.nonfinite)
    if not finite:
        # Equal values (the same infinity, NaN on both sides) are unchanged: 0, not nan.
        unchanged = (wide_a == wide_b) | (np.isnan(wide_a) & np.isnan(wide_b))
        diff[unchanged] = 0.0
    acc_d = accumulate([diff.view(np.complex128) if as_complex else diff])
    dot = _scaled_dot(wide_a, wide_b, acc_a.max_abs, acc_b.max_abs) if finite else (0.0, 0)
    return _Partial(acc_a, acc_b, acc_d, dot, False, nbytes)


def _bits(chunk: np.ndarray) -> np.ndarray:
    """The elements' bit patterns in native byte order, as unsigned integers."""
    if not chunk.dtype.isnative:
        chunk = chunk.astype(chunk.dtype.newbyteorder("="))
    chunk = np.ascontiguousarray(chunk)
    size = chunk.dtype.itemsize
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(size)
    if unsigned is None:
        unsigned = np.uint64 if size % 8 == 0 else np.uint8
    return chunk.view(unsigned)


def _wide(chunk: np.ndarray, as_complex: bool) -> np.ndarray:
    """float64 values (complex: the real view of complex128), a fresh or read-only array."""
    if as_complex:
        if chunk.dtype.kind != "c":
            chunk = widen(chunk)
        wide = np.ascontiguousarray(chunk, dtype=np.complex128)
        return wide.view(np.float64)
    return np.ascontiguousarray(widen(chunk))


def _scaled_dot(a: np.ndarray, b: np.ndarray, max_a: float, max_b: float) -> tuple[float, int]:
    """a·b as (mant, exp) meaning mant * 2**exp; rescaled when values are extreme."""
    if max_a == 0.0 or max_b == 0.0:
        return 0.0, 0
    exp_a = 0 if _DOT_SAFE_LO <= max_a <= _DOT_SAFE_HI else math.frexp(max_a)[1]
    exp_b = 0 if _DOT_SAFE_LO <= max_b <= _DOT_SAFE_HI else math.frexp(max_b)[1]
    scaled_a = np.ldexp(a, -exp_a) if exp_a else a
    scaled_b = np.ldexp(b, -exp_b) if exp_b else b
    return float(np.dot(scaled_a, scaled_b)), exp_a + exp_b


# ---------------------------------------------------------------------------------------
# final figures


def _finish(job: _Job, run: _Running) -> TensorDiff:
    info_a, info_b = job.info_a, job.info_b
    norm_a = run.acc_a.norm if info_a is not None else None
    norm_b = run.acc_b.norm if info_b is not None else None
    common: dict[str, Any] = {
        "name": job.name,
        "dtype_a": info_a.dtype_name if info_a else None,
        "dtype_b": info_b.dtype_name if info_b else None,
        "shape_a": info_a.shape if info_a else None,
        "shape_b": info_b.shape if info_b else None,
        "norm_a": norm_a,
        "norm_b": norm_b,
        "nonfinite_a": run.acc_a.nonfinite,
        "nonfinite_b": run.acc_b.nonfinite,
    }
    if not job.paired:
        status: Status = (
            ONLY_IN_B if info_a is None else ONLY_IN_A if info_b is None else SHAPE_CHANGED
        )
        return TensorDiff(
            status=status,
            diff_norm=None,
            rel_change=None,
            max_abs_diff=None,
            cosine=None,
            norm_ratio=None,
            **common,
        )
    assert info_a is not None and norm_a is not None and norm_b is not None
    if not job.same_dtype:
        status = DTYPE_CHANGED
    else:
        status = SAME if run.identical else CHANGED
    diff_norm = run.acc_d.norm
    return TensorDiff(
        status=status,
        diff_norm=diff_norm,
        rel_change=relative(diff_norm, norm_a),
        max_abs_diff=_max_abs(run.acc_d),
        cosine=_cosine(run, norm_a, norm_b, status == SAME),
        norm_ratio=norm_b / norm_a if norm_a != 0 else None,
        in_global=is_floating(info_a.dtype),
        **common,
    )


def relative(change: float, reference: float) -> float:
    """change / reference, with 0 for no change and inf for a change of nothing."""
    if change == 0.0:
        return 0.0
    if reference == 0.0:
        return math.inf
    return change / reference


def _max_abs(acc: NormAccumulator) -> float:
    if acc.nan_count:
        return math.nan
    if acc.nonfinite:
        return math.inf
    return acc.max_abs


def _cosine(run: _Running, norm_a: float, norm_b: float, identical: bool) -> float | None:
    if norm_a == 0.0 or norm_b == 0.0:
        return None
    if not (math.isfinite(norm_a) and math.isfinite(norm_b)):
        return math.nan
    if identical:
        return 1.0
    # A·B / (‖A‖‖B‖) with ‖X‖ = sqrt(ssq) * 2**exp, all in mantissa/exponent form.
    a, b = run.acc_a, run.acc_b
    ratio = run.dot.mant / (math.sqrt(a.ssq) * math.sqrt(b.ssq))
    try:
        cosine = math.ldexp(ratio, run.dot.exp - a.exp - b.exp)
    except OverflowError:
        cosine = math.copysign(1.0, ratio)
    return max(-1.0, min(1.0, cosine))


def _result(a: Reader, b: Reader, jobs: Sequence[_Job], tensors: list[TensorDiff]) -> DiffResult:
    norms_a, norms_b = [], []
    for job, t in zip(jobs, tensors, strict=True):
        if job.info_a is not None and t.norm_a is not None and is_floating(job.info_a.dtype):
            norms_a.append(t.norm_a)
        if job.info_b is not None and t.norm_b is not None and is_floating(job.info_b.dtype):
            norms_b.append(t.norm_b)
    global_a = global_norm(norms_a)
    diffs = [t.diff_norm for t in tensors if t.in_global and t.diff_norm is not None]
    global_diff = global_norm(diffs)
    return DiffResult(
        path_a=a.path,
        path_b=b.path,
        format_a=a.format_name,
        format_b=b.format_name,
        tensors=tensors,
        metadata_changes=file_changes(a, b),  # metadata, then HDF5 structure
        global_norm_a=global_a,
        global_norm_b=global_norm(norms_b),
        global_diff_norm=global_diff,
        global_rel_change=relative(global_diff, global_a),
    )
