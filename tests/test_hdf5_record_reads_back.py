"""A structure record clipcli writes is one it reads back (THREAT_MODEL item 22).

The record's reading side (clipcli.formats.hdf5.record_check) refuses a record that breaks
any of its rules, as it must for a forged one. The writing side described HDF5 objects
without those rules: an .h5 with a 2 MB fixed-length string attribute clipped to
safetensors with exit 0 and no word, and `convert OUT back.h5` was then exit 3 (the
1 MiB type-size rule); a tensor of 20,000 one-element chunks beside a 60 MB vocabulary
(dropped: over the record's cap) gave a record over the chunk budget of what it still
described. Now each part is checked by the reading rules when it is recorded, and a part
outside them is dropped and named like any other loss (refused without --allow-lossy).

References: h5py writes the inputs and reads every output back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
from conftest import MainRun as Run

from clipcli.formats.hdf5.portable import MAX_TYPE_SIZE

Cli = Callable[..., Run]


def _with_attributes(path: Path, sizes: dict[str, int]) -> None:
    """A float32 tensor 'w' (with a small attribute 'ok'), and at the root one fixed-length
    string attribute of each given size, named by its key."""
    with h5py.File(path, "w", libver="latest") as f:  # dense attributes: past 64 KiB
        dataset = f.create_dataset("w", data=np.arange(16, dtype=np.float32).reshape(4, 4))
        dataset.attrs["ok"] = 3
        for name, size in sizes.items():
            f.attrs.create(name, np.array(b"x" * size, dtype=f"S{size}"))


def test_the_attacks_attributes_are_losses_and_what_is_kept_reads_back(
    clipcli: Cli, tmp_path: Path
) -> None:
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w", libver="latest") as f:
        dataset = f.create_dataset("w", data=np.arange(16, dtype=np.float32).reshape(4, 4))
        dataset.attrs["ok"] = 3
        f.attrs.create("big", np.array(b"x" * 2_000_000, dtype="S2000000"))
        pair = np.dtype([("a", "S600000"), ("b", "S600000")])
        dataset.attrs.create("pair", np.zeros((2,), dtype=pair))
    refused = clipcli("clip", "--global", "1", "-q", src, out)
    assert refused.returncode == 2, refused
    assert "attribute 'big' of '/'" in refused.stderr
    assert "attribute 'pair' of '/w'" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not out.exists()
    run = clipcli("clip", "--global", "1", "-q", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    assert "attribute 'big' of '/'" in run.stderr
    back_run = clipcli("convert", "-q", out, back)
    assert back_run.returncode == 0, back_run
    with h5py.File(back, "r") as f:
        assert f["w"].attrs["ok"] == 3
        assert "pair" not in f["w"].attrs
        norm = float(np.sqrt(np.sum(f["w"][()].astype(np.float64) ** 2)))
        assert abs(norm - 1.0) < 1e-6


def test_a_type_of_exactly_the_records_limit_is_kept_and_one_byte_more_dropped(
    clipcli: Cli, tmp_path: Path
) -> None:
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    _with_attributes(src, {"at": MAX_TYPE_SIZE, "past": MAX_TYPE_SIZE + 1})
    run = clipcli("convert", "-q", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    assert "attribute 'past' of '/'" in run.stderr
    assert "'at'" not in run.stderr
    back_run = clipcli("convert", "-q", out, back)
    assert back_run.returncode == 0, back_run
    with h5py.File(back, "r") as f:
        kept = f.attrs.get_id("at")
        assert kept.get_type().get_size() == MAX_TYPE_SIZE
        assert f.attrs["at"] == b"x" * MAX_TYPE_SIZE


def test_objects_outside_the_rules_are_dropped_and_named(clipcli: Cli, tmp_path: Path) -> None:
    """A named datatype and a non-tensor dataset whose types are past the size rule."""
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w", libver="latest") as f:
        f.create_dataset("w", data=np.ones(3, np.float32))
        f["wide_type"] = np.dtype(f"S{MAX_TYPE_SIZE + 1}")
        f.create_dataset("names", data=np.array([b"a"], dtype=f"S{MAX_TYPE_SIZE + 1}"))
        f.create_dataset("vocab", data=np.array([b"a", b"bb"], dtype="S2"))
    run = clipcli("convert", "-q", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    assert "named datatype '/wide_type'" in run.stderr
    assert "dataset '/names'" in run.stderr
    back_run = clipcli("convert", "-q", out, back)
    assert back_run.returncode == 0, back_run
    with h5py.File(back, "r") as f:
        assert sorted(f) == ["vocab", "w"]
        assert f["vocab"][()].tolist() == [b"a", b"bb"]


def test_a_record_over_a_budget_of_what_it_describes_is_dropped_whole(
    clipcli: Cli, tmp_path: Path
) -> None:
    """20,000 one-element chunks beside a 60 MB vocabulary: the file's own chunk budget
    holds them, but the vocabulary is over the record's cap, and what the record still
    describes (80 KB of tensor) allows 8,211 chunks. The record is dropped, named; OUT
    converts back (to the plain layout) instead of being refused as malformed."""
    src, out, back = tmp_path / "c.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w", libver="latest") as f:
        f.create_dataset("w", data=np.ones(20000, np.float32), chunks=(1,))
        f.create_dataset("vocab", data=np.zeros(60000, dtype="S1000"))
    run = clipcli("clip", "--global", "1", "-q", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    assert "the HDF5 structure (outside what a structure record may hold" in run.stderr
    back_run = clipcli("convert", "-q", out, back)
    assert back_run.returncode == 0, back_run
    with h5py.File(back, "r") as f:
        values = f["w"][()].astype(np.float64)
        assert abs(float(np.sqrt(np.sum(values**2))) - 1.0) < 1e-6
