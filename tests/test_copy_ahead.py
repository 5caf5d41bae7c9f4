"""Copying unchanged tensors while the others are still being measured (safetensors).

The measuring pass hands the writer every tensor the plan will most likely leave alone; the
writer kernel-copies it to its final offset on a background thread. The plan still decides
what is written: a tensor copied ahead and then clipped after all must come out clipped,
and a refusal after some tensors were copied must leave nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors
from safetensors.numpy import load_file

import clipcli.formats.safetensors as st_format
from clipcli.cli.entry import main
from clipcli.system import filecopy


@pytest.fixture
def copied_ahead(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names the writer was asked to copy ahead, in order; copies go 4 KiB per call, so
    multi-piece copies are exercised on small files."""
    names: list[str] = []
    original = st_format.SafetensorsWriter.copy_ahead

    def spy(self: st_format.SafetensorsWriter, source: object, info: object) -> None:
        names.append(info.name)  # type: ignore[attr-defined]
        original(self, source, info)  # type: ignore[arg-type]

    monkeypatch.setattr(st_format.SafetensorsWriter, "copy_ahead", spy)
    monkeypatch.setattr(filecopy, "PIECE", 4096)
    return names


def norm64(x: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64)))


def test_nothing_changes_copies_every_tensor_ahead_and_the_file_is_identical(
    tmp_path: Path, copied_ahead: list[str]
) -> None:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "a": rng.standard_normal(50_000).astype(np.float32),
        "b": rng.standard_normal((300, 70)).astype(np.float64),
        "empty": np.zeros(0, np.float32),
        "step": np.array([7], np.int64),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors, {"format": "pt"})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e6", "-q", str(src), str(out)]) == 0
    assert copied_ahead == ["a", "b", "empty", "step"]
    assert out.read_bytes() == src.read_bytes()


def test_global_limit_crossed_midway_overwrites_what_was_copied_ahead(
    tmp_path: Path, copied_ahead: list[str]
) -> None:
    """a and b fit under C=5 on their own, so they are copied ahead; c pushes the global
    norm to ~100, so all three must be scaled by the same factor in the output."""
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(20_000) / 200).astype(np.float32)
    b = (rng.standard_normal(20_000) / 200).astype(np.float32)
    c = (rng.standard_normal(20_000) * 0.7).astype(np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"a": a, "b": b, "c": c})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "5", "-q", str(src), str(out)]) == 0
    assert copied_ahead == ["a", "b"]
    result = load_file(str(out))
    total = float(np.sqrt(norm64(a) ** 2 + norm64(b) ** 2 + norm64(c) ** 2))
    for name, original in (("a", a), ("b", b), ("c", c)):
        expected = original.astype(np.float64) * (5.0 / total)
        np.testing.assert_allclose(result[name], expected, rtol=2e-7, atol=0)
    assert norm64(np.concatenate([result["a"], result["b"], result["c"]])) <= 5.0


def test_per_tensor_mode_copies_only_the_tensors_within_their_limit(
    tmp_path: Path, copied_ahead: list[str]
) -> None:
    small = np.full(1000, 0.01, np.float32)  # norm 0.316
    big = np.full(1000, 1.0, np.float32)  # norm 31.6
    src = write_safetensors(tmp_path / "in.safetensors", {"small": small, "big": big})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", "1", "-q", str(src), str(out)]) == 0
    assert copied_ahead == ["small"]
    result = load_file(str(out))
    assert result["small"].tobytes() == small.tobytes()
    assert norm64(result["big"]) == pytest.approx(1.0, rel=2e-7)
    assert norm64(result["big"]) <= 1.0


def test_refusal_after_tensors_were_copied_ahead_leaves_nothing(
    tmp_path: Path, copied_ahead: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {
        "ok": np.ones(100_000, np.float32),
        "bad": np.array([1.0, np.nan], np.float32),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e9", str(src), str(out)]) == 4
    assert copied_ahead == ["ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "'bad' (1 non-finite)" in err


def test_value_mode_copies_the_tensors_already_in_range(
    tmp_path: Path, copied_ahead: list[str]
) -> None:
    inside = np.linspace(-0.5, 0.5, 999, dtype=np.float32)
    outside = np.linspace(-2, 2, 999, dtype=np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"inside": inside, "outside": outside})
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--value", "1", "-q", str(src), str(out)]) == 0
    assert copied_ahead == ["inside"]
    result = load_file(str(out))
    assert result["inside"].tobytes() == inside.tobytes()
    np.testing.assert_array_equal(result["outside"], np.clip(outside, -1, 1))
