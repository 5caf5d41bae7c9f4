"""`norms --plot` pictures: horizontal bars, a per-layer profile (one line per tensor
role), a profile of groups, and the norms ranked; each returns a matplotlib figure.

A zero norm has no place on a log axis: it is drawn at the axis floor, marked "0", in bars
and lines alike. Legends sit under the axes, never on what they explain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clipcli.report.plot_layout import (
    APART,
    BARS_MAX,
    LIMIT,
    NAMED_IN_RANKING,
    OVER,
    ROLES_MAX,
    WITHIN,
    _finite,
    _floored,
    _label,
    _labels,
    _log_scale,
    _plain,
    _rank,
    true_norm,
)
from clipcli.words import count

if TYPE_CHECKING:
    from clipcli.report.builders import Bars


def _bar_figure(plt: Any, bars: Bars, limit: float | None) -> Any:
    n = len(bars.labels)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.24 * n), layout="constrained")
    _horizontal_bars(ax, bars.labels, bars.norms, bars.counted, limit)
    ax.set_title(_plain(bars.title), fontsize=10, loc="left")
    return fig


def _horizontal_bars(
    ax: Any,
    labels: Sequence[str],
    norms: Sequence[float],
    counted: Sequence[bool],
    limit: float | None,
) -> None:
    """One bar per row, first row on top, its norm written at its end. The axis is scaled
    to the rows the global norm counts: a bar outside it that is longer is cut at the edge
    (its number still says how long it is)."""
    values = [n if math.isfinite(n) else math.nan for n in norms]
    scale = [v for v, c in zip(values, counted, strict=True) if c and v > 0] or [
        v for v in values if v > 0
    ]
    marks = scale + ([limit] if limit is not None else [])
    log = _log_scale(marks)
    floor = min(scale) / 10 if log and scale else 0.0
    top = max(marks, default=1.0) * (3.0 if log else 1.12)
    positions = list(range(len(labels)))
    colours = [
        APART if not c else OVER if limit is not None and not v <= limit else WITHIN
        for v, c in zip(values, counted, strict=True)
    ]
    shown = [min(v, top) if v > 0 else 0.0 for v in values]
    ax.barh(
        positions,
        [v - floor if v > 0 else 0.0 for v in shown],
        left=floor,
        color=colours,
        height=0.7,
    )
    for y, v, end in zip(positions, values, shown, strict=True):
        text = "NaN/Inf" if math.isnan(v) else f"{v:.4g}"
        cut = v > top
        ax.annotate(
            text + (" ▸" if cut else ""),
            (end if v > 0 else floor, y),
            xytext=(-3 if cut else 3, 0),
            textcoords="offset points",
            ha="right" if cut else "left",
            va="center",
            fontsize=7,
            color=OVER if math.isnan(v) else "#1b2631",
        )
    if log:
        ax.set_xscale("log")
    ax.set_xlim(floor, top)
    ax.set_yticks(positions, _labels(labels), fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first row on top, as in the table
    ax.set_xlabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, limit, any(not c for c in counted), vertical=True)


def _legend(ax: Any, limit: float | None, apart: bool, vertical: bool) -> None:
    from matplotlib.patches import Patch

    handles = []
    if limit is not None:
        line = ax.axvline if vertical else ax.axhline
        handles.append(
            line(limit, color=LIMIT, linestyle="--", linewidth=1.2, label=f"limit {limit:g}")
        )
        handles.append(Patch(color=OVER, label="over the limit"))
    if apart:
        handles.append(Patch(color=APART, label="not in the global norm"))
    if handles:
        _legend_below(ax, handles)


def _legend_below(ax: Any, handles: Sequence[Any] | None = None, above: bool = False) -> None:
    """The legend under the axes (or above them, right, where slanted tick labels fill the
    space below), never on the bars or lines it explains."""
    kwargs: dict[str, Any] = {} if handles is None else {"handles": list(handles)}
    count_ = len(handles) if handles is not None else len(ax.get_legend_handles_labels()[0])
    ax.legend(
        **kwargs,
        fontsize=8,
        loc="lower right" if above else "upper center",
        bbox_to_anchor=(1.0, 1.0) if above else (0.5, -0.14),
        ncols=max(1, min(3, count_)),
        frameon=False,
    )


def _mark_zeros(ax: Any, xs: Sequence[float], floor: float, zeros: Sequence[int]) -> None:
    """Zero norms drawn at the floor are marked `0`, as in the bar view."""
    if not zeros:
        return
    ax.scatter([xs[i] for i in zeros], [floor] * len(zeros), color="#1b2631", s=10, zorder=4)
    for i in zeros[:20]:
        ax.annotate(
            "0",
            (xs[i], floor),
            xytext=(5, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )


def _profile_figure(plt: Any, bars: Bars, limit: float | None, layered: Sequence[Any]) -> Any:
    """Layers across, one line per tensor role; what is outside the layers beside it."""
    series: dict[str, dict[int, float]] = {}
    apart: list[tuple[str, float, bool]] = []
    summarised, left_out = _summarised(bars)
    for i in summarised:
        label, norm, counted, match = bars.labels[i], bars.norms[i], bars.counted[i], layered[i]
        if match is None or not counted:
            apart.append((label, norm, counted))
            continue
        series.setdefault(match["role"], {})[int(match["n"])] = norm
    roles = sorted(series, key=lambda r: -max(_finite(series[r].values()), default=0.0))
    named = roles[:ROLES_MAX]
    fig, (ax, side) = plt.subplots(
        1, 2, figsize=(15, 7), layout="constrained", gridspec_kw={"width_ratios": [3, 1.2]}
    )
    every = [v for s in series.values() for v in s.values()]
    log = _log_scale(every + ([limit] if limit is not None else []), ratio=100)
    colours = plt.get_cmap("tab10").colors
    lines: dict[str, Any] = {}
    floor = min([v for v in every if math.isfinite(v) and v > 0], default=1.0) / 10
    zero_points: list[int] = []
    for role in reversed(roles):  # the strongest drawn last, on top
        points = sorted(series[role].items())
        xs = [x for x, _ in points]
        ys = [floor if y == 0 and log else y for _, y in points]
        zero_points += [x for x, y in points if y == 0 and log]
        if role in named:
            k = named.index(role)
            (lines[role],) = ax.plot(
                xs,
                ys,
                marker="o" if len(xs) <= 40 else None,
                markersize=3,
                linewidth=1.4,
                color=colours[k % 10],
                linestyle="-" if k < 10 else "--",
                label=_label(role),
            )
        else:
            ax.plot(xs, ys, linewidth=0.8, color=APART)
    peaks = [(y, x, r) for r in roles for x, y in series[r].items() if math.isfinite(y)]
    if peaks:  # name the largest point: the outlier is what one looks for
        norm, layer, role = max(peaks, key=lambda p: (true_norm(p[0]), p[1], p[2]))
        right_half = layer > (min(x for _, x, _ in peaks) + max(x for _, x, _ in peaks)) / 2
        ax.annotate(
            f"layer {layer} {_label(role)}: {norm:.4g}",
            (layer, norm),
            xytext=(-8 if right_half else 8, -4),
            textcoords="offset points",
            ha="right" if right_half else "left",
            fontsize=8,
        )
    handles = [lines[role] for role in named]  # the legend lists the strongest first
    if limit is not None:
        over = [(x, y) for r in roles for x, y in series[r].items() if not y <= limit]
        handles.append(
            ax.scatter(
                [x for x, _ in over],
                [y for _, y in over],
                color=OVER,
                s=14,
                zorder=3,
                label="over the limit",
            )
        )
    _mark_zeros(ax, zero_points, floor, list(range(len(zero_points))))
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(alpha=0.3)
    if limit is not None:
        handles.append(
            ax.axhline(limit, color=LIMIT, linestyle="--", linewidth=1.2, label=f"limit {limit:g}")
        )
    extra = len(roles) - len(named)
    ax.set_title(
        f"{_plain(bars.title)}: per layer, one line per tensor role"
        + (f" ({extra} weaker roles in grey)" if extra > 0 else "")
        + left_out,
        fontsize=10,
        loc="left",
    )
    ax.legend(
        handles=handles,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncols=min(4, max(1, len(named))),
        frameon=False,
    )
    if apart:
        shown = apart[:BARS_MAX]
        _horizontal_bars(
            side, [a[0] for a in shown], [a[1] for a in shown], [a[2] for a in shown], limit
        )
        side.set_title("outside the layers", fontsize=9, loc="left")
    else:
        side.axis("off")
    return fig


def _group_profile_figure(plt: Any, bars: Bars, limit: float | None) -> Any:
    """Groups across in the order listed (natural order: layer 2 before layer 10)."""
    from clipcli.jobs.groups import OTHER_GROUP

    # `(other)` (the tensors no group matched) is no point of the line: drawn apart after it.
    line = [i for i, label in enumerate(bars.labels) if label != OTHER_GROUP]
    other = [i for i, label in enumerate(bars.labels) if label == OTHER_GROUP]
    n = len(line)
    fig, (ax, side) = plt.subplots(
        1, 2, figsize=(15, 6), layout="constrained", gridspec_kw={"width_ratios": [3, 1.2]}
    )
    every = list(bars.norms)
    log = _log_scale(every + ([limit] if limit is not None else []), ratio=100)
    ys, floor, zeros = _floored(every, log)
    values = [every[i] for i in line]
    xs = list(range(n))
    ax.plot(
        xs,
        [ys[i] for i in line],
        color=WITHIN,
        linewidth=1.4,
        marker="o" if n <= 120 else None,
        markersize=3,
    )
    _mark_zeros(ax, xs, floor, [line.index(i) for i in zeros if i in line])
    for i in other:
        x = n + 1  # a gap after the last group
        over_limit = limit is not None and not every[i] <= limit
        colour = OVER if over_limit else APART
        ax.scatter([x], [ys[i]], marker="D", s=28, color=colour, edgecolors="#1b2631", zorder=3)
        ax.annotate(
            f"{OTHER_GROUP} {every[i]:.4g}" if every[i] != 0 else f"{OTHER_GROUP} 0",
            (x, ys[i]),
            xytext=(0, 7),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )
        ax.axvline(n, color=APART, linewidth=0.8, linestyle=":")
    if limit is not None:
        over = [(x, v) for x, v in zip(xs, values, strict=True) if not v <= limit]
        ax.scatter(
            [x for x, _ in over],
            [v for _, v in over],
            color=OVER,
            s=14,
            zorder=3,
            label="over the limit",
        )
        ax.axhline(limit, color=LIMIT, linestyle="--", linewidth=1.2, label=f"limit {limit:g}")
        _legend_below(ax, above=True)
    step = max(1, math.ceil(n / 25))
    ax.set_xticks(
        xs[::step],
        _labels([bars.labels[line[i]] for i in xs[::step]]),
        rotation=45,
        ha="right",
        fontsize=7,
    )
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(alpha=0.3)
    ax.set_title(
        f"{_plain(bars.title)}: {count(len(bars.labels), 'group')}", fontsize=10, loc="left"
    )
    _largest(side, bars, limit)
    return fig


def _summarised(bars: Bars) -> tuple[list[int], str]:
    """The rows a summary (a profile, a ranking, the largest) draws: those the global norm
    counts, so that an optimizer's step counter or BatchNorm statistics do not crowd out
    the weights (every row, if none counts); and the words that say what was left out."""
    counted = [i for i, c in enumerate(bars.counted) if c]
    if not counted or len(counted) == len(bars.counted):
        return list(range(len(bars.labels))), ""
    return (
        counted,
        f" ({count(len(bars.counted) - len(counted), 'row')} not in the global norm left out)",
    )


def _largest(side: Any, bars: Bars, limit: float | None) -> None:
    order = sorted(_summarised(bars)[0], key=lambda i: _rank(bars.norms[i]))
    top = order[:NAMED_IN_RANKING]
    _horizontal_bars(
        side,
        [bars.labels[i] for i in top],
        [bars.norms[i] for i in top],
        [bars.counted[i] for i in top],
        limit,
    )
    side.set_title(f"the {len(top)} largest", fontsize=9, loc="left")


def _ranked_figure(plt: Any, bars: Bars, limit: float | None) -> Any:
    """Many rows without layers: the norms ranked, and the largest named."""
    fig, (ax, side) = plt.subplots(
        1, 2, figsize=(15, 6), layout="constrained", gridspec_kw={"width_ratios": [2, 1.3]}
    )
    rows, left_out = _summarised(bars)
    values = sorted((bars.norms[i] for i in rows), key=_rank)
    log = _log_scale(values + ([limit] if limit is not None else []), ratio=100)
    ys, floor, zeros = _floored(values, log)
    xs = list(range(1, len(values) + 1))
    ax.plot(xs, ys, color=WITHIN, linewidth=1.4)
    _mark_zeros(ax, xs, floor, zeros)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("rank (largest norm first)")
    ax.set_ylabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(alpha=0.3)
    if limit is not None:
        ax.axhline(limit, color=LIMIT, linestyle="--", linewidth=1.2, label=f"limit {limit:g}")
        _legend_below(ax)
    ax.set_title(
        f"{_plain(bars.title)}: {count(len(values), 'row')} ranked{left_out}",
        fontsize=10,
        loc="left",
    )
    _largest(side, bars, limit)
    return fig
