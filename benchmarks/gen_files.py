"""Checkpoint files for the benchmarks, generated from seeded samples: safetensors written
by hand in bounded memory, npz and HDF5 copies of the same data."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import GEN_CHUNK, GIB, MIB, human, log


@dataclass
class Checkpoint:
    path: Path
    kind: str  # "safetensors" | "npz" | "HDF5"
    dtype: str
    n_tensors: int
    shape: tuple[int, ...]  # of every tensor

    nbytes: int = 0  # remembered after generation: the files may be gone by report time

    @property
    def size(self) -> int:
        if not self.nbytes:
            self.nbytes = self.path.stat().st_size
        return self.nbytes

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype in ("BF16", "F16") else 4

    @property
    def largest_tensor_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.itemsize


def write_safetensors(ck: Checkpoint, seed: int) -> None:
    """Hand-written safetensors (8-byte LE header length, compact JSON padded with spaces to
    8 bytes, raw little-endian data), streamed chunk by chunk so memory stays bounded.
    BF16 = the top 16 bits of the float32 sample; F16 = the sample rounded to float16."""
    if ck.path.exists():
        return
    assert sys.byteorder == "little"
    itemsize = ck.itemsize
    numel = int(np.prod(ck.shape))
    header: dict[str, object] = {"__metadata__": {"format": "pt", "generator": "clipcli bench"}}
    offset = 0
    for i in range(ck.n_tensors):
        header[f"model.layers.{i}.weight"] = {
            "dtype": ck.dtype,
            "shape": list(ck.shape),
            "data_offsets": [offset, offset + numel * itemsize],
        }
        offset += numel * itemsize
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    partial = ck.path.with_name(ck.path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(ck.n_tensors):
            left = numel
            while left:
                n = min(left, GEN_CHUNK)
                values = rng.standard_normal(n, dtype=np.float32)
                if ck.dtype == "BF16":
                    values = (values.view(np.uint32) >> 16).astype(np.uint16)
                elif ck.dtype == "F16":
                    values = values.astype(np.float16)
                out.write(memoryview(values))
                left -= n
    os.replace(partial, ck.path)


def safetensors_entries(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def tensors_of(src: Path) -> list[tuple[str, np.ndarray]]:
    """(name, memmap view) per tensor of an F32 safetensors file: no copies."""
    base, header = safetensors_entries(src)
    data = np.memmap(src, dtype=np.uint8, mode="r", offset=base)
    out = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        out.append((name, data[begin:end].view("<f4").reshape(entry["shape"])))
    return out


def write_npz(src: Path, ck: Checkpoint) -> None:
    """What np.savez writes (a ZIP_STORED zip64 archive of NAME.npy members), but streamed
    from the safetensors file tensor by tensor instead of from arrays held in memory."""
    if ck.path.exists():
        return
    partial = ck.path.with_name(ck.path.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in tensors_of(src):
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    os.replace(partial, ck.path)


def write_h5(src: Path, ck: Checkpoint) -> None:
    """One contiguous (unchunked, uncompressed) dataset per tensor, same names and data."""
    if ck.path.exists():
        return
    import h5py

    partial = ck.path.with_name(ck.path.name + ".partial")
    with h5py.File(partial, "w") as f:
        for name, array in tensors_of(src):
            f.create_dataset(name, data=array)
    os.replace(partial, ck.path)


@dataclass
class Files:
    fp32: Checkpoint  # the 2 GiB fp32 file
    bf16: Checkpoint  # 2 GiB bf16 (same bytes, twice the elements)
    fp16: Checkpoint  # 2 GiB fp16 (same bytes, twice the elements)
    fp32_small: Checkpoint  # 0.5 GiB fp32: the RSS-growth check
    single: Checkpoint  # one 1 GiB fp32 tensor
    tiny: Checkpoint  # 1 MiB: start-up time
    npz: Checkpoint  # same data as fp32, np.savez layout, uncompressed
    h5: Checkpoint  # same data as fp32, HDF5

    def all(self) -> list[Checkpoint]:
        return [
            *(self.fp32, self.bf16, self.fp16, self.fp32_small, self.single, self.tiny),
            *(self.npz, self.h5),
        ]


def plan(directory: Path, quick: bool) -> Files:
    big, small, single = (64 * MIB, 16 * MIB, 32 * MIB) if quick else (2 * GIB, GIB // 2, GIB)
    cols = 1024

    def st(tag: str, total: int, n: int, dtype: str) -> Checkpoint:
        itemsize = 2 if dtype in ("BF16", "F16") else 4
        rows = total // n // itemsize // cols
        path = directory / f"{tag}-{dtype.lower()}-{n}x{rows}x{cols}.safetensors"
        return Checkpoint(path, "safetensors", dtype, n, (rows, cols))

    fp32 = st("big", big, 64, "F32")

    def same_as_fp32(suffix: str, kind: str) -> Checkpoint:
        return Checkpoint(fp32.path.with_suffix(suffix), kind, "F32", fp32.n_tensors, fp32.shape)

    return Files(
        fp32=fp32,
        bf16=st("big", big, 128, "BF16"),
        fp16=st("big", big, 128, "F16"),
        fp32_small=st("small", small, 64, "F32"),
        single=st("single", single, 1, "F32"),
        tiny=st("tiny", MIB, 8, "F32"),
        npz=same_as_fp32(".npz", "npz"),
        h5=same_as_fp32(".h5", "HDF5"),
    )


def generate(files: Files) -> None:
    # fp16 comes last so that the other files keep the seeds they had before it was added.
    safetensors = [files.fp32, files.bf16, files.fp32_small, files.single, files.tiny, files.fp16]
    for seed, ck in enumerate(safetensors):
        started = time.perf_counter()
        write_safetensors(ck, seed + 1)
        log(f"  {ck.path.name}: {human(ck.size)} in {time.perf_counter() - started:.1f} s")
    for ck, writer in ((files.npz, write_npz), (files.h5, write_h5)):
        started = time.perf_counter()
        writer(files.fp32.path, ck)
        log(f"  {ck.path.name}: {human(ck.size)} in {time.perf_counter() - started:.1f} s")
