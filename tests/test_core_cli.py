"""The core contract through the real CLI, on files of every format built in tmp_path and
read back with the official libraries (safe_open, np.load, h5py), never with our readers."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from forked_cli import run_forked
from handmade import write_safetensors
from safetensors import safe_open
from typer.testing import CliRunner

from clipcli.cli.entry import main
from clipcli.cli.typer_app import app

runner = CliRunner()
FORMATS = ["safetensors", "npz", "h5"]
BF16 = np.dtype(ml_dtypes.bfloat16)
TF_TOLERANCE = 1e-6  # relative, as the TF docs print float32 to ~8 digits


# ------------------------------------------------------------------ files


def write(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> Path:
    if path.suffix == ".safetensors":
        write_safetensors(path, tensors, metadata)
    elif path.suffix == ".npz":
        arrays: dict[str, Any] = dict(tensors)  # numpy types **kwds as bool | ArrayLike
        np.savez(path, **arrays)
    else:
        with h5py.File(path, "w") as f:
            for key, value in (metadata or {}).items():
                f.attrs[key] = value
            for name, array in tensors.items():
                f.create_dataset(name, data=array)
    return path


def read(path: Path) -> dict[str, np.ndarray]:
    """Read with the official libraries only."""
    if path.suffix == ".safetensors":
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__", None)
        with safe_open(str(path), framework="np") as handle:
            assert sorted(handle.keys()) == sorted(header)
        out = {}
        for name, entry in header.items():
            dtype = {
                "BF16": BF16,
                "F16": np.float16,
                "F32": np.float32,
                "F64": np.float64,
                "I64": np.int64,
                "I32": np.int32,
                "BOOL": np.bool_,
            }[entry["dtype"]]
            begin, end = entry["data_offsets"]
            raw = data[8 + length + begin : 8 + length + end]
            out[name] = np.frombuffer(raw, dtype=dtype).reshape(entry["shape"])
        return out
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {k: loaded[k] for k in loaded.files}
    with h5py.File(path, "r") as f:
        found: dict[str, np.ndarray] = {}
        f.visititems(
            lambda n, o: found.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None
        )
        return found


def cli(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def clip_json(src: Path, out: Path, *mode: str) -> dict:  # type: ignore[type-arg]
    code, stdout, stderr = cli("clip", *mode, str(src), str(out), "--format", "json")
    assert code == 0, stderr
    return json.loads(stdout)  # type: ignore[no-any-return]


def norm64(array: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(array, dtype=np.float64).ravel()))


# ------------------------------------------------------------------ TF's own numbers


@pytest.mark.parametrize("fmt", FORMATS)
def test_tf_clip_by_norm_example(tmp_path: Path, fmt: str) -> None:
    src = write(tmp_path / f"in.{fmt}", {"t": np.array([[1, 2, 3, 4, 5]], dtype=np.float32)})
    out = tmp_path / f"out.{fmt}"
    clip_json(src, out, "--norm", "2.0")
    expected = [[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]]
    np.testing.assert_allclose(read(out)["t"], expected, rtol=TF_TOLERANCE)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tf_article_examples(tmp_path: Path, fmt: str) -> None:
    t = np.linspace(-2, 3, 6).reshape(2, 3).astype(np.float32)
    src = write(tmp_path / f"in.{fmt}", {"t": t})
    clip_json(src, tmp_path / f"a.{fmt}", "--norm", "4")
    np.testing.assert_allclose(
        read(tmp_path / f"a.{fmt}")["t"],
        [[-1.8353258, -0.9176629, 0.0], [0.9176629, 1.8353258, 2.7529888]],
        rtol=TF_TOLERANCE,
    )
    clip_json(src, tmp_path / f"b.{fmt}", "--norm", "5")
    assert read(tmp_path / f"b.{fmt}")["t"].tobytes() == t.tobytes()
    clip_json(src, tmp_path / f"c.{fmt}", "--norm", "3", "--axes", "1")
    np.testing.assert_allclose(
        read(tmp_path / f"c.{fmt}")["t"],
        np.array([[-2, -1, 0], [0.8017837, 1.6035674, 2.4053512]]),
        rtol=TF_TOLERANCE,
    )
    # TF's clip_by_value example.
    v = np.linspace(-4, 6, 6).astype(np.float32)
    src_v = write(tmp_path / f"v.{fmt}", {"v": v})
    clip_json(src_v, tmp_path / f"vo.{fmt}", "--min", "-2", "--max", "2")
    assert read(tmp_path / f"vo.{fmt}")["v"].tolist() == [-2, -2, 0, 2, 2, 2]


@pytest.mark.parametrize("fmt", FORMATS)
def test_tf_global_norm_example(tmp_path: Path, fmt: str) -> None:
    c1 = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.float32)
    c2 = np.array([[-2, -4], [2, 4]], dtype=np.float32)
    src = write(tmp_path / f"in.{fmt}", {"c1": c1, "c2": c2})
    report = clip_json(src, tmp_path / f"out.{fmt}", "--global", "9")
    out = read(tmp_path / f"out.{fmt}")
    np.testing.assert_allclose(
        out["c1"], [[0, 0.9233805, 1.846761], [2.7701416, 3.693522, 4.6169024]], rtol=TF_TOLERANCE
    )
    np.testing.assert_allclose(
        out["c2"], [[-1.846761, -3.693522], [1.846761, 3.693522]], rtol=TF_TOLERANCE
    )
    assert report["global_norm_before"] == pytest.approx(math.sqrt(95), rel=1e-15)
    assert report["global_norm_after"] == pytest.approx(9.0, rel=1e-6)
    assert report["global_norm_after"] <= 9.0


# ------------------------------------------------------------------ every mode vs float64


def reference(mode: str, tensors: dict[str, np.ndarray], c: float) -> dict[str, np.ndarray]:
    """TF's formulas in float64."""
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    if mode == "value":
        return {k: np.clip(v, -c, c) for k, v in wide.items()}
    if mode == "norm":
        return {k: v * c / max(norm64(v), c) for k, v in wide.items()}
    if mode == "average":
        return {k: v * c / max(norm64(v) / v.size, c) for k, v in wide.items()}
    g = math.sqrt(sum(norm64(v) ** 2 for v in wide.values()))
    return {k: v * c / max(g, c) for k, v in wide.items()}


DTYPES = {"float16": np.float16, "bfloat16": BF16, "float32": np.float32, "float64": np.float64}
# Rounding to the dtype (plus, for the 16-bit types, the at most three refinement steps
# that keep the rounded norm under C) bounds the error at a few units of the dtype's eps;
# the scale also carries a 1e-12 relative margin for the float64 norm's own error.
EPS = {"float16": 2**-10, "bfloat16": 2**-7, "float32": 2**-23, "float64": 5e-13}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    ("mode", "limit"), [("value", 0.5), ("norm", 3.0), ("average", 0.05), ("global", 5.0)]
)
def test_every_mode_matches_the_float64_formula(
    tmp_path: Path, fmt: str, dtype: str, mode: str, limit: float
) -> None:
    # A constant seed per case (hash() of a str changes with every interpreter start).
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{dtype}/{mode}".encode()))
    shapes = [(), (7,), (4, 5), (2, 3, 4)]
    tensors = {
        f"t{i}": (rng.standard_normal(s) * 4).astype(DTYPES[dtype]) for i, s in enumerate(shapes)
    }
    tensors["t0"] = np.asarray(tensors["t0"])
    # npz and HDF5 cannot hold bfloat16, so a bf16 input is always a safetensors file.
    src = write(tmp_path / ("in.safetensors" if dtype == "bfloat16" else f"in.{fmt}"), tensors)
    out = tmp_path / f"out.{fmt}"
    flag = {"value": "--value", "norm": "--norm", "average": "--average", "global": "--global"}[
        mode
    ]
    if dtype == "bfloat16" and fmt != "safetensors":
        code, _, err = cli("clip", flag, str(limit), str(src), str(out))
        assert code == 2
        assert "cannot hold bfloat16" in err
        return
    clip_json(src, out, flag, str(limit))
    result = read(out)
    expected = reference(mode, tensors, limit)
    for name, array in tensors.items():
        got = result[name]
        assert got.dtype == array.dtype
        assert got.shape == array.shape
        tolerance = 4 * EPS[dtype] * max(1.0, float(np.max(np.abs(expected[name]), initial=0.0)))
        np.testing.assert_allclose(
            got.astype(np.float64), expected[name], rtol=4 * EPS[dtype], atol=tolerance
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_norm_equals_the_limit(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {
        "a": rng.standard_normal((30, 20)),
        "b": rng.standard_normal(50).astype(np.float32),
    }
    src = write(tmp_path / f"in.{fmt}", tensors)
    clip_json(src, tmp_path / f"g.{fmt}", "--global", "2.5")
    g = math.sqrt(sum(norm64(v) ** 2 for v in read(tmp_path / f"g.{fmt}").values()))
    assert g <= 2.5
    assert g == pytest.approx(2.5, rel=1e-6)
    clip_json(src, tmp_path / f"n.{fmt}", "--norm", "1.5")
    for array in read(tmp_path / f"n.{fmt}").values():
        assert norm64(array) <= 1.5
        assert norm64(array) == pytest.approx(1.5, rel=1e-6)
    clip_json(src, tmp_path / f"x.{fmt}", "--norm", "0.5", "--axes", "0")
    columns = np.linalg.norm(read(tmp_path / f"x.{fmt}")["a"].astype(np.float64), axis=0)
    assert np.all(columns <= 0.5)
    np.testing.assert_allclose(columns, 0.5, rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_untouched_tensors_are_bit_identical(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(8)
    tensors = {
        "big": rng.standard_normal(100) * 10,
        "small": rng.standard_normal(10) * 0.01,
        "skip.me": rng.standard_normal(10) * 100,
        "counts": np.arange(10, dtype=np.int64) * 1000,
        "mask": np.array([True, False, True]),
    }
    src = write(tmp_path / f"in.{fmt}", tensors)
    report = clip_json(src, tmp_path / f"o.{fmt}", "--norm", "1", "--exclude", "skip.*")
    out = read(tmp_path / f"o.{fmt}")
    for name in ("small", "skip.me", "counts", "mask"):
        assert out[name].tobytes() == tensors[name].tobytes(), name
    assert norm64(out["big"]) <= 1.0
    notes = {row["name"]: row["note"] for row in report["tensors"]}
    assert notes == {
        "big": "",
        "small": "within limit",
        "skip.me": "not selected",
        "counts": "not floating point",
        "mask": "not floating point",
    }


def test_metadata_and_attributes_survive(tmp_path: Path) -> None:
    tensors = {"w": np.arange(10.0, dtype=np.float32)}
    src = write(tmp_path / "in.safetensors", tensors, {"format": "pt", "step": "7"})
    out = tmp_path / "out.safetensors"
    clip_json(src, out, "--global", "1")
    with safe_open(str(out), framework="np") as handle:
        assert handle.metadata() == {"format": "pt", "step": "7"}
    h5 = tmp_path / "in.h5"
    with h5py.File(h5, "w") as f:
        f.attrs["model"] = "mlp"
        group = f.create_group("layer")
        group.attrs["units"] = 10
        ds = group.create_dataset("w", data=np.arange(10.0), chunks=(5,), compression="gzip")
        ds.attrs["trainable"] = True
    clip_json(h5, tmp_path / "out.h5", "--global", "1")
    with h5py.File(tmp_path / "out.h5") as f:
        assert f.attrs["model"] == "mlp"
        assert f["layer"].attrs["units"] == 10
        assert f["layer/w"].attrs["trainable"]
        assert f["layer/w"].compression == "gzip"
        assert f["layer/w"].chunks == (5,)
    npz = tmp_path / "in.npz"
    np.savez_compressed(npz, w=np.arange(10.0))
    clip_json(npz, tmp_path / "out.npz", "--global", "1")
    import zipfile

    assert zipfile.ZipFile(tmp_path / "out.npz").infolist()[0].compress_type == zipfile.ZIP_DEFLATED


# ------------------------------------------------------------------ exact norms


def norms_json(path: Path) -> dict:  # type: ignore[type-arg]
    code, out, err = cli("norms", str(path), "--format", "json")
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("array", "expected", "rel"),
    [
        (np.full(300, 300.0, dtype=np.float16), 5196.152422706632, 1e-12),
        (np.array([1e20, 1e20], dtype=np.float32), 1.4142135623730951e20, 1e-7),
        (np.array([1e200, 1e200]), 1.4142135623730951e200, 1e-15),
        (np.array([1e-200, 1e-200]), 1.4142135623730951e-200, 1e-15),
        (np.array([65504.0] * 4, dtype=np.float16), 131008.0, 1e-15),
        (np.array([1e-45] * 4, dtype=np.float32), 2 * float(np.float32(1e-45)), 1e-15),
    ],
)
def test_norms_are_exact(tmp_path: Path, array: np.ndarray, expected: float, rel: float) -> None:
    path = write(tmp_path / "x.safetensors", {"x": array})
    row = norms_json(path)["tensors"][0]
    assert row["norm"] == pytest.approx(expected, rel=rel)


# ------------------------------------------------------------------ refusals


def assert_refused(tmp_path: Path, args: list[str], code: int, *fragments: str) -> None:
    """In its own clipcli process (forked warm: tests/forked_cli.py)."""
    before = sorted(p.name for p in tmp_path.iterdir())
    (proc,) = run_forked([args], cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("clipcli: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp file


def test_bad_inputs_are_refused_cleanly(tmp_path: Path) -> None:
    good = write(tmp_path / "good.safetensors", {"w": np.arange(6.0).reshape(2, 3)})
    out = str(tmp_path / "out.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-5])
    assert_refused(tmp_path, ["clip", "--global", "1", str(truncated), out], 3, "truncated")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\xff" * 100)
    assert_refused(tmp_path, ["norms", str(garbage)], 3, str(garbage))
    objects = tmp_path / "objects.npz"
    np.savez(objects, a=np.array([None, 1], dtype=object))
    assert_refused(tmp_path, ["norms", str(objects)], 3, "'a'", "objects")
    linked = tmp_path / "linked.h5"
    with h5py.File(linked, "w") as f:
        f["x"] = h5py.ExternalLink("/etc/passwd", "/data")
    assert_refused(tmp_path, ["norms", str(linked)], 3, "external link")
    nan = write(
        tmp_path / "nan.safetensors", {"ok": np.ones(3), "bad": np.array([1.0, np.nan, np.inf])}
    )
    assert_refused(tmp_path, ["clip", "--global", "1", str(nan), out], 4, "'bad' (2 non-finite)")
    assert_refused(
        tmp_path, ["clip", "--norm", "1", "--axes", "2", str(good), out], 4, "'w'", "[2, 3]"
    )
    assert_refused(tmp_path, ["clip", "--norm", "-1", str(good), out], 2, "positive")
    assert_refused(tmp_path, ["clip", "--norm", "0", str(good), out], 2, "positive")
    assert_refused(
        tmp_path, ["clip", "--norm", "1", "--global", "1", str(good), out], 2, "one mode"
    )
    assert_refused(tmp_path, ["clip", "--axes", "0", "--global", "1", str(good), out], 2, "--axes")
    assert_refused(tmp_path, ["clip", "--norm", "1", str(good), str(good)], 2, "is the input")
    mislabelled = tmp_path / "really_safetensors.npz"
    mislabelled.write_bytes(good.read_bytes())
    assert_refused(tmp_path, ["norms", str(mislabelled)], 3, "extension says npz")
    assert_refused(tmp_path, ["norms", str(tmp_path / "missing.npz")], 3, "no such file")
    mislabelled.unlink()


def test_existing_out_needs_force(tmp_path: Path) -> None:
    good = write(tmp_path / "good.safetensors", {"w": np.arange(6.0)})
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    assert_refused(tmp_path, ["clip", "--global", "1", str(good), str(out)], 2, "--force")
    assert out.read_bytes() == b"keep me"
    assert main(["clip", "--global", "1", "-q", "--force", str(good), str(out)]) == 0
    assert norm64(read(out)["w"]) == pytest.approx(1.0, rel=1e-12)


def test_skip_nonfinite_leaves_the_tensor_alone(tmp_path: Path) -> None:
    bad = np.array([1.0, np.nan, 3.0])
    src = write(tmp_path / "in.safetensors", {"bad": bad, "ok": np.full(4, 10.0)})
    report = clip_json(src, tmp_path / "o.safetensors", "--global", "1", "--skip-nonfinite")
    out = read(tmp_path / "o.safetensors")
    assert out["bad"].tobytes() == bad.tobytes()
    assert norm64(out["ok"]) == pytest.approx(1.0, rel=1e-12)
    assert {r["name"]: r["note"] for r in report["tensors"]}["bad"] == "non-finite, skipped"


# ------------------------------------------------------------------ reports and help


def test_norms_json_schema_and_options(tmp_path: Path) -> None:
    src = write(
        tmp_path / "m.safetensors",
        {"embed": np.full((4, 4), 2.0, dtype=np.float32), "head": np.ones(3), "step": np.array(5)},
    )
    document = norms_json(src)
    assert set(document) == {"path", "format", "global_norm", "tensors"}
    assert document["format"] == "safetensors"
    assert document["global_norm"] == pytest.approx(math.sqrt(64 + 3), rel=1e-15)
    assert document["tensors"][0] == {
        "name": "embed",
        "dtype": "float32",
        "shape": [4, 4],
        "numel": 16,
        "norm": 8.0,
        "max_abs": 2.0,
        "nonfinite": 0,
        "in_global": True,
        "role": "weight",
    }
    assert document["tensors"][2]["in_global"] is False
    code, out, _ = cli("norms", str(src), "--sort", "norm", "--top", "1", "--format", "csv")
    assert out.splitlines() == [
        "name,dtype,shape,numel,norm,max_abs,nonfinite,in_global,role",
        "embed,float32,4x4,16,8.0,2.0,0,true,weight",
    ]
    code, out, _ = cli("norms", str(src), "--include", "h*", "--format", "json")
    assert [t["name"] for t in json.loads(out)["tensors"]] == ["head"]
    assert cli("norms", str(src), "--fail-above", "8.1")[0] == 1
    assert cli("norms", str(src), "--fail-above", "8.2")[0] == 0
    code, out, _ = cli("norms", str(src))
    assert code == 0
    assert "embed" in out
    assert "global L2 norm 8.18535" in out


def test_clip_report_dry_run_and_quiet(tmp_path: Path) -> None:
    src = write(tmp_path / "m.safetensors", {"a": np.full(4, 3.0), "b": np.ones(2)})
    out = tmp_path / "o.safetensors"
    code, stdout, _ = cli(
        "clip", "--global", "1", "--dry-run", "--format", "json", str(src), str(out)
    )
    assert code == 0
    assert not out.exists()
    document = json.loads(stdout)
    assert document["mode"] == "global"
    assert document["limit"] == 1.0
    assert document["dry_run"] is True
    assert document["global_norm_before"] == pytest.approx(math.sqrt(38), rel=1e-15)
    # The scale keeps a documented 1e-12 relative margin under C (plus float64 rounding).
    assert document["global_norm_after"] == pytest.approx(1.0, rel=1.5e-12)
    row = document["tensors"][0]
    assert set(row) == {"name", "dtype", "norm_before", "norm_after", "scale", "changed", "note"}
    assert row["changed"] is True
    assert row["scale"] == pytest.approx(1 / math.sqrt(38), rel=1e-12)
    code, stdout, _ = cli("clip", "--global", "1", "--quiet", str(src), str(out))
    assert code == 0
    assert stdout == ""
    assert out.exists()


@pytest.mark.parametrize("command", [[], ["ls"], ["norms"], ["clip"], ["convert"], ["diff"]])
def test_every_command_has_help_with_examples(command: list[str]) -> None:
    code, out, _ = cli(*command, "--help")
    assert code == 0
    assert "Example" in out


def test_no_arguments_shows_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "Usage: clipcli" in capsys.readouterr().out


def test_help_does_not_import_numpy_or_the_format_libraries() -> None:
    """`clipcli --help` must start fast: numpy, h5py and safetensors load only when a command
    needs them (a report-module import of clipping once pulled numpy in: 0.07 -> 0.14 s)."""
    probe = (
        "import sys\n"
        "from clipcli.cli.entry import main\n"
        "code = main(['--help'])\n"
        "heavy = sorted({'numpy', 'h5py', 'safetensors', 'ml_dtypes'} & set(sys.modules))\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout
