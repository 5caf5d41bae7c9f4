"""Clipping checked against a reference that shares no code with clipcli (issue 10).

The reference here is built only from numpy, ml_dtypes and Python's exact arithmetic:
- exact norms: sums of squares of the values as fractions.Fraction (complex: re and im);
- exhaustive rounding tables for every 8- and 16-bit float: all 256 or 65,536 bit patterns
  cast by ml_dtypes/numpy to float64, sorted; a float64 product x*s is carried exactly as
  a double-double (Dekker) and rounded to the nearest table entry, ties to the even bit
  pattern;
- an independent clamp: only elements strictly below/above the bound are replaced;
- an independent bisection for the best uniform factor.

clipcli runs through its CLI (typer's runner, in process) on files written here by hand
(safetensors) or with numpy/h5py, and the output is read back the same way. For every
case it asserts: output norm <= C (exactly, as fractions; C*(1+u) is what the issue
requires); output norm >= the best uniform factor's output norm minus one rounding of the
output dtype; under-limit tensors and slices bit-identical; clip(clip(x)) == clip(x) byte
for byte; every output element is round(x * s) for the reported scale s (rounded once);
value mode bit-exact against the independent clamp, NaN bits kept.

dtypes that no checkpoint format stores (float8_e4m3, float8_e3m4, float8_e4m3b11fnuz)
are checked through clipcli.numerics.slices.axes_scales with all axes (the same scale search).
WORST records output/C per dtype and mode; run the module with -s to print it. The larger
sweep is marked slow and runs with CLIPCLI_SLOW=1.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from expect import listing, one_error_line
from handmade import read_safetensors, write_safetensors

from clipcli.cli.entry import main

WORST: dict[tuple[str, str], float] = {}

STORABLE = {  # safetensors codes (its spec); files written and read by hand (handmade.py)
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
LIBRARY_ONLY = ["float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz"]


def dtype_of(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)


# ------------------------------------------------------------------ files, by hand


def write_any(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    if path.suffix == ".safetensors":
        return write_safetensors(path, tensors)
    if path.suffix == ".npz":
        np.savez(path, **tensors)  # type: ignore[arg-type]  # numpy's stub: allow_pickle
        return path
    import h5py

    with h5py.File(path, "w") as handle:
        for name, array in tensors.items():
            handle.create_dataset(name, data=array)
    return path


def read_any(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        out = read_safetensors(path)
        if all(
            a.dtype.name in ("float16", "float32", "float64", "complex64") for a in out.values()
        ):
            with safe_open(str(path), framework="np") as handle:  # the official reader agrees
                for name in out:
                    assert np.asarray(handle.get_tensor(name)).tobytes() == out[name].tobytes()
        return out
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {name: loaded[name] for name in loaded.files}
    import h5py

    with h5py.File(path, "r") as handle:
        return {name: np.asarray(handle[name][()]) for name in handle}


# ------------------------------------------------------------------ exact reference


def real_parts(array: np.ndarray) -> np.ndarray:
    """float64 values (re and im for complex); exact for every float dtype here."""
    if array.dtype.kind == "c":
        array = array.astype(np.complex128).reshape(-1).view(np.float64)
    with np.errstate(invalid="ignore"):
        return (
            np.asarray(array)
            .astype(np.float32 if array.dtype.itemsize <= 2 else array.dtype)
            .astype(np.float64)
            .ravel()
        )


def exact_sumsq(array: np.ndarray) -> Fraction:
    total = Fraction(0)
    for value in real_parts(array).tolist():
        if value:
            total += Fraction(value) ** 2
    return total


def exact_norm(array: np.ndarray) -> float:
    total = exact_sumsq(array)
    if total == 0:
        return 0.0
    half = (total.numerator.bit_length() - total.denominator.bit_length()) // 2
    return math.ldexp(math.sqrt(total / Fraction(4) ** half), half)


class Table:
    """Every finite value of an 8- or 16-bit float, sorted, with its bit pattern."""

    def __init__(self, dtype: np.dtype) -> None:
        bits = np.arange(256**dtype.itemsize, dtype=np.uint32).astype(f"u{dtype.itemsize}")
        with np.errstate(invalid="ignore"):
            values = bits.view(dtype).astype(np.float32).astype(np.float64)
        keep = np.isfinite(values)
        values, bits = values[keep], bits[keep]
        # -0.0 and +0.0 are one value: keep +0.0 (bit pattern 0) where both exist.
        order = np.lexsort((bits, values))
        values, bits = values[order], bits[order]
        unique = np.concatenate([[True], values[1:] != values[:-1]])
        self.values, self.bits, self.dtype = values[unique], bits[unique], dtype

    def round(self, high: np.ndarray, low: np.ndarray) -> np.ndarray:
        """Nearest table values to high + low (exact double-double), ties to even bits.
        Returns bit patterns; the sign of zero follows the product's sign."""
        v = self.values
        idx = np.clip(np.searchsorted(v, high), 1, v.size - 1)
        below, above = v[idx - 1], v[idx]
        # Compared exactly with the midpoint (high - mid is exact: both are multiples of
        # high's last place, and |low| is below it): distances summed in float64 rounded
        # a product a hair above a midpoint (--use-norm's 53-bit factors) onto the tie.
        mid = (below + above) / 2
        offset = high - mid
        tie = (offset == 0) & (low == 0)
        pick_above = (offset > 0) | ((offset == 0) & (low > 0))
        pick_above |= tie & (self.bits[idx] % 2 == 0)
        pick_above &= high > below  # never past the last value below (saturation aside)
        chosen = np.where(pick_above, idx, idx - 1)
        result = self.bits[chosen].copy()
        negative_zero = (v[chosen] == 0) & (np.signbit(high))
        if negative_zero.any():
            with np.errstate(invalid="ignore"):
                nz = np.asarray(-0.0).astype(self.dtype).view(f"u{self.dtype.itemsize}")
            result[negative_zero] = nz
        picked: np.ndarray = result
        return picked


TABLES: dict[str, Table] = {}


def table(dtype: np.dtype) -> Table:
    if dtype.name not in TABLES:
        TABLES[dtype.name] = Table(dtype)
    return TABLES[dtype.name]


def two_product(x: np.ndarray, s: float) -> tuple[np.ndarray, np.ndarray]:
    """x*s as an exact sum high + low (Dekker, both factors split)."""
    high = x * s

    def split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = a * 134217729.0
        h = c - (c - a)
        return h, a - h

    xh, xl = split(x)
    sh, sl = split(np.asarray(s, np.float64))
    low = ((xh * sh - high) + xh * sl + xl * sh) + xl * sl
    return high, low


def ref_scaled(array: np.ndarray, s: float) -> np.ndarray:
    """round(x * s) once, to the array's dtype, for every element (bits as the dtype)."""
    dtype = array.dtype
    x = real_parts(array)
    if dtype.itemsize <= 2:
        bits = table(dtype).round(*two_product(x, s))
        return bits.view(dtype).reshape(array.shape)
    if dtype in (np.float64, np.complex128):
        return (x * s).view(dtype).reshape(array.shape)  # one float64 rounding
    # float32 / complex64: nearest float32 to the exact product, checked on the neighbours
    high, low = two_product(x, s)
    first = high.astype(np.float32)
    up = np.nextafter(first, np.float32(np.inf))
    down = np.nextafter(first, np.float32(-np.inf))
    best = first.copy()
    for other in (up, down):
        d_best = np.abs((best.astype(np.float64) - high) - low)
        d_other = np.abs((other.astype(np.float64) - high) - low)
        tie_even = (d_other == d_best) & (other.view(np.uint32) % 2 == 0)
        best = np.where((d_other < d_best) | tie_even, other, best)
    return best.view(np.complex64 if dtype.kind == "c" else np.float32).reshape(array.shape)


def best_uniform_norm(array: np.ndarray, limit: float) -> float:
    """The largest output norm <= limit over uniform factors, by bisection on the factor
    (the rounded norm grows with it), from the reference rounding only."""
    lo, hi = 0.0, 1.0
    for _ in range(70):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if exact_sumsq(ref_scaled(array, mid)) <= Fraction(limit) ** 2:
            lo = mid
        else:
            hi = mid
    return exact_norm(ref_scaled(array, lo))


def unit(dtype: np.dtype) -> float:
    real = (
        np.dtype(np.float32 if dtype == np.complex64 else np.float64)
        if dtype.kind == "c"
        else dtype
    )
    return float(ml_dtypes.finfo(real).eps) / 2  # type: ignore[no-untyped-call]


def tiny(dtype: np.dtype) -> float:
    real = (
        np.dtype(np.float32 if dtype == np.complex64 else np.float64)
        if dtype.kind == "c"
        else dtype
    )
    return float(ml_dtypes.finfo(real).smallest_subnormal)  # type: ignore[no-untyped-call]


# ------------------------------------------------------------------ data


def sample(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype.name == "float8_e8m0fnu":  # powers of two only, all positive
        return (2.0 ** rng.integers(-6, 6, n)).astype(np.float32).astype(dtype).reshape(shape)
    values = rng.standard_normal(n) * (10.0 ** rng.uniform(-1, 1))
    if seed % 3 == 0:  # spread magnitudes, subnormals of the dtype included
        values *= 2.0 ** rng.integers(-12, 4, n)
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(n)
    largest = float(ml_dtypes.finfo(dtype).max)  # type: ignore[no-untyped-call]
    top = largest / 2 if dtype.itemsize <= 2 else math.inf
    values = np.clip(values.real, -top, top) + (1j * values.imag if dtype.kind == "c" else 0)
    with np.errstate(over="ignore"):
        if dtype.itemsize <= 2:
            out = values.astype(np.float32).astype(dtype)
        else:
            out = values.astype(dtype)
    shaped: np.ndarray = out.reshape(shape)
    return shaped


SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (0,), (64,)]


def run_clip(cli: Callable[..., Any], src: Path, out: Path, *args: str) -> dict[str, Any]:
    result = cli("clip", *args, str(src), str(out), "--format", "json", "--force")
    assert result.code == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def record(dtype: np.dtype, mode: str, ratio: float) -> None:
    key = (dtype.name, mode)
    WORST[key] = min(WORST.get(key, math.inf), ratio)


def check_norm_clip(
    cli: Callable[..., Any],
    tmp_path: Path,
    x: np.ndarray,
    limit: float,
    mode_args: list[str],
    mode: str,
    scale_limit: float | None = None,
    within: Fraction | None = None,
) -> None:
    """One tensor through a norm mode: every acceptance property of issue 10."""
    limit_for_tensor = scale_limit if scale_limit is not None else limit
    src = write_safetensors(tmp_path / "in.safetensors", {"t": x})
    out_path = tmp_path / "out.safetensors"
    report = run_clip(cli, src, out_path, *mode_args)
    out = read_safetensors(out_path)["t"]
    row = report["tensors"][0]
    assert out.dtype == x.dtype
    assert out.shape == x.shape
    before = exact_sumsq(x)
    # --average: within is decided against the exact C * n; the rounded-down float is the
    # target a clipped tensor is scaled to.
    if before <= (within if within is not None else Fraction(limit_for_tensor)) ** 2:
        assert out.tobytes() == x.tobytes(), "an under-limit tensor changed"
        assert row["changed"] is False
        return
    assert row["changed"] is True
    after = exact_sumsq(out)
    # <= C exactly (the issue asks for C*(1+u); clipcli keeps the exact bound)
    assert after <= Fraction(limit_for_tensor) ** 2, (
        x.dtype,
        float(after) ** 0.5 / limit_for_tensor,
    )
    # rounded once: every element is the reference rounding of x * s for the reported s
    assert row["scale"] is not None
    expected = ref_scaled(x, float(row["scale"]))
    assert out.tobytes() == expected.tobytes(), "not round(x * s) element by element"
    # tight: no worse than the best uniform factor by more than one rounding
    best = best_uniform_norm(x, limit_for_tensor)
    got = exact_norm(out)
    slack = best * ROUNDINGS[x.dtype.name] * unit(x.dtype) + tiny(x.dtype)
    assert got >= best - slack, (x.dtype, got / limit_for_tensor, best / limit_for_tensor)
    record(x.dtype, mode, got / limit_for_tensor)
    # idempotent
    again = tmp_path / "again.safetensors"
    run_clip(cli, out_path, again, *mode_args)
    assert again.read_bytes() == out_path.read_bytes()


NORM_DTYPES = list(STORABLE)
# How many roundings of the output dtype the result may fall short of the best uniform
# factor's: 8/16-bit and float32 reach it to one rounding (2u of the norm covers the
# rounding of one factor); float64 starts at TF's factor, checks it with a certain sum,
# and shrinks once by the measured overshoot, which costs a few float64 ulps.
ROUNDINGS = dict.fromkeys(STORABLE, 2) | {"float64": 8, "complex128": 8}


# The default run keeps one dtype of each kind; the rest run with `-m slow` (CI).
QUICK_NORM_DTYPES = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn")


def _exact_product_down(average: float, n: int) -> float:
    """C * n as the README defines the average limit: the exact product, rounded down to a
    float (the float product may round up past it)."""
    exact = Fraction(average) * n
    value = float(exact)
    return math.nextafter(value, 0.0) if Fraction(value) > exact else value


@pytest.mark.parametrize(
    "name",
    [n if n in QUICK_NORM_DTYPES else pytest.param(n, marks=pytest.mark.slow) for n in NORM_DTYPES],
)
@pytest.mark.parametrize("mode", ["norm", "average", "global"])
def test_norm_modes_against_reference(
    cli: Callable[..., Any], tmp_path: Path, name: str, mode: str
) -> None:
    dtype = dtype_of(name)
    for seed, shape in enumerate(SHAPES):
        x = sample(dtype, shape, seed)
        norm = exact_norm(x)
        for factor in (0.3, 0.97, 1.0, 1.3):
            if norm == 0 or not math.isfinite(norm):
                limit = 1.0
            else:
                limit = float(np.float64(norm * factor))
            if mode == "norm":
                check_norm_clip(cli, tmp_path, x, limit, ["--norm", repr(limit)], mode)
            elif mode == "average":
                n = max(x.size, 1)
                average = limit / n
                check_norm_clip(
                    cli,
                    tmp_path,
                    x,
                    limit,
                    ["--average", repr(average)],
                    mode,
                    _exact_product_down(average, n) if x.size else average,
                    Fraction(average) * n if x.size else None,
                )
            else:
                check_norm_clip(cli, tmp_path, x, limit, ["--global", repr(limit)], mode)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("CLIPCLI_SLOW"), reason="slow: set CLIPCLI_SLOW=1")
@pytest.mark.parametrize("name", NORM_DTYPES)
def test_norm_modes_larger_sweep(cli: Callable[..., Any], tmp_path: Path, name: str) -> None:
    """More seeds, bigger tensors and limits at many distances from the norm (slow)."""
    dtype = dtype_of(name)
    for seed in range(100, 130):
        shape = [(), (3,), (31,), (17, 13), (4, 5, 6), (2, 3, 4, 5), (0, 3), (500,)][seed % 8]
        x = sample(dtype, shape, seed)
        norm = exact_norm(x)
        for factor in (1e-3, 0.5, 0.9, 0.999, 1.0, 1.0001):
            limit = float(norm * factor) if norm and math.isfinite(norm) else 1.0
            mode = ["norm", "global"][seed % 2]
            check_norm_clip(cli, tmp_path, x, limit, [f"--{mode}", repr(limit)], mode)


# ------------------------------------------------------------------ --axes, per slice


def slices_of(array: np.ndarray, axes: tuple[int, ...]) -> list[np.ndarray]:
    rest = [i for i in range(array.ndim) if i not in axes]
    moved = np.moveaxis(array, rest, list(range(len(rest))))
    return list(moved.reshape(math.prod(array.shape[i] for i in rest), -1))


AXES_CASES = [
    ((6, 5), (1,)),
    ((6, 5), (0,)),
    ((3, 4, 5), (0, 2)),
    ((2, 3, 2, 4), (-1,)),
    ((4, 1), (0,)),
]


@pytest.mark.parametrize("name", [*STORABLE, "complex128"])
def test_axes_against_reference(cli: Callable[..., Any], tmp_path: Path, name: str) -> None:
    """Each slice over C gets the best uniform factor of its own (to one rounding), each
    slice within C stays bit-identical, and clipping again changes nothing."""
    dtype = dtype_of(name)
    suffix = ".npz" if name == "complex128" else ".safetensors"
    for seed, (shape, axes) in enumerate(AXES_CASES):
        x = sample(dtype, shape, 40 + seed)
        norms = sorted(exact_norm(s) for s in slices_of(x, tuple(a % x.ndim for a in axes)))
        limit = norms[len(norms) // 2]  # the median slice: exactly at the limit, stays
        src = write_any(tmp_path / f"in{suffix}", {"t": x})
        out_path = tmp_path / f"out{suffix}"
        report = run_clip(
            cli, src, out_path, "--norm", repr(limit), "--axes", ",".join(map(str, axes))
        )
        out = read_any(out_path)["t"]
        resolved = tuple(a % x.ndim for a in axes)
        for before, after in zip(slices_of(x, resolved), slices_of(out, resolved), strict=True):
            if exact_sumsq(before) <= Fraction(limit) ** 2:
                assert after.tobytes() == before.tobytes(), "an under-limit slice changed"
                continue
            assert exact_sumsq(after) <= Fraction(limit) ** 2
            best = best_uniform_norm(before, limit)
            got = exact_norm(after)
            assert got >= best - best * ROUNDINGS.get(name, 2) * unit(dtype) - tiny(dtype)
            record(dtype, "axes", got / limit)
        assert report["tensors"][0]["changed"] is (out.tobytes() != x.tobytes())
        again = tmp_path / f"again{suffix}"
        run_clip(cli, out_path, again, "--norm", repr(limit), "--axes", ",".join(map(str, axes)))
        assert read_any(again)["t"].tobytes() == out.tobytes()


@pytest.mark.parametrize("name", LIBRARY_ONLY)
def test_unstorable_fp8_through_the_library(name: str) -> None:
    """fp8 variants no format stores: the same scale search through axes_scales (all axes),
    then scale_slices; checked as above against the reference."""
    from clipcli.numerics import slices

    dtype = dtype_of(name)
    for seed, shape in enumerate([(7,), (3, 5), (2, 3, 4), (64,)]):
        x = sample(dtype, shape, 60 + seed)
        axes = tuple(range(x.ndim))
        norm = exact_norm(x)
        for factor in (0.3, 0.97, 1.0):
            limit = float(norm * factor)
            _, scales = slices.axes_scales(x, axes, limit)
            out = slices.scale_slices(x, scales, axes) if np.any(scales != 1) else x
            if exact_sumsq(x) <= Fraction(limit) ** 2:
                assert out.tobytes() == x.tobytes()
                continue
            assert exact_sumsq(out) <= Fraction(limit) ** 2
            assert out.tobytes() == ref_scaled(x, float(scales.reshape(-1)[0])).tobytes()
            best = best_uniform_norm(x, limit)
            got = exact_norm(out)
            assert got >= best - best * 2 * unit(dtype) - tiny(dtype)
            record(dtype, "library", got / limit)


# ------------------------------------------------------------------ value mode


def has_infinity(dtype: np.dtype) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.asarray(np.inf).astype(dtype).astype(np.float64)))


def ref_bound(dtype: np.dtype, value: float, toward: int) -> float | None:
    """The dtype value nearest `value` on the allowed side (>= for the low bound, toward=1),
    None if none is finite; a missing bound is the dtype's infinity or its finite extreme."""
    if dtype.itemsize <= 2:
        finite = table(dtype).values
        if math.isinf(value) and (value > 0) != (toward > 0):
            return value if has_infinity(dtype) else float(finite[0] if toward > 0 else finite[-1])
        pick = finite[finite >= value] if toward > 0 else finite[finite <= value]
        if pick.size == 0:
            return None
        found = float(pick[0] if toward > 0 else pick[-1])
        return math.copysign(0.0, value) if found == 0 else found  # a zero bound as given
    if math.isinf(value) and (value > 0) != (toward > 0):
        return value
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    if (toward > 0 and value > float(info.max)) or (toward < 0 and value < float(info.min)):
        return None
    with np.errstate(over="ignore"):
        near = np.asarray(value).astype(dtype)
    while (float(near) - value) * toward < 0 or math.isinf(float(near)):
        near = np.nextafter(near, np.asarray(toward * np.inf, dtype))
    return float(near)


def ref_clamp(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        wide = (
            x.astype(np.float32).astype(np.float64)
            if x.dtype.itemsize <= 2
            else x.astype(np.float64)
        )
    out = x.copy()
    out[wide < lo] = np.asarray(lo).astype(x.dtype)
    out[wide > hi] = np.asarray(hi).astype(x.dtype)
    return out


def value_data(dtype: np.dtype, seed: int) -> np.ndarray:
    if dtype.itemsize <= 2:  # every bit pattern: NaN payloads, -0.0, infinities, subnormals
        return (
            np.arange(256**dtype.itemsize, dtype=np.uint32).astype(f"u{dtype.itemsize}").view(dtype)
        )
    rng = np.random.default_rng(seed)
    bits = rng.integers(
        0, 2 ** (8 * dtype.itemsize), 4000, dtype=np.uint64 if dtype.itemsize == 8 else np.uint32
    )
    x = bits.astype(f"u{dtype.itemsize}").view(dtype)
    special = np.array([0.0, -0.0, 1.5, -1.5, 9.0, -9.0, 0.5, np.inf, -np.inf, np.nan], dtype)
    return np.concatenate([x, special, (rng.standard_normal(200) * 5).astype(dtype)])


VALUE_BOUNDS = [
    (None, 9.0),
    (-9.0, None),
    (-0.5, 0.5),
    (0.0, None),
    (None, -0.0),
    (0.75, 1.5),
    (1e-30, 1e30),
    (-1.5, 1.5),
]


@pytest.mark.parametrize("name", [*STORABLE])
def test_value_mode_against_independent_clamp(
    cli: Callable[..., Any], tmp_path: Path, name: str
) -> None:
    dtype = dtype_of(name)
    if dtype.kind == "c":
        pytest.skip("complex has no order: value mode leaves it")
    x = value_data(dtype, 3)
    src = write_safetensors(tmp_path / "in.safetensors", {"t": x})
    for low, high in VALUE_BOUNDS:
        args = (["--min", repr(low)] if low is not None else []) + (
            ["--max", repr(high)] if high is not None else []
        )
        lo = ref_bound(dtype, -math.inf if low is None else low, 1)
        hi = ref_bound(dtype, math.inf if high is None else high, -1)
        result = cli(
            "clip",
            *args,
            str(src),
            str(tmp_path / "out.safetensors"),
            "--format",
            "json",
            "--force",
        )
        if lo is None or hi is None or lo > hi or lo == math.inf or hi == -math.inf:
            assert result.code == 4, (name, low, high, result.stderr)
            continue
        assert result.code == 0, (name, low, high, result.stderr)
        out = read_safetensors(tmp_path / "out.safetensors")["t"]
        expected = ref_clamp(x, lo, hi)
        assert out.tobytes() == expected.tobytes(), (name, low, high)
        assert json.loads(result.stdout)["tensors"][0]["changed"] is (
            expected.tobytes() != x.tobytes()
        )


# ------------------------------------------------------------------ the issue's own cases


def clip_one(
    cli: Callable[..., Any], tmp_path: Path, x: np.ndarray, *args: str, suffix: str = ".safetensors"
) -> tuple[Any, Any]:
    src = write_any(tmp_path / f"issue-in{suffix}", {"t": x})
    out = tmp_path / f"issue-out{suffix}"
    result = cli("clip", *args, str(src), str(out), "--format", "json", "--force")
    return result, (read_any(out)["t"] if result.code == 0 else None)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"])
@pytest.mark.parametrize("bound", [["--max", "9"], ["--min", "-9"]])
def test_issue_1_one_sided_bounds_on_fp8_without_infinity(
    cli: Callable[..., Any], tmp_path: Path, name: str, bound: str
) -> None:
    dtype = dtype_of(name)
    x = np.array([0, 1, 20, -30], np.float32).astype(dtype)
    result, out = clip_one(cli, tmp_path, x, *bound)
    assert result.code == 0, result.stderr
    wide, given = out.astype(np.float32), x.astype(np.float32)
    assert not np.isnan(wide).any()
    moved = 2 if bound[0] == "--max" else 3
    keep = [i for i in range(4) if i != moved]
    assert wide[keep].tolist() == given[keep].tolist()
    assert 8 <= abs(wide[moved]) <= 9


def test_issue_1_e8m0_clamps(cli: Callable[..., Any], tmp_path: Path) -> None:
    x = np.array([1, 2, 4, 0.5], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    _, out = clip_one(cli, tmp_path, x, "--max", "1.5")
    assert out.astype(np.float32).tolist() == [1, 1, 1, 0.5]
    _, out = clip_one(cli, tmp_path, x, "--min", "0.75", "--max", "1.5")
    assert out.astype(np.float32).tolist() == [1, 1, 1, 1]


def test_issue_2_norm_modes_reach_the_best_uniform_factor(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    values = np.random.default_rng(0).standard_normal(10000)
    x8 = values.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    _, out = clip_one(cli, tmp_path, x8, "--norm", "1")
    assert 0.99 <= exact_norm(out) <= 1.0  # was 0.852
    x16 = values.astype(np.float16)
    _, out = clip_one(cli, tmp_path, x16, "--norm", "2e-5")
    assert 0.9999 * 2e-5 <= exact_norm(out) <= 2e-5  # was 0.856 C
    extra = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    mixed = {"w": values.astype(np.float32), "b": extra.astype(ml_dtypes.float8_e4m3fn)}
    src = write_safetensors(tmp_path / "mixed.safetensors", mixed)
    result = cli("clip", "--global", "0.1", str(src), str(tmp_path / "m.safetensors"), "-q")
    assert result.code == 0, result.stderr
    out = read_safetensors(tmp_path / "m.safetensors")
    total = math.sqrt(float(exact_sumsq(out["w"]) + exact_sumsq(out["b"])))
    assert 0.1 * 0.999 <= total <= 0.1  # was 0.017 C


def test_issue_3_complex64_axes_in_float64(cli: Callable[..., Any], tmp_path: Path) -> None:
    x = np.array([[3e38 + 3e38j, 1e38 - 2e38j], [1 + 1j, 2 + 2j]], np.complex64)
    result, out = clip_one(cli, tmp_path, x, "--norm", "1", "--axes", "1")
    assert result.code == 0, result.stderr
    for row in out:
        assert exact_sumsq(row) <= 1  # the overflowing slice is clipped too
    again, out2 = clip_one(cli, tmp_path, out, "--norm", "1", "--axes", "1")
    assert out2.tobytes() == out.tobytes()


def test_issue_4_float64_output_not_above_c(cli: Callable[..., Any], tmp_path: Path) -> None:
    x = np.full((4, 58, 565), 18.954296754636935)
    result, out = clip_one(cli, tmp_path, x, "--norm", "0.284794")
    assert result.code == 0, result.stderr
    assert exact_sumsq(out) <= Fraction(0.284794) ** 2


def test_issue_5_float16_min_beyond_range_is_refused(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    result, _ = clip_one(cli, tmp_path, np.ones(4, np.float16), "--min", "65520")
    assert result.code == 4
    assert result.stderr.startswith("clipcli: error: ")
    assert len(result.stderr.splitlines()) == 1


def test_issue_6_float16_scaling_rounds_once(cli: Callable[..., Any], tmp_path: Path) -> None:
    # mostly subnormal results: where a float32 product rounded again went wrong
    x = (np.random.default_rng(2).standard_normal(281000) * 1e-3).astype(np.float16)
    result, out = clip_one(cli, tmp_path, x, "--global", "1", "--use-norm", "100")
    assert result.code == 0, result.stderr
    scale = json.loads(result.stdout)["tensors"][0]["scale"]
    assert out.tobytes() == ref_scaled(x, scale).tobytes()


def test_issue_7_subnormal_limit(cli: Callable[..., Any], tmp_path: Path) -> None:
    x = np.array([1.7e308, 1.7e308])
    result, out = clip_one(cli, tmp_path, x, "--norm", "5e-324")
    assert result.code == 0, result.stderr
    assert exact_sumsq(out) <= Fraction(5e-324) ** 2


def test_issue_8_nan_bits_kept_and_complex_max_abs(cli: Callable[..., Any], tmp_path: Path) -> None:
    bf = np.array([0x7FC1, 0x7F81, 0x3F80, 0x4000], np.uint16).view(ml_dtypes.bfloat16)
    _, out = clip_one(cli, tmp_path, bf, "--max", "1.5")
    assert out.view(np.uint16).tolist() == [0x7FC1, 0x7F81, 0x3F80, 0x3FC0]
    e5 = np.array([0xFF, 0x7F, 0x3C, 0x44], np.uint8).view(ml_dtypes.float8_e5m2)
    _, out = clip_one(cli, tmp_path, e5, "--max", "1.5")
    assert out.view(np.uint8).tolist()[:3] == [0xFF, 0x7F, 0x3C]
    src = tmp_path / "c.npz"
    np.savez(src, t=np.array([1.4e-45 - 1.4e-45j], np.complex64))
    result = cli("norms", str(src), "--format", "json")
    assert json.loads(result.stdout)["tensors"][0]["max_abs"] == pytest.approx(
        math.hypot(1.4e-45, 1.4e-45), rel=1e-6
    )


def test_worst_output_over_limit_report() -> None:
    """Prints the worst output/C seen per dtype and mode (run with -s)."""
    for (name, mode), ratio in sorted(WORST.items()):
        print(f"worst output/C {name:20s} {mode:8s} {ratio:.16g}")


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
