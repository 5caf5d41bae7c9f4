"""What clipcli's own modules cost to import on top of numpy, for the `ls` and `norms`
sets of clipcli/__main__.py (issue 12, item 7): whole processes, min CPU of N runs.

    python benchmarks/import_cost.py --runs 15
    python benchmarks/import_cost.py --runs 15 --root /tmp/old --root .   # before/after

Each case is `python -c "import numpy; import <modules>"`, against `python -c "import
numpy"`; the runs take turns so that load on the machine hits every case alike. CPU is
user + system of the child (rusage), which swings less than wall time on a shared machine.
--root DIR imports clipcli from DIR (a checkout, e.g. `git archive OLD clipcli | tar -x`)
instead of the installed copy; each root's modules are compiled to bytecode first, as pip
install does. The CLI itself is not in these sets: benchmarks/startup.py times commands.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import subprocess
import sys
from pathlib import Path

LS = (
    "clipcli.formats.opening",
    "clipcli.formats.safetensors",
    "clipcli.report.builders",
    "clipcli.report.table",
    "clipcli.report.serialize",
    "clipcli.jobs.groups",
)
NORMS = (*LS[:-1], "clipcli.api", "clipcli.report.chart")
SETS = {"ls set": LS, "norms set": NORMS}
# Put ROOT first, and drop the editable install's finder, which would win over sys.path.
PREFIX = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(f)]; "
    "sys.path.insert(0, {root!r}); "
)


def cpu_of(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--root", action="append", default=[], help="a checkout to import")
    args = parser.parse_args()
    roots = [str(Path(r).resolve()) for r in args.root]
    cases = {"numpy": "import numpy"}
    for root in roots or [""]:
        prefix = PREFIX.format(root=root) if root else ""
        if root:
            compileall.compile_dir(os.path.join(root, "clipcli"), quiet=1)
        else:
            import clipcli

            compileall.compile_dir(os.path.dirname(clipcli.__file__), quiet=1)
        for name, modules in SETS.items():
            label = f"{name} {root}".strip()
            cases[label] = prefix + "import numpy; import " + ", ".join(modules)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, code in cases.items():
            times[name].append(cpu_of(code))
    base = min(times["numpy"])
    print(f"load average {os.getloadavg()[0]:.2f}; min CPU of {args.runs} runs; bytecode compiled")
    for name, values in times.items():
        extra = "" if name == "numpy" else f"  (+{(min(values) - base) * 1000:.1f} ms on numpy)"
        print(f"{name:40} {min(values) * 1000:7.1f} ms{extra}")


if __name__ == "__main__":
    main()
