"""Quantized sets that lack a part: refused (exit 3), never read as plain tensors.

A scheme recognises a weight only when every part it needs is stored. A set missing one
(GPTQ codes without their scales, NVFP4 codes without their global scale, a bitsandbytes
absmax without its quant state, a scale whose codes are not stored) would otherwise fall
through to the identity view: its packed words measured as if they were a weight, its
scales counted in the global norm (issue 21: "27,694 where the real norm is 54.2").

The rule (docs/FORMATS.md, "Quantized checkpoints"): after every scheme has claimed its
weights, a stored tensor that no scheme claimed and whose name and dtype make it a part
of a quantized set is refused, naming the weight and the part it lacks. Names that only a
quantization library writes (`qweight`, `qzeros`, `weight_packed`, `weight_scale_inv`,
`weight_global_scale`, `.absmax`, `SCB`, ...) are refused in any checkpoint; generic ones
(`scales`, `g_idx`, `weight_scale`, `_scales`) only in a checkpoint quantized in their
family (its config.json's quant_method, or a weight recognised in it, is GPTQ/AWQ for
`scales`), so a plain model with a parameter called `scales` is read as it always was.
A part whose codes are stored but in a dtype no scheme reads (a compressed-tensors
`int-quantized` int8 weight with its `weight_scale`) is a complete set clipcli does not
decode: left to the existing warning (norms, diff) and refusal (clip), as documented.
`--stored` (ls, norms) reads every stored tensor as it is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.logical.quantized import intcodes, rules

if TYPE_CHECKING:
    from clipcli.formats.base import TensorInfo

BNB_STATES = (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")


class Companion(NamedTuple):
    """A part named `<module><suffix>` that belongs to codes named `<module><codes>`. A
    dotted suffix (".qzeros") is a part of a module, the root module's included: its bare
    name ("qzeros") is that part too (rules.module_prefix, _prefix)."""

    suffix: str
    codes: tuple[str, ...]  # the codes' suffixes it may belong to (any one of them)
    scheme: str  # for the message
    # None: a name only quantization libraries write, refused in any checkpoint. Else a
    # generic name, refused only where the checkpoint is quantized in this family: its
    # config's quant_method is one of these, or a weight of a scheme starting with one
    # of them was recognised.
    family: tuple[str, ...] | None = None


# Longer suffixes first where one ends another (".weight_scale_inv" / ".weight_scale").
COMPANIONS = (
    Companion(".qzeros", (".qweight",), "GPTQ/AWQ zero point"),
    Companion(".weight_scale_inv", (".weight",), "block-FP8 scale"),
    Companion(".weight_global_scale", (".weight_packed",), "NVFP4 global scale"),
    Companion(".weight_shape", (".weight_packed",), "packed-integer shape"),
    Companion(".weight_zero_point", (".weight_packed", ".weight"), "zero point"),
    Companion(".weight_g_idx", (".weight_packed",), "packed-integer g_idx"),
    Companion(".weight.absmax", (".weight",), "bitsandbytes absmax"),
    Companion(".weight.quant_map", (".weight",), "bitsandbytes quant map"),
    Companion(".weight.nested_absmax", (".weight",), "bitsandbytes nested absmax"),
    Companion(".weight.nested_quant_map", (".weight",), "bitsandbytes nested quant map"),
    Companion(".SCB", (".weight",), "LLM.int8 scale"),
    Companion(".scales", (".qweight",), "GPTQ/AWQ scale", ("gptq", "awq")),
    Companion(".g_idx", (".qweight",), "GPTQ g_idx", ("gptq",)),
    Companion(
        ".weight_scale",
        (".weight", ".weight_packed"),
        "weight scale",
        ("compressed-tensors", "fbgemm_fp8", "fp8-", "nvfp4", "mxfp4", "pack-quantized"),
    ),
    Companion(".scale_weight", (".weight",), "weight scale", ("fp8-",)),
    Companion("_scales", ("_blocks",), "MXFP4 scale", ("mxfp4",)),
)
# Every name a check below may refuse ends in one of these (".weight": LLM.int8 codes,
# checked only under a bitsandbytes config).
SUFFIXES = (".qweight", ".weight_packed", "_blocks", *(c.suffix for c in COMPANIONS))
# The same parts of the root module: their names have no prefix ("qzeros", "SCB").
BARE = rules.bare_parts(SUFFIXES)
BARE_WEIGHT = rules.bare_parts((".weight",))
BNB_PARTS = frozenset(
    {".weight.absmax", ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map"}
)


def refuse_incomplete(
    stored: Mapping[str, TensorInfo],
    claimed: Collection[str],
    config: Mapping[str, Any] | None,
    schemes: Collection[str],
) -> None:
    """Exit 3 for the first stored tensor (in file order) that no scheme claimed and that
    is a part of a quantized set missing another part. `claimed`: the stored names some
    scheme's weight is made of; `schemes`: the schemes of the weights recognised."""
    method = rules.method_of(config)
    families = {*schemes, *([method] if method is not None else [])}
    # One C-level test per name first: 200,000 plain names cost milliseconds, not a second.
    bnb = method == "bitsandbytes"
    suffixes = SUFFIXES + ((".weight",) if bnb else ())
    bare = BARE | BARE_WEIGHT if bnb else BARE
    for name, info in stored.items():
        # a module's part, or the root module's bare one (rules.bare_parts)
        if not (name.endswith(suffixes) or name in bare) or name in claimed:
            continue
        problem = _codes_missing(name, info, stored, config) or _companion_missing(
            name, info, stored, families
        )
        if problem is not None:
            weight, what = problem
            raise rules.incomplete(weight, f"{what}: its real values are unknown")


def _codes_missing(
    name: str, info: TensorInfo, stored: Mapping[str, TensorInfo], config: Mapping[str, Any] | None
) -> tuple[str, str] | None:
    """(weight, what is wrong) when `name` holds a quantized weight's codes that no scheme
    claimed, else None."""
    dtype = rules.dtype_name(info)
    module = rules.module_prefix(name, "qweight")  # "X.", or "" for the root module
    if module is not None and dtype in intcodes.WORD_DTYPES:
        missing = [module + s for s in ("qzeros", "scales") if module + s not in stored]
        if missing:
            return module + "weight", f"GPTQ/AWQ codes {name} stored without {_and(missing)}"
        return module + "weight", (
            f"GPTQ/AWQ codes {name} {rules.shown(info.shape)} with {module}qzeros "
            f"{rules.shown(stored[module + 'qzeros'].shape)} and {module}scales "
            f"{rules.shown(stored[module + 'scales'].shape)} fit neither GPTQ's layout nor AWQ's"
        )
    module = rules.module_prefix(name, "weight_packed")
    if module is not None and dtype in ("uint8", *intcodes.WORD_DTYPES):
        return _packed_missing(name, module, dtype, stored)
    if name.endswith("_blocks") and dtype == "uint8" and _mxfp4_blocks(info):
        scales = name[: -len("_blocks")] + "_scales"
        if scales not in stored:
            return name[: -len("_blocks")], f"MXFP4 blocks {name} stored without {scales}"
    module = rules.module_prefix(name, "weight")
    if (
        module is not None
        and dtype == "int8"
        and rules.method_of(config) == "bitsandbytes"
        and config is not None
        and config.get("load_in_8bit") is True
        and module + "SCB" not in stored
    ):
        scb = module + "SCB"
        return name, f"LLM.int8 codes {name} stored without {scb} (config.json: load_in_8bit)"
    return None


def _packed_missing(
    name: str, module: str, dtype: str, stored: Mapping[str, TensorInfo]
) -> tuple[str, str] | None:
    weight = module + "weight"
    scale = stored.get(module + "weight_scale")
    if dtype != "uint8":  # compressed-tensors pack-quantized integers
        needed = ("weight_scale", "weight_shape")
        missing = [module + s for s in needed if module + s not in stored]
        if missing:
            return weight, f"packed integer codes {name} stored without {_and(missing)}"
        return None  # complete: packed_int decides (and refuses what it cannot read)
    global_scale = module + "weight_global_scale"
    if scale is None:
        return weight, f"4-bit codes {name} stored without {module}weight_scale"
    if rules.dtype_name(scale) in rules.FP8_CODE_DTYPES and global_scale not in stored:
        return weight, (
            f"NVFP4 codes {name} with an {rules.dtype_name(scale)} {scale.name} stored "
            f"without {global_scale}"
        )
    return weight, (
        f"4-bit codes {name} with a {rules.dtype_name(scale)} {scale.name}"
        + (" and a global scale" if global_scale in stored else "")
        + " fit neither MXFP4 (an E8M0 scale, no global scale) nor NVFP4 (an fp8 e4m3 "
        "scale and a global scale)"
    )


def _mxfp4_blocks(info: TensorInfo) -> bool:
    """gpt-oss's blocks: [..., nb, 16] bytes (two e2m1 codes each, 32 per block)."""
    return len(info.shape) >= 2 and info.shape[-1] == 16


def _companion_missing(
    name: str, info: TensorInfo, stored: Mapping[str, TensorInfo], families: Collection[str]
) -> tuple[str, str] | None:
    """(weight, what is missing) when `name` is a part of a quantized set whose codes (or,
    for bitsandbytes, quant state) are not stored, else None."""
    for companion in COMPANIONS:
        module = _prefix(name, companion.suffix)
        if module is None:
            continue
        family = companion.family
        if family is not None and not any(f.startswith(family) for f in families):
            return None
        if companion.suffix == "_scales" and rules.dtype_name(info) != "uint8":
            return None  # MXFP4 scales are E8M0 bytes; another "_scales" is no such part
        codes = [_named(module, c) for c in companion.codes]
        weight = module + ("" if companion.codes == ("_blocks",) else "weight")
        if not any(c in stored for c in codes):
            return weight, (
                f"a {companion.scheme} {name} stored without its codes {' or '.join(codes)}"
            )
        if companion.suffix in BNB_PARTS and not any(weight + s in stored for s in BNB_STATES):
            return weight, (
                f"bitsandbytes 4-bit parts ({name}) stored without the quant state "
                f"{weight}{BNB_STATES[0]} (or __fp4)"
            )
        return None
    return None


def _prefix(name: str, suffix: str) -> str | None:
    """`name` as <prefix><suffix>, or None: for a dotted suffix the module's prefix with its
    dot, "" for the root module's bare part (rules.module_prefix); for gpt-oss's "_scales"
    the weight's name."""
    if suffix.startswith("."):
        return rules.module_prefix(name, suffix[1:])
    return name[: -len(suffix)] if name.endswith(suffix) else None


def _named(prefix: str, suffix: str) -> str:
    """The name _prefix read: prefix + the suffix (without its dot for a module's part)."""
    return prefix + (suffix[1:] if suffix.startswith(".") else suffix)


def _and(names: list[str]) -> str:
    return " and ".join(names)
