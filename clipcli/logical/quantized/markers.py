"""What says a checkpoint may hold quantized weights, known without importing a scheme:
its names' markers and config.json's quantization_config. A plain checkpoint (no marker,
no config) is read through the identity view, and neither the quantized view nor any
scheme module is imported (start-up: ~35 ms of ~210 for `norms` of a small file)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipcli.errors import InputError

if TYPE_CHECKING:
    from clipcli.formats.base import Reader

CONFIG_LIMIT = 16 << 20  # bytes: a config.json is a few KB; never slurp a huge one

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


def may_be_quantized(reader: Reader) -> bool:
    """Whether any scheme may claim a weight of `reader`'s checkpoint: its config.json has a
    quantization_config (a config.json that cannot be read is refused here, exit 3), or a
    stored name holds a marker. False: it is read as stored, and no scheme is imported."""
    return quantization_config(reader.model_directory) is not None or may_hold_quantized(
        t.name for t in reader.listing
    )


def quantization_config(directory: Path | None) -> Mapping[str, Any] | None:
    """config.json's quantization_config, or None when there is none. A config.json that is
    there but cannot be read as one object, or whose quantization_config is not an object,
    is refused: its scheme would otherwise be guessed from names."""
    if directory is None:
        return None
    from clipcli.formats.sharded.layout import allowed_roots, real_path_inside
    from clipcli.system.inputs import read_input

    path = directory / "config.json"
    if not path.exists() and not path.is_symlink():
        return None
    real = real_path_inside(path, allowed_roots(directory))
    raw, _ = read_input(path, CONFIG_LIMIT, real)
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(path, f"is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        return None  # not a Hugging Face config: says nothing about quantization
    quant = document.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise InputError(path, "quantization_config is not an object")
    method = quant.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise InputError(path, f"quantization_config.quant_method {method!r} is not a string")
    return quant
