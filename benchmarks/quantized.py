"""Quantized checkpoints (issue 21): norms and `convert --dtype bfloat16` of a block-FP8
checkpoint (DeepSeek-V3 layout: F8_E4M3 codes + F32 weight_scale_inv per 128 x 128 block).

Rows (whole processes, CPU seconds user+sys and wall, peak RSS from /usr/bin/time):
- norms of the block-FP8 file vs the plain fp8 floor on the same bytes: a memmap of the
  codes, a 256-entry float64 table per code byte, `c @ c` per chunk, single-threaded, no
  scales, no validation (target <= 1.5x);
- convert --dtype bfloat16 of it vs `cp` + sync of a file of the output's size (the
  converted file itself), target <= 2x;
- clip --global 1.0 of it vs its norms (CPU s; the factor search's checks from code
  energies, issue 20);
- RSS: norms and convert on the big file vs a file a quarter its size (flat: <= 1.1x).

    python benchmarks/quantized.py [--gib 2] [--runs 3] [--workdir DIR] [--keep]

The machine is shared: CPU seconds are the fairer figure, wall seconds are shown too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLIPCLI = [sys.executable, "-m", "clipcli"]
ROWS, COLUMNS, BLOCK = 8192, 16384, 128  # one weight: 128 MiB of codes
CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}

FLOOR = r"""
import json, os, struct, sys
for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
import numpy as np, ml_dtypes
table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
path = sys.argv[1]
with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8)); header = json.loads(f.read(n))
header.pop("__metadata__", None)
data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
total = 0.0
for name, e in header.items():
    if e["dtype"] != "F8_E4M3":
        continue
    b, end = e["data_offsets"]
    for i in range(b, end, 1 << 20):
        c = table[data[i:min(i + (1 << 20), end)]]
        total += float(c @ c)
print(repr(total ** 0.5))
"""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_block_fp8(path: Path, weights: int, seed: int = 0) -> None:
    """`weights` weights of [ROWS, COLUMNS] e4m3fn codes (no NaN code) with float32 block
    scales, streamed to disk a weight at a time."""
    rng = np.random.default_rng(seed)
    scale_shape = [ROWS // BLOCK, COLUMNS // BLOCK]
    header: dict[str, object] = {}
    offset = 0
    for k in range(weights):
        codes = ROWS * COLUMNS
        header[f"layers.{k}.weight"] = {
            "dtype": "F8_E4M3",
            "shape": [ROWS, COLUMNS],
            "data_offsets": [offset, offset + codes],
        }
        offset += codes
        scales = scale_shape[0] * scale_shape[1] * 4
        header[f"layers.{k}.weight_scale_inv"] = {
            "dtype": "F32",
            "shape": scale_shape,
            "data_offsets": [offset, offset + scales],
        }
        offset += scales
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(weights):
            codes = rng.integers(0, 256, ROWS * COLUMNS, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] &= 0xFE  # 0x7F / 0xFF are NaN: not in real weights
            out.write(codes.tobytes())
            scales = rng.uniform(1e-4, 1e-3, scale_shape[0] * scale_shape[1]).astype(np.float32)
            out.write(scales.tobytes())


def reference_norm(path: Path) -> float:
    """The first weight's norm, dequantized here with numpy (ml_dtypes' table of codes)."""
    import ml_dtypes

    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    b, e = header["layers.0.weight"]["data_offsets"]
    sb, se = header["layers.0.weight_scale_inv"]["data_offsets"]
    scales = data[sb:se].view(np.float32).astype(np.float64).reshape(ROWS // BLOCK, -1)
    total = 0.0
    for r in range(0, ROWS, BLOCK):
        codes = table[data[b + r * COLUMNS : b + (r + BLOCK) * COLUMNS]].reshape(BLOCK, COLUMNS)
        values = codes * np.repeat(scales[r // BLOCK], BLOCK)[None, :]
        total += float(np.sum(values * values))
    return total**0.5


def gib(path: Path) -> float:
    return path.stat().st_size / 2**30


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(wall s, CPU s user+sys, peak RSS MiB) of one run."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        subprocess.run(
            ["/usr/bin/time", "-o", report.name, "-f", "%M %U %S", *argv],
            check=True,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        wall = time.perf_counter() - start
        rss_kib, user, system = report.read().split()[-3:]
    return wall, float(user) + float(system), int(rss_kib) / 1024


def median_of(runs: int, argv: list[str], before: object = None) -> tuple[float, float, float]:
    samples = []
    for _ in range(runs):
        if callable(before):
            before()
        samples.append(timed(argv))
    walls, cpus, rss = zip(*samples, strict=True)
    return statistics.median(walls), statistics.median(cpus), max(rss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="clipcli-quant-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    weights = max(1, round(args.gib * 8))  # 128 MiB of codes each
    # Model directories: the block size comes from config.json (the shapes alone fit
    # 128..130, which clipcli refuses to guess between).
    big_dir, small_dir = workdir / "fp8_block", workdir / "fp8_block_small"
    for directory in (big_dir, small_dir):
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(CONFIG))
    big, small = big_dir / "model.safetensors", small_dir / "model.safetensors"
    out, copy = workdir / "out.safetensors", workdir / "copy.safetensors"
    floor_script = workdir / "floor_fp8.py"
    floor_script.write_text(FLOOR)
    if not big.exists():
        log(f"writing {big} ({weights} weights)")
        write_block_fp8(big, weights)
    if not small.exists():
        write_block_fp8(small, max(1, weights // 4), seed=1)
    rows = []

    def row(
        job: str,
        ours: tuple[float, float, float],
        base: tuple[float, float, float] | None,
        base_name: str,
        target: str,
        limit: float | None,
        wall: bool = False,
    ) -> None:
        k = 0 if wall else 1
        ratio = ours[k] / base[k] if base else None
        met = "-" if ratio is None or limit is None else ("MET" if ratio <= limit else "NOT MET")
        rows.append((job, ours, base, base_name, ratio, target, met))
        log(f"{job}: {ours} vs {base_name} {base} ratio {ratio}")

    # correctness first: clipcli's norm of the first weight = an independent numpy one
    # (table of the 256 codes, scales repeated over their blocks, float64 sums)
    report = json.loads(
        subprocess.run(
            [*CLIPCLI, "norms", "--format", "json", str(big_dir)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    first = next(t for t in report["tensors"] if t["name"] == "layers.0.weight")
    assert first["shape"] == [ROWS, COLUMNS], first
    assert abs(first["norm"] - reference_norm(big)) <= 1e-9 * first["norm"], first
    floor_value = float(
        subprocess.run(
            [sys.executable, str(floor_script), str(big)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert floor_value > 0

    norms = [*CLIPCLI, "norms", "--format", "json", str(big_dir)]
    floor = [sys.executable, str(floor_script), str(big)]
    ours = norms_figures = median_of(args.runs, norms)
    row(
        f"norms, {args.gib:g} GiB block-FP8",
        ours,
        median_of(args.runs, floor),
        "plain fp8 floor (same bytes)",
        "<= 1.5x floor (CPU s)",
        1.5,
    )

    def fresh_out() -> None:
        out.unlink(missing_ok=True)
        os.sync()

    convert = [*CLIPCLI, "convert", "--dtype", "bfloat16", str(big_dir), str(out)]
    ours = median_of(args.runs, convert, fresh_out)
    shutil.copyfile(out, workdir / "cp_source.safetensors")

    def fresh_copy() -> None:
        copy.unlink(missing_ok=True)
        os.sync()

    cp = ["sh", "-c", f"cp {workdir / 'cp_source.safetensors'} {copy} && sync {copy}"]
    row(
        f"convert --dtype bfloat16, {args.gib:g} GiB block-FP8 -> {gib(out):.2f} GiB",
        ours,
        median_of(args.runs, cp, fresh_copy),
        "cp + sync of the output's size",
        "<= 2x cp + sync (wall s: cp's work is the kernel's I/O)",
        2.0,
        wall=True,
    )
    (workdir / "cp_source.safetensors").unlink()
    copy.unlink(missing_ok=True)

    # clip: the factor search checks ten or so factors, each from the weights' code
    # energies (counted once) and their scales, not by decoding every weight again
    clipped = workdir / "clipped"

    def fresh_clip() -> None:
        shutil.rmtree(clipped, ignore_errors=True)
        os.sync()

    clip = [*CLIPCLI, "clip", "--global", "1.0", str(big_dir), str(clipped)]
    row(
        f"clip --global 1.0 (durable), {args.gib:g} GiB block-FP8",
        median_of(args.runs, clip, fresh_clip),
        norms_figures,
        "norms of the same checkpoint",
        "(info) <= 3x norms (CPU s)",
        3.0,
    )
    fresh_clip()

    small_norms = median_of(args.runs, [*CLIPCLI, "norms", "--format", "json", str(small_dir)])
    big_norms = median_of(1, norms)
    rows.append(
        (
            f"norms RSS, {gib(small):.2f} -> {gib(big):.2f} GiB",
            big_norms,
            small_norms,
            "quarter-size file",
            big_norms[2] / small_norms[2],
            "RSS <= 1.1x",
            "MET" if big_norms[2] <= 1.1 * small_norms[2] else "NOT MET",
        )
    )
    small_out = workdir / "out_small.safetensors"
    small_out.unlink(missing_ok=True)
    small_convert = timed(
        [*CLIPCLI, "convert", "--dtype", "bfloat16", str(small_dir), str(small_out)]
    )
    small_out.unlink()
    fresh_out()
    big_convert = timed(convert)
    rows.append(
        (
            f"convert --dtype bfloat16 RSS, {gib(small):.2f} -> {gib(big):.2f} GiB",
            big_convert,
            small_convert,
            "quarter-size file",
            big_convert[2] / small_convert[2],
            "RSS <= 1.1x",
            "MET" if big_convert[2] <= 1.1 * small_convert[2] else "NOT MET",
        )
    )
    out.unlink(missing_ok=True)
    if not args.keep:
        shutil.rmtree(workdir)

    load = os.getloadavg()
    print(
        f"- machine: {os.cpu_count()} cores, shared (load average {load[0]:.2f}/{load[1]:.2f}/"
        f"{load[2]:.2f} at the end): ratios are of CPU seconds (user + sys), wall shown too"
    )
    print(f"- medians of {args.runs} runs; peak RSS = the largest /usr/bin/time %M")
    print()
    print(
        "| job | clipcli CPU s (wall) | baseline | baseline CPU s (wall) | ratio | target | met? "
        "| peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for job, (wall, cpu, rss), base, base_name, ratio, target, met in rows:
        shown = "-" if base is None else f"{base[1]:.2f} ({base[0]:.2f})"
        if "RSS" in job:
            shown = "-" if base is None else f"{base[2]:.0f} MiB"
        r = "-" if ratio is None else f"{ratio:.2f}"
        print(
            f"| {job} | {cpu:.2f} ({wall:.2f}) | {base_name} | {shown} | {r} | {target} | {met} "
            f"| {rss:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
