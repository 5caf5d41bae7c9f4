"""`diff` of checkpoints of many small tensors (issue 20, "Many tensors"): paired small
tensors are read many at a time (one read a side, Reader.loader_of_many) and compared in
one task, with the same report, byte for byte, as one pair at a time (the batching turned
off), whatever the mix: bit-identical and changed pairs, dtype changes, NaN and
infinities on one side or both, -0.0 against 0.0, complex, int64 beyond 2**53, empty
tensors, shape changes and tensors on one side only, across the runs' edges.

The values are checked against numpy in float64 (no clipcli code), the files are written
by handmade's own safetensors writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from handmade import write_safetensors
from test_many_tensors import count_preads

from clipcli.cli.entry import main
from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.jobs import diff_math, pipeline
from clipcli.jobs.diff import Pair

KINDS: list[Any] = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.float64,
    np.int64,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,  # the same width and dtype.str as e4m3fn
    np.bool_,
]


FLOATS = (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


def _floating(kind: Any) -> bool:
    return np.dtype(kind).kind == "f" or kind in FLOATS


def _changed(values: np.ndarray) -> np.ndarray:
    """The values with each one changed (doubled, negated for bool), in their dtype."""
    if values.dtype == np.bool_:
        return ~values
    if values.dtype.kind in "iu":
        return values + 1
    return (values.astype(np.complex128 if values.dtype.kind == "c" else np.float64) * 2).astype(
        values.dtype
    )


def pair_of_checkpoints(tmp: Path, count: int, seed: int) -> tuple[Path, Path]:
    """A and B: B is A with most tensors changed in some way."""
    rng = np.random.default_rng(seed)
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    for i in range(count):
        size = int(rng.choice([0, 1, 2, 3, 7, 64]))
        kind = KINDS[i % len(KINDS)]
        name = f"layers.{i}.w"
        if np.dtype(kind).kind == "i":
            values = rng.integers(-(2**62), 2**62, size).astype(kind)
        elif np.dtype(kind).kind == "c":
            values = (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(kind)
        elif kind is np.bool_:
            values = rng.integers(0, 2, size).astype(bool)
        else:
            values = (rng.standard_normal(size) * 3).astype(kind)
        a[name] = values
        change = i % 11
        if change == 0:  # identical
            b[name] = values.copy()
        elif change == 1 and size:  # one element changed
            other = values.copy()
            other[-1:] = _changed(values[-1:])
            b[name] = other
        elif change == 2 and _floating(kind):  # another dtype, same shape
            b[name] = values.astype(np.float32 if kind is not np.float32 else np.float64)
        elif change == 3 and size and _floating(kind):  # NaN / inf on a side
            other = values.copy()
            other[0] = np.nan
            b[name] = other
            if size > 1 and kind is not ml_dtypes.float8_e4m3fn:  # e4m3fn holds no inf
                values[1] = np.inf
                other[1] = np.inf
        elif change == 4 and size and _floating(kind):  # -0.0 against 0.0
            values[0] = 0.0
            other = values.copy()
            other[0] = -0.0
            b[name] = other
        elif change == 5:  # shape changed
            b[name] = np.zeros(size + 1, values.dtype)
        elif change == 6:  # only in A
            pass
        elif change == 7 and np.dtype(kind).kind == "f":  # complex on B's side
            b[name] = values.astype(np.complex64) * (1 + 1j)
        elif change == 8 and kind is np.int64 and size:  # beyond 2**53: exact difference
            values[0] = 2**60
            other = values.copy()
            other[0] = 2**60 + 1
            b[name] = other
        else:  # every element changed
            b[name] = _changed(values)
    b["only.in.b"] = np.ones(3, np.float32)
    return write_safetensors(tmp / "a.safetensors", a), write_safetensors(tmp / "b.safetensors", b)


def diff_report(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["diff", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("run_length", [2, 3, 4096])
@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_diff_of_many_small_tensors_is_what_one_pair_at_a_time_gives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    run_length: int,
    fmt: str,
) -> None:
    a, b = pair_of_checkpoints(tmp_path, 400, seed=run_length)
    monkeypatch.setattr(pipeline, "MANY_TENSORS", run_length)
    together = diff_report(["--format", fmt, str(a), str(b)], capsys)
    monkeypatch.setattr(pipeline, "SMALL_TENSOR_BYTES", -1)  # no runs: one pair at a time
    apart = diff_report(["--format", fmt, str(a), str(b)], capsys)
    assert together == apart


def test_diff_figures_of_batched_pairs_against_numpy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(7)
    a = {
        f"t{i}": rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32)
        for i in range(300)
    }
    b = {name: (v * np.float32(0.5) if i % 2 else v) for i, (name, v) in enumerate(a.items())}
    path_a = write_safetensors(tmp_path / "a.safetensors", a)
    path_b = write_safetensors(tmp_path / "b.safetensors", b)
    assert main(["diff", "--format", "json", str(path_a), str(path_b)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    for i, (name, values) in enumerate(a.items()):
        wide_a, wide_b = values.astype(np.float64), b[name].astype(np.float64)
        row = rows[name]
        assert row["status"] == ("changed" if i % 2 else "same")
        assert row["diff_norm"] == pytest.approx(float(np.linalg.norm(wide_a - wide_b)), rel=1e-12)
        cosine = float(wide_a @ wide_b / np.linalg.norm(wide_a) / np.linalg.norm(wide_b))
        assert row["cosine"] == pytest.approx(cosine, rel=1e-12)


def test_paired_small_tensors_take_one_read_a_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {f"t{i}": np.full(2, i, np.float32) for i in range(500)}
    path_a = write_safetensors(tmp_path / "a.safetensors", tensors)
    path_b = write_safetensors(tmp_path / "b.safetensors", tensors)
    calls = count_preads(monkeypatch)
    assert main(["diff", "-q", str(path_a), str(path_b)]) == 0
    assert len(calls) == 2  # was 1,000: one per tensor and side
    capsys.readouterr()


def test_a_reader_that_gives_too_few_elements_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The batched reads are checked as the chunked ones are: elements that do not fill
    a tensor's shape are an input error (exit 3, one line), not a short comparison."""
    tensors = {f"t{i}": np.full(2, i, np.float32) for i in range(10)}
    path_a = write_safetensors(tmp_path / "a.safetensors", tensors)
    path_b = write_safetensors(tmp_path / "b.safetensors", tensors)
    real = SafetensorsReader._read_many

    def short(self: SafetensorsReader, *args: Any) -> list[np.ndarray]:
        arrays = real(self, *args)
        return [arrays[0][:1], *arrays[1:]] if self.path == path_b else arrays

    monkeypatch.setattr(SafetensorsReader, "_read_many", short)
    assert main(["diff", str(path_a), str(path_b)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "read 2 and 1 elements, the shape holds 2" in err[0]


@pytest.mark.parametrize(
    "dtypes",
    [(np.complex128, np.complex128), ("<f4", ">f4"), ("<f8", "<f8"), ("<i2", ">i2")],
    ids=str,
)
def test_identical_pairs_are_told_by_their_words(dtypes: tuple[Any, Any]) -> None:
    """_identical_each lays the pairs end to end as words: a complex128 element is two
    words, another byte order is compared by value. Each pair's answer is its own: one
    changed element, first or last, in one pair only."""
    rng = np.random.default_rng(5)
    sizes = [1, 2, 3, 5, 1, 4]
    base = [rng.standard_normal(n) * 100 for n in sizes]
    arrays_a = [v.astype(dtypes[0]) for v in base]
    arrays_b = [v.astype(dtypes[1]) for v in base]
    jobs = [
        Pair(
            TensorInfo(f"t{k}", np.dtype(dtypes[0]), (n,), n * np.dtype(dtypes[0]).itemsize),
            TensorInfo(f"t{k}", np.dtype(dtypes[1]), (n,), n * np.dtype(dtypes[1]).itemsize),
        )
        for k, n in enumerate(sizes)
    ]
    assert diff_math._identical_each(arrays_a, arrays_b, jobs) == [True] * len(sizes)
    for k in range(len(sizes)):
        for at in (0, -1):
            changed = [v.copy() for v in arrays_b]
            changed[k][at] = changed[k][at] + 1
            expected = [j != k for j in range(len(sizes))]
            assert diff_math._identical_each(arrays_a, changed, jobs) == expected
