"""Properties of `clipcli clip` on random checkpoints (hypothesis), in process through
`clipcli.cli.entry.main` so that each example costs milliseconds:

- the clipped norm never exceeds C (per tensor, per numel, global);
- clipping is idempotent: clip(clip(x)) == clip(x), bit for bit;
- tensors already within the limit come out bit-identical;
- write-then-read identity through `clip` with an infinite limit, for every format.

Inputs: float16/float32/float64 arrays of rank 0-3 (empty ones included) with finite values,
subnormals allowed; sometimes an integer or bool tensor alongside. Files are written and
read with the official libraries (conftest.py).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clipcli.cli.entry import main

EXTS = [".safetensors", ".npz", ".h5"]
FLOAT_DTYPES: list[np.dtype[Any]] = [
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
]
OTHER_DTYPES: list[np.dtype[Any]] = [
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.bool_),
]

PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def float_arrays(dtype: np.dtype, min_dims: int = 0) -> st.SearchStrategy[np.ndarray]:
    elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False, allow_subnormal=True)
    shapes = hnp.array_shapes(min_dims=min_dims, max_dims=3, min_side=0, max_side=5)
    return hnp.arrays(dtype, shapes, elements=elements)


def other_arrays(dtype: np.dtype) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4))


NAMES = st.from_regex(r"[a-z][a-z0-9_.]{0,7}", fullmatch=True)


def checkpoints(
    min_dims: int = 0, with_others: bool = True
) -> st.SearchStrategy[dict[str, np.ndarray]]:
    """1-3 floating-point tensors, plus (maybe) one integer or bool tensor."""
    floats = st.dictionaries(
        NAMES,
        st.sampled_from(FLOAT_DTYPES).flatmap(lambda d: float_arrays(d, min_dims)),
        min_size=1,
        max_size=3,
    )
    if not with_others:
        return floats
    others = st.dictionaries(
        st.from_regex(r"int_[a-z0-9]{1,4}", fullmatch=True),
        st.sampled_from(OTHER_DTYPES).flatmap(other_arrays),
        max_size=1,
    )
    return st.tuples(floats, others).map(lambda pair: {**pair[0], **pair[1]})


def is_float(x: np.ndarray) -> bool:
    return x.dtype.kind == "f"


def run_clip(src: Path, out: Path, *mode: str) -> None:
    code = main(["clip", *mode, str(src), str(out), "--quiet", "--no-fsync"])
    assert code == 0, f"clip {' '.join(mode)} exited {code}"


def global_norm64(tensors: dict[str, np.ndarray], norm64: Callable[[np.ndarray], float]) -> float:
    norms = [norm64(x) for x in tensors.values() if is_float(x)]
    if any(math.isinf(n) for n in norms):
        return math.inf
    peak = max(norms, default=0.0)
    if peak == 0.0:
        return 0.0
    return peak * math.sqrt(sum((n / peak) ** 2 for n in norms))


def limit_from(norm: float, ratio: float) -> float:
    """A positive, finite limit `ratio` times `norm` (some fixed value when norm is 0 or
    does not fit a float64)."""
    if norm == 0.0 or not math.isfinite(norm):
        return 1.0
    return min(max(norm * ratio, 1e-300), 1e300)


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("ext", EXTS)
@PROPERTY
@given(
    data=st.data(),
    mode=st.sampled_from(["--norm", "--average", "--global", "--axes"]),
    ratio=st.floats(1e-3, 2.0),
)
def test_clipped_norm_never_exceeds_the_limit(
    ext: str,
    data: st.DataObject,
    mode: str,
    ratio: float,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    """Per tensor (--norm), per numel (--average), over all (--global), per last-axis slice
    (--norm --axes -1): the output's norm, computed in float64, is at most C."""
    tensors = data.draw(checkpoints(min_dims=1 if mode == "--axes" else 0), label="tensors")
    floats = {k: v for k, v in tensors.items() if is_float(v)}
    if mode == "--global":
        limit = limit_from(global_norm64(floats, norm64), ratio)
        args = [mode, repr(limit)]
    elif mode == "--average":
        limit = limit_from(max(norm64(x) / max(x.size, 1) for x in floats.values()), ratio)
        args = [mode, repr(limit)]
    else:
        limit = limit_from(max(norm64(x) for x in floats.values()), ratio)
        args = ["--norm", repr(limit)] + (["--axes", "-1"] if mode == "--axes" else [])
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / f"in{ext}", tensors)
        run_clip(src, Path(tmp) / f"out{ext}", *args)
        out = read_checkpoint(Path(tmp) / f"out{ext}")
    assert set(out) == set(tensors)
    for name, x in out.items():
        assert x.dtype == tensors[name].dtype, name
        assert x.shape == tensors[name].shape, name
    if mode == "--global":
        assert global_norm64({k: out[k] for k in floats}, norm64) <= limit
    for name in floats:
        y = out[name]
        if mode == "--norm":
            assert norm64(y) <= limit, (name, norm64(y), limit)
        elif mode == "--average":
            assert norm64(y) <= limit * y.size, (name, norm64(y), limit * y.size)
        elif mode == "--axes":
            rows = y.reshape(-1, y.shape[-1]) if y.size else np.zeros((0, 1))
            worst = max((norm64(row) for row in rows), default=0.0)
            assert worst <= limit, (name, worst, limit)


MODES = ["--value", "--norm", "--average", "--global", "--axes"]


@pytest.mark.slow  # ~1 s per format
@pytest.mark.parametrize("ext", EXTS)
@PROPERTY
@given(data=st.data(), mode=st.sampled_from(MODES), ratio=st.floats(1e-3, 2.0))
def test_clipping_is_idempotent(
    ext: str,
    data: st.DataObject,
    mode: str,
    ratio: float,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    """clip(clip(x)) == clip(x) bit for bit: the first output is within the limit, so the
    second run leaves it alone."""
    tensors = data.draw(checkpoints(min_dims=1 if mode == "--axes" else 0), label="tensors")
    floats = [x for x in tensors.values() if is_float(x)]
    if mode == "--value":
        peak = max(
            (float(np.max(np.abs(x.astype(np.float64)))) for x in floats if x.size), default=1
        )
        args = ["--value", repr(limit_from(peak, ratio))]
    elif mode == "--axes":
        args = ["--norm", repr(limit_from(max(norm64(x) for x in floats), ratio)), "--axes", "-1"]
    elif mode == "--average":
        args = [mode, repr(limit_from(max(norm64(x) / max(x.size, 1) for x in floats), ratio))]
    elif mode == "--global":
        args = [mode, repr(limit_from(global_norm64(tensors, norm64), ratio))]
    else:
        args = [mode, repr(limit_from(max(norm64(x) for x in floats), ratio))]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / f"in{ext}", tensors)
        once, twice = Path(tmp) / f"once{ext}", Path(tmp) / f"twice{ext}"
        run_clip(src, once, *args)
        run_clip(once, twice, *args)
        first, second = read_checkpoint(once), read_checkpoint(twice)
    assert set(first) == set(second) == set(tensors)
    for name in tensors:
        assert first[name].dtype == second[name].dtype
        assert first[name].tobytes() == second[name].tobytes(), name


@pytest.mark.parametrize("ext", EXTS)
@PROPERTY
@given(
    tensors=checkpoints(),
    mode=st.sampled_from(["--value", "--norm", "--average", "--global"]),
    headroom=st.floats(1e-6, 10.0),
)
def test_tensors_within_the_limit_are_unchanged(
    ext: str,
    tensors: dict[str, np.ndarray],
    mode: str,
    headroom: float,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    norm64: Callable[[np.ndarray], float],
    assert_bit_identical: Callable[..., None],
) -> None:
    floats = [x for x in tensors.values() if is_float(x)]
    grow = 1 + headroom
    if mode == "--value":
        wide = [x.astype(np.float64) for x in floats if x.size]
        low = min((float(w.min()) for w in wide), default=0.0)
        high = max((float(w.max()) for w in wide), default=0.0)
        args = [
            "--min",
            repr(low - abs(low) * headroom),
            "--max",
            repr(high + abs(high) * headroom),
        ]
    elif mode == "--global":
        args = [mode, repr(global_norm64(tensors, norm64) * grow or 1.0)]
    elif mode == "--average":
        args = [mode, repr(max(norm64(x) / max(x.size, 1) for x in floats) * grow or 1.0)]
    else:
        args = [mode, repr(max(norm64(x) for x in floats) * grow or 1.0)]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / f"in{ext}", tensors)
        run_clip(src, Path(tmp) / f"out{ext}", *args)
        out = read_checkpoint(Path(tmp) / f"out{ext}")
    assert set(out) == set(tensors)
    for name, x in tensors.items():
        assert_bit_identical(out[name], x, name)


@pytest.mark.parametrize("ext", EXTS)
@PROPERTY
@given(tensors=checkpoints())
def test_clip_with_an_infinite_limit_is_a_faithful_copy(
    ext: str,
    tensors: dict[str, np.ndarray],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    assert_bit_identical: Callable[..., None],
) -> None:
    """Write with the official library, pass through `clip --norm inf`, read with the
    official library: same names, dtypes, shapes and bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / f"in{ext}", tensors)
        run_clip(src, Path(tmp) / f"out{ext}", "--norm", "inf")
        out = read_checkpoint(Path(tmp) / f"out{ext}")
    assert set(out) == set(tensors)
    for name, x in tensors.items():
        assert_bit_identical(out[name], x, name)
