"""Hypothesis invariants of clipping, run through main() on real files of every format."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipcli.cli import main
from clipcli.io import open_reader

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
        np.savez(path, **tensors)
    elif path.suffix == ".h5":
        import h5py

        with h5py.File(path, "w") as f:
            for name, array in tensors.items():
                f.create_dataset(name, data=array)
    else:
        from safetensors.numpy import save_file

        save_file({k: v.copy(order="C") for k, v in tensors.items()}, str(path))


def load(path: Path) -> dict[str, np.ndarray]:
    with open_reader(path) as reader:
        return {info.name: reader.read(info) for info in reader.infos}


def norm64(array: np.ndarray) -> float:
    return float(np.linalg.norm(array.astype(np.float64).ravel()))


def clip(src: Path, out: Path, mode: str, limit: float) -> None:
    assert main(["clip", mode, repr(limit), "-q", "--force", str(src), str(out)]) == 0


@SETTINGS
@given(tensors=finite_tensors, mode=modes, limit=limits, ext=st.sampled_from(EXTENSIONS))
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
            assert out.dtype == array.dtype and out.shape == array.shape
            if mode == "--norm":
                assert norm64(out) <= limit
                if norm64(array) <= limit:
                    assert out.tobytes() == array.tobytes()
            elif mode == "--average":
                assert norm64(out) <= limit * max(array.size, 1)
            elif mode == "--value":
                assert np.all(np.abs(out.astype(np.float64)) <= limit)
                if np.all(np.abs(array.astype(np.float64)) <= limit):
                    assert out.tobytes() == array.tobytes()
        if mode == "--global":
            before = math.sqrt(sum(norm64(a) ** 2 for a in tensors.values()))
            after = math.sqrt(sum(norm64(a) ** 2 for a in first.values()))
            assert after <= limit * (1 + 1e-15)
            if before <= limit:
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
