#!/usr/bin/env bash
# Before/after on the hot paths: two clipcli executables (e.g. a checkout of the old commit
# and this one, each with its own venv) on the same seeded files, runs interleaved; prints
# the minimum CPU (user+sys) and wall time of each job per tree.
#   benchmarks/compare_trees.sh OLD/.venv/bin/clipcli NEW/.venv/bin/clipcli [DIR] [RUNS]
set -euo pipefail
old=$1 new=$2 dir=${3:-/tmp/clipcli-compare} runs=${4:-5}
py=$(dirname "$new")/python
mkdir -p "$dir" && cd "$dir"
[ -f f32.safetensors ] || "$py" -c "
import numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(2)
save_file({f'model.layers.{i}.w': rng.standard_normal((2048, 1024)).astype(np.float32) for i in range(64)}, 'f32.safetensors')
save_file({f't{i}': rng.standard_normal((1024, 1024)).astype(np.float16) for i in range(64)}, 'f16.safetensors')
"
for _ in $(seq "$runs"); do
  for tree in old new; do
    c=${!tree}
    /usr/bin/time -f "$tree norms-f32 %U %S %e" "$c" norms f32.safetensors >/dev/null
    /usr/bin/time -f "$tree norms-f16 %U %S %e" "$c" norms f16.safetensors >/dev/null
    /usr/bin/time -f "$tree clip-global-f32 %U %S %e" "$c" clip -q --no-fsync --force --global 1 f32.safetensors o.safetensors
    /usr/bin/time -f "$tree clip-norm-f16 %U %S %e" "$c" clip -q --no-fsync --force --norm 1 f16.safetensors o.safetensors
    /usr/bin/time -f "$tree clip-unchanged-f32 %U %S %e" "$c" clip -q --no-fsync --force --global 1e9 f32.safetensors o.safetensors
  done
done 2>&1 | awk '{cpu = $3 + $4; k = $2 " " $1
  if (!(k in m) || cpu < m[k]) m[k] = cpu; if (!(k in w) || $5 < w[k]) w[k] = $5}
  END {for (k in m) printf "%-26s cpu_min %.2f s  wall_min %.2f s\n", k, m[k], w[k]}' | sort
uptime
