"""Issue 22 item 4: a tie is counted once among what is counted.

Two names of one storage view (tied weights) count once in the global norm. When the first
of the pair does not count (training state, or left out by the selection), the second
counts: a model weight tied to an optimizer tensor before it, or the lm_head.weight that
`--include 'lm_head*'` selects, once counted zero times ("global L2 norm 0 over 0", and
`--fail-above` passed). The clip that would untie such a pair is refused in one line.
Files are hand-made torch zips (zipfile and a pickle of torch's globals); the reference
norm is exact: sixteen 10s have norm 40.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import MainRun
from expect import one_error_line
from test_pytorch_hostile import state, tensor, torch_zip

NORM = 40.0  # sqrt(16 * 10**2)


def _tied(path: Path, first: str, second: str) -> Path:
    pickled = state(**{first: tensor(numel=16, size=(16,)), second: tensor(numel=16, size=(16,))})
    return torch_zip(path, pickled, {"0": np.full(16, 10, "<f4").tobytes()})


def _norms(clipcli: Callable[..., MainRun], path: Path, *args: str) -> dict[str, object]:
    run = clipcli("norms", "--format", "json", path, *args)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def _counted(report: dict[str, object]) -> list[str]:
    rows = report["tensors"]
    assert isinstance(rows, list)
    return [row["name"] for row in rows if row["in_global"]]


@pytest.mark.parametrize(
    ("first", "second", "args", "counted"),
    [
        # training state first: the weight counts
        ("optimizer.state.0.exp_avg", "model.w", (), ["model.w"]),
        # the selection leaves out the first: the second counts
        ("model.embed.weight", "lm_head.weight", ("--include", "lm_head*"), ["lm_head.weight"]),
        ("model.embed.weight", "lm_head.weight", ("--exclude", "model.*"), ["lm_head.weight"]),
        # both count: once, as the first
        ("model.embed.weight", "lm_head.weight", (), ["model.embed.weight"]),
        ("optimizer.state.0.exp_avg", "model.w", ("--all-tensors",), ["optimizer.state.0.exp_avg"]),
        # the selection leaves out the second: the first counts
        ("model.embed.weight", "lm_head.weight", ("--include", "model.*"), ["model.embed.weight"]),
    ],
)
def test_a_tie_counts_once_among_what_is_counted(
    clipcli: Callable[..., MainRun],
    tmp_path: Path,
    first: str,
    second: str,
    args: tuple[str, ...],
    counted: list[str],
) -> None:
    path = _tied(tmp_path / "tied.pt", first, second)
    report = _norms(clipcli, path, *args)
    assert _counted(report) == counted
    assert report["global_norm"] == NORM


@pytest.mark.parametrize(("limit", "code"), [("40", 0), ("39.99", 1), ("5", 1)])
@pytest.mark.parametrize(
    ("first", "second", "args"),
    [
        ("optimizer.state.0.exp_avg", "model.w", ()),
        ("model.embed.weight", "lm_head.weight", ("--include", "lm_head*")),
    ],
)
def test_fail_above_sees_the_tied_weight(
    clipcli: Callable[..., MainRun],
    tmp_path: Path,
    first: str,
    second: str,
    args: tuple[str, ...],
    limit: str,
    code: int,
) -> None:
    path = _tied(tmp_path / "tied.pt", first, second)
    run = clipcli("norms", "-q", "--fail-above", limit, path, *args)
    assert run.returncode == code, run.stderr


def test_the_role_of_the_counted_weight_is_its_own(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    path = _tied(tmp_path / "tied.pt", "optimizer.state.0.exp_avg", "model.w")
    run = clipcli("norms", "--format", "csv", path)
    rows = {line.split(",")[0]: line.split(",")[-1] for line in run.stdout.splitlines()[1:]}
    assert rows == {"optimizer.state.0.exp_avg": "optimizer", "model.w": "weight"}


@pytest.mark.parametrize(
    ("first", "second", "args"),
    [
        ("optimizer.state.0.exp_avg", "model.w", ()),
        ("model.embed.weight", "lm_head.weight", ("--include", "lm_head*")),
    ],
)
def test_a_clip_that_would_untie_the_pair_is_refused_in_one_line(
    clipcli: Callable[..., MainRun],
    tmp_path: Path,
    first: str,
    second: str,
    args: tuple[str, ...],
) -> None:
    path = _tied(tmp_path / "tied.pt", first, second)
    out = tmp_path / "out.pt"
    run = clipcli("clip", "--global", "1", path, out, *args)
    assert run.returncode == 2
    assert "tied to" in one_error_line(run.stderr)
    assert not out.exists()
