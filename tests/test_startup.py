"""Start-up (issue 12, item 7): `clipcli ls` in a shell loop imports only what listing
needs. The times themselves are measured by benchmarks/startup.py, not here: a test
checks which modules a run loads, which does not depend on the machine's load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import write_safetensors

from clipcli import __version__
from clipcli.cli.entry import main

HEAVY = ("rich", "h5py", "matplotlib", "clipcli.engine", "clipcli.jobs.diff", "clipcli.numerics")


def _modules_after(argv: list[str]) -> set[str]:
    code = (
        "import sys\n"
        f"sys.argv = ['clipcli', *{argv!r}]\n"
        "from clipcli.__main__ import run\n"
        "try:\n    run()\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,  # a clip to OUT '-' writes binary there
        stderr=subprocess.PIPE,
        text=True,
        check=True,
        timeout=60,
    )
    return set(done.stderr.split())


def _loaded(modules: set[str], prefix: str) -> bool:
    return any(m == prefix or m.startswith(prefix + ".") for m in modules)


def _other_formats_loaded(modules: set[str], fmt: str) -> list[str]:
    """The modules of other formats than `fmt` (formats.registry's preload lists) that a
    run loaded: an input of one format should load its own reader only."""
    from clipcli.formats import registry

    own = set(registry.BY_NAME[fmt].preload)
    others = {m for f in registry.FORMATS if f.readable for m in f.preload} - own
    return sorted(m for m in others if _loaded(modules, m))


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_ls_loads_no_job_module_rich_or_h5py(tmp_path: Path, fmt: str) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    modules = _modules_after(["ls", str(path), "--format", fmt])
    assert "clipcli.formats.safetensors" in modules  # the run did list the file
    assert [m for m in HEAVY if _loaded(modules, m)] == []
    assert _other_formats_loaded(modules, "safetensors") == []  # only the reader it needs


def test_norms_table_loads_no_rich_h5py_or_diff(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    modules = _modules_after(["norms", str(path)])
    assert "clipcli.api" in modules
    assert [
        m for m in ("rich", "h5py", "matplotlib", "clipcli.jobs.diff") if _loaded(modules, m)
    ] == []


# Modules a run over plain float32 files never needs (issue 12, item 7): ml_dtypes (only a
# file that names bf16/fp8 does), the safetensors writers with their copy thread pool, zipfile
# (only zips), hashlib and secrets (temp names and long OUT names, only when writing), csv
# (only --format csv).
NOT_FOR_READING = (
    "ml_dtypes",
    "csv",
    "clipcli.formats.safetensors.writer",
    "clipcli.formats.safetensors.stream",
    "hashlib",
    "secrets",
)


def _float32_files(tmp_path: Path) -> dict[str, Path]:
    import h5py

    npz = tmp_path / "m.npz"
    np.savez(npz, w=np.ones(4, np.float32))
    h5 = tmp_path / "m.h5"
    with h5py.File(h5, "w") as f:
        f["w"] = np.ones(4, np.float32)
    return {
        "safetensors": write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)}),
        "npz": npz,
        "hdf5": h5,
    }


@pytest.mark.parametrize("command", ["ls", "norms"])
@pytest.mark.parametrize("fmt", ["safetensors", "npz", "hdf5"])
def test_float32_run_loads_no_ml_dtypes_writer_or_hashlib(
    tmp_path: Path, command: str, fmt: str
) -> None:
    path = _float32_files(tmp_path)[fmt]
    modules = _modules_after([command, str(path), "--format", "json"])
    assert "clipcli.formats.opening" in modules  # the run did read the file
    assert _other_formats_loaded(modules, fmt) == []  # by suffix: formats.registry
    assert [m for m in NOT_FOR_READING if _loaded(modules, m)] == []
    if fmt != "npz":  # only a zip needs zipfile
        assert not _loaded(modules, "zipfile")
    # Listing starts no thread pool, nor does measuring a small file (measured inline).
    assert not _loaded(modules, "concurrent.futures")
    # Measuring plans nothing and writes nothing: clip's modules stay out (api.WRITING_MODULES).
    writing = (
        "clipcli.jobs.execution",
        "clipcli.jobs.plan",
        "clipcli.jobs.spec",
        "clipcli.output.target",
    )
    assert [m for m in (*writing, "clipcli.numerics.slices") if _loaded(modules, m)] == []


def test_clip_loads_every_module_api_imports_for_writing(tmp_path: Path) -> None:
    """WRITING_MODULES is the list the CLI can import up front for clip and convert; each
    name is a real module that a clip run loads (to a file, or streamed to OUT '-')."""
    from clipcli.api import WRITING_MODULES

    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    loaded: set[str] = set()
    for out in (str(tmp_path / "out.safetensors"), "-"):
        loaded |= _modules_after(["clip", str(path), out, "--norm", "1"])
    assert [m for m in WRITING_MODULES if m not in loaded] == []


@pytest.mark.parametrize("command", ["norms"])  # ls loads neither numpy nor ml_dtypes: below
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_bf16_or_fp8_file_loads_ml_dtypes(tmp_path: Path, command: str, dtype: str) -> None:
    import ml_dtypes

    tensor = np.ones(4, np.float32).astype(getattr(ml_dtypes, dtype))
    path = write_safetensors(tmp_path / "m.safetensors", {"w": tensor})
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", command, str(path), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert dtype in done.stdout  # read and named through ml_dtypes
    assert _loaded(_modules_after([command, str(path), "--format", "json"]), "ml_dtypes")


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--format", "json"],
        ["--format", "csv", "--sort", "name"],
        ["--include", "*.w*", "--exclude", "b.*", "--sort", "size"],
    ],
)
def test_ls_of_a_safetensors_file_loads_no_numpy(tmp_path: Path, options: list[str]) -> None:
    """A safetensors file is listed from its header alone (Reader.listing): a shell loop
    of `clipcli ls` pays for no numpy, ml_dtypes or typer, whatever the dtypes."""
    import ml_dtypes

    tensors = {
        "a.w": np.ones((2, 3), np.float32),
        "b.w": np.ones(4, ml_dtypes.bfloat16),
        "c.w": np.ones(5, ml_dtypes.float8_e4m3fn),
    }
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    modules = _modules_after(["ls", str(path), *options])
    assert "clipcli.formats.safetensors.reader" in modules  # the run did list the file
    assert [m for m in ("numpy", "ml_dtypes", "typer") if _loaded(modules, m)] == []


def test_ls_of_a_model_directory_loads_no_numpy(tmp_path: Path) -> None:
    import json

    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": np.ones(3, np.float16)})
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 14}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    modules = _modules_after(["ls", str(tmp_path), "--format", "json"])
    assert "clipcli.formats.sharded.reader" in modules
    assert [m for m in ("numpy", "ml_dtypes", "typer") if _loaded(modules, m)] == []


def test_the_listing_without_numpy_is_what_numpy_says(tmp_path: Path) -> None:
    """Every dtype code, listed from the header's plain table, against the listing the
    reader's numpy dtypes give (formats.base.Reader.listing, built from `infos`)."""
    import json
    import struct

    from clipcli.formats.base import Reader
    from clipcli.formats.safetensors import DTYPE_NAMES, SafetensorsReader, dtype_of

    header: dict[str, object] = {}
    offset = 0
    for code in sorted(DTYPE_NAMES):  # (dtype_of is checked against numpy above)
        nbytes = 6 * dtype_of(code).itemsize
        header[f"t.{code}"] = {
            "dtype": code,
            "shape": [2, 3],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header).encode()
    path = tmp_path / "all.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))
    with SafetensorsReader(path) as reader:
        from_header = reader.listing
        from_numpy = Reader.listing.fget(reader)  # type: ignore[attr-defined]
    assert from_header == from_numpy
    assert len(from_header) == len(DTYPE_NAMES)


def test_writing_still_finds_the_lazy_safetensors_writers() -> None:
    """The package's writer names resolve on first use (module __getattr__), to the very
    classes of their modules; an unknown name is still an AttributeError."""
    import clipcli.formats.safetensors as package
    from clipcli.formats.safetensors.stream import SafetensorsStreamWriter
    from clipcli.formats.safetensors.writer import SafetensorsWriter, with_structure

    assert package.SafetensorsWriter is SafetensorsWriter
    assert package.SafetensorsStreamWriter is SafetensorsStreamWriter
    assert package.with_structure is with_structure
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(package, "no_such_name")  # noqa: B009 - the attribute is the point


def test_lazy_safetensors_dtype_table_is_the_format_table() -> None:
    """The codes resolve on first use to the dtypes FORMATS.md names (F8_E4M3 is
    float8_e4m3fn), little-endian, built here straight from numpy and ml_dtypes."""
    import ml_dtypes

    from clipcli.formats.safetensors import CODES, DTYPE_NAMES, dtype_of

    expected = {
        "BOOL": np.dtype("|b1"),
        "U8": np.dtype("|u1"),
        "I8": np.dtype("|i1"),
        "I16": np.dtype("<i2"),
        "U16": np.dtype("<u2"),
        "I32": np.dtype("<i4"),
        "U32": np.dtype("<u4"),
        "I64": np.dtype("<i8"),
        "U64": np.dtype("<u8"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F32": np.dtype("<f4"),
        "F64": np.dtype("<f8"),
        "C64": np.dtype("<c8"),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
        "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
        "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    }
    assert set(DTYPE_NAMES) == set(expected)
    for code, dtype in expected.items():
        assert dtype_of(code) == dtype, code
        assert dtype_of(code).str == dtype.str, code  # byte order too
        assert CODES[dtype.name] == code


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "complex64", "complex128"])
def test_finfo_of_numpy_floats_without_ml_dtypes_agrees_with_ml_dtypes(name: str) -> None:
    import ml_dtypes

    from clipcli import dtypes

    ours, theirs = dtypes.finfo(np.dtype(name)), ml_dtypes.finfo(np.dtype(name))  # type: ignore[no-untyped-call]
    for field in ("eps", "max", "tiny", "smallest_subnormal", "nmant", "nexp", "bits"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_records_made_namedtuples_for_start_up_stay_immutable_values() -> None:
    """TensorInfo, FileIdentity and Report became NamedTuples (cheaper to define than
    frozen dataclasses): still immutable, equal by value, hashable where their fields are."""
    from clipcli.formats.base import TensorInfo
    from clipcli.report.model import Column, Report
    from clipcli.system.identity import FileIdentity

    info = TensorInfo("w", np.dtype(np.float32), (2, 3), 24)
    assert info == TensorInfo("w", np.dtype(np.float32), (2, 3), 24)
    assert info != TensorInfo("w", np.dtype(np.float16), (2, 3), 12)
    assert len({info, TensorInfo("w", np.dtype(np.float32), (2, 3), 24)}) == 1
    assert (info.numel, info.dtype_name) == (6, "float32")
    identity = FileIdentity(1, 2, 3, 4, 5)
    report = Report("t", (Column("name", "Name"),), (("w",),))
    for record, field in ((info, "name"), (identity, "size"), (report, "title")):
        with pytest.raises(AttributeError):
            setattr(record, field, None)
    assert report.records() == [{"name": "w"}]


@pytest.mark.parametrize(("nbytes", "threaded"), [(16 << 20, True), ((16 << 20) - 1, False)])
def test_measuring_under_16_mib_runs_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, threaded: bool
) -> None:
    """Exactly INLINE_BELOW_BYTES in all goes to worker threads; a byte less is measured
    in this thread (workers=1), with the same norm."""
    from clipcli.formats.opening import open_reader
    from clipcli.jobs import pipeline
    from clipcli.jobs.selection import EVERY_TENSOR
    from clipcli.system.parallel import ordered_map

    assert pipeline.INLINE_BELOW_BYTES == 16 << 20
    data = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # wraps: 0..255, repeated
    path = write_safetensors(tmp_path / "m.safetensors", {"a": data[:1000], "b": data[1000:]})
    asked: list[int | None] = []

    def spy(fn: Any, items: Any, workers: int | None = None) -> Any:
        asked.append(workers)
        return ordered_map(fn, items, workers)

    monkeypatch.setattr(pipeline, "ordered_map", spy)
    monkeypatch.setenv("CLIPCLI_THREADS", "2")
    with open_reader(path) as reader:
        measured = pipeline.measure(reader, list(reader.infos), EVERY_TENSOR.describe)
    assert asked == ([None] if threaded else [1])
    # Exact reference: sum of squares of 0..255 per full cycle, plus the tail.
    cycles, tail = divmod(nbytes, 256)
    sumsq = cycles * sum(v * v for v in range(256)) + sum(v * v for v in range(tail))
    got = sum(t.stats.norm**2 for t in measured.tensors)
    assert got == pytest.approx(float(sumsq), rel=1e-12)


def test_version_through_main_and_as_a_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"clipcli {__version__}\n"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[1:] = ['--version'];from clipcli.__main__ import run; run()",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"clipcli {__version__}\n", "")


def test_version_loads_no_cli_module() -> None:
    """`clipcli --version` answers before typer, rich or numpy are imported."""
    code = (
        "import sys; sys.argv[1:] = ['--version']\n"
        "from clipcli.__main__ import run\n"
        "try:\n    run()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('typer', 'rich', 'numpy', 'clipcli.cli.entry')"
        " if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip().endswith("[]"), done.stdout


# The quantized view and its schemes (~35 ms of imports): only where markers.py says a
# scheme may claim a weight (a name's marker, or a config.json quantization_config).
SCHEME_MODULES = (
    "clipcli.logical.quantized.view",
    "clipcli.logical.quantized.registry",
    "clipcli.logical.quantized.fp8_block",
    "clipcli.logical.quantized.gptq",
)


@pytest.mark.parametrize("command", ["ls", "norms", "clip"])
@pytest.mark.parametrize("fmt", ["safetensors", "npz", "hdf5"])
def test_a_plain_checkpoint_imports_no_quantized_scheme(
    tmp_path: Path, command: str, fmt: str
) -> None:
    path = _float32_files(tmp_path)[fmt]
    argv = [command, str(path)]
    if command == "clip":
        argv = [command, "--global", "1", str(path), str(tmp_path / f"out{path.suffix}")]
    modules = _modules_after(argv)
    assert "clipcli.formats.opening" in modules  # the run did read the file
    assert "clipcli.logical.quantized.markers" in modules  # and asked whether it might be
    assert [m for m in SCHEME_MODULES if m in modules] == []


def test_a_name_with_a_scheme_marker_still_imports_the_view(tmp_path: Path) -> None:
    """The other side: one companion name (an fp8 scale) and the view is asked."""
    path = write_safetensors(
        tmp_path / "m.safetensors",
        {"w.weight": np.ones(4, np.float32), "w.weight_scale": np.ones(1, np.float32)},
    )
    modules = _modules_after(["norms", str(path)])
    assert "clipcli.logical.quantized.view" in modules


def test_a_config_with_quantization_config_still_imports_the_view(tmp_path: Path) -> None:
    """The other door: no marker in any name, but config.json says the model is quantized."""
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", {"w.weight": np.ones(4, np.float32)})
    (model / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nsys.argv = ['clipcli', 'norms', sys.argv[1]]\n"
            "from clipcli.__main__ import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "print('clipcli.logical.quantized.view' in sys.modules, file=sys.stderr)\n",
            str(model),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stderr.strip().splitlines()[-1] == "True", done.stderr
