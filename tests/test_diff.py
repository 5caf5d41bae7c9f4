"""clipcli.jobs.diff: tensor-by-tensor comparison of two checkpoints; files made in tmp_path."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from conftest import RunCli
from hypothesis import given, settings
from hypothesis import strategies as st
from layouts import bert_like
from safetensors.numpy import save_file

from clipcli.api import diff, measure
from clipcli.cli.entry import main
from clipcli.errors import InputError, UsageError
from clipcli.formats.base import Checkpoint, Reader, TensorInfo
from clipcli.formats.opening import open_reader
from clipcli.formats.safetensors import SafetensorsWriter
from clipcli.jobs.diff import (
    CHANGED,
    DTYPE_CHANGED,
    ONLY_IN_A,
    ONLY_IN_B,
    SAME,
    SHAPE_CHANGED,
    STATUSES,
    DiffResult,
    TensorDiff,
    aligned_pieces,
    metadata_changes,
)
from clipcli.jobs.diff_math import relative
from clipcli.jobs.pipeline import compare
from clipcli.jobs.selection import Selection

RNG = np.random.default_rng(20240611)
HAS_NPZ = importlib.util.find_spec("clipcli.formats.npz") is not None


# ---------------------------------------------------------------------------------------
# helpers


class ArrayReader(Reader):
    """In-memory reader. `step` (if set) ignores chunk_elems, like HDF5's row-rounded pieces."""

    format_name = "memory"

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray],
        metadata: Mapping[str, str] | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(Path("<memory>"))
        self.arrays = {name: np.asarray(array) for name, array in tensors.items()}
        self._metadata = dict(metadata or {})
        self.step = step

    @property
    def infos(self) -> list[TensorInfo]:
        return [
            TensorInfo(name, array.dtype, array.shape, array.nbytes)
            for name, array in self.arrays.items()
        ]

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        flat = self.arrays[info.name].reshape(-1)
        step = self.step or chunk_elems or 1 << 16
        for start in range(0, flat.size, step):
            yield flat[start : start + step].copy()


def write_st(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None
) -> Path:
    """Any dtype safetensors can hold (bf16 too), through clipcli's own writer."""
    infos = [TensorInfo(n, a.dtype, a.shape, a.nbytes) for n, a in tensors.items()]
    writer = SafetensorsWriter(path, Checkpoint(infos, metadata or {}))
    for info in infos:
        writer.write(info, [np.ascontiguousarray(tensors[info.name]).reshape(-1)])
    writer.close()
    return path


def by_name(result: DiffResult) -> dict[str, TensorDiff]:
    return {t.name: t for t in result.tensors}


def reference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """The figures straight from numpy in float64 (complex128)."""
    kind = complex if np.iscomplexobj(a) or np.iscomplexobj(b) else float
    wa = a.astype(np.complex128 if kind is complex else np.float64).reshape(-1)
    wb = b.astype(np.complex128 if kind is complex else np.float64).reshape(-1)
    norm_a, norm_b = float(np.linalg.norm(wa)), float(np.linalg.norm(wb))
    diff = float(np.linalg.norm(wa - wb))
    dot = float(np.real(np.vdot(wa, wb)))
    return {
        "norm_a": norm_a,
        "norm_b": norm_b,
        "diff_norm": diff,
        "rel_change": diff / norm_a,
        "cosine": dot / (norm_a * norm_b),
        "max_abs_diff": float(np.max(np.abs(wa - wb))),
    }


MIXED: dict[str, np.ndarray] = {
    "embed.weight": RNG.standard_normal((17, 9)).astype(np.float32),
    "layer.0.w": RNG.standard_normal((8, 8)),
    "layer.0.bf16": RNG.standard_normal(40).astype(ml_dtypes.bfloat16),
    "layer.0.half": RNG.standard_normal((3, 5)).astype(np.float16),
    "layer.0.c": (RNG.standard_normal(6) + 1j * RNG.standard_normal(6)).astype(np.complex64),
    "steps": np.arange(12, dtype=np.int64),
    "mask": RNG.random(10) > 0.5,
    "zeros": np.zeros(4, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "scalar": np.array(2.5, dtype=np.float32),
}


# ---------------------------------------------------------------------------------------
# a file against itself


def test_file_against_itself_is_all_same(tmp_path: Path) -> None:
    path = write_st(tmp_path / "a.safetensors", MIXED, {"epoch": "3"})
    result = diff(path, path, chunk_elems=5)
    with open_reader(path) as reader:
        assert [t.name for t in result.tensors] == [info.name for info in reader.infos]
    assert {t.name for t in result.tensors} == set(MIXED)
    for t in result.tensors:
        assert t.status == SAME, t
        assert t.diff_norm == 0.0
        assert t.rel_change == 0.0
        assert t.max_abs_diff == 0.0
        assert t.norm_a == t.norm_b
        if t.norm_a:
            assert t.cosine == 1.0
            assert t.norm_ratio == 1.0
        else:
            assert t.cosine is None
            assert t.norm_ratio is None
    assert result.global_rel_change == 0.0
    assert result.global_diff_norm == 0.0
    assert result.metadata_changes == []
    assert result.identical
    assert result.counts[SAME] == len(MIXED)
    assert result.n_changed == result.n_structural == 0
    assert result.max_rel_change == 0.0
    assert result.format_a == result.format_b == "safetensors"


def test_norms_and_global_norm_match_clipcli_norms(tmp_path: Path) -> None:
    path = write_st(tmp_path / "a.safetensors", MIXED)
    measured = measure(path)
    result = diff(path, path)
    rows = by_name(result)
    for stats in measured.tensors:
        assert rows[stats.info.name].norm_a == stats.norm
        assert rows[stats.info.name].in_global == stats.in_global
    assert result.global_norm_a == measured.global_norm == result.global_norm_b


def test_same_file_with_nan_and_inf_is_same_with_zero_difference(tmp_path: Path) -> None:
    data = {"x": np.array([1.0, np.nan, np.inf, -np.inf, 2.0], dtype=np.float32)}
    path = write_st(tmp_path / "a.safetensors", data)
    (t,) = diff(path, path).tensors
    assert t.status == SAME
    assert t.diff_norm == 0.0
    assert t.rel_change == 0.0
    assert t.max_abs_diff == 0.0
    assert math.isnan(t.norm_a or 0.0)
    assert t.nonfinite_a == 3
    assert t.cosine is not None
    assert math.isnan(t.cosine)


# ---------------------------------------------------------------------------------------
# one tensor scaled


def test_tensor_scaled_by_half(tmp_path: Path) -> None:
    w = RNG.standard_normal((64, 33))
    other = RNG.standard_normal(50)
    a = write_st(tmp_path / "a.safetensors", {"w": w, "other": other})
    b = write_st(tmp_path / "b.safetensors", {"w": w * 0.5, "other": other})
    result = diff(a, b)
    rows = by_name(result)
    t = rows["w"]
    assert t.status == CHANGED
    assert t.rel_change == pytest.approx(0.5, rel=1e-12, abs=1e-12)
    assert t.norm_ratio == pytest.approx(0.5, rel=1e-12)
    assert t.cosine == pytest.approx(1.0, abs=1e-12)
    assert t.max_abs_diff == pytest.approx(0.5 * np.max(np.abs(w)), rel=1e-12)
    assert t.diff_norm == pytest.approx(0.5 * np.linalg.norm(w), rel=1e-12)
    assert rows["other"].status == SAME
    assert result.n_changed == 1
    assert result.n_same == 1
    assert result.max_rel_change == t.rel_change
    assert result.largest_change is t
    expected = 0.5 * np.linalg.norm(w) / math.hypot(np.linalg.norm(w), np.linalg.norm(other))
    assert result.global_rel_change == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------
# across formats


def write_h5(
    path: Path, tensors: Mapping[str, np.ndarray], attrs: dict[str, str] | None = None
) -> Path:
    with h5py.File(path, "w") as handle:
        for name, array in tensors.items():
            handle.create_dataset(name, data=array)
        for key, value in (attrs or {}).items():
            handle.attrs[key] = value
    return path


def test_hdf5_big_endian_against_safetensors_is_same(tmp_path: Path) -> None:
    # HDF5 rounds pieces to whole rows (7 -> 6 elements here), safetensors does not:
    # the pieces are re-cut to line up, and byte order does not count as a change.
    data = RNG.standard_normal((5, 3)).astype(np.float32)
    h5 = write_h5(tmp_path / "a.h5", {"w": data.astype(">f4"), "v": data[0]})
    st_path = write_st(tmp_path / "b.safetensors", {"w": data, "v": data[0]})
    result = diff(h5, st_path, chunk_elems=7)
    assert result.format_a == "hdf5"
    assert result.format_b == "safetensors"
    assert [t.status for t in result.tensors] == [SAME, SAME]
    changed = write_st(tmp_path / "c.safetensors", {"w": data * 2, "v": data[0]})
    t = by_name(diff(h5, changed, chunk_elems=7))["w"]
    assert t.status == CHANGED
    assert t.rel_change == pytest.approx(1.0, rel=1e-12)
    assert t.norm_ratio == pytest.approx(2.0, rel=1e-12)


@pytest.mark.skipif(not HAS_NPZ, reason="clipcli/formats/npz.py has not landed yet")
def test_npz_against_safetensors_same_data(tmp_path: Path) -> None:
    tensors: dict[str, Any] = {  # numpy types **kwds as bool | ArrayLike
        "a": RNG.standard_normal((4, 6)).astype(np.float32),
        "b": RNG.standard_normal(9).astype(np.float32),
    }
    npz = tmp_path / "a.npz"
    np.savez(npz, a=tensors["a"], b=tensors["b"])
    st_path = write_st(tmp_path / "b.safetensors", tensors)
    result = diff(npz, st_path, chunk_elems=5)
    assert result.format_a == "npz"
    assert result.format_b == "safetensors"
    assert {t.name: t.status for t in result.tensors} == {"a": SAME, "b": SAME}
    assert result.global_rel_change == 0.0
    half = write_st(
        tmp_path / "h.safetensors", {k: v.astype(np.float16) for k, v in tensors.items()}
    )
    assert {t.status for t in diff(npz, half).tensors} == {DTYPE_CHANGED}


def test_float16_against_float32_of_the_same_values(tmp_path: Path) -> None:
    values = RNG.standard_normal(100).astype(np.float16)
    a = write_st(tmp_path / "a.safetensors", {"x": values})
    b = write_st(tmp_path / "b.safetensors", {"x": values.astype(np.float32)})
    (t,) = diff(a, b, chunk_elems=16).tensors
    assert t.status == DTYPE_CHANGED
    assert (t.dtype_a, t.dtype_b) == ("float16", "float32")
    assert t.norm_a == t.norm_b == pytest.approx(np.linalg.norm(values.astype(np.float64)))
    assert t.diff_norm == 0.0
    assert t.rel_change == 0.0
    assert t.max_abs_diff == 0.0
    assert t.cosine == pytest.approx(1.0, abs=1e-15)
    # Rounded to float16 the other way: a small, exactly measured change.
    wide = RNG.standard_normal(100).astype(np.float32)
    a = write_st(tmp_path / "c.safetensors", {"x": wide})
    b = write_st(tmp_path / "d.safetensors", {"x": wide.astype(np.float16)})
    (t,) = diff(a, b).tensors
    ref = reference(wide, wide.astype(np.float16))
    assert t.status == DTYPE_CHANGED
    assert t.diff_norm == pytest.approx(ref["diff_norm"], rel=1e-12)
    assert 0 < (t.rel_change or 0) < 1e-3


def test_bfloat16_against_float32(tmp_path: Path) -> None:
    values = RNG.standard_normal(77).astype(np.float32)
    a = write_st(tmp_path / "a.safetensors", {"x": values})
    b = write_st(tmp_path / "b.safetensors", {"x": values.astype(ml_dtypes.bfloat16)})
    (t,) = diff(a, b, chunk_elems=10).tensors
    ref = reference(values, values.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert t.status == DTYPE_CHANGED
    assert t.dtype_b == "bfloat16"
    for key in ("diff_norm", "rel_change", "cosine", "max_abs_diff", "norm_b"):
        assert getattr(t, key) == pytest.approx(ref[key], rel=1e-12), key


# ---------------------------------------------------------------------------------------
# structure and metadata


def test_structural_changes_and_order(tmp_path: Path) -> None:
    a = write_st(
        tmp_path / "a.safetensors",
        {
            "keep": np.ones(3, np.float32),
            "gone": np.full(4, 2.0, np.float32),
            "reshaped": np.arange(6, dtype=np.float32),
            "recast": np.arange(5, dtype=np.float32),
            "count": np.arange(4, dtype=np.int32),
        },
        {"epoch": "1", "same": "x", "dropped": "y"},
    )
    b = write_st(
        tmp_path / "b.safetensors",
        {
            "keep": np.ones(3, np.float32),
            "reshaped": np.arange(6, dtype=np.float32).reshape(2, 3),
            "recast": np.arange(5, dtype=np.float64),
            "count": np.array([0, 1, 2, 5], dtype=np.int32),
            "new": np.full(2, 3.0, np.float32),
        },
        {"epoch": "2", "same": "x", "added": "z"},
    )
    result = diff(a, b)
    rows = by_name(result)
    assert [t.name for t in result.tensors][-1] == "new"  # B-only tensors come last
    a_order = [t.name for t in result.tensors[:-1]]
    assert set(a_order) == {"keep", "gone", "reshaped", "recast", "count"}

    assert rows["keep"].status == SAME
    gone = rows["gone"]
    assert gone.status == ONLY_IN_A
    assert gone.norm_a == pytest.approx(4.0)
    assert gone.norm_b is None
    assert gone.diff_norm is None
    assert gone.cosine is None
    assert gone.dtype_b is None
    new = rows["new"]
    assert new.status == ONLY_IN_B
    assert new.norm_b == pytest.approx(math.sqrt(18))
    assert new.norm_a is None
    reshaped = rows["reshaped"]
    assert reshaped.status == SHAPE_CHANGED
    assert (reshaped.shape_a, reshaped.shape_b) == ((6,), (2, 3))
    assert reshaped.norm_a == reshaped.norm_b == pytest.approx(np.linalg.norm(np.arange(6)))
    assert reshaped.diff_norm is reshaped.rel_change is reshaped.max_abs_diff is None
    assert reshaped.cosine is reshaped.norm_ratio is None
    recast = rows["recast"]
    assert recast.status == DTYPE_CHANGED
    assert (recast.dtype_a, recast.dtype_b) == (
        "float32",
        "float64",
    )
    assert recast.diff_norm == 0.0
    count = rows["count"]
    assert count.status == CHANGED
    assert count.diff_norm == 2.0
    assert count.max_abs_diff == 2.0
    assert not count.in_global

    assert result.metadata_changes == [
        ("epoch", "1", "2"),
        ("dropped", "y", None),
        ("added", None, "z"),
    ]
    assert result.counts == {
        SAME: 1,
        CHANGED: 1,
        DTYPE_CHANGED: 1,
        SHAPE_CHANGED: 1,
        ONLY_IN_A: 1,
        ONLY_IN_B: 1,
    }
    assert set(result.counts) == set(STATUSES)
    assert result.n_structural == 3
    assert result.n_changed == 2
    assert not result.identical
    # Integer tensors are compared but stay out of the global figures.
    assert result.global_diff_norm == 0.0
    floats_a = [1, 1, 1, 2, 2, 2, 2, *range(6), *range(5)]
    assert result.global_norm_a == pytest.approx(math.sqrt(sum(x * x for x in floats_a)))
    assert result.max_rel_change == pytest.approx(2 / np.linalg.norm(np.arange(4)))


def test_metadata_only_change_is_not_identical(tmp_path: Path) -> None:
    data = {"x": np.ones(2, np.float32)}
    a = write_st(tmp_path / "a.safetensors", data, {"k": "v"})
    b = write_st(tmp_path / "b.safetensors", data, {"k": "w", "n": "1"})
    result = diff(a, b)
    assert result.tensors[0].status == SAME
    assert result.metadata_changes == [("k", "v", "w"), ("n", None, "1")]
    assert not result.identical
    assert metadata_changes({}, {}) == []


def test_selection_restricts_both_sides(tmp_path: Path) -> None:
    a = write_st(tmp_path / "a.safetensors", {"enc.w": np.ones(2), "dec.w": np.ones(2)})
    b = write_st(tmp_path / "b.safetensors", {"enc.w": np.zeros(2), "dec.x": np.ones(2)})
    result = diff(a, b, Selection(include=("enc.*",)))
    assert [(t.name, t.status) for t in result.tensors] == [("enc.w", CHANGED)]
    result = diff(a, b, lambda name: name.startswith("dec"))
    assert {t.name: t.status for t in result.tensors} == {"dec.w": ONLY_IN_A, "dec.x": ONLY_IN_B}


# ---------------------------------------------------------------------------------------
# chunking


FIGURES = ("norm_a", "norm_b", "diff_norm", "rel_change", "max_abs_diff", "cosine", "norm_ratio")


def assert_same_figures(x: TensorDiff, y: TensorDiff, rel: float = 1e-13) -> None:
    assert x.status == y.status
    for key in FIGURES:
        assert getattr(x, key) == pytest.approx(getattr(y, key), rel=rel, abs=1e-300), key


def test_small_chunks_give_the_same_figures_as_one_chunk(tmp_path: Path) -> None:
    a_data: dict[str, np.ndarray] = {
        "w": RNG.standard_normal((13, 11)),
        "h": RNG.standard_normal(50).astype(np.float16),
    }
    b_data: dict[str, np.ndarray] = {
        "w": a_data["w"] + 0.01 * RNG.standard_normal((13, 11)),
        "h": RNG.standard_normal(50).astype(np.float32),
    }
    a = write_st(tmp_path / "a.safetensors", a_data)
    b = write_st(tmp_path / "b.safetensors", b_data)
    small = diff(a, b, chunk_elems=7)
    big = diff(a, b, chunk_elems=10_000)
    for x, y in zip(small.tensors, big.tensors, strict=True):
        assert_same_figures(x, y)
    assert small.global_diff_norm == pytest.approx(big.global_diff_norm, rel=1e-13)


def test_misaligned_pieces_are_recut() -> None:
    a = RNG.standard_normal(101)
    b = a + RNG.standard_normal(101)
    regular = compare(ArrayReader({"x": a}), ArrayReader({"x": b}), chunk_elems=1000)
    for step_a, step_b in [(7, 3), (10, 101), (1, 50), (33, 33)]:
        result = compare(
            ArrayReader({"x": a}, step=step_a), ArrayReader({"x": b}, step=step_b), chunk_elems=5
        )
        assert_same_figures(result.tensors[0], regular.tensors[0])
    same = compare(ArrayReader({"x": a}, step=7), ArrayReader({"x": a.copy()}, step=3))
    assert same.tensors[0].status == SAME


def test_aligned_pieces() -> None:
    a = [np.arange(0, 4), np.arange(4, 5), np.arange(5, 10)]
    b = [np.arange(0, 3), np.empty(0, np.int64), np.arange(3, 10)]
    pairs = list(aligned_pieces(a, b))
    assert [len(x) for x, _ in pairs] == [3, 1, 1, 5]
    for x, y in pairs:
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError):  # noqa: PT011 (any message: the lengths differ)
        list(aligned_pieces([np.arange(3)], [np.arange(4)]))
    assert list(aligned_pieces([], [])) == []


class ShortReader(ArrayReader):
    def chunks(
        self,
        info: TensorInfo,
        chunk_elems: int | None = None,  # noqa: ARG002 (the Reader interface)
    ) -> Iterator[np.ndarray]:
        yield self.arrays[info.name].reshape(-1)[:-1]


def test_a_reader_that_yields_too_few_elements_is_an_input_error() -> None:
    with pytest.raises(InputError, match="elements"):
        compare(ArrayReader({"x": np.ones(5)}), ShortReader({"x": np.ones(5)}))
    with pytest.raises(InputError, match="elements"):
        compare(ShortReader({"x": np.ones(5)}), ShortReader({"x": np.ones(5)}))


def test_bad_chunk_elems() -> None:
    with pytest.raises(UsageError):
        compare(ArrayReader({}), ArrayReader({}), chunk_elems=0)


def test_threads_give_identical_results() -> None:
    tensors_a = {f"t{i}": RNG.standard_normal(300) for i in range(6)}
    tensors_b = {k: v * (1 + 0.1 * RNG.standard_normal(300)) for k, v in tensors_a.items()}
    one = compare(ArrayReader(tensors_a), ArrayReader(tensors_b), chunk_elems=13, workers=1)
    four = compare(ArrayReader(tensors_a), ArrayReader(tensors_b), chunk_elems=13, workers=4)
    assert one == four


# ---------------------------------------------------------------------------------------
# numerics


def test_non_finite_values_do_not_crash() -> None:
    a = np.array([1.0, 2.0, np.nan, np.inf, 3.0])
    cases: list[tuple[np.ndarray, Any, Any]] = [
        (np.array([1.0, 2.0, np.nan, np.inf, 4.0]), 1.0, 1.0),  # same NaN, same Inf: unchanged
        (np.array([1.0, 2.0, 0.0, np.inf, 3.0]), math.nan, math.nan),  # NaN disappears
        (np.array([1.0, 2.0, np.nan, 5.0, 3.0]), math.inf, math.inf),  # Inf becomes finite
        (np.array([1.0, 2.0, np.nan, -np.inf, 3.0]), math.inf, math.inf),  # +Inf vs -Inf
    ]
    for b, diff_norm, max_abs in cases:
        (t,) = compare(ArrayReader({"x": a}), ArrayReader({"x": b})).tensors
        assert t.status == CHANGED
        np.testing.assert_equal(t.diff_norm, diff_norm)
        np.testing.assert_equal(t.max_abs_diff, max_abs)
        assert t.cosine is not None
        assert math.isnan(t.cosine)
        assert t.nonfinite_a == 2
    # Finite A, B gains an Inf: diff inf, rel inf; global figures follow.
    result = compare(
        ArrayReader({"x": np.ones(3)}), ArrayReader({"x": np.array([1.0, np.inf, 1.0])})
    )
    (t,) = result.tensors
    assert t.diff_norm == math.inf
    assert t.rel_change == math.inf
    assert t.norm_b == math.inf
    assert result.global_diff_norm == math.inf
    assert result.global_rel_change == math.inf
    assert result.max_rel_change == math.inf


def test_difference_beyond_float64_is_inf_without_warnings() -> None:
    a, b = np.array([1e308, 1.0]), np.array([-1e308, 1.0])
    (t,) = compare(ArrayReader({"x": a}), ArrayReader({"x": b})).tensors
    assert t.diff_norm == math.inf
    assert t.max_abs_diff == math.inf
    assert t.cosine == pytest.approx(-1.0, rel=1e-12)


def test_zero_tensors() -> None:
    zeros, ones = np.zeros(4), np.ones(4)
    (t,) = compare(ArrayReader({"x": zeros}), ArrayReader({"x": ones})).tensors
    assert t.rel_change == math.inf
    assert t.norm_ratio is None
    assert t.cosine is None
    (t,) = compare(ArrayReader({"x": ones}), ArrayReader({"x": zeros})).tensors
    assert t.rel_change == 1.0
    assert t.norm_ratio == 0.0
    assert t.cosine is None
    (t,) = compare(ArrayReader({"x": zeros}), ArrayReader({"x": -zeros})).tensors
    assert t.status == CHANGED  # -0.0 has other bits: the smallest change, never 0
    assert t.rel_change == math.ulp(0.0)
    assert t.diff_norm == 0.0
    assert relative(0.0, 0.0) == 0.0
    assert relative(1.0, 0.0) == math.inf


@pytest.mark.parametrize("magnitude", [1e300, 1e-300, 1e200, 1e-200, 1e-310])
def test_extreme_magnitudes_neither_overflow_nor_underflow(magnitude: float) -> None:
    a = RNG.standard_normal(40)
    b = a + 0.25 * RNG.standard_normal(40)
    ref = reference(a, b)
    (t,) = compare(
        ArrayReader({"x": a * magnitude}), ArrayReader({"x": b * magnitude}), chunk_elems=9
    ).tensors
    rel = 1e-12 if magnitude > 1e-300 else 1e-6  # subnormals keep fewer digits
    assert t.diff_norm == pytest.approx(ref["diff_norm"] * magnitude, rel=rel)
    assert t.rel_change == pytest.approx(ref["rel_change"], rel=rel)
    assert t.cosine == pytest.approx(ref["cosine"], rel=rel)
    assert t.norm_ratio == pytest.approx(ref["norm_b"] / ref["norm_a"], rel=rel)


def test_mixed_extreme_scales_in_one_tensor() -> None:
    # One piece at 1e300, another at 1e-300: the dot product is carried with exponents.
    a = np.concatenate([np.full(5, 1e300), np.full(5, 1e-300)])
    b = np.concatenate([np.full(5, -1e300), np.full(5, 1e-300)])
    (t,) = compare(ArrayReader({"x": a}), ArrayReader({"x": b}), chunk_elems=5).tensors
    assert t.cosine == pytest.approx(-1.0, rel=1e-12)
    assert t.diff_norm == pytest.approx(2e300 * math.sqrt(5), rel=1e-12)
    assert t.max_abs_diff == pytest.approx(2e300)


def test_complex_tensors() -> None:
    a = RNG.standard_normal(30) + 1j * RNG.standard_normal(30)
    b = a * (0.5 + 0.5j)
    (t,) = compare(ArrayReader({"z": a}), ArrayReader({"z": b}), chunk_elems=4).tensors
    ref = reference(a, b)
    for key in ("diff_norm", "rel_change", "cosine", "max_abs_diff", "norm_a", "norm_b"):
        assert getattr(t, key) == pytest.approx(ref[key], rel=1e-12), key
    # complex64 against complex128, and complex against real
    (t,) = compare(
        ArrayReader({"z": a.astype(np.complex64)}), ArrayReader({"z": a}), chunk_elems=7
    ).tensors
    assert t.status == DTYPE_CHANGED
    assert t.diff_norm == pytest.approx(reference(a.astype(np.complex64), a)["diff_norm"], rel=1e-9)
    real = a.real.copy()
    (t,) = compare(ArrayReader({"z": a}), ArrayReader({"z": real}), chunk_elems=7).tensors
    assert t.status == DTYPE_CHANGED
    assert t.diff_norm == pytest.approx(np.linalg.norm(a.imag), rel=1e-12)
    assert t.max_abs_diff == pytest.approx(np.max(np.abs(a.imag)), rel=1e-12)


def test_integer_and_bool_tensors_compare_numerically() -> None:
    a = {"i": np.array([1, 2, 3], np.uint8), "m": np.array([True, False, True])}
    b = {"i": np.array([3, 2, 1], np.uint8), "m": np.array([True, True, True])}
    result = compare(ArrayReader(a), ArrayReader(b))
    rows = by_name(result)
    assert rows["i"].diff_norm == pytest.approx(math.sqrt(8))  # no uint8 wraparound
    assert rows["i"].max_abs_diff == 2.0
    assert rows["m"].diff_norm == 1.0
    assert not rows["i"].in_global
    assert not rows["m"].in_global
    assert result.global_norm_a == 0.0
    assert result.global_diff_norm == 0.0
    assert result.global_rel_change == 0.0


# ---------------------------------------------------------------------------------------
# against a float64 numpy reference


@st.composite
def array_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype_a = draw(st.sampled_from([np.float64, np.float32, np.float16, np.complex128]))
    dtype_b = draw(st.sampled_from([dtype_a, np.float64, np.float32]))
    scale = 10.0 ** draw(st.integers(-3, 3))
    a = (rng.standard_normal(n) * scale).astype(dtype_a)
    if dtype_a is np.complex128:
        a = a + 1j * rng.standard_normal(n) * scale
    noise = draw(st.sampled_from([0.0, 1e-6, 0.1, 10.0]))
    b = (a.real if dtype_b is not dtype_a and dtype_a is np.complex128 else a).astype(dtype_b)
    b = b + (noise * scale * rng.standard_normal(n)).astype(dtype_b)
    chunk = draw(st.integers(1, 64))
    return a, b, chunk


@given(array_pairs())
@settings(max_examples=50, deadline=None)
def test_matches_numpy_float64_reference(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    a, b, chunk = case
    (t,) = compare(ArrayReader({"x": a}), ArrayReader({"x": b}), chunk_elems=chunk).tensors
    ref = reference(a, b)
    for key in ("diff_norm", "rel_change", "max_abs_diff", "norm_a", "norm_b"):
        assert getattr(t, key) == pytest.approx(ref[key], rel=1e-12, abs=0), key
    # The cosine has an absolute, not relative, error bound (see clipcli.jobs.diff).
    assert t.cosine == pytest.approx(ref["cosine"], rel=1e-12, abs=1e-14)
    assert t.norm_ratio == pytest.approx(ref["norm_b"] / ref["norm_a"], rel=1e-12)


def test_the_summary_says_its_difference_is_over_the_tensors_both_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """‖A−B‖ 0 beside "1 only in B" read as "no difference" (found by the newcomer)."""
    from safetensors.numpy import save_file

    from clipcli.cli.entry import main

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(a))
    save_file({"w": np.ones(3, np.float32), "extra": np.ones(2, np.float32)}, str(b))
    assert main(["diff", str(a), str(b)]) == 0
    assert "‖A−B‖ 0 (relative 0) over the tensors both hold" in capsys.readouterr().out
    assert main(["diff", str(a), str(a)]) == 0
    assert "both hold" not in capsys.readouterr().out


def test_diff_fail_above_fails_on_metadata_and_structure_alone(tmp_path: Path) -> None:
    """Same tensors, one metadata value changed: --fail-above 0 must fail (exit 1)."""
    import h5py

    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, backend in ((a, "tensorflow"), (b, "jax")):
        with h5py.File(path, "w") as f:
            f.create_dataset("dense/kernel:0", data=np.ones((2, 2), np.float32))
            f.attrs["backend"] = backend
            f["dense"].attrs["weight_names"] = [b"kernel:0"]
    assert main(["diff", str(a), str(a), "--fail-above", "0"]) == 0
    assert main(["diff", str(a), str(b), "--fail-above", "0"]) == 1
    with h5py.File(b, "a") as f:
        f.attrs["backend"] = "tensorflow"
        f["dense"].attrs["weight_names"] = [b"bias:0"]  # an attribute of a group
    assert main(["diff", str(a), str(b), "--fail-above", "0"]) == 1


def test_diff_fail_above_fails_on_a_dtype_change_with_equal_values(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": np.array([1.0, 2.0], np.float32)}, str(a))
    save_file({"x": np.array([1.0, 2.0], np.float64)}, str(b))
    assert main(["diff", str(a), str(a), "--fail-above", "0"]) == 0
    assert main(["diff", str(a), str(b), "--fail-above", "0"]) == 1


# ------------------------------------------ issue 23, item 4: diff dir vs joined file


def test_a_directory_and_its_joined_file_do_not_differ(tmp_path: Path, run_main: RunCli) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    joined = tmp_path / "bert1.safetensors"
    assert run_main("convert", model, joined).code == 0
    for a, b in ((model, joined), (joined, model)):
        done = run_main("diff", a, b, "--fail-above", "0", "--json")
        assert done.code == 0, done.stderr
        assert done.json()["metadata_changes"] == []


def test_a_directory_and_its_npz_differ_only_by_format(tmp_path: Path, run_main: RunCli) -> None:
    """npz holds no metadata: the shards' format=pt is what it lost, and nothing else."""
    model = bert_like(tmp_path / "bert-tiny")
    joined = tmp_path / "bert1.npz"
    assert run_main("convert", model, joined).code == 0
    done = run_main("diff", model, joined, "--json")
    assert done.code == 0, done.stderr
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("format", "pt", None)]


def test_other_index_keys_are_still_differences(tmp_path: Path, run_main: RunCli) -> None:
    plain = bert_like(tmp_path / "plain")
    edited = bert_like(tmp_path / "edited", {"total_flops": 7, "total_size": 1})
    done = run_main("diff", plain, edited, "--fail-above", "0", "--json")
    assert done.code == 1
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("total_flops", None, "7")]


def test_an_index_key_the_shards_carry_otherwise_is_shown_apart(
    tmp_path: Path, run_main: RunCli
) -> None:
    plain = bert_like(tmp_path / "plain")
    edited = bert_like(tmp_path / "edited", {"format": "tf"})
    done = run_main("diff", plain, edited, "--json")
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("index format", None, "tf")]
