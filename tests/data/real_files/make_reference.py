# mypy: ignore-errors
# (torch is not installed where CI type-checks: this script runs by hand, with torch)
"""Pins what torch itself reads in the fetched PyTorch files (run by hand, once, in a venv
with torch; CI needs no torch):

    python tools/fetch_test_data.py
    /path/to/venv-with-torch/bin/python tests/data/real_files/make_reference.py

Writes `reference.json` beside this file: for every PyTorch member of
tools/fetch_test_data.py, each tensor that `torch.load(weights_only=True)` returns, under
its dotted path (nested dicts and lists joined by "."), with dtype, shape, and its L2 norm
and max |x| computed by torch in float64. tests/test_real_files.py checks clipcli against
these numbers when torch is not importable, and against torch itself when it is."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TOOL = HERE.parents[2] / "tools" / "fetch_test_data.py"
PYTORCH_SUFFIXES = (".pt", ".pth", ".bin", ".pth.tar")


def load_tool():
    spec = importlib.util.spec_from_file_location("fetch_test_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fetch_test_data"] = module
    spec.loader.exec_module(module)
    return module


def flatten(value, prefix, found):
    if isinstance(value, torch.Tensor):
        found[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            flatten(item, f"{prefix}.{key}" if prefix else str(key), found)
    elif isinstance(value, (list, tuple)):
        for key, item in enumerate(value):
            flatten(item, f"{prefix}.{key}" if prefix else str(key), found)


def describe(path: Path) -> dict:
    tensors = {}
    flatten(torch.load(path, map_location="cpu", weights_only=True), "", tensors)
    rows = {}
    for name, tensor in sorted(tensors.items()):
        wide = tensor.detach().to(torch.float64)
        rows[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "norm": float(torch.linalg.vector_norm(wide)) if wide.numel() else 0.0,
            "max_abs": float(wide.abs().max()) if wide.numel() else 0.0,
        }
    return rows


def main() -> None:
    tool = load_tool()
    root = tool.cache_folder()
    reference = {"torch": torch.__version__, "files": {}}
    for _archive, member, target in tool.files(root):
        if not member.path.endswith(PYTORCH_SUFFIXES):
            continue
        key = target.relative_to(root).as_posix()
        reference["files"][key] = describe(target)
        print(key, len(reference["files"][key]), "tensors")
    (HERE / "reference.json").write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
