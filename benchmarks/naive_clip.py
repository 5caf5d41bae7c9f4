"""The script a user would write for clip_by_global_norm: load, norm, scale, save.

    python benchmarks/naive_clip.py IN.safetensors OUT.safetensors LIMIT

Global norm in float64; every tensor is scaled by LIMIT / max(norm, LIMIT) in float64 and
cast back to its dtype (fp32/fp16 files: safetensors.numpy cannot hold bfloat16).
"""

import sys

import numpy as np
from safetensors.numpy import load_file, save_file

src, out, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
tensors = load_file(src)
g = sum(float(np.linalg.norm(v.astype(np.float64))) ** 2 for v in tensors.values()) ** 0.5
scale = limit / max(g, limit)
save_file({k: (v.astype(np.float64) * scale).astype(v.dtype) for k, v in tensors.items()}, out)
