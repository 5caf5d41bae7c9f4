"""The markdown report (benchmarks/RESULTS.md): context lines, tables, failures."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from common import CLIPCLI, PY, REPO, compile_clipcli, human
from jobs import Row
from timing import COLD_MIB, NOISY, TIME, Bench, Pinned


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def compile_bytecode() -> str:
    """Compile clipcli's modules to bytecode first, as `pip install` does
    (common.compile_clipcli says what it costs otherwise). Returns the line for the
    report."""
    ok = compile_clipcli()
    env = (
        " (PYTHONDONTWRITEBYTECODE is set here)"
        if os.environ.get("PYTHONDONTWRITEBYTECODE")
        else ""
    )
    state = "compiled to bytecode before timing, as pip install does" if ok else "compile FAILED"
    return f"clipcli's modules: {state}{env}"


def machine() -> list[str]:
    import h5py
    import safetensors

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        ram = 0
    dirty = " (uncommitted changes in clipcli/)" if git("status", "--porcelain", "clipcli") else ""
    return [
        f"machine: {os.cpu_count()} cores ({cpu}), {human(ram)} RAM, {platform.system()} "
        f"{platform.release()}, {platform.machine()}",
        f"software: Python {platform.python_version()}, numpy {np.__version__}, "
        f"safetensors {safetensors.__version__}, h5py {h5py.__version__}",
        f"clipcli: git {git('rev-parse', '--short', 'HEAD')}{dirty}, "
        f"run as `{shlex.join(CLIPCLI)}`",
    ]


def loadavg(values: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in values)


def method(runs: int, pinned: Pinned | None) -> str:
    rss = "/usr/bin/time -f %M" if TIME else "a RUSAGE_CHILDREN ru_maxrss wrapper"
    if pinned is None:
        pin = "Input files are not pinned (--no-pin)."
    elif pinned.failed:
        pin = f"Pinning the input files into the page cache FAILED ({pinned.failed})."
    else:
        pin = (
            "Each group's input files are mmap'ed and mlock'ed by the harness while the group "
            "runs, so the page cache stays warm (the harness maps them, so they are not in the "
            "measured processes' RSS)."
        )
    return (
        f"whole processes; per command one warm-up run (page cache warm), then the median wall "
        f"time of {runs} runs, the commands of a group taking turns (interleaved); peak RSS = the "
        f"largest `{rss}` over those runs (file-backed pages count). Commands that write OUT "
        "(clipcli clip, cp, the naive script) get OUT deleted and `os.sync()` before every run, "
        "untimed, so each run writes a fresh file into a quiet page cache. "
        "`cp + sync` = `cp IN OUT && sync OUT`. " + pin
    )


def render(
    rows: Sequence[Row],
    file_rows: list[list[str]],
    results: list[tuple[str, bool, str]],
    bench: Bench,
    context: list[str],
    quick: bool,
) -> str:
    targets = [r for r in rows if not r.target.startswith("(info)")]
    met = sum(r.verdict == "MET" for r in targets)
    lines = ["# clipcli benchmark results", ""]
    if quick:
        lines += [
            "**Quick (smoke) run: the files are far too small for the targets to mean anything; "
            "start-up time dominates every row.**",
            "",
        ]
    lines += [f"- {line}" for line in context]
    stats = [st for st in bench.cache.values() if st.ok]
    redone = sum(st.retried for st in stats)
    loaded = sum(x.foreign > NOISY for st in stats for x in st.samples)
    cold = sum(x.disk > COLD_MIB for st in stats for x in st.samples)
    total = sum(len(st.samples) for st in stats)
    lines.append(
        f"- unclean runs: waited {bench.waited:.0f} s in all for other processes to go quiet "
        f"before groups; {redone} timed runs were redone because other processes kept more "
        f"than {NOISY} cores busy or the command read more than {COLD_MIB:g} MiB from the disk "
        f"(cold page cache); of the {total} kept runs, {loaded} still had such load and {cold} "
        "such disk reads"
    )
    lines += [
        "",
        f"## Results: {met} of {len(targets)} targets met",
        "",
        "ratio = clipcli time / baseline time (for RSS growth: peak RSS on the big file / on the "
        "small file). Rows whose target starts with (info) are diagnostics, not targets.",
        "",
        markdown(
            ["job", "clipcli", "baseline", "ratio", "target", "met?", "peak RSS"],
            [[r.job, r.ours, r.baseline, r.ratio, r.target, r.verdict, r.rss] for r in rows],
        ),
        "",
        "## Files",
        "",
        markdown(["file", "format", "dtype", "tensors × shape", "size", "bytes"], file_rows),
        "",
        "## Correctness checks (run once, before timing)",
        "",
        markdown(
            ["check", "result", "detail"],
            [[n, "ok" if ok else "FAILED", d] for n, ok, d in results],
        )
        if results
        else "(none for these sections)",
        "",
        "## Every command",
        "",
        f"`$BENCH` = the temp dir holding the generated files; `python` = `{PY}`. "
        "`other load` = CPU time the rest of the machine used during a run (from /proc/stat, "
        "minus the command's own CPU) / its wall time; `disk reads` = what the command read "
        "from the block device (`/usr/bin/time %I`), i.e. page-cache misses. A timed run with "
        f"more than {NOISY} cores of other load or {COLD_MIB:g} MiB of disk reads is redone, at "
        f"most {bench.retries} times; `unclean` counts the kept runs that still had either.",
        "",
    ]
    detail = []
    for s in bench.cache.values():
        shown = f"`{bench.show(s.cmd)}`" + (f" [{s.group} group]" if s.group else "")
        if s.ok:
            cpu = statistics.median(x.cpu for x in s.samples)
            unclean = sum(not x.clean for x in s.samples)
            foreign = max(x.foreign for x in s.samples)
            disk = max(x.disk for x in s.samples)
            detail.append(
                [shown, f"{s.median:.3f} s", f"{min(s.walls):.3f} s", f"{max(s.walls):.3f} s"]
                + [f"{cpu:.2f} s", f"{s.peak:.0f} MiB", f"{foreign:.2f}", f"{disk:.0f} MiB"]
                + [f"{s.retried} / {unclean}"]
            )
        else:
            detail.append([shown, "FAILED"] + ["-"] * 7)
    lines.append(
        markdown(
            ["command", "median", "min", "max", "CPU user+sys", "peak RSS"]
            + ["other load (max, cores)", "disk reads (max)", "redone / unclean"],
            detail,
        )
    )
    failures = [(bench.show(s.cmd), s.error) for s in bench.cache.values() if s.error]
    failures += [(name, text) for name, ok, text in results if not ok]
    if failures:
        lines += ["", "## Failures", ""]
        for cmd, err in failures:
            lines += [f"- `{cmd}`", "", "```", str(err), "```", ""]
    return "\n".join(lines) + "\n"
