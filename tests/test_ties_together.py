"""Ties decided together (issue 20, "Many tensors"): a tensor (or group) whose measured
norm is within rounding error of its limit is decided exactly, by its values as stored.
For a plain checkpoint the ties of a block of problems are decided in one go, the small
tensors read many at a time (execution._OutputCheck.each), instead of a read and a task
each: a clipped checkpoint of many small tensors clipped again is all ties.

Each tensor's fate is checked against exact fractions (no clipcli arithmetic): at or
under its limit it is bit-identical; over it, clipped to a norm <= the limit. And the
output and report are the same bytes as the one-tie-at-a-time route (`each` taken away).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import Run
from handmade import read_safetensors, write_safetensors
from test_many_tensors import count_preads

from clipcli.jobs import execution
from clipcli.numerics import scaling

LIMIT = 5.0
# Limits a relative hair off 5 (within the 1e-9 that makes a tie): [3, 4] has norm 5 exactly.
ABOVE, BELOW = 5.0 * (1 + 1e-12), 5.0 * (1 - 1e-12)


def tied_checkpoint(path: Path, count: int) -> dict[str, np.ndarray]:
    """Tensors whose norms are 5 exactly, a hair under or over it, or clearly off it, in
    float32 and float64, one to a few elements, 0.0 and -0.0 among them."""
    shapes: list[np.ndarray] = [
        np.array([3.0, 4.0]),  # exactly 5
        np.array([5.0]),
        np.array([-5.0]),
        np.array([0.0, -3.0, 4.0]),
        np.array([BELOW]),  # a hair under 5
        np.array([ABOVE]),  # a hair over
        np.array([3.0, np.nextafter(4.0, 5.0)]),  # over by an ulp of 4
        np.array([7.0]),  # clearly over
        np.array([1.0, 1.0]),  # clearly under
        np.zeros(2),
    ]
    tensors: dict[str, np.ndarray] = {}
    for i in range(count):
        dtype = np.float64 if i % 3 == 0 else np.float32
        tensors[f"layers.{i}.w"] = shapes[i % len(shapes)].astype(dtype)
    write_safetensors(path, tensors)
    return tensors


def exact_sumsq(array: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in array.reshape(-1)), Fraction(0))


def one_tie_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(execution._OutputCheck, "each")


@pytest.mark.parametrize("limit", [LIMIT, ABOVE, BELOW])
def test_each_tie_is_decided_exactly(
    tmp_path: Path, run_main: Callable[..., Run], limit: float
) -> None:
    src = tmp_path / "tied.safetensors"
    tensors = tied_checkpoint(src, 60)
    out = tmp_path / "out.safetensors"
    assert run_main("clip", "--norm", repr(limit), "-q", src, out).code == 0
    written = read_safetensors(out)
    bound = Fraction(limit) ** 2
    for name, array in tensors.items():
        if exact_sumsq(array) <= bound:
            assert written[name].tobytes() == array.tobytes(), name
        else:
            assert written[name].tobytes() != array.tobytes(), name
            assert exact_sumsq(written[name]) <= bound, name


@pytest.mark.parametrize(
    "mode",
    [
        ["--norm", repr(LIMIT)],
        ["--norm", repr(BELOW)],
        ["--average", repr(LIMIT / 2**0.5)],
        ["--group-by", r"(layers\.\d+)\.", "--global", repr(LIMIT)],  # a group a tensor
    ],
    ids=" ".join,
)
def test_ties_together_are_what_one_at_a_time_gives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_main: Callable[..., Run],
    mode: list[str],
) -> None:
    src = tmp_path / "tied.safetensors"
    tied_checkpoint(src, 300)
    together, apart = tmp_path / "together.safetensors", tmp_path / "apart.safetensors"
    monkeypatch.setattr(scaling, "EACH_BLOCK", 7)  # blocks' edges among the ties
    first = run_main("clip", *mode, "--format", "json", src, together)
    assert first.code == 0, first.stderr
    one_tie_at_a_time(monkeypatch)
    second = run_main("clip", *mode, "--format", "json", src, apart)
    assert second.code == 0, second.stderr
    assert together.read_bytes() == apart.read_bytes()
    reports = [json.loads(run.stdout) for run in (first, second)]
    for report in reports:
        report.pop("out")
    assert reports[0] == reports[1]


def test_ties_of_small_tensors_take_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_main: Callable[..., Run]
) -> None:
    """A clipped checkpoint clipped again: every tensor is a tie, decided from one read
    of them all (the measuring read and the writing copy aside), not one read each."""
    src = tmp_path / "tied.safetensors"
    write_safetensors(src, {f"t{i}": np.array([3.0, 4.0], np.float32) for i in range(500)})
    calls = count_preads(monkeypatch)
    out = tmp_path / "out.safetensors"
    assert run_main("clip", "--norm", "5", "-q", src, out).code == 0
    assert out.read_bytes() == src.read_bytes()
    assert len(calls) <= 4  # measured, decided, copied: was ~500 more
    assert len(calls) >= 2


def test_a_tie_a_hair_over_is_searched_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_main: Callable[..., Run]
) -> None:
    """A tie found over its limit is searched by group_factor without deciding it again."""
    src = tmp_path / "tied.safetensors"
    write_safetensors(src, {f"t{i}": np.array([ABOVE], np.float32) for i in range(3)})
    decided: list[int] = []
    real = scaling._within_exactly

    def spy(*args: object) -> bool:
        decided.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(scaling, "_within_exactly", spy)
    assert run_main("clip", "--norm", repr(LIMIT), "-q", src, tmp_path / "o.safetensors").code == 0
    assert decided == []
    written = read_safetensors(tmp_path / "o.safetensors")
    assert all(exact_sumsq(v) <= Fraction(LIMIT) ** 2 for v in written.values())
