"""The script a user would write: load everything, norm each tensor in float64."""

import sys

import numpy as np
from safetensors.numpy import load_file

tensors = load_file(sys.argv[1])
norms = {name: float(np.linalg.norm(v.astype(np.float64))) for name, v in tensors.items()}
print(sum(n * n for n in norms.values()) ** 0.5)
