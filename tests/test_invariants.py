"""Hypothesis invariants of clipping, run through main() on real files of every format.

Outputs are read back with the official libraries only (safetensors.numpy, numpy.load,
h5py), and limits are checked against exact sums of squares (fractions.Fraction of every
value), never against clipcli's own readers or norms."""

from __future__ import annotations

import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipcli.cli.entry import main

# Example counts come from the profile in conftest.py (ci: 40, long: 5000).
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTENSIONS = (".safetensors", ".npz", ".h5")

finite_tensors = st.dictionaries(
    keys=st.sampled_from(["a", "b", "c", "d"]),
    values=hnp.arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=6),
        elements={"allow_nan": False, "allow_infinity": False, "min_value": -1e4, "max_value": 1e4},
    ),
    min_size=1,
    max_size=4,
)
modes = st.sampled_from(["--global", "--norm", "--average", "--value"])
limits = st.floats(min_value=1e-3, max_value=1e3)


def save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    if path.suffix == ".npz":
        arrays: dict[str, Any] = dict(tensors)  # numpy types **kwds as bool | ArrayLike
        np.savez(path, **arrays)
    elif path.suffix == ".h5":
        import h5py

        with h5py.File(path, "w") as f:
            for name, array in tensors.items():
                f.create_dataset(name, data=array)
    else:
        from safetensors.numpy import save_file

        save_file({k: v.copy(order="C") for k, v in tensors.items()}, str(path))


def load(path: Path) -> dict[str, np.ndarray]:
    """Every tensor, read with the format's official library."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {name: loaded[name] for name in loaded.files}
    if path.suffix == ".h5":
        import h5py

        with h5py.File(path, "r") as f:
            return {name: np.asarray(f[name][()]) for name in f}
    from safetensors.numpy import load_file

    return load_file(str(path))


def squares(array: np.ndarray) -> Fraction:
    """The exact sum of squares of the values (float16/32/64 widen to float64 exactly)."""
    return sum((Fraction(float(x)) ** 2 for x in array.ravel()), Fraction(0))


def norm_at_most(squared: Fraction, limit: float) -> bool:
    """sqrt(squared) <= limit, decided exactly."""
    return squared <= Fraction(limit) ** 2


def clip(src: Path, out: Path, mode: str, limit: float) -> None:
    assert main(["clip", mode, repr(limit), "-q", "--force", str(src), str(out)]) == 0


@SETTINGS
@given(tensors=finite_tensors, mode=modes, limit=limits, ext=st.sampled_from(EXTENSIONS))
# Found by the exact check: the average limit C * numel must be the exact product (just
# below 1.0 here), not the float64 one (1.0).
@example(
    tensors={"c": np.array([1.0, 0.0, 0.0], np.float16)},
    mode="--average",
    limit=1 / 3,
    ext=".safetensors",
)
def test_limit_holds_idempotent_and_untouched_unchanged(
    tensors: dict[str, np.ndarray], mode: str, limit: float, ext: str
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        src, once, twice = (Path(directory) / f"{n}{ext}" for n in ("src", "once", "twice"))
        save(src, tensors)
        clip(src, once, mode, limit)
        clip(once, twice, mode, limit)
        first, second = load(once), load(twice)
        # clip(clip(x)) == clip(x), bit for bit.
        assert all(first[k].tobytes() == second[k].tobytes() for k in tensors)
        for name, array in tensors.items():
            out = first[name]
            assert out.dtype == array.dtype
            assert out.shape == array.shape
            if mode == "--norm":
                assert norm_at_most(squares(out), limit)
                if norm_at_most(squares(array), limit):
                    assert out.tobytes() == array.tobytes()
            elif mode == "--average":
                # ||out|| <= C * numel exactly (clipcli rounds the float product down:
                # at [1, 0, 0] and C = fl(1/3) the float product is 1.0 while the exact
                # C * 3 is just below it, so the tensor must be scaled).
                bound = Fraction(limit) * max(array.size, 1)
                assert squares(out) <= bound**2
            elif mode == "--value":
                assert np.all(np.abs(out.astype(np.float64)) <= limit)
                if np.all(np.abs(array.astype(np.float64)) <= limit):
                    assert out.tobytes() == array.tobytes()
        if mode == "--global":
            assert norm_at_most(sum((squares(a) for a in first.values()), Fraction(0)), limit)
            if norm_at_most(sum((squares(a) for a in tensors.values()), Fraction(0)), limit):
                assert all(first[k].tobytes() == tensors[k].tobytes() for k in tensors)


@SETTINGS
@given(tensors=finite_tensors, ext=st.sampled_from(EXTENSIONS), out_ext=st.sampled_from(EXTENSIONS))
def test_write_then_read_is_identity(
    tensors: dict[str, np.ndarray], ext: str, out_ext: str
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        src, out = Path(directory) / f"src{ext}", Path(directory) / f"out{out_ext}"
        save(src, tensors)
        assert main(["convert", "-q", str(src), str(out)]) == 0
        result = load(out)
        assert sorted(result) == sorted(tensors)
        for name, array in tensors.items():
            assert result[name].dtype == array.dtype
            assert result[name].shape == array.shape
            assert result[name].tobytes() == array.tobytes()
