"""A clip counts bit patterns only of the tensors it may scale (issue 20).

The factor search and a scaled tensor's outcome read the 8- and 16-bit floats' bit-pattern
histograms (65,536 counts each for 16 bits). A tensor the clip never scales (a quantized
weight's float16 scales, training state, one the selection leaves out) needs none: counting
them made `clip --global` of 3,000 small int4 modules spend most of its measuring on the
float16 scales' histograms. The reference: the bytes a clip writes, which must not change
(read back with the safetensors library), and NormAccumulator.histogram per tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from handmade import write_safetensors
from safetensors.numpy import load_file

from clipcli.formats.opening import open_reader
from clipcli.jobs import pipeline
from clipcli.jobs.selection import Selection
from clipcli.numerics.norms import NormAccumulator


def bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def measured(path: Path, wanted: set[str]) -> dict[str, NormAccumulator]:
    selection = Selection()
    with open_reader(path) as reader:
        found = pipeline.measure(
            reader,
            list(reader.infos),
            selection.describe,
            histograms=lambda info: info.name in wanted,
        )
    return {row.info.name: row.stats for row in found.tensors}


def test_only_the_tensors_asked_for_count_bit_patterns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "a.weight": bf16(rng, 64, 64),
        "b.weight": bf16(rng, 3),
        "c.weight": rng.standard_normal(5).astype(np.float16),
        "d.weight": rng.standard_normal(5).astype(np.float32),
    }
    path = write_safetensors(tmp_path / "m.safetensors", arrays)
    stats = measured(path, {"a.weight", "c.weight", "d.weight"})
    assert stats["a.weight"].histogram is not None
    assert stats["c.weight"].histogram is not None
    assert stats["b.weight"].histogram is None  # not asked for
    assert stats["d.weight"].histogram is None  # float32: never
    plain = measured(path, set())
    for name in arrays:  # the statistics themselves do not depend on it
        assert stats[name].norm == plain[name].norm
        assert stats[name].max_abs == plain[name].max_abs
        assert stats[name].numel == plain[name].numel


def counting_spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each NormAccumulator made from now on counts bit patterns, in order."""
    kept: list[bool] = []
    real = NormAccumulator.__init__

    def spy(self: NormAccumulator, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        kept.append(self.keep_histogram)

    monkeypatch.setattr(NormAccumulator, "__init__", spy)
    return kept


def clipped(run_main: Any, src: Path, out: Path, *mode: str) -> dict[str, Any]:
    result = run_main("clip", *mode, src, out, "--format", "json")
    assert result.code == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)["tensors"]}


@pytest.mark.parametrize("mode", [("--global", "1.5"), ("--norm", "0.5"), ("--average", "0.01")])
def test_tensors_a_clip_never_scales_are_written_as_they_were(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, mode: tuple[str, ...]
) -> None:
    """Training state and a tensor --exclude leaves out are bf16 too, and count no bit
    patterns; the weights that do are clipped to within C (read back by safetensors)."""
    rng = np.random.default_rng(1)
    arrays = {
        "model.layer.weight": bf16(rng, 32, 32),
        "model.other.weight": bf16(rng, 16),
        "model.skipped.weight": bf16(rng, 16),
        "optimizer.state.0.exp_avg": bf16(rng, 32, 32),
    }
    src = write_safetensors(tmp_path / "m.safetensors", arrays)
    kept = counting_spy(monkeypatch)
    rows = clipped(
        run_main, src, tmp_path / "out.safetensors", *mode, "--exclude", "model.skipped.*"
    )
    assert sum(kept) == 2  # one accumulator for each of the two weights in scope
    out = load_file(str(tmp_path / "out.safetensors"))
    for name in ("model.skipped.weight", "optimizer.state.0.exp_avg"):
        assert out[name].tobytes() == arrays[name].tobytes()
        assert not rows[name]["changed"]
    limit = float(mode[1])
    if mode[0] == "--norm":
        for name in ("model.layer.weight", "model.other.weight"):
            assert np.linalg.norm(out[name].astype(np.float64)) <= limit
    elif mode[0] == "--global":
        both = np.concatenate(
            [
                out[n].astype(np.float64).ravel()
                for n in ("model.layer.weight", "model.other.weight")
            ]
        )
        assert np.linalg.norm(both) <= limit * (1 + 2**-40)
