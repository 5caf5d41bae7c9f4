"""HDF5 inputs stored with lossy filters (issue 18 item 3): OUT holds the values measured.

A dataset stored with scale-offset on floats (or any filter not known to be lossless,
clipcli.formats.hdf5.filters) is written to an HDF5 OUT without that filter, with one
note line; its lossless filters and chunks are kept. Once, `clip --norm 10` reported
norm_after 9.9999994 while OUT, re-encoded by scale-offset, held 10.0029, and clipping
OUT again never converged.

References: h5py reads both files; norms are exact (fractions.Fraction) sums of squares.
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

Cli = Callable[..., Run]


def _exact_norm(values: np.ndarray) -> float:
    total = sum((Fraction(float(v)) ** 2 for v in values.reshape(-1)), Fraction(0))
    return math.sqrt(total)


def _filters(dataset: h5py.Dataset) -> list[str]:
    plist = dataset.id.get_create_plist()
    return [plist.get_filter(i)[3].decode() for i in range(plist.get_nfilters())]


def _lossy_file(path: Path) -> np.ndarray:
    """'w': floats under scale-offset (2 decimal digits) and gzip; 'i': integers under
    lossless scale-offset (the library picks the bits); 'plain': contiguous."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal(1000).astype(np.float32) * 3
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=values, scaleoffset=2, chunks=(100,), compression="gzip")
        f.create_dataset("i", data=np.arange(-50, 50, dtype=np.int32), scaleoffset=0, chunks=(10,))
        f["plain"] = np.ones(4, np.float32)
    with h5py.File(path, "r") as f:
        stored: np.ndarray = f["w"][()]
    assert not np.array_equal(stored, values)  # the filter really is lossy
    return stored


def _note_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("clipcli: note:")]


def test_clipped_norm_is_the_norm_of_what_out_holds(clipcli: Cli, tmp_path: Path) -> None:
    src, out = tmp_path / "lossy.h5", tmp_path / "out.h5"
    _lossy_file(src)
    run = clipcli("clip", "--norm", "10", "--format", "json", src, out)
    assert run.returncode == 0, run
    [note] = _note_lines(run.stderr)
    assert "'w' (scale-offset)" in note
    assert run.stderr.count("\n") == 1
    rows = {row["name"]: row for row in json.loads(run.stdout)["tensors"]}
    with h5py.File(out, "r") as f:
        held = f["w"][()]
        assert _filters(f["w"]) == ["deflate"]  # scale-offset dropped, gzip kept
        assert f["w"].chunks == (100,)
        assert _filters(f["i"]) == ["scaleoffset"]  # lossless on integers: kept
        np.testing.assert_array_equal(f["i"][()], np.arange(-50, 50, dtype=np.int32))
    assert _exact_norm(held) <= 10
    assert rows["w"]["norm_after"] == pytest.approx(_exact_norm(held), rel=1e-12)
    again = clipcli("clip", "--norm", "10", "--format", "json", out, tmp_path / "again.h5")
    assert again.returncode == 0, again
    assert again.stderr == ""  # nothing lossy left to drop
    assert not any(row["changed"] for row in json.loads(again.stdout)["tensors"])


def test_unchanged_lossy_dataset_is_copied_as_the_values_read(clipcli: Cli, tmp_path: Path) -> None:
    """Nothing over the limit: the values read (decoded once) are written unfiltered, not
    the stored chunks (valid only under the dropped filter)."""
    src, out = tmp_path / "lossy.h5", tmp_path / "out.h5"
    stored = _lossy_file(src)
    run = clipcli("clip", "--norm", "1e9", src, out)
    assert run.returncode == 0, run
    assert len(_note_lines(run.stderr)) == 1
    with h5py.File(out, "r") as f:
        assert f["w"][()].tobytes() == stored.tobytes()
        assert _filters(f["w"]) == ["deflate"]


def test_a_lossy_filter_never_enters_the_structure_record(clipcli: Cli, tmp_path: Path) -> None:
    """HDF5 -> safetensors records the storage without the lossy filter (the tensor holds
    the values read), so the way back writes it unfiltered, with no refusal."""
    src, mid, back = tmp_path / "lossy.h5", tmp_path / "mid.safetensors", tmp_path / "back.h5"
    stored = _lossy_file(src)
    for a, b in ((src, mid), (mid, back)):
        run = clipcli("convert", a, b)
        assert run.returncode == 0, run
        assert run.stderr == ""
    with h5py.File(back, "r") as f:
        assert f["w"][()].tobytes() == stored.tobytes()
        assert _filters(f["w"]) == ["deflate"]
        assert _filters(f["i"]) == ["scaleoffset"]


def test_dry_run_says_the_same(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "lossy.h5"
    _lossy_file(src)
    run = clipcli("clip", "--dry-run", "--norm", "10", src, tmp_path / "out.h5")
    assert run.returncode == 0, run
    assert len(_note_lines(run.stderr)) == 1
    assert not (tmp_path / "out.h5").exists()
