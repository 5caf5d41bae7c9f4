"""GPTQ (v1, v2; 2/3/4/8 bits; act-order g_idx) and AWQ GEMM: recognised from names and
shapes or from a quantization_config, decoded exactly by rows.

Fixtures are packed by tests/quant_int_reference.py from the published layouts (Python
integers, no clipcli code); every decoded value is compared with its Fraction and every
norm with the exact square root of a Fraction sum of squares."""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from quant_int_reference import (
    assert_exact,
    decode_all,
    dense_stream,
    fractions_of,
    infos,
    pack_columns,
    pack_rows,
)

from clipcli.errors import ExitCode, InputError
from clipcli.logical.quantized import awq, gptq, intcodes

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble k of a word holds output ORDER[k]


def gptq_arrays(
    inputs: int,
    out: int,
    bits: int,
    groups: int,
    *,
    seed: int = 0,
    act_order: bool = False,
    zero_values: list[int] | None = None,
) -> tuple[dict[str, np.ndarray], list[int], list[list[int]], list[list[int]]]:
    """A GPTQ layer `m`: codes, zeros, float16 scales and g_idx; also the g_idx, codes and
    zeros as Python ints."""
    rng = random.Random(seed)
    top = (1 << bits) - 1
    q = [[rng.randint(0, top) for _ in range(out)] for _ in range(inputs)]
    z = [[rng.randint(0, top) for _ in range(out)] for _ in range(groups)]
    if zero_values:
        for j, v in enumerate(zero_values):
            z[0][j] = v
    size = -(-inputs // groups)
    g_idx = [i // size for i in range(inputs)]
    if act_order:
        rng.shuffle(g_idx)
    scales = np.array(
        [[rng.choice([-1, 1]) * rng.uniform(1e-3, 2.0) for _ in range(out)] for _ in range(groups)],
        dtype=np.float16,
    )
    arrays = {
        "m.qweight": pack_columns(q, dense_stream, bits),
        "m.qzeros": pack_rows(z, dense_stream, bits),
        "m.scales": scales,
        "m.g_idx": np.array(g_idx, dtype=np.int32),
        "m.bias": np.zeros(out, dtype=np.float16),
    }
    return arrays, g_idx, q, z


def gptq_reference(
    arrays: dict[str, np.ndarray],
    g_idx: list[int],
    q: list[list[int]],
    z: list[list[int]],
    plus: int,
) -> list[list[Fraction]]:
    """W[i][j] = scale[g][j] * (q[i][j] - (z[g][j] + plus)), shaped [in, out]."""
    s = fractions_of(arrays["m.scales"])
    return [
        [s[g_idx[i]][j] * (q[i][j] - (z[g_idx[i]][j] + plus)) for j in range(len(q[0]))]
        for i in range(len(q))
    ]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_gptq_v1_single_file_exact(bits: int, step: int) -> None:
    arrays, g_idx, q, z = gptq_arrays(96, 40, bits, 3, seed=bits, act_order=True)
    (weight,) = gptq.recognise(infos(arrays), None)
    assert weight.name == "m.weight"
    assert weight.shape == (40, 96)
    assert weight.transposed
    assert weight.scheme == f"gptq-int{bits}"
    assert weight.codes == "m.qweight"
    assert {p.name for p in weight.parts} == {"m.qweight", "m.qzeros", "m.scales", "m.g_idx"}
    assert gptq.scaled_parts(weight) == ["m.scales"]
    decoded = decode_all(gptq, weight, arrays, step)
    assert_exact(decoded, gptq_reference(arrays, g_idx, q, z, plus=1))


def test_gptq_v1_zero_plus_one_is_not_masked() -> None:
    """A stored zero of 15 at 4 bits means 16 in v1 (AutoGPTQ adds 1 after unpacking)."""
    arrays, g_idx, q, z = gptq_arrays(32, 8, 4, 1, zero_values=[15] * 8)
    (weight,) = gptq.recognise(infos(arrays), None)
    decoded = decode_all(gptq, weight, arrays, 7)
    assert_exact(decoded, gptq_reference(arrays, g_idx, q, z, plus=1))


def test_gptq_v2_from_config_drops_the_plus_one() -> None:
    arrays, g_idx, q, z = gptq_arrays(64, 16, 4, 2, seed=3)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}
    (weight,) = gptq.recognise(infos(arrays), config)
    assert weight.scheme == "gptq-int4-v2"
    assert_exact(decode_all(gptq, weight, arrays, 9), gptq_reference(arrays, g_idx, q, z, plus=0))


def test_gptq_config_group_size_without_g_idx() -> None:
    arrays, g_idx, q, z = gptq_arrays(96, 8, 4, 3, seed=4)
    del arrays["m.g_idx"]
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (weight,) = gptq.recognise(infos(arrays), config)
    assert_exact(decode_all(gptq, weight, arrays, 11), gptq_reference(arrays, g_idx, q, z, plus=1))
    with pytest.raises(InputError, match="do not fit 96 inputs in groups of 31"):
        gptq.recognise(infos(arrays), {**config, "group_size": 31})


def test_gptq_one_group_without_g_idx_or_config() -> None:
    arrays, g_idx, q, z = gptq_arrays(64, 32, 4, 1, seed=5)
    del arrays["m.g_idx"]
    (weight,) = gptq.recognise(infos(arrays), None)
    assert_exact(decode_all(gptq, weight, arrays, 64), gptq_reference(arrays, g_idx, q, z, plus=1))


def test_gptq_groups_without_g_idx_or_config_are_refused() -> None:
    arrays, *_ = gptq_arrays(64, 32, 4, 2)
    del arrays["m.g_idx"]
    with pytest.raises(InputError, match="group size cannot be told") as caught:
        gptq.recognise(infos(arrays), None)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_gptq_g_idx_out_of_range_is_refused_before_indexing() -> None:
    arrays, *_ = gptq_arrays(32, 8, 4, 2)
    (weight,) = gptq.recognise(infos(arrays), None)
    for bad in (2, -1):  # groups is 2: group 1 is the last one stored
        arrays["m.g_idx"][5] = bad
        with pytest.raises(InputError, match=f"g_idx holds group {bad}, outside the 2 groups"):
            decode_all(gptq, weight, arrays, 32)
    arrays["m.g_idx"][5] = 1  # at the limit: decodes
    decode_all(gptq, weight, arrays, 32)


def test_gptq_bits_ambiguous_from_shapes_is_refused() -> None:
    """One output and no g_idx: a single qzeros word fits every bit width."""
    arrays, *_ = gptq_arrays(32, 1, 4, 1)
    del arrays["m.g_idx"]
    with pytest.raises(InputError, match="bit width cannot be told"):
        gptq.recognise(infos(arrays), None)
    (weight,) = gptq.recognise(infos(arrays), {"quant_method": "gptq", "bits": 4})
    assert weight.params["bits"] == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 5}, "GPTQ bits 5 is not one of"),
        ({"bits": True}, "GPTQ bits True"),
        ({"group_size": 0}, "group_size 0 is not a whole number"),
        ({"group_size": intcodes.MAX_GROUP + 1}, "is not a whole number from 1"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"bits": 8}, "qweight of shape .* does not fit m.weight"),
    ],
)
def test_gptq_config_is_checked(change: dict[str, Any], message: str) -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, **change}
    with pytest.raises(InputError, match=message):
        gptq.recognise(infos(arrays), config)


def test_gptq_group_size_at_the_limit() -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 1)
    del arrays["m.g_idx"]
    config = {"quant_method": "gptq", "bits": 4, "group_size": intcodes.MAX_GROUP}
    (weight,) = gptq.recognise(infos(arrays), config)
    assert weight.params["group"] == intcodes.MAX_GROUP


def test_gptq_shapes_that_do_not_fit_are_refused() -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    arrays["m.g_idx"] = np.zeros(72, dtype=np.int32)  # 72 inputs need 9 packed rows, not 8
    with pytest.raises(InputError, match=r"they fit none of \[2, 3, 4, 8\]"):
        gptq.recognise(infos(arrays), None)
    with pytest.raises(InputError, match=r"qweight of shape \[8, 16\] does not fit"):
        gptq.recognise(infos(arrays), {"quant_method": "gptq", "bits": 4, "group_size": 36})
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    arrays["m.qzeros"] = arrays["m.qzeros"][:1]
    with pytest.raises(InputError, match=r"qzeros of shape \[1, 2\] does not fit"):
        gptq.recognise(infos(arrays), None)
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    arrays["m.scales"] = arrays["m.scales"].astype(np.float64)
    with pytest.raises(InputError, match="GPTQ scale of dtype float64"):
        gptq.recognise(infos(arrays), None)


def test_gptq_config_needs_every_part() -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    del arrays["m.qzeros"]
    assert gptq.recognise(infos(arrays), None) == []
    with pytest.raises(InputError, match="without their m.qzeros"):
        gptq.recognise(infos(arrays), {"quant_method": "gptq", "bits": 4})


def test_another_method_in_the_config_is_not_gptq() -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    assert gptq.recognise(infos(arrays), {"quant_method": "awq"}) == []


# --- AWQ ---


def awq_pack(values: Sequence[int], bits: int) -> list[int]:
    """AutoAWQ GEMM: words of 8 outputs, nibble k holding output ORDER[k]."""
    assert bits == 4
    assert len(values) % 8 == 0
    return [
        sum(values[w * 8 + AWQ_ORDER[k]] << (4 * k) for k in range(8))
        for w in range(len(values) // 8)
    ]


def awq_arrays(
    inputs: int, out: int, group: int, seed: int = 0
) -> tuple[dict[str, np.ndarray], list[list[Fraction]]]:
    rng = random.Random(seed)
    groups = inputs // group
    q = [[rng.randint(0, 15) for _ in range(out)] for _ in range(inputs)]
    z = [[rng.randint(0, 15) for _ in range(out)] for _ in range(groups)]
    scales = np.array(
        [[rng.uniform(-3.0, 3.0) for _ in range(out)] for _ in range(groups)], dtype=np.float16
    )
    arrays = {
        "m.qweight": pack_rows(q, awq_pack, 4),
        "m.qzeros": pack_rows(z, awq_pack, 4),
        "m.scales": scales,
    }
    s = fractions_of(scales)
    reference = [
        [(q[i][j] - z[i // group][j]) * s[i // group][j] for j in range(out)] for i in range(inputs)
    ]
    return arrays, reference


@pytest.mark.parametrize("step", [1, 3, 16, 1000])
def test_awq_single_file_exact(step: int) -> None:
    arrays, reference = awq_arrays(64, 24, 16, seed=step)
    (weight,) = awq.recognise(infos(arrays), None)
    assert weight.name == "m.weight"
    assert weight.shape == (24, 64)
    assert weight.transposed
    assert weight.scheme == "awq-int4"
    assert weight.params["group"] == 16
    assert awq.scaled_parts(weight) == ["m.scales"]
    assert gptq.recognise(infos(arrays), None) == []  # the shapes tell the two apart
    assert_exact(decode_all(awq, weight, arrays, step), reference)


def test_gptq_is_not_awq() -> None:
    arrays, *_ = gptq_arrays(64, 16, 4, 2)
    assert awq.recognise(infos(arrays), None) == []


def test_awq_from_config() -> None:
    arrays, reference = awq_arrays(48, 16, 16, seed=7)
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 16,
        "version": "GEMM",
        "zero_point": True,
    }
    (weight,) = awq.recognise(infos(arrays), config)
    assert_exact(decode_all(awq, weight, arrays, 5), reference)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": "gemv"}, "AWQ version 'gemv' is not one clipcli decodes"),
        ({"bits": 8}, "AWQ bits 8"),
        ({"zero_point": False}, "without zero points"),
        ({"group_size": 32}, "do not fit 48 inputs in groups of 32"),
        ({"group_size": 0}, "group_size 0 is not a whole number"),
    ],
)
def test_awq_config_is_checked(change: dict[str, Any], message: str) -> None:
    arrays, _ = awq_arrays(48, 16, 16)
    config = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", **change}
    with pytest.raises(InputError, match=message):
        awq.recognise(infos(arrays), config)


def test_awq_groups_that_do_not_divide_the_inputs_are_refused() -> None:
    arrays, _ = awq_arrays(48, 16, 16)
    arrays["m.qweight"] = np.concatenate([arrays["m.qweight"], arrays["m.qweight"][:1]])
    with pytest.raises(InputError, match="3 AWQ groups do not divide 49 inputs"):
        awq.recognise(infos(arrays), None)
