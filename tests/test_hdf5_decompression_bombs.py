"""Decompression bombs in HDF5 chunks (THREAT_MODEL, "decompressed chunks"; open item 13
until 2026-11-27). The library's decompressors size their buffers from the data: a 1 MB
file whose 4 KB gzip chunk was replaced by a stream inflating to 1 GiB ran at 1.16 GB, and
the first fix let two gzips, or LZF and gzip, through (attack bomb13att). Now a pipeline
holds one decompressor, only size-keeping filters after it, and a chunk that could decode
past a third of the file's budget is decoded here first and refused when it gives more
than its chunk holds."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from clipcli.api import measure
from clipcli.errors import InputError
from clipcli.formats.hdf5 import decoding
from clipcli.formats.hdf5.filters import DEFLATE, FLETCHER32, LZF, NBIT, SCALEOFFSET, SHUFFLE
from clipcli.formats.opening import open_reader

CHUNK = 1024  # float32 elements: a 4096-byte chunk
CHUNK_BYTES = 4 * CHUNK
ALLOWED = CHUNK_BYTES + decoding.DECODE_SLACK


def zeros_stream(inflated: int) -> bytes:
    made = zlib.compressobj(9)
    return made.compress(bytes(inflated)) + made.flush()


def shuffled(data: bytes, size: int) -> bytes:
    """HDF5's shuffle, from its definition: byte i of every element together, in turn."""
    count = len(data) // size
    whole = np.frombuffer(data, np.uint8, count * size).reshape(count, size)
    return whole.T.tobytes() + data[count * size :]


def with_pipeline(
    path: Path, add: Callable[[object], None], stream: bytes | None, integers: bool = False
) -> Path:
    """A float32 (or int32) dataset of one chunk through the filters `add` sets (write
    order), written by the library; then its stored chunk replaced by `stream`, if given."""
    with h5py.File(path, "w") as f:
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_chunk((CHUNK,))
        add(plist)
        space = h5py.h5s.create_simple((CHUNK,))
        kind = h5py.h5t.STD_I32LE if integers else h5py.h5t.IEEE_F32LE
        h5py.h5d.create(f.id, b"w", kind, space, dcpl=plist)
        f["w"][...] = np.arange(CHUNK, dtype="i4" if integers else "f4")
        if stream is not None:
            f["w"].id.write_direct_chunk((0,), stream)
    return path


def gzip(plist: object) -> None:
    plist.set_deflate(4)  # type: ignore[attr-defined]


def checking_every_chunk(patch: pytest.MonkeyPatch) -> None:
    patch.setattr(decoding, "decode_limit", lambda _: 0)


def test_a_gzip_bomb_is_refused_before_any_read(tmp_path: Path) -> None:
    bomb = zeros_stream(64 << 20)  # ~64 KB stored: 1032 x that is past this file's limit
    path = with_pipeline(tmp_path / "bomb.h5", gzip, bomb)
    assert decoding.worst_output(DEFLATE, len(bomb)) > decoding.decode_limit(path.stat().st_size)
    with pytest.raises(InputError, match=f"decodes \\(gzip\\) past {ALLOWED} bytes.*bomb"):
        measure(path)


def test_the_decoded_bound_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream giving the chunk and DECODE_SLACK bytes more passes; one byte more not."""
    at = with_pipeline(tmp_path / "at.h5", gzip, zeros_stream(ALLOWED))
    past = with_pipeline(tmp_path / "past.h5", gzip, zeros_stream(ALLOWED + 1))
    checking_every_chunk(monkeypatch)
    with open_reader(at):
        pass
    with pytest.raises(InputError, match=f"past {ALLOWED} bytes"), open_reader(past):
        pass


@pytest.mark.parametrize("below", [0, 1])
def test_the_worst_output_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, below: int
) -> None:
    """A chunk whose worst output is exactly decode_limit is left to the library; a limit
    one byte lower has it decoded here (and this one is a bomb)."""
    bomb = zeros_stream(1 << 20)
    path = with_pipeline(tmp_path / "b.h5", gzip, bomb)
    worst = decoding.worst_output(DEFLATE, len(bomb))
    monkeypatch.setattr(decoding, "decode_limit", lambda _: worst - below)
    if below:
        with pytest.raises(InputError, match="bomb"), open_reader(path):
            pass
    else:
        with open_reader(path):
            pass


def _shuffle_gzip_fletcher(plist: object) -> None:
    plist.set_shuffle()  # type: ignore[attr-defined]
    plist.set_deflate(4)  # type: ignore[attr-defined]
    plist.set_fletcher32()  # type: ignore[attr-defined]


def _gzip_then_shuffle(plist: object) -> None:
    plist.set_deflate(4)  # type: ignore[attr-defined]
    plist.set_shuffle()  # type: ignore[attr-defined]


def _gzip_shuffle_fletcher(plist: object) -> None:
    _gzip_then_shuffle(plist)
    plist.set_fletcher32()  # type: ignore[attr-defined]


def _lzf(plist: object) -> None:
    plist.set_filter(LZF, h5py.h5z.FLAG_OPTIONAL, ())  # type: ignore[attr-defined]


def _shuffle_lzf(plist: object) -> None:
    plist.set_shuffle()  # type: ignore[attr-defined]
    _lzf(plist)


def _szip(plist: object) -> None:
    plist.set_szip(h5py.h5z.SZIP_NN_OPTION_MASK, 8)  # type: ignore[attr-defined]


def _fletcher_then_gzip(plist: object) -> None:
    plist.set_fletcher32()  # type: ignore[attr-defined]
    gzip(plist)


PIPELINES = {
    "gzip": gzip,
    "shuffle,gzip,fletcher32": _shuffle_gzip_fletcher,
    "gzip,shuffle": _gzip_then_shuffle,
    "gzip,shuffle,fletcher32": _gzip_shuffle_fletcher,
    "fletcher32,gzip": _fletcher_then_gzip,
    "lzf": _lzf,
    "shuffle,lzf": _shuffle_lzf,
    "szip": _szip,
}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("fill", ["noise", "zeros", "steps"])
def test_real_chunks_decoded_here_read_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline: str, fill: str
) -> None:
    """Chunks as the library writes them, every one decoded here first, read back with
    the values written."""
    rng = np.random.default_rng(3)
    values = {
        "noise": rng.standard_normal(CHUNK).astype("f4"),
        "zeros": np.zeros(CHUNK, "f4"),
        "steps": np.repeat(np.arange(CHUNK // 64, dtype="f4"), 64),
    }[fill]
    path = with_pipeline(tmp_path / "real.h5", PIPELINES[pipeline], None)
    with h5py.File(path, "r+") as f:
        f["w"][...] = values
    checking_every_chunk(monkeypatch)
    m = measure(path)
    exact = np.sqrt(np.sum(values.astype(np.float64) ** 2))
    assert m.tensors[0].norm == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("pipeline", ["gzip,shuffle", "gzip,shuffle,fletcher32"])
def test_a_bomb_behind_a_shuffle_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline: str
) -> None:
    """Shuffle written after gzip: the stored bytes are the stream shuffled; put back,
    it is the bomb it is."""
    stream = shuffled(zeros_stream(1 << 20), 4)
    if pipeline.endswith("fletcher32"):
        stream += b"\0\0\0\0"  # the checksum's place
    path = with_pipeline(tmp_path / "b.h5", PIPELINES[pipeline], stream)
    checking_every_chunk(monkeypatch)
    with pytest.raises(InputError, match="decodes \\(gzip\\) past"), open_reader(path):
        pass


def test_an_lzf_bomb_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "zeros.h5"
    with h5py.File(source, "w") as f:
        d = f.create_dataset(
            "z", data=np.zeros(1 << 20, "f4"), chunks=(1 << 20,), compression="lzf"
        )
        stream = d.id.read_direct_chunk((0,))[1]
    assert decoding.lzf_bytes(stream, 1 << 30) == 4 << 20  # the counter against h5py's LZF
    path = with_pipeline(tmp_path / "b.h5", _lzf, stream)
    checking_every_chunk(monkeypatch)
    with pytest.raises(InputError, match="decodes \\(lzf\\) past"), open_reader(path):
        pass


def test_an_lzf_bomb_over_the_limit_is_refused_unpatched(tmp_path: Path) -> None:
    """Attack bomb14att: the 100 MiB that h5py's LZF was thought to stop at does not hold
    (a 12 MB file's 4 KiB chunk decoded to 1 GB, exit 0); LZF's worst is 88 x the stored
    bytes, and a chunk over the limit is counted here. One literal, then back references
    of 264 bytes at distance 1: ~116 MB from a 1.3 MB chunk (past 100 MiB + its size)."""
    stream = b"\x00\x00" + b"\xe0\xff\x00" * 440_000
    assert decoding.lzf_bytes(stream, 1 << 30) == 1 + 264 * 440_000
    path = with_pipeline(tmp_path / "b.h5", _lzf, stream)
    limit = decoding.decode_limit(path.stat().st_size)
    assert decoding.worst_output(LZF, len(stream)) > limit
    with pytest.raises(InputError, match="decodes \\(lzf\\) past"), open_reader(path):
        pass


def test_an_szip_header_declaring_gigabytes_is_refused(tmp_path: Path) -> None:
    """szip allocates what the stream's first four bytes declare; every szip chunk is
    looked at, whatever the file's size."""
    path = with_pipeline(tmp_path / "s.h5", _szip, None)
    with h5py.File(path, "r+") as f:
        stream = f["w"].id.read_direct_chunk((0,))[1]
        assert int.from_bytes(stream[:4], "little") == CHUNK_BYTES
        f["w"].id.write_direct_chunk((0,), (0xFFFF0000).to_bytes(4, "little") + stream[4:])
    with pytest.raises(InputError, match="decodes \\(szip\\) past"), open_reader(path):
        pass


@pytest.mark.parametrize(
    ("first", "second"),
    [(DEFLATE, DEFLATE), (DEFLATE, LZF), (LZF, DEFLATE), (DEFLATE, NBIT), (DEFLATE, SCALEOFFSET)],
)
def test_pipelines_that_cannot_be_bounded_are_refused_at_any_size(
    tmp_path: Path, first: int, second: int
) -> None:
    """Two decompressors (a bomb behind a second gzip or an LZF passed the first fix at
    1.15-4.3 GB), or a filter after the decompressor that changes sizes: refused when the
    file is opened, small chunks too."""

    def add(plist: object) -> None:
        for code in (first, second):
            parameters = (4,) if code == DEFLATE else (2, 0) if code == SCALEOFFSET else ()
            plist.set_filter(code, 0, parameters)  # type: ignore[attr-defined]

    path = with_pipeline(tmp_path / "p.h5", add, None, integers=True)
    with pytest.raises(InputError, match="cannot be bounded"), open_reader(path):
        pass


def test_n_bit_and_scale_offset_must_declare_the_chunks_own_size() -> None:
    ok = decoding.pipeline_problem([SCALEOFFSET], [[2, 0, 100, 0, 4, 1]], 100, 4)
    assert ok is None
    assert decoding.pipeline_problem([NBIT], [[8, 1, 100, 1, 2, 0, 16, 0]], 100, 2) is None
    for forged in ([8, 1, 10**9, 1, 2, 0, 16, 0], [8, 1, 100, 1, 8, 0, 16, 0], [8, 1]):
        assert "declares chunks other than its own" in str(
            decoding.pipeline_problem([NBIT], [forged], 100, 2)
        )
    assert decoding.pipeline_problem([SHUFFLE, DEFLATE, FLETCHER32], [[4], [4], []], 9, 4) is None


def test_a_chunk_stored_without_its_decompressor_is_not_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit 0 of a chunk's filter mask set: gzip was skipped for it; its bytes are the
    values themselves."""
    path = with_pipeline(tmp_path / "skipped.h5", gzip, None)
    with h5py.File(path, "r+") as f:
        raw = np.arange(CHUNK, dtype="<f4").tobytes()
        f["w"].id.write_direct_chunk((0,), raw, filter_mask=1)
    checking_every_chunk(monkeypatch)
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
    counted = decoding.inflated_bytes(stream, 1 << 20)
    assert counted == gives if gives is not None else 0 <= counted <= 5000


def test_counting_stops_at_the_most_asked() -> None:
    assert decoding.inflated_bytes(zeros_stream(10 << 20), 12345) == 12345
    assert decoding.lzf_bytes(bytes([0xE0, 255, 0]) * 1000, 999) == 999


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [0, 3, 64, 67])
def test_unshuffled_undoes_hdf5s_shuffle(size: int, length: int) -> None:
    data = bytes(np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8))
    assert decoding.unshuffled(shuffled(data, size), size) == data


def test_small_bombs_under_the_limit_do_not_add_up(tmp_path: Path) -> None:
    """Attack bomb14att (open item 14 until 2026-11-27): 200 chunks of 4 KiB, each a 4 KB
    stream inflating to 4 MiB and under the limit on its own, ran at 868 MB: the library's
    64 MiB chunk cache counts a chunk by its nominal size and kept every decoded buffer at
    its real one. A dataset is now read with a cache of the chunks its reads need kept
    (two, along one axis)."""
    from peak_memory import peak_rss as _peak
    from test_hdf5_chunk_budget import RSS_BUDGET

    chunks = 120
    stream = zeros_stream(4 << 20)
    path = tmp_path / "many.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset(
            "w", shape=(chunks * CHUNK,), chunks=(CHUNK,), dtype="f4", compression="gzip"
        )
        d[...] = np.ones(chunks * CHUNK, "f4")
        for k in range(chunks):
            d.id.write_direct_chunk((k * CHUNK,), stream)
    limit = decoding.decode_limit(path.stat().st_size)
    assert decoding.worst_output(DEFLATE, len(stream)) <= limit // 2  # none decoded here
    assert chunks * (4 << 20) > RSS_BUDGET  # what the old cache held
    code, peak, stderr = _peak("norms", "-q", path)
    assert code == 0, stderr
    assert peak < RSS_BUDGET, peak


@pytest.mark.parametrize(
    ("shape", "chunks", "band"),
    [
        ((), (), 2),
        ((1000,), (64,), 2),
        ((4096, 4096), (64, 256), 2 * 16),
        ((4096, 4097), (64, 256), 2 * 17),  # a partial chunk at the end of each row
        ((3000, 700), (3000, 1), 2 * 700),
        ((8, 6, 10), (2, 3, 4), 2 * 2 * 3),
        ((5, 0), (1, 4), 2),  # no chunk along an axis: still one band of one
        ((2, 1 << 27), (1, 1 << 18), 2),  # rows chunked one at a time: read one by one
        ((4, 256, 131072), (1, 256, 32), 2 * 4096),  # bands along the second axis
        ((4, 6, 10), (1, 1, 4), 2),
        ((1, 8, 10), (4, 2, 4), 2 * 3),  # a chunk deeper than its one-index axis
        ((4, 6, 10), (2, 1, 4), 2 * 6 * 3),  # the first axis chunked deeper than one
    ],
)
def test_the_chunks_a_read_keeps_are_two_bands(
    shape: tuple[int, ...], chunks: tuple[int, ...], band: int
) -> None:
    from clipcli.formats.hdf5.geometry import band_chunks

    assert band_chunks(shape, chunks) == band


def test_a_datasets_cache_is_its_bands_and_at_most_the_files(tmp_path: Path) -> None:
    """Uncompressed: two bands of chunks (at most the file's 64 MiB). Compressed tensors
    of rank 2 and more: read a band at a time, with a cache of two chunks."""
    from clipcli.formats.hdf5 import limits

    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("one", data=np.ones(4096, "f4"), chunks=(256,), compression="gzip")
        f.create_dataset("two", data=np.ones((64, 4096), "f4"), chunks=(8, 512))
        f.create_dataset("wide", shape=(4, 1 << 24), dtype="f4", chunks=(1, 1 << 16))
        f.create_dataset("deep", shape=(4, 1 << 24), dtype="f4", chunks=(2, 1 << 16))
        f.create_dataset("gz", data=np.ones((64, 4096), "f4"), chunks=(8, 512), compression="gzip")
    with open_reader(path) as reader:
        checks = reader._checks  # type: ignore[attr-defined]
        assert checks.cache_bytes["one"] == 2 * 256 * 4
        assert checks.cache_bytes["two"] == 2 * 8 * 8 * 512 * 4
        # Rows chunked one at a time are read one after another: two chunks, not two
        # rows of 256 each (the file's 64 MiB, which norms of a gzip [2, 2**25] held).
        assert checks.cache_bytes["wide"] == 2 * (1 << 16) * 4
        assert checks.cache_bytes["deep"] == limits.CHUNK_CACHE_BYTES  # not 2 x 256 x 256 KiB
        assert checks.cache_bytes["gz"] == 2 * 8 * 512 * 4
        assert checks.band_rows == {"gz": 8}
        for name in ("two", "gz"):
            dataset = reader.dataset(name)  # type: ignore[attr-defined]
            cache = dataset.id.get_access_plist().get_chunk_cache()
            assert cache[1] == checks.cache_bytes[name]


def test_a_written_datasets_cache_is_its_bands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer fills a chunked dataset in C-order pieces: its cache holds the chunks
    that fills at once (band_chunks), not the file's 64 MiB (row chunks of a gzip
    [2, 2**25] clipped: 297 -> 95 MB). The library ignores the cache a second open of a
    dataset asks for, so the test reads the cache the write went through."""
    from clipcli.cli.entry import main
    from clipcli.formats.hdf5 import limits
    from clipcli.formats.hdf5 import writer as hdf5_writer

    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("rows", data=np.ones((4, 4096), "f4"), chunks=(1, 512), compression="gzip")
        f.create_dataset("deep", data=np.ones((4, 4096), "f4"), chunks=(2, 512), compression="gzip")
    caches: dict[str, int] = {}
    real = hdf5_writer.Hdf5Writer._opened_for_writing

    def spy(self: hdf5_writer.Hdf5Writer, info: Any) -> Any:
        dataset = real(self, info)
        caches[info.name] = dataset.id.get_access_plist().get_chunk_cache()[1]
        return dataset

    monkeypatch.setattr(hdf5_writer.Hdf5Writer, "_opened_for_writing", spy)
    args = ["clip", "--global", "1", "-q", "--no-fsync", "--force"]
    assert main([*args, str(src), str(tmp_path / "o.h5")]) == 0
    assert caches == {"rows": 2 * 512 * 4, "deep": 2 * 8 * 2 * 512 * 4}
    # Two bands of "deep" over the cache: one band and a chunk (up to MAX_BAND_BYTES and a
    # chunk: the reader reads no larger band), since chunks written in part are let go
    # and each would be encoded again for every piece.
    monkeypatch.setattr(limits, "CHUNK_CACHE_BYTES", 4096)
    caches.clear()
    assert main([*args, str(src), str(tmp_path / "o.h5")]) == 0
    assert caches == {"rows": 2 * 512 * 4, "deep": (8 + 1) * 2 * 512 * 4}


class _Array:
    """A dataset standing in for h5py's: read_direct of a first-axis slice."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.reads: list[slice] = []

    def read_direct(self, dest: np.ndarray, source_sel: slice) -> None:
        self.reads.append(source_sel)
        dest[...] = self.values[source_sel]


@pytest.mark.parametrize("seed", range(40))
def test_band_pieces_are_the_c_order_pieces(seed: int) -> None:
    """Pieces cut from bands are the tensor's C-order ranges, for any shape, band height
    and step; each band is read once, in order."""
    from clipcli.formats.hdf5.geometry import BandReader

    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 9, int(rng.integers(2, 5))))
    values = rng.standard_normal(shape).astype("f4")
    rows = int(rng.integers(1, shape[0] + 3))
    step = int(rng.integers(1, values.size + 2))
    array = _Array(values)
    bands = BandReader(array, shape, values.dtype, rows)
    flat = values.reshape(-1)
    for start in range(0, values.size, step):
        stop = min(start + step, values.size)
        assert np.array_equal(bands.piece(start, stop), flat[start:stop])
    firsts = [s.start for s in array.reads]
    assert firsts == sorted(set(firsts))
    assert all(s.stop - s.start <= rows for s in array.reads)


def test_band_reading_gives_the_librarys_values(tmp_path: Path) -> None:
    """Bands of chunk height, and of the whole dataset where a chunk is taller than it
    (an extensible dataset)."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal((37, 19, 11)).astype("f4")
    path = tmp_path / "b.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=values, chunks=(4, 5, 3), compression="gzip", shuffle=True)
        f.create_dataset(
            "x", data=values, chunks=(64, 5, 3), maxshape=(None, 19, 11), compression="gzip"
        )
    with open_reader(path) as reader:
        assert reader._checks.band_rows == {"w": 4, "x": 37}  # type: ignore[attr-defined]
        for info in reader.infos:
            for step in (1, 7, 11 * 19, 1000, values.size):
                got = np.concatenate(list(reader.chunks(info, step)))
                assert np.array_equal(got, values.reshape(-1))


def test_small_bombs_in_a_non_tensor_are_refused(tmp_path: Path) -> None:
    """Attack bomb15att: a non-tensor is read a 16 MiB slice at a time and the library
    kept every chunk a slice decodes (200 small bombs in a compound dataset: 3.4 GB at
    exit 0); its chunks share the limit as a slice's many, and each is looked at."""
    kind = np.dtype([("a", "<f4"), ("b", "<i4")])
    stream = zeros_stream(1 << 20)
    path = tmp_path / "n.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.ones((4, 4), "f4"))
        d = f.create_dataset(
            "table", shape=(60 * 256,), chunks=(256,), dtype=kind, compression="gzip"
        )
        d[...] = np.zeros(60 * 256, kind)
        for k in range(60):
            d.id.write_direct_chunk((k * 256,), stream)
    with pytest.raises(InputError, match="table.*decompression bomb"), open_reader(path):
        pass


def test_a_compressed_non_tensor_still_reads(tmp_path: Path) -> None:
    kind = np.dtype([("a", "<f4"), ("b", "<i4")])
    values = np.zeros(5000, kind)
    values["a"] = np.arange(5000)
    path = tmp_path / "n.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.ones((4, 4), "f4"))
        f.create_dataset("table", data=values, chunks=(256,), compression="gzip")
        f.create_dataset(
            "words",
            data=np.array([b"w%d" % i for i in range(3000)]),
            chunks=(100,),
            compression="gzip",
        )
    from clipcli.cli.entry import main

    out = tmp_path / "o.h5"
    assert main(["convert", "-q", str(path), str(out)]) == 0
    with h5py.File(out) as f:
        assert np.array_equal(f["table"][...], values)
        assert np.array_equal(f["words"][...], np.array([b"w%d" % i for i in range(3000)]))


@pytest.mark.parametrize(("columns", "banded"), [(8 << 20, True), ((8 << 20) + 1, True)])
def test_a_band_of_the_cache_bytes_and_more_is_read_by_bands(
    tmp_path: Path, columns: int, banded: bool
) -> None:
    """A band (two rows of float32 here) of exactly CHUNK_CACHE_BYTES is read a band at a
    time, and one element more too: the cache cannot hold two bands of its chunks, and at
    CHUNK_CACHE_W0 < 1 it lets go of chunks read in part, so a C-order pass through the
    cache would decode each chunk again for every piece (at 1.0 it kept them all, past its
    size: attack s47b)."""
    from clipcli.formats.hdf5 import limits

    assert limits.CHUNK_CACHE_BYTES == 2 * (8 << 20) * 4
    path = tmp_path / "band.h5"
    with h5py.File(path, "w") as f:  # unallocated: nothing stored, nothing to decode
        f.create_dataset(
            "w", shape=(3, columns), chunks=(2, 1 << 20), dtype="f4", compression="gzip"
        )
    with open_reader(path) as reader:
        assert reader._checks.band_rows == ({"w": 2} if banded else {})  # type: ignore[attr-defined]


@pytest.mark.parametrize(("columns", "refused"), [(2048, False), (2049, True)])
def test_a_band_over_the_band_limit_that_the_cache_cannot_hold_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, columns: int, refused: bool
) -> None:
    """Compressed chunks two rows deep whose band of rows is over MAX_BAND_BYTES (16 KiB
    here: 2 rows of 2,048 float32) and whose two bands of chunks the cache cannot hold:
    read in order, each chunk would be decoded again for every piece that crosses it (a
    5.7 MB file's float16 [64, 2**23] in chunks 64 rows deep: 102 s of norms with the
    cache honoured, 1.1 GB without: attack s47b). Exactly at the limit it is read by
    bands; one column more is exit 3, one line. Unallocated, it is made from its fill
    value and never read through the library: not refused."""
    from clipcli.cli.entry import main
    from clipcli.formats.hdf5 import limits

    monkeypatch.setattr(limits, "CHUNK_CACHE_BYTES", 4096)
    monkeypatch.setattr(limits, "MAX_BAND_BYTES", 2 * 2048 * 4)
    path = tmp_path / "tall.h5"
    values = np.random.default_rng(5).standard_normal((3, columns)).astype("f4")
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=values, chunks=(2, 64), compression="gzip")
        f.create_dataset("fill", shape=(3, columns), chunks=(2, 64), dtype="f4", compression="gzip")
    if refused:
        with pytest.raises(InputError, match=r"tensor 'w'.*over 0 MiB: each chunk would be"):
            open_reader(path)
        return
    with open_reader(path) as reader:
        assert reader._checks.band_rows == {"w": 2, "fill": 2}  # type: ignore[attr-defined]
        info = next(i for i in reader.infos if i.name == "w")
        got = np.concatenate(list(reader.chunks(info, 1000)))
        assert np.array_equal(got, values.reshape(-1))
    assert main(["norms", "-q", str(path)]) == 0


_HALF_READS = """
import sys
import h5py, numpy as np
from clipcli.formats.hdf5 import limits
path, chunk = sys.argv[1], int(sys.argv[2])
f = h5py.File(path, "r")
access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
access.set_chunk_cache(limits.CHUNK_CACHE_SLOTS, 2 * chunk * 4, limits.CHUNK_CACHE_W0)
dataset = h5py.Dataset(h5py.h5d.open(f.id, b"/w", dapl=access))
half = np.empty(chunk // 2, "f4")
dataset.read_direct(half, source_sel=np.s_[0 : chunk // 2])
def resident_kib():  # now, not the peak: a child's peak starts at its parent's
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
before = resident_kib()
for start in range(chunk, dataset.shape[0], chunk):
    dataset.read_direct(half, source_sel=np.s_[start : start + chunk // 2])
print(resident_kib() - before)
"""


def test_chunks_read_in_part_leave_the_cache_at_its_size(tmp_path: Path) -> None:
    """The first half of each of 1,024 gzip chunks of 64 KiB, through a cache of two: at
    CHUNK_CACHE_W0 the library lets go of chunks read in part once the cache is full. At
    1.0 it kept every one (64 MiB here; 1.1 GB for a 5.7 MB file read in C order through
    chunks 64 rows deep: attack s47b). The library itself is what is measured (the
    resident set of a child, which keeps what the cache holds)."""
    import subprocess
    import sys

    chunk = 1 << 14
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.ones(1024 * chunk, "f4"), chunks=(chunk,), compression="gzip")
    probe = subprocess.run(
        [sys.executable, "-c", _HALF_READS, str(path), str(chunk)],
        capture_output=True,
        text=True,
        check=True,
    )
    grown_kib = int(probe.stdout)
    assert grown_kib < 16 << 10, grown_kib  # 64 MiB of chunks held at 1.0
