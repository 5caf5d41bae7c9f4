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


def _converts_back(clipcli: Cli, out: Path, back: Path) -> None:
    """clipcli reads its own OUT back into HDF5: the promise under test."""
    run = clipcli("convert", "-q", out, back)
    assert run.returncode == 0, run


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
    _converts_back(clipcli, out, back)
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
    _converts_back(clipcli, out, back)
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
    _converts_back(clipcli, out, back)
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
    _converts_back(clipcli, out, back)
    with h5py.File(back, "r") as f:
        values = f["w"][()].astype(np.float64)
        assert abs(float(np.sqrt(np.sum(values**2))) - 1.0) < 1e-6


# ---------------------------------------------------------------------- attack s33rec
# The first version checked the record with prepare()'s malformed rules only. What the HDF5
# writer also checks on reading it back: that the record is these tensors' (the fit rule),
# and the attribute budget with the root's attributes as the metadata beside the record
# leaves them (an edited value is written as a plain variable-length string).


def _raw_attribute(obj: h5py.HLObject, name: str) -> tuple[int, int, bytes]:
    """A fixed-length string attribute's size, padding and bytes as stored."""
    attr = h5py.h5a.open(obj.id, name.encode())
    file_type = attr.get_type()
    raw = np.zeros((), dtype=f"V{file_type.get_size()}")
    attr.read(raw, mtype=file_type)
    return file_type.get_size(), file_type.get_strpad(), raw.tobytes()


def _fixed_string_attribute(obj: h5py.HLObject, name: str, raw: bytes, pad: int) -> None:
    file_type = h5py.h5t.C_S1.copy()
    file_type.set_size(len(raw))
    file_type.set_strpad(pad)
    attr = h5py.h5a.create(obj.id, name.encode(), file_type, h5py.h5s.create(h5py.h5s.SCALAR))
    attr.write(np.frombuffer(raw, dtype=f"S{len(raw)}").reshape(()), mtype=file_type)


PADS = {
    "nullterm": h5py.h5t.STR_NULLTERM,
    "nullpad": h5py.h5t.STR_NULLPAD,
    "spacepad": h5py.h5t.STR_SPACEPAD,
}


def test_fixed_string_root_attributes_keep_their_type_and_bytes_whatever_the_padding(
    clipcli: Cli, tmp_path: Path
) -> None:
    """A root string attribute is metadata too; its metadata value is what h5py reads
    (padding converted, trailing NULs dropped). Compared with the record's bytes taken
    otherwise, a space-padded one never matched and came back a variable-length string."""
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    contents = [b"ab  ", b"a\x00b\x00", b"ab\x00\x00", b"abcd", b"a \x00 "]
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.ones(3, np.float32))
        for pad_name, pad in PADS.items():
            for k, raw in enumerate(contents):
                _fixed_string_attribute(f, f"{pad_name}{k}", raw, pad)
    assert clipcli("convert", "-q", src, out).returncode == 0
    run = clipcli("convert", "-q", out, back)
    assert run.returncode == 0, run
    with h5py.File(src, "r") as before, h5py.File(back, "r") as after:
        for name in before.attrs:
            assert _raw_attribute(after, name) == _raw_attribute(before, name), name


def test_a_large_space_padded_attribute_beside_variable_length_ones_reads_back(
    clipcli: Cli, tmp_path: Path
) -> None:
    """The attack's F3: 1,000,000 bytes, space-padded, and 70 variable-length elements on a
    dataset: kept in the record, no loss, and clipcli reads its own OUT back."""
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w", libver="latest") as f:
        f.create_dataset("w", data=np.arange(16, dtype=np.float32))
        f["w"].attrs.create("vl", ["a"] * 70, dtype=h5py.string_dtype())
        _fixed_string_attribute(f, "desc", b"x" * 999_992 + b" " * 8, h5py.h5t.STR_SPACEPAD)
    run = clipcli("clip", "--global", "1", "-q", src, out)
    assert run.returncode == 0, run
    assert run.stderr == ""
    _converts_back(clipcli, out, back)
    with h5py.File(src, "r") as before, h5py.File(back, "r") as after:
        assert _raw_attribute(after, "desc") == _raw_attribute(before, "desc")


def test_metadata_left_beside_a_dropped_attribute_counts_in_the_budget(
    clipcli: Cli, tmp_path: Path
) -> None:
    """The attack's F1: a 2 MB fixed-length root string (over the type rule: dropped from
    the record) stays in __metadata__, and reading back writes it as a variable-length
    root attribute; with 40 variable-length elements on a dataset that breaks the
    attribute budget. The record is dropped whole (named), and OUT reads back."""
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w", libver="latest") as f:
        f.create_dataset("w", data=np.arange(16, dtype=np.float32))
        f["w"].attrs.create("vl", ["a"] * 40, dtype=h5py.string_dtype())
        f.attrs.create("big", np.array(b"x" * 2_000_000, dtype="S2000000"))
    refused = clipcli("convert", "-q", src, out)
    assert refused.returncode == 2, refused
    assert "attribute budget" in refused.stderr or "64 MiB limit" in refused.stderr
    run = clipcli("convert", "-q", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    _converts_back(clipcli, out, back)
    with h5py.File(back, "r") as f:
        assert f.attrs["big"] == "x" * 2_000_000  # as metadata: a plain string


def test_a_record_that_is_not_the_tensors_own_is_a_loss(clipcli: Cli, tmp_path: Path) -> None:
    """The attack's F2: an enum {FALSE, TRUE} over int32 reads as a bool tensor, but a bool
    tensor's dataset must have h5py's own bool type (the fit rule, on reading back). The
    record is a named loss, not a file clipcli then refuses to convert back."""
    src, out, back = tmp_path / "a.h5", tmp_path / "o.safetensors", tmp_path / "back.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.arange(16, dtype=np.float32))
        f["w"].attrs["scale"] = np.int32(3)
        wide_bool = h5py.enum_dtype({"FALSE": 0, "TRUE": 1}, basetype="i4")
        f.create_dataset("mask", data=np.array([0, 1, 1, 0], dtype="i4"), dtype=wide_bool)
    refused = clipcli("convert", "-q", src, out)
    assert refused.returncode == 2, refused
    assert "dataset 'mask'" in refused.stderr
    assert not out.exists()
    assert clipcli("convert", "-q", "--allow-lossy", src, out).returncode == 0
    _converts_back(clipcli, out, back)
    with h5py.File(back, "r") as f:
        assert f["mask"][()].tolist() == [False, True, True, False]


def test_a_model_directory_names_what_no_record_could_hold(clipcli: Cli, tmp_path: Path) -> None:
    """Attack s33sig: a model directory's shards keep none of the structure, and the loss
    line summed up what the record holds: once the parts outside the record's rules were
    dropped from it, "(0 attributes, 0 groups)" named nothing that was lost."""
    src = tmp_path / "e.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.ones((3, 4), np.float32))
        many = h5py.enum_dtype({f"m{i}": i for i in range(5000)}, basetype="i2")
        f["w"].attrs.create("e", np.array([3], dtype="i2"), dtype=many)
    refused = clipcli("convert", "-q", src, f"{tmp_path / 'out'}/")
    assert refused.returncode == 2, refused
    assert "attribute 'e' of '/w'" in refused.stderr
    run = clipcli("convert", "-q", "--allow-lossy", src, f"{tmp_path / 'kept'}/")
    assert run.returncode == 0, run
    assert "attribute 'e' of '/w'" in run.stderr
