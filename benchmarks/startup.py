"""Start-up time for shell loops (issue 12, item 7): whole processes, in one run.

    python benchmarks/startup.py            # 25 rounds, writes its section of RESULTS.md
    python benchmarks/startup.py --rounds 5 --no-write

Cases, each timed as a whole process (the commands take turns, round after round, so that
a burst of load on the machine hits them all alike):

- `python -c pass` and `clipcli --version`: target --version <= 2x;
- a `safe_open` one-liner listing a 1 MB safetensors file (names, dtypes, shapes), and
  `clipcli ls` / `clipcli norms` on it: targets ls <= 1.0x, norms <= 1.3x.

Both wall time and CPU time (user + system, from the children's rusage) are recorded,
min and median. The targets are judged on the minimum CPU time, as the issue measured them:
on a shared 2-core machine wall time swings with other people's work, CPU time much less
(it still rises with cache contention). The machine's load average before and after is
recorded with the figures.

The one-liner's CPU time includes what OpenBLAS's threads burn while numpy loads (they
start and spin); clipcli sets them to one. So the one-liner is also timed with
OPENBLAS_NUM_THREADS=1, and the ratios against that run and against wall time are printed
beside the targets: they are the harder, fairer comparisons.

clipcli's modules are compiled to bytecode first, as `pip install` does. This sandbox sets
PYTHONDONTWRITEBYTECODE=1, under which an editable install compiles every clipcli module
from source on every run; one more case times `clipcli norms` that way (a copy of the
package with no __pycache__), for information.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import compile_bytecode

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- startup:begin -->", "<!-- startup:end -->"

SAFE_OPEN = (
    "import sys; from safetensors import safe_open\n"
    "with safe_open(sys.argv[1], 'np') as f:\n"
    "    for k in f.keys():\n"
    "        s = f.get_slice(k); print(k, s.get_dtype(), s.get_shape())\n"
)


def make_file(directory: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((64, 64)).astype(np.float32)
        for i in range(61)
    }
    path = directory / "one_mb.safetensors"
    save_file(tensors, str(path))
    return path


def clipcli_command() -> list[str]:
    script = Path(sys.executable).with_name("clipcli")
    return [str(script)] if script.exists() else [sys.executable, "-m", "clipcli"]


ONE_BLAS_THREAD = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
ONE_THREAD_CASE = "safe_open one-liner, 1 BLAS thread"
NO_BYTECODE_CASE = "clipcli norms, no bytecode cache"


def source_only_copy(directory: Path) -> dict[str, str]:
    """An environment running a copy of the clipcli package that has no bytecode and may
    not write any: every clipcli module is compiled from source on each run."""
    import shutil

    import clipcli

    package = Path(clipcli.__file__).parent
    shutil.copytree(package, directory / "clipcli", ignore=shutil.ignore_patterns("__pycache__"))
    return {**os.environ, "PYTHONPATH": str(directory), "PYTHONDONTWRITEBYTECODE": "1"}


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    clipcli = clipcli_command()
    bytecode = compile_bytecode()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_file(Path(tmp))
        (Path(tmp) / "source").mkdir()
        no_bytecode = source_only_copy(Path(tmp) / "source")
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "clipcli --version": [*clipcli, "--version"],
            "safe_open one-liner": [sys.executable, "-c", SAFE_OPEN, str(model)],
            ONE_THREAD_CASE: [sys.executable, "-c", SAFE_OPEN, str(model)],
            # What the one-liner and `clipcli norms` both must import: numpy. Information.
            "import numpy, 1 BLAS thread": [sys.executable, "-c", "import numpy"],
            "clipcli ls": [*clipcli, "ls", str(model)],
            "clipcli norms": [*clipcli, "norms", str(model)],
            # -P: not the working directory's clipcli (a checkout) but the copy
            NO_BYTECODE_CASE: [sys.executable, "-P", "-m", "clipcli", "norms", str(model)],
        }
        envs = {name: ONE_BLAS_THREAD if "1 BLAS thread" in name else None for name in cases}
        envs[NO_BYTECODE_CASE] = no_bytecode
        load_before = os.getloadavg()
        for name, argv in cases.items():  # warm-up: page cache, bytecode
            timed(argv, envs[name])
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, argv in cases.items():
                wall, cpu = timed(argv, envs[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
        load_after = os.getloadavg()
    cpu_min = {name: min(values) for name, values in cpus.items()}
    wall_min = {name: min(values) for name, values in walls.items()}
    targets = [
        ("clipcli --version", "python -c pass", 2.0),
        ("clipcli ls", "safe_open one-liner", 1.0),
        ("clipcli norms", "safe_open one-liner", 1.3),
    ]
    lines = [
        BEGIN,
        "## Start-up (issue 12, item 7)",
        "",
        f"- command: `python benchmarks/startup.py --rounds {args.rounds}`; date "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; clipcli run as "
        f"`{' '.join(Path(c).name for c in clipcli)}`",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}; load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}",
        "- method: whole processes, one warm-up each, then the cases take turns for "
        f"{args.rounds} rounds; CPU = user + system time of the process; ratios on the "
        "minimum CPU time (wall time on a loaded machine is other people's work)",
        f"- {bytecode}",
        "",
        "| case | CPU min | CPU median | wall min | wall median |",
        "|---|---|---|---|---|",
    ]
    for name in cases:
        lines.append(
            f"| {name} | {cpu_min[name] * 1000:.0f} ms | "
            f"{statistics.median(cpus[name]) * 1000:.0f} ms | {wall_min[name] * 1000:.0f} ms | "
            f"{statistics.median(walls[name]) * 1000:.0f} ms |"
        )
    lines += [
        "",
        "| target | ratio (CPU min) | met? | ratio (CPU min) to the 1-thread one-liner "
        "| ratio (wall min) |",
        "|---|---|---|---|---|",
    ]
    for case, base, limit in targets:
        ratio = cpu_min[case] / cpu_min[base]
        fair_base = ONE_THREAD_CASE if base == "safe_open one-liner" else base
        fair = cpu_min[case] / cpu_min[fair_base]
        wall_ratio = wall_min[case] / wall_min[base]
        met = "MET" if ratio <= limit else "NOT MET"
        lines.append(
            f"| {case} <= {limit}x {base} | {ratio:.2f} | {met} | {fair:.2f} | {wall_ratio:.2f} |"
        )
    lines += [
        "",
        "Before issue 12's start-up work (commit eedc5c6, same script, 5 rounds, load ~8): "
        "ls 327 ms CPU (2.88x), norms 335 ms (2.94x), --version 1.10x. At the end of the "
        "previous round (commit b1a01d8, load 0.4; Typer and numpy on every run, no bytecode "
        "cache): ls 1.13x, norms 1.48x.",
    ]
    lines.append(END)
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        results = HERE / "RESULTS.md"
        old = results.read_text() if results.exists() else ""
        if BEGIN in old and END in old:
            head, _, rest = old.partition(BEGIN)
            _, _, tail = rest.partition(END)
            new = head + text.rstrip("\n") + tail
        else:
            new = old.rstrip("\n") + "\n\n" + text
        results.write_text(new)


if __name__ == "__main__":
    main()
