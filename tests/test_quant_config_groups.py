"""Issue 21, third attack round, break 1: compressed-tensors `config_groups` with another
scheme per module. Each module takes the scheme of the group whose targets match it
(compressed-tensors' utils/match.py: `re:` = re.match on the module name, else an exact
name or a class name; exact over regex over class; `ignore` first). A module holding codes
that two groups match at the same rank, or none, or that `ignore` names, is refused (exit 3,
naming it). Every pairing of mxfp4-pack, nvfp4, fp8 float-quantized and int4 pack-quantized.

References: values from the formats' definitions (tests/quant_reference.py), packed words
from tests/quant_int_reference.py, sums of squares as Fractions.
"""

from __future__ import annotations

import itertools
import json
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from quant_int_reference import per_word_stream
from quant_reference import (
    e2m1_value,
    e4m3fn_value,
    e8m0_value,
    f32_payload,
    float32_value,
    sqrt_fraction,
    write_model_directory,
)

ROWS, COLUMNS = 2, 32
MLP = "model.layers.0.mlp.down_proj"
ATTN = "model.layers.0.self_attn.q_proj"
FLOAT8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
INT4 = {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True}
FP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
GROUPS = {  # scheme -> (format, weights args)
    "mxfp4": ("mxfp4-pack-quantized", FP4),
    "nvfp4": ("nvfp4-pack-quantized", NVFP4_ARGS),
    "fp8": ("float-quantized", FLOAT8),
    "int4": ("pack-quantized", INT4),
}
SHOWN = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8-channel", "int4": "pack-quantized-int4"}


def fp4_bytes() -> tuple[bytes, list[Fraction]]:
    """ROWS x COLUMNS e2m1 codes (every code), low nibble first, and their values."""
    codes = [(i * 7 + 3) % 16 for i in range(ROWS * COLUMNS)]
    packed = bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))
    return packed, [e2m1_value(c) for c in codes]


def module(scheme: str, stem: str) -> tuple[dict[str, Any], list[Fraction]]:
    """The stored tensors of one ROWS x COLUMNS weight in `scheme`, and its exact values."""
    if scheme == "mxfp4":
        packed, values = fp4_bytes()
        scales = bytes([126, 129])  # one per row (32 values)
        tensors = {
            stem + ".weight_packed": ("U8", [ROWS, COLUMNS // 2], packed),
            stem + ".weight_scale": ("U8", [ROWS, 1], scales),
        }
        row_scales = [e8m0_value(b) for b in scales]
        assert None not in row_scales
        return tensors, [v * Fraction(row_scales[i // COLUMNS] or 0) for i, v in enumerate(values)]
    if scheme == "nvfp4":
        packed, values = fp4_bytes()
        scales = bytes([0x38, 0x40, 0x30, 0x44])  # e4m3: 1, 2, 0.5, 3; one per 16 values
        global_bits = 0x40000000  # 2.0
        global_scale = float32_value(global_bits)
        assert global_scale is not None
        tensors = {
            stem + ".weight_packed": ("U8", [ROWS, COLUMNS // 2], packed),
            stem + ".weight_scale": ("F8_E4M3", [ROWS, COLUMNS // 16], scales),
            stem + ".weight_global_scale": ("F32", [1], f32_payload([global_bits])),
        }
        out = []
        for i, v in enumerate(values):
            scale = e4m3fn_value(scales[i // 16])
            assert scale is not None
            out.append(v * scale / global_scale)
        return tensors, out
    scale_bits = [0x3E800000, 0x40400000]  # 0.25, 3.0 per row
    row_scales = [float32_value(b) for b in scale_bits]
    if scheme == "fp8":
        codes = bytes((i * 37 + 5) % 0x7E for i in range(ROWS * COLUMNS))  # no NaN codes
        tensors = {
            stem + ".weight": ("F8_E4M3", [ROWS, COLUMNS], codes),
            stem + ".weight_scale": ("F32", [ROWS, 1], f32_payload(scale_bits)),
        }
        values = []
        for i, c in enumerate(codes):
            value, scale = e4m3fn_value(c), row_scales[i // COLUMNS]
            assert value is not None
            assert scale is not None
            values.append(value * scale)
        return tensors, values
    assert scheme == "int4"
    unsigned = [(i * 5 + 1) % 16 for i in range(ROWS * COLUMNS)]  # Q = q + 8
    words = per_word_stream(unsigned, 4)
    tensors = {
        stem + ".weight_packed": (
            "I32",
            [ROWS, COLUMNS // 8],
            struct.pack(f"<{len(words)}I", *words),
        ),
        stem + ".weight_scale": ("F32", [ROWS, 1], f32_payload(scale_bits)),
        stem + ".weight_shape": ("I64", [2], struct.pack("<2q", ROWS, COLUMNS)),
    }
    values = []
    for i, q in enumerate(unsigned):
        scale = row_scales[i // COLUMNS]
        assert scale is not None
        values.append((q - 8) * scale)
    return tensors, values


def config(groups: dict[str, tuple[list[str], str]], ignore: list[str] | None = None) -> Any:
    """A mixed-precision compressed-tensors config: group key -> (targets, scheme)."""
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mixed-precision",
            "quantization_status": "compressed",
            "version": "0.10.0",
            "ignore": ignore or [],
            "config_groups": {
                key: {"targets": targets, "format": GROUPS[s][0], "weights": GROUPS[s][1]}
                for key, (targets, s) in groups.items()
            },
        }
    }


def norms(run_main: Any, directory: Path) -> dict[str, dict[str, Any]]:
    result = run_main("norms", directory, "--format", "json")
    assert result.code == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)["tensors"]}


def assert_norm(row: dict[str, Any], values: list[Fraction]) -> None:
    exact = sqrt_fraction(sum((v * v for v in values), Fraction(0)))
    assert abs(row["norm"] - exact) <= 2 * exact * 2**-52, (row["norm"], exact)


PAIRS = list(itertools.permutations(GROUPS, 2))


@pytest.mark.parametrize(("mlp", "attn"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_each_module_takes_its_own_groups_scheme(
    tmp_path: Path, run_main: Any, mlp: str, attn: str
) -> None:
    stored_mlp, values_mlp = module(mlp, MLP)
    stored_attn, values_attn = module(attn, ATTN)
    conf = config({"group_0": (["re:.*mlp.*"], mlp), "group_1": (["re:.*self_attn.*"], attn)})
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": {**stored_mlp, **stored_attn}}, conf
    )
    rows = norms(run_main, directory)
    assert rows[MLP + ".weight"]["quantization"]["scheme"] == SHOWN[mlp]
    assert rows[ATTN + ".weight"]["quantization"]["scheme"] == SHOWN[attn]
    assert_norm(rows[MLP + ".weight"], values_mlp)
    assert_norm(rows[ATTN + ".weight"], values_attn)
    # The other group targets nothing here: still each module its own scheme.
    alone = write_model_directory(tmp_path / "alone", {"model.safetensors": stored_mlp}, conf)
    assert_norm(norms(run_main, alone)[MLP + ".weight"], values_mlp)


def test_an_exact_name_wins_over_a_regex_and_a_regex_over_a_class(
    tmp_path: Path, run_main: Any
) -> None:
    stored_mlp, values_mlp = module("mxfp4", MLP)
    stored_attn, values_attn = module("fp8", ATTN)
    conf = config(
        {
            "group_0": (["Linear"], "int4"),
            "group_1": (["re:.*self_attn.*"], "fp8"),
            "group_2": ([MLP], "mxfp4"),
            "group_3": (["re:.*mlp.*"], "nvfp4"),
        }
    )
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": {**stored_mlp, **stored_attn}}, conf
    )
    rows = norms(run_main, directory)
    assert_norm(rows[MLP + ".weight"], values_mlp)
    assert_norm(rows[ATTN + ".weight"], values_attn)


def refused(run_main: Any, directory: Path, *needles: str) -> None:
    result = run_main("norms", directory)
    assert result.code == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("clipcli: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("groups", "ignore", "needles"),
    [
        (  # two regexes of two groups
            {"group_0": (["re:.*mlp.*"], "mxfp4"), "group_1": (["re:model\\..*"], "nvfp4")},
            None,
            ("both target it: ambiguous", "'group_0'", "'group_1'"),
        ),
        (  # two classes
            {"group_0": (["Linear"], "mxfp4"), "group_1": (["Linear"], "nvfp4")},
            None,
            ("both target it: ambiguous",),
        ),
        (  # none
            {"group_0": (["re:.*self_attn.*"], "mxfp4"), "group_1": (["re:.*gate$"], "nvfp4")},
            None,
            ("no config group of config.json targets it", "mxfp4"),
        ),
        (  # ignored, yet holding codes
            {"group_0": (["re:.*mlp.*"], "mxfp4"), "group_1": (["Linear"], "nvfp4")},
            ["re:.*down_proj$"],
            ("ignore entry 're:.*down_proj$' names it",),
        ),
    ],
    ids=["two-regexes", "two-classes", "none", "ignored"],
)
def test_an_undecided_module_with_codes_is_refused(
    tmp_path: Path, run_main: Any, groups: Any, ignore: Any, needles: tuple[str, ...]
) -> None:
    stored, _ = module("mxfp4", MLP)
    directory = write_model_directory(
        tmp_path / "m", {"model.safetensors": stored}, config(groups, ignore)
    )
    refused(run_main, directory, MLP, *needles)


def test_an_undecided_plain_module_is_read_as_it_is(tmp_path: Path, run_main: Any) -> None:
    stored, values = module("mxfp4", MLP)
    stored["model.norm.weight"] = ("F32", [2], f32_payload([0x3F800000, 0x3F800000]))
    conf = config({"group_0": (["re:.*mlp.*"], "mxfp4"), "group_1": (["re:.*attn.*"], "fp8")})
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    rows = norms(run_main, directory)
    assert rows["model.norm.weight"]["norm"] == 2**0.5
    assert_norm(rows[MLP + ".weight"], values)


@pytest.mark.parametrize(
    "target",
    ["re:(?=mlp)", "re:(.*", "re:a{101}", "re:\\1", "re:((a{100}){100})", "re:" + "a" * 1001],
)
def test_a_target_the_automaton_does_not_read_is_refused(
    tmp_path: Path, run_main: Any, target: str
) -> None:
    stored, _ = module("mxfp4", MLP)
    conf = config({"group_0": ([target], "mxfp4"), "group_1": (["re:.*attn.*"], "fp8")})
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    refused(run_main, directory, "config_groups['group_0'].targets")


def test_limits_at_the_edge_are_read(tmp_path: Path, run_main: Any) -> None:
    """{100} repeats and a 1000-character pattern are read (one past: refused above)."""
    stored, values = module("mxfp4", MLP)
    escaped = MLP.replace(".", "\\.") + "|"
    long_target = "re:" + escaped + "x" * (1000 - len(escaped))
    assert len(long_target) == 3 + 1000
    conf = config(
        {"group_0": (["re:.{0,100}mlp", long_target], "mxfp4"), "group_1": (["re:a{100}"], "fp8")}
    )
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    assert_norm(norms(run_main, directory)[MLP + ".weight"], values)


def test_a_catastrophic_pattern_runs_in_linear_time(tmp_path: Path, run_main: Any) -> None:
    """`(a+)+$` against a long run of a's then b: hours for a backtracking engine; the
    automaton reads each character once."""
    stem = "a" * 5000 + "b"
    stored, values = module("mxfp4", stem)
    conf = config({"group_0": (["re:(a+)+$"], "nvfp4"), "group_1": (["re:a+b"], "mxfp4")})
    directory = write_model_directory(tmp_path / "m", {"model.safetensors": stored}, conf)
    assert_norm(norms(run_main, directory)[stem + ".weight"], values)
