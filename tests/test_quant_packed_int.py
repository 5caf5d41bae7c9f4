"""compressed-tensors pack-quantized integers (1 to 8 bits, both packings, zero points,
g_idx, stacked experts): recognised from quantization_config or from names and shapes,
the real shape read from weight_shape and checked, decoded exactly by rows.

Fixtures are packed by tests/quant_int_reference.py from compressed-tensors' published
layout (Python integers, no clipcli code); every decoded value is compared with its
Fraction and every norm with the exact square root of a Fraction sum of squares."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
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
    per_word_stream,
)

from clipcli.errors import ExitCode, InputError
from clipcli.logical.quantized import packed_int

Pack = Callable[[Sequence[int], int], list[int]]


def config(
    bits: int,
    strategy: str = "group",
    group: int | None = 16,
    version: str | None = "0.17.0",
    **extra: Any,
) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": bits,
        "type": "int",
        "symmetric": False,
        "strategy": strategy,
    }
    if group is not None:
        weights["group_size"] = group
    made: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        **extra,
    }
    if version is not None:
        made["version"] = version
    return made


def layer(
    shape: tuple[int, ...],
    bits: int,
    groups: int,
    pack: Pack,
    *,
    zero: bool = True,
    g_idx: list[int] | None = None,
    group: int | None = None,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], list[Any]]:
    """One weight `m` of real `shape` ([out, in] or [experts, out, in]), its scales
    [..., out, groups] (groups 0: one scale), zero points when asked; and its exact values."""
    rng = random.Random(seed)
    *lead, out, columns = shape
    top = (1 << bits) - 1
    size = group or -(-columns // max(groups, 1))
    column_group = g_idx if g_idx is not None else [j // size for j in range(columns)]
    slices = []
    packed, zeros, scales, reference = [], [], [], []
    for _ in range(int(np.prod(lead)) if lead else 1):
        q = [[rng.randint(0, top) for _ in range(columns)] for _ in range(out)]
        z = [[rng.randint(0, top) for _ in range(max(groups, 1))] for _ in range(out)]
        if not zero:
            z = [[1 << (bits - 1)] * max(groups, 1) for _ in range(out)]
        s = np.array(
            [[rng.uniform(-2.0, 2.0) for _ in range(max(groups, 1))] for _ in range(out)],
            dtype=ml_dtypes.bfloat16 if bits % 2 else np.float16,  # both scale dtypes met
        )
        slices.append(q)
        packed.append(pack_rows(q, pack, bits))
        zeros.append(pack_columns(z, pack, bits))
        scales.append(s)
        fs = fractions_of(s)
        reference.append(
            [
                [(q[i][j] - z[i][column_group[j]]) * fs[i][column_group[j]] for j in range(columns)]
                for i in range(out)
            ]
        )
    arrays = {
        "m.weight_packed": np.stack(packed).reshape(*lead, out, -1),
        "m.weight_shape": np.array(shape, dtype=np.int64),
        "m.weight_scale": np.stack(scales).reshape(*lead, out, max(groups, 1)),
    }
    if groups == 0:
        arrays["m.weight_scale"] = arrays["m.weight_scale"].reshape(-1)[:1].copy()
        reference = [
            [
                [
                    (q[i][j] - z[0][0]) * fractions_of(arrays["m.weight_scale"])[0]
                    for j in range(columns)
                ]
                for i in range(out)
            ]
            for q in slices
        ]
    if zero:
        arrays["m.weight_zero_point"] = np.stack(zeros).reshape(*lead, -1, max(groups, 1))
    if g_idx is not None:
        arrays["m.weight_g_idx"] = np.array(g_idx, dtype=np.int32)
    return arrays, reference


def found(arrays: dict[str, np.ndarray], conf: dict[str, Any] | None) -> Any:
    (weight,) = packed_int.recognise(infos(arrays), conf, arrays.__getitem__)
    return weight


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("step", [1, 4, 100])
def test_group_asymmetric_exact(bits: int, step: int) -> None:
    """40 inputs in groups of 16: the last group and the last word are partial."""
    arrays, reference = layer((6, 40), bits, 3, dense_stream, group=16, seed=bits)
    weight = found(arrays, config(bits))
    assert weight.name == "m.weight"
    assert weight.shape == (6, 40)
    assert not weight.transposed
    assert weight.scheme == f"pack-quantized-int{bits}"
    assert packed_int.scaled_parts(weight) == ["m.weight_scale"]
    roles = {p.name: p.role for p in weight.parts}
    assert roles == {
        "m.weight_packed": "codes",
        "m.weight_scale": "scale",
        "m.weight_zero_point": "zero_point",
        "m.weight_shape": "shape",
    }
    assert_exact(decode_all(packed_int, weight, arrays, step), reference[0])


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
@pytest.mark.parametrize(
    ("version", "pack"),
    [
        ("0.17.0", dense_stream),
        ("0.16.2", per_word_stream),
        ("0.17.1.dev3+g1234", dense_stream),
        ("0.9.0", per_word_stream),
    ],
)
def test_odd_bits_both_packings(bits: int, version: str, pack: Pack) -> None:
    arrays, reference = layer((5, 70), bits, 5, pack, seed=bits)
    weight = found(arrays, config(bits, group=14, version=version))
    assert weight.params["dense"] is (pack is dense_stream)
    assert_exact(decode_all(packed_int, weight, arrays, 2), reference[0])


def test_a_version_that_disagrees_with_the_width_is_refused() -> None:
    """3 bits over 64 inputs: 6 words dense, 7 words at 10 per word."""
    arrays, _ = layer((2, 64), 3, 1, dense_stream)
    with pytest.raises(InputError, match=r"packed width 6 for 64 inputs fits no") as caught:
        found(arrays, config(3, "channel", None, version="0.16.0"))
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    found(arrays, config(3, "channel", None, version="0.17.0"))


def test_no_version_decides_by_width_where_only_one_fits() -> None:
    arrays, reference = layer((2, 64), 3, 1, per_word_stream, seed=9)
    weight = found(arrays, config(3, "channel", None, version=None))
    assert weight.params["dense"] is False
    assert_exact(decode_all(packed_int, weight, arrays, 1), reference[0])
    arrays, _ = layer((2, 70), 3, 1, dense_stream)  # 70 inputs: 7 words either way
    with pytest.raises(InputError, match=r"fits \[\(3, 'dense'\), \(3, 'per word'\)\]"):
        found(arrays, config(3, "channel", None, version=None))


def test_channel_symmetric_int4_without_config() -> None:
    arrays, reference = layer((3, 40), 4, 1, dense_stream, zero=False, seed=2)
    weight = found(arrays, None)  # 5 words for 40 inputs: 4 bits and nothing else
    assert weight.params["bits"] == 4
    assert_exact(decode_all(packed_int, weight, arrays, 2), reference[0])


def test_tensor_scale() -> None:
    arrays, reference = layer((3, 16), 4, 0, dense_stream, zero=False, seed=3)
    weight = found(arrays, config(4, "tensor", None))
    assert_exact(decode_all(packed_int, weight, arrays, 2), reference[0])


def test_bits_ambiguous_without_config_are_refused() -> None:
    # 8 bits and 7 bits at 4 per word (before 0.17) always take the same words
    arrays, _ = layer((3, 10), 8, 1, dense_stream, zero=False)
    with pytest.raises(InputError, match="give the model directory with its config.json"):
        found(arrays, None)
    assert found(arrays, config(8, "channel", None)).params["bits"] == 8


def test_act_order_g_idx() -> None:
    rng = random.Random(5)
    g_idx = [j % 3 for j in range(24)]
    rng.shuffle(g_idx)
    arrays, reference = layer((4, 24), 4, 3, dense_stream, g_idx=g_idx, seed=5)
    weight = found(arrays, config(4, group=8))
    assert_exact(decode_all(packed_int, weight, arrays, 3), reference[0])
    for bad in (3, -1):
        arrays["m.weight_g_idx"][7] = bad
        with pytest.raises(InputError, match=f"g_idx holds group {bad}, outside the 3 groups"):
            decode_all(packed_int, weight, arrays, 3)


def test_stacked_experts_rows_across_slices() -> None:
    arrays, reference = layer((3, 5, 24), 4, 2, dense_stream, seed=6)
    weight = found(arrays, config(4, group=12))
    assert weight.shape == (3, 5, 24)
    for step in (1, 3, 7, 15):
        assert_exact(decode_all(packed_int, weight, arrays, step), reference)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([6, -40], r"weight_shape \[6, -40\] is no real shape"),
        ([6, (1 << 40) + 1], "is no real shape"),
        ([6, 1 << 40], r"fits no"),  # at the limit: past the value check, refused by the width
        ([7, 40], r"do not hold a weight of shape \[7, 40\]"),
        ([6, 32], "fits no"),  # 32 inputs take 4 words at 4 bits, not 5
    ],
)
def test_weight_shape_is_checked_against_the_packed_codes(shape: list[int], message: str) -> None:
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    arrays["m.weight_shape"] = np.array(shape, dtype=np.int64)
    with pytest.raises(InputError, match=message):
        found(arrays, config(4))


def test_weight_shape_rank_and_dtype() -> None:
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    arrays["m.weight_shape"] = np.array([1, 1, 6, 40], dtype=np.int64)
    with pytest.raises(InputError, match="no real shape"):
        found(arrays, config(4))
    arrays["m.weight_shape"] = np.array([6.0, 40.0])
    with pytest.raises(InputError, match="weight_shape of dtype float64"):
        found(arrays, config(4))


def test_scale_and_zero_point_shapes_are_checked() -> None:
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    arrays["m.weight_scale"] = arrays["m.weight_scale"][:5]
    with pytest.raises(InputError, match=r"scale of shape \[5, 3\] does not fit m.weight"):
        found(arrays, config(4))
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    arrays["m.weight_zero_point"] = np.zeros((2, 3), dtype=np.int32)
    with pytest.raises(InputError, match=r"zero point of shape \[2, 3\] does not fit"):
        found(arrays, config(4))


def test_group_size_must_fit_and_config_is_checked() -> None:
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    with pytest.raises(InputError, match="3 groups of scales do not fit 40 inputs in groups of 20"):
        found(arrays, config(4, group=20))
    found(arrays, config(4, group=14))  # ceil(40 / 14) = 3: fits
    with pytest.raises(InputError, match="group size cannot be told"):
        found(arrays, None)
    for bad, message in (
        ({"num_bits": 9}, "num_bits 9"),
        ({"strategy": "block"}, "strategy 'block'"),
        ({"group_size": 0}, "group_size 0"),
    ):
        conf = config(4)
        conf["config_groups"]["group_0"]["weights"].update(bad)
        with pytest.raises(InputError, match=message):
            found(arrays, conf)


def test_config_without_a_pack_quantized_group_refuses_packed_codes() -> None:
    arrays, _ = layer((6, 40), 4, 3, dense_stream)
    conf = config(4, format="float-quantized")
    with pytest.raises(InputError, match="declares no pack-quantized int group"):
        found(arrays, conf)
    assert packed_int.recognise(infos(arrays), {"quant_method": "gptq"}, arrays.__getitem__) == []


def test_two_config_groups_are_told_apart_by_the_widths() -> None:
    arrays, reference = layer((2, 64), 8, 1, dense_stream, seed=11)
    conf = config(4, "channel", None)
    conf["config_groups"]["group_1"] = {
        "targets": ["re:.*down"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
    }
    weight = found(arrays, conf)
    assert weight.params["bits"] == 8
    assert_exact(decode_all(packed_int, weight, arrays, 1), reference[0])
