"""A count meets its noun in the singular when it is one (`of 1 tensor`, `1 of 1 tensor`),
and `diff --changed-only` on identical files says so instead of drawing an empty table
(JSON and CSV keep their empty lists)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors

from clipcli.cli.entry import main


@pytest.fixture
def one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    return write_safetensors(tmp_path / "one.safetensors", {"w": np.full(4, 2.0, np.float32)})


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_nothing_selected_of_one_tensor(one: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "norms", str(one), "--include", "zzz")
    assert code == 2
    assert "(of 1 tensor)" in err


def test_would_change_one_of_one_tensor(one: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "clip", "--norm", "1", "--dry-run", str(one), "o.safetensors")
    assert code == 0
    assert "would change 1 of 1 tensor\n" in out


def test_convert_says_one_tensor(one: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "convert", str(one), "o.safetensors")
    assert code == 0
    assert ": 1 tensor, 16 bytes" in out


def test_changed_only_on_identical_files(one: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "diff", str(one), str(one), "--changed-only")
    assert code == 0
    assert "no tensor changed" in out
    assert "┏" not in out  # no empty table
    _, out, _ = _run(capsys, "diff", str(one), str(one), "--changed-only", "-f", "json")
    assert json.loads(out)["tensors"] == []
    _, out, _ = _run(capsys, "diff", str(one), str(one), "--changed-only", "-f", "csv")
    assert out.splitlines()[0].startswith("name,status")
    assert len(out.splitlines()) == 1


def test_one_slice_is_singular(one: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["clip", "--norm", "1", "--axes", "0", "--dry-run", str(one), "o.safetensors"]
    code, out, _ = _run(capsys, *argv, "-f", "json")
    assert code == 0
    assert json.loads(out)["tensors"][0]["note"] == "1 of 1 slice clipped"


def test_one_group_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"layers.0.w": np.ones(4, np.float32)})
    assert main(["norms", str(path), "--group-by", "layer"]) == 0
    out = capsys.readouterr().out
    assert "over 1 group\n" in out
    assert "over 1 groups" not in out


def test_diff_of_files_that_share_no_tensor_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "a.npz", x=np.ones(3))
    np.savez(tmp_path / "b.npz", y=np.ones(3))
    assert main(["diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 0
    out = capsys.readouterr().out
    assert "A and B share no tensor to compare" in out
    assert "relative 0" not in out
