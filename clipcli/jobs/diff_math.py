"""The arithmetic of clipcli diff: each pair of aligned pieces reduced to a few numbers
(in worker threads), merged per tensor, and turned into the final figures.

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

import dataclasses
import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clipcli.dtypes import is_floating
from clipcli.formats.base import Reader
from clipcli.jobs.diff import (
    CHANGED,
    DTYPE_CHANGED,
    ONLY_IN_A,
    ONLY_IN_B,
    SAME,
    SHAPE_CHANGED,
    DiffResult,
    ManyPairs,
    Pair,
    PieceWork,
    Status,
    TensorDiff,
)
from clipcli.jobs.diff_metadata import file_changes
from clipcli.numerics.difference import difference
from clipcli.numerics.many import accumulate_each
from clipcli.numerics.norms import (
    NormAccumulator,
    ScaledSum,
    accumulate,
    global_norm,
    scaled_dot,
)
from clipcli.numerics.widening import widen, widen_real

# ---------------------------------------------------------------------------------------
# per-piece reduction (runs in worker threads) and per-tensor merge


@dataclass
class Partial:
    acc_a: NormAccumulator | None = None
    acc_b: NormAccumulator | None = None
    acc_d: NormAccumulator | None = None
    dot: tuple[float, int] = (0.0, 0)
    identical: bool = True
    nbytes: int = 0


@dataclass
class Running:
    acc_a: NormAccumulator = field(default_factory=NormAccumulator)
    acc_b: NormAccumulator = field(default_factory=NormAccumulator)
    acc_d: NormAccumulator = field(default_factory=NormAccumulator)
    dot: ScaledSum = field(default_factory=ScaledSum)
    identical: bool = True

    def merge(self, part: Partial) -> None:
        if part.acc_a is not None:
            self.acc_a.merge(part.acc_a)
        if part.acc_b is not None:
            self.acc_b.merge(part.acc_b)
        if part.acc_d is not None:
            self.acc_d.merge(part.acc_d)
        self.dot.add(*part.dot)
        self.identical = self.identical and part.identical


def reduce_piece(item: PieceWork) -> tuple[int, Partial]:
    if item.a is None or item.b is None:
        piece = item.a if item.a is not None else item.b
        assert piece is not None
        stats = accumulate([piece])
        if item.a is not None:
            return item.index, Partial(acc_a=stats, nbytes=piece.nbytes)
        return item.index, Partial(acc_b=stats, nbytes=piece.nbytes)
    return item.index, _compare(item.a, item.b, item.same_dtype, item.as_complex, item.by_value)


def reduce_many(item: ManyPairs) -> list[Partial]:
    """A Partial for each pair of small whole tensors, as reduce_piece gives it: A's
    statistics and which pairs are bit-identical worked out for all at once (most pairs of
    a checkpoint and its clipped or converted copy are one or the other), the rest pair
    by pair."""
    arrays_a, arrays_b = item.load()
    accs_a = accumulate_each(arrays_a)
    identical = _identical_each(arrays_a, arrays_b, item.jobs)
    changed = [k for k, same in enumerate(identical) if not same]
    accs_b: list[NormAccumulator | None] = [None] * len(arrays_b)
    for k, measured in zip(changed, accumulate_each([arrays_b[k] for k in changed]), strict=True):
        accs_b[k] = measured
    partials = []
    for a, b, acc_a, acc_b, job in zip(arrays_a, arrays_b, accs_a, accs_b, item.jobs, strict=True):
        if acc_b is None:  # bit-identical
            partials.append(_unchanged(acc_a, a.nbytes + b.nbytes))
        else:
            flags = (job.same_dtype, job.as_complex, job.by_value)
            partials.append(_compare(a, b, *flags, acc_a=acc_a, acc_b=acc_b))
    return partials


def _identical_each(
    arrays_a: list[np.ndarray], arrays_b: list[np.ndarray], jobs: Sequence[Pair]
) -> list[bool]:
    """Whether each pair is bit-identical (same dtype, not compared by value), one
    comparison per pair of dtypes over the pairs laid end to end; False says only "not
    known here": _compare decides."""
    groups: dict[tuple[str, str], list[int]] = {}
    for k, (a, b, job) in enumerate(zip(arrays_a, arrays_b, jobs, strict=True)):
        if job.same_dtype and not job.by_value and a.size:
            groups.setdefault((a.dtype.str, b.dtype.str), []).append(k)
    identical = [False] * len(arrays_a)
    for members in groups.values():
        # Words, not elements: _bits views a complex128 element as two uint64.
        words_a = [_bits(arrays_a[k]).reshape(-1) for k in members]
        words_b = [_bits(arrays_b[k]).reshape(-1) for k in members]
        starts = np.cumsum([0] + [words.size for words in words_a[:-1]])
        same = np.logical_and.reduceat(np.concatenate(words_a) == np.concatenate(words_b), starts)
        for k, each in zip(members, same.tolist(), strict=True):
            identical[k] = each
    return identical


def _unchanged(acc_a: NormAccumulator, nbytes: int) -> Partial:
    """A bit-identical pair: B's statistics are A's, the difference is zero, A·B = ‖A‖².
    (The one accumulator serves both sides: a Partial's are only merged from, and a
    shallow copy, as before, shared its sum anyway.)"""
    dot = (acc_a.ssq, 2 * acc_a.exp) if not acc_a.nonfinite else (0.0, 0)
    return Partial(acc_a, acc_a, NormAccumulator(), dot, True, nbytes)


def _compare(
    a: np.ndarray,
    b: np.ndarray,
    same_dtype: bool,
    as_complex: bool,
    by_value: bool = False,
    acc_a: NormAccumulator | None = None,
    acc_b: NormAccumulator | None = None,
) -> Partial:
    """The Partial of a pair of aligned pieces; acc_a, acc_b: each side's statistics, if
    worked out (B's only where the pair is not bit-identical)."""
    nbytes = a.nbytes + b.nbytes
    if acc_a is None:
        acc_a = accumulate([a])
    if by_value:
        # A logical tensor's values are decoded, not stored: equal values (NaN as NaN, -0.0
        # as 0.0: a negative-zero code times a scale) are the same tensor, whatever dtype
        # the other side stores them in (a plain float32 copy of a quantized weight). A
        # dtype change is told from the dtypes its rows show (api._shown_dtypes).
        if np.array_equal(a, b, equal_nan=True):
            return _unchanged(acc_a, nbytes)
    elif same_dtype and np.array_equal(_bits(a), _bits(b)):
        return _unchanged(acc_a, nbytes)
    if acc_b is None:
        acc_b = accumulate([b])
    wide_a, wide_b = _wide(a, as_complex), _wide(b, as_complex)
    # Exact differences, not those of the widened values: int64 2**60 + 1 vs 2**60 is 1.
    diff, shift = difference(_real_parts(a, as_complex), _real_parts(b, as_complex))
    finite = not (acc_a.nonfinite or acc_b.nonfinite)
    if not finite:
        # The same infinity, or NaN on both sides, is unchanged: 0, not nan. (Only floats
        # are non-finite, and they are exact when widened.)
        unchanged = (np.isinf(wide_a) & (wide_a == wide_b)) | (np.isnan(wide_a) & np.isnan(wide_b))
        diff[unchanged] = 0.0
    acc_d = accumulate([diff.view(np.complex128) if as_complex else diff])
    if shift:
        acc_d.sumsq.exp += 2 * shift  # the squares of differences halved `shift` times
        try:
            acc_d.max_abs = math.ldexp(acc_d.max_abs, shift)
        except OverflowError:  # the largest difference itself is beyond float64
            acc_d.max_abs = math.inf
    dot = scaled_dot(wide_a, wide_b, acc_a.max_abs, acc_b.max_abs) if finite else (0.0, 0)
    return Partial(acc_a, acc_b, acc_d, dot, False, nbytes)


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


def _real_parts(chunk: np.ndarray, as_complex: bool) -> np.ndarray:
    """The chunk's values in their own dtype (integers stay integers, to be subtracted
    exactly); against a complex side, as real and imaginary parts side by side."""
    if not as_complex:
        return chunk
    if chunk.dtype.kind == "c":
        return widen(chunk).view(np.float64)
    parts = np.zeros((chunk.size, 2), dtype=chunk.dtype)
    parts[:, 0] = chunk.reshape(-1)
    return parts.reshape(-1)


def _wide(chunk: np.ndarray, as_complex: bool) -> np.ndarray:
    """float64 values (complex: the real view of complex128), a fresh or read-only array."""
    if as_complex:
        if chunk.dtype.kind != "c":
            chunk = widen_real(chunk)
        wide = np.ascontiguousarray(chunk, dtype=np.complex128)
        return wide.view(np.float64)
    return np.ascontiguousarray(widen_real(chunk))


# ---------------------------------------------------------------------------------------
# final figures


def finish(job: Pair, run: Running, weight: bool = True) -> TensorDiff:
    """The figures of one tensor; `weight`: a model weight by name (or --all-tensors),
    which counts in the global figures if A's dtype is floating point."""
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
        "part": job.part,
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
    assert info_a is not None
    assert norm_a is not None
    assert norm_b is not None
    if job.by_value:  # compared in float64: the dtypes its rows show decide a dtype change
        status = SAME if run.identical else CHANGED
    else:
        status = DTYPE_CHANGED if not job.same_dtype else SAME if run.identical else CHANGED
    diff_norm = run.acc_d.norm
    rel_change = _relative_change(run.acc_d, run.acc_a)
    if status == CHANGED and rel_change == 0.0:
        # Bits that no value shows changed (-0.0 for 0.0, a NaN's payload): the smallest
        # change there is, so that `--fail-above 0` sees what `changed` says.
        rel_change = _never_zero(0.0)
    return TensorDiff(
        status=status,
        diff_norm=diff_norm,
        rel_change=rel_change,
        max_abs_diff=_max_abs(run.acc_d),
        cosine=_cosine(run, norm_a, norm_b, status == SAME),
        norm_ratio=norm_b / norm_a if norm_a != 0 else None,
        in_global=weight and is_floating(info_a.dtype) and not job.part,
        **common,
    )


def relative(change: float, reference: float) -> float:
    """change / reference, with 0 for no change and inf for a change of nothing. A change
    is never reported as 0: a quotient below float64's range is the smallest float64."""
    if change == 0.0:
        return 0.0
    if reference == 0.0:
        return math.inf
    return _never_zero(change / reference)


def _relative_change(diff: NormAccumulator, base: NormAccumulator) -> float:
    """‖A−B‖/‖A‖ from the scaled sums of squares, so that neither norm overflowing
    (1e308 values) nor the quotient underflowing (a change of 5e-324 against 1e300) hides
    a change: 0 exactly when no value changed. nan when a difference is NaN, or when
    something changed and ‖A‖ is not finite (A holds NaN or Inf: no ratio to take)."""
    changed = diff.sumsq.mant != 0.0 or diff.nonfinite
    if not changed:
        return 0.0
    if diff.nan_count or base.nonfinite:
        return math.nan
    if diff.nonfinite or base.sumsq.mant == 0.0:
        return math.inf
    ratio = math.sqrt(diff.ssq) / math.sqrt(base.ssq)
    try:
        return _never_zero(math.ldexp(ratio, diff.exp - base.exp))
    except OverflowError:
        return math.inf


def _never_zero(quotient: float) -> float:
    """A nonzero quotient that underflowed to 0 is the smallest float64 instead, so that
    `--fail-above 0` and `rel_change > 0` see the change."""
    return quotient if quotient != 0.0 else math.ulp(0.0)


def _max_abs(acc: NormAccumulator) -> float:
    if acc.nan_count:
        return math.nan
    if acc.nonfinite:
        return math.inf
    return acc.max_abs


def _cosine(run: Running, norm_a: float, norm_b: float, identical: bool) -> float | None:
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


def counted_once(tied: Mapping[str, str], counts: Container[str]) -> dict[str, str]:
    """Of each tied group (a first name and the names tied to it: one storage), the names
    that count but are left out, each mapped to the one that counts for the group: the
    first member that counts (as `norms` does, api._counted_ties), so a group whose first
    name is not counted is still counted once, never zero times."""
    groups: dict[str, list[str]] = {}
    for name, first in tied.items():
        groups.setdefault(first, [first]).append(name)
    left_out: dict[str, str] = {}
    for members in groups.values():
        counted = [n for n in members if n in counts]
        left_out.update(dict.fromkeys(counted[1:], counted[0]) if counted else {})
    return left_out


def result(
    a: Reader,
    b: Reader,
    jobs: Sequence[Pair],
    tensors: list[TensorDiff],
    weights: Sequence[bool],
    tied_a: Mapping[str, str] | None = None,
    tied_b: Mapping[str, str] | None = None,
) -> DiffResult:
    """The global figures over the tensors that are `weights` (by name) and floating point
    on their side: the selection `clipcli norms` makes of each file. `tied_a`/`tied_b`:
    each side's tied tensors (name -> the first of its storage), counted once in that
    side's norm; a tensor tied alike on both sides has its first one's difference, so it
    counts once in ‖A−B‖ too (and says `tied_to`)."""
    tied_a, tied_b = tied_a or {}, tied_b or {}
    norms_a: dict[str, float] = {}
    norms_b: dict[str, float] = {}
    for job, t, weight in zip(jobs, tensors, weights, strict=True):
        if not weight or job.part:
            continue
        if job.info_a is not None and t.norm_a is not None and is_floating(job.info_a.dtype):
            norms_a[job.name] = t.norm_a
        if job.info_b is not None and t.norm_b is not None and is_floating(job.info_b.dtype):
            norms_b[job.name] = t.norm_b
    once_a, once_b = counted_once(tied_a, norms_a), counted_once(tied_b, norms_b)
    global_a = global_norm(v for n, v in norms_a.items() if n not in once_a)
    tied_alike = {n: first for n, first in tied_a.items() if tied_b.get(n) == first}
    in_diff = {t.name for t in tensors if t.in_global and t.diff_norm is not None}
    once_diff = counted_once(tied_alike, in_diff)
    tensors = [
        dataclasses.replace(t, in_global=False, tied_to=once_diff[t.name])
        if t.name in once_diff
        else t
        for t in tensors
    ]
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
        global_norm_b=global_norm(v for n, v in norms_b.items() if n not in once_b),
        global_diff_norm=global_diff,
        global_rel_change=relative(global_diff, global_a),
        training_state=sum(not w and not job.part for job, w in zip(jobs, weights, strict=True)),
        tied_a=once_a,
        tied_b=once_b,
    )
