"""`norms --plot` layout: sizes, colours, the layer pattern, and the labels and scales
every picture shares (names made safe for matplotlib, shortened together, log or linear)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from clipcli.errors import printable
from clipcli.report.table import middle_ellipses, middle_ellipsis

PLOT_SUFFIXES = (".png", ".svg")
BARS_MAX = 40
LABEL_CHARS = 56
NAMED_IN_RANKING = 15
ROLES_MAX = 20  # lines in a profile (10 colours, solid then dashed); the rest grey
LAYERED = re.compile(
    r"^(?P<prefix>.*?\b(?:layers|layer|blocks|block|h)[._/])(?P<n>\d+)[._/](?P<role>.+)$"
)
OVER, WITHIN, APART, LIMIT = "#c0392b", "#2e86c1", "#aab7b8", "#d4ac0d"


def _plain(text: str) -> str:
    # Names are data: escaped for the terminal, and '$' escaped so that matplotlib does not
    # read "$...$" as mathtext (a name like '$\\frac{a}{$' made savefig raise).
    return printable(text).replace("$", r"\$")


def _label(text: str) -> str:
    return _plain(middle_ellipsis(printable(text), LABEL_CHARS))


def _labels(texts: Sequence[str]) -> list[str]:
    """Labels shortened together, so that they stay as distinct as the names."""
    return [_plain(t) for t in middle_ellipses([printable(t) for t in texts], LABEL_CHARS)]


def _log_scale(values: Sequence[float], ratio: float = 1e3) -> bool:
    positive = [v for v in values if math.isfinite(v) and v > 0]
    return bool(positive) and max(positive) / min(positive) > ratio


def _floored(values: Sequence[float], log: bool) -> tuple[list[float], float, list[int]]:
    """A line's y values on a log axis: a zero norm at the floor (a tenth of the smallest
    positive value), so that the line does not stop; also the floor and the zeros' indices."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not log or not positive:
        return list(values), 0.0, []
    floor = min(positive) / 10
    zeros = [i for i, v in enumerate(values) if v == 0]
    return [floor if v == 0 else v for v in values], floor, zeros


def _finite(values: Any) -> list[float]:
    return [v for v in values if math.isfinite(v)]


class Drawn(float):
    """A norm beyond what the axes can draw (plot.DRAWABLE): drawn as this float, at the
    edge, but printed and ranked as `true`, the norm itself (a label, the largest named)."""

    true: float

    def __new__(cls, drawn: float, true: float) -> Drawn:
        made = super().__new__(cls, drawn)
        made.true = true
        return made

    def __format__(self, spec: str) -> str:
        return format(self.true, spec)

    def __repr__(self) -> str:
        return repr(self.true)

    __str__ = __repr__


def true_norm(value: float) -> float:
    """The norm itself, also for one drawn at the edge (Drawn)."""
    return value.true if isinstance(value, Drawn) else value


def _rank(norm: float) -> float:
    norm = true_norm(norm)
    return -norm if not math.isnan(norm) else -math.inf
