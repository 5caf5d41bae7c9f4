"""Unallocated HDF5 tensors (issue 18 item 18): measured from their fill value, copied to
HDF5 unallocated, never read or made unless an output needs their elements.

A 3 MB file of 10,000 never-written datasets was refused by the expansion budget. Now an
unallocated tensor with a defined fill value is outside the expansion and chunk budgets at
opening; its statistics come from the one value (Reader.constant, in constant time), an
HDF5 OUT copied from it keeps it unallocated, and only making its elements (another output
format, or a clip that changes it) charges it to the expansion budget: exit 3 past it,
before OUT exists where every element must be written.

References: h5py reads every dataset; norms are exact (fractions.Fraction).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from safetensors import safe_open

from clipcli.formats.hdf5 import limits

Cli = Callable[..., Run]

FILLS: dict[str, tuple[str, tuple[int, ...], object, dict[str, object]]] = {
    "f32": ("<f4", (300, 7), 2.5, {}),
    "f32_chunked": ("<f4", (1000,), -1.25, {"chunks": (10,)}),
    "f64_big_endian": (">f8", (5, 5), 1e200, {}),
    "f16": ("<f2", (4096,), 65504.0, {}),
    "f16_subnormal": ("<f2", (64,), 6e-8, {}),
    "c64": ("<c8", (10,), 3 - 4j, {}),
    "i32": ("<i4", (6,), -7, {}),
    "bool": ("?", (9,), True, {}),
    "default_zero": ("<f4", (100,), None, {}),
    "scalar_shape_1": ("<f4", (1,), 1e-30, {}),
    "nan": ("<f4", (8,), float("nan"), {}),
}


def _fill_file(path: Path) -> None:
    with h5py.File(path, "w") as f:
        for name, (dtype, shape, fill, extra) in FILLS.items():
            f.create_dataset(name, shape=shape, dtype=dtype, fillvalue=fill, **extra)
        f["written"] = np.arange(5, dtype=np.float32)


def _sqrt(value: Fraction) -> float:
    """sqrt of an exact sum of squares that may be far beyond float64 (25 x 1e400)."""
    shift = max(0, (value.numerator.bit_length() - value.denominator.bit_length()) // 2 - 500)
    return math.sqrt(value / 4**shift) * 2.0**shift


def _exact(values: np.ndarray) -> tuple[float, float]:
    """(L2 norm, max |x|) of finite values, exactly; complex by |z|^2."""
    flat = values.reshape(-1)
    if flat.dtype.kind == "c":
        parts = [Fraction(float(z.real)) ** 2 + Fraction(float(z.imag)) ** 2 for z in flat]
        return _sqrt(sum(parts, Fraction(0))), float(np.max(np.abs(flat.astype(np.complex128))))
    wide = [Fraction(float(v)) for v in flat]
    return _sqrt(sum((v * v for v in wide), Fraction(0))), max(abs(float(v)) for v in wide)


def test_norms_of_unallocated_tensors_come_from_the_fill_value(
    clipcli: Cli, tmp_path: Path
) -> None:
    src = tmp_path / "fills.h5"
    _fill_file(src)
    run = clipcli("norms", "--format", "json", src)
    assert run.returncode == 0, run
    rows = {row["name"]: row for row in json.loads(run.stdout)["tensors"]}
    with h5py.File(src, "r") as f:
        for name in [*FILLS, "written"]:
            values = f[name][()]
            assert rows[name]["numel"] == values.size
            if name == "nan":
                assert rows[name]["nonfinite"] == values.size
                continue
            norm, top = _exact(values)
            assert rows[name]["norm"] == pytest.approx(norm, rel=1e-12, abs=0), name
            assert rows[name]["max_abs"] == top, name
            assert rows[name]["nonfinite"] == 0


def test_unchanged_unallocated_tensors_stay_unallocated_in_hdf5_out(
    clipcli: Cli, tmp_path: Path
) -> None:
    src, out = tmp_path / "fills.h5", tmp_path / "out.h5"
    _fill_file(src)
    run = clipcli("clip", "--skip-nonfinite", "--norm", "1e300", src, out)
    assert run.returncode == 0, run
    with h5py.File(src, "r") as f, h5py.File(out, "r") as g:
        for name in FILLS:
            assert g[name].id.get_storage_size() == 0, name
            assert g[name][()].tobytes() == f[name][()].tobytes(), name
        np.testing.assert_array_equal(g["written"][()], np.arange(5, dtype=np.float32))


def test_a_clipped_unallocated_tensor_is_made_and_holds_the_clipped_values(
    clipcli: Cli, tmp_path: Path
) -> None:
    """A changed constant tensor is written out (its elements made): the result is the
    same as for the same values stored, against h5py and exact norms."""
    src, out = tmp_path / "fills.h5", tmp_path / "out.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("f16", shape=(4096,), dtype="<f2", fillvalue=65504.0)
        f.create_dataset("f32", shape=(300, 7), dtype="<f4", fillvalue=2.5)
    run = clipcli("clip", "--norm", "3", "--format", "json", src, out)
    assert run.returncode == 0, run
    rows = {row["name"]: row for row in json.loads(run.stdout)["tensors"]}
    with h5py.File(out, "r") as g:
        for name in ("f16", "f32"):
            norm, _ = _exact(g[name][()])
            assert norm <= 3
            assert rows[name]["norm_after"] == pytest.approx(norm, rel=1e-12)
            assert len(np.unique(g[name][()])) == 1


def test_many_unallocated_datasets_measure_and_copy_without_expanding(
    clipcli: Cli, tmp_path: Path
) -> None:
    """The issue's file, scaled down: 300 unallocated 64 MiB datasets (19 GiB declared)
    in a file of ~120 KB, far over 200 x its size + 64 MiB."""
    src, out = tmp_path / "many.h5", tmp_path / "out.h5"
    with h5py.File(src, "w") as f:
        for index in range(300):
            f.create_dataset(f"d{index:03d}", shape=(1 << 24,), dtype="<f4", fillvalue=0.5)
    assert limits.expansion_budget(src.stat().st_size) < 300 * (64 << 20)
    run = clipcli("norms", "--format", "json", src)
    assert run.returncode == 0, run
    expected = math.sqrt(Fraction(300 * (1 << 24)) * Fraction(1, 4))
    assert json.loads(run.stdout)["global_norm"] == pytest.approx(expected, rel=1e-12)
    run = clipcli("clip", "--global", "1e9", src, out)
    assert run.returncode == 0, run
    assert out.stat().st_size < 2 * src.stat().st_size
    with h5py.File(out, "r") as g:
        assert all(g[name].id.get_storage_size() == 0 for name in g)
        assert float(g["d299"][12345]) == 0.5
    st_out = tmp_path / "out.safetensors"
    run = clipcli("convert", src, st_out)
    assert run.returncode == 3, run
    assert "refusing to expand" in run.stderr
    assert run.stderr.count("\n") == 1
    assert not st_out.exists()


@pytest.mark.parametrize("over", [0, 1])
def test_expanding_unallocated_tensors_exactly_at_the_budget(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    """Stored (4,000 bytes) + unallocated made (2 x 8,000 bytes) = 20,000 bytes: a budget
    of exactly that converts to safetensors; one byte less refuses before OUT exists."""
    src, out = tmp_path / "mixed.h5", tmp_path / "out.safetensors"
    with h5py.File(src, "w") as f:
        f["stored"] = np.arange(1000, dtype=np.float32)
        f.create_dataset("a", shape=(2000,), dtype="<f4", fillvalue=3.0)
        f.create_dataset("b", shape=(1000,), dtype="<f8", fillvalue=-2.0, chunks=(100,))
    monkeypatch.setattr(limits, "MAX_EXPANSION", 0)
    monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", 20_000 - over)
    run = clipcli("convert", src, out)
    if over:
        assert run.returncode == 3, run
        assert "refusing to expand" in run.stderr
        assert not out.exists()
        return
    assert run.returncode == 0, run
    with safe_open(str(out), "np") as f, h5py.File(src, "r") as h:
        for name in ("stored", "a", "b"):
            assert f.get_tensor(name).tobytes() == h[name][()].tobytes()
