"""Clip of many tensors: the per-tensor work spared must change nothing (issue 20).

- the writer's header measured by its checks (header_length) and then built (build_header)
  from the text already formatted: the same bytes as json.dumps makes, whichever tensors
  were measured last, and nothing kept past the official reader's limit;
- ordered_bytes returns a native, C-contiguous array as it stands: the bytes numpy's own
  `astype(dtype).tobytes()` makes, for every layout the fast path must not take;
- the factor search's data pass asks the logical questions of a logical reader only;
- the clip report's rows read each norm once and the common notes without clip_note:
  every row's note and norms are clip_note's and the NormAccumulators' own;
- Role.kept_apart / training_state by identity agree with the roles' definition.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import ml_dtypes
import numpy as np
import pytest
from handmade import write_safetensors

from clipcli import api
from clipcli.formats.base import TensorInfo, ordered_bytes
from clipcli.formats.opening import open_reader
from clipcli.formats.safetensors import header as st_header
from clipcli.jobs import execution, roles
from clipcli.jobs.spec import ClipSpec, Mode
from clipcli.logical import views
from clipcli.report.builders import clip_note, clip_report

# ---------------------------------------------------------------- the header, built once


def _reference(infos: list[TensorInfo]) -> bytes:
    """The header as Python's json module writes it (no code shared with the formatting)."""
    header: dict[str, object] = {}
    offset = 0
    for info in infos:
        header[info.name] = {
            "dtype": st_header.CODES[info.dtype_name],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return text + b" " * (-len(text) % 8)


def _infos(count: int, prefix: str) -> list[TensorInfo]:
    f4 = np.dtype("<f4")
    return [TensorInfo(f"{prefix}é.{i}", f4, (1,), 4) for i in range(count)]


@pytest.mark.parametrize("count", [0, 1, 4095, 4096, 4097, 9000])
def test_a_header_measured_then_built_is_what_json_dumps_makes(count: int) -> None:
    infos = _infos(count, "a")
    length = st_header.header_length(infos, {})
    built = st_header.build_header(list(infos), {})
    assert built[8:] == _reference(infos)
    assert length == len(built) - 8


def test_a_header_built_for_other_tensors_than_measured_is_their_own() -> None:
    measured, other = _infos(5000, "a"), _infos(5000, "b")
    st_header.header_length(measured, {})
    assert st_header.build_header(other, {})[8:] == _reference(other)
    # The measured text is taken by the first build, whichever tensors it is for.
    st_header.header_length(measured, {})
    st_header.build_header(other, {})
    assert st_header._measured is None


def test_a_header_over_the_limit_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    infos = _infos(100, "a")
    exact = len(_reference(infos))
    monkeypatch.setattr(st_header, "MAX_HEADER_BYTES", exact)
    assert st_header.header_length(infos, {}) == exact  # at the limit: kept
    assert st_header._measured is not None
    assert st_header.build_header(infos, {})[8:] == _reference(infos)
    monkeypatch.setattr(st_header, "MAX_HEADER_BYTES", exact - 1)  # one byte past it
    st_header.header_length(infos, {})
    assert st_header._measured is None
    assert st_header.build_header(infos, {})[8:] == _reference(infos)


# ---------------------------------------------------------------- ordered_bytes


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype="<f4"),
        np.arange(6, dtype="<f4").reshape(2, 3),
        np.arange(12, dtype="<f4").reshape(3, 4)[:, ::2],  # not contiguous
        np.array(3.5, dtype="<f4"),  # 0-d
        np.arange(6, dtype=">f4"),  # another byte order
        np.arange(6, dtype="<f8"),  # another dtype: cast
        np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.arange(6, dtype="<c8"),
        np.arange(6, dtype=np.uint8),
    ],
    ids=["f4", "f4-2d", "strided", "0-d", "big-endian", "f8", "bf16", "c8", "u1"],
)
@pytest.mark.parametrize("order", ["<", ">"])
def test_ordered_bytes_are_numpys_bytes(array: np.ndarray, order: Literal["<", ">"]) -> None:
    dtype = (
        np.dtype("<f4") if array.dtype.kind == "f" and array.dtype.itemsize != 2 else array.dtype
    )
    expected_dtype = (
        dtype.newbyteorder(order) if dtype.itemsize > 1 and dtype.kind != "V" else dtype
    )
    if dtype.kind == "V":  # bfloat16: numpy has no '>' for it; swap the 2-byte units
        units = np.ascontiguousarray(array).view("<u2")
        expected = (units if order == "<" else units.byteswap()).tobytes()
    else:
        expected = np.ascontiguousarray(array.astype(expected_dtype)).tobytes()
    assert bytes(ordered_bytes(array, dtype, order)) == expected


@pytest.mark.parametrize("source", ["<f4", ">f4", "=f4", "<i2", ">i2", "<c8", ">c16", "i1", "u1"])
@pytest.mark.parametrize("target", ["<f4", ">f4", "=f4", "float32", "<i2", ">i2", "<c8", "i1"])
@pytest.mark.parametrize("order", ["<", ">"])
def test_ordered_bytes_in_every_byte_order_pair(
    source: str, target: str, order: Literal["<", ">"]
) -> None:
    """Whatever byte order the array and the target dtype spell (safetensors' dtypes say
    '<', numpy's own '=', a big-endian source '>'), the bytes are the target's values in
    `order`, as numpy casts and lays them out."""
    step = 1 if np.dtype(source).kind in "iu" else 1.5
    array = (np.arange(0, 6) * step).astype(source)
    dtype = np.dtype(target)
    if array.dtype.kind == "c" and dtype.kind != "c":
        return  # a complex array is never written as real values
    expected_dtype = dtype.newbyteorder(order) if dtype.itemsize > 1 else dtype
    expected = np.ascontiguousarray(array.astype(expected_dtype)).tobytes()
    assert bytes(ordered_bytes(array, dtype, order)) == expected


# ---------------------------------------------------------------- the output check


def test_only_a_logical_readers_check_asks_the_logical_questions(tmp_path: Path) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {"w": np.ones(4, np.float32)})
    with open_reader(src) as reader:
        check = execution.output_check(reader)
        assert not hasattr(check, "power_of_two")
        assert not hasattr(check, "rounded_elsewhere")
        total = check(list(reader.infos), 0.5, 0)
        assert total.at_most(math.nextafter(1.0, 2.0))  # sqrt(4 * 0.25) = 1
        logical = views.logical(reader)
        logical_check = execution.output_check(logical)
        if logical is not reader:
            assert hasattr(logical_check, "power_of_two")


# ---------------------------------------------------------------- the clip report


def test_clip_rows_are_clip_notes_and_each_tensors_norms(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "layers.0.w": np.array([3.0, 4.0], np.float32),
        "layers.1.w": np.zeros(3, np.float32),  # zero tensor
        "layers.2.steps": np.array([7], np.int32),  # not floating point
        "layers.3.bn.running_mean": np.array([9.0], np.float32),  # left out
        "layers.4.w": np.array([0.5], np.float16),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    for spec in (ClipSpec(Mode.GLOBAL, limit=1.0), ClipSpec(Mode.NORM, limit=100.0)):
        out = tmp_path / f"out-{spec.mode.value}.safetensors"
        result = api.clip(src, out, spec)
        report = clip_report(result)
        by_name = {row[0]: row for row in report.rows}
        assert set(by_name) == set(tensors)
        for plan, outcome in zip(result.plan.tensors, result.outcomes, strict=True):
            row = by_name[plan.info.name]
            assert row[2] == plan.before.norm  # no NaN here
            assert row[3] == outcome.after.norm
            assert row[6] == clip_note(api.ClipRow(plan, outcome))
        before, after, global_before, global_after = result.norms()
        assert global_before == result.global_before
        assert global_after == result.global_after
        assert len(before) == len(after) == len(tensors)


# ---------------------------------------------------------------- roles


@pytest.mark.parametrize("role", list(roles.Role))
def test_kept_apart_is_training_state_or_quantization(role: roles.Role) -> None:
    assert role.training_state is (role in {roles.Role.OPTIMIZER, roles.Role.BUFFER})
    assert role.kept_apart is (
        role in {roles.Role.OPTIMIZER, roles.Role.BUFFER, roles.Role.QUANTIZATION}
    )
