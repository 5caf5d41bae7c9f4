"""A gzip bomb in an HDF5 chunk (THREAT_MODEL, open item 13 until 2026-11-27): the
library's deflate filter grows its buffer to whatever a stream gives, so a 1 MB file whose
4 KB chunk is replaced by a stream inflating to 1 GiB ran at 1.16 GB. Chunks big enough to
break the memory budget at deflate's greatest ratio are inflated by clipcli first, a piece
at a time, and refused (exit 3) if they give more than the chunk holds."""

from __future__ import annotations

import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from clipcli.api import measure
from clipcli.errors import InputError
from clipcli.formats.hdf5 import safety
from clipcli.formats.opening import open_reader

CHUNK = 1024  # float32 elements: a 4096-byte chunk
CHUNK_BYTES = 4 * CHUNK


def zeros_stream(inflated: int) -> bytes:
    made = zlib.compressobj(9)
    return made.compress(bytes(inflated)) + made.flush()


def with_chunk(path: Path, stream: bytes, **filters: object) -> Path:
    """A float32 dataset of one gzip chunk, whose stored chunk is then `stream`."""
    with h5py.File(path, "w") as f:
        d = f.create_dataset(
            "w", shape=(CHUNK,), chunks=(CHUNK,), dtype="f4", compression="gzip", **filters
        )
        d[...] = np.arange(CHUNK, dtype="f4")
        d.id.write_direct_chunk((0,), stream)
    return path


def test_a_chunk_inflating_past_its_size_is_refused_before_any_read(tmp_path: Path) -> None:
    bomb = zeros_stream(64 << 20)  # ~64 KB stored, over the limit of this small file
    path = with_chunk(tmp_path / "bomb.h5", bomb)
    assert len(bomb) > safety.inflate_limit(path.stat().st_size)
    with pytest.raises(InputError, match="inflates past 8192 bytes.*gzip bomb"):
        measure(path)


def test_the_inflated_bound_exactly_at_the_limit(tmp_path: Path) -> None:
    """A stream giving the chunk and INFLATE_SLACK bytes more is let through to the
    library; one byte more is refused."""
    allowed = CHUNK_BYTES + safety.INFLATE_SLACK
    at = with_chunk(tmp_path / "at.h5", zeros_stream(allowed))
    past = with_chunk(tmp_path / "past.h5", zeros_stream(allowed + 1))
    checked = pytest.MonkeyPatch.context()
    with checked as patch:
        patch.setattr(safety, "inflate_limit", lambda _: 0)  # check every chunk
        with open_reader(at):
            pass
        with pytest.raises(InputError, match=f"inflates past {allowed} bytes"), open_reader(past):
            pass


@pytest.mark.parametrize("above", [0, 1])
def test_the_stored_size_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, above: int
) -> None:
    """A chunk stored in exactly inflate_limit bytes is left to the library; one byte
    over it is inflated here (and this one is a bomb)."""
    bomb = zeros_stream(1 << 20)
    path = with_chunk(tmp_path / "b.h5", bomb)
    monkeypatch.setattr(safety, "inflate_limit", lambda _: len(bomb) - above)
    if above:
        with pytest.raises(InputError, match="gzip bomb"), open_reader(path):
            pass
    else:
        with open_reader(path):
            pass


@pytest.mark.parametrize(
    "filters",
    [{}, {"shuffle": True}, {"fletcher32": True}, {"shuffle": True, "fletcher32": True}],
    ids=str,
)
def test_real_chunks_over_the_limit_read_exactly(tmp_path: Path, filters: dict[str, bool]) -> None:
    """Chunks as h5py writes them, inflated here first (every one is over the limit of a
    file this small), read back with the values written."""
    rng = np.random.default_rng(3)
    values = {
        "noise": rng.standard_normal((256, 1024)).astype("f4"),
        "zeros": np.zeros((256, 1024), "f4"),
        "steps": np.repeat(np.arange(256, dtype="f4"), 1024).reshape(256, 1024),
    }
    path = tmp_path / "real.h5"
    with h5py.File(path, "w") as f:
        for name, array in values.items():
            f.create_dataset(name, data=array, chunks=array.shape, compression="gzip", **filters)
    size = path.stat().st_size
    with h5py.File(path) as f:
        stored = [f[n].id.get_chunk_info(0).size for n in values]
    assert max(stored) > safety.inflate_limit(size)
    m = measure(path)
    for t in m.tensors:
        exact = np.sqrt(np.sum(values[t.info.name].astype(np.float64) ** 2))
        assert t.norm == pytest.approx(exact, rel=1e-12)


def test_gzip_then_another_filter_is_refused_over_the_limit(tmp_path: Path) -> None:
    """Shuffle written after gzip: the stored bytes are not the deflate stream, so it
    cannot be inflated here; over the limit such a chunk is refused."""
    path = tmp_path / "order.h5"
    with h5py.File(path, "w") as f:
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_chunk((CHUNK,))
        plist.set_deflate(4)
        plist.set_shuffle()  # after deflate, in the pipeline's write order
        space = h5py.h5s.create_simple((CHUNK,))
        h5py.h5d.create(f.id, b"w", h5py.h5t.IEEE_F32LE, space, dcpl=plist)
        f["w"][...] = np.arange(CHUNK, dtype="f4")
    with h5py.File(path) as f:
        size = f["w"].id.get_chunk_info(0).size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safety, "inflate_limit", lambda _: size - 1)
        with pytest.raises(InputError, match="gzip then shuffle"), open_reader(path):
            pass
    with open_reader(path) as reader:  # under the limit: the library reads it
        assert reader.infos[0].name == "w"


def test_a_chunk_stored_without_gzip_is_not_inflated(tmp_path: Path) -> None:
    """Bit 0 of a chunk's filter mask set: gzip was skipped for it; its bytes are the
    values themselves."""
    raw = np.arange(CHUNK, dtype="<f4").tobytes()
    path = tmp_path / "skipped.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("w", shape=(CHUNK,), chunks=(CHUNK,), dtype="<f4", compression="gzip")
        d.id.write_direct_chunk((0,), raw, filter_mask=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safety, "inflate_limit", lambda _: 0)
        m = measure(path)
    assert m.tensors[0].norm == pytest.approx(np.sqrt(np.sum(np.arange(CHUNK) ** 2.0)))


@pytest.mark.parametrize(
    ("stream", "gives"),
    [
        (zeros_stream(5000), 5000),
        (zeros_stream(5000)[:20], None),  # truncated: what it gave so far
        (b"not a zlib stream at all", 0),
        (b"", 0),
        (zeros_stream(5000) + b"tail", 5000),  # a checksum's bytes after the stream
    ],
)
def test_inflated_bytes_counts_without_raising(stream: bytes, gives: int | None) -> None:
    counted = safety._inflated_bytes(stream, 1 << 20)
    assert counted == gives if gives is not None else 0 <= counted <= 5000


def test_inflated_bytes_stops_at_the_most_asked() -> None:
    assert safety._inflated_bytes(zeros_stream(10 << 20), 12345) == 12345
