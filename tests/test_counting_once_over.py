"""A clip counts the bit patterns of its 8/16-bit floats only once it may scale them (issue
20, "CPU per element": a no-op clip of a bfloat16 file spent most of its CPU counting).

The exact factor search of 8/16-bit floats reads each tensor's histogram of bit patterns
(np.bincount, ~1.2 ns an element, three times the ~0.4 ns of measuring without it). A
tensor the clip leaves alone never needs one. `clip --norm` now counts a tensor's chunks
once its norm so far may be over the limit, `clip --global` once the global norm so far
may be; chunks measured before are counted when their tensor is done, and tensors done
uncounted are counted in a pass of their own if the limit does not clearly leave them
alone after all (pipeline._Counting).

References: the same clip counting every chunk from the start (api._count_once_over
giving None), whose written bytes and report rows of scaled tensors must be the same; the
norms a `norms` run reports, for the tensors a clip leaves alone; and a spy on the
accumulators that count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from handmade import write_safetensors
from test_histograms_where_scaled import counting_spy

from clipcli import api
from clipcli.formats import base
from clipcli.formats.opening import open_reader
from clipcli.jobs import pipeline
from clipcli.jobs.selection import Selection
from clipcli.numerics.norms import NormAccumulator

NAMES = [f"model.layers.{i}.weight" for i in range(5)]


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, float]]:
    """Five weights of growing norm in three 16-bit and 8-bit dtypes, and a float32 one;
    their norms as `norms` measures them."""
    rng = np.random.default_rng(7)
    dtypes: list[Any] = [
        ml_dtypes.bfloat16,
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.bfloat16,
    ]
    arrays: dict[str, np.ndarray] = {
        name: (rng.standard_normal((24, 40)) * (k + 1)).astype(dtype)
        for k, (name, dtype) in enumerate(zip(NAMES, dtypes, strict=True))
    }
    arrays["model.head.weight"] = rng.standard_normal(50).astype(np.float32)
    path = write_safetensors(tmp_path / "m.safetensors", arrays)
    return path, _norms_of(path)


def _norms_of(path: Path) -> dict[str, float]:
    """Each tensor's norm as `norms` measures it (the measuring pass without histograms)."""
    with open_reader(path) as reader:
        found = pipeline.measure(reader, list(reader.infos), Selection().describe)
    return {row.info.name: row.norm for row in found.tensors}


def _threads(monkeypatch: pytest.MonkeyPatch, threads: str) -> None:
    """CLIPCLI_THREADS; more than one run in worker threads, which race, however small
    the file."""
    monkeypatch.setenv("CLIPCLI_THREADS", threads)
    if threads != "1":
        monkeypatch.setattr(pipeline, "INLINE_BELOW_BYTES", 0)


def _clip(run_main: Any, src: Path, out: Path, mode: list[str]) -> dict[str, Any]:
    result = run_main("clip", *mode, "--no-fsync", "--force", "--format", "json", src, out)
    assert result.code == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _limits(norms: dict[str, float]) -> list[tuple[str, float]]:
    """Limits for --global: under every tensor, crossed after two tensors, a hair over the
    global norm (within the margin: counted again), far over it; for --norm: under all,
    between, one tensor's norm exactly (a tie), a hair over the largest, far over all."""
    weights = [norms[name] for name in NAMES]
    total = math.sqrt(sum(n * n for n in norms.values()))
    crossed = math.sqrt(weights[0] ** 2 + 0.5 * weights[1] ** 2)
    return [
        ("--global", 0.5),
        ("--global", crossed),
        ("--global", total * (1 + 2**-30)),
        ("--global", total * 4),
        ("--norm", 0.5),
        ("--norm", weights[2]),
        ("--norm", weights[3] * (1 + 2**-40)),
        ("--norm", max(weights) * (1 + 2**-30)),
        ("--norm", max(weights) * 4),
    ]


@pytest.mark.parametrize("chunk_bytes", [1 << 21, 256], ids=["a chunk a tensor", "many chunks"])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_clip_writes_what_counting_from_the_start_wrote(
    tmp_path: Path,
    run_main: Any,
    monkeypatch: pytest.MonkeyPatch,
    chunk_bytes: int,
    threads: str,
) -> None:
    src, norms = _checkpoint(tmp_path)
    monkeypatch.setattr(base, "CHUNK_BYTES", chunk_bytes)
    _threads(monkeypatch, threads)
    for flag, limit in _limits(norms):
        mode = [flag, repr(limit)]
        deferred = _clip(run_main, src, tmp_path / "deferred.safetensors", mode)
        with monkeypatch.context() as counting:
            counting.setattr(api, "_count_once_over", lambda _spec: None)
            counted = _clip(run_main, src, tmp_path / "counted.safetensors", mode)
        written = (tmp_path / "deferred.safetensors").read_bytes()
        assert written == (tmp_path / "counted.safetensors").read_bytes(), mode
        for got, want in zip(deferred["tensors"], counted["tensors"], strict=True):
            assert got["changed"] == want["changed"], (mode, got["name"])
            if got["changed"]:  # a scaled tensor's statistics are its histogram's, as before
                assert got == want, mode
            else:  # one left alone is reported as `norms` measures it, or as before
                assert got["norm_before"] in (norms[got["name"]], want["norm_before"])
        assert deferred["changed"] == counted["changed"]


@pytest.mark.parametrize("mode", [["--global", "1e30"], ["--norm", "1e30"]])
def test_a_clip_that_scales_nothing_counts_no_bit_patterns(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, mode: list[str]
) -> None:
    src, norms = _checkpoint(tmp_path)
    kept = counting_spy(monkeypatch)
    report = _clip(run_main, src, tmp_path / "out.safetensors", mode)
    assert not any(kept)
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()
    for row in report["tensors"]:
        assert row["norm_before"] == norms[row["name"]]  # as `norms` reports it
        assert not row["changed"]


def test_a_global_norm_near_the_limit_counts_every_tensor_again(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the margin of the limit (a hair over the global norm), every 8/16-bit weight
    is counted in the pass after the measuring one, and the clip still changes nothing."""
    src, norms = _checkpoint(tmp_path)
    total = math.sqrt(sum(n * n for n in norms.values()))
    kept = counting_spy(monkeypatch)
    report = _clip(
        run_main, src, tmp_path / "out.safetensors", ["--global", repr(total * (1 + 2**-30))]
    )
    assert sum(kept) == len(NAMES)  # one counting accumulator each (a chunk a tensor)
    assert report["changed"] == 0


def test_clearly_within_is_a_strict_margin_exactly_at_its_edge() -> None:
    """A norm of exactly 1 at a limit of exactly 1 + 2**-16 may be over (counted); a limit
    one float64 above it is clearly within (left uncounted)."""
    stats = NormAccumulator()
    stats.add(np.array([1.0], np.float32))
    edge = 1 + 2**-16
    assert stats.limit_ratio(edge) == edge
    assert pipeline._may_be_over(stats, edge)
    assert not pipeline._may_be_over(stats, math.nextafter(edge, math.inf))
    nonfinite = NormAccumulator()
    nonfinite.add(np.array([1.0, math.inf], np.float32))
    assert pipeline._may_be_over(nonfinite, 1e300)  # the plan decides, on counts


@pytest.mark.parametrize("when", ["a tensor's skipped chunks", "the pass after measuring"])
def test_an_input_changed_before_a_second_count_is_exit_3(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    when: str,
) -> None:
    """Chunks counted later are read again: bytes written into the input in between (at
    a known point: just before that read) fail the run as any change of the input during
    it does, exit 3 in one line, nothing written."""
    src, norms = _checkpoint(tmp_path)
    hook: object
    if when == "the pass after measuring":
        total = math.sqrt(sum(n * n for n in norms.values()))
        mode = ["--global", repr(total * (1 + 2**-30))]  # every tensor counted again
        hook, name = pipeline, "measure"
    else:
        monkeypatch.setattr(base, "CHUNK_BYTES", 256)
        mode = ["--norm", "0.5"]  # each tensor's first chunk counted when it is done
        hook, name = pipeline._Counting, "complete"
    real = getattr(hook, name)
    spoiled: list[bool] = []

    def spoiling(*args: Any, **kwargs: Any) -> Any:
        again = name == "measure" and kwargs.get("histograms") is pipeline._always
        if not spoiled and (again or name == "complete"):
            spoiled.append(True)
            data = bytearray(src.read_bytes())
            data[-64:] = bytes(64)  # the float32 weight's last values, as zeros
            with open(src, "r+b") as rewrite:
                rewrite.write(data)
        return real(*args, **kwargs)

    monkeypatch.setattr(hook, name, spoiling)
    out = tmp_path / "out.safetensors"
    from clipcli.cli.entry import main

    code = main(["clip", *mode, str(src), str(out)])
    err = capsys.readouterr().err.splitlines()
    assert spoiled
    assert code == 3, err
    assert len(err) == 1
    assert "was modified" in err[0]  # while being read, or between two passes
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("guess", ["always", "never", "as it comes"])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_what_a_clip_reports_does_not_depend_on_the_shape_guess(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, guess: str, threads: str
) -> None:
    """Tensors of one shape with norms alternating about the limit: whether the guess
    counts a tensor depends on the threads (attack s44b: 3 reports in 16 runs). Counted
    from the start or not at all, or as the guess comes, the report is the same, and a
    tensor left alone reports what `norms` does."""
    rng = np.random.default_rng(11)
    # Magnitudes over 40 decades: float64 sums of their squares round, so a histogram's sum
    # and the plain one differ in their last bits.
    shape = (256, 160)  # 80 KiB: `norms` too measures it on its own, not with others
    spread = 10.0 ** rng.uniform(-30, 10, shape)
    arrays = {
        f"model.layers.{k}.weight": (rng.standard_normal(shape) * spread * (1 + k % 2)).astype(
            ml_dtypes.bfloat16
        )
        for k in range(12)
    }
    src = write_safetensors(tmp_path / "alt.safetensors", arrays)
    monkeypatch.setattr(base, "CHUNK_BYTES", 16384)  # five chunks a tensor
    norms = _norms_of(src)
    limit = float(np.median(list(norms.values())))
    _threads(monkeypatch, threads)
    reference = _clip(run_main, src, tmp_path / "ref.safetensors", ["--norm", repr(limit)])
    if guess != "as it comes":
        real = pipeline._Counting.counts

        def guessed(self: Any, index: int, load: Any) -> bool:
            if guess == "always":
                self.shapes_over.add(self.infos[index].shape)
            else:
                self.shapes_over.clear()
            return bool(real(self, index, load))

        monkeypatch.setattr(pipeline._Counting, "counts", guessed)
    report = _clip(run_main, src, tmp_path / "out.safetensors", ["--norm", repr(limit)])
    assert report["tensors"] == reference["tensors"]
    assert report["global_norm_before"] == reference["global_norm_before"]
    assert (tmp_path / "out.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    left_alone = [row for row in report["tensors"] if not row["changed"]]
    assert len(left_alone) == 6
    for row in left_alone:
        assert row["norm_before"] == norms[row["name"]]


@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_skipped_non_finite_tensor_starts_no_counting(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """--global --skip-nonfinite leaves a tensor with Inf out of the global norm: the
    finite tensors, clearly within C, count nothing and report what `norms` does (the Inf
    had every tensor counted again: attack s44c), and the bytes are the same."""
    rng = np.random.default_rng(12)
    shape = (256, 160)  # 80 KiB: measured on its own by `norms` too
    arrays: dict[str, np.ndarray] = {
        f"model.layers.{k}.weight": (
            rng.standard_normal(shape) * 10.0 ** rng.uniform(-30, 10, shape)
        ).astype(ml_dtypes.bfloat16)
        for k in range(3)
    }
    arrays["model.head.weight"] = np.array([1.0, np.inf, 2.0], np.float32)
    src = write_safetensors(tmp_path / "inf.safetensors", arrays)
    monkeypatch.setattr(base, "CHUNK_BYTES", 16384)
    norms = _norms_of(src)
    finite = [n for name, n in norms.items() if math.isfinite(n)]
    limit = 4 * math.sqrt(sum(n * n for n in finite))
    _threads(monkeypatch, threads)
    mode = ["--global", repr(limit), "--skip-nonfinite"]
    with monkeypatch.context() as counting:
        counting.setattr(api, "_count_once_over", lambda _spec: None)
        reference = _clip(run_main, src, tmp_path / "ref.safetensors", mode)
    kept = counting_spy(monkeypatch)
    report = _clip(run_main, src, tmp_path / "out.safetensors", mode)
    assert not any(kept)
    assert (tmp_path / "out.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    assert [row["changed"] for row in report["tensors"]] == [False] * 4
    assert [row["changed"] for row in reference["tensors"]] == [False] * 4
    for row in report["tensors"]:
        if row["name"] != "model.head.weight":
            assert row["norm_before"] == norms[row["name"]]
