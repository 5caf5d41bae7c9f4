"""Tests that loop over every member of an enum, so that a new member cannot arrive
untested or undocumented: clip modes, checkpoint formats (file suffixes), sort keys, report
formats and exit codes.

Each table below is keyed by the enum itself; a member missing from a table fails its test
by name instead of being skipped. Outputs are read back with the official libraries
(safetensors.numpy, numpy.load, h5py), never with clipcli's readers.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import signal
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.errors import ExitCode
from clipcli.formats import registry
from clipcli.formats.safetensors import SafetensorsWriter
from clipcli.jobs.spec import Mode
from clipcli.report import OutputFormat, SortKey

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
# Every suffix OUT may have, with its format's name: from the registry, so that a new
# format arrives here by its entry alone.
EXTENSIONS = {suffix: fmt.name for suffix, fmt in registry.OUTPUT_SUFFIXES.items()}

MainRun = Callable[..., Any]


def _tensors() -> dict[str, np.ndarray]:
    # Norms 5, 13 and 1 (exact in float32), and one integer tensor that stays out of it all.
    return {
        "layers.10.w": np.array([3.0, 4.0], np.float32),
        "layers.2.w": np.array([5.0, 12.0, 0.0], np.float32),
        "bias": np.array([1.0], np.float32),
        "step": np.array([7], np.int64),
    }


def _write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """With the official library of the format the suffix names."""
    fmt = EXTENSIONS[path.suffix]
    if fmt == "safetensors":
        save_file(tensors, str(path))
    elif fmt == "npz":
        arrays: dict[str, Any] = dict(tensors)  # numpy types **kwds as bool | ArrayLike
        np.savez(path, **arrays)
    elif fmt == "hdf5":
        with h5py.File(path, "w") as handle:
            for name, array in tensors.items():
                handle.create_dataset(name, data=array)
    elif fmt == "keras":  # a zip of config.json, metadata.json and the HDF5 weights
        weights = io.BytesIO()
        with h5py.File(weights, "w") as handle:
            for name, array in tensors.items():
                handle.create_dataset(name, data=array)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("metadata.json", '{"keras_version": "3.0.0"}')
            archive.writestr("config.json", '{"class_name": "Sequential"}')
            archive.writestr("model.weights.h5", weights.getvalue())
    elif fmt == "npy":  # one array, no name
        (array,) = tensors.values()
        np.save(path, array)
    elif fmt == "gguf":  # llama.cpp's own gguf package
        import gguf

        writer = gguf.GGUFWriter(str(path), "test")
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    elif fmt == "pytorch":  # torch itself, where it installs (CI has no torch: the
        # torch-free round trips are tests/test_pytorch_writer.py's)
        torch = pytest.importorskip("torch")
        torch.save({name: torch.from_numpy(array) for name, array in tensors.items()}, path)
    else:
        raise AssertionError(f"no official writer known to the test for {fmt!r}")
    return path


def _read(path: Path) -> dict[str, np.ndarray]:
    fmt = EXTENSIONS[path.suffix]
    if fmt == "safetensors":
        return load_file(str(path))
    if fmt == "npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {name: loaded[name] for name in loaded.files}
    if fmt == "hdf5":
        with h5py.File(path, "r") as handle:
            return {name: np.asarray(handle[name][()]) for name in handle}
    if fmt == "keras":
        with zipfile.ZipFile(path) as archive:
            weights = io.BytesIO(archive.read("model.weights.h5"))
        with h5py.File(weights, "r") as handle:
            return {name: np.asarray(handle[name][()]) for name in handle}
    if fmt == "npy":
        from clipcli.formats.npy import TENSOR_NAME

        return {TENSOR_NAME: np.load(path, allow_pickle=False)}
    if fmt == "gguf":
        import gguf

        return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    if fmt == "pytorch":
        torch = pytest.importorskip("torch")
        loaded = torch.load(path, weights_only=True)
        return {name: tensor.numpy() for name, tensor in loaded.items()}
    raise AssertionError(f"no official reader known to the test for {fmt!r}")


def _main_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> Any:
    capsys.readouterr()
    code = main([str(a) for a in (*args, "--format", "json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


# ------------------------------------------------------------------ clip modes

# How each mode is asked for on the command line, and the limit that makes it change the
# 13-norm tensor but not the 1-norm one.
MODE_FLAGS: dict[Mode, list[str]] = {
    Mode.VALUE: ["--value", "4"],
    Mode.NORM: ["--norm", "4"],
    Mode.AVERAGE: ["--average", "1"],  # the [5, 12, 0] tensor's limit is 1 * 3 elements
    Mode.GLOBAL: ["--global", "4"],
}


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_is_accepted_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: Mode
) -> None:
    assert mode in MODE_FLAGS, f"new clip mode {mode!r}: add it to MODE_FLAGS"
    src = _write(tmp_path / "in.safetensors", _tensors())
    out = tmp_path / "out.safetensors"
    report = _main_json(capsys, "clip", *MODE_FLAGS[mode], src, out)
    assert report["mode"] == mode.value
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows["layers.2.w"]["changed"] is True
    assert rows["step"]["changed"] is False
    written = _read(out)
    assert written["step"].tobytes() == _tensors()["step"].tobytes()
    big = written["layers.2.w"].astype(np.float64)
    if mode is Mode.VALUE:
        assert float(np.max(np.abs(big))) <= 4.0
    elif mode is Mode.AVERAGE:
        assert math.sqrt(float(np.dot(big, big))) <= 3.0 * (1 + 2**-23)
    else:
        assert math.sqrt(float(np.dot(big, big))) <= 4.0 * (1 + 2**-23)


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_has_a_readme_entry(mode: Mode) -> None:
    """The clip section's table has a row starting with the mode's flag."""
    assert re.search(rf"^\| `--{mode.value} ", README, re.MULTILINE) or (
        mode is Mode.VALUE and "`--value V`" in README
    ), f"README has no row for --{mode.value}"


# ------------------------------------------------------------------ formats


@pytest.mark.parametrize("suffix", sorted(EXTENSIONS))
def test_every_registered_suffix_reads_and_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """Written by the official library, read by clipcli; written by clipcli, read back by
    the official library bit for bit. A format that holds one tensor gets one, named as
    its reader names it."""
    tensors = _tensors()
    if registry.ONE_TENSOR in registry.OUTPUT_SUFFIXES[suffix].capabilities:
        from clipcli.formats.npy import TENSOR_NAME

        tensors = {TENSOR_NAME: tensors["layers.2.w"]}
    src = _write(tmp_path / f"in{suffix}", tensors)
    document = _main_json(capsys, "norms", src)
    assert document["format"] == EXTENSIONS[suffix]
    assert sorted(row["name"] for row in document["tensors"]) == sorted(tensors)
    out = tmp_path / f"out{suffix}"
    # A .keras archive is written from a .keras IN only (its other members are kept).
    source = _write(tmp_path / ("any.keras" if suffix == ".keras" else "any.safetensors"), tensors)
    assert main(["convert", "-q", str(source), str(out)]) == 0
    back = _read(out)
    assert sorted(back) == sorted(tensors)
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype
        assert back[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("suffix", sorted(EXTENSIONS))
def test_every_registered_suffix_is_documented(suffix: str) -> None:
    assert f"`{suffix}`" in README, f"README never names {suffix}"


# ------------------------------------------------------------------ sort keys and formats

# The row order each key promises, computed here from the tensors themselves (FILE: the
# order of the data in the file, read from the header's offsets).
SORT_ORDERS: dict[SortKey, list[str]] = {
    SortKey.FILE: [],
    SortKey.NAME: ["bias", "layers.2.w", "layers.10.w", "step"],  # natural: 2 before 10
    # What the global norm counts first (13, 5, 1), then the rest (the int64 step, norm 7).
    SortKey.NORM: ["layers.2.w", "layers.10.w", "bias", "step"],
    SortKey.SIZE: ["layers.2.w", "layers.10.w", "bias", "step"],  # 12, 8, 4, 8 bytes
}


@pytest.mark.parametrize("key", list(SortKey))
def test_every_sort_key_orders_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: SortKey
) -> None:
    assert key in SORT_ORDERS, f"new sort key {key!r}: add its order to SORT_ORDERS"
    src = _write(tmp_path / "in.safetensors", _tensors())
    rows = _main_json(capsys, "norms", src, "--sort", key.value)["tensors"]
    names = [row["name"] for row in rows]
    if key is SortKey.FILE:
        data = src.read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        header.pop("__metadata__", None)
        assert names == sorted(header, key=lambda name: header[name]["data_offsets"][0])
    elif key is SortKey.SIZE:  # ties (8 bytes) may come in either order
        assert names[0] == "layers.2.w"
        assert sorted(names[1:3]) == ["layers.10.w", "step"]
        assert names[3] == "bias"
    else:
        assert names == SORT_ORDERS[key]


def test_readme_lists_exactly_the_sort_keys() -> None:
    keys = {key.value for key in SortKey}
    listed = [set(entry.split("|")) for entry in re.findall(r"`--sort ([a-z|]+)`", README)]
    assert keys in listed, "README never lists every --sort key (norms takes them all)"
    assert all(entry <= keys for entry in listed), listed


def test_readme_lists_exactly_the_report_formats() -> None:
    formats = {fmt.value for fmt in OutputFormat}
    listed = [set(e.split("|")) for e in re.findall(r"`--format ([a-z]+(?:\|[a-z]+)+)`", README)]
    assert formats in listed, "README never lists every --format value"
    assert all(entry <= formats for entry in listed), listed


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_report_format_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: OutputFormat
) -> None:
    src = _write(tmp_path / "in.safetensors", _tensors())
    capsys.readouterr()
    assert main(["norms", str(src), "--format", fmt.value]) == 0
    out = capsys.readouterr().out
    assert "layers.10.w" in out


# ------------------------------------------------------------------ exit codes


def _readme_exit_codes() -> set[int]:
    section = README.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes: set[int] = set()
    for number, meaning in re.findall(r"^\| (\d+) \| (.*)\|$", section, re.MULTILINE):
        codes.add(int(number))
        codes.update(int(extra) for extra in re.findall(r"\b(1[0-9]{2}) for SIG", meaning))
    return codes


def test_every_exit_code_is_documented_and_every_documented_code_exists() -> None:
    assert _readme_exit_codes() == {int(code) for code in ExitCode}


def _signal_inside_the_write(monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """The signal arrives while the output is being written (clipcli records it and acts
    on it between chunks)."""
    real = SafetensorsWriter.write

    def write(self: SafetensorsWriter, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), sig)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SafetensorsWriter, "write", write)


def _fail_inside_the_write(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def write(*_args: object) -> None:
        raise error

    monkeypatch.setattr(SafetensorsWriter, "write", write)


def _reach(code: ExitCode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Arrange for `code` and return the command line that must exit with it."""
    src = _write(tmp_path / "in.safetensors", _tensors())
    out = str(tmp_path / "out.safetensors")
    if code is ExitCode.OK:
        return ["norms", str(src)]
    if code is ExitCode.CONDITION:
        return ["norms", "--fail-above", "5", str(src)]  # global norm sqrt(195) > 5
    if code is ExitCode.USAGE:
        return ["clip", "--global", "0", str(src), out]
    if code is ExitCode.BAD_INPUT:
        garbage = tmp_path / "garbage.safetensors"
        garbage.write_bytes(b"\xff" * 64)
        return ["norms", str(garbage)]
    if code is ExitCode.REFUSED_DATA:
        nan = _write(tmp_path / "nan.safetensors", {"w": np.array([np.nan], np.float32)})
        return ["clip", "--norm", "1", str(nan), out]
    if code is ExitCode.WRITE_FAILED:
        _fail_inside_the_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
        return ["clip", "--global", "1", str(src), out]
    if code is ExitCode.INTERNAL:
        _fail_inside_the_write(monkeypatch, RuntimeError("a bug"))
        return ["clip", "--global", "1", str(src), out]
    signals = {
        ExitCode.HANGUP: signal.SIGHUP,
        ExitCode.INTERRUPTED: signal.SIGINT,
        ExitCode.TERMINATED: signal.SIGTERM,
    }
    assert code in signals, f"new exit code {code!r}: add a case that reaches it"
    _signal_inside_the_write(monkeypatch, signals[code])
    return ["clip", "--global", "1", str(src), out]


@pytest.mark.parametrize("code", list(ExitCode))
def test_every_exit_code_is_reachable(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: ExitCode,
) -> None:
    monkeypatch.delenv("CLIPCLI_DEBUG", raising=False)
    argv = _reach(code, tmp_path, monkeypatch)
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err
    if code is ExitCode.OK:
        assert err == ""
    elif code is not ExitCode.CONDITION:
        one_error_line(err)
    assert not (tmp_path / "out.safetensors").exists() or code is ExitCode.OK
