"""Issue 22: `norms` of a 2 GiB F16 GGUF against `norms` of a safetensors file holding the
same tensors' bytes (target: within 1.3x), and peak RSS (flat: far below the file).

    python benchmarks/gguf_norms.py [--gib G] [--vocab N] [--runs R] [--dir DIR]

The GGUF file carries a tokenizer of N tokens (default 256,000: a Llama-3-sized vocabulary)
and a merges list of N strings, so that the header walk is that of a real file. Both files
are written here by hand (struct, numpy: no clipcli code). Each row is a whole
`python -m clipcli norms FILE --format json` process timed with /usr/bin/time: CPU = user +
system seconds (the figure to trust on a shared machine), wall, peak RSS. Runs alternate
between the two files. `ls` of the GGUF file times the header walk alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
ROWS, COLUMNS = 8192, 4096  # one tensor: 64 MiB of float16


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def write_files(directory: Path, gib: float, vocab: int) -> tuple[Path, Path]:
    count = max(1, round(gib * (1 << 30) / (ROWS * COLUMNS * 2)))
    names = [f"blk.{i}.ffn_up.weight" for i in range(count)]
    nbytes = ROWS * COLUMNS * 2
    tokens = [f"tok{i}".encode() for i in range(vocab)]
    merges = [f"t {i}".encode() for i in range(vocab)]
    kvs = [
        _string(b"general.architecture") + struct.pack("<I", 8) + _string(b"llama"),
        _string(b"tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, 8, len(tokens))
        + b"".join(map(_string, tokens)),
        _string(b"tokenizer.ggml.merges")
        + struct.pack("<IIQ", 9, 8, len(merges))
        + b"".join(map(_string, merges)),
    ]
    infos = b"".join(
        _string(name.encode()) + struct.pack("<IQQIQ", 2, COLUMNS, ROWS, 1, i * nbytes)
        for i, name in enumerate(names)
    )
    head = b"GGUF" + struct.pack("<IQQ", 3, count, len(kvs)) + b"".join(kvs) + infos
    head += bytes(-len(head) % 32)
    header = {
        name: {
            "dtype": "F16",
            "shape": [ROWS, COLUMNS],
            "data_offsets": [i * nbytes, (i + 1) * nbytes],
        }
        for i, name in enumerate(names)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    gguf_path, st_path = directory / "m.gguf", directory / "m.safetensors"
    rng = np.random.default_rng(0)
    with open(gguf_path, "wb") as g, open(st_path, "wb") as s:
        g.write(head)
        s.write(struct.pack("<Q", len(text)) + text)
        for _ in names:
            data = rng.standard_normal((ROWS, COLUMNS), np.float32).astype("<f2").tobytes()
            g.write(data)
            s.write(data)
    return gguf_path, st_path


def timed(argv: list[str]) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS MiB) of one clipcli process."""
    cmd = ["/usr/bin/time", "-f", "%U %S %e %M", sys.executable, "-m", "clipcli", *argv]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )
    user, system, wall, rss = done.stderr.strip().splitlines()[-1].split()
    return float(user) + float(system), float(wall), int(rss) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--vocab", type=int, default=256_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        directory = args.dir or Path(temporary)
        directory.mkdir(parents=True, exist_ok=True)
        gguf_path, st_path = write_files(directory, args.gib, args.vocab)
        rows: dict[str, list[tuple[float, float, float]]] = {}
        commands = {
            "norms safetensors": ["norms", str(st_path), "--format", "json"],
            "norms gguf": ["norms", str(gguf_path), "--format", "json"],
            "ls gguf (header walk)": ["ls", str(gguf_path), "--format", "json"],
        }
        for _ in range(args.runs):
            for label, argv in commands.items():
                rows.setdefault(label, []).append(timed(argv))
        size = gguf_path.stat().st_size / (1 << 30)
        title = f"command ({size:.2f} GiB, {args.vocab:,} tokens)"
        print(f"| {title} | CPU s (median) | wall s | peak RSS MiB |")
        print("|---|---|---|---|")
        for label, samples in rows.items():
            cpu = statistics.median(s[0] for s in samples)
            wall = statistics.median(s[1] for s in samples)
            rss = max(s[2] for s in samples)
            print(f"| {label} | {cpu:.2f} | {wall:.2f} | {rss:.0f} |")
        base = statistics.median(s[0] for s in rows["norms safetensors"])
        ratio = statistics.median(s[0] for s in rows["norms gguf"]) / base
        print(f"\nnorms gguf / norms safetensors, CPU: {ratio:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
