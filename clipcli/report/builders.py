"""Results -> Report: which columns each command shows, in which order, with which summary.

No arithmetic on tensors here: the numbers come measured; ordering keys come from plan.py.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from clipcli.report.model import Column, Report, Rows, SortKey, Value
from clipcli.words import count, count_number

if TYPE_CHECKING:  # keep `clipcli --help` from importing numpy
    from clipcli.api import ClipResult, ClipRow
    from clipcli.formats.base import ListedTensor, NonTensorInfo
    from clipcli.jobs.diff import DiffResult
    from clipcli.jobs.measurement import Measurement, TensorStats
    from clipcli.logical.view import QuantizedRows


def _norm_first(norm: float | None) -> float:
    """Largest first, NaN (and a figure that does not apply) after every number."""
    return -norm if norm is not None and not math.isnan(norm) else math.inf


T = TypeVar("T")


def ordered(
    items: Sequence[T],
    sort: SortKey,
    top: int | None,
    name: Callable[[T], str],
    norm: Callable[[T], float | None],
    counted: Callable[[T], bool],
    size: Callable[[T], int],
) -> list[T]:
    """The rows of any command in --sort order, the first --top of them. Natural name order
    is the default (layers.2 before layers.10: file order is no guide, as safetensors and
    h5py store names sorted as text); --sort norm ranks what the global norm counts,
    largest first, and lists the rest after it, each part in name order."""
    rows = list(items)
    if sort is not SortKey.FILE:
        # Imported here (once, not per row): groups.py is pure but sits with the jobs;
        # --help need not load it.
        from clipcli.jobs.groups import natural_key

        rows.sort(key=lambda r: natural_key(name(r)))  # also the tie-break of the others
    return _ranked(rows, sort, top, norm, counted, size)


def ordered_positions(
    count: int,
    sort: SortKey,
    top: int | None,
    name: Callable[[int], str],
    norm: Callable[[int], float | None],
    counted: Callable[[int], bool],
    size: Callable[[int], int],
) -> Sequence[int]:
    """ordered(range(count), ...) in less memory, for clip's report: its sort comes after
    the write pass, with the plan and outcome of every tensor still held, at the run's
    peak. The names sorted as packed keys (groups.natural_order: ~3 MB for 200,000 short
    names where tuple keys were ~40 MB, for ~1 us more a name), positions as an array."""
    if sort is SortKey.FILE:
        return range(count) if top is None else range(min(count, top))
    from clipcli.jobs.groups import natural_order

    positions = natural_order(count, name)
    if sort is SortKey.NAME:
        return positions if top is None else positions[:top]
    return array("q", _ranked(list(positions), sort, top, norm, counted, size))


def _ranked(
    rows: list[T],
    sort: SortKey,
    top: int | None,
    norm: Callable[[T], float | None],
    counted: Callable[[T], bool],
    size: Callable[[T], int],
) -> list[T]:
    """Rows in name order put in --sort norm or --sort size order (stable: name order
    breaks ties), the first --top of them."""
    if sort is SortKey.NORM:
        rows.sort(key=lambda r: (not counted(r), _norm_first(norm(r))))
    elif sort is SortKey.SIZE:
        rows.sort(key=lambda r: -size(r))
    return rows if top is None else rows[:top]


def written_to(out: str) -> str:
    """What the report says was written: OUT '-' is no file name."""
    return "safetensors to standard output" if out == "-" else out


def showing_line(shown: int, total: int, noun: str, top: int | None) -> list[str]:
    """The footer line that says --top left rows out; none when it did not."""
    if top is None or shown >= total:
        return []
    return [f"showing {shown} of {count(total, noun)} (--top {top})"]


# ------------------------------------------------------------------ ls

LS_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("shape", "shape"),
    Column("numel", "numel", numeric=True),
    Column("bytes", "bytes", numeric=True),
)
SHARD_COLUMN = Column("shard", "shard")
# Only where a checkpoint has quantized weights: a weight's scheme (JSON: {"scheme",
# "stored": its stored tensors}), a scale's or zero point's role (JSON: {"role", "of"}).
QUANTIZATION_COLUMN = Column("quantization", "quantized")


NON_TENSOR_LINES = 10  # footer lines naming non-tensors; JSON lists every one


def ls_report(
    path: str,
    fmt: str,
    metadata: Mapping[str, str],
    infos: Sequence[ListedTensor],
    sort: SortKey = SortKey.NAME,
    shards: Mapping[str, str] | None = None,
    listed_of: int | None = None,
    non_tensors: Sequence[NonTensorInfo] = (),
    quantized: QuantizedRows | None = None,
) -> Report:
    """`shards` (tensor -> shard file) adds a shard column for model directories;
    `listed_of` is the tensor count before --include/--exclude; `non_tensors` (an HDF5
    vocabulary, a string table) are named in the footer and listed whole in JSON."""
    order = ordered(
        infos, sort, None, lambda i: i.name, lambda _: None, lambda _: True, lambda i: i.nbytes
    )
    columns = LS_COLUMNS + ((SHARD_COLUMN,) if shards is not None else ())
    columns += () if quantized is None else (QUANTIZATION_COLUMN,)
    rows = tuple(
        (i.name, i.dtype_name, i.shape, i.numel, i.nbytes)
        + ((shards[i.name],) if shards is not None else ())
        + (() if quantized is None else (quantized.cell(i.name),))
        for i in order
    )
    total = sum(i.nbytes for i in infos)
    # Parameters are what norms counts in the global norm: floating-point model weights.
    # Optimizer slots and BatchNorm statistics (clipcli.jobs.roles) are training state, and
    # integer or bool tensors (position_ids, a step counter) no parameters: said apart.
    from clipcli.jobs.roles import Role, classify, is_floating_name

    # A quantized weight counts its real elements; its scales, zero points and maps are
    # counted apart, as norms leaves them out of the global norm.
    elements = dict.fromkeys(Role, 0)
    quantization = 0
    for i in infos:
        if quantized is not None and i.name in quantized.parts:
            quantization += i.numel
            continue
        elements[classify(i.name, is_floating_name(i.dtype_name))] += i.numel
    parameters = elements[Role.WEIGHT]
    training_state = elements[Role.OPTIMIZER] + elements[Role.BUFFER]
    non_float = elements[Role.NON_FLOAT]
    listed = count(len(infos), "tensor")
    if listed_of is not None and listed_of != len(infos):
        listed = f"{len(infos)} of {count(listed_of, 'tensor')}"
    counted = count_number(parameters, "parameter")
    apart = [f"+{training_state:,} in training state"] if training_state else []
    apart += [f"+{non_float:,} non-float"] if non_float else []
    apart += [f"+{quantization:,} in quantization tensors"] if quantization else []
    if apart:
        counted += f" ({', '.join(apart)})"
    footer = [f"{listed}, {counted}, {count_number(total, 'byte')}"]
    for item in non_tensors[:NON_TENSOR_LINES]:
        shape = "no dataspace" if item.shape is None else f"shape {list(item.shape)}"
        footer.append(f"non-tensor {item.name}: {item.kind}, {shape} (not measured)")
    if len(non_tensors) > NON_TENSOR_LINES:
        footer.append(f"... and {count(len(non_tensors) - NON_TENSOR_LINES, 'more non-tensor')}")
    summary: tuple[tuple[str, Any], ...] = (
        ("path", path),
        ("format", fmt),
        ("metadata", dict(metadata)),
        ("total_bytes", total),
        ("total_parameters", parameters),
        ("training_state_parameters", training_state),
        ("non_float_elements", non_float),
        *((("quantization_elements", quantization),) if quantized is not None else ()),
        (
            "non_tensors",
            [
                {
                    "name": item.name,
                    "kind": item.kind,
                    "shape": None if item.shape is None else list(item.shape),
                    "bytes": item.nbytes,
                }
                for item in non_tensors
            ],
        ),
    )
    return Report(
        f"{path} ({fmt})",
        columns,
        rows,
        summary,
        tuple(footer),
        drop_order=("numel",),
        drop_late=("bytes", "shard", "dtype"),
        metadata=tuple(metadata.items()),
    )


# ------------------------------------------------------------------ norms

NORM_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("shape", "shape"),
    Column("numel", "numel", numeric=True),
    Column("norm", "norm", numeric=True),
    Column("max_abs", "max|x|", numeric=True),
    Column("nonfinite", "nonfinite", numeric=True),
    Column("in_global", "global"),
    Column("role", "role"),  # weight, optimizer or buffer (clipcli.jobs.roles)
)
NORM_DROP_ORDER = ("numel", "role", "nonfinite", "shape")


def ranked_tensors(
    m: Measurement, sort: SortKey = SortKey.NAME, top: int | None = None
) -> list[TensorStats]:
    # Ranked among what the global norm counts: an int64 buffer (position_ids) or an
    # optimizer slot is listed after every weight, whatever its norm.
    return ordered(
        m.tensors,
        sort,
        top,
        lambda t: t.info.name,
        lambda t: t.norm,
        lambda t: t.in_global,
        lambda t: t.info.nbytes,
    )


def _norm_rows(
    tensors: Sequence[TensorStats], q: QuantizedRows | None
) -> Iterator[tuple[Value, ...]]:
    """The norms table's row of each tensor (one per tensor of 200,000: each dtype's name
    and each role's text looked up once, not asked of numpy and the enum per row); with
    `q`, a quantized weight's dtype and its quantization cell."""
    dtype_names: dict[Any, str] = {}
    role_texts: dict[Any, str] = {}
    for t in tensors:
        info, stats = t.info, t.stats
        dtype_name = dtype_names.get(info.dtype)
        if dtype_name is None:
            dtype_name = dtype_names[info.dtype] = info.dtype_name
        if t.tied_to is None:
            role = role_texts.get(t.role)
            if role is None:
                role = role_texts[t.role] = t.role.value
        else:
            role = f"tied to {t.tied_to}"
        row: tuple[Value, ...] = (
            info.name,
            dtype_name if q is None else q.dtype(info.name, dtype_name),
            info.shape,
            info.numel,
            t.norm,
            stats.largest_magnitude,
            stats.nonfinite,
            t.in_global,
            role,
        )
        yield row if q is None else (*row, q.cell(info.name))


def norms_report(m: Measurement, sort: SortKey = SortKey.NAME, top: int | None = None) -> Report:
    q = m.quantized
    rows = tuple(_norm_rows(ranked_tensors(m, sort, top), q))
    g = m.global_norm
    counted = sum(t.in_global for t in m.tensors)
    footer = [f"global L2 norm {g:.6g} over {count(counted, 'floating-point tensor')}"]
    footer += showing_line(len(rows), len(m.tensors), "tensor", top)
    return Report(
        f"{m.path} ({m.format})",
        NORM_COLUMNS + (() if q is None else (QUANTIZATION_COLUMN,)),
        rows,
        (("path", str(m.path)), ("format", m.format), ("global_norm", g)),
        tuple(footer),
        drop_order=NORM_DROP_ORDER,
        drop_late=("max_abs", "dtype", "quantization"),
        kept=("norm", "numel") if sort is SortKey.SIZE else ("norm",),
    )


GROUP_COLUMNS = (
    Column("group", "group"),
    Column("tensors", "tensors", numeric=True),
    Column("norm", "norm", numeric=True),
    Column("share", "share of global²", numeric=True),
)


def groups_report(
    m: Measurement, group_by: str, sort: SortKey = SortKey.NAME, top: int | None = None
) -> Report:
    groups = m.groups(group_by)  # in natural order, (other) last
    if sort is SortKey.NORM:
        groups.sort(key=lambda g: _norm_first(g.norm))
    shown = groups if top is None else groups[:top]
    rows = tuple((g.name, g.tensors, g.norm, g.share) for g in shown)
    g = m.global_norm
    footer = [f"global L2 norm {g:.6g} over {count(len(groups), 'group')}"]
    footer += showing_line(len(shown), len(groups), "group", top)
    return Report(
        f"{m.path} ({m.format}) grouped by {group_by}",
        GROUP_COLUMNS,
        rows,
        (("path", str(m.path)), ("format", m.format), ("global_norm", g), ("group_by", group_by)),
        tuple(footer),
        rows_key="groups",
        drop_late=("tensors", "share"),
        kept=("norm",),
    )


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class Bars(NamedTuple):
    """What --chart and --plot draw: exactly the rows the report lists."""

    title: str
    labels: tuple[str, ...]
    norms: tuple[float, ...]
    counted: tuple[bool, ...]  # in the global norm


def bars_of(report: Report) -> Bars:
    keys = [c.key for c in report.columns]
    norm_at = keys.index("norm")
    counted_at = keys.index("in_global") if "in_global" in keys else None
    rows = report.rows
    return Bars(
        report.title,
        tuple(str(r[0]) for r in rows),
        tuple(float(r[norm_at]) for r in rows),  # type: ignore[arg-type]
        tuple(True for _ in rows)
        if counted_at is None
        else tuple(bool(r[counted_at]) for r in rows),
    )


# ------------------------------------------------------------------ clip

CLIP_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("norm_before", "before", numeric=True),
    Column("norm_after", "after", numeric=True),
    Column("scale", "scale", numeric=True),
    Column("changed", "changed"),
    Column("note", "note"),
)


# The note column of `clip`: each plan reason in words (clipcli.jobs.plan.Reason).
REASON_TEXT = {
    "not selected": "not selected",
    "left out": "{role}, left unchanged",
    "not floating point": "not floating point",
    "non-finite skipped": "non-finite, skipped",
    "low rank skipped": "skipped: too few dimensions for --axes",
    "complex unordered": "complex: no order to clamp by",
    "within range": "within range",
    "within limit": "within limit",
    "zero tensor": "zero tensor",
    "over limit": "",
    "over range": "",
    "per slice": "{clipped} of {slices} clipped",
    "converted": "copied",
}


# The note of a tensor whose factor was rounded down to a power of two (MXFP4's E8M0
# scales), in the table and in JSON's `note`.
POWER_OF_TWO_NOTE = "scale rounded down to a power of two"


def clip_note(row: ClipRow) -> str:
    """The note for one tensor of a clip: its plan's reason, with its group if any."""
    reason = row.reason.value
    if reason == "left out" and row.changed:  # a quantized weight's scale: clipped with it
        return f"{row.plan.role.description}, rescaled with its weight"
    text = REASON_TEXT[reason].format(
        role=row.plan.role.description,
        clipped=row.outcome.slices_clipped,
        slices=count(row.outcome.slices, "slice"),
    )
    if row.plan.power_of_two:  # E8M0 scales (MXFP4): the factor is 2**-k, not the plan's
        text = f"{POWER_OF_TWO_NOTE}, {text}" if text else POWER_OF_TWO_NOTE
    if row.plan.tied_to is not None:  # counted once, as the tensor it shares values with
        text = f"tied to {row.plan.tied_to}, {text}" if text else f"tied to {row.plan.tied_to}"
    if row.plan.group is None:
        return text
    return f"{text}, group {row.plan.group}" if text else f"group {row.plan.group}"


# Reasons whose note is REASON_TEXT's text as it stands, whatever the outcome.
_PLAIN_REASONS = frozenset(REASON_TEXT) - {"left out", "per slice"}


def _clip_row(
    result: ClipResult, before: Sequence[float], after: Sequence[float]
) -> Callable[[int], tuple[Value, ...]]:
    """The table's cells of the row of the tensor at a position, each field read once,
    and the common note (a reason's fixed text) without clip_note's questions: 200,000
    rows, each made when a renderer reads it (model.Rows)."""
    tensors, outcomes, q = result.plan.tensors, result.outcomes, result.quantized

    def row(k: int) -> tuple[Value, ...]:
        plan = tensors[k]
        info = plan.info
        reason = plan.reason.value
        if (
            reason in _PLAIN_REASONS
            and plan.group is None
            and plan.tied_to is None
            and not plan.power_of_two
        ):
            note = REASON_TEXT[reason]
        else:
            note = clip_note(result.row(k))
        factor = plan.factor
        return (
            info.name,
            info.dtype_name if q is None else q.dtype(info.name, info.dtype_name),
            before[k],
            after[k],
            None if factor is None else math.ldexp(factor, plan.exponent),
            outcomes[k].changed,
            note,
        )

    return row


def clip_report(result: ClipResult, sort: SortKey = SortKey.NAME, top: int | None = None) -> Report:
    # Rows by position, each norm worked out once: a checkpoint may hold 200,000 tensors.
    every = result.plan.tensors
    before, after, global_before, global_after = result.norms()
    listed = ordered_positions(
        len(every),
        sort,
        top,
        lambda k: every[k].info.name,
        lambda k: before[k],  # --sort norm: the norm each tensor had before the clip
        lambda k: every[k].in_global,
        lambda k: every[k].info.nbytes,
    )
    rows = Rows(_clip_row(result, before, after), listed)
    spec = result.spec
    outcomes = result.outcomes
    changed = sum(o.changed for o in outcomes)
    verb = "would change" if result.dry_run else "changed"
    footer = [
        f"global L2 norm {global_before:.6g} -> {global_after:.6g}",
        f"{verb} {changed} of {count(len(every), 'tensor')}"
        + ("" if result.dry_run else f"; wrote {written_to(str(result.out))}"),
    ]
    to_zero = sum(o.flushes.to_zero for o in outcomes)
    to_subnormal = sum(o.flushes.to_subnormal for o in outcomes)
    footer += showing_line(len(rows), len(every), "tensor", top)
    if to_zero or to_subnormal:  # the dtype's range, not a bug: said, never silent
        footer.append(
            f"the scaling {'would flush' if result.dry_run else 'flushed'} "
            f"{count(to_zero, 'nonzero value')} to zero and made "
            f"{count(to_subnormal, 'value')} subnormal (below the dtype's normal range)"
        )
    summary: tuple[tuple[str, Value], ...] = (
        ("src", str(result.src)),
        ("out", str(result.out)),
        ("mode", spec.mode.value),
        ("limit", spec.limit if spec.mode.value != "value" else None),
        ("min", spec.low if spec.mode.value == "value" else None),
        ("max", spec.high if spec.mode.value == "value" else None),
        ("axes", list(spec.axes) if spec.axes is not None else None),
        ("used_norm", result.used_norm),
        ("dry_run", result.dry_run),
        ("global_norm_before", global_before),
        ("global_norm_after", global_after),
        ("changed", changed),
        ("flushed_to_zero", to_zero),
        ("made_subnormal", to_subnormal),
    )
    title = f"clip {spec.mode.value} {spec.describe_limit()}: {result.src}"
    return Report(
        title,
        CLIP_COLUMNS,
        rows,
        summary,
        tuple(footer),
        # `changed` says again what scale and note say (scale "-", or a note's reason)
        drop_order=("dtype", "changed", "scale"),
        drop_late=("note", "norm_before"),
        kept=("norm_before", "norm_after"),  # --sort norm sorts by norm_before
    )


# ------------------------------------------------------------------ diff

DIFF_COLUMNS = (
    Column("name", "tensor"),
    Column("status", "status"),
    Column("dtype_a", "dtype A"),
    Column("dtype_b", "dtype B"),
    Column("norm_a", "norm A", numeric=True),
    Column("norm_b", "norm B", numeric=True),
    Column("diff_norm", "‖A−B‖", numeric=True),
    Column("rel_change", "‖A−B‖/‖A‖", numeric=True),
    Column("max_abs_diff", "max|A−B|", numeric=True),
    Column("cosine", "cosine", numeric=True),
    Column("norm_ratio", "‖B‖/‖A‖", numeric=True),
)
DIFF_DROP_ORDER = ("dtype_a", "dtype_b", "max_abs_diff", "cosine")


def _diff_size(t: Any) -> int:
    """--sort size in diff: the elements of the larger side (diff has no byte counts)."""
    return max((math.prod(s) for s in (t.shape_a, t.shape_b) if s is not None), default=0)


def diff_report(
    result: DiffResult,
    changed_only: bool = False,
    sort: SortKey = SortKey.NAME,
    top: int | None = None,
) -> Report:
    kept = [t for t in result.tensors if not (changed_only and t.status == "same")]
    listed = ordered(
        kept,
        sort,
        top,
        lambda t: t.name,
        lambda t: t.diff_norm,  # --sort norm: the largest ‖A−B‖ first
        lambda t: t.in_global,
        _diff_size,
    )
    rows = tuple(
        (
            t.name,
            t.status,
            t.dtype_a,
            t.dtype_b,
            t.norm_a,
            t.norm_b,
            t.diff_norm,
            t.rel_change,
            t.max_abs_diff,
            t.cosine,
            t.norm_ratio,
        )
        # a `tied to` column only where a side has ties, as `norms` says it in `role`
        + ((result.tied_a.get(t.name) or result.tied_b.get(t.name),) if result.tied else ())
        for t in listed
    )
    counts = {status: n for status, n in result.counts.items() if n}
    shared = any(t.compared for t in result.counted)
    unpaired = not all(t.compared for t in result.counted)
    difference = (
        f"‖A−B‖ {result.global_diff_norm:.6g} (relative {result.global_rel_change:.6g})"
        + (" over the tensors both hold" if unpaired else "")
        if shared
        else "A and B share no tensor to compare"
    )
    footer = [
        f"global norm A {result.global_norm_a:.6g}, B {result.global_norm_b:.6g}, {difference}",
        ", ".join(f"{n} {status}" for status, n in counts.items()) or "no tensor",
    ]
    if result.n_parts:  # a quantized weight's scales: compared through their weight
        footer.append(
            f"{count(result.n_parts, 'quantization part')} (scales, zero points) listed "
            "apart: compared through their weights, not in the counts or global figures"
        )
    if result.tied:  # as in `norms`: a tensor sharing one storage with another counts once
        footer.append(
            f"{count(len(result.tied), 'tied tensor')} (one storage with an earlier one) "
            "counted once in the global figures"
        )
    if result.training_state:  # as in `norms`: the global figures are of model weights
        footer.append(
            f"{count(result.training_state, 'training-state tensor')} compared, not in the "
            "global figures (--all-tensors counts them)"
        )
    footer += showing_line(len(rows), len(kept), "tensor", top)
    summary: tuple[tuple[str, Any], ...] = (
        ("path_a", str(result.path_a)),
        ("path_b", str(result.path_b)),
        ("format_a", result.format_a),
        ("format_b", result.format_b),
        ("global_norm_a", result.global_norm_a),
        ("global_norm_b", result.global_norm_b),
        ("global_diff_norm", result.global_diff_norm),
        ("global_rel_change", result.global_rel_change),
        ("training_state", result.training_state),
        ("parts", result.n_parts),
        ("tied_a", dict(result.tied_a)),
        ("tied_b", dict(result.tied_b)),
        ("max_rel_change", result.max_rel_change),
        ("identical", result.identical),
        ("counts", dict(result.counts)),
        (
            "metadata_changes",
            [{"key": k, "a": a, "b": b} for k, a, b in result.metadata_changes],
        ),
    )
    return Report(
        f"diff {result.path_a} ({result.format_a}) -> {result.path_b} ({result.format_b})",
        DIFF_COLUMNS + ((Column("tied_to", "tied to"),) if result.tied else ()),
        rows,
        summary,
        tuple(footer),
        drop_order=("tied_to", *DIFF_DROP_ORDER),
        drop_late=("norm_b", "norm_ratio", "diff_norm", "norm_a"),
        kept=("rel_change", "diff_norm") if sort is SortKey.NORM else ("rel_change",),
        metadata_changes=tuple(result.metadata_changes),
        empty="no tensor changed" if changed_only else "",
    )
