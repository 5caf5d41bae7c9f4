"""Pure: what a tensor is for, from its name alone. Model weights versus training state.

TensorFlow's clip_by_global_norm is applied to the gradients of trainable weights, never to
an optimizer's slots or to statistics a layer keeps for itself. A checkpoint often carries
both: Keras' legacy full model holds `optimizer_weights/.../iterations:0`, a float32 step
counter that can dominate the global norm. So by default norms, the global norm and every
clip mode act on model weights only; the rest is listed apart and copied bit for bit.

The rules (documented in the README, "Model weights and training state"):
- optimizer state: the first name component (split at '/' or '.') is one of
  OPTIMIZER_ROOTS (Keras `optimizer_weights/`, TF/Keras 3 `optimizer/`, PyTorch-style
  `optimizer.` / `optim_state` / `optimizer_state` dictionaries saved beside the model);
- non-trainable buffer: the last name component, without a Keras `:0` suffix, is one of
  BUFFER_NAMES (BatchNorm's running statistics in Keras and PyTorch).
Keras 3 `.weights.h5` files number their variables (`vars/0`, `vars/1`) instead of naming
them, so their BatchNorm statistics cannot be told from weights by name.
A tensor named like a weight that is not floating point (an int64 `position_ids`, a step
counter, a bool mask) is no parameter: its role is NON_FLOAT, never WEIGHT. Its dtype
decides that, so it is no training state either: --all-tensors cannot bring it in.
"""

from __future__ import annotations

import re
from enum import Enum

OPTIMIZER_ROOTS = frozenset(
    {
        "optimizer_weights",
        "optimizer",
        "optim_state",
        "optim_state_dict",
        "optimizer_state",
        "optimizer_state_dict",
        "optimizer_states",  # Lightning checkpoints: a list of optimizer state dicts
        # Lightning's trainer state beside them (checkpoint_connector.dump_checkpoint):
        # ModelCheckpoint's best_model_score tensor is a loss value, no weight to clip
        *("callbacks", "lr_schedulers", "loops"),
    }
)
BUFFER_NAMES = frozenset(
    {"moving_mean", "moving_variance", "running_mean", "running_var", "num_batches_tracked"}
)

_SEPARATORS = re.compile(r"[/.]")
_KERAS_SUFFIX = re.compile(r":\d+$")


class Role(str, Enum):
    """What a tensor is for; only WEIGHT is measured and clipped by default."""

    WEIGHT = "weight"
    OPTIMIZER = "optimizer"
    BUFFER = "buffer"
    NON_FLOAT = "non-float"
    # A stored tensor that belongs to a logical tensor without being values (a quantized
    # weight's scales or zero points, an activation scale): listed, never in a norm, not
    # even with --all-tensors (clipcli.logical).
    QUANTIZATION = "quantization"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]

    @property
    def training_state(self) -> bool:
        """Left out by name unless --all-tensors (optimizer slots, BatchNorm statistics)."""
        return self is _OPTIMIZER or self is _BUFFER

    @property
    def kept_apart(self) -> bool:
        """Never measured into a global norm nor clipped by default."""
        return self is _OPTIMIZER or self is _BUFFER or self is _QUANTIZATION


# The members as module names: `Role.X` is a lookup through the Enum class (~0.2 us) and
# `in (...)` an Enum.__hash__ in Python; kept_apart is asked of 200,000 tensors at a time.
_OPTIMIZER, _BUFFER, _QUANTIZATION = Role.OPTIMIZER, Role.BUFFER, Role.QUANTIZATION

# The roles a name decides (classify); QUANTIZATION comes from a view, never from a name.
BY_NAME = (Role.WEIGHT, Role.OPTIMIZER, Role.BUFFER, Role.NON_FLOAT)

_DESCRIPTIONS = {
    Role.WEIGHT: "model weight",
    Role.OPTIMIZER: "optimizer state",
    Role.BUFFER: "non-trainable buffer",
    Role.NON_FLOAT: "non-floating-point tensor",
    Role.QUANTIZATION: "quantization scale or zero point",
}

# numpy's and ml_dtypes' names of the floating-point and complex dtypes (float16,
# bfloat16, float8_e4m3fn, float4_e2m1fn, complex64, ...): what `ls` tells apart by the
# dtype's name alone, without numpy (clipcli.dtypes.is_floating on the dtype agrees).
# GGUF's block-quantized types (Q4_0, Q4_K, IQ2_XXS, TQ1_0, MXFP4, NVFP4) are listed by
# their ggml names: their real values are floating point too.
_FLOATING_PREFIXES = ("float", "bfloat", "complex", "Q", "IQ", "TQ", "MXFP", "NVFP")


def is_floating_name(dtype_name: str) -> bool:
    return dtype_name.startswith(_FLOATING_PREFIXES)


# Every name in OPTIMIZER_ROOTS holds "optim" or starts with one of LIGHTNING_ROOTS, and every
# one in BUFFER_NAMES one of these: a name holding none of them is not training state, known
# without splitting it (a checkpoint of 200,000 tensors asks this of each, several times).
BUFFER_MARKS = ("moving_", "running_", "num_batches_tracked")
LIGHTNING_ROOTS = ("callbacks", "lr_schedulers", "loops")


def classify(name: str, floating: bool = True) -> Role:
    """The role of the tensor called `name` (HDF5 path or dotted safetensors/npz name):
    training state by name first, then NON_FLOAT for a tensor that is not `floating`."""
    if (
        "optim" not in name
        and "moving_" not in name
        and "running_" not in name
        and "num_batches_tracked" not in name
        and not name.startswith(LIGHTNING_ROOTS)
    ):
        return Role.WEIGHT if floating else Role.NON_FLOAT
    parts = [part for part in _SEPARATORS.split(name) if part]
    if parts and parts[0] in OPTIMIZER_ROOTS:
        return Role.OPTIMIZER
    if parts and _KERAS_SUFFIX.sub("", parts[-1]) in BUFFER_NAMES:
        return Role.BUFFER
    return Role.WEIGHT if floating else Role.NON_FLOAT
