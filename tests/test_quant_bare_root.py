"""Quantized parts of the root module (names without a prefix: `qweight`, `scales`,
`weight` + `weight_scale_inv`, `SCB`, `weight_packed`, ...) are a quantized set like any
module's: decoded to the same real values, refused when incomplete (exit 3) exactly as
`m.qweight`, `m.scales`, ... are. They used to pass every rule: bare `qzeros` + `scales`
read as plain tensors (the scales counted in the global norm), a bare GPTQ set measured
as its scales (0.038 for a real 1.362) and clipped "within limit" left above it.

Every scheme, prefixed and bare: the same exit code, the same rows (names apart) and the
same global norm, that of a Fraction reference built from the published layouts by the
scheme tests' own encoders (no clipcli code)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from quant_int_reference import dense_stream, exact_sqrt, fractions_of
from quant_reference import e4m3fn_value, read_raw_safetensors, write_model_directory
from test_quant_bnb import four_bit
from test_quant_gptq_awq import awq_arrays, gptq_arrays, gptq_reference
from test_quant_packed_int import config as packed_config
from test_quant_packed_int import layer
from test_quantized_fp4 import gpt_oss_mxfp4, nvfp4, pack_low_first

from clipcli.logical.quantized.markers import may_hold_quantized

Raw = dict[str, tuple[str, list[int], bytes]]
CODES = {
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
}
GPTQ_CONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 32,
    "desc_act": False,
    "sym": False,
    "checkpoint_format": "gptq",
}


def raw(arrays: Mapping[str, np.ndarray]) -> Raw:
    return {
        name: (CODES[a.dtype], list(a.shape), np.ascontiguousarray(a).tobytes())
        for name, a in arrays.items()
    }


def relative(stored: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The builders' names without their module prefix: the parts of one module."""
    assert all(name.startswith(prefix) for name in stored)
    return {name[len(prefix) :]: value for name, value in stored.items()}


def flat(values: Any) -> list[Fraction]:
    if isinstance(values, list):
        return [v for item in values for v in flat(item)]
    return [values]


def norm_of(values: Iterable[Fraction]) -> float:
    return exact_sqrt(sum((v * v for v in values), Fraction(0)))


# ---------------------------------------------------------------- one module per scheme
# Each: (the module's parts by bare name, quantization_config or None, reference values).
Case = tuple[Raw, dict[str, Any] | None, list[Fraction]]


def fp8_codes(rng: random.Random, count: int) -> list[int]:
    """e4m3fn codes, never NaN (0x7F, 0xFF), both signs."""
    return [rng.randint(0, 0x7E) | rng.choice((0, 0x80)) for _ in range(count)]


def fp8_block(configured: bool) -> Case:
    rng = random.Random(1)
    rows, columns = 4, 6
    codes = fp8_codes(rng, rows * columns)
    block = (2, 3) if configured else (rows, columns)
    grid = (rows // block[0], columns // block[1])
    scales = np.array([[rng.uniform(0.01, 4.0) for _ in range(grid[1])] for _ in range(grid[0])])
    scales = scales.astype(np.float32)
    s = fractions_of(scales)
    values = []
    for i in range(rows):
        for j in range(columns):
            value = e4m3fn_value(codes[i * columns + j])
            assert value is not None
            values.append(value * s[i // block[0]][j // block[1]])
    parts: Raw = {
        "weight": ("F8_E4M3", [rows, columns], bytes(codes)),
        "weight_scale_inv": raw({"s": scales})["s"],
    }
    config = {"quant_method": "fp8", "weight_block_size": list(block)} if configured else None
    return parts, config, values


def fp8_channel() -> Case:
    rng = random.Random(2)
    rows, columns = 5, 4
    codes = fp8_codes(rng, rows * columns)
    scales = np.array([[rng.uniform(0.01, 4.0)] for _ in range(rows)], np.float32)
    s = fractions_of(scales)
    values = []
    for i in range(rows):
        for j in range(columns):
            value = e4m3fn_value(codes[i * columns + j])
            assert value is not None
            values.append(value * s[i][0])
    parts: Raw = {
        "weight": ("F8_E4M3", [rows, columns], bytes(codes)),
        **raw({"weight_scale": scales, "input_scale": np.array([0.5], np.float32)}),
    }
    return parts, None, values


def mxfp4_gpt_oss() -> Case:
    stored, _, _, values = gpt_oss_mxfp4(np.random.default_rng(3), (2,), 1)
    parts = relative(stored, "mlp.experts.")  # "down_proj_blocks": gpt-oss's root names
    return parts, {"quant_method": "mxfp4"}, [v for v in values if v is not None]


def mxfp4_pack() -> Case:
    rng = np.random.default_rng(5)
    rows, columns = 3, 64
    codes = [int(c) for c in rng.integers(0, 16, rows * columns)]
    exponents = [int(e) for e in rng.integers(110, 140, rows * 2)]
    from quant_reference import e2m1_value, e8m0_value

    values = []
    for i in range(rows * columns):
        scale = e8m0_value(exponents[(i // columns) * 2 + (i % columns) // 32])
        assert scale is not None
        values.append(e2m1_value(codes[i]) * scale)
    parts: Raw = {
        "weight_packed": ("U8", [rows, columns // 2], pack_low_first(codes)),
        "weight_scale": ("U8", [rows, 2], bytes(exponents)),
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {},
    }
    return parts, config, values


def nvfp4_case() -> Case:
    stored, _, _, values = nvfp4(np.random.default_rng(6), 3, 32, 1.0, positive=True)
    config = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {},
    }
    return relative(stored, "layer."), config, [v for v in values if v is not None]


def packed_int_case() -> Case:
    arrays, reference = layer((6, 40), 4, 3, dense_stream, group=16, seed=4)
    return raw(relative(arrays, "m.")), packed_config(4), flat(reference)


def gptq_case(configured: bool) -> Case:
    if configured:
        arrays, g_idx, q, z = gptq_arrays(64, 16, 4, 2, seed=7)
        del arrays["m.g_idx"]  # desc_act false: groups of 32 in order
    else:
        arrays, g_idx, q, z = gptq_arrays(96, 40, 4, 3, seed=4, act_order=True)
    reference = gptq_reference(arrays, g_idx, q, z, plus=1)
    return raw(relative(arrays, "m.")), GPTQ_CONFIG if configured else None, flat(reference)


def awq_case() -> Case:
    arrays, reference = awq_arrays(64, 24, 16, seed=3)
    return raw(relative(arrays, "m.")), None, flat(reference)


def bnb_nf4() -> Case:
    arrays, reference = four_bit((5, 13), 16, seed=2)
    return raw(relative(arrays, "m.")), {"quant_method": "bitsandbytes"}, reference


def bnb_int8() -> Case:
    rng = random.Random(3)
    q = np.array([[rng.randint(-127, 127) for _ in range(6)] for _ in range(4)], np.int8)
    scb = np.array([rng.uniform(0.01, 9.0) for _ in range(4)], np.float32)
    values = [
        Fraction(int(q[i, j])) * Fraction(float(scb[i])) / 127 for i in range(4) for j in range(6)
    ]
    return raw({"weight": q, "SCB": scb}), None, values


CASES: dict[str, Callable[[], Case]] = {
    "fp8-block": lambda: fp8_block(False),
    "fp8-block-config": lambda: fp8_block(True),
    "fp8-channel": fp8_channel,
    "mxfp4-gpt-oss": mxfp4_gpt_oss,
    "mxfp4-pack": mxfp4_pack,
    "nvfp4": nvfp4_case,
    "packed-int": packed_int_case,
    "gptq": lambda: gptq_case(False),
    "gptq-config": lambda: gptq_case(True),
    "awq": awq_case,
    "bnb-nf4": bnb_nf4,
    "bnb-int8": bnb_int8,
}


def written(directory: Path, parts: Raw, prefix: str, config: dict[str, Any] | None) -> Path:
    """A model directory (config.json: the quantization_config, if any) of one module."""
    stored = {prefix + name: part for name, part in parts.items()}
    document = None if config is None else {"quantization_config": config}
    return write_model_directory(directory, {"model.safetensors": stored}, document)


def rows(report: dict[str, Any], prefix: str) -> list[tuple[Any, ...]]:
    """Each row of `norms --json` without the module prefix."""
    shown = []
    for row in report["tensors"]:
        assert row["name"].startswith(prefix)
        shown.append((row["name"][len(prefix) :], row["role"], row["in_global"], row["norm"]))
    return shown


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bare_set_reads_as_the_prefixed_one(
    case: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    parts, config, values = CASES[case]()
    reports = {}
    for prefix in ("m.", ""):
        directory = written(tmp_path / f"p{prefix}", parts, prefix, config)
        run = run_main("norms", directory, "--json")
        assert run.code == 0, run.stderr
        reports[prefix] = run.json()
    assert rows(reports[""], "") == rows(reports["m."], "m.")
    assert reports[""]["global_norm"] == reports["m."]["global_norm"]
    # the real weight alone is in the global norm: no scale counted as a weight
    assert math.isclose(reports[""]["global_norm"], norm_of(values), rel_tol=1e-13)
    weights = [r for r in reports[""]["tensors"] if r["in_global"]]
    assert len(weights) == 1 + ("bias" in parts), weights


# ---------------------------------------------------------------- incomplete sets

INCOMPLETE: dict[str, tuple[str, dict[str, Any] | None, tuple[str, ...]]] = {
    # case -> (the scheme's full set, its config, the parts left out)
    "gptq without qweight": ("gptq", None, ("qweight", "g_idx")),
    "gptq without scales": ("gptq", None, ("scales",)),
    "gptq dir without qzeros": ("gptq-config", GPTQ_CONFIG, ("qzeros",)),
    "fp8 scale without codes": ("fp8-block", None, ("weight",)),
    "fp8 codes without scale": ("fp8-block-config", {"quant_method": "fp8"}, ("weight_scale_inv",)),
    "fp8 channel scale without codes": (
        "fp8-channel",
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
        ("weight",),
    ),
    "SCB without codes": ("bnb-int8", None, ("weight",)),
    "nvfp4 without global scale": ("nvfp4", None, ("weight_global_scale",)),
    "nvfp4 global scale alone": ("nvfp4", None, ("weight_packed", "weight_scale")),
    "packed int without shape": ("packed-int", None, ("weight_shape",)),
    "packed int zero point alone": ("packed-int", None, ("weight_packed", "weight_scale")),
    "bnb absmax without state": ("bnb-nf4", None, ("weight.quant_state.bitsandbytes__nf4",)),
    "mxfp4 blocks without scales": ("mxfp4-gpt-oss", None, ("down_proj_scales",)),
}


@pytest.mark.parametrize("case", sorted(INCOMPLETE))
def test_a_bare_incomplete_set_is_refused_as_the_prefixed_one(
    case: str, run_main: Callable[..., Any], tmp_path: Path
) -> None:
    scheme, config, left_out = INCOMPLETE[case]
    parts, own_config, _ = CASES[scheme]()
    for name in left_out:
        del parts[name]
    config = config if config is not None else own_config
    errors = {}
    for prefix in ("m.", ""):
        directory = written(tmp_path / f"p{prefix}", parts, prefix, config)
        run = run_main("norms", directory, "--json")
        assert run.code == 3, (prefix, run.stdout, run.stderr)
        assert run.stdout == ""
        assert len(run.stderr.splitlines()) == 1
        errors[prefix] = run.stderr
    assert errors[""] == errors["m."].replace("m.", ""), errors


# ---------------------------------------------------------------- clip


def test_a_clip_of_a_bare_gptq_set_puts_the_real_norm_at_the_limit(
    run_main: Callable[..., Any], tmp_path: Path
) -> None:
    """The attack's case: a bare GPTQ directory clipped --global 1 used to exit 0 "within
    limit", its scales measured in place of the weight and its real norm (1.36) above 1.
    Now the scales are scaled; the norm of what is written, recomputed in Fractions from
    OUT's own scales, is 1 (within the factor's rounding, never above)."""
    arrays, g_idx, q, z = gptq_arrays(64, 16, 4, 2, seed=7)
    del arrays["m.g_idx"]
    parts = raw(relative(arrays, "m."))
    before = norm_of(flat(gptq_reference(arrays, g_idx, q, z, plus=1)))
    limit = before / 2
    outs = {}
    for prefix in ("m.", ""):
        directory = written(tmp_path / f"p{prefix}", parts, prefix, GPTQ_CONFIG)
        out = tmp_path / f"out{prefix}"
        run = run_main("clip", directory, out, "--global", repr(limit))
        assert run.code == 0, run.stderr
        outs[prefix] = read_raw_safetensors(out / "model.safetensors")
    assert relative(outs["m."], "m.") == outs[""]  # byte for byte, names apart
    clipped = dict(arrays)
    dtype, shape, payload = outs[""]["scales"]
    assert dtype == "F16"
    clipped["m.scales"] = np.frombuffer(payload, np.float16).reshape(shape)
    assert outs[""]["qweight"] == parts["qweight"]  # the codes kept
    after = norm_of(flat(gptq_reference(clipped, g_idx, q, z, plus=1)))
    assert after <= limit
    assert after == pytest.approx(limit, rel=2e-3)  # float16 scales, each rounded down


# ---------------------------------------------------------------- the cheap name test


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["qweight"], True),
        (["scales", "qzeros"], True),
        (["SCB"], True),
        (["weight", "weight_scale"], True),
        (["weight_packed"], True),
        (["weight.absmax"], True),
        (["weight", "bias", "scales"], False),  # generic names alone: no scheme's marker
    ],
)
def test_root_names_are_markers_too(names: list[str], expected: bool) -> None:
    assert may_hold_quantized(names) is expected


def test_a_bare_activation_scale_is_no_weight(run_main: Callable[..., Any], tmp_path: Path) -> None:
    parts, _, values = fp8_channel()
    directory = written(tmp_path / "d", parts, "", None)
    report = run_main("norms", directory, "--json").json()
    roles = {r["name"]: (r["role"], r["in_global"]) for r in report["tensors"]}
    assert roles["input_scale"][1] is False
    assert math.isclose(report["global_norm"], norm_of(values), rel_tol=1e-13)
