"""clipcli benchmark harness: whole processes, warm page cache, median of N runs, peak RSS.

    python benchmarks/run.py                 # full run (2 GiB files), writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick         # smoke run with small files (< 1 min), prints only
    python benchmarks/run.py --keep /tmp/cb  # generate into / reuse checkpoints from /tmp/cb
    python benchmarks/run.py --only norms startup

Every checkpoint is generated here from a seeded generator in a temp dir (no downloads).
Sections for --only: norms, formats, clip, rss, axes, startup (default: all).
See benchmarks/README.md for what every row means.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from checks import checks
from common import HERE, SECTIONS, human, log
from gen_files import generate, plan
from jobs import ck_shape, run_sections
from results_md import compile_bytecode, loadavg, machine, method, render
from timing import RETRIES, Bench


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small files (64 MiB / 16 MiB / 32 MiB), 3 runs: a smoke test",
    )
    parser.add_argument("--runs", type=int, help="timed runs per command (default 5; quick 3)")
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="generate checkpoints into DIR and reuse them on later runs",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="NAME",
        help=f"run only these sections: {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="don't mlock each group's input files into the page cache while it runs",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        metavar="S",
        help="before each group of commands, wait up to S seconds for other processes to "
        "go quiet (default 180; quick 0, and no runs are redone)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="write the report here (default: benchmarks/RESULTS.md for a full "
        "run of every section, nowhere otherwise)",
    )
    args = parser.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    sections = set(args.only or SECTIONS)
    output = args.output
    if output is None and not args.quick and not args.only:
        output = HERE / "RESULTS.md"

    workdir = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="clipcli-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    try:
        files = plan(workdir, args.quick)
        bytecode = compile_bytecode()
        log(bytecode)
        log(f"generating under {workdir}")
        generate(files)
        gen_seconds = time.perf_counter() - started
        results = checks(files, workdir, sections)
        max_wait = args.max_wait if args.max_wait is not None else (0 if args.quick else 180)
        bench = Bench(runs, workdir, max_wait, 0 if args.quick else RETRIES, not args.no_pin)
        nominal = human(files.fp32.n_tensors * files.fp32.largest_tensor_bytes)
        rows = run_sections(bench, files, sections, nominal)
        file_rows = [
            [ck.path.name, ck.kind, ck.dtype.lower(), ck_shape(ck), human(ck.size), f"{ck.size:,}"]
            for ck in files.all()
        ]
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()

    command = "python benchmarks/run.py" + "".join(
        [
            " --quick" if args.quick else "",
            f" --runs {args.runs}" if args.runs else "",
            f" --only {' '.join(args.only)}" if args.only else "",
        ]
    )
    context = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"command: `{command}` (total {time.perf_counter() - started:.0f} s, of which "
        f"generating the files {gen_seconds:.0f} s)",
        *machine(),
        bytecode,
        f"load average (1/5/15 min) before: {loadavg(load_before)}, after: {loadavg(load_after)}"
        " (other work on the machine skews timings; > 0.5 at the start deserves a re-run)",
        f"method: {method(runs, bench.pinned)}",
        f"sizes: {nominal} fp32, bf16 and fp16 files, the RSS-growth file "
        f"{human(files.fp32_small.n_tensors * files.fp32_small.largest_tensor_bytes)}, one "
        f"{human(files.single.largest_tensor_bytes)} tensor, a {human(files.tiny.size)} file; "
        "npz and HDF5 hold the same data and byte count as the big fp32 safetensors file (npz: "
        "np.savez layout, stored = uncompressed; HDF5: contiguous datasets), and their rows "
        "compare seconds per byte (the sizes differ by headers only).",
    ]
    report = render(rows, file_rows, results, bench, context, args.quick)
    print(report)
    if output is not None:
        output.write_text(report)
        log(f"wrote {output}")
    return 1 if "## Failures" in report else 0


if __name__ == "__main__":
    raise SystemExit(main())
