#!/usr/bin/env bash
# Issue 20 on a many-core machine, in one go (about 4-5 minutes on 16 cores; stopped at
# 450 s whatever happens, keeping what it measured):
#
#   OUT=/some/empty/dir bash benchmarks/device_run.sh
#
# Generates seeded checkpoints under $TMPDIR (SIZE GiB each, default 2: an fp32 file, a bf16
# file, a bf16 model directory of 4 shards), then runs benchmarks/scale.py for
#   norms of the fp32 file and of the bf16 file (against the one-thread floor), and
#   clip --global 1.0 of the bf16 model directory (against cp -r + sync; the PyTorch script
#   too where torch is installed, skipped otherwise)
# at CLIPCLI_THREADS = 1, 2, 4, 8, 16 (and the core count where it is more) and without the
# variable (the machine's default), every run a whole process, 3 timed runs each after a
# warm-up, interleaved. Prints the markdown tables; writes under $OUT: machine.txt,
# scale.md (the table), scale.json (every run), summary.md (speed-up per thread count),
# scale.stderr; then clip-dir again with the bit patterns counted in the threads
# (CLIPCLI_COUNTING_PROCESSES=0): scale_threads_counting.md/.json/.stderr.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
out=${OUT:?set OUT to the folder for the results}
size=${SIZE:-2}
runs=${RUNS:-3}
python=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/clipcli-device-XXXXXX")
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
unset CLIPCLI_THREADS

cores=$(nproc)
threads="1,2,4,8,16"
if [ "$cores" -gt 16 ]; then threads="$threads,$cores"; fi

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "nproc: $cores"
    echo "affinity: $("$python" -c 'import os; print(len(os.sched_getaffinity(0)))')"
    echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    echo "clipcli default threads: $("$python" -c 'from clipcli.system.parallel import worker_count; print(worker_count())')"
    echo "git: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    "$python" -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
    echo "load average: $(cat /proc/loadavg)"
    uname -a
    free -g
    lscpu
} >"$out/machine.txt" 2>&1
head -8 "$out/machine.txt"

cd "$root" || exit 1
# Pre-flight: clipcli must run with this machine's Python. Where its image lacks a dependency
# (or has one the CLI cannot use), the wheels carried in .whl (pure-Python ones) are tried.
preflight() {
    "$python" - <<'PY'
import sys, tempfile, subprocess, numpy as np
from pathlib import Path
d = Path(tempfile.mkdtemp())
np.savez(d / "t.npz", a=np.arange(4, dtype=np.float32))
r = subprocess.run([sys.executable, "-m", "clipcli", "norms", "--format", "json", str(d / "t.npz")],
                   capture_output=True, text=True)
print("preflight:", r.returncode, r.stdout[:80].replace("\n", " "), r.stderr[-300:])
sys.exit(r.returncode)
PY
}
if ! preflight && [ -d .whl ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/clipcli-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/clipcli-site"
    preflight || { echo "clipcli does not run here"; exit 1; }
fi
command -v /usr/bin/time >/dev/null || echo "no /usr/bin/time here: peak RSS is an upper bound"
timeout -k 10 450 "$python" benchmarks/scale.py \
    --size "$size" --runs "$runs" --shards 4 --threads "$threads" --default-threads \
    --jobs norms-fp32,norms-bf16,clip-dir --keep "$work/files" --json "$out/scale.json" \
    2>"$out/scale.stderr" | tee "$out/scale.md"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "scale.py ended with status $status (124: stopped at 450 s; see scale.stderr)"

# The same clip with its bit patterns counted in the threads, not in helper processes
# (system.counting): what the helpers win where the GIL stops threads (session 45).
echo "## clip-dir, counted in threads (CLIPCLI_COUNTING_PROCESSES=0)"
CLIPCLI_COUNTING_PROCESSES=0 timeout -k 10 240 "$python" benchmarks/scale.py \
    --size "$size" --runs "$runs" --shards 4 --threads "$threads" \
    --jobs clip-dir --keep "$work/files" --json "$out/scale_threads_counting.json" \
    2>"$out/scale_threads_counting.stderr" | tee "$out/scale_threads_counting.md"

# Speed-up per thread count against 1 thread, and against each group's first row.
"$python" - "$out/scale.json" <<'EOF' | tee "$out/summary.md"
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no scale.json to summarise: {exc}")
print("\n| job | command | wall (median) | CPU s | speed-up vs 1 thr | vs baseline |")
print("|---|---|---|---|---|---|")
by_job = {}
for row in data["rows"]:
    by_job.setdefault(row["job"], []).append(row)
for job, rows in by_job.items():
    first = rows[0]["wall_median_s"]
    one = next((r["wall_median_s"] for r in rows if r["command"].endswith(", 1 thr")), None)
    for r in rows:
        wall = r["wall_median_s"]
        threaded = r["command"].endswith(" thr") or r["command"].endswith("default threads")
        speedup = f"{one / wall:.2f}x" if one and threaded else "-"
        print(f"| {job} | {r['command']} | {wall:.3f} s | {r['cpu_median_s']:.2f} | {speedup} | {wall / first:.2f} |")
EOF
exit 0
