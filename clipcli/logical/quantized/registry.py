"""Every scheme module the quantized view asks, in order (each implements scheme.Scheme)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from clipcli.logical.quantized import (
    awq,
    bnb,
    fp8_block,
    fp8_scaled,
    gptq,
    mxfp4,
    nvfp4,
    packed_int,
)

if TYPE_CHECKING:
    from clipcli.logical.quantized.scheme import Scheme

SCHEMES: tuple[Scheme, ...] = (fp8_block, fp8_scaled, mxfp4, nvfp4, gptq, awq, packed_int, bnb)

# A stored name holding one of these is a companion some scheme recognises its weights by
# (a scale, packed codes, a quant state). Without any, and without a quantization_config,
# no scheme claims anything: `ls` lists such a checkpoint from its header alone, without
# numpy (tests/test_startup.py). Every scheme's recognise() needs one of them.
MARKERS = (
    "_scale_inv",  # fp8_block
    ".weight_scale",  # fp8_scaled, nvfp4, packed_int
    ".scale_weight",  # fp8_scaled (ComfyUI)
    "_scales",  # mxfp4 (gpt-oss)
    ".weight_packed",  # mxfp4, nvfp4, packed_int
    ".qweight",  # gptq, awq
    ".quant_state.bitsandbytes__",  # bnb 4-bit
    ".SCB",  # bnb LLM.int8
    # parts of a set that may lack the marker above (incomplete.py refuses such a set)
    ".qzeros",
    ".weight_global_scale",
    ".weight_shape",
    ".weight_zero_point",
    ".weight_g_idx",
    ".weight.absmax",
    ".weight.quant_map",
    ".weight.nested_",
)
# Matched at the end of a name only: "_blocks" is in diffusers' "down_blocks.0.…".
END_MARKERS = ("_blocks",)
# The dotted markers as the root module's names begin ("qweight", "SCB": a part without a
# prefix is a part like any other), matched after the newline that starts a name.
BARE_MARKERS = tuple("\n" + marker[1:] for marker in MARKERS if marker.startswith("."))


def may_hold_quantized(names: Iterable[str]) -> bool:
    """False when no scheme can recognise a weight (or a set missing a part) among
    `names` without a config."""
    # One search per marker through all names at once (200,000 names: ms, not 0.1 s): no
    # marker holds the newline, so none is found across two names, and a name's end is
    # where a newline follows it.
    joined = "\n" + "\n".join(names) + "\n"
    return (
        any(marker in joined for marker in MARKERS)
        or any(marker in joined for marker in BARE_MARKERS)
        or any(marker + "\n" in joined for marker in END_MARKERS)
    )
