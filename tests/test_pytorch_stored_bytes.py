"""A PyTorch checkpoint's contiguous tensors as the bytes they lie in (issue 20): where
the stored bytes are the values (a little-endian file, or one byte an element),
PyTorchReader.stored_bytes says where, and its chunk loaders are RangeLoaders. A clip's
measuring pass then counts 8/16-bit float chunks in helper processes, as for a
safetensors file, and an unchanged tensor is copied to a safetensors output by the
kernel. References: the values torch itself recorded for the fixtures
(tests/data/pytorch/*.expected.npz), safetensors' own reader, and the same clip with the
helpers off.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from expect import REPO_ROOT
from handmade import write_safetensors
from safetensors.numpy import load_file
from test_counting_processes import _helpers_used, assert_helpers_count_as_threads

from clipcli.cli.entry import main
from clipcli.formats.base import RangeLoader
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import PyTorchReader
from clipcli.formats.safetensors import writer as safetensors_writer

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
FIXTURES = sorted(p.name for p in DATA.iterdir() if p.suffix in (".pt", ".pth"))


def _expected(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name.split('.')[0]}.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


@pytest.mark.parametrize("name", FIXTURES)
def test_stored_bytes_are_the_values_torch_recorded(name: str) -> None:
    """Every contiguous tensor of a little-endian fixture (and every one-byte one of the
    big-endian fixture) has stored bytes, and they are its values; a strided view or a
    swapped multi-byte tensor has none, and its loaders are not RangeLoaders."""
    want = _expected(name)
    big = "big_endian" in name
    with open_reader(DATA / name) as reader:
        assert isinstance(reader, PyTorchReader)
        for info in reader.infos:
            stored = reader.stored_bytes(info)
            contiguous = reader._located[info.name].contiguous
            if not contiguous or (big and info.dtype.itemsize > 1):
                assert stored is None, info.name
                loaders = reader.chunk_loaders(info)
                first = None if loaders is None else next(iter(loaders), None)
                assert not isinstance(first, RangeLoader), info.name
                continue
            assert stored is not None, info.name
            assert stored.end - stored.begin == info.nbytes
            with stored.in_use() as fd:
                raw = os.pread(fd, info.nbytes, stored.begin)
            values = np.frombuffer(raw, info.dtype)
            widened = values.astype(np.float64) if values.dtype.kind not in "biu" else values
            np.testing.assert_array_equal(
                widened, want[info.name].reshape(-1), err_msg=f"{name}: {info.name}"
            )


def _half_precision_pt(tmp_path: Path) -> Path:
    """bfloat16, float16 and float32 weights in a .pt clipcli writes (torch is not
    installed here)."""
    rng = np.random.default_rng(47)
    src = write_safetensors(
        tmp_path / "m.safetensors",
        {
            "a.weight": (rng.standard_normal((64, 48)) * 3).astype(ml_dtypes.bfloat16),
            "b.weight": rng.standard_normal((32, 40)).astype(np.float16),
            "c.weight": rng.standard_normal((16, 16)).astype(np.float32),
        },
    )
    out = tmp_path / "m.pt"
    assert main(["convert", "-q", str(src), str(out)]) == 0
    return out


@pytest.mark.parametrize("mode", [["--global", "0.5"], ["--norm", "0.5"]], ids=" ".join)
def test_a_pytorch_clip_is_counted_by_helpers_and_writes_what_threads_did(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, mode: list[str]
) -> None:
    assert_helpers_count_as_threads(run_main, monkeypatch, _half_precision_pt(tmp_path), mode)


def test_a_big_endian_pytorch_file_is_counted_in_the_threads(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its stored bytes are not its values: no helper counts its float16 and bfloat16
    tensors; the little-endian twin of the same fixture is counted by helpers."""
    counted = _helpers_used(monkeypatch)
    for name in ["zip_big_endian.pt", "zip_v2.pt"]:
        run = run_main("clip", "--norm", "0.1", "-q", "--no-fsync", DATA / name, tmp_path / name)
        assert run.code == 0, run.stderr
        assert bool(counted) == (name == "zip_v2.pt"), name


def test_unchanged_tensors_are_copied_by_the_kernel_to_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert .pt -> .safetensors copies each tensor's stored bytes file to file; the
    output is what safetensors reads as the values."""
    src = _half_precision_pt(tmp_path)
    copied: list[int] = []
    real = safetensors_writer.SafetensorsWriter._copy_range

    def spy(self: Any, source_fd: int, begin: int, end: int, position: int) -> None:
        copied.append(end - begin)
        real(self, source_fd, begin, end, position)

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "_copy_range", spy)
    out = tmp_path / "back.safetensors"
    assert main(["convert", "-q", str(src), str(out)]) == 0
    assert copied
    got = load_file(out)
    want = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(want)
    for key, values in want.items():
        assert got[key].tobytes() == values.tobytes(), key


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_a_copy_ahead_holds_its_shard_while_the_directory_lets_shards_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """A model directory keeps MAX_OPEN_SHARDS shards open (1 here). An unchanged tensor's
    kernel copy is queued on the copier's thread; by the time it runs, the directory has
    let its shard go and opened the next, which may take the same descriptor number: a
    copy that kept the number copied shard 65's bytes for shard 1's tensor, exit 0, or
    failed with EBADF as a write error (attack s47c, 80 shards; safetensors before this
    session too). The copy holds its shard's descriptor (StoredBytes.in_use) where it
    runs. While the first copy runs, the directory opens the other shards."""
    from clipcli.formats.sharded import reader as sharded_reader

    directory = tmp_path / "model"
    directory.mkdir()
    weight_map = {}
    stem = "model" if suffix == ".safetensors" else "pytorch_model"
    for shard in range(3):
        name = f"t{shard}"
        src = write_safetensors(
            tmp_path / f"{name}.safetensors", {name: np.full((128, 128), shard + 1.0, np.float32)}
        )
        file = f"{stem}-{shard + 1:05d}-of-00003{suffix}"
        if suffix == ".safetensors":
            src.rename(directory / file)
        else:
            assert main(["convert", "-q", str(src), str(directory / file)]) == 0
        weight_map[name] = file
    index = directory / f"{stem}{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.setattr(sharded_reader, "MAX_OPEN_SHARDS", 1)
    directories: list[Any] = []
    real_used = sharded_reader.ShardedReader._used

    def used(self: Any, shard: str) -> None:
        directories.append(self)
        real_used(self, shard)

    monkeypatch.setattr(sharded_reader.ShardedReader, "_used", used)
    real_copy = safetensors_writer.SafetensorsWriter._copy_range
    copied_from: list[str] = []

    def copy_range(self: Any, source_fd: int, begin: int, end: int, position: int) -> None:
        if not copied_from:  # the directory lets this shard go and opens the others
            for shard in sorted(set(weight_map.values()))[1:]:
                with (
                    directories[-1]
                    .shard_reader(shard)
                    .stored_bytes(directories[-1].shard_reader(shard).infos[0])
                    .in_use()
                ):
                    pass
        copied_from.append(os.path.basename(os.readlink(f"/proc/self/fd/{source_fd}")))
        real_copy(self, source_fd, begin, end, position)

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "_copy_range", copy_range)
    out = tmp_path / "one.safetensors"
    assert main(["clip", "--global", "1e9", "-q", "--no-fsync", str(directory), str(out)]) == 0
    assert copied_from[0] == weight_map["t0"]
    got = load_file(out)
    for shard in range(3):
        assert np.all(got[f"t{shard}"] == shard + 1.0), shard
