"""What clipcli's own modules cost to import on top of numpy, for the `ls` and `norms`
sets of clipcli/__main__.py (issue 12, item 7): whole processes, min CPU of N runs.

    python benchmarks/import_cost.py --runs 15

Each case is `python -c "import numpy; import <modules>"`, against `python -c "import
numpy"`; the runs take turns so that load on the machine hits every case alike. CPU is
user + system of the child (rusage), which swings less than wall time on a shared machine.
The CLI itself (typer or not) is not in these sets: benchmarks/startup.py times whole
commands.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import compile_bytecode  # a sibling script, not a package

LS = (
    "clipcli.io",
    "clipcli.formats.safetensors",
    "clipcli.report.builders",
    "clipcli.report.table",
    "clipcli.report.serialize",
    "clipcli.groups",
)
NORMS = (*LS[:-1], "clipcli.api", "clipcli.report.chart")
CASES = {
    "numpy": "import numpy",
    "ls set": "import numpy; import " + ", ".join(LS),
    "norms set": "import numpy; import " + ", ".join(NORMS),
}


def cpu_of(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(compile_bytecode())
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, code in CASES.items():
            times[name].append(cpu_of(code))
    base = min(times["numpy"])
    print(f"load average {os.getloadavg()[0]:.2f}; min CPU of {args.runs} runs")
    for name, values in times.items():
        extra = "" if name == "numpy" else f"  (+{(min(values) - base) * 1000:.1f} ms on numpy)"
        print(f"{name:10} {min(values) * 1000:7.1f} ms{extra}")


if __name__ == "__main__":
    main()
