"""Issue 22 item 1: every writer writes the VALUES, in the byte order its format declares.

A big-endian source (a '>i8'/'>f2'/'>f4' npz member, a big-endian HDF5 dataset) once came
out of the PyTorch and GGUF writers byte-swapped (their files say little-endian), exit 0.
Each output is read back by a reader that shares no code with clipcli: numpy, h5py,
safetensors, gguf.GGUFReader, torch where it installs, and, for `.pt` without torch, the
standard library's pickle with stand-ins for torch's two rebuild functions.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from clipcli.cli.entry import main

VALUES = [1, -2, 3, 250, -7]
DTYPES = [">i8", ">i4", ">i2", ">f2", ">f4", ">f8"]
WRITERS = [".pt", ".bin", ".gguf", ".safetensors", ".npz", ".h5"]
LIMIT = 1.0  # the clip that changes every float tensor


def _source_arrays(dtypes: list[str]) -> dict[str, np.ndarray]:
    return {f"t_{np.dtype(d).name}": np.array(VALUES, dtype=d) for d in dtypes}


def _make_source(tmp_path: Path, kind: str, arrays: dict[str, np.ndarray]) -> Path:
    if kind == "npz":
        path = tmp_path / "big.npz"
        np.savez(path, **arrays)  # type: ignore[arg-type]
    else:
        path = tmp_path / "big.h5"
        with h5py.File(path, "w") as h5:
            for name, array in arrays.items():
                h5.create_dataset(name, data=array, dtype=array.dtype)
            assert all(h5[n].dtype.byteorder == ">" for n in arrays)  # really big-endian
    return path


class _Storage:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


_TORCH_DTYPES = {
    "FloatStorage": "<f4",
    "DoubleStorage": "<f8",
    "HalfStorage": "<f2",
    "LongStorage": "<i8",
    "IntStorage": "<i4",
    "ShortStorage": "<i2",
    "ComplexFloatStorage": "<c8",
}


def _torch_zip_reference(path: Path) -> dict[str, np.ndarray]:
    """A `.pt` zip read with zipfile, pickle and numpy alone (no torch, no clipcli):
    the pickle's globals resolve to stand-ins, its persistent ids to storage keys."""
    with zipfile.ZipFile(path) as archive:
        (root,) = {name.split("/")[0] for name in archive.namelist()}
        assert archive.read(f"{root}/byteorder") == b"little"

        def rebuild(storage: tuple[str, str], offset: int, size: Any, *_: Any) -> np.ndarray:
            dtype, key = storage
            data = np.frombuffer(archive.read(f"{root}/data/{key}"), dtype=dtype)
            return data[offset : offset + int(np.prod(size))].reshape(size)

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                    return rebuild
                if module == "torch" and name in _TORCH_DTYPES:
                    return _Storage(_TORCH_DTYPES[name])
                if (module, name) == ("collections", "OrderedDict"):
                    return dict
                raise AssertionError(f"unexpected global {module}.{name}")

            def persistent_load(self, pid: Any) -> Any:
                _, storage_type, key, _location, _numel = pid
                return (storage_type.dtype, key)

        loaded = Unpickler(archive.open(f"{root}/data.pkl")).load()
    return {name: np.array(value) for name, value in loaded.items()}


def _read_back(path: Path) -> dict[str, np.ndarray]:
    suffix = path.suffix
    if suffix in (".pt", ".bin"):
        out = _torch_zip_reference(path)
        try:
            torch = pytest.importorskip("torch")
        except pytest.skip.Exception:
            return out  # the stdlib reference above still checked it
        loaded = torch.load(path, weights_only=True)
        for name, tensor in loaded.items():
            np.testing.assert_array_equal(tensor.numpy(), out[name], err_msg=name)
        return out
    if suffix == ".gguf":
        import gguf

        return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    if suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(path)
    if suffix == ".npy":
        return {"only": np.load(path)}
    if suffix == ".npz":
        with np.load(path) as archive:
            return {k: archive[k] for k in archive.files}
    with h5py.File(path, "r") as h5:
        return {k: h5[k][()] for k in h5}


def _run(command: str, source: Path, out: Path) -> None:
    args = {
        "convert": ["convert", "-q"],
        "unchanged": ["clip", "-q", "--global", "1e9"],
        "changed": ["clip", "-q", "--global", str(LIMIT)],
    }[command]
    assert main([*args, str(source), str(out)]) == 0


@pytest.mark.parametrize("command", ["convert", "unchanged", "changed"])
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("kind", ["npz", "h5"])
def test_big_endian_tensors_are_written_as_their_values(
    tmp_path: Path, kind: str, writer: str, command: str
) -> None:
    arrays = _source_arrays(DTYPES)
    source = _make_source(tmp_path, kind, arrays)
    out = tmp_path / f"out{writer}"
    _run(command, source, out)
    got = _read_back(out)
    assert sorted(got) == sorted(arrays)
    floats = {n: a for n, a in arrays.items() if a.dtype.kind == "f"}
    global_norm = float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in floats.values())))
    for name, want in arrays.items():
        values = got[name]
        assert values.dtype.name == want.dtype.name, name  # the dtype, byte order aside
        if command == "changed" and name in floats:
            scaled = want.astype(np.float64) * (LIMIT / global_norm)
            np.testing.assert_allclose(values.astype(np.float64), scaled, rtol=2e-3, atol=1e-4)
        else:
            np.testing.assert_array_equal(values, want, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_big_endian_tensor_into_npy_keeps_its_values(tmp_path: Path, dtype: str) -> None:
    source = _make_source(tmp_path, "npz", {"only": np.array(VALUES, dtype=dtype)})
    out = tmp_path / "out.npy"
    _run("convert", source, out)
    np.testing.assert_array_equal(_read_back(out)["only"], np.array(VALUES, dtype=dtype))


@pytest.mark.parametrize("writer", [".pt", ".safetensors", ".npz", ".h5"])
def test_big_endian_complex_values_swap_each_part(tmp_path: Path, writer: str) -> None:
    want = np.array([1 + 2j, -3 - 250j, 7j], dtype=">c8")
    source = _make_source(tmp_path, "npz", {"z": want})
    out = tmp_path / f"out{writer}"
    _run("convert", source, out)
    np.testing.assert_array_equal(_read_back(out)["z"], want)
