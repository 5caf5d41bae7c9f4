"""The HDF5 chunk-count budget (issue 18 item 9): a 6.2 MB file of 150,000 one-element
chunks made `norms` peak at ~1 GB (the library keeps ~7 KiB of state for each chunk a read
touches), which no byte budget caught. All chunked datasets of a file together may declare
at most one chunk per 4 KiB of file plus 8,192 (limits.chunk_budget); past it, exit 3
before the chunk index is walked.

Peak memory is measured in a child process (resource.getrusage of its only child).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from peak_memory import peak_rss as _peak

from clipcli.errors import InputError
from clipcli.formats import hdf5 as hdf5_module
from clipcli.formats.hdf5 import limits

RSS_BUDGET = 300 << 20  # bytes, as tests/hostile/test_resource_budgets.py


def _one_element_chunks(path: Path, counts: list[int]) -> int:
    """Datasets of float32 in chunks of one element; the file's size."""
    with h5py.File(path, "w") as f:
        for index, count in enumerate(counts):
            f.create_dataset(f"w{index}", data=np.arange(count, dtype=np.float32), chunks=(1,))
    return path.stat().st_size


def test_many_one_element_chunks_are_refused_within_memory(tmp_path: Path) -> None:
    src = tmp_path / "chunks.h5"
    size = _one_element_chunks(src, [150_000])
    assert size < 7_000_000
    code, peak, stderr = _peak("norms", src)
    assert code == 3, stderr
    assert stderr.startswith("clipcli: error: ")
    assert stderr.count("\n") == 1
    assert "chunks in all" in stderr
    assert peak < RSS_BUDGET, peak


def test_a_file_exactly_at_the_default_budget_is_read_within_memory(tmp_path: Path) -> None:
    """One-element chunks, as many as the default budget allows for the file's own size:
    read, every value right, peak memory within the budget; one chunk more is refused."""
    src = tmp_path / "at.h5"
    count = limits.FREE_CHUNKS
    for _ in range(10):  # the size grows ~40 bytes a chunk: find the fixed point
        size = _one_element_chunks(src, [count])
        if count == limits.chunk_budget(size):
            break
        count = limits.chunk_budget(size)
    assert count == limits.chunk_budget(src.stat().st_size)
    code, peak, stderr = _peak("norms", "--format", "csv", src)
    assert code == 0, stderr
    assert peak < RSS_BUDGET, peak
    with hdf5_module.Hdf5Reader(src) as reader:
        [info] = reader.infos
        np.testing.assert_array_equal(reader.read(info), np.arange(count, dtype=np.float32))


@pytest.mark.parametrize("over", [0, 1])
def test_chunk_budget_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    """Chunks of every dataset count together, partial ones and unwritten ones of a
    dataset with stored data too: 4 (10 elements in 3s, the last partial) + 4 (4 x 5 in
    2 x 3 chunks: 2 x 2) + 2 (one never written) = 10. A dataset with no stored chunk at
    all ("never") is measured from its fill value, never read: it counts none."""
    src = tmp_path / "three.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("a", data=np.arange(10, dtype=np.float32), chunks=(3,), maxshape=(20,))
        f.create_dataset("b", data=np.ones((4, 5), np.float64), chunks=(2, 3))
        f.create_dataset("c", shape=(6,), dtype=np.float32, chunks=(3,))
        f["c"][0] = 1.0
        f.create_dataset("never", shape=(6000,), dtype=np.float32, chunks=(1,))
        f["plain"] = np.ones(1000, np.float32)  # contiguous: no chunks
    monkeypatch.setattr(limits, "FREE_CHUNKS", 10 - src.stat().st_size // limits.BYTES_PER_CHUNK)
    monkeypatch.setattr(limits, "FREE_CHUNKS", limits.FREE_CHUNKS - over)
    if over:
        with pytest.raises(InputError, match=r"more than 9 HDF5 chunks in all \(10 so far\)"):
            hdf5_module.Hdf5Reader(src)
        return
    with hdf5_module.Hdf5Reader(src) as reader:
        assert [info.name for info in reader.infos] == ["a", "b", "c", "never", "plain"]
