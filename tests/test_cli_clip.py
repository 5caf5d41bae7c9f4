"""`clipcli clip` through the real CLI, on files of every format built in tmp_path and read
back with the official libraries (safe_open, np.load, h5py), never with clipcli's readers.

- TensorFlow's own published numbers (/work/shared/seeds/*), format by format.
- Every mode against a float64 reference of TF's formula, on random tensors of rank 0-3.
- The output's norms equal the limit (float32/float64) and never exceed it.
- Whatever is not clipped is bit-identical; metadata and npz compression survive.
- The JSON report, --dry-run and --quiet.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest

FORMATS = ("safetensors", "npz", "h5")
EXT = {"safetensors": ".safetensors", "npz": ".npz", "h5": ".h5"}
BF16 = np.dtype(ml_dtypes.bfloat16)

# TF prints float32 to ~8 significant digits; its numbers are matched to 1e-6 relative.
TF_RTOL = 1e-6


@pytest.fixture
def clip_json(cli: Any) -> Any:
    """Run `clip MODE... IN OUT --format json`, assert exit 0, return the parsed report."""

    def run(src: Path, out: Path, *mode: str) -> dict[str, Any]:
        result = cli("clip", *mode, src, out, "--format", "json")
        assert result.code == 0, result.stderr
        assert result.stderr == ""
        report: dict[str, Any] = result.json()
        return report

    return run


# ------------------------------------------------------------------ 1. TF's own numbers

TF_BY_NORM_INPUT = np.array([[-2, -1, 0], [1, 2, 3]], dtype=np.float32)  # np.linspace(-2, 3, 6)
C1 = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.float32)
C2 = np.array([[-2, -4], [2, 4]], dtype=np.float32)


def test_tf_clip_by_norm_doc_example(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # tf.clip_by_norm([[1, 2, 3, 4, 5]], 2.0) from the tf.clip_by_norm API page.
    src = write_checkpoint(ckpt("in"), {"t": np.array([[1, 2, 3, 4, 5]], dtype=np.float32)})
    clip_json(src, ckpt("out"), "--norm", "2.0")
    out = read_checkpoint(ckpt("out"))["t"]
    assert out.dtype == np.float32
    assert out.shape == (1, 5)
    expected = [[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]]
    np.testing.assert_allclose(out, expected, rtol=TF_RTOL)


def test_tf_clip_by_norm_4_clips(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    src = write_checkpoint(ckpt("in"), {"p3": TF_BY_NORM_INPUT})
    clip_json(src, ckpt("out"), "--norm", "4")
    expected = [[-1.8353258, -0.9176629, 0.0], [0.9176629, 1.8353258, 2.7529888]]
    np.testing.assert_allclose(read_checkpoint(ckpt("out"))["p3"], expected, rtol=TF_RTOL)


def test_tf_clip_by_norm_5_leaves_tensor_bit_identical(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    # ||p3|| = 4.358... <= 5: TF returns the input; we promise the very same bytes.
    src = write_checkpoint(ckpt("in"), {"p3": TF_BY_NORM_INPUT})
    report = clip_json(src, ckpt("out"), "--norm", "5")
    assert_bit_identical(read_checkpoint(ckpt("out"))["p3"], TF_BY_NORM_INPUT)
    assert report["tensors"][0]["changed"] is False


def test_tf_clip_by_norm_axes_1(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # Row 0 has norm sqrt(5) <= 3 and stays; row 1 has sqrt(14) > 3 and is scaled.
    src = write_checkpoint(ckpt("in"), {"p3": TF_BY_NORM_INPUT})
    clip_json(src, ckpt("out"), "--norm", "3", "--axes", "1")
    out = read_checkpoint(ckpt("out"))["p3"]
    expected = [[-2.0, -1.0, 0.0], [0.8017837, 1.6035674, 2.4053512]]
    np.testing.assert_allclose(out, expected, rtol=TF_RTOL)
    assert out[0].tobytes() == TF_BY_NORM_INPUT[0].tobytes()


def test_tf_clip_by_global_norm_two_tensors(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    src = write_checkpoint(ckpt("in"), {"c1": C1, "c2": C2})
    report = clip_json(src, ckpt("out"), "--global", "9")
    out = read_checkpoint(ckpt("out"))
    expected_c1 = [[0.0, 0.9233805, 1.846761], [2.7701416, 3.693522, 4.6169024]]
    expected_c2 = [[-1.846761, -3.693522], [1.846761, 3.693522]]
    np.testing.assert_allclose(out["c1"], expected_c1, rtol=TF_RTOL)
    np.testing.assert_allclose(out["c2"], expected_c2, rtol=TF_RTOL)
    assert report["global_norm_before"] == pytest.approx(math.sqrt(95), rel=1e-12)
    assert report["global_norm_after"] == pytest.approx(9, rel=1e-6)


def test_tf_clip_by_value_linspace(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    num1 = np.linspace(-4, 6, 6).astype(np.float32)
    src = write_checkpoint(ckpt("in"), {"p2": num1})
    clip_json(src, ckpt("out"), "--min", "-2", "--max", "2")
    out = read_checkpoint(ckpt("out"))["p2"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([-2, -2, 0, 2, 2, 2], dtype=np.float32))


def test_tf_numbers_through_a_subprocess(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    run_subprocess: Callable[..., Any],
) -> None:
    src = write_checkpoint(tmp_path / "in.safetensors", {"c1": C1, "c2": C2})
    result = run_subprocess("clip", "--global", "9", src, tmp_path / "out.h5", "--quiet")
    assert (result.code, result.stdout, result.stderr) == (0, "", "")
    np.testing.assert_allclose(
        read_checkpoint(tmp_path / "out.h5")["c2"],
        [[-1.846761, -3.693522], [1.846761, 3.693522]],
        rtol=TF_RTOL,
    )


# ------------------------------------------------------------------ 2. modes vs float64 reference
#
# Tolerance: the output may differ from the float64 reference by
#     REF_EPS_UNITS * eps(dtype) * |reference|  +  one subnormal step of the dtype,
# i.e. "a few units of the dtype's epsilon", relative. The budget: half an ulp for the final
# rounding to the dtype, up to about one ulp from the scale (clipcli may shrink TF's factor so
# that the *rounded* output's norm cannot exceed C), a few float32 roundings for 16-bit types
# computed in float32, and the absolute subnormal step for values that land below the normal
# range, where relative precision is lost by any rounding.
REF_EPS_UNITS = 3

DTYPES = ("float16", "bfloat16", "float32", "float64")
# bfloat16 only exists in safetensors; into npz/HDF5 it is a usage error (test_cli_errors.py).
FMT_DTYPES = [
    pytest.param(f, d, id=f"{f}-{d}")
    for f in FORMATS
    for d in DTYPES
    if d != "bfloat16" or f == "safetensors"
]
SHAPES = {"rank0": (), "rank1": (7,), "rank2": (3, 5), "rank3": (2, 3, 4)}
SCALES = {"rank0": 2.5, "rank1": 3.0, "rank2": 0.5, "rank3": 1.5}


def as_dtype(name: str) -> np.dtype[Any]:
    return BF16 if name == "bfloat16" else np.dtype(name)


def random_tensors(
    dtype: str, ranks: tuple[str, ...] = tuple(SHAPES), seed: int = 0
) -> dict[str, np.ndarray]:
    """One tensor per rank, standard normals times a per-tensor scale, cast to `dtype`."""
    rng = np.random.default_rng(seed)
    return {
        name: np.asarray(rng.standard_normal(SHAPES[name]) * SCALES[name]).astype(as_dtype(dtype))
        for name in ranks
    }


def wide(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float64)


def eps(dtype: np.dtype[Any]) -> float:
    return float(ml_dtypes.finfo(dtype).eps)  # type: ignore[no-untyped-call]


def assert_close_to_reference(
    name: str, out: np.ndarray, ref: np.ndarray, dtype: np.dtype[Any]
) -> None:
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    assert out.dtype == dtype, (name, out.dtype, out.shape)
    assert out.shape == ref.shape, (name, out.dtype, out.shape)
    error = np.abs(wide(out) - ref)
    allowed = REF_EPS_UNITS * float(info.eps) * np.abs(ref) + float(info.smallest_subnormal)
    worst = np.max(error / allowed) if error.size else 0.0
    assert np.all(error <= allowed), (
        f"{name} ({dtype}): error up to {worst:.3g} x the allowed "
        f"{REF_EPS_UNITS} eps; max relative error "
        f"{np.max(error / np.maximum(np.abs(ref), 1e-300)):.3g}, eps {float(info.eps):.3g}"
    )


def tf_norm_clip(
    x: np.ndarray, limit: float, norm64: Callable[[np.ndarray], float]
) -> tuple[np.ndarray, bool]:
    """TF's clip_by_norm in float64: t * C / max(||t||, C). Returns (reference, clipped?)."""
    n = norm64(x)
    return wide(x) * limit / max(n, limit), n > limit


def tf_axes_clip(x: np.ndarray, limit: float, axes: tuple[int, ...]) -> np.ndarray:
    """clip_by_norm with axes: every slice over `axes` gets its own t * C / max(||t||, C)."""
    w = wide(x)
    norms = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
    clipped: np.ndarray = w * limit / np.maximum(norms, limit)
    return clipped


def median_limit(values: Iterable[float]) -> float:
    """A limit that clips some tensors (or slices) and leaves others: between the middle two."""
    ordered = sorted(values)
    return float((ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2)


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_norm_matches_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
    assert_bit_identical: Callable[..., None],
) -> None:
    tensors = random_tensors(dtype)
    limit = median_limit(norm64(t) for t in tensors.values())
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--norm", repr(limit))
    out = read_checkpoint(ckpt("out"))
    clipped = 0
    for name, x in tensors.items():
        ref, was_clipped = tf_norm_clip(x, limit, norm64)
        if was_clipped:
            clipped += 1
            assert_close_to_reference(name, out[name], ref, x.dtype)
        else:
            assert_bit_identical(out[name], x, name)
    assert clipped == 2  # the limit sits between the middle two norms


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_average_norm_matches_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
    assert_bit_identical: Callable[..., None],
) -> None:
    # TF: the average norm is ||t|| / numel (not RMS); clip_by_norm(t, C * numel).
    tensors = random_tensors(dtype)
    limit = median_limit(norm64(t) / t.size for t in tensors.values())
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--average", repr(limit))
    out = read_checkpoint(ckpt("out"))
    clipped = 0
    for name, x in tensors.items():
        ref, was_clipped = tf_norm_clip(x, limit * x.size, norm64)
        if was_clipped:
            clipped += 1
            assert_close_to_reference(name, out[name], ref, x.dtype)
        else:
            assert_bit_identical(out[name], x, name)
    assert clipped == 2


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_global_norm_matches_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    tensors = random_tensors(dtype)
    g = math.sqrt(sum(norm64(t) ** 2 for t in tensors.values()))
    limit = g / 3
    src = write_checkpoint(ckpt("in"), tensors)
    report = clip_json(src, ckpt("out"), "--global", repr(limit))
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        ref = wide(x) * limit / max(g, limit)
        assert_close_to_reference(name, out[name], ref, x.dtype)
    assert report["global_norm_before"] == pytest.approx(g, rel=1e-12)


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_global_norm_with_use_norm_matches_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # With --use-norm N, TF scales by C / max(N, C) whatever the tensors' real norm is.
    tensors = random_tensors(dtype)
    limit, use_norm = 1.25, 4.0
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--global", repr(limit), "--use-norm", repr(use_norm))
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        ref = wide(x) * limit / max(use_norm, limit)
        assert_close_to_reference(name, out[name], ref, x.dtype)


AXES_CASES = [
    pytest.param("-1", ("rank1", "rank2", "rank3"), id="last"),
    pytest.param("0", ("rank1", "rank2", "rank3"), id="first"),
    pytest.param("0,-1", ("rank2", "rank3"), id="first-and-last"),
    pytest.param("1,2", ("rank3",), id="inner-pair"),
]


@pytest.mark.parametrize(("axes_arg", "ranks"), AXES_CASES)
@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_norm_with_axes_matches_reference(
    dtype: Any,
    axes_arg: Any,
    ranks: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    tensors = random_tensors(dtype, ranks)
    axes_of = {
        name: tuple(sorted(int(a) % x.ndim for a in axes_arg.split(",")))
        for name, x in tensors.items()
    }
    slice_norms = np.concatenate(
        [np.sqrt(np.sum(wide(x) ** 2, axis=axes_of[name])).ravel() for name, x in tensors.items()]
    )
    limit = median_limit(slice_norms)
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--norm", repr(limit), "--axes", axes_arg)
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        ref = tf_axes_clip(x, limit, axes_of[name])
        assert_close_to_reference(name, out[name], ref, x.dtype)
        # Slices within the limit keep their exact bytes.
        norms = np.sqrt(np.sum(wide(x) ** 2, axis=axes_of[name], keepdims=True))
        untouched = np.broadcast_to(norms <= limit, x.shape)
        assert out[name][untouched].tobytes() == x[untouched].tobytes(), name


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_clip_by_value_matches_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    tensors = random_tensors(dtype)
    low, high = -0.5, 0.75  # exactly representable in every float dtype
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--min", repr(low), "--max", repr(high))
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        ref = np.clip(wide(x), low, high)
        assert out[name].dtype == x.dtype
        assert out[name].shape == x.shape
        np.testing.assert_array_equal(wide(out[name]), ref, err_msg=name)
        if np.all(ref == wide(x)):
            assert_bit_identical(out[name], x, name)


@pytest.mark.parametrize(("fmt", "dtype"), FMT_DTYPES)
def test_value_mode_bounds_that_the_dtype_cannot_hold_never_overshoot(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # --value 0.1: 0.1 is not representable in binary floats; the clamp may round inwards,
    # never outwards, and stays within one ulp of 0.1.
    x = np.linspace(-1, 1, 21).astype(as_dtype(dtype))
    src = write_checkpoint(ckpt("in"), {"x": x})
    clip_json(src, ckpt("out"), "--value", "0.1")
    out = wide(read_checkpoint(ckpt("out"))["x"])
    assert np.all(np.abs(out) <= 0.1)
    assert np.max(out) == pytest.approx(0.1, rel=eps(x.dtype))
    assert np.min(out) == pytest.approx(-0.1, rel=eps(x.dtype))


# ------------------------------------------------------------------ 3. the output's norms


def large_tensors(dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Random tensors of rank 0-3 whose every element has |x| >= 1, so that the limits below
    clip every tensor and every slice."""
    rng = np.random.default_rng(seed)
    return {
        name: np.asarray(
            rng.choice([-1.0, 1.0], SHAPES[name]) * (1 + np.abs(rng.standard_normal(SHAPES[name])))
        ).astype(as_dtype(dtype))
        for name in SHAPES
    }


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_output_norm_equals_limit(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    """Per tensor (--norm), per numel (--average), over all (--global), per slice (--axes):
    the clipped output's norm is C within 1e-6 relative, and never above it (float64 math)."""
    tensors = large_tensors(dtype, seed=3)
    src = write_checkpoint(ckpt("in"), tensors)
    limit = 0.375  # below every tensor's norm (and every row's): all are clipped

    clip_json(src, ckpt("norm"), "--norm", repr(limit))
    for name, y in read_checkpoint(ckpt("norm")).items():
        assert norm64(y) <= limit, name
        assert norm64(y) == pytest.approx(limit, rel=1e-6), name

    average = limit / 100  # the average norm ||t|| / numel of every tensor is >= 0.2
    clip_json(src, ckpt("average"), "--average", repr(average))
    for name, y in read_checkpoint(ckpt("average")).items():
        assert norm64(y) <= average * y.size, name
        assert norm64(y) == pytest.approx(average * y.size, rel=1e-6), name

    report = clip_json(src, ckpt("global"), "--global", repr(limit))
    g = math.sqrt(sum(norm64(y) ** 2 for y in read_checkpoint(ckpt("global")).values()))
    assert g <= limit
    assert g == pytest.approx(limit, rel=1e-6)
    assert report["global_norm_after"] == pytest.approx(g, rel=1e-9)

    clip_json(src, ckpt("axes"), "--norm", repr(limit), "--axes", "-1", "--exclude", "rank0")
    for name, y in read_checkpoint(ckpt("axes")).items():
        if name != "rank0":
            rows = np.sqrt(np.sum(wide(y) ** 2, axis=-1))
            assert np.all(rows <= limit), name
            np.testing.assert_allclose(rows, limit, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(("fmt", "dtype"), [p for p in FMT_DTYPES if "float16" in str(p.id)])
def test_low_precision_output_norm_never_exceeds_limit(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    # float16/bfloat16: the rounded output cannot hit C exactly, but must never exceed it,
    # and must come within a few eps of it.
    tensors = large_tensors(dtype, seed=7)
    src = write_checkpoint(ckpt("in"), tensors)
    floor = 1 - 4 * eps(as_dtype(dtype))
    for limit in (0.1, 0.3, 0.7, 0.9):
        clip_json(src, ckpt(f"norm{limit}"), "--norm", repr(limit))
        for name, y in read_checkpoint(ckpt(f"norm{limit}")).items():
            assert limit * floor <= norm64(y) <= limit, (name, limit, norm64(y))
        clip_json(src, ckpt(f"global{limit}"), "--global", repr(limit))
        clipped = read_checkpoint(ckpt(f"global{limit}"))
        g = math.sqrt(sum(norm64(y) ** 2 for y in clipped.values()))
        assert limit * floor <= g <= limit, (limit, g)


# ------------------------------------------------------------------ 4. bit-identical pass-through


def passthrough_tensors(_fmt: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    tensors: dict[str, np.ndarray] = {
        # float tensors with -0.0 and subnormals, so that any arithmetic would show
        "small": np.array([-0.0, 1e-45, -3e-41, 0.25, -0.125], dtype=np.float32),
        "big.weight": (rng.standard_normal((4, 6)) * 10).astype(np.float32),
        "big.bias": (rng.standard_normal(6) * 10).astype(np.float64),
        "steps": np.array([1_000_000, -7, 2**40], dtype=np.int64),
        "ids": np.array([[3, 9], [100000, -5]], dtype=np.int32),
        "mask": np.array([True, False, True]),
        "bytes": np.array([0, 200, 255], dtype=np.uint8),
        "half": np.array([60000.0, -65504.0, 6e-8], dtype=np.float16),
    }
    return tensors


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["--value", "1"], id="value"),
        pytest.param(["--norm", "1"], id="norm"),
        pytest.param(["--average", "0.1"], id="average"),
        pytest.param(["--global", "1"], id="global"),
    ],
)
def test_untouched_tensors_are_bit_identical(
    fmt: str,
    mode: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    """Excluded ("big.bias"), not included ("half"), integer and bool tensors, and (except
    with --global, which scales every selected tensor alike) tensors within the limit
    ("small"): the same bytes come out."""
    tensors = passthrough_tensors(fmt)
    src = write_checkpoint(ckpt("in"), tensors)
    report = clip_json(
        src, ckpt("out"), *mode, "--include", "big.*", "--include", "small",
        "--include", "steps", "--include", "ids", "--include", "mask", "--include", "bytes",
        "--exclude", "*.bias",
    )  # fmt: skip
    out = read_checkpoint(ckpt("out"))
    assert set(out) == set(tensors)
    clipped = {"big.weight", "small"} if mode[0] == "--global" else {"big.weight"}
    for name, x in tensors.items():
        if name in clipped:
            assert out[name].tobytes() != x.tobytes(), name
        else:
            assert_bit_identical(out[name], x, name)
    changed = {row["name"]: row["changed"] for row in report["tensors"]}
    assert changed == {name: name in clipped for name in tensors}


def test_integer_tensors_stay_out_of_the_global_norm(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    w = np.array([3.0, 4.0], dtype=np.float32)
    counts = np.array([10**6, 10**6], dtype=np.int64)
    src = write_checkpoint(ckpt("in"), {"w": w, "counts": counts})
    report = clip_json(src, ckpt("out"), "--global", "2.5")
    out = read_checkpoint(ckpt("out"))
    assert report["global_norm_before"] == pytest.approx(5.0, rel=1e-12)
    np.testing.assert_allclose(out["w"], [1.5, 2.0], rtol=1e-6)
    assert_bit_identical(out["counts"], counts, "counts")


def test_global_within_limit_changes_nothing(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    tensors = random_tensors("float32")
    src = write_checkpoint(ckpt("in"), tensors)
    report = clip_json(src, ckpt("out"), "--global", "1e6")
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        assert_bit_identical(out[name], x, name)
    assert report["global_norm_after"] == report["global_norm_before"]
    assert not any(row["changed"] for row in report["tensors"])


def test_zero_tensor_is_unchanged(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    zeros = np.array([0.0, -0.0, 0.0], dtype=np.float32)
    src = write_checkpoint(ckpt("in"), {"z": zeros, "w": np.array([30.0, 40.0], np.float32)})
    clip_json(src, ckpt("out"), "--global", "1")
    assert_bit_identical(read_checkpoint(ckpt("out"))["z"], zeros, "z")


def test_infinite_limit_changes_nothing(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    tensors = random_tensors("float64")
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--norm", "inf")
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        assert_bit_identical(out[name], x, name)


def test_skip_nonfinite_leaves_the_nan_tensor_and_clips_the_rest(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    bad = np.array([1.0, np.nan, 5.0, -np.inf], dtype=np.float32)
    good = np.array([30.0, 40.0], dtype=np.float32)
    src = write_checkpoint(ckpt("in"), {"bad": bad, "good": good})
    report = clip_json(src, ckpt("out"), "--global", "5", "--skip-nonfinite")
    out = read_checkpoint(ckpt("out"))
    assert_bit_identical(out["bad"], bad, "bad")
    np.testing.assert_allclose(out["good"], [3.0, 4.0], rtol=1e-6)
    # The skipped tensor stays out of the global norm, and the report says it was skipped.
    assert report["global_norm_before"] == pytest.approx(50.0, rel=1e-12)
    row = next(r for r in report["tensors"] if r["name"] == "bad")
    assert row["changed"] is False
    assert "non-finite" in json.dumps(row)


@pytest.mark.parametrize(
    "mode",
    [
        ["--norm", "1"],
        ["--global", "1"],
        ["--average", "0.5"],
        ["--norm", "1", "--axes", "1"],
        ["--norm", "1", "--axes", "0,1"],
    ],
    ids=lambda m: " ".join(m),
)
def test_huge_float64_tensor_whose_norm_overflows_is_still_clipped(
    mode: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    # ||[1.7e308, 1.7e308]|| = 2.4e308 does not fit a float64, but the input is finite:
    # DESIGN.md says no finite input overflows, so it is clipped like any other.
    x = np.array([[1.7e308, 1.7e308]], dtype=np.float64)
    src = write_checkpoint(ckpt("in"), {"x": x})
    clip_json(src, ckpt("out"), *mode)
    out = read_checkpoint(ckpt("out"))["x"]
    np.testing.assert_allclose(out, [[0.5**0.5] * 2], rtol=1e-9)
    assert norm64(out) <= 1.0


# ------------------------------------------------------------------ 5. metadata and structure


def test_safetensors_metadata_survives(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_metadata: Callable[[Path], dict[str, str]],
    clip_json: Any,
) -> None:
    metadata = {"format": "pt", "note": "clipped by nobody yet", "unicode": "héllo ✓"}
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": C1}, metadata)
    for mode in (["--global", "1"], ["--norm", "100"]):
        out = tmp_path / f"out{mode[0]}.safetensors"
        clip_json(src, out, *mode)
        assert read_metadata(out) == metadata


def test_safetensors_without_metadata_gets_none(
    tmp_path: Path, write_checkpoint: Callable[..., Path], clip_json: Any
) -> None:
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": C1})
    out = tmp_path / "out.safetensors"
    clip_json(src, out, "--global", "1")
    (length,) = struct.unpack("<Q", out.read_bytes()[:8])
    header = json.loads(out.read_bytes()[8 : 8 + length])
    assert "__metadata__" not in header


def test_bfloat16_safetensors_roundtrip(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
    assert_bit_identical: Callable[..., None],
) -> None:
    w = np.array([[3.0, 4.0], [0.5, -0.25]], dtype=BF16)
    keep = np.array([0.125, -0.0], dtype=BF16)
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": w, "keep": keep}, {"a": "b"})
    clip_json(src, tmp_path / "out.safetensors", "--norm", "1", "--include", "w")
    out = read_checkpoint(tmp_path / "out.safetensors")
    assert out["w"].dtype == BF16
    assert norm64(out["w"]) <= 1.0
    assert_bit_identical(out["keep"], keep, "keep")


def make_keras_like_h5(path: Path) -> dict[str, np.ndarray]:
    """A legacy-Keras-shaped file: nested groups, attributes on the root, on groups and on
    datasets (strings, numbers, arrays of byte strings), and a compressed chunked dataset."""
    kernel = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    bias = np.array([10.0, -20.0, 30.0, 0.5], dtype=np.float32)
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = "2.15.0"
        f.attrs["backend"] = "tensorflow"
        weights = f.create_group("model_weights")
        weights.attrs["layer_names"] = np.array([b"dense"])
        dense = weights.create_group("dense/dense")
        weights["dense"].attrs["weight_names"] = np.array([b"dense/kernel:0", b"dense/bias:0"])
        k = dense.create_dataset("kernel:0", data=kernel, chunks=(3, 2), compression="gzip")
        k.attrs["initializer"] = "glorot_uniform"
        k.attrs["fan"] = np.int64(7)
        dense.create_dataset("bias:0", data=bias).attrs["trainable"] = np.bool_(True)
    return {"model_weights/dense/dense/kernel:0": kernel, "model_weights/dense/dense/bias:0": bias}


def all_attributes(path: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    with h5py.File(path, "r") as f:
        found["/"] = dict(f.attrs.items())
        f.visititems(lambda name, obj: found.__setitem__(name, dict(obj.attrs.items())))
    return found


def test_hdf5_attributes_on_groups_and_datasets_survive(
    tmp_path: Path,
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    src = tmp_path / "in.h5"
    tensors = make_keras_like_h5(src)
    out = tmp_path / "out.h5"
    clip_json(src, out, "--global", "5")
    before, after = all_attributes(src), all_attributes(out)
    assert list(after) == list(before)  # same groups and datasets, same order
    for where, attrs in before.items():
        assert set(after[where]) == set(attrs), where
        for key, value in attrs.items():
            copied = after[where][key]
            assert np.asarray(copied).dtype == np.asarray(value).dtype, (where, key)
            np.testing.assert_array_equal(copied, value, err_msg=f"{where} {key}")
    out_tensors = read_checkpoint(out)
    assert set(out_tensors) == set(tensors)
    g = math.sqrt(sum(norm64(y) ** 2 for y in out_tensors.values()))
    assert g == pytest.approx(5, rel=1e-6)
    assert g <= 5


def test_npz_compressed_input_gives_compressed_output(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    tensors = {"w": np.zeros((64, 64), np.float32) + 1, "b": np.arange(100, dtype=np.int64)}
    src = write_checkpoint(tmp_path / "in.npz", tensors, compressed=True)
    out = tmp_path / "out.npz"
    clip_json(src, out, "--global", "1")
    with zipfile.ZipFile(out) as archive:
        kinds = {info.filename: info.compress_type for info in archive.infolist()}
    assert kinds == {"w.npy": zipfile.ZIP_DEFLATED, "b.npy": zipfile.ZIP_DEFLATED}
    assert set(read_checkpoint(out)) == {"w", "b"}


def test_nested_names_survive_every_format(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    tensors = {
        "model/layers.0/attn/q_proj.weight": np.full((2, 2), 3.0, np.float32),
        "model/layers.0/attn/k_proj.weight": np.full((2, 2), 0.1, np.float32),
        "model/embed:0": np.arange(4, dtype=np.int32),
    }
    src = write_checkpoint(ckpt("in"), tensors)
    clip_json(src, ckpt("out"), "--norm", "1")
    out = read_checkpoint(ckpt("out"))
    assert set(out) == set(tensors)
    np.testing.assert_allclose(out["model/layers.0/attn/q_proj.weight"], 0.5, rtol=1e-6)
    assert_bit_identical(
        out["model/layers.0/attn/k_proj.weight"], tensors["model/layers.0/attn/k_proj.weight"]
    )


@pytest.mark.parametrize("out_fmt", FORMATS)
def test_clip_converts_between_formats(
    out_fmt: Any,
    tmp_path: Path,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    tensors = {"c1": C1, "c2": C2, "step": np.array(12, dtype=np.int64)}
    src = write_checkpoint(ckpt("in"), tensors)
    out = tmp_path / f"converted{EXT[out_fmt]}"
    clip_json(src, out, "--global", "9")
    got = read_checkpoint(out)
    assert set(got) == set(tensors)
    assert got["c1"].dtype == np.float32
    assert got["step"].shape == ()
    np.testing.assert_allclose(got["c2"], [[-1.846761, -3.693522], [1.846761, 3.693522]], rtol=1e-6)
    assert int(got["step"]) == 12


# ------------------------------------------------------------------ reports, --dry-run, --quiet


def test_clip_json_report(
    ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path], clip_json: Any
) -> None:
    src = write_checkpoint(ckpt("in"), {"c1": C1, "c2": C2, "n": np.arange(3, dtype=np.int32)})
    report = clip_json(src, ckpt("out"), "--global", "9")
    assert {"mode", "limit", "global_norm_before", "global_norm_after", "tensors"} <= set(report)
    assert report["mode"] == "global"
    assert report["limit"] == 9
    assert report["global_norm_before"] == pytest.approx(math.sqrt(95), rel=1e-12)
    assert report["global_norm_after"] == pytest.approx(9, rel=1e-6)
    rows = {row["name"]: row for row in report["tensors"]}
    assert set(rows) == {"c1", "c2", "n"}
    for row in rows.values():
        assert {"name", "norm_before", "norm_after", "scale", "changed"} <= set(row)
    assert rows["c1"]["norm_before"] == pytest.approx(math.sqrt(55), rel=1e-12)
    assert rows["c2"]["norm_before"] == pytest.approx(math.sqrt(40), rel=1e-12)
    assert rows["c1"]["scale"] == pytest.approx(9 / math.sqrt(95), rel=1e-6)
    assert rows["c1"]["norm_after"] == pytest.approx(math.sqrt(55) * 9 / math.sqrt(95), rel=1e-6)
    assert rows["c1"]["changed"] is True
    assert rows["c2"]["changed"] is True
    assert rows["n"]["changed"] is False
    assert rows["n"]["scale"] is None


@pytest.mark.parametrize("report_format", ["table", "json", "csv"])
def test_dry_run_writes_nothing(
    report_format: Any,
    tmp_path: Path,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    cli: Callable[..., Any],
    listing: Callable[[Path], list[str]],
) -> None:
    src = write_checkpoint(ckpt("in"), {"c1": C1, "c2": C2})
    before = listing(tmp_path)
    result = cli("clip", "--global", "9", "--dry-run", "--format", report_format, src, ckpt("out"))
    assert result.code == 0, result.stderr
    assert listing(tmp_path) == before
    assert "c1" in result.stdout
    assert "c2" in result.stdout
    if report_format == "json":
        report = result.json()
        assert report["global_norm_after"] == pytest.approx(9, rel=1e-6)
        assert all(row["changed"] for row in report["tensors"])


def test_quiet_prints_nothing_and_writes(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Callable[..., Any],
) -> None:
    src = write_checkpoint(ckpt("in"), {"c1": C1, "c2": C2})
    result = cli("clip", "--global", "9", "--quiet", src, ckpt("out"))
    assert (result.code, result.stdout, result.stderr) == (0, "", "")
    np.testing.assert_allclose(read_checkpoint(ckpt("out"))["c2"][1], [1.846761, 3.693522], 1e-6)


def test_table_report_names_every_tensor(
    ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path], cli: Callable[..., Any]
) -> None:
    names = {"c1": C1, "encoder.layer_11.attention.output.dense.weight": C2}
    src = write_checkpoint(ckpt("in"), names)
    result = cli("clip", "--global", "9", src, ckpt("out"))
    assert result.code == 0, result.stderr
    for name in names:
        assert name in result.stdout


def test_main_entry_point_clips(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    run_main: Callable[..., Any],
) -> None:
    src = write_checkpoint(ckpt("in"), {"t": np.array([[1, 2, 3, 4, 5]], dtype=np.float32)})
    result = run_main("clip", "--norm", "2.0", src, ckpt("out"), "--format", "json")
    assert result.code == 0
    assert result.stderr == ""
    assert result.json()["tensors"][0]["changed"] is True
    np.testing.assert_allclose(
        read_checkpoint(ckpt("out"))["t"],
        [[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]],
        rtol=TF_RTOL,
    )


# ------------------------------------------------------------------ more dtypes and layouts


def test_value_mode_keeps_nan_and_clamps_infinities(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # DESIGN.md: in value mode NaN stays NaN and +-Inf is clamped; nothing is refused.
    x = np.array([np.nan, np.inf, -np.inf, 5.0, -5.0, 0.5], np.float32)
    src = write_checkpoint(ckpt("in"), {"x": x})
    clip_json(src, ckpt("out"), "--value", "2")
    out = read_checkpoint(ckpt("out"))["x"]
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], np.array([2, -2, 2, -2, 0.5], np.float32))


def test_value_mode_on_every_float16_matches_np_clip_bit_for_bit(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # float16 is clamped through a lookup table (numpy's float16 compare is 15x slower):
    # all 65,536 values, NaN payloads and signed zeros included, come out as np.clip has it.
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    src = write_checkpoint(ckpt("in"), {"x": x})
    high = 2.0**-17  # a float16 subnormal, so np.clip gets the very bound clipcli uses
    clip_json(src, ckpt("out"), "--min", "-2.5", "--max", repr(high))
    with np.errstate(invalid="ignore"):  # np.clip on signalling NaNs
        expected = np.clip(x, np.float16(-2.5), np.float16(high))
    out = read_checkpoint(ckpt("out"))["x"]
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        (["--min", "0"], [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]),
        (["--max", "1"], [-2.0, -1.0, 0.0, 1.0, 1.0, 1.0]),
        (["--min", "-1.5", "--max", "1.5"], [-1.5, -1.0, 0.0, 1.0, 1.5, 1.5]),
    ],
    ids=["min-only", "max-only", "both"],
)
def test_value_mode_one_sided_bounds(
    bounds: Any,
    expected: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    x = np.array([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0], np.float64)
    src = write_checkpoint(ckpt("in"), {"x": x})
    clip_json(src, ckpt("out"), *bounds)
    np.testing.assert_array_equal(read_checkpoint(ckpt("out"))["x"], expected)


def test_use_norm_not_above_the_limit_changes_nothing(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    # The tensors' real global norm is sqrt(95) > 9, but --use-norm says 8 <= 9: no change.
    src = write_checkpoint(ckpt("in"), {"c1": C1, "c2": C2})
    clip_json(src, ckpt("out"), "--global", "9", "--use-norm", "8")
    out = read_checkpoint(ckpt("out"))
    assert_bit_identical(out["c1"], C1, "c1")
    assert_bit_identical(out["c2"], C2, "c2")


@pytest.mark.parametrize(
    "dtype",
    [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16],
    ids=["fp8-e4m3fn", "fp8-e5m2", "bf16"],
)
def test_safetensors_8_and_16_bit_floats_are_clipped(
    tmp_path: Path,
    dtype: Any,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    x = np.array([[3.0, -4.0], [12.0, 0.5]], dtype=dtype)
    src = write_checkpoint(tmp_path / "in.safetensors", {"x": x})
    for mode, limit in (("--norm", 2.0), ("--global", 2.0), ("--average", 0.5)):
        out_path = tmp_path / f"out{mode}.safetensors"
        clip_json(src, out_path, mode, repr(limit))
        y = read_checkpoint(out_path)["x"]
        assert y.dtype == x.dtype
        assert y.shape == x.shape
        bound = limit * (x.size if mode == "--average" else 1)
        assert norm64(y) <= bound
        assert norm64(y) >= bound * 0.75  # coarse dtypes: within a few of their eps
    clip_json(src, tmp_path / "v.safetensors", "--value", "3.5")
    y = read_checkpoint(tmp_path / "v.safetensors")["x"].astype(np.float64)
    assert np.max(np.abs(y)) <= 3.5
    assert np.min(y) < -3


def test_complex_tensors_use_the_modulus(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # DESIGN.md: complex tensors are handled by the norm modes with |z|^2.
    z = np.array([3 + 4j, 0 - 12j], dtype=np.complex64)  # ||z|| = 13
    src = write_checkpoint(ckpt("in"), {"z": z})
    report = clip_json(src, ckpt("out"), "--norm", "6.5")
    assert report["tensors"][0]["norm_before"] == pytest.approx(13.0, rel=1e-12)
    out = read_checkpoint(ckpt("out"))["z"]
    assert out.dtype == np.complex64
    np.testing.assert_allclose(out, z / 2, rtol=1e-6)


@pytest.mark.parametrize("ext", [".npz", ".h5"])  # safetensors is little-endian by definition
def test_big_endian_tensors(
    tmp_path: Path,
    ext: Any,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # npz and HDF5 can store big-endian data; the values, not the bytes, are what count.
    big = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=">f4")
    keep = np.array([1e-3, -2e-3], dtype=">f8")
    src = write_checkpoint(tmp_path / f"in{ext}", {"big": big, "keep": keep})
    report = clip_json(src, tmp_path / f"out{ext}", "--norm", "1")
    rows = {r["name"]: r for r in report["tensors"]}
    assert rows["big"]["norm_before"] == 5.0
    out = read_checkpoint(tmp_path / f"out{ext}")
    assert out["big"].dtype.name == "float32"
    assert out["keep"].dtype.name == "float64"
    np.testing.assert_allclose(out["big"], [[0.6, 0.8], [0.0, 0.0]], rtol=1e-6)
    assert out["keep"].astype("<f8").tobytes() == keep.astype("<f8").tobytes()


def test_npz_fortran_order(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
) -> None:
    # np.savez keeps Fortran order in the .npy header; the data must be read in that order.
    x = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert x.flags.f_contiguous
    assert not x.flags.c_contiguous
    src = write_checkpoint(tmp_path / "in.npz", {"x": x})
    clip_json(src, tmp_path / "out.npz", "--norm", "1", "--axes", "1")
    out = read_checkpoint(tmp_path / "out.npz")["x"]
    rows = np.arange(12, dtype=np.float64).reshape(3, 4)
    expected = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_unicode_names(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    cli: Callable[..., Any],
) -> None:
    tensors = {
        "ünïcødé.weight": np.array([3.0, 4.0], np.float32),
        "模型/层.bias": np.array([0.1], np.float32),
    }
    src = write_checkpoint(ckpt("in"), tensors)
    report = clip_json(src, ckpt("out"), "--norm", "1")
    assert {r["name"] for r in report["tensors"]} == set(tensors)
    out = read_checkpoint(ckpt("out"))
    assert set(out) == set(tensors)
    np.testing.assert_allclose(out["ünïcødé.weight"], [0.6, 0.8], rtol=1e-6)
    table = cli("norms", ckpt("out"))
    assert all(name in table.stdout for name in tensors)


# ------------------------------------------------------------------ selection decides refusals


def test_unselected_tensors_are_not_checked(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    assert_bit_identical: Callable[..., None],
) -> None:
    """Refusals concern selected tensors only: an excluded NaN tensor does not stop --global,
    and an excluded scalar does not stop --axes 0."""
    nan = np.array([np.nan, 1.0], np.float32)
    scalar = np.array(7.0, np.float64)
    w = np.array([[3.0, 4.0], [6.0, 8.0]], np.float32)
    src = write_checkpoint(ckpt("in"), {"nan": nan, "scalar": scalar, "w": w})
    clip_json(src, ckpt("global"), "--global", "5", "--exclude", "nan")
    out = read_checkpoint(ckpt("global"))
    assert_bit_identical(out["nan"], nan, "nan")
    clip_json(src, ckpt("axes"), "--norm", "5", "--axes", "0", "--include", "w")
    out = read_checkpoint(ckpt("axes"))
    assert_bit_identical(out["scalar"], scalar, "scalar")
    expected = np.array([[3, 4], [6, 8]]) * (5 / np.hypot([3, 4], [6, 8]))
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)


def test_checkpoint_without_tensors(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    cli: Callable[..., Any],
) -> None:
    src = write_checkpoint(ckpt("empty"), {})
    report = cli("norms", src, "--format", "json").json()
    assert report["global_norm"] == 0.0
    assert report["tensors"] == []
    clip_json(src, ckpt("out"), "--global", "1")
    assert read_checkpoint(ckpt("out")) == {}


# ------------------------------------------------------------------ tensors spanning many chunks


@pytest.mark.slow  # ~1 s per case
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_multi_chunk_tensors_match_reference(
    dtype: Any,
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    """Tensors of several MiB are read and written in chunks (2 MiB each in clipcli); chunk
    boundaries fall inside rows here. Every mode must still match the float64 reference."""
    rng = np.random.default_rng(21)
    big = rng.standard_normal((1031, 2053)).astype(dtype)  # ~4 or 8 MiB, odd sizes
    small = rng.standard_normal((3, 5)).astype(dtype)
    src = write_checkpoint(ckpt("in"), {"big": big, "small": small})
    n_big, n_small = norm64(big), norm64(small)

    clip_json(src, ckpt("norm"), "--norm", "100")
    out = read_checkpoint(ckpt("norm"))
    assert_close_to_reference("big", out["big"], wide(big) * 100 / n_big, big.dtype)

    g = math.hypot(n_big, n_small)
    clip_json(src, ckpt("global"), "--global", "10")
    out = read_checkpoint(ckpt("global"))
    assert_close_to_reference("big", out["big"], wide(big) * 10 / g, big.dtype)
    assert_close_to_reference("small", out["small"], wide(small) * 10 / g, big.dtype)

    for axis in (0, 1):
        limit = float(np.median(np.sqrt(np.sum(wide(big) ** 2, axis=axis))))
        clip_json(src, ckpt(f"axes{axis}"), "--norm", repr(limit), "--axes", str(axis))
        out = read_checkpoint(ckpt(f"axes{axis}"))
        ref = tf_axes_clip(big, limit, (axis,))
        assert_close_to_reference(f"big axis {axis}", out["big"], ref, big.dtype)


def test_multi_chunk_compressed_npz(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    clip_json: Any,
    norm64: Callable[[np.ndarray], float],
) -> None:
    rng = np.random.default_rng(22)
    big = rng.standard_normal((777, 3001)).astype(np.float32)
    src = write_checkpoint(tmp_path / "in.npz", {"big": big}, compressed=True)
    clip_json(src, tmp_path / "out.npz", "--global", "7")
    out = read_checkpoint(tmp_path / "out.npz")["big"]
    assert_close_to_reference("big", out, wide(big) * 7 / norm64(big), big.dtype)


def test_value_bounds_beyond_float16_range_leave_an_empty_float16_tensor_alone(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    run_main: Callable[..., Any],
    assert_bit_identical: Callable[..., None],
) -> None:
    # Found by test_properties.py: an empty float16 tensor has no value outside the range,
    # so nothing needs clamping, even though no float16 lies in [65520, 196560].
    tensors = {"a": np.array([], np.float16), "b": np.array(131040.0, np.float32)}
    src = write_checkpoint(ckpt("in"), tensors)
    result = run_main("clip", "--min", "65520", "--max", "196560", src, ckpt("out"), "-q")
    assert (result.code, result.stderr) == (0, "")
    out = read_checkpoint(ckpt("out"))
    for name, x in tensors.items():
        assert_bit_identical(out[name], x, name)
