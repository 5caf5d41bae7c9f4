"""Exactly at the limit (issue 10): every `<` vs `<=` of clipping, in every format.

Each case is built so that the value sits exactly on the limit (a norm of exactly C, a
value exactly on a bound, -0.0 on a bound of 0, an all-zero tensor), and a companion case
a hair over it. The output is read back with the official libraries (safetensors' own
reader, numpy.load, h5py) and compared byte for byte; the JSON report's `changed` and
`note` fields are asserted too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The `cli` fixture (tests/conftest.py): a CliRunner call returning a Run.
Cli = Callable[..., Any]

F32_3_4 = np.array([3.0, 4.0], np.float32)  # norm exactly 5


def clip_report(cli: Cli, src: Path, out: Path, *args: str) -> dict[str, Any]:
    result = cli("clip", *args, str(src), str(out), "--format", "json")
    assert result.code == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def rows_by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["tensors"]}


@pytest.mark.parametrize(
    "args",
    [
        ["--norm", "5"],
        ["--average", "2.5"],
        ["--global", "5"],
        ["--global", "5", "--use-norm", "5"],
    ],
    ids=["norm", "average", "global", "use-norm"],
)
def test_norm_exactly_at_the_limit_is_left_alone(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    assert_bit_identical: Callable[..., None],
    cli: Cli,
    args: list[str],
) -> None:
    src = write_checkpoint(ckpt("in"), {"t": F32_3_4})
    report = clip_report(cli, src, ckpt("out"), *args)
    row = rows_by_name(report)["t"]
    assert (row["changed"], row["note"], row["scale"]) == (False, "within limit", None)
    assert report["changed"] == 0
    assert_bit_identical(read_checkpoint(ckpt("out"))["t"], F32_3_4, "t")


@pytest.mark.parametrize(
    "args",
    [
        ["--norm", "4.999999"],
        ["--average", "2.4999995"],  # the tensor's limit is 2 * 2.4999995
        ["--global", "4.999999"],
        ["--global", "4.999999", "--use-norm", "5"],
    ],
    ids=["norm", "average", "global", "use-norm"],
)
def test_norm_a_hair_under_the_limit_clips(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Cli,
    args: list[str],
) -> None:
    src = write_checkpoint(ckpt("in"), {"t": F32_3_4})
    report = clip_report(cli, src, ckpt("out"), *args)
    row = rows_by_name(report)["t"]
    assert row["changed"] is True
    assert row["note"] == ""
    out = read_checkpoint(ckpt("out"))["t"]
    assert out.dtype == np.float32
    assert 4.99 < float(np.linalg.norm(out.astype(np.float64))) <= 4.999999


def test_slice_exactly_at_the_limit_with_axes(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Cli,
) -> None:
    # Row norms 5 (exactly C: stays) and 10 (clipped to <= 5).
    x = np.array([[3.0, 4.0], [6.0, 8.0]], np.float32)
    src = write_checkpoint(ckpt("in"), {"t": x})
    report = clip_report(cli, src, ckpt("out"), "--norm", "5", "--axes", "1")
    row = rows_by_name(report)["t"]
    assert (row["changed"], row["note"]) == (True, "1 of 2 slices clipped")
    out = read_checkpoint(ckpt("out"))["t"]
    assert out[0].tobytes() == x[0].tobytes()
    assert 4.999 <= float(np.linalg.norm(out[1].astype(np.float64))) <= 5.0
    # the largest slice exactly at the limit: nothing changes
    report = clip_report(cli, src, ckpt("rows"), "--norm", "10", "--axes", "1")
    row = rows_by_name(report)["t"]
    assert (row["changed"], row["note"]) == (False, "0 of 2 slices clipped")
    assert read_checkpoint(ckpt("rows"))["t"].tobytes() == x.tobytes()


def test_values_exactly_on_the_bounds_are_within_range(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Cli,
) -> None:
    x = np.array([-2.0, 2.0, 1.0, -1.0, 0.0], np.float32)
    src = write_checkpoint(ckpt("in"), {"t": x})
    report = clip_report(cli, src, ckpt("out"), "--value", "2")
    row = rows_by_name(report)["t"]
    assert (row["changed"], row["note"]) == (False, "within range")
    assert read_checkpoint(ckpt("out"))["t"].tobytes() == x.tobytes()


def test_negative_zero_on_a_min_0_bound_keeps_its_bits(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Cli,
) -> None:
    alone = np.array([-0.0, 1.0, 2.0], np.float32)
    mixed = np.array([-0.0, -1.0, 2.0], np.float32)
    src = write_checkpoint(ckpt("in"), {"alone": alone, "mixed": mixed})
    report = clip_report(cli, src, ckpt("out"), "--min", "0")
    rows = rows_by_name(report)
    assert (rows["alone"]["changed"], rows["alone"]["note"]) == (False, "within range")
    assert rows["mixed"]["changed"] is True
    out = read_checkpoint(ckpt("out"))
    assert out["alone"].tobytes() == alone.tobytes()
    expected = np.array([-0.0, 0.0, 2.0], np.float32)  # -0.0 is within [0, inf): kept
    assert out["mixed"].tobytes() == expected.tobytes()


def test_all_zero_tensor_under_global_stays_bit_identical(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    cli: Cli,
) -> None:
    zeros = np.array([0.0, -0.0, 0.0], np.float32)
    weights = np.array([30.0, 40.0], np.float32)
    src = write_checkpoint(ckpt("in"), {"z": zeros, "w": weights})
    report = clip_report(cli, src, ckpt("out"), "--global", "5")
    rows = rows_by_name(report)
    assert (rows["z"]["changed"], rows["z"]["note"], rows["z"]["scale"]) == (
        False,
        "zero tensor",
        None,
    )
    assert rows["w"]["changed"] is True
    out = read_checkpoint(ckpt("out"))
    assert out["z"].tobytes() == zeros.tobytes()
    assert float(np.linalg.norm(out["w"].astype(np.float64))) <= 5.0
    # and with --use-norm (TF's factor applied as given)
    report = clip_report(cli, src, ckpt("used"), "--global", "5", "--use-norm", "50")
    assert rows_by_name(report)["z"]["changed"] is False
    assert read_checkpoint(ckpt("used"))["z"].tobytes() == zeros.tobytes()


def test_diff_fail_above_fails_on_a_nan_relative_change(
    ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path], cli: Cli
) -> None:
    a = {"t": np.array([math.nan, 1.0], np.float32), "u": np.array([1.0, 1.0], np.float32)}
    b = {"t": np.array([math.nan, 1.5], np.float32), "u": np.array([1.0, 1.0], np.float32)}
    pa, pb = write_checkpoint(ckpt("a"), a), write_checkpoint(ckpt("b"), b)
    result = cli("diff", str(pa), str(pb), "--fail-above", "1e9", "--format", "json")
    assert result.code == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["max_rel_change"] is None or math.isnan(float(report["max_rel_change"]))
