"""Issue 22: `diff` counts a tie (two names of one storage) once in its global figures, as
`norms` does, and says so (JSON `tied_a`/`tied_b`, a footer line in the table).

Files are hand-made torch zips (test_pytorch_hostile's opcode writer); the references are
exact: the storage [1, 2, 3, 4] has norm sqrt(30), [1, 2, 3, 5] sqrt(39), their difference
[0, 0, 0, 1] norm 1. Counted twice, the figures were sqrt(60), sqrt(78) and sqrt(2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MainRun
from test_pytorch_hostile import state, tensor, torch_zip

A_VALUES = [1.0, 2.0, 3.0, 4.0]
B_VALUES = [1.0, 2.0, 3.0, 5.0]


def _tied(path: Path, values: list[float], *names: str) -> Path:
    """Every name a view of one storage of four float32 (tied weights)."""
    pickled = state(**{name: tensor() for name in names})
    return torch_zip(path, pickled, {"0": np.array(values, "<f4").tobytes()})


def _json(clipcli: Callable[..., MainRun], *args: str | Path) -> dict[str, Any]:
    run = clipcli(*args, "--format", "json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def test_a_tie_counts_once_in_every_global_figure(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    a = _tied(tmp_path / "a.pt", A_VALUES, "embed.weight", "lm_head.weight")
    b = _tied(tmp_path / "b.pt", B_VALUES, "embed.weight", "lm_head.weight")
    report = _json(clipcli, "diff", a, b)
    assert report["global_norm_a"] == pytest.approx(math.sqrt(30), rel=1e-15)
    assert report["global_norm_b"] == pytest.approx(math.sqrt(39), rel=1e-15)
    assert report["global_diff_norm"] == pytest.approx(1.0, rel=1e-15)
    assert report["global_rel_change"] == pytest.approx(1 / math.sqrt(30), rel=1e-15)
    assert report["tied_a"] == {"lm_head.weight": "embed.weight"}
    assert report["tied_b"] == {"lm_head.weight": "embed.weight"}
    # the same figures `norms` gives each file
    assert report["global_norm_a"] == _json(clipcli, "norms", a)["global_norm"]
    assert report["global_norm_b"] == _json(clipcli, "norms", b)["global_norm"]
    # every row is still listed and compared
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows["lm_head.weight"]["diff_norm"] == pytest.approx(1.0)
    assert rows["embed.weight"]["status"] == rows["lm_head.weight"]["status"] == "changed"
    # each row says what it is tied to, as `norms` does in its role column
    assert rows["lm_head.weight"]["tied_to"] == "embed.weight"
    assert rows["embed.weight"]["tied_to"] is None


def test_without_ties_there_is_no_tied_to_column(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    a = _tied(tmp_path / "a.pt", A_VALUES, "embed.weight")
    b = _tied(tmp_path / "b.pt", B_VALUES, "embed.weight")
    report = _json(clipcli, "diff", a, b)
    assert "tied_to" not in report["tensors"][0]
    assert report["tied_a"] == report["tied_b"] == {}
    assert "tied" not in clipcli("diff", a, b).stdout


def test_three_names_of_one_storage_count_once(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    names = ("a.w", "b.w", "c.w")
    a = _tied(tmp_path / "a.pt", A_VALUES, *names)
    b = _tied(tmp_path / "b.pt", B_VALUES, *names)
    report = _json(clipcli, "diff", a, b)
    assert report["global_norm_a"] == pytest.approx(math.sqrt(30), rel=1e-15)
    assert report["global_diff_norm"] == pytest.approx(1.0, rel=1e-15)
    assert report["tied_a"] == {"b.w": "a.w", "c.w": "a.w"}


def test_when_the_first_is_left_out_the_second_counts_once(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    """The selection drops the first of the pair: the other counts (never zero times)."""
    a = _tied(tmp_path / "a.pt", A_VALUES, "embed.weight", "lm_head.weight")
    b = _tied(tmp_path / "b.pt", B_VALUES, "embed.weight", "lm_head.weight")
    report = _json(clipcli, "diff", a, b, "--include", "lm_head*")
    assert report["global_norm_a"] == pytest.approx(math.sqrt(30), rel=1e-15)
    assert report["global_diff_norm"] == pytest.approx(1.0, rel=1e-15)
    assert report["tied_a"] == {}


def test_a_tie_on_one_side_only_counts_both_differences(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    """B holds the two as separate tensors (one of them changed): A's norm counts the tie
    once, B's norm and ‖A−B‖ count each of B's tensors."""
    from safetensors.numpy import save_file

    a = _tied(tmp_path / "a.pt", A_VALUES, "embed.weight", "lm_head.weight")
    b = tmp_path / "b.safetensors"
    save_file(
        {
            "embed.weight": np.array(A_VALUES, "<f4"),
            "lm_head.weight": np.array(B_VALUES, "<f4"),
        },
        str(b),
    )
    report = _json(clipcli, "diff", a, b)
    assert report["global_norm_a"] == pytest.approx(math.sqrt(30), rel=1e-15)
    assert report["global_norm_b"] == pytest.approx(math.sqrt(69), rel=1e-15)
    assert report["global_diff_norm"] == pytest.approx(1.0, rel=1e-15)  # 0 and 1
    assert report["tied_a"] == {"lm_head.weight": "embed.weight"}
    assert report["tied_b"] == {}


def test_the_table_says_the_tie_is_counted_once(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    a = _tied(tmp_path / "a.pt", A_VALUES, "embed.weight", "lm_head.weight")
    b = _tied(tmp_path / "b.pt", B_VALUES, "embed.weight", "lm_head.weight")
    run = clipcli("diff", a, b)
    assert run.returncode == 0, run.stderr
    assert "1 tied tensor (one storage with an earlier one) counted once" in run.stdout
    assert f"global norm A {math.sqrt(30):.6g}, B {math.sqrt(39):.6g}" in run.stdout


def test_torch_tied_weights_diff_as_torch_computes(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    embed = torch.randn(8, 4)
    paths = []
    for label, scale in (("a", 1.0), ("b", 2.0)):
        weight = embed * scale
        paths.append(tmp_path / f"{label}.pt")
        torch.save(
            {"embed.weight": weight, "lm_head.weight": weight, "bias": torch.ones(4)}, paths[-1]
        )
    report = _json(clipcli, "diff", *paths)
    expect_a = math.sqrt(embed.double().square().sum().item() + 4)
    expect_diff = embed.double().norm().item()  # (2 - 1) * embed, once
    assert report["global_norm_a"] == pytest.approx(expect_a, rel=1e-12)
    assert report["global_diff_norm"] == pytest.approx(expect_diff, rel=1e-12)
