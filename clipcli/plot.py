"""`norms --plot`: a per-group (or per-tensor) norm profile as PNG or SVG, via matplotlib.

matplotlib is an optional extra (`pip install -e '.[plot]'` in the checkout), imported only here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

from clipcli.errors import UsageError, printable

PLOT_SUFFIXES = (".png", ".svg")


def plot_profile(
    out: Path, title: str, labels: Sequence[str], norms: Sequence[float], limit: float | None
) -> None:
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {out}: use a .png or .svg file name")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed; "
            "install it from the clipcli checkout with: pip install -e '.[plot]'"
        ) from None
    # Names are data: escaped for the terminal, and '$' escaped so that matplotlib does not
    # read "$...$" as mathtext (a name like '$\\frac{a}{$' made savefig raise).
    labels = [_plain_text(label) for label in labels]
    title = _plain_text(title)
    positions = range(len(labels))
    values = [n if math.isfinite(n) else math.nan for n in norms]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(labels) + 2), 4.5), layout="constrained")
    colors = ["#c0392b" if limit is not None and v > limit else "#2e86c1" for v in values]
    ax.bar(positions, values, color=colors)
    ax.plot(positions, values, color="#1b2631", linewidth=1, marker="o", markersize=3)
    if limit is not None:
        ax.axhline(limit, color="#d4ac0d", linestyle="--", label=f"limit {limit:g}")
        ax.legend(loc="best")
    if (
        any(v > 0 for v in values)
        and max(values) / max(min(v for v in values if v > 0), 1e-300) > 1e3
    ):
        ax.set_yscale("log")
    ax.set_xticks(list(positions), [str(label) for label in labels], rotation=90, fontsize=7)
    ax.set_ylabel("L2 norm")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    try:
        with warnings.catch_warnings():
            # A name in a script the font lacks draws as boxes; that is not worth a warning
            # on stderr, which holds errors only.
            warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)
            fig.savefig(out, format=out.suffix.lower().lstrip("."))
    except OSError as exc:
        raise UsageError(f"--plot {out}: cannot write: {exc.strerror}") from None
    finally:
        plt.close(fig)


def _plain_text(text: str) -> str:
    return printable(text).replace("$", r"\$")
