"""Issue 9 items 13-17: small files built to cost minutes, gigabytes or terabytes. Each case
runs the real CLI in a subprocess and asserts explicit budgets, stated in
docs/UNTRUSTED_INPUT.md: wall time, peak RSS of the child, and bytes written. These are bombs:
handled badly they cost minutes or gigabytes, so generous bounds are meaningful."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clipcli.errors import InputError
from clipcli.formats import npz as npz_module
from clipcli.formats import zipsafe as npz_zipcheck
from clipcli.formats.npz import fortran as npz_fortran
from clipcli.formats.npz import reader as npz_reader

WALL_BUDGET = 10.0  # seconds
RSS_BUDGET = 300 << 20  # bytes of peak resident memory
WRITE_BUDGET = 64 << 20  # bytes written to OUT's directory


@dataclass
class Measured:
    returncode: int | None
    stderr: str
    seconds: float
    peak_rss: int  # bytes
    written: int  # bytes in the output directory afterwards


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# Runs the command as its only child and writes that child's peak RSS (KiB) to argv[1]:
# RUSAGE_CHILDREN of the test process itself is the maximum over every child it ever
# waited for (the whole suite's, in one pytest run), not this command's.
_PEAK_PROBE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL)\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(done.returncode)\n"
)


def measured_run(args: list[str], out_dir: Path, timeout: float = 60.0) -> Measured:
    """Wall time, exit, stderr, peak RSS of clipcli alone, and bytes left in out_dir."""
    peak_file = out_dir.parent / f".peak-{time.monotonic_ns()}"
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_PROBE, str(peak_file), sys.executable, "-m", "clipcli"]
            + args,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        code: int | None = proc.returncode
        stderr = proc.stderr
    except subprocess.TimeoutExpired:
        code, stderr = None, "timeout"
    seconds = time.monotonic() - start
    if code is None:  # timed out: the probe was killed before it could write
        peak = 0
    else:
        peak = int(peak_file.read_text()) * 1024
        peak_file.unlink()
    return Measured(code, stderr, seconds, peak, _tree_bytes(out_dir))


def assert_within_budgets(run: Measured, codes: tuple[int, ...] = (3,)) -> None:
    assert run.returncode in codes, run
    assert run.seconds < WALL_BUDGET, run
    assert run.peak_rss < RSS_BUDGET, run
    assert run.written < WRITE_BUDGET, run
    if run.returncode != 0:
        assert run.stderr.startswith("clipcli: error: "), run
        assert run.stderr.count("\n") == 1, run


# ------------------------------------------------------------------ zip building by hand


def npy_bytes_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    text = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


@dataclass
class Member:
    name: str
    offset: int  # of the local header
    extra_len: int
    method: int
    compressed: int
    size: int
    crc: int


def build_zip(path: Path, blob: bytes, members: list[Member]) -> None:
    """`blob` is the whole body (local headers + data, laid out by the caller), followed by
    a central directory listing `members`."""
    central = b""
    for m in members:
        name = m.name.encode()
        central += (
            struct.pack(
                "<4s6H3I5H2I",
                b"PK\x01\x02",
                20,
                20,
                0,
                m.method,
                0,
                0,
                m.crc,
                m.compressed,
                m.size,
                len(name),
                0,
                0,
                0,
                0,
                0,
                m.offset,
            )
            + name
        )
    end = struct.pack(
        "<4s4H2IH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(blob), 0
    )
    path.write_bytes(blob + central + end)


def local_header(m: Member) -> bytes:
    name = m.name.encode()
    return (
        struct.pack(
            "<4s5H3I2H",
            b"PK\x03\x04",
            20,
            0,
            m.method,
            0,
            0,
            m.crc,
            m.compressed,
            m.size,
            len(name),
            m.extra_len,
        )
        + name
    )


def deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    return compressor.compress(data) + compressor.flush()


def zero_member_payload(size: int) -> tuple[bytes, int, int]:
    """(raw deflate stream, crc, size) of a float32 .npy member of exactly `size` bytes."""
    header = npy_bytes_header("<f4", ((size - 128) // 4,))
    assert len(header) == 128
    body = header + bytes(size - 128)
    return deflate(body), zlib.crc32(body), len(body)


def overlapping_zip(path: Path, members: int, size: int) -> None:
    """Fifield's overlapping-files construction: every local header's extra field is sized
    so that all members' data start at the same offset and share one deflate stream."""
    payload, crc, full = zero_member_payload(size)
    names = [f"t{i:05d}.npy" for i in range(members)]
    header_len = 30 + len(names[0])
    data_start = header_len * members
    entries = []
    blob = b""
    for i, name in enumerate(names):
        offset = header_len * i
        m = Member(name, offset, data_start - offset - header_len, 8, len(payload), full, crc)
        entries.append(m)
        blob += local_header(m)
    build_zip(path, blob + payload, entries)


def many_members_zip(path: Path, members: int, size: int) -> None:
    """Disjoint members, each inflating exactly `size` bytes: under any per-member cap."""
    payload, crc, full = zero_member_payload(size)
    blob, entries = b"", []
    for i in range(members):
        m = Member(f"t{i:05d}.npy", len(blob), 0, 8, len(payload), full, crc)
        entries.append(m)
        blob += local_header(m) + payload
    build_zip(path, blob, entries)


def stored_overlapping_zip(path: Path, members: int, elements: int) -> None:
    """Stored (uncompressed) members all pointing at one data block through their extra
    fields: no compression ratio to trip on, yet the file reads as members x its size."""
    body = npy_bytes_header("<f4", (elements,)) + np.ones(elements, np.float32).tobytes()
    crc = zlib.crc32(body)
    names = [f"t{i:05d}.npy" for i in range(members)]
    header_len = 30 + len(names[0])
    data_start = header_len * members
    blob, entries = b"", []
    for i, name in enumerate(names):
        offset = header_len * i
        m = Member(name, offset, data_start - offset - header_len, 0, len(body), len(body), crc)
        entries.append(m)
        blob += local_header(m)
    build_zip(path, blob + body, entries)


def test_zip_builder_makes_a_valid_npz(tmp_path: Path) -> None:
    """The builder itself, checked with numpy: two disjoint members load."""
    path = tmp_path / "ok.npz"
    many_members_zip(path, 2, 4096)
    with np.load(path) as loaded:
        assert sorted(loaded.files) == ["t00000", "t00001"]
        assert loaded["t00001"].shape == ((4096 - 128) // 4,)


def _bomb_is_refused_within_budgets(
    tmp_path: Path, build: Callable[[Path], object], suffix: str
) -> None:
    """`ls` and `clip` of a hostile file: refused (naming it) within the memory, disk and
    time budgets."""
    src = tmp_path / f"bomb{suffix}"
    build(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for args in (
        ["ls", str(src)],
        ["clip", "--global", "1", str(src), str(out_dir / f"o{suffix}")],
    ):
        run = measured_run(args, out_dir)
        assert_within_budgets(run)
        assert str(src) in run.stderr


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda p: overlapping_zip(p, 300, 60 << 20), id="deflate-overlap-18GB"),
        pytest.param(lambda p: stored_overlapping_zip(p, 1500, 1 << 20), id="stored-overlap-6GB"),
        pytest.param(lambda p: many_members_zip(p, 200, 64 << 20), id="200x64MiB-members"),
    ],
)
def test_npz_bombs_are_refused_within_budgets(
    tmp_path: Path, build: Callable[[Path], object]
) -> None:
    _bomb_is_refused_within_budgets(tmp_path, build, ".npz")


def test_overlapping_members_are_refused_by_name(tmp_path: Path) -> None:
    src = tmp_path / "overlap.npz"
    stored_overlapping_zip(src, 3, 16)
    with pytest.raises(InputError, match="overlap"):
        npz_module.NpzReader(src)


def _one_member(tmp_path: Path, size: int) -> tuple[Path, int, int]:
    src = tmp_path / "one.npz"
    many_members_zip(src, 1, size)
    return src, src.stat().st_size, size


def test_expansion_budget_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members inflating to exactly the budget are read; one byte more is refused."""
    src, file_size, inflated = _one_member(tmp_path, 1 << 20)
    monkeypatch.setattr(
        npz_zipcheck, "BOMB_MIN_BYTES", inflated - npz_zipcheck.BOMB_RATIO * file_size
    )
    assert npz_zipcheck.expansion_budget(file_size) == inflated
    with npz_module.NpzReader(src) as reader:
        assert reader.infos[0].nbytes == inflated - 128
    monkeypatch.setattr(
        npz_zipcheck, "BOMB_MIN_BYTES", inflated - npz_zipcheck.BOMB_RATIO * file_size - 1
    )
    with pytest.raises(InputError, match="zip bomb"):
        npz_module.NpzReader(src)


def test_stored_member_with_two_sizes_is_refused(tmp_path: Path) -> None:
    body = npy_bytes_header("<f4", (4,)) + bytes(16)
    m = Member("t.npy", 0, 0, 0, len(body), len(body) + 1_000_000, zlib.crc32(body))
    src = tmp_path / "stored.npz"
    build_zip(src, local_header(m) + body, [m])
    with pytest.raises(InputError):
        npz_module.NpzReader(src)


def test_bzip2_members_are_read(tmp_path: Path) -> None:
    """np.load reads bzip2 members (issue 18, item 17): read, not refused."""
    import zipfile

    src = tmp_path / "bz.npz"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_BZIP2) as archive:
        archive.writestr("t.npy", npy_bytes_header("<f4", (4,)) + bytes(16))
    with npz_module.NpzReader(src) as reader:
        np.testing.assert_array_equal(reader.read(reader.infos[0]), np.load(src)["t"])


def test_healthy_npz_variants_still_read(tmp_path: Path) -> None:
    """numpy's own writers: savez (stored), savez_compressed (deflate), ZIP64, empty."""
    rng = np.random.default_rng(1)
    arrays: dict[str, Any] = {"a": rng.standard_normal((3, 5)), "b": np.zeros(0, np.float32)}
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, **arrays)
        with npz_module.NpzReader(path) as reader:
            np.testing.assert_array_equal(reader.read(reader.infos[0]), arrays["a"])


# ------------------------------------------------------------------ HDF5


def vlen_shared_heap_object(path: Path, elements: int = 1500) -> None:
    """`elements` variable-length strings all pointing at one 1 MiB global heap object:
    a 1.1 MB file that reads as 1.5 GB of attribute data (patched by hand after h5py)."""
    import re

    import h5py

    with h5py.File(path, "w") as f:
        f["w"] = np.ones(4, np.float32)
        text = h5py.string_dtype()
        f.attrs.create("names", np.array(["a"] * elements, dtype=object), dtype=text)
        f.attrs.create("big", "B" * (1 << 20), dtype=text)
    data = bytearray(path.read_bytes())

    def in_a_heap(match: re.Match[bytes]) -> bool:
        address = struct.unpack("<Q", match.group(1))[0]
        return data[address : address + 4] == b"GCOL"

    big = [m for m in re.finditer(rb"\x00\x00\x10\x00(.{8})(.{4})", data, re.S) if in_a_heap(m)]
    small = [m for m in re.finditer(rb"\x01\x00\x00\x00(.{8})(.{4})", data, re.S) if in_a_heap(m)]
    assert len(big) == 1
    assert len(small) == elements
    for m in small:
        data[m.start() : m.start() + 16] = big[0].group(0)
    path.write_bytes(bytes(data))
    with h5py.File(path) as f:  # the library really reads 1 MiB per element
        assert f.attrs.get_id("names").shape == (elements,)


def unallocated_datasets(path: Path, count: int, nbytes: int) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for i in range(count):
            f.create_dataset(f"d{i:05d}", shape=(nbytes // 4,), dtype="<f4", fillvalue=1.0)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(vlen_shared_heap_object, id="1500-vlen-strings-one-1MiB-object"),
    ],
)
def test_hdf5_bombs_are_refused_within_budgets(
    tmp_path: Path, build: Callable[[Path], object]
) -> None:
    _bomb_is_refused_within_budgets(tmp_path, build, ".h5")


@pytest.mark.slow  # several seconds: many processes or files
def test_unallocated_hdf5_bomb_is_measured_and_refused_only_to_expand(tmp_path: Path) -> None:
    """2,000 unallocated 64 MiB datasets (fill 1.0): issue 18 item 18 changed this from
    refused on opening to listed and measured from the fill value (no element read or
    made); clipping them all makes their elements, which the expansion budget refuses
    within the same budgets."""
    src = tmp_path / "bomb.h5"
    unallocated_datasets(src, 2000, 64 << 20)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    listed = measured_run(["ls", str(src)], out_dir)
    assert_within_budgets(listed, codes=(0,))
    clipped = measured_run(["clip", "--global", "1", str(src), str(out_dir / "o.h5")], out_dir)
    assert_within_budgets(clipped)
    assert str(src) in clipped.stderr


def test_unchanged_unallocated_dataset_stays_unallocated(tmp_path: Path) -> None:
    import h5py

    src = tmp_path / "sparse.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("empty", shape=(1000, 1000), dtype="<f4", fillvalue=0.5)
        f.create_dataset("chunked", shape=(1000, 1000), dtype="<f4", chunks=(100, 100))
        f["dense"] = np.arange(6, dtype=np.float64)
    out = tmp_path / "out.h5"
    run = measured_run(["clip", "--global", "1e9", str(src), str(out)], tmp_path)
    assert run.returncode == 0, run
    with h5py.File(out) as f:
        assert f["empty"].id.get_storage_size() == 0
        assert f["chunked"].id.get_storage_size() == 0
        assert f["empty"].fillvalue == 0.5
        assert float(f["empty"][999, 999]) == 0.5
        np.testing.assert_array_equal(f["dense"][...], np.arange(6))


def test_hdf5_expansion_budget_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Datasets declaring exactly the budget in all are read; one byte less budget refuses."""
    import h5py

    from clipcli.formats import hdf5 as hdf5_module
    from clipcli.formats.hdf5 import limits as hdf5_limits

    src = tmp_path / "two.h5"
    with h5py.File(src, "w") as f:
        f["a"] = np.ones(1000, np.float32)
        f["b"] = np.ones(1000, np.float32)
    monkeypatch.setattr(hdf5_limits, "MAX_EXPANSION", 0)
    monkeypatch.setattr(hdf5_limits, "SPARSE_CHECK_BYTES", 8000)
    with hdf5_module.Hdf5Reader(src) as reader:
        assert sum(info.nbytes for info in reader.infos) == 8000
    monkeypatch.setattr(hdf5_limits, "SPARSE_CHECK_BYTES", 7999)
    with pytest.raises(InputError, match="in all"):
        hdf5_module.Hdf5Reader(src)


def test_hdf5_attribute_budget_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import h5py

    from clipcli.formats import hdf5 as hdf5_module
    from clipcli.formats.hdf5 import limits as hdf5_limits

    src = tmp_path / "names.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(2, np.float32)
        f.attrs.create("names", np.array(["x" * 100] * 10, dtype=object), dtype=h5py.string_dtype())
    largest = 100  # each string is its own 100-byte heap object
    monkeypatch.setattr(hdf5_limits, "MAX_ATTRIBUTE_BYTES", 10 * largest)
    with hdf5_module.Hdf5Reader(src) as reader:
        assert reader.infos[0].name == "w"
    monkeypatch.setattr(hdf5_limits, "MAX_ATTRIBUTE_BYTES", 10 * largest - 1)
    with pytest.raises(InputError, match="variable-length attribute"):
        hdf5_module.Hdf5Reader(src)


# ------------------------------------------------------------------ Fortran-order npz


def fortran_npz(path: Path, shape: tuple[int, ...], compress: bool) -> np.ndarray:
    """np.savez of a transposed array writes it column-major (fortran_order: True)."""
    rng = np.random.default_rng(5)
    c_order = rng.standard_normal(shape[::-1]).astype(np.float32)
    tensor = c_order.T
    assert tensor.flags.f_contiguous
    assert tensor.ndim < 2 or not tensor.flags.c_contiguous
    (np.savez_compressed if compress else np.savez)(path, w=tensor)
    return tensor


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4, 5), (1,), ()])
@pytest.mark.parametrize("in_memory_limit", [0, 1 << 30])
def test_fortran_members_read_in_c_order(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    compress: bool,
    shape: tuple[int, ...],
    in_memory_limit: int,
) -> None:
    """Both paths (in memory; memory-mapped, from the npz or an inflated temp file) give
    numpy's own values, in any chunk size."""
    monkeypatch.setattr(npz_reader, "FORTRAN_IN_MEMORY_BYTES", in_memory_limit)
    path = tmp_path / "f.npz"
    tensor = fortran_npz(path, shape, compress)
    with np.load(path) as loaded:
        reference = loaded["w"]
    np.testing.assert_array_equal(reference, tensor)
    with npz_module.NpzReader(path) as reader:
        (info,) = reader.infos
        for chunk_elems in (1, 7, 1 << 20):
            flat = np.concatenate(
                [c.copy() for c in reader.chunks(info, chunk_elems)] or [np.zeros(0)]
            )
            np.testing.assert_array_equal(flat.astype(np.float32), reference.reshape(-1))
        np.testing.assert_array_equal(reader.read(info), reference)


def test_corrupt_stored_fortran_member_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(npz_reader, "FORTRAN_IN_MEMORY_BYTES", 0)
    path = tmp_path / "f.npz"
    fortran_npz(path, (64, 64), compress=False)
    data = bytearray(path.read_bytes())
    data[2000] ^= 0xFF  # inside the array data
    path.write_bytes(bytes(data))
    with npz_module.NpzReader(path) as reader, pytest.raises(InputError, match="CRC"):
        list(reader.chunks(reader.infos[0]))


@pytest.mark.slow
def test_large_fortran_member_within_memory_budget(tmp_path: Path) -> None:
    """An npz inflating one 300 MB column-major member (under the expansion budget): read
    whole, it peaked at twice its size before."""
    src = tmp_path / "fortran.npz"
    rows, cols = 5_000, 15_000  # 300 MB of float32: read whole, 600 MB
    import zipfile

    header = npy_bytes_header("<f4", (rows, cols)).replace(b"False", b"True ")
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 2, cols).astype(np.float32).tobytes() for _ in range(64)]
    with (
        zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
        archive.open("w.npy", "w", force_zip64=True) as member,
    ):
        member.write(header)
        for row in range(rows):
            member.write(blocks[row % 64])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = measured_run(["norms", "--format", "json", str(src)], out_dir, timeout=300)
    assert run.returncode == 0, run
    assert run.peak_rss < RSS_BUDGET, run


@pytest.mark.parametrize("shape", [(70, 3), (3, 70), (5, 6, 7, 8), (1000, 2, 2), (2, 1, 900)])
@pytest.mark.parametrize("tile_bytes", [4, 64, 4096, 1 << 20])
def test_fortran_transpose_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], tile_bytes: int
) -> None:
    """Every tiling of the on-disk transpose (whole rows, partial tiles, batches of small
    matrices) gives numpy's C order."""
    monkeypatch.setattr(npz_reader, "FORTRAN_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(npz_fortran, "FORTRAN_TILE_BYTES", tile_bytes)
    path = tmp_path / "f.npz"
    tensor = fortran_npz(path, shape, compress=True)
    with npz_module.NpzReader(path) as reader:
        (info,) = reader.infos
        flat = np.concatenate([c.copy() for c in reader.chunks(info, 100)])
    np.testing.assert_array_equal(flat, np.ascontiguousarray(tensor).reshape(-1))


class _Unseekable:
    """A write-only stream: zipfile then writes data descriptors after each member."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("method", ["stored", "deflate"])
@pytest.mark.parametrize("zip64", [False, True])
def test_members_with_data_descriptors_are_adjacent_not_overlapping(
    tmp_path: Path, method: str, zip64: bool
) -> None:
    """Data descriptors (streamed zips) and ZIP64 descriptors: each member's span ends
    exactly where the next begins, which must be accepted."""
    import zipfile

    stream = _Unseekable()
    compression = zipfile.ZIP_STORED if method == "stored" else zipfile.ZIP_DEFLATED
    arrays = {f"t{i}": np.arange(i + 3, dtype=np.float32) for i in range(4)}
    with zipfile.ZipFile(stream, "w", compression) as archive:  # type: ignore[call-overload]
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=zip64) as member:
                member.write(npy_bytes_header("<f4", array.shape) + array.tobytes())
    path = tmp_path / "streamed.npz"
    path.write_bytes(bytes(stream.data))
    with zipfile.ZipFile(path) as archive:
        assert all(info.flag_bits & 0x08 for info in archive.infolist())
    with npz_module.NpzReader(path) as reader:
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info), arrays[info.name])


def test_local_header_naming_another_member_is_refused(tmp_path: Path) -> None:
    body = npy_bytes_header("<f4", (4,)) + bytes(16)
    local = Member("a.npy", 0, 0, 0, len(body), len(body), zlib.crc32(body))
    central = Member("b.npy", 0, 0, 0, len(body), len(body), zlib.crc32(body))
    src = tmp_path / "names.npz"
    build_zip(src, local_header(local) + body, [central])
    with pytest.raises(InputError, match="disagrees"):
        npz_module.NpzReader(src)


def test_local_header_sizes_disagreeing_with_the_central_directory_are_refused(
    tmp_path: Path,
) -> None:
    body = npy_bytes_header("<f4", (4,)) + bytes(16)
    local = Member("a.npy", 0, 0, 0, len(body) - 8, len(body) - 8, zlib.crc32(body))
    central = Member("a.npy", 0, 0, 0, len(body), len(body), zlib.crc32(body))
    src = tmp_path / "sizes.npz"
    build_zip(src, local_header(local) + body, [central])
    with pytest.raises(InputError, match="disagrees"):
        npz_module.NpzReader(src)


def test_hdf5_chunk_size_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library decodes whole chunks: a chunk of exactly MAX_CHUNK_BYTES is read, one
    byte over is refused (the default limit is 256 MiB)."""
    import h5py

    from clipcli.formats import hdf5 as hdf5_module
    from clipcli.formats.hdf5 import limits as hdf5_limits

    src = tmp_path / "chunks.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.ones((40, 30), np.float32), chunks=(10, 30))
    monkeypatch.setattr(hdf5_limits, "MAX_CHUNK_BYTES", 10 * 30 * 4)
    with hdf5_module.Hdf5Reader(src) as reader:
        assert reader.read(reader.infos[0]).sum() == 1200
    monkeypatch.setattr(hdf5_limits, "MAX_CHUNK_BYTES", 10 * 30 * 4 - 1)
    with pytest.raises(InputError, match="chunks of 1200 bytes"):
        hdf5_module.Hdf5Reader(src)
