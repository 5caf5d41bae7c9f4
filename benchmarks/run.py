"""clipcli benchmarks: whole processes, warm page cache, median of N runs, peak RSS.

    python benchmarks/run.py            # full run (2 GiB files), writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick    # smoke run with small files

Every checkpoint is generated here, seeded, in a temp dir (or --keep DIR to reuse them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PY = sys.executable
CLIPCLI = [PY, "-m", "clipcli"]
TIME = shutil.which("time") or "/usr/bin/time"
GIB = 1 << 30
MIB = 1 << 20


# ------------------------------------------------------------------ data


def write_safetensors(path: Path, n_tensors: int, total_bytes: int, dtype: str, seed: int) -> None:
    """Streamed tensor by tensor, so generating 2 GiB needs ~one tensor of memory."""
    if path.exists():
        return
    itemsize = 2 if dtype == "BF16" else 4
    per = total_bytes // n_tensors // itemsize
    cols = 1024 if per % 1024 == 0 else 1
    header, offset = {}, 0
    for i in range(n_tensors):
        header[f"model.layers.{i}.weight"] = {
            "dtype": dtype,
            "shape": [per // cols, cols],
            "data_offsets": [offset, offset + per * itemsize],
        }
        offset += per * itemsize
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(n_tensors):
            values = rng.standard_normal(per, dtype=np.float32)
            if dtype == "BF16":
                values = (values.view(np.uint32) >> 16).astype(np.uint16)
            out.write(values.tobytes())


def safetensors_arrays(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def write_npz_and_h5(src: Path, npz: Path, h5: Path) -> None:
    if npz.exists() and h5.exists():
        return
    import h5py

    arrays = safetensors_arrays(src)
    np.savez(npz, **arrays)
    with h5py.File(h5, "w") as f:
        for name, array in arrays.items():
            f.create_dataset(name, data=array)


@dataclass
class Files:
    fp32: Path
    bf16: Path
    fp32_small: Path  # for RSS growth and the npz/HDF5 comparison
    single: Path
    tiny: Path
    npz: Path
    h5: Path


def generate(directory: Path, quick: bool) -> Files:
    big = 64 * MIB if quick else 2 * GIB
    small = 16 * MIB if quick else GIB // 2
    files = Files(
        fp32=directory / "fp32.safetensors",
        bf16=directory / "bf16.safetensors",
        fp32_small=directory / "fp32_small.safetensors",
        single=directory / "single.safetensors",
        tiny=directory / "tiny.safetensors",
        npz=directory / "small.npz",
        h5=directory / "small.h5",
    )
    write_safetensors(files.fp32, 64, big, "F32", 1)
    write_safetensors(files.bf16, 128, big, "BF16", 2)
    write_safetensors(files.fp32_small, 64, small, "F32", 3)
    write_safetensors(files.single, 1, big // 2, "F32", 4)
    write_safetensors(files.tiny, 8, MIB, "F32", 5)
    write_npz_and_h5(files.fp32_small, files.npz, files.h5)
    return files


# ------------------------------------------------------------------ measuring


@dataclass
class Timing:
    seconds: float  # median wall time
    rss_mib: float  # largest peak RSS over the runs


def measure(cmd: Sequence[str], runs: int, before: Callable[[], None] | None = None) -> Timing:
    """One warm-up, then `runs` timed runs; each under /usr/bin/time for its peak RSS."""
    walls, peaks = [], []
    for attempt in range(runs + 1):
        if before is not None:
            before()
        with tempfile.NamedTemporaryFile("r") as rss_file:
            start = time.perf_counter()
            subprocess.run(
                [TIME, "-f", "%M", "-o", rss_file.name, *cmd],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            wall = time.perf_counter() - start
            peak_kib = int(rss_file.read().strip().splitlines()[-1])
        if attempt:  # the first run only warms the page cache
            walls.append(wall)
            peaks.append(peak_kib / 1024)
    return Timing(statistics.median(walls), max(peaks))


def fresh_output(path: Path) -> Callable[[], None]:
    """Delete OUT and flush dirty pages before a run, so each run writes a new file into a
    quiet page cache (this VM's disk throttles writers hard once dirty data piles up)."""

    def reset() -> None:
        path.unlink(missing_ok=True)
        os.sync()

    return reset


@dataclass
class Row:
    job: str
    ours: Timing
    baseline: str
    base: Timing | None
    target: str
    met: bool | None

    def cells(self) -> list[str]:
        ratio = f"{self.ours.seconds / self.base.seconds:.2f}" if self.base else "-"
        base = f"{self.base.seconds:.3f} s" if self.base else "-"
        verdict = "-" if self.met is None else ("MET" if self.met else "NOT MET")
        return [
            self.job,
            f"{self.ours.seconds:.3f} s",
            f"{self.baseline} {base}".strip(),
            ratio,
            f"{self.ours.rss_mib:.0f} MiB",
            self.target,
            verdict,
        ]


def run_all(files: Files, out_dir: Path, runs: int, only: set[str]) -> list[Row]:
    rows: list[Row] = []
    out = out_dir / "out.safetensors"
    reset = fresh_output(out)

    def want(name: str) -> bool:
        return not only or name in only

    floor_fp32 = measure([PY, str(HERE / "floor_norms.py"), str(files.fp32)], runs)
    if want("norms"):
        ours = measure([*CLIPCLI, "norms", "--format", "json", str(files.fp32)], runs)
        naive = measure([PY, str(HERE / "naive_norms.py"), str(files.fp32)], runs)
        rows.append(
            Row(
                "norms fp32",
                ours,
                "floor",
                floor_fp32,
                "≤ 1.25 × floor",
                ours.seconds <= 1.25 * floor_fp32.seconds,
            )
        )
        rows.append(
            Row(
                "norms fp32 vs naive",
                ours,
                "naive",
                naive,
                "≥ 5× faster",
                naive.seconds >= 5 * ours.seconds,
            )
        )
        bf16 = measure([*CLIPCLI, "norms", "--format", "json", str(files.bf16)], runs)
        rows.append(
            Row(
                "norms bf16 (same bytes)",
                bf16,
                "fp32 floor",
                floor_fp32,
                "≤ 2 × fp32 floor",
                bf16.seconds <= 2 * floor_fp32.seconds,
            )
        )
        small = measure([*CLIPCLI, "norms", "--format", "json", str(files.fp32_small)], runs)
        rows.append(
            Row(
                "norms RSS 0.5 GiB → 2 GiB",
                ours,
                "0.5 GiB",
                small,
                "≤ 200 MiB, ≤ +10%",
                ours.rss_mib <= 200 and ours.rss_mib <= 1.1 * small.rss_mib,
            )
        )
        single = measure([*CLIPCLI, "norms", "--format", "json", str(files.single)], runs)
        rows.append(
            Row(
                "norms single 1 GiB tensor",
                single,
                "",
                None,
                "RSS ≤ 200 MiB",
                single.rss_mib <= 200,
            )
        )
        for label, path in (("npz", files.npz), ("HDF5", files.h5)):
            other = measure([*CLIPCLI, "norms", "--format", "json", str(path)], runs)
            rows.append(
                Row(
                    f"norms {label} (0.5 GiB)",
                    other,
                    "safetensors",
                    small,
                    "≤ 2 × safetensors",
                    other.seconds <= 2 * small.seconds,
                )
            )
    if want("clip"):
        cp = measure(["cp", str(files.fp32), str(out)], runs, reset)
        clip = measure(
            [*CLIPCLI, "clip", "--global", "1.0", "-q", str(files.fp32), str(out)], runs, reset
        )
        clip_nosync = measure(
            [*CLIPCLI, "clip", "--global", "1.0", "-q", "--no-fsync", str(files.fp32), str(out)],
            runs,
            reset,
        )
        naive = measure(
            [PY, str(HERE / "naive_clip.py"), str(files.fp32), str(out), "1.0"], runs, reset
        )
        cp_sync = measure(["sh", "-c", f"cp {files.fp32} {out} && sync {out}"], runs, reset)
        rows.append(
            Row(
                "clip --global 1.0 (fsync)",
                clip,
                "cp+sync",
                cp_sync,
                "≤ 1.5 × cp",
                clip.seconds <= 1.5 * cp_sync.seconds,
            )
        )
        rows.append(
            Row(
                "clip --global 1.0 --no-fsync",
                clip_nosync,
                "cp",
                cp,
                "≤ 1.5 × cp",
                clip_nosync.seconds <= 1.5 * cp.seconds,
            )
        )
        rows.append(
            Row(
                "clip --global 1.0 vs naive",
                clip,
                "naive",
                naive,
                "≥ 2× faster",
                naive.seconds >= 2 * clip.seconds,
            )
        )
        same = measure(
            [*CLIPCLI, "clip", "--global", "1e30", "-q", "--no-fsync", str(files.fp32), str(out)],
            runs,
            reset,
        )
        rows.append(
            Row(
                "clip, nothing changes (--no-fsync)",
                same,
                "cp",
                cp,
                "≤ 1.2 × cp",
                same.seconds <= 1.2 * cp.seconds,
            )
        )
        for mode in (["--norm", "1.0"], ["--average", "1e-6"], ["--value", "0.5"]):
            for label, path in (("2 GiB", files.fp32), ("1 GiB tensor", files.single)):
                timing = measure(
                    [*CLIPCLI, "clip", *mode, "-q", "--no-fsync", str(path), str(out)],
                    max(1, runs // 2),
                    reset,
                )
                rows.append(
                    Row(
                        f"clip {' '.join(mode)} RSS, {label}",
                        timing,
                        "",
                        None,
                        "RSS ≤ 200 MiB",
                        timing.rss_mib <= 200,
                    )
                )
        largest_mib = files.single.stat().st_size / MIB
        axes = measure(
            [
                *CLIPCLI,
                "clip",
                "--norm",
                "1",
                "--axes",
                "0",
                "-q",
                "--no-fsync",
                str(files.single),
                str(out),
            ],
            max(1, runs // 2),
            reset,
        )
        rows.append(
            Row(
                "clip --norm --axes RSS, 1 GiB tensor",
                axes,
                "",
                None,
                f"RSS ≤ {2 * largest_mib + 100:.0f} MiB",
                axes.rss_mib <= 2 * largest_mib + 100,
            )
        )
        reset()
    if want("startup"):
        help_ = measure([*CLIPCLI, "--help"], runs)
        rows.append(Row("clipcli --help", help_, "", None, "≤ 0.25 s", help_.seconds <= 0.25))
        tiny = measure([*CLIPCLI, "norms", "--format", "json", str(files.tiny)], runs)
        rows.append(Row("norms on a 1 MB file", tiny, "", None, "≤ 0.45 s", tiny.seconds <= 0.45))
    return rows


HEADER = ["job", "clipcli", "baseline", "ratio", "peak RSS", "target", "verdict"]


def table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small files, for a smoke run")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per job (median)")
    parser.add_argument("--keep", type=Path, help="generate into / reuse files from DIR")
    parser.add_argument("--only", nargs="*", default=[], help="norms, clip, startup")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="clipcli-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        files = generate(workdir, args.quick)
        print(
            f"generated in {time.perf_counter() - started:.1f} s under {workdir}", file=sys.stderr
        )
        rows = run_all(files, workdir, args.runs, set(args.only))
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result = table(rows)
    print(result)
    import numpy

    sizes = "64 MiB / 16 MiB (quick)" if args.quick else "2 GiB / 0.5 GiB, single tensor 1 GiB"
    report = (
        "# Benchmark results\n\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}\n"
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, numpy {numpy.__version__}\n"
        f"- files: {sizes}; npz/HDF5 rows use the 0.5 GiB data; median of {args.runs} runs after"
        " one warm-up; page cache warm\n"
        f"- command: `python benchmarks/run.py{' --quick' if args.quick else ''}`\n\n"
        f"{result}\n"
    )
    args.output.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
