"""Cases found by an attacker of the numeric promises who did not write clipcli. Inputs
are written by hand and outputs read back with safetensors.safe_open's raw bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from expect import listing, one_error_line
from handmade import write_safetensors
from safetensors.numpy import load_file

from clipcli.cli.entry import main

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


@pytest.mark.parametrize("mode", [["--norm"], ["--global"], ["--average"]])
@pytest.mark.parametrize("limit", ["1e-40", "4.9e-324", "2.2e-308"])
def test_e8m0_below_its_smallest_value_is_refused_not_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str], limit: str
) -> None:
    """float8_e8m0fnu holds powers of two only, no zero: below 2**-127 no factor can
    reach the limit. It wrote NaN (0xFF) with exit 0, or exited 70 at 4.9e-324."""
    src = write_safetensors(tmp_path / "in.safetensors", {"e": np.array([1.0, 2.0]).astype(E8M0)})
    assert main(["clip", *mode, limit, str(src), str(tmp_path / "out.safetensors")]) == 4
    assert "without zero" in one_error_line(capsys.readouterr().err)
    assert listing(tmp_path) == ["in.safetensors"]


@pytest.mark.parametrize(("times", "code"), [(1.0, 4), (1.5, 0), (2.0, 0)])
def test_e8m0_at_and_above_its_floor(tmp_path: Path, times: float, code: int) -> None:
    """The least norm e8m0 values can have is sqrt(n) * 2**-127: a limit at it leaves the
    search no room and is refused; above it the output is finite and within the limit."""
    src = write_safetensors(
        tmp_path / "in.safetensors", {"e": np.array([1.0, 2.0, 4.0, 8.0]).astype(E8M0)}
    )
    limit = math.sqrt(4) * 2.0**-127 * times
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--norm", repr(limit), "-q", str(src), str(out)]) == code
    if code == 0:
        written = np.frombuffer(_raw(out, "e"), dtype=E8M0).astype(np.float64)
        assert np.all(np.isfinite(written))
        assert math.sqrt(float(np.sum(written**2))) <= limit


def _raw(path: Path, name: str) -> bytes:
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    begin, end = header[name]["data_offsets"]
    return path.read_bytes()[8 + header_len + begin : 8 + header_len + end]


def test_use_norm_inf_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.array([3.0, 4.0], np.float32)})
    argv = ["clip", "--global", "1", "--use-norm", "inf", str(src), str(tmp_path / "o.npz")]
    assert main(argv) == 2
    assert "--use-norm must be finite" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_scaling_keeps_the_sign_of_zero_parts(tmp_path: Path, dtype: type) -> None:
    values: np.ndarray = np.array(
        [3 - 0j, complex(-0.0, -0.0), complex(-0.0, 4), -3 - 0j], dtype=dtype
    )
    values.imag[0] = -0.0
    values.imag[3] = -0.0
    np.savez(tmp_path / "in.npz", z=values)
    out = tmp_path / "out.npz"
    assert main(["clip", "--norm", "3", "-q", str(tmp_path / "in.npz"), str(out)]) == 0
    with np.load(out) as archive:
        written = archive["z"]
    for before, after in zip(values, written, strict=True):
        assert math.copysign(1, after.real) == math.copysign(1, before.real)
        assert math.copysign(1, after.imag) == math.copysign(1, before.imag)


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.array([-np.inf, 2.0], np.float32), None),  # inf: JSON null
        (np.array([np.nan, 2.0], np.float32), 2.0),  # NaN is not a magnitude
        (np.array([3.0, -5.0], np.float32), 5.0),
    ],
)
def test_max_abs_counts_infinities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], array: np.ndarray, expected: float | None
) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"t": array})
    assert main(["norms", "--format", "json", str(path)]) == 0
    row = json.loads(capsys.readouterr().out)["tensors"][0]
    assert row["max_abs"] == expected
    assert load_file(str(path))["t"].shape == (2,)
