"""`norms --plot`: the listed norms as a PNG or SVG picture, via matplotlib.

matplotlib is an optional extra (`pip install -e '.[plot]'` in the checkout), imported only
here. Three pictures, chosen by what is listed, so that every name that is shown can be read:

- up to BARS_MAX rows: horizontal bars, one per row, names on the left in full or
  shortened in the middle;
- more rows whose names follow a layer layout (`model.layers.3.mlp.up_proj.weight`): a
  per-layer profile, one line per tensor role (`mlp.up_proj.weight`) across the layers, and
  the tensors outside the layers (embeddings, final norm, head) as bars beside it;
- more rows without layers: the norms ranked, largest first, the largest ones named.

A zero norm has no place on a log axis: it is drawn at the axis floor, marked "0".
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipcli.errors import UsageError, WriteError, printable
from clipcli.report.table import middle_ellipsis

if TYPE_CHECKING:
    from clipcli.report.builders import Bars

PLOT_SUFFIXES = (".png", ".svg")
BARS_MAX = 60
LABEL_CHARS = 56
NAMED_IN_RANKING = 15
ROLES_MAX = 12  # lines in a profile; the other roles are drawn grey, unnamed
LAYERED = re.compile(
    r"^(?P<prefix>.*?\b(?:layers|layer|blocks|block|h)[._/])(?P<n>\d+)[._/](?P<role>.+)$"
)
OVER, WITHIN, APART, LIMIT = "#c0392b", "#2e86c1", "#aab7b8", "#d4ac0d"


def check_plot_target(out: Path, force: bool) -> None:
    """Everything about --plot FILE that can be refused before any data is read (exit 2)."""
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {out}: use a .png or .svg file name")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "--plot needs matplotlib, which is not installed; "
            "install it from the clipcli checkout with: pip install -e '.[plot]'"
        )
    if os.path.lexists(out) and not force:
        raise UsageError(f"--plot {out} exists; add --force to replace it")
    if os.path.isdir(out):
        raise UsageError(f"--plot {out} is a directory")
    if not out.parent.is_dir() if str(out.parent) else False:
        raise WriteError(f"--plot {out}: the directory {out.parent} does not exist")


def write_plot(out: Path, bars: Bars, limit: float | None, force: bool, grouped: bool) -> None:
    """Draw, write to a temp file beside `out`, then move it into place: `out` appears
    whole or not at all, and without --force a file that appeared meanwhile is kept."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = _figure(plt, bars, limit, grouped)
    fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent or ".")
    try:
        with os.fdopen(fd, "wb") as stream, warnings.catch_warnings():
            # A name in a script the font lacks draws as boxes; that is not worth a warning
            # on stderr, which holds errors only.
            warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)
            fig.savefig(stream, format=out.suffix.lower().lstrip("."), dpi=100)
        if force:
            os.replace(temp, out)
        else:
            from clipcli.output import rename_noreplace

            rename_noreplace(Path(temp), out, is_directory=False)
    except FileExistsError:
        raise UsageError(
            f"--plot {out} appeared during the run; add --force to replace it"
        ) from None
    except OSError as exc:
        raise WriteError(f"--plot {out}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
        if os.path.lexists(temp):
            os.unlink(temp)


def _plain(text: str) -> str:
    # Names are data: escaped for the terminal, and '$' escaped so that matplotlib does not
    # read "$...$" as mathtext (a name like '$\\frac{a}{$' made savefig raise).
    return printable(text).replace("$", r"\$")


def _label(text: str) -> str:
    return _plain(middle_ellipsis(printable(text), LABEL_CHARS))


def _log_scale(values: Sequence[float]) -> bool:
    positive = [v for v in values if math.isfinite(v) and v > 0]
    return bool(positive) and max(positive) / min(positive) > 1e3


def _figure(plt: Any, bars: Bars, limit: float | None, grouped: bool) -> Any:
    if len(bars.labels) <= BARS_MAX:
        return _bar_figure(plt, bars, limit)
    layered = [LAYERED.match(label) for label in bars.labels]
    if not grouped and sum(m is not None for m in layered) >= len(bars.labels) // 2:
        return _profile_figure(plt, bars, limit, layered)
    return _ranked_figure(plt, bars, limit)


def _bar_figure(plt: Any, bars: Bars, limit: float | None) -> Any:
    n = len(bars.labels)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.24 * n), layout="constrained")
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
    values = [n if math.isfinite(n) else math.nan for n in norms]
    positions = list(range(len(labels)))
    log = _log_scale(values + ([limit] if limit is not None else []))
    positive = [v for v in values if v > 0]
    floor = min(positive) / 10 if log and positive else 0.0
    colours = [
        APART if not c else OVER if limit is not None and not v <= limit else WITHIN
        for v, c in zip(values, counted, strict=True)
    ]
    widths = [v - floor if v > 0 else 0.0 for v in values]
    ax.barh(positions, widths, left=floor, color=colours, height=0.7)
    for y, v in zip(positions, values, strict=True):
        if v == 0:
            ax.annotate(
                "0",
                (floor, y),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color="#566573",
            )
        elif math.isnan(v):
            ax.annotate(
                "NaN/Inf",
                (floor, y),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color=OVER,
            )
    if log:
        ax.set_xscale("log")
        ax.set_xlim(left=floor)
    ax.set_yticks(positions, [_label(label) for label in labels], fontsize=8)
    ax.invert_yaxis()  # the first row on top, as in the table
    ax.set_xlabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(axis="x", alpha=0.3)
    _limit_line(ax, limit, vertical=True)


def _limit_line(ax: Any, limit: float | None, vertical: bool) -> None:
    if limit is None:
        return
    line = ax.axvline if vertical else ax.axhline
    line(limit, color=LIMIT, linestyle="--", linewidth=1.2, label=f"limit {limit:g}")
    ax.legend(loc="lower right", fontsize=8)


def _profile_figure(plt: Any, bars: Bars, limit: float | None, layered: Sequence[Any]) -> Any:
    series: dict[str, dict[int, float]] = {}
    apart: list[tuple[str, float, bool]] = []
    for label, norm, counted, match in zip(
        bars.labels, bars.norms, bars.counted, layered, strict=True
    ):
        if match is None or not counted:
            apart.append((label, norm, counted))
            continue
        series.setdefault(match["role"], {})[int(match["n"])] = norm
    roles = sorted(
        series, key=lambda r: -max(v for v in series[r].values() if math.isfinite(v) or True)
    )
    named = roles[:ROLES_MAX]
    height = max(5.0, 1.5 + 0.24 * len(apart))
    fig, (ax, side) = plt.subplots(
        1,
        2,
        figsize=(14, min(height, 12.0)),
        layout="constrained",
        gridspec_kw={"width_ratios": [3, 1.3]},
    )
    every = [v for s in series.values() for v in s.values()]
    log = _log_scale(every + ([limit] if limit is not None else []))
    colours = plt.get_cmap("tab20").colors
    for i, role in enumerate(reversed(roles)):  # the strongest drawn last, on top
        points = sorted(series[role].items())
        xs = [x for x, _ in points]
        ys = [y if y > 0 or not log else math.nan for _, y in points]
        if role in named:
            colour = colours[named.index(role) % len(colours)]
            ax.plot(
                xs,
                ys,
                marker="o" if len(xs) <= 40 else None,
                markersize=3,
                linewidth=1.4,
                color=colour,
                label=_label(role),
            )
        else:
            ax.plot(xs, ys, linewidth=0.8, color=APART)
        del i
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(alpha=0.3)
    _limit_line(ax, limit, vertical=False)
    title = _plain(bars.title)
    ax.set_title(f"{title}: per layer, one line per tensor role", fontsize=10, loc="left")
    legend_title = (
        None if len(roles) <= ROLES_MAX else f"{ROLES_MAX} strongest of {len(roles)} roles"
    )
    ax.legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0) if False else None,
        title=legend_title,
        title_fontsize=7,
        ncols=2 if len(named) > 6 else 1,
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


def _ranked_figure(plt: Any, bars: Bars, limit: float | None) -> Any:
    order = sorted(
        range(len(bars.norms)),
        key=lambda i: -bars.norms[i] if not math.isnan(bars.norms[i]) else math.inf,
    )
    fig, (ax, side) = plt.subplots(
        1, 2, figsize=(14, 6), layout="constrained", gridspec_kw={"width_ratios": [2, 1.3]}
    )
    values = [bars.norms[i] for i in order]
    log = _log_scale(values + ([limit] if limit is not None else []))
    ax.plot(
        range(1, len(values) + 1),
        [v if v > 0 or not log else math.nan for v in values],
        color=WITHIN,
        linewidth=1.4,
    )
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("rank (largest norm first)")
    ax.set_ylabel("L2 norm" + (" (log scale)" if log else ""))
    ax.grid(alpha=0.3)
    _limit_line(ax, limit, vertical=False)
    ax.set_title(f"{_plain(bars.title)}: {len(values)} rows ranked", fontsize=10, loc="left")
    top = order[:NAMED_IN_RANKING]
    _horizontal_bars(
        side,
        [bars.labels[i] for i in top],
        [bars.norms[i] for i in top],
        [bars.counted[i] for i in top],
        limit,
    )
    side.set_title(f"the {len(top)} largest", fontsize=9, loc="left")
    return fig
