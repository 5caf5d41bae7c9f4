"""`clipcli norms`, `clipcli ls` and every command's --help, through the real CLI, on files
of every format built in tmp_path. Expected norms come from float64 numpy (norm64)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import pytest
from handmade import write_safetensors
from safetensors.numpy import load_file

from clipcli.cli.entry import main

if TYPE_CHECKING:
    from conftest import Run

FORMAT_NAMES = {"safetensors": "safetensors", "npz": "npz", "h5": "hdf5"}
NORM_KEYS = {"path", "format", "global_norm", "tensors"}
ROW_KEYS = {"name", "dtype", "shape", "numel", "norm", "max_abs", "nonfinite", "in_global", "role"}
CSV_HEADER = "name,dtype,shape,numel,norm,max_abs,nonfinite,in_global,role"


def model() -> dict[str, np.ndarray]:
    """Distinct norms and distinct byte sizes, so every sort order is unambiguous."""
    rng = np.random.default_rng(11)
    return {
        "embed.weight": (rng.standard_normal((8, 16)) * 2).astype(np.float32),  # 512 B
        "layers.0.attn.weight": (rng.standard_normal((6, 6)) * 0.5).astype(np.float16),  # 72 B
        "layers.0.attn.bias": np.array([3.0, -4.0, 12.0], np.float64),  # 24 B, norm 13
        "layers.1.mlp.weight": (rng.standard_normal((5, 7)) * 9).astype(np.float64),  # 280 B
        "step": np.array(1000, np.int64),  # 8 B
        "mask": np.array([True, False, True, True]),  # 4 B
    }


FLOATS = ("embed.weight", "layers.0.attn.weight", "layers.0.attn.bias", "layers.1.mlp.weight")


@pytest.fixture
def model_file(ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path]) -> Path:
    return write_checkpoint(ckpt("model"), model())


@pytest.fixture
def norms_json(cli: Callable[..., Run]) -> Callable[..., dict[str, Any]]:
    def run(*args: str | Path) -> dict[str, Any]:
        result = cli("norms", *args, "--format", "json")
        assert result.code == 0, result.stderr
        assert result.stderr == ""
        report: dict[str, Any] = result.json()
        return report

    return run


def expected_global(names: Iterable[str], norm64: Callable[[np.ndarray], float]) -> float:
    tensors = model()
    return math.sqrt(sum(norm64(tensors[n]) ** 2 for n in names))


# ------------------------------------------------------------------ norms --format json


def test_norms_json_schema_and_values(
    fmt: str,
    model_file: Path,
    norms_json: Callable[..., dict[str, Any]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    report = norms_json(model_file)
    assert set(report) == NORM_KEYS
    assert report["path"] == str(model_file)
    assert report["format"] == FORMAT_NAMES[fmt]
    assert report["global_norm"] == pytest.approx(expected_global(FLOATS, norm64), rel=1e-12)
    tensors = model()
    rows = {row["name"]: row for row in report["tensors"]}
    assert set(rows) == set(tensors)
    for name, x in tensors.items():
        row = rows[name]
        assert set(row) == ROW_KEYS, name
        assert row["dtype"] == x.dtype.name
        assert row["shape"] == list(x.shape)
        assert row["numel"] == x.size
        assert row["norm"] == pytest.approx(norm64(x), rel=1e-12)
        assert row["max_abs"] == float(np.max(np.abs(x.astype(np.float64))))
        assert row["nonfinite"] == 0
        assert row["in_global"] is (name in FLOATS), name
    assert rows["layers.0.attn.bias"]["norm"] == 13.0
    # Integer and bool tensors are not in the global norm, but their norm is reported.
    assert rows["step"]["norm"] == 1000.0
    assert rows["mask"]["norm"] == pytest.approx(math.sqrt(3), rel=1e-15)


def test_norms_json_bfloat16(
    tmp_path: Path, write_checkpoint: Callable[..., Path], norms_json: Callable[..., dict[str, Any]]
) -> None:
    x = np.array([[3.0, -4.0], [0.5, 0.0]], dtype=ml_dtypes.bfloat16)
    path = write_checkpoint(tmp_path / "bf.safetensors", {"w": x})
    row = norms_json(path)["tensors"][0]
    assert row["dtype"] == "bfloat16"
    assert row["norm"] == pytest.approx(math.sqrt(25.25), rel=1e-15)
    assert row["in_global"] is True


def test_norms_reports_nonfinite_values(
    ckpt: Callable[[str], Path],
    write_checkpoint: Callable[..., Path],
    norms_json: Callable[..., dict[str, Any]],
) -> None:
    bad = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    path = write_checkpoint(ckpt("bad"), {"bad": bad, "ok": np.array([3.0, 4.0], np.float32)})
    report = norms_json(path)
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows["bad"]["nonfinite"] == 3
    assert rows["ok"]["nonfinite"] == 0
    assert rows["ok"]["norm"] == 5.0
    # JSON has no NaN: a norm that is not a number is null, and so is the global norm.
    assert rows["bad"]["norm"] is None
    assert report["global_norm"] is None


@pytest.mark.parametrize("dtype", ["float16", "float32", "complex64"])
def test_signalling_nans_are_counted_without_a_warning(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_subprocess: Callable[..., Run],
    dtype: str,
) -> None:
    """A signalling NaN (quiet bit clear) made numpy warn "invalid value encountered in
    cast" on stderr when it was widened; a NaN is data to count, not a warning."""
    bits = {
        "float16": [0x7C01, 0x3C00, 0xFC00],
        "float32": [0x7F800001, 0x3F800000, 0xFF800000],
        # complex64 (attack s43b): sNaN + 1.0j, 1.0 - inf j (its widening to complex128)
        "complex64": [0x7F800001, 0x3F800000, 0x3F800000, 0xFF800000],
    }
    unsigned = np.uint16 if dtype == "float16" else np.uint32
    x = np.array(bits[dtype], dtype=unsigned).view(dtype)  # sNaN, 1.0, -inf
    path = write_checkpoint(tmp_path / "s.safetensors", {"x": x})
    result = run_subprocess("norms", "--format", "json", path)
    assert (result.code, result.stderr) == (0, "")
    row = result.json()["tensors"][0]
    assert (row["nonfinite"], row["norm"]) == (2, None)


# ------------------------------------------------------------------ table and CSV


def test_norms_table_lists_every_tensor(
    model_file: Path, cli: Callable[..., Run], norm64: Callable[[np.ndarray], float]
) -> None:
    result = cli("norms", model_file)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, x in model().items():
        matching = [line for line in lines if re.search(rf"(^|\W){re.escape(name)}(\W|$)", line)]
        assert len(matching) == 1, (name, result.stdout)
        assert x.dtype.name in matching[0]
        assert has_number_near(matching[0], norm64(x)), (name, matching[0])
    footer = [line for line in lines if "global" in line.lower()]
    assert any(has_number_near(line, expected_global(FLOATS, norm64)) for line in footer)


def has_number_near(text: str, value: float, rel: float = 1e-5) -> bool:
    """Some number printed in `text` equals `value` to the table's ~6 significant digits."""
    numbers = re.findall(r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", text)
    return any(float(n) == pytest.approx(value, rel=rel) for n in numbers)


def test_norms_csv(
    model_file: Path, cli: Callable[..., Run], norm64: Callable[[np.ndarray], float]
) -> None:
    result = cli("norms", model_file, "--format", "csv")
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines()[0] == CSV_HEADER
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    tensors = model()
    in_json = json.loads(cli("norms", model_file, "--format", "json").stdout)["tensors"]
    assert [row["name"] for row in rows] == [row["name"] for row in in_json]
    for row in rows:
        x = tensors[row["name"]]
        assert row["dtype"] == x.dtype.name
        assert int(row["numel"]) == x.size
        assert float(row["norm"]) == pytest.approx(norm64(x), rel=1e-12)
        assert row["in_global"].lower() in (("true",) if row["name"] in FLOATS else ("false",))


# ------------------------------------------------------------------ --sort, --top, selection


@pytest.mark.parametrize(
    ("args", "order"),
    [([], ["a", "m", "z"]), (["--sort", "file"], ["z", "a", "m"])],
    ids=["default", "file"],
)
def test_default_order_is_natural_names_and_sort_file_keeps_the_files(
    tmp_path: Path,
    args: list[str],
    order: list[str],
    write_checkpoint: Callable[..., Path],
    norms_json: Callable[..., dict[str, Any]],
) -> None:
    # npz and HDF5 keep insertion order only as zip/HDF5 order; check it on a hand-made
    # safetensors file whose offsets follow the dict order. The default is natural name
    # order since issue 23 (item 3); `--sort file` keeps the file's order.
    tensors = {n: np.full(3, v, ml_dtypes.bfloat16) for n, v in (("z", 1), ("a", 2), ("m", 3))}
    path = write_checkpoint(tmp_path / "ordered.safetensors", tensors)
    assert [r["name"] for r in norms_json(path, *args)["tensors"]] == order


def ranked_by_norm(
    tensors: dict[str, np.ndarray], norm64: Callable[[np.ndarray], float]
) -> list[str]:
    """--sort norm ranks what the global norm counts (floating point) first, the rest after
    (issue 12: an int64 `step` of norm 1000 no longer outranks every weight)."""
    return sorted(tensors, key=lambda n: (n not in FLOATS, -norm64(tensors[n])))


def test_sort_by_norm_name_and_size(
    model_file: Path,
    norms_json: Callable[..., dict[str, Any]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    tensors = model()
    by_norm = ranked_by_norm(tensors, norm64)
    by_name = sorted(tensors)
    by_size = sorted(tensors, key=lambda n: -tensors[n].nbytes)
    assert [r["name"] for r in norms_json(model_file, "--sort", "norm")["tensors"]] == by_norm
    assert [r["name"] for r in norms_json(model_file, "--sort", "name")["tensors"]] == by_name
    assert [r["name"] for r in norms_json(model_file, "--sort", "size")["tensors"]] == by_size


def test_top_n(
    model_file: Path,
    norms_json: Callable[..., dict[str, Any]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    tensors = model()
    by_norm = ranked_by_norm(tensors, norm64)
    report = norms_json(model_file, "--sort", "norm", "--top", "2")
    assert [r["name"] for r in report["tensors"]] == by_norm[:2]
    # --top trims the rows, not the global norm
    assert report["global_norm"] == pytest.approx(expected_global(FLOATS, norm64), rel=1e-12)
    everything = norms_json(model_file, "--top", "100")
    assert len(everything["tensors"]) == len(tensors)


def test_top_must_be_positive(
    model_file: Path, run_main: Callable[..., Run], assert_one_error_line: Callable[..., str]
) -> None:
    result = run_main("norms", model_file, "--top", "0")
    assert result.code == 2
    assert_one_error_line(result.stderr, "--top")


def test_include_and_exclude(
    model_file: Path,
    norms_json: Callable[..., dict[str, Any]],
    norm64: Callable[[np.ndarray], float],
) -> None:
    report = norms_json(model_file, "--include", "layers.*")
    names = [r["name"] for r in report["tensors"]]
    assert sorted(names) == ["layers.0.attn.bias", "layers.0.attn.weight", "layers.1.mlp.weight"]
    assert report["global_norm"] == pytest.approx(expected_global(names, norm64), rel=1e-12)

    report = norms_json(model_file, "--include", "layers.*", "--exclude", "*.bias")
    names = sorted(r["name"] for r in report["tensors"])
    assert names == ["layers.0.attn.weight", "layers.1.mlp.weight"]
    assert report["global_norm"] == pytest.approx(expected_global(names, norm64), rel=1e-12)

    # exclude wins over include; repeated globs add up
    report = norms_json(model_file, "-i", "step", "-i", "mask", "-x", "step")
    assert [r["name"] for r in report["tensors"]] == ["mask"]
    assert report["global_norm"] == 0.0


# ------------------------------------------------------------------ --fail-above


def test_fail_above(
    model_file: Path, cli: Callable[..., Run], norm64: Callable[[np.ndarray], float]
) -> None:
    g = expected_global(FLOATS, norm64)
    over = cli("norms", model_file, "--fail-above", repr(g * 0.99), "--format", "json")
    assert over.code == 1
    assert over.json()["global_norm"] == pytest.approx(g, rel=1e-12)  # the report still prints
    lines = over.stderr.splitlines()
    assert len(lines) == 1
    assert "fail-above" in lines[0]
    assert "Traceback" not in over.stderr

    under = cli("norms", model_file, "--fail-above", repr(g * 1.01), "--format", "json")
    assert (under.code, under.stderr) == (0, "")

    exact = over.json()["global_norm"]  # "exceeds": equal is not above
    assert cli("norms", model_file, "--fail-above", repr(exact)).code == 0


def test_fail_above_in_a_shell_pipeline(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_subprocess: Callable[..., Run]
) -> None:
    # `clipcli norms --fail-above 5 m || clipcli clip --global 5 m o`
    path = write_checkpoint(tmp_path / "m.safetensors", {"w": np.array([6.0, 8.0], np.float32)})
    assert run_subprocess("norms", "--fail-above", "10", path).code == 0
    failing = run_subprocess("norms", "--fail-above", "5", path)
    assert failing.code == 1
    assert "w" in failing.stdout
    clipped = run_subprocess("clip", "--global", "5", path, tmp_path / "o.safetensors", "-q")
    assert clipped.code == 0, clipped.stderr
    assert run_subprocess("norms", "--fail-above", "5", tmp_path / "o.safetensors").code == 0


def test_fail_above_with_nan_global_norm_fails(
    ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path], cli: Callable[..., Run]
) -> None:
    path = write_checkpoint(ckpt("nan"), {"w": np.array([np.nan, 1.0], np.float32)})
    assert cli("norms", path, "--fail-above", "1e300").code == 1


# ------------------------------------------------------------------ ls


def test_ls_table(model_file: Path, cli: Callable[..., Run]) -> None:
    result = cli("ls", model_file)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, x in model().items():
        [line] = [line for line in lines if re.search(rf"(^|\W){re.escape(name)}(\W|$)", line)]
        assert x.dtype.name in line
        assert re.search(rf"(^|\D){x.nbytes}(\D|$)", line), (name, line)
        dims = r"\D{1,3}".join(str(d) for d in x.shape)
        assert re.search(dims, line), (name, x.shape, line)


def test_ls_json(fmt: str, model_file: Path, cli: Callable[..., Run]) -> None:
    result = cli("ls", model_file, "--format", "json")
    assert result.code == 0, result.stderr
    report = result.json()
    assert report["format"] == FORMAT_NAMES[fmt]
    rows = {row["name"]: row for row in report["tensors"]}
    for name, x in model().items():
        assert rows[name]["dtype"] == x.dtype.name
        assert rows[name]["shape"] == list(x.shape)
        assert rows[name]["bytes"] == x.nbytes


@pytest.mark.parametrize("ext", [".safetensors", ".h5"])
def test_ls_shows_metadata(
    tmp_path: Path, ext: str, write_checkpoint: Callable[..., Path], cli: Callable[..., Run]
) -> None:
    metadata = {"format": "pt", "source": "unit-test"}
    path = write_checkpoint(tmp_path / f"meta{ext}", {"w": np.ones(2, np.float32)}, metadata)
    table = cli("ls", path)
    assert table.code == 0, table.stderr
    for key, value in metadata.items():
        assert re.search(rf"{key}\W+{value}", table.stdout), table.stdout
    assert cli("ls", path, "--format", "json").json()["metadata"] == metadata


def test_ls_and_norms_through_main_and_a_subprocess(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    run_subprocess: Callable[..., Run],
) -> None:
    path = write_checkpoint(tmp_path / "m.npz", {"w": np.array([3.0, 4.0])})
    for run in (run_main, run_subprocess):
        result = run("norms", path, "--format", "json")
        assert (result.code, result.stderr) == (0, "")
        assert result.json()["global_norm"] == 5.0
        listed = run("ls", path)
        assert listed.code == 0
        assert "w" in listed.stdout
        assert "float64" in listed.stdout


# ------------------------------------------------------------------ help


@pytest.mark.parametrize(
    "command", [[], ["ls"], ["norms"], ["clip"]], ids=["clipcli", "ls", "norms", "clip"]
)
def test_help_has_examples(command: list[str], cli: Callable[..., Run]) -> None:
    result = cli(*command, "--help")
    assert result.code == 0, result.stderr
    assert "Usage:" in result.stdout
    assert "Example" in result.stdout


def test_every_command_has_help(cli: Callable[..., Run]) -> None:
    from clipcli.cli.typer_app import app

    names = [c.name for c in app.registered_commands]
    assert {"ls", "norms", "clip"} <= set(names)
    for name in names:
        result = cli(name, "--help")
        assert result.code == 0, name
        assert "Example" in result.stdout, name


def test_top_level_help_documents_exit_codes(cli: Callable[..., Run]) -> None:
    text = cli("--help").stdout
    assert "Exit codes" in text
    for code in ("0", "1", "2", "3", "4", "5", "70", "130"):
        assert re.search(rf"^\s*{code}\s+\S", text, re.MULTILINE), code


def test_no_arguments_shows_help(
    run_subprocess: Callable[..., Run], run_main: Callable[..., Run]
) -> None:
    for run in (run_subprocess, run_main):
        result = run()
        assert result.code == 0, result.stderr
        assert "Usage:" in result.stdout
        for command in ("ls", "norms", "clip"):
            assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command


def test_dtype_names_are_numpys(
    tmp_path: Path, write_checkpoint: Callable[..., Path], cli: Callable[..., Run]
) -> None:
    tensors = {
        "bf16": np.ones(2, ml_dtypes.bfloat16),
        "e4m3": np.ones(2, ml_dtypes.float8_e4m3fn),
        "e5m2": np.ones(2, ml_dtypes.float8_e5m2),
        "f16": np.ones(2, np.float16),
        "u8": np.ones(2, np.uint8),
    }
    path = write_checkpoint(tmp_path / "dtypes.safetensors", tensors)
    listed = {r["name"]: r["dtype"] for r in cli("ls", path, "-f", "json").json()["tensors"]}
    measured = cli("norms", path, "-f", "json").json()["tensors"]
    expected = {
        "bf16": "bfloat16",
        "e4m3": "float8_e4m3fn",
        "e5m2": "float8_e5m2",
        "f16": "float16",
        "u8": "uint8",
    }
    assert listed == expected
    assert {r["name"]: r["dtype"] for r in measured} == expected
    assert {r["name"]: r["in_global"] for r in measured} == {n: n != "u8" for n in tensors}


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
