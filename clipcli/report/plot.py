"""`norms --plot`: the listed norms as a PNG or SVG picture, via matplotlib.

matplotlib is an optional extra (clipcli.system.extras says how to add it), imported only
here. Three pictures, chosen by what is listed, so that every name that is shown can be read:

- up to BARS_MAX rows: horizontal bars, one per row, names on the left in full or
  shortened in the middle;
- more rows whose names follow a layer layout (`model.layers.3.mlp.up_proj.weight`): a
  per-layer profile, one line per tensor role (`mlp.up_proj.weight`) across the layers, and
  the tensors outside the layers (embeddings, final norm, head) as bars beside it;
- more rows without layers: the norms ranked, largest first, the largest ones named.

A zero norm has no place on a log axis: it is drawn at the axis floor, marked "0", in bars
and lines alike. Many groups are a line in the listed order, with `(other)` drawn apart after
it. Legends sit under the axes, never on what they explain.

plot_layout: sizes, colours, labels and scales; plot_figures: the pictures; here: the
check of --plot FILE, the choice of picture, and writing it.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipcli.errors import UsageError, WriteError
from clipcli.report.plot_figures import (
    _bar_figure,
    _group_profile_figure,
    _profile_figure,
    _ranked_figure,
)
from clipcli.report.plot_layout import (
    APART,
    BARS_MAX,
    LABEL_CHARS,
    LAYERED,
    LIMIT,
    NAMED_IN_RANKING,
    OVER,
    PLOT_SUFFIXES,
    ROLES_MAX,
    WITHIN,
    Drawn,
)

if TYPE_CHECKING:
    from clipcli.report.builders import Bars


__all__ = [
    "APART",
    "BARS_MAX",
    "LABEL_CHARS",
    "LAYERED",
    "LIMIT",
    "NAMED_IN_RANKING",
    "OVER",
    "PLOT_SUFFIXES",
    "ROLES_MAX",
    "WITHIN",
    "check_plot_target",
    "render_plot",
]


def check_plot_target(out: Path, force: bool) -> None:
    """Everything about --plot FILE that can be refused before any data is read (exit 2)."""
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {out}: use a .png or .svg file name")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from clipcli.system.extras import install_command

        raise UsageError(
            "--plot needs matplotlib, which is not installed; install it with: "
            + install_command("plot", "matplotlib")
        )
    if os.path.lexists(out) and not force:
        raise UsageError(f"--plot {out} exists; add --force to replace it")
    if os.path.isdir(out):
        raise UsageError(f"--plot {out} is a directory")
    if not out.parent.is_dir():  # (Path("p.png").parent is ".")
        raise WriteError(f"--plot {out}: the directory {out.parent} does not exist")


def render_plot(bars: Bars, limit: float | None, grouped: bool, suffix: str) -> bytes:
    """The picture of the listed norms as PNG or SVG bytes; the command writes it to its
    file through clipcli.output.target, the one way anything is written."""
    import io
    import logging

    # matplotlib logs, as warnings, that it made a temporary cache directory when $HOME is
    # not writable (a service account), several lines per run: stderr holds errors only.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    from clipcli.system.address_space import PLOT_BYTES, check_room

    check_room(PLOT_BYTES, "drawing the plot")  # else OpenBLAS may exit(1) mid-drawing
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    bars, limit = _drawable(bars, limit)
    # stderr holds errors only: what matplotlib warns about while drawing (a name in a
    # script the font lacks drawn as boxes, an axis it adjusted) stays out of it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = _figure(plt, bars, limit, grouped)
        try:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=suffix.lower().lstrip("."), dpi=100)
            return buffer.getvalue()
        finally:
            plt.close(fig)


# What matplotlib's log axes can draw: past about 1e250 their ticks overflow (exit 70), and
# under a subnormal norm no floor fits (a tenth of it is 0). Real norms never come near.
DRAWABLE = (1e-200, 1e200)


def _drawable(bars: Bars, limit: float | None) -> tuple[Bars, float | None]:
    """The bars (and limit) with every finite nonzero norm inside DRAWABLE: one beyond is
    drawn at its edge (a Drawn: its labels and its rank are still its own), and the title
    says so. Zero, inf and NaN are drawn as before."""
    low, high = DRAWABLE

    def inside(value: float) -> float:
        if value > 0 and math.isfinite(value) and not low <= value <= high:
            return Drawn(min(max(value, low), high), value)  # labelled and ranked as itself
        return value

    norms = tuple(inside(v) for v in bars.norms)
    inside_limit = None if limit is None else inside(limit)
    if not any(isinstance(v, Drawn) for v in (*norms, inside_limit)):
        return bars, limit
    title = f"{bars.title} (values beyond {low:g}..{high:g} drawn at its edge)"
    return bars._replace(title=title, norms=norms), inside_limit


def _figure(plt: Any, bars: Bars, limit: float | None, grouped: bool) -> Any:
    if len(bars.labels) <= BARS_MAX:
        return _bar_figure(plt, bars, limit)
    if grouped:
        return _group_profile_figure(plt, bars, limit)
    layered = [LAYERED.match(label) for label in bars.labels]
    if sum(m is not None for m in layered) >= len(bars.labels) // 2:
        return _profile_figure(plt, bars, limit, layered)
    return _ranked_figure(plt, bars, limit)
