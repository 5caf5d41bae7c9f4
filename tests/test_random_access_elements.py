"""Reader.elements_loader for npz, HDF5 (and .keras) and PyTorch files (issue 20, "--axes
in bounded memory"): where the boxes cut the slices (two-element columns of a [2, n] with
--axes 0), a reader that reads any run of elements lets --axes work the slices out a
group at a time; the others kept every slice's sums and factors in memory, ~10 bytes a
slice. Each format reads at any offset where its stored bytes allow it:

- npz: uncompressed C-order members, one pread each, once the member's CRC is checked
  over the whole of it (a run cannot be checked on its own);
- HDF5: any dataset but one read a band of chunks at a time (its chunks span rows that
  runs of elements would decode again and again) and an unallocated one;
- PyTorch: contiguous tensors (a strided view is read in order through its maps).

References: numpy's, h5py's and torch's values (the PyTorch fixtures' recorded ones), and
the same clip with every slice in one group.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import REPO_ROOT
from handmade import write_safetensors

from clipcli.formats import base
from clipcli.formats.base import Reader
from clipcli.formats.opening import open_reader
from clipcli.jobs import execution, pipeline
from clipcli.numerics import slices

PYTORCH = REPO_ROOT / "tests" / "data" / "pytorch"


def _values(seed: int = 20, shape: tuple[int, ...] = (2, 40)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)


def _h5(path: Path, **dataset: Any) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("w", **dataset)
    return path


def _ranges(numel: int) -> list[tuple[int, int]]:
    inner = [(0, 1), (3, 37), (5, 6), (numel // 3, numel // 2)]
    ends = [(0, 0), (0, numel), (numel, numel), (numel - 1, numel)]
    return ends + [(start, stop) for start, stop in inner if stop <= numel]


def assert_reads_any_run(reader: Reader, name: str, want: np.ndarray) -> None:
    """Every run asked for is the reference's, bit for bit; one past either end is a
    ValueError, as is a run that ends before it starts."""
    info = next(info for info in reader.infos if info.name == name)
    flat = want.reshape(-1)
    for start, stop in _ranges(info.numel):
        load = reader.elements_loader(info, start, stop)
        assert load is not None, name
        got = load()
        assert got.dtype == info.dtype
        assert got.tobytes() == flat[start:stop].astype(info.dtype).tobytes(), (start, stop)
    for start, stop in [(0, info.numel + 1), (-1, 2), (4, 3)]:
        with pytest.raises(ValueError, match="not in tensor"):
            reader.elements_loader(info, start, stop)


def test_an_uncompressed_npz_member_is_read_at_any_offset(tmp_path: Path) -> None:
    values = _values()
    np.savez(tmp_path / "m.npz", w=values, h=values.astype(np.float16)[:, :7])
    with open_reader(tmp_path / "m.npz") as reader:
        assert_reads_any_run(reader, "w", values)
        assert_reads_any_run(reader, "h", values.astype(np.float16)[:, :7])


def test_compressed_and_column_major_npz_members_are_read_in_order(tmp_path: Path) -> None:
    np.savez_compressed(tmp_path / "c.npz", w=_values())
    np.savez(tmp_path / "f.npz", w=np.asfortranarray(_values()))
    for name in ["c.npz", "f.npz"]:
        with open_reader(tmp_path / name) as reader:
            assert reader.elements_loader(reader.infos[0], 0, 1) is None, name


def test_a_corrupt_npz_member_is_refused_before_any_run_of_it_is_used(tmp_path: Path) -> None:
    """One byte changed in the data, far from the run asked for: the first read checks
    the whole member's CRC, so the run is never handed out."""
    path = tmp_path / "m.npz"
    values = _values(shape=(2, 4000))  # more than zipfile reads with the .npy header
    np.savez(path, w=values)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        entry = archive.getinfo("w.npy")
    at = data.index(values.tobytes()) + values.nbytes - 3  # the last element, past the run
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    from clipcli.errors import InputError

    with open_reader(path) as reader:
        load = reader.elements_loader(reader.infos[0], 0, 2)
        assert load is not None
        with pytest.raises(InputError, match="CRC mismatch"):
            load()
    assert entry.compress_type == zipfile.ZIP_STORED


@pytest.mark.parametrize(
    "storage",
    [
        {},
        {"chunks": (1, 40)},
        {"chunks": (2, 7)},
        {"chunks": (1, 40), "compression": "gzip"},
        {"chunks": (2, 40), "compression": "gzip", "shuffle": True, "fletcher32": True},
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "contiguous",
)
def test_an_hdf5_dataset_is_read_at_any_offset(tmp_path: Path, storage: dict[str, Any]) -> None:
    values = _values()
    path = _h5(tmp_path / "m.h5", data=values, **storage)
    with h5py.File(path, "r") as f:
        official = f["w"][...]
    with open_reader(path) as reader:
        assert_reads_any_run(reader, "w", official)


def test_an_hdf5_dataset_read_by_bands_is_read_in_order(tmp_path: Path) -> None:
    """Compressed chunks two rows deep over [2, 40]: runs would decode a band's chunks
    again for each run (a cache of a band's chunks held them all: attack s47)."""
    banded = _h5(tmp_path / "b.h5", data=_values(), chunks=(2, 8), compression="gzip")
    with open_reader(banded) as reader:
        assert reader._checks.band_rows == {"w": 2}  # type: ignore[attr-defined]
        assert reader.elements_loader(reader.infos[0], 0, 1) is None


def test_an_unallocated_hdf5_datasets_runs_are_its_fill_value_charged_once_made(
    tmp_path: Path,
) -> None:
    """No storage: runs of its fill value, charged to the expansion budget when the first
    is made (as reading it in order charges it), not when a run is asked for."""
    empty = _h5(tmp_path / "e.h5", shape=(2, 40), dtype=np.float32, fillvalue=2.5)
    with open_reader(empty) as reader:
        info = reader.infos[0]
        load = reader.elements_loader(info, 3, 10)
        assert load is not None
        assert not reader._expanded  # type: ignore[attr-defined]
        assert load().tolist() == [2.5] * 7
        assert reader._expanded == {"w"}  # type: ignore[attr-defined]
        assert_reads_any_run(reader, "w", np.full((2, 40), 2.5, np.float32))


def _expected(stem: str) -> dict[str, np.ndarray]:
    with np.load(PYTORCH / f"{stem}.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


@pytest.mark.parametrize(
    "name", sorted(p.name for p in PYTORCH.iterdir() if p.suffix in (".pt", ".pth"))
)
def test_a_contiguous_pytorch_tensor_is_read_at_any_offset(name: str) -> None:
    """Every fixture torch wrote (both zip byte orders, legacy files, views): a contiguous
    tensor's runs are torch's values; a strided view is read in order (None)."""
    want = _expected(name.split(".")[0])
    read_at_offsets = 0
    with open_reader(PYTORCH / name) as reader:
        for info in reader.infos:
            if not info.numel:
                continue
            load = reader.elements_loader(info, 0, 1)
            if load is None:
                assert not reader._located[info.name].contiguous  # type: ignore[attr-defined]
                continue
            read_at_offsets += 1
            flat = want[info.name].reshape(-1)
            for start, stop in _ranges(info.numel):
                run = reader.elements_loader(info, start, stop)
                assert run is not None
                got = run()
                widened = got.astype(np.float64) if got.dtype.kind not in "biu" else got
                np.testing.assert_array_equal(widened, flat[start:stop], err_msg=info.name)
    assert read_at_offsets


# -- whole clips: grouped where the reader reads at any offset, the same as one group ----


def _npz(path: Path, values: np.ndarray) -> Path:
    np.savez(path.with_suffix(".npz"), w=values)
    return path.with_suffix(".npz")


def _hdf5(path: Path, values: np.ndarray) -> Path:
    return _h5(
        path.with_suffix(".h5"), data=values, chunks=(1, values.shape[1]), compression="gzip"
    )


def _hdf5_unallocated(path: Path, values: np.ndarray) -> Path:
    """No storage: every element its fill value, every column over the limit."""
    return _h5(path.with_suffix(".h5"), shape=values.shape, dtype=values.dtype, fillvalue=3.0)


def _keras_weights(path: Path, values: np.ndarray) -> Path:
    return _h5(path.with_suffix(".weights.h5"), data=values)


def _pytorch(path: Path, values: np.ndarray) -> Path:
    """A .pt clipcli writes (torch is not installed here): convert from safetensors."""
    from clipcli.cli.entry import main

    src = write_safetensors(path.with_suffix(".safetensors"), {"w": values})
    out = path.with_suffix(".pt")
    assert main(["convert", "-q", str(src), str(out)]) == 0
    return out


def _keras_archive(path: Path, values: np.ndarray) -> Path:
    """A .keras archive (laid out as layouts.keras_archive): its weights member is
    unpacked and read by an Hdf5Reader, whose runs the archive's reader hands on (attack
    s47: it did not, so no group was used)."""
    from layouts import KERAS_CONFIG, KERAS_METADATA

    weights = _h5(path.with_suffix(".weights.h5"), data=values)
    archive_path = path.with_suffix(".keras")
    with zipfile.ZipFile(archive_path, "w") as archive:
        archive.writestr("metadata.json", KERAS_METADATA, zipfile.ZIP_DEFLATED)
        archive.writestr("config.json", KERAS_CONFIG, zipfile.ZIP_DEFLATED)
        archive.write(weights, "model.weights.h5", zipfile.ZIP_STORED)
    weights.unlink()
    return archive_path


def _read_back(path: Path) -> np.ndarray:
    with open_reader(path) as reader:
        return reader.read(next(i for i in reader.infos if i.name == "w"))


WRITERS: dict[str, Callable[[Path, np.ndarray], Path]] = {
    "npz": _npz,
    "hdf5": _hdf5,
    "hdf5-unallocated": _hdf5_unallocated,
    "keras-weights": _keras_weights,
    "keras-archive": _keras_archive,
    "pytorch": _pytorch,
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_axes_by_groups_write_and_report_what_one_group_does(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """float32 [2, 40] with --axes 0 (40 two-element columns), boxes of 8 elements: groups
    of 5 slices, read at their offsets, against one group of all; every column's norm at
    most the limit."""
    src = WRITERS[fmt](tmp_path / "in", _values())
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 8)
    monkeypatch.setattr(base, "CHUNK_BYTES", 64)
    monkeypatch.setattr(pipeline, "INLINE_BELOW_BYTES", 0)
    grouped: list[str] = []
    read_at: list[int] = []
    real_groups, real_boxes_at = execution._clip_slices_by_groups, execution._boxes_at

    def by_groups(boxes: Any, groups: Any, tensor: Any, limit: float) -> Any:
        grouped.append(tensor.info.name)
        return real_groups(boxes, groups, tensor, limit)

    def boxes_at(*args: Any) -> Any:
        read_at.append(1)
        return real_boxes_at(*args)

    monkeypatch.setattr(execution, "_clip_slices_by_groups", by_groups)
    monkeypatch.setattr(execution, "_boxes_at", boxes_at)
    results = []
    for group in [1 << 30, 5]:
        monkeypatch.setattr(slices, "SLICE_GROUP", group)
        out = src.with_name(f"out{group}{''.join(src.suffixes)}")
        run = run_main("clip", "--norm", "1", "--axes", "0", "--no-fsync", "--format", "json",
                       src, out)  # fmt: skip
        assert run.code == 0, run.stderr
        report = json.loads(run.stdout)
        del report["out"]
        results.append((report, _read_back(out).tobytes()))
    assert grouped == ["w"]
    assert read_at
    assert results[0] == results[1]
    clipped = np.frombuffer(results[1][1], np.float32).reshape(2, 40).astype(np.float64)
    assert np.all(np.sqrt(np.sum(clipped**2, axis=0)) <= 1.0)
    assert "slices clipped" in results[0][0]["tensors"][0]["note"]


def test_hdf5_runs_are_read_through_the_cache_the_decoding_budget_counted(
    tmp_path: Path,
) -> None:
    """A compressed dataset of row chunks: its runs go through a chunk cache of the bytes
    DatasetChecks counted held at once (two chunks), not a band's chunks: a band of 4,096
    chunks that each decoded to 1 MiB held ~4 GB from a 9 MB file (attack s47)."""
    values = _values(shape=(2, 4096))
    path = _h5(tmp_path / "b.h5", data=values, chunks=(1, 64), compression="gzip")
    with open_reader(path) as reader:
        info = reader.infos[0]
        counted = reader._checks.cache_bytes[info.name]  # type: ignore[attr-defined]
        assert not reader._checks.band_rows  # type: ignore[attr-defined]
        load = reader.elements_loader(info, 4000, 4200)
        assert load is not None
        assert load().size == 200
        dataset = reader._held[1]  # type: ignore[attr-defined]
        _slots, cache, _w0 = dataset.id.get_access_plist().get_chunk_cache()
        assert cache == counted == 2 * 64 * 4


def test_the_keras_archive_reader_hands_on_every_fast_path_of_its_weights_reader() -> None:
    """Every FastReading method the HDF5 reader has its own of, the .keras reader hands on
    to it: one left out falls back to the slow default without a word (attack s47:
    elements_loader, so a .keras --axes held every slice's sums)."""
    from clipcli.formats.base import FastReading
    from clipcli.formats.hdf5 import Hdf5Reader
    from clipcli.formats.keras_archive import KerasArchiveReader

    for name, default in vars(FastReading).items():
        if callable(default) and getattr(Hdf5Reader, name) is not default:
            assert getattr(KerasArchiveReader, name) is not default, name


def test_an_npz_changed_and_restored_while_a_dry_run_reads_it_is_exit_3(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every column within the limit; right after the member's CRC check (the first run
    read at an offset), its data is rewritten over the limit, mtime put back; the original
    bytes are back before the in-order pass, whose CRC check passes. The groups measured
    the rewritten bytes: a dry run reported 40 of 40 slices clipped, exit 0 (attack s47).
    The input's identity (its ctime) says it changed, as it does for a real run."""
    from clipcli.formats.npz import reader as npz_reader

    src = tmp_path / "m.npz"
    within = np.full((2, 40), 0.1, np.float32)
    np.savez(src, w=within)
    original = src.read_bytes()
    at = original.index(within.tobytes())
    over = np.full((2, 40), 100.0, np.float32).tobytes()
    rewritten = original[:at] + over + original[at + len(over) :]

    def put(data: bytes) -> None:
        before = os.stat(src)
        with open(src, "r+b") as file:
            file.write(data)
        os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))

    real_check, real_in_order = (
        npz_reader.NpzReader._stored_data_start,
        npz_reader.NpzReader._stored_chunks,
    )
    events: list[str] = []

    def check_then_rewrite(self: Any, info: Any, member: Any) -> int:
        start = real_check(self, info, member)
        put(rewritten)
        events.append("rewritten")
        return start

    def restore_then_read(self: Any, *args: Any) -> Any:
        if events[-1:] == ["rewritten"]:
            put(original)
            events.append("restored")
        yield from real_in_order(self, *args)

    monkeypatch.setattr(npz_reader.NpzReader, "_stored_data_start", check_then_rewrite)
    monkeypatch.setattr(npz_reader.NpzReader, "_stored_chunks", restore_then_read)
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 8)
    monkeypatch.setattr(slices, "SLICE_GROUP", 5)
    monkeypatch.setattr(base, "CHUNK_BYTES", 64)
    monkeypatch.setattr(pipeline, "INLINE_BELOW_BYTES", 0)
    run = run_main("clip", "--norm", "1", "--axes", "0", "--dry-run", src, tmp_path / "o.npz")
    assert events == ["rewritten", "restored"]
    assert run.code == 3, run.stdout
    assert "modified while it was being read" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
