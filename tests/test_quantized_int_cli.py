"""The integer quantization schemes (GPTQ, AWQ, compressed-tensors pack-quantized,
bitsandbytes) through the command line: `norms` of the real weights against the exact
references of tests/quant_int_reference.py (Python integers and Fractions, no clipcli
code), `diff` against a plain file holding the real [out, in] weight (C order, though
GPTQ and AWQ store its transpose), and clip through the scales: codes byte for byte,
the bound checked exactly on the written bytes."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_int_reference import dense_stream, exact_sqrt
from safetensors.numpy import save_file
from test_quant_bnb import four_bit
from test_quant_gptq_awq import awq_arrays, gptq_arrays, gptq_reference
from test_quant_packed_int import config as packed_config
from test_quant_packed_int import layer

from clipcli.logical.quantized import view as view_module


def flat(reference: Any) -> list[Fraction]:
    return [Fraction(v) for v in np.array(reference, dtype=object).reshape(-1)]


def sumsq(values: list[Fraction]) -> Fraction:
    return sum((v * v for v in values), Fraction(0))


def save(path: Path, arrays: dict[str, np.ndarray], config: dict[str, Any] | None) -> Path:
    """One safetensors file, or a model directory with config.json's quantization_config."""
    if config is None:
        save_file(arrays, str(path))
        return path
    path.mkdir()
    save_file(arrays, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": config}))
    return path


def gptq_case() -> tuple[dict[str, np.ndarray], list[list[Fraction]], dict[str, Any] | None]:
    arrays, g_idx, q, z = gptq_arrays(96, 40, 4, 3, seed=4, act_order=True)
    return arrays, gptq_transposed(gptq_reference(arrays, g_idx, q, z, plus=1)), None


def gptq_transposed(reference: list[list[Fraction]]) -> list[list[Fraction]]:
    return [list(row) for row in zip(*reference, strict=True)]


def awq_case() -> tuple[dict[str, np.ndarray], list[list[Fraction]], dict[str, Any] | None]:
    arrays, reference = awq_arrays(64, 24, 16, seed=2)
    return arrays, gptq_transposed(reference), None


def packed_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    arrays, reference = layer((6, 40), 4, 3, dense_stream, group=16, seed=3)
    return arrays, reference[0], packed_config(4, group=16)  # one 2-D slice


def nf4_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    arrays, reference = four_bit((5, 13), 16, seed=5)
    return arrays, np.array(reference, dtype=object).reshape(5, 13).tolist(), None


def int8_case() -> tuple[dict[str, np.ndarray], Any, dict[str, Any] | None]:
    rng = np.random.default_rng(6)
    q = rng.integers(-127, 128, (4, 6)).astype(np.int8)
    scb = rng.uniform(0.01, 9.0, 4).astype(np.float32)
    # W = q * SCB / 127, rounded once to float64 (bnb.py's one inexact value)
    reference = [
        [Fraction(float(q[i, j]) * float(scb[i]) / 127) for j in range(6)] for i in range(4)
    ]
    return {"m.weight": q, "m.SCB": scb}, reference, None


CASES = {
    "gptq-int4": gptq_case,
    "awq-int4": awq_case,
    "pack-quantized-int4": packed_case,
    "bnb-nf4": nf4_case,
    "bnb-int8": int8_case,
}


def norms_json(run_main: Any, path: Path, *options: str) -> dict[str, Any]:
    result = run_main("norms", path, "--format", "json", *options)
    assert result.code == 0, result.stderr
    assert not result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


@pytest.mark.parametrize("scheme", list(CASES))
def test_norms_of_the_real_weight(tmp_path: Path, run_main: Any, scheme: str) -> None:
    arrays, reference, config = CASES[scheme]()
    path = save(tmp_path / "m.safetensors" if config is None else tmp_path / "m", arrays, config)
    report = norms_json(run_main, path)
    rows = {row["name"]: row for row in report["tensors"]}
    row = rows["m.weight"]
    values = flat(reference)
    exact = exact_sqrt(sumsq(values))
    assert abs(row["norm"] - exact) <= math.ulp(exact), (row["norm"], exact)
    assert Fraction(row["max_abs"]) == max(abs(v) for v in values)
    assert row["shape"] == list(np.array(reference, dtype=object).shape)
    assert row["numel"] == len(values)
    assert row["quantization"]["scheme"] == scheme
    stored = row["quantization"]["stored"]
    assert stored[0] in arrays
    assert set(stored) <= set(arrays)
    for name in stored[1:]:  # scales, zero points, maps: listed apart, never in the norm
        assert not rows[name]["in_global"]
        assert rows[name]["role"] == "quantization"
    counted = {r["name"] for r in report["tensors"] if r["in_global"]}
    assert "m.weight" in counted
    assert not counted & set(stored[1:])


@pytest.mark.parametrize("scheme", list(CASES))
def test_diff_against_the_plain_weight_is_zero(tmp_path: Path, run_main: Any, scheme: str) -> None:
    """The plain file holds the real [out, in] weight: a diff of zero everywhere means
    the quantized weight's values come out in the same (C) order, transposed or not."""
    arrays, reference, config = CASES[scheme]()
    path = save(tmp_path / "q.safetensors" if config is None else tmp_path / "q", arrays, config)
    real = np.array([[float(v) for v in row] for row in reference], dtype=np.float64)
    pairs = zip(real.reshape(-1), flat(reference), strict=True)
    assert all(Fraction(float(x)) == v for x, v in pairs)
    plain = tmp_path / "plain.safetensors"
    save_file({"m.weight": real}, str(plain))
    result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
    assert result.code == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout)["tensors"] if r["name"] == "m.weight"]
    assert row["max_abs_diff"] == 0.0, row
    # and a diff that is not zero: one value moved by its own size
    real[0, 0] += 1.0
    save_file({"m.weight": real}, str(plain))
    result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
    (row,) = [r for r in json.loads(result.stdout)["tensors"] if r["name"] == "m.weight"]
    assert row["max_abs_diff"] == 1.0, row


def test_a_transposed_weight_larger_than_one_block_takes_several_passes(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPTQ's [in, out] codes put in C order of [out, in] a few real rows at a time
    (TRANSPOSE_ELEMENTS values held): the same order and values at 1, 2, 3 rows per pass."""
    arrays, reference, _ = gptq_case()
    path = save(tmp_path / "q.safetensors", arrays, None)
    real = np.array([[float(v) for v in row] for row in reference], dtype=np.float64)
    plain = tmp_path / "plain.safetensors"
    save_file({"m.weight": real}, str(plain))
    inputs = real.shape[1]
    for rows in (1, 2, 3, 40):
        monkeypatch.setattr(view_module, "TRANSPOSE_ELEMENTS", rows * inputs)
        result = run_main("diff", plain, path, "--format", "json", "-i", "m.weight")
        assert result.code == 0, result.stderr
        (row,) = json.loads(result.stdout)["tensors"]
        assert row["max_abs_diff"] == 0.0, (rows, row)


# ---------------------------------------------------------------- clip through the scales

# Each case's scale tensor and, for element (row, column) of the real [out, in] weight
# (bitsandbytes 4-bit: of the flattened weight), the index of the scale it is multiplied by.
SCALE_OF: dict[str, tuple[str, Any]] = {
    "gptq-int4": ("m.scales", lambda a, o, i: (int(a["m.g_idx"][i]), o)),
    "awq-int4": ("m.scales", lambda _, o, i: (i // 16, o)),
    "pack-quantized-int4": ("m.weight_scale", lambda _, o, i: (o, i // 16)),
    "bnb-nf4": ("m.weight.absmax", lambda _, o, i: ((o * 13 + i) // 16,)),
    "bnb-int8": ("m.SCB", lambda _, o, __: (o,)),
}


def clipped_values(
    scheme: str, before: dict[str, np.ndarray], after: dict[str, np.ndarray], reference: Any
) -> list[Fraction]:
    """The real values under the written scales, exactly: each value is its code's part
    times its scale, so the new value is the old one times new scale / old scale (LLM.int8
    rounds q * SCB / 127 once to float64, as its definition in bnb.py says)."""
    name, index = SCALE_OF[scheme]
    values = []
    for o, row in enumerate(reference):
        for i, value in enumerate(row):
            at = index(before, o, i)
            old, new = Fraction(float(before[name][at])), Fraction(float(after[name][at]))
            if scheme == "bnb-int8":
                q = int(before["m.weight"][o, i])
                values.append(Fraction(float(q) * float(after[name][at]) / 127))
            else:
                values.append(Fraction(0) if old == 0 else Fraction(value) * new / old)
    return values


@pytest.mark.parametrize("where", ["above", "at", "just-below", "far-below"])
@pytest.mark.parametrize("scheme", list(CASES))
def test_clip_through_the_scales(tmp_path: Path, run_main: Any, scheme: str, where: str) -> None:
    from safetensors.numpy import load_file

    arrays, reference, config = CASES[scheme]()
    src = save(tmp_path / "q.safetensors" if config is None else tmp_path / "q", arrays, config)
    exact = sumsq(flat(reference))
    norm_up = exact_sqrt(exact)
    while Fraction(norm_up) ** 2 < exact:  # the least float64 at or above the exact norm
        norm_up = math.nextafter(norm_up, math.inf)
    while Fraction(math.nextafter(norm_up, 0)) ** 2 >= exact:
        norm_up = math.nextafter(norm_up, 0)
    limit = {
        "above": norm_up * 2,
        "at": norm_up,
        "just-below": math.nextafter(math.nextafter(norm_up, 0), 0),
        "far-below": norm_up / 1000,
    }[where]
    out = tmp_path / ("o.safetensors" if config is None else "o")
    result = run_main("clip", "--global", repr(limit), src, out, "-q")
    assert result.code == 0, result.stderr
    written = load_file(str(out if config is None else out / "model.safetensors"))
    scale_name = SCALE_OF[scheme][0]
    for name in arrays:  # codes, zero points, maps, states (and GPTQ's zero bias): as they were
        if name != scale_name:
            assert written[name].tobytes() == arrays[name].tobytes(), name
    after = sumsq(clipped_values(scheme, arrays, written, reference))
    assert after <= Fraction(limit) ** 2  # the promise, exactly, on the written scales
    if where in ("above", "at"):
        assert written[scale_name].tobytes() == arrays[scale_name].tobytes()
    else:
        assert written[scale_name].tobytes() != arrays[scale_name].tobytes()
        assert after >= Fraction(limit) ** 2 / 4  # tight as the scale dtype allows, roughly


def test_nested_bitsandbytes_clip_is_refused_and_value_too(tmp_path: Path, run_main: Any) -> None:
    """Nested absmax: absmax = map[q] * nested_absmax + nested_offset, and the offset is a
    number in the JSON quant state: a clip scales it there (issue 21; the bound and the
    bytes: tests/test_quant_bnb_nested_clip.py). --value is still refused."""
    arrays, _ = four_bit((6, 10), 4, nested_block=3, seed=2)
    src = save(tmp_path / "q.safetensors", arrays, None)
    out = tmp_path / "o.safetensors"
    result = run_main("clip", "--global", "0.001", src, out, "-q")
    assert result.code == 0, result.stderr
    assert 0 < norms_json(run_main, out)["global_norm"] <= 0.001
    out.unlink()
    result = run_main("clip", "--value", "0.1", src, out)
    assert result.code == 4
    (line,) = result.stderr.splitlines()
    assert "not linear" in line
    assert not out.exists()
    assert run_main("norms", src, "-q").code == 0  # measured all the same


def test_nested_bitsandbytes_with_a_zero_offset_is_clipped(tmp_path: Path, run_main: Any) -> None:
    """With nested_offset 0, absmax is map[q] * nested_absmax: linear in nested_absmax."""
    arrays, _ = four_bit((6, 10), 4, nested_block=3, seed=2)
    name = "m.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(arrays[name].tobytes())
    state["nested_offset"] = 0.0
    arrays[name] = np.frombuffer(json.dumps(state).encode(), np.uint8)
    src = save(tmp_path / "q.safetensors", arrays, None)
    out = tmp_path / "o.safetensors"
    assert run_main("clip", "--global", "0.5", src, out, "-q").code == 0
    from safetensors.numpy import load_file

    written = load_file(str(out))
    for key in arrays:
        if key != "m.weight.nested_absmax":
            assert written[key].tobytes() == arrays[key].tobytes(), key
    assert written["m.weight.nested_absmax"].tobytes() != arrays["m.weight.nested_absmax"].tobytes()
    report = norms_json(run_main, out)
    assert 0 < report["global_norm"] <= 0.5


# ---------------------------------------------------------------- what ls shows


def test_ls_lists_the_real_weight_and_counts_scales_apart(tmp_path: Path, run_main: Any) -> None:
    arrays, _, _ = gptq_case()
    src = save(tmp_path / "q.safetensors", arrays, None)
    result = run_main("ls", src, "--format", "json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["tensors"]}
    assert sorted(rows) == ["m.bias", "m.g_idx", "m.qzeros", "m.scales", "m.weight"]
    weight = rows["m.weight"]
    assert weight["shape"] == [40, 96]  # the real [out, in] weight, not the packed words
    assert weight["numel"] == 40 * 96
    assert weight["dtype"] == "float16"  # its scales' dtype: what it dequantizes to
    assert weight["bytes"] == arrays["m.qweight"].nbytes  # its codes; the scales have rows
    assert weight["quantization"] == {
        "scheme": "gptq-int4",
        "stored": ["m.qweight", "m.scales", "m.qzeros", "m.g_idx"],
    }
    assert rows["m.scales"]["quantization"] == {"role": "scale", "of": "m.weight"}
    assert rows["m.bias"]["quantization"] is None
    assert report["total_parameters"] == 40 * 96 + 40  # the weight's and the bias's
    parts = ("m.scales", "m.qzeros", "m.g_idx")
    assert report["quantization_elements"] == sum(arrays[n].size for n in parts)
    assert report["total_bytes"] == sum(a.nbytes for a in arrays.values())
    table = run_main("ls", src)
    assert table.code == 0
    assert "gptq-int4" in table.stdout
    assert f"+{report['quantization_elements']:,} in quantization tensors" in table.stdout


@pytest.mark.parametrize(
    ("scheme", "dtype"),
    [("gptq-int4", "float16"), ("pack-quantized-int4", "float16"), ("bnb-nf4", "bfloat16")],
)
def test_the_row_dtype_is_what_the_weight_dequantizes_to(
    tmp_path: Path, run_main: Any, scheme: str, dtype: str
) -> None:
    """Not float64 (the exact values' own): the scales' dtype, or bitsandbytes' quant
    state's dtype; float32 where the scales are 32-bit (LLM.int8's SCB)."""
    arrays, _, config = CASES[scheme]()
    src = save(tmp_path / "q.safetensors" if config is None else tmp_path / "q", arrays, config)
    (row,) = [r for r in norms_json(run_main, src)["tensors"] if r["name"] == "m.weight"]
    assert row["dtype"] == dtype


def test_plain_rows_have_no_quantization_column(tmp_path: Path, run_main: Any) -> None:
    src = tmp_path / "p.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(src))
    (row,) = norms_json(run_main, src)["tensors"]
    assert "quantization" not in row
    (row,) = json.loads(run_main("ls", src, "--format", "json").stdout)["tensors"]
    assert "quantization" not in row


@pytest.mark.parametrize("room", [0, -1])
def test_recognising_reads_at_most_the_small_parts_budget(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """The real shape of a pack-quantized weight is read from its weight_shape tensor
    (16 bytes): within SMALL_PARTS_LIMIT it is read, one byte short it is refused (exit 3)."""
    arrays, _, config = packed_case()
    src = save(tmp_path / "q", arrays, config)
    monkeypatch.setattr(view_module, "SMALL_PARTS_LIMIT", arrays["m.weight_shape"].nbytes + room)
    result = run_main("ls", src)
    if room == 0:
        assert result.code == 0, result.stderr
        assert "[6,40]" in result.stdout
    else:
        assert result.code == 3
        (line,) = result.stderr.splitlines()
        assert "m.weight_shape" in line
        assert "small tensors" in line


@pytest.mark.parametrize("command", ["ls", "norms"])
def test_stored_shows_each_stored_tensor_as_it_is(
    tmp_path: Path, run_main: Any, command: str
) -> None:
    arrays, _, _ = gptq_case()
    src = save(tmp_path / "q.safetensors", arrays, None)
    result = run_main(command, src, "--stored", "--format", "json")
    assert result.code == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["tensors"]}
    assert sorted(rows) == sorted(arrays)
    assert rows["m.qweight"]["shape"] == list(arrays["m.qweight"].shape)
    assert rows["m.qweight"]["dtype"] == "int32"
    assert all("quantization" not in row for row in rows.values())


def test_diff_rows_show_the_dequantized_dtype(tmp_path: Path, run_main: Any) -> None:
    """Against the plain float16 weight it equals, a GPTQ weight (float16 scales) is
    `same`... in values; its row says float16 both sides, so `changed` is not `dtype
    changed` (the float64 it is compared in is no dtype of the file)."""
    arrays, reference, _ = gptq_case()
    src = save(tmp_path / "q.safetensors", arrays, None)
    real = np.array([[float(v) for v in row] for row in reference], dtype=np.float64)
    plain = tmp_path / "plain.safetensors"
    save_file({"m.weight": real.astype(np.float16)}, str(plain))
    result = run_main("diff", plain, src, "--format", "json", "-i", "m.weight")
    assert result.code == 0, result.stderr
    (row,) = json.loads(result.stdout)["tensors"]
    assert (row["dtype_a"], row["dtype_b"]) == ("float16", "float16")
    assert row["status"] in ("same", "changed")
