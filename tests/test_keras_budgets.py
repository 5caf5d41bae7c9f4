"""A `.keras` archive's HDF5 budgets are the archive's (THREAT_MODEL item 17): the zip rules
let `model.weights.h5` unpack to 200 times the archive plus 64 MiB, and HDF5 budgets taken
from the unpacked member allowed 200 times that again. A 67 KB archive whose member holds
gzip chunks of zeros (each under the per-dataset 200-fold rule, thanks to bytes after the
deflate stream that the zip compresses away) ran for 346 s at 375 MB, exit 0; a 61 KB one
held 1.2 GB.

The archive's size is what the user gave, so the budgets are those of a plain HDF5 file of
that size: exactly at the budget reads, one byte past it is exit 3, and the same member
given as a plain file (its own, larger, size) still reads."""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from clipcli.cli.entry import main
from clipcli.formats.hdf5 import limits


def write_keras(path: Path, weights: bytes) -> int:
    """A .keras archive holding `weights` as model.weights.h5 (deflated); its size."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.5.0"}))
        archive.writestr("config.json", json.dumps({"class_name": "Sequential", "config": {}}))
        archive.writestr("model.weights.h5", weights)
    return path.stat().st_size


def zeros_weights(elements: int) -> tuple[bytes, int]:
    """An HDF5 file of one contiguous float32 dataset of zeros; its bytes and the bytes
    its datasets declare."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.zeros(elements, np.float32))
    return buffer.getvalue(), elements * 4


@pytest.mark.parametrize("past", [0, 1])
def test_the_expansion_budget_is_the_archives_exactly_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], past: int
) -> None:
    weights, declared = zeros_weights(1_000_000)
    archive = tmp_path / "m.keras"
    size = write_keras(archive, weights)
    free = declared - limits.MAX_EXPANSION * size - past  # the budget: exactly, or 1 short
    assert free > 0
    monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", free)
    code = main(["norms", "-q", str(archive)])
    err = capsys.readouterr().err
    if past:
        assert code == 3
        assert err.count("\n") == 1
        assert f"200 times the {size}-byte archive it came from" in err
    else:
        assert code == 0, err
    # The member as a plain file has budgets of its own size, which it is within.
    plain = tmp_path / "model.weights.h5"
    plain.write_bytes(weights)
    assert main(["norms", "-q", str(plain)]) == 0


def test_the_chunk_budget_is_the_archives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Chunks of zeros: 300 of them, over a chunk budget of 200 for the archive and
    within the member's (which the contiguous padding makes large)."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f.create_dataset("layers/pad/vars/0", data=np.zeros(1_000_000, np.float32))
        f.create_dataset(
            "layers/dense/vars/0", data=np.zeros((300, 16), np.float32), chunks=(1, 16)
        )
    archive = tmp_path / "m.keras"
    size = write_keras(archive, buffer.getvalue())
    member_chunks = len(buffer.getvalue()) // limits.BYTES_PER_CHUNK
    archive_chunks = size // limits.BYTES_PER_CHUNK
    monkeypatch.setattr(limits, "FREE_CHUNKS", 300 - archive_chunks - 1)  # one chunk short
    assert member_chunks + limits.FREE_CHUNKS >= 300  # within the member's
    assert main(["norms", "-q", str(archive)]) == 3
    err = capsys.readouterr().err
    assert f"of the {size}-byte archive it came from" in err
    monkeypatch.setattr(limits, "FREE_CHUNKS", 300 - archive_chunks)  # exactly at it
    assert main(["norms", "-q", str(archive)]) == 0


def test_zero_chunks_padded_past_their_stream_are_refused_in_an_archive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The attack's shape at a quarter of its size: four 64 MiB gzip chunks of zeros,
    each stream followed by 340 KB of zero bytes (so each dataset stores more than a
    200th of what it declares), in an archive of a few KB."""
    stream = zlib.compress(bytes(64 << 20), 9)
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        dataset = f.create_dataset(
            "layers/dense/vars/0",
            shape=(4, 16 << 20),
            dtype=np.float32,
            chunks=(1, 16 << 20),
            compression="gzip",
        )
        for row in range(4):
            dataset.id.write_direct_chunk((row, 0), stream + bytes(340_000))
    archive = tmp_path / "m.keras"
    size = write_keras(archive, buffer.getvalue())
    assert size < 20_000
    assert main(["norms", "-q", str(archive)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("clipcli: error: ")
    assert err.count("\n") == 1
    assert "archive it came from" in err


def many_groups(groups: int, per_group: int) -> bytes:
    """An HDF5 file of `groups` groups of `per_group` empty groups each, and one dataset."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.ones(8, np.float32))
        for g in range(groups):
            group = f.create_group(f"g{g}")
            for k in range(per_group):
                group.create_group(f"k{k}")
    return buffer.getvalue()


@pytest.mark.parametrize("past", [0, 1])
def test_the_object_budget_exactly_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], past: int
) -> None:
    """Objects: the root, /layers, /layers/dense, .../vars, the dataset, 3 groups of 4
    empty groups: 5 + 3 + 12 = 20. A budget of 20 reads it; 19 refuses it, exit 3."""
    path = tmp_path / "m.h5"
    path.write_bytes(many_groups(3, 4))
    monkeypatch.setattr(limits, "BYTES_PER_OBJECT", 1 << 40)  # the size gives none
    monkeypatch.setattr(limits, "FREE_OBJECTS", 20 - past)
    code = main(["norms", "-q", str(path)])
    err = capsys.readouterr().err
    if past:
        assert code == 3
        assert err.count("\n") == 1
        assert "objects" in err
    else:
        assert code == 0, err


def test_a_group_of_more_links_than_the_budget_is_refused_before_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.h5"
    path.write_bytes(many_groups(1, 30))
    monkeypatch.setattr(limits, "BYTES_PER_OBJECT", 1 << 40)
    monkeypatch.setattr(limits, "FREE_OBJECTS", 29)
    listed: list[int] = []
    real = h5py.Group.__iter__

    def spy(self: h5py.Group) -> object:
        listed.append(len(self))
        return real(self)

    monkeypatch.setattr(h5py.Group, "__iter__", spy)
    assert main(["norms", "-q", str(path)]) == 3
    assert "holds 30 links" in capsys.readouterr().err
    assert 30 not in listed  # refused from the count, not the list


def test_an_archive_of_many_small_objects_is_held_to_the_archives_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 groups of 100 empty groups deflate to a small archive: the archive's budget
    (one object per 64 bytes of it, plus 4,096) refuses it; the member given as a plain
    file holds about 160 bytes per object and reads."""
    weights = many_groups(100, 100)
    archive = tmp_path / "m.keras"
    size = write_keras(archive, weights)
    assert size // limits.BYTES_PER_OBJECT + limits.FREE_OBJECTS < 10_000
    assert main(["norms", "-q", str(archive)]) == 3
    err = capsys.readouterr().err
    assert "archive it came from" in err
    plain = tmp_path / "model.weights.h5"
    plain.write_bytes(weights)
    assert main(["norms", "-q", str(plain)]) == 0


def test_values_over_the_record_cap_stop_the_reading_before_they_are_encoded(
    tmp_path: Path,
) -> None:
    """Three 30 MiB attributes: encoded, 126 MB, over the record's 50 MB cap. The record is
    dropped as before (a warning with --allow-lossy), but reading stops at the second
    attribute instead of encoding all three first (472 MB peak before, 226 MB now; the
    library alone takes ~100 MB to list them)."""
    from peak_memory import peak_rss

    path = tmp_path / "attrs.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("w", data=np.ones((64, 64), np.float32))
        for k in range(3):
            f.attrs.create(f"a{k}", np.zeros((30 << 20) // 8, "f8"))
    out = tmp_path / "out.safetensors"
    code, peak, stderr = peak_rss("convert", "--allow-lossy", "-q", path, out)
    assert code == 0, stderr
    assert "over the 50000000-byte cap" in stderr
    assert peak < 330 << 20, peak


def stored_headers(path: Path) -> int:
    """Every object's header and attribute storage, from the library's object info."""
    total = 0
    with h5py.File(path, "r") as f:
        objects = [f]
        f.visititems(lambda _name, obj: objects.append(obj))
        for obj in objects:
            info = h5py.h5o.get_info(obj.id)
            attributes = info.meta_size.attr
            total += info.hdr.space.total + attributes.heap_size + attributes.index_size
    return int(total)


@pytest.mark.parametrize("past", [0, 1])
def test_the_header_budget_exactly_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], past: int
) -> None:
    path = tmp_path / "m.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("layers/dense/vars/0", data=np.ones(8, np.float32))
        f.attrs.create("big", np.zeros(100_000))  # dense storage: outside the header
        f["layers"].attrs["small"] = "x"
    total = stored_headers(path)
    assert total > 800_000
    monkeypatch.setattr(limits, "header_budget", lambda _size: total - past)
    code = main(["norms", "-q", str(path)])
    err = capsys.readouterr().err
    if past:
        assert code == 3
        assert "headers and attributes" in err
    else:
        assert code == 0, err


def test_an_archive_of_large_attributes_is_refused_before_they_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two 35 MiB attributes of zeros in a ~70 KB archive (within the zip's 200-fold
    rule): the library would load both to list their names; the archive's header budget
    (its size plus 64 MiB) refuses them first. The member as a plain file reads."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", libver="latest") as f:
        f.create_dataset("layers/dense/vars/0", data=np.ones(8, np.float32))
        for k in range(2):
            f.attrs.create(f"a{k}", np.zeros((35 << 20) // 8))
    archive = tmp_path / "m.keras"
    size = write_keras(archive, buffer.getvalue())
    assert len(buffer.getvalue()) > size + (64 << 20)
    assert main(["norms", "-q", str(archive)]) == 3
    err = capsys.readouterr().err
    assert "headers and attributes" in err
    assert "archive it came from" in err
    plain = tmp_path / "model.weights.h5"
    plain.write_bytes(buffer.getvalue())
    assert main(["norms", "-q", str(plain)]) == 0


def test_a_plain_file_of_12000_named_datatypes_reads(tmp_path: Path) -> None:
    """The smallest objects h5py writes: committed datatypes of ~81 bytes each (latest
    format). The object budget of one per 128 bytes refused this file (attack s32att2);
    no plain file's objects are smaller than its 64."""
    path = tmp_path / "types.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("w", data=np.ones(4, np.float32))
        for k in range(12_000):
            f[f"t{k}"] = np.dtype("f4")
    assert path.stat().st_size // 12_000 < 128
    assert main(["norms", "-q", str(path)]) == 0


def test_a_dataset_over_the_record_cap_on_its_own_is_dropped_and_the_record_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The early stop counts only what is kept: a variable-length dataset over the cap on
    its own is dropped from the record (as before it), and the rest of the record stays.
    The first version of the stop dropped the whole record for it."""
    from clipcli.formats.hdf5 import record_read

    monkeypatch.setattr(record_read, "MAX_STRUCTURE_BYTES", 200_000)
    path = tmp_path / "vocab.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.ones((8, 8), np.float32))
        f.attrs["note"] = "kept"
        f.create_dataset("vocab", data=["x" * 1000] * 300, dtype=h5py.string_dtype())
    out = tmp_path / "out.safetensors"
    assert main(["convert", "--allow-lossy", "-q", str(path), str(out)]) == 0
    err = capsys.readouterr().err
    assert "dataset '/vocab'" in err
    assert "the HDF5 structure" not in err
