"""Hostile paths and hostile values, across formats: directories, FIFOs, devices, symlinks,
extensions that lie, file and tensor names with control characters, non-finite and extreme
finite values. Runs as capped subprocesses unless said otherwise."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from handmade import read_raw_safetensors, write_safetensors
from hostile_cli import (
    assert_refused,
    check_error_line,
    exact_norm,
    refuse_input,
    run_clipcli,
)
from safetensors import safe_open

from clipcli.cli.entry import main

# ---------------------------------------- writers (official libraries; safetensors: handmade.py)


def write_npz(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    arrays: dict[str, Any] = dict(tensors)  # numpy types **kwds as bool | ArrayLike
    np.savez(path, **arrays)
    return path


def write_h5(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    with h5py.File(path, "w") as f:
        for name, array in tensors.items():
            f[name] = array
    return path


WRITERS: dict[str, Callable[[Path, dict[str, np.ndarray]], Path]] = {
    ".safetensors": write_safetensors,
    ".npz": write_npz,
    ".h5": write_h5,
}


def healthy(directory: Path, suffix: str) -> Path:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "dense.kernel": rng.standard_normal((64, 32)).astype(np.float32)
    }
    tensors["dense.bias"] = rng.standard_normal(32)
    return WRITERS[suffix](directory / f"model{suffix}", tensors)


# ------------------------------------------------------------------ the memory cap itself


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_healthy_files_pass_under_the_memory_cap(tmp_path: Path, suffix: str) -> None:
    """The control: with the same cap and timeout, a healthy file of each format works, so
    the refusals below are clipcli's and not the cap's. Includes a 32 MiB tensor, so that
    clipcli's worker threads and chunk buffers run under the cap too."""
    path = healthy(tmp_path, suffix)
    big = WRITERS[suffix](tmp_path / f"big{suffix}", {"w": np.ones(4 << 20)})
    runs = run_clipcli(
        ["norms", str(path)],
        ["clip", "--global", "1", str(path), str(tmp_path / f"out{suffix}")],
        ["clip", "--global", "1", str(big), str(tmp_path / f"big_out{suffix}")],
        cwd=tmp_path,
    )
    for run in runs:
        assert run.returncode == 0, run.describe()


# ------------------------------------------------------------------ paths that are not files


def test_empty_directory(tmp_path: Path) -> None:
    directory = tmp_path / "empty_dir"
    directory.mkdir()
    refuse_input(directory, 3)


def test_directory_of_junk(tmp_path: Path) -> None:
    directory = tmp_path / "junk_dir"
    directory.mkdir()
    (directory / "notes.txt").write_text("hello")
    (directory / "config.json").write_text("{}")
    refuse_input(directory, 3)


@pytest.mark.parametrize(
    "shard", ["../secret.safetensors", "/etc/passwd", "sub/../../secret.safetensors"]
)
def test_index_pointing_outside_the_directory(tmp_path: Path, shard: str) -> None:
    healthy(tmp_path, ".safetensors").rename(tmp_path / "secret.safetensors")
    directory = tmp_path / "model_dir"
    directory.mkdir()
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"dense.bias": shard}}))
    out = tmp_path / "out.safetensors"
    assert_refused(
        [["norms", str(directory)], ["clip", "--global", "1", str(directory), str(out)]],
        3,
        [str(directory)],
        watch=tmp_path,
    )


def test_model_file_symlinked_outside_the_directory(tmp_path: Path) -> None:
    secret = healthy(tmp_path, ".safetensors").rename(tmp_path / "secret.safetensors")
    directory = tmp_path / "model_dir"
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(secret)
    out = tmp_path / "out.safetensors"
    assert_refused(
        [["norms", str(directory)], ["clip", "--global", "1", str(directory), str(out)]],
        3,
        [str(directory)],
        watch=tmp_path,
    )


@pytest.mark.parametrize("name", ["pipe.safetensors", "pipe.npz", "pipe.h5", "pipe"])
def test_fifo_does_not_hang(tmp_path: Path, name: str) -> None:
    """Nobody ever writes to the FIFO: opening it for reading would block forever."""
    path = tmp_path / name
    os.mkfifo(path)
    refuse_input(path, 3)


def test_dev_zero_does_not_hang() -> None:
    """/dev/zero has no extension and never ends: no hang, no eating memory."""
    refuse_input(Path("/dev/zero"), 3)


def test_dev_zero_with_an_extension(tmp_path: Path) -> None:
    link = tmp_path / "zeros.safetensors"
    link.symlink_to("/dev/zero")
    refuse_input(link, 3)


def test_dev_urandom_as_h5(tmp_path: Path) -> None:
    link = tmp_path / "random.h5"
    link.symlink_to("/dev/urandom")
    refuse_input(link, 3)


def test_symlink_loop(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").symlink_to(tmp_path / "b.safetensors")
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "a.safetensors")
    refuse_input(tmp_path / "a.safetensors", 3)


def test_missing_file(tmp_path: Path) -> None:
    refuse_input(tmp_path / "nothing_here.safetensors", 3)


def test_unknown_content_without_extension(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    refuse_input(path, 3)


# ------------------------------------------------------------------ extensions that lie


@pytest.mark.parametrize(
    ("content", "claimed"),
    [
        (".safetensors", ".npz"),
        (".safetensors", ".h5"),
        (".npz", ".safetensors"),
        (".npz", ".hdf5"),
        (".h5", ".safetensors"),
        (".h5", ".npz"),
    ],
)
def test_extension_disagrees_with_content(tmp_path: Path, content: str, claimed: str) -> None:
    source = healthy(tmp_path, content)
    path = source.rename(tmp_path / f"model{claimed}")
    refuse_input(path, 3)


# ------------------------------------------------------------------ hostile file names


def test_file_name_with_newline_and_escape(tmp_path: Path) -> None:
    """The error names the file, escaped: one line, no raw ESC or newline."""
    path = tmp_path / "evil\n\x1b[31mname.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    out = tmp_path / "out.safetensors"
    runs = assert_refused(
        [["norms", str(path)], ["clip", "--global", "1", str(path), str(out)]],
        3,
        [str(tmp_path), "evil", "name.safetensors"],
        watch=tmp_path,
    )
    assert all("[31mname" in run.stderr for run in runs)


# ------------------------------------------------------------------ non-finite values


NONFINITE = {
    "nan_float64": (np.array([1.0, np.nan, 2.0]), 1),
    "inf_float32": (np.array([np.inf, -np.inf, 1.0], dtype=np.float32), 2),
    "nan_and_inf_float16": (np.array([np.nan, np.inf, 0.0, np.nan], dtype=np.float16), 3),
}


@pytest.mark.parametrize("suffix", list(WRITERS))
@pytest.mark.parametrize("case", list(NONFINITE))
def test_nonfinite_values(tmp_path: Path, suffix: str, case: str) -> None:
    """`norms` reports the count (exit 0); `clip --global` refuses (exit 4), naming the
    tensor and the count, and writes nothing."""
    array, count = NONFINITE[case]
    path = WRITERS[suffix](tmp_path / f"m{suffix}", {"ok": np.ones(3), "bad.w": array})
    out = tmp_path / f"out{suffix}"
    before = sorted(p.name for p in tmp_path.iterdir())
    norms, clip = run_clipcli(
        ["norms", "--format", "json", str(path)],
        ["clip", "--global", "1", str(path), str(out)],
        cwd=tmp_path,
    )
    assert norms.returncode == 0, norms.describe()
    rows = {row["name"]: row for row in json.loads(norms.stdout)["tensors"]}
    assert rows["bad.w"]["nonfinite"] == count
    assert rows["ok"]["nonfinite"] == 0
    line = check_error_line(clip, 4, ["bad.w", str(count)])
    assert "'ok'" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_nonfinite_refusal_names_the_file(tmp_path: Path, suffix: str) -> None:
    """Every refusal names the file it is about, exit 4 included: in a script that clips a
    hundred checkpoints, "'bad.w' (1 non-finite)" alone does not say which one."""
    path = WRITERS[suffix](tmp_path / f"m{suffix}", {"bad.w": np.array([np.nan, 1.0])})
    out = tmp_path / f"out{suffix}"
    assert_refused(
        ["clip", "--global", "1", str(path), str(out)], 4, [str(path), "bad.w"], watch=tmp_path
    )


# ------------------------------------------------------------------ extreme finite values


FP16_MAX = float(np.finfo(np.float16).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # type: ignore[no-untyped-call]
EXTREMES: dict[str, tuple[np.ndarray, float, tuple[str, ...]]] = {
    # name: (values, expected norm, formats that can hold the dtype)
    "float64_1e200": (np.array([1e200, 1e200]), 1.4142135623730951e200, tuple(WRITERS)),
    "float64_1e-200": (np.array([1e-200, 1e-200]), 1.4142135623730951e-200, tuple(WRITERS)),
    "float64_max": (np.array([1.7976931348623157e308] * 4), 2 * 1.7976931348623157e308, ()),
    "float64_subnormal": (np.array([5e-324] * 4), 1e-323, tuple(WRITERS)),
    "float32_1e20": (
        np.full(9, 1e20, dtype=np.float32),
        3 * float(np.float32(1e20)),
        tuple(WRITERS),
    ),
    "float32_max": (
        np.full(4, np.finfo(np.float32).max, dtype=np.float32),
        2 * float(np.finfo(np.float32).max),
        tuple(WRITERS),
    ),
    "float32_subnormal_1e-45": (
        np.full(4, 1e-45, dtype=np.float32),
        2 * float(np.float32(1e-45)),
        tuple(WRITERS),
    ),
    "float16_65504": (np.full(16, 65504.0, dtype=np.float16), 4 * FP16_MAX, tuple(WRITERS)),
    "float16_300": (np.array([300.0], dtype=np.float16), 300.0, tuple(WRITERS)),
    "float16_subnormal": (
        np.full(4, 2.0**-24, dtype=np.float16),
        2 * 2.0**-24,
        tuple(WRITERS),
    ),
    "bfloat16_max": (
        np.full(4, BF16_MAX, dtype=ml_dtypes.bfloat16),
        2 * BF16_MAX,
        (".safetensors",),
    ),
}
# float64_max's norm overflows float64 itself (2 * max); it is checked below on its own.
del EXTREMES["float64_max"]

EXTREME_CASES = [(case, suffix) for case, (_, _, fmts) in EXTREMES.items() for suffix in fmts]


@pytest.mark.parametrize(("case", "suffix"), EXTREME_CASES)
def test_extreme_finite_values(tmp_path: Path, case: str, suffix: str) -> None:
    """Norms of huge and tiny values are exact (no overflow to inf, no underflow to 0), and
    `clip --global 1` brings them to norm <= 1 without NaN or Inf."""
    array, expected, _ = EXTREMES[case]
    assert exact_norm(array) == pytest.approx(expected, rel=1e-15, abs=0)
    path = WRITERS[suffix](tmp_path / f"m{suffix}", {"x": array})
    out = tmp_path / f"out{suffix}"
    norms, clip = run_clipcli(
        ["norms", "--format", "json", str(path)],
        ["clip", "--global", "1", "--quiet", str(path), str(out)],
        cwd=tmp_path,
    )
    assert norms.returncode == 0, norms.describe()
    report = json.loads(norms.stdout)
    (row,) = report["tensors"]
    assert row["nonfinite"] == 0
    assert row["norm"] == pytest.approx(expected, rel=1e-12, abs=0), row
    assert report["global_norm"] == pytest.approx(expected, rel=1e-12, abs=0), report
    assert clip.returncode == 0, clip.describe()
    clipped = read_back(out)["x"]
    assert clipped.dtype == array.dtype
    assert clipped.shape == array.shape
    assert np.all(np.isfinite(clipped.astype(np.float64)))
    after = exact_norm(clipped)
    assert after <= 1.0, after
    if expected > 1:
        assert after > 0.9, after  # scaled, not zeroed


def test_float64_max_values_are_refused_or_reported_exactly(tmp_path: Path) -> None:
    """Four float64 maxima: every value is finite but the norm (2 * max) is not a float64.
    `norms` may report it as unrepresentable, but `clip --global 1` must either clip (the
    scale 1/(2 * max) is a perfectly good subnormal; output norm <= 1) or refuse with exit 4;
    writing the tensor unchanged, "within limit", breaks the limit silently."""
    array = np.full(4, np.finfo(np.float64).max)
    path = write_safetensors(tmp_path / "m.safetensors", {"x": array})
    out = tmp_path / "out.safetensors"
    norms, clip = run_clipcli(
        ["norms", "--format", "json", str(path)],
        ["clip", "--global", "1", "--quiet", str(path), str(out)],
        cwd=tmp_path,
    )
    assert norms.returncode == 0, norms.describe()
    assert clip.returncode in (0, 4), clip.describe()
    if clip.returncode == 0:
        clipped = read_back(out)["x"]
        after = exact_norm(clipped)
        assert after <= 1.0, f"clip exited 0, but the output's norm is {after}: {clipped}"
        assert np.all(np.isfinite(clipped))
    else:
        check_error_line(clip, 4, ["'x'"])


@pytest.mark.parametrize("mode", ["--norm", "--global"])
@pytest.mark.parametrize(
    ("values", "limit"),
    [([1e300, 1e300], 1e-42), ([8.2e280], 2.85e-42), ([-1.56e247, -1.5], 3.39e-124)],
)
def test_extreme_limit_to_norm_ratios(
    tmp_path: Path, mode: str, values: list[float], limit: float
) -> None:
    """A limit C with C/||t|| beyond float64's range (below ~1e-308, or 0 after rounding):
    computing that scale first underflows and zeroes the tensor (or leaves it a few bits
    of precision). t/||t||*C is representable, so the output's norm must be C up to
    rounding, not 0: clipcli does not zero tensors. (Found by the fuzzer, layer 1.)"""
    array = np.array(values)
    path = write_safetensors(tmp_path / "m.safetensors", {"x": array})
    out = tmp_path / "out.safetensors"
    (clip,) = run_clipcli(["clip", mode, repr(limit), "--quiet", str(path), str(out)], cwd=tmp_path)
    assert clip.returncode == 0, clip.describe()
    clipped = read_back(out)["x"]
    expected = min(limit, exact_norm(array))
    assert exact_norm(clipped) == pytest.approx(expected, rel=1e-6, abs=0), clipped


@pytest.mark.parametrize("mode", ["--norm", "--global"])
@pytest.mark.parametrize("values", [[2.0**969], [2.0**1000, 1.0], [1e308, -1e308]])
def test_scaling_huge_values_never_overflows(
    tmp_path: Path, mode: str, values: list[float]
) -> None:
    """Found by the fuzzer (layer 1): float64 2**969 clipped to 1.8e16 came out as inf, with
    a RuntimeWarning on stderr and exit 0 (scale_chunk multiplied by the scale's mantissa
    before applying its power of two). The output must be finite, its norm the limit, and
    stderr empty."""
    array = np.array(values)
    limit = 1.801440065696563e16
    path = write_safetensors(tmp_path / "m.safetensors", {"x": array})
    out = tmp_path / "out.safetensors"
    (clip,) = run_clipcli(["clip", mode, repr(limit), "--quiet", str(path), str(out)], cwd=tmp_path)
    assert clip.returncode == 0, clip.describe()
    assert clip.stderr == "", clip.describe()
    clipped = read_back(out)["x"]
    assert np.all(np.isfinite(clipped)), clipped
    assert exact_norm(clipped) == pytest.approx(limit, rel=1e-6, abs=0), clipped


def read_back(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        return read_safetensors_raw(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {key: loaded[key] for key in loaded.files}
    with h5py.File(path, "r") as f:
        out: dict[str, np.ndarray] = {}
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
        return out


def read_safetensors_raw(path: Path) -> dict[str, np.ndarray]:
    """safe_open checks the layout; bytes are viewed here (bfloat16 included)."""
    dtypes = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64}
    with safe_open(str(path), framework="np"):
        pass
    return {
        name: np.frombuffer(payload, dtype=dtypes[code]).reshape(shape)
        for name, (code, shape, payload) in read_raw_safetensors(path).items()
    }


# ------------------------------------------------------------------ hostile tensor names in OUT

HOSTILE_NAMES = {
    "dot_dot_slash": "../evil",
    "absolute": "/abs/evil",
    "backslash_dot_dot": "a\\..\\evil",
    "nul_byte": "a\x00evil",
    "metadata_key": "__metadata__",
    "newline_escape": "evil\n\x1b[31mname",
    "empty": "",
    "trailing_slash": "evil/",
}


@pytest.mark.parametrize("out_suffix", [".safetensors", ".npz", ".h5"])
@pytest.mark.parametrize("case", list(HOSTILE_NAMES))
def test_hostile_tensor_name_in_output(
    case: str, out_suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor name from a stranger's file, carried into OUT (same or another format):
    either OUT holds exactly that tensor name and clipcli (and the official reader) read
    it back, or the clip is refused cleanly and nothing is written. Never a zip member
    that escapes the archive, a silently renamed tensor, or a file nobody can read.

    In-process through main(): 24 cases at a few ms each instead of subprocesses."""
    name = HOSTILE_NAMES[case]
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        src = write_safetensors(workdir / "in.safetensors", {name: np.array([3.0, 4.0])})
        if name == "__metadata__":  # safetensors cannot hold it; start from an npz instead
            src.unlink()
            src = workdir / "in.npz"
            write_npz(src, {name: np.array([3.0, 4.0])})
        out = workdir / f"out{out_suffix}"
        code = main(["clip", "--global", "1", "--quiet", str(src), str(out)])
        err = capsys.readouterr().err
        if code != 0:
            assert code in (2, 3, 5), (code, err)
            assert err.startswith("clipcli: error: "), err
            assert err.count("\n") == 1, err
            assert sorted(p.name for p in workdir.iterdir()) == [src.name]
            return
        assert main(["ls", "--format", "json", str(out)]) == 0, capsys.readouterr().err
        listed = [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]]
        assert listed == [name]
        assert list(read_back(out)) == [name]
