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
