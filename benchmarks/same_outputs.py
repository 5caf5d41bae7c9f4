"""Byte-identical outputs between two clipcli checkouts (a speed change must change nothing).

    python benchmarks/same_outputs.py OTHER_CHECKOUT [--tensors N] [--seeds K] [--dir DIR]

Runs the same commands with this checkout's clipcli and OTHER_CHECKOUT's (each on
PYTHONPATH, from a scratch directory) and compares stdout, stderr, the exit code and every
file written, byte for byte. The files: K random safetensors checkpoints of N tensors of
mixed dtypes (F64/F32/F16/BF16/I32/I8/U8/BOOL), shapes of 0-20,000 elements, values with
NaN, +-inf and +-0 in some tensors of odd seeds, some names natural-sort sensitive
(`layers.2` / `layers.10`), with and without __metadata__; and 200,000 one-element tensors
(benchmarks/many_tiny_tensors.py). Commands: norms in every --format and --sort, --top,
--group-by layer, ls; clip in every mode (--global, --global --group-by, --norm, --norm
--axes, --value, --min/--max), with --skip-nonfinite, and the reports in table and JSON.
Exit status 1 and the differing commands listed when anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_tiny_tensors import write_tiny

HERE = Path(__file__).resolve().parent.parent

_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": None,  # float32's top half
    "I32": "<i4",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


def write_mixed(path: Path, count: int, seed: int) -> None:
    """`count` random tensors of mixed dtypes and sizes, some holding NaN/inf/-0."""
    rng = np.random.default_rng(seed)
    header: dict[str, object] = {}
    if seed % 3:
        header["__metadata__"] = {"format": "pt", "seed": str(seed)}
    blobs: list[bytes] = []
    offset = 0
    codes = list(_DTYPES)
    for i in range(count):
        code = codes[int(rng.integers(len(codes)))]
        numel = int(rng.choice([0, 1, 2, 3, 7, 64, 1000, int(rng.integers(1, 20_001))]))
        shape = [numel] if numel < 64 or rng.random() < 0.5 else [numel // 8, 8]
        numel = int(np.prod(shape))
        values = rng.standard_normal(numel) * float(rng.choice([1e-3, 1.0, 30.0, 1e4]))
        if seed % 2 and numel and rng.random() < 0.1:  # odd seeds: some non-finite
            special = rng.choice([np.nan, np.inf, -np.inf, -0.0], size=min(numel, 3))
            values[rng.integers(0, numel, size=special.size)] = special
        if code == "BF16":
            data = (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        elif code in ("I32", "I8"):
            data = np.clip(np.nan_to_num(values), -100, 100).astype(_DTYPES[code]).tobytes()
        elif code in ("U8", "BOOL"):
            data = (np.abs(np.nan_to_num(values)) % 2).astype(_DTYPES[code]).tobytes()
        else:
            data = values.astype(_DTYPES[code]).tobytes()
        name = f"model.layers.{i % 13}.block{i}.w" if i % 3 else f"t{i}"
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def commands(path: Path, big: bool) -> list[list[str]]:
    p = str(path)
    jobs = [
        ["norms", p],
        [NO_COLUMNS, "norms", p],  # a pipe with no COLUMNS: no width to fit
        [NO_COLUMNS, "clip", "--global", "1", "--force", p, "OUT"],
        ["norms", "--format", "json", p],
        ["ls", p],
        ["clip", "--global", "1", "--force", p, "OUT"],
        ["clip", "--global", "1", "--force", "--format", "json", p, "OUT"],
    ]
    if big:
        return jobs
    jobs += [
        ["norms", "--format", "jsonl", p],
        ["norms", "--format", "csv", p],
        ["norms", "--sort", "norm", "--top", "7", p],
        ["norms", "--sort", "size", p],
        ["norms", "--sort", "file", "--format", "json", p],
        ["norms", "--group-by", "layer", p],
        ["norms", "--stored", "--format", "csv", p],
        ["clip", "--global", "1", "--group-by", "layer", "--force", p, "OUT"],
        ["clip", "--global", "1", "--skip-nonfinite", "--force", "--format", "json", p, "OUT"],
        ["clip", "--global", "1e9", "--force", p, "OUT"],
        ["clip", "--norm", "0.5", "--force", p, "OUT"],
        ["clip", "--norm", "0.5", "--skip-nonfinite", "--force", "--format", "csv", p, "OUT"],
        ["clip", "--norm", "1", "--axes", "-1", "--skip-low-rank", "--force", p, "OUT"],
        ["clip", "--value", "0.5", "--force", "--format", "json", p, "OUT"],
        ["clip", "--min", "-0.1", "--max", "2", "--force", p, "OUT"],
        ["clip", "--global", "1", "--sort", "norm", "--top", "5", "--force", p, "OUT"],
    ]
    return jobs


NO_COLUMNS = "(no COLUMNS)"


def run(checkout: Path, job: list[str], scratch: Path) -> tuple[int, bytes, bytes, bytes]:
    out = scratch / f"out-{checkout.name}.safetensors"
    out.unlink(missing_ok=True)
    args = [str(out) if a == "OUT" else a for a in job if a != NO_COLUMNS]
    env = dict(os.environ, PYTHONPATH=str(checkout), COLUMNS="100")
    if NO_COLUMNS in job:
        del env["COLUMNS"]
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", *args], env=env, cwd=scratch, capture_output=True
    )
    written = out.read_bytes() if out.exists() else b""
    stdout = done.stdout.replace(str(out).encode(), b"OUT")
    stderr = done.stderr.replace(str(out).encode(), b"OUT")
    return done.returncode, stdout, stderr, written


def _show_difference(
    mine: tuple[int, bytes, bytes, bytes], theirs: tuple[int, bytes, bytes, bytes]
) -> None:
    import difflib

    for what, a, b in zip(("rc", "stdout", "stderr", "OUT"), mine, theirs, strict=True):
        if a == b:
            continue
        if what in ("stdout", "stderr"):
            lines = difflib.unified_diff(
                b.decode(errors="replace").splitlines(),
                a.decode(errors="replace").splitlines(),
                "other",
                "this",
                lineterm="",
            )
            print("\n".join(list(lines)[:40]))
        else:
            print(f"  {what} differs ({len(a)} vs {len(b)} bytes)" if what == "OUT" else a, b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("other", type=Path)
    parser.add_argument("--tensors", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tiny", type=int, default=200_000, help="0: no one-element file")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    other = args.other.resolve()
    differ = 0
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.dir or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        files = []
        for seed in range(args.seeds):
            path = scratch / f"mixed-{seed}.safetensors"
            write_mixed(path, args.tensors, seed)
            files.append((path, False))
        if args.tiny:
            tiny = scratch / f"tiny-{args.tiny}.safetensors"
            if not tiny.exists():
                write_tiny(tiny, args.tiny)
            files.append((tiny, True))
        for path, big in files:
            for job in commands(path, big):
                mine, theirs = run(HERE, job, scratch), run(other, job, scratch)
                same = mine == theirs
                differ += not same
                shown = " ".join(job).replace(str(scratch) + "/", "")
                print(f"{'same' if same else 'DIFFERENT'}  rc={mine[0]}  {shown}", flush=True)
                if not same:
                    _show_difference(mine, theirs)
    print(f"{differ} command(s) differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
