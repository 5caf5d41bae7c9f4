"""The quantization projects' own code as a second reference for clipcli's quantized view.

tests/data/quant_reference/ holds small model directories that compressed-tensors,
bitsandbytes, AutoAWQ, AutoGPTQ and transformers wrote themselves (their own scale computation and
packing), with the norms and max |x| their own decompression gives in float64
(reference.json; how they were made: make_reference.py there and docs/DEVELOPMENT.md).
These tests share no code with clipcli's decoders:

- always: clipcli's norms of the pinned files against the pinned reference (rel 1e-12,
  max |x| exact but for NVFP4's one ulp, see assert_matches), and a `clip --global` of
  them whose codes, zero points, maps and global scales stay byte for byte (read by a raw
  safetensors parser here);
- where torch and the producing project import (a throwaway venv, docs/DEVELOPMENT.md):
  fresh files written by the projects, clipcli's norms against their own decompression,
  and clipcli's clip output decompressed by the projects' own code to check the bound and
  its tightness.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from conftest import Run

REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "quant_reference"
REFERENCE: dict[str, Any] = json.loads((REFERENCE_DIR / "reference.json").read_text())
CASES: dict[str, Any] = REFERENCE["cases"]
DECODED = sorted(name for name, case in CASES.items() if case["decoded_by_clipcli"])
UNDECODED = sorted(name for name, case in CASES.items() if not case["decoded_by_clipcli"])
PLAIN = "model.norm.weight"
REL = 1e-12
# Layouts clipcli reads but does not clip (exit 4, one line, nothing written): none now. Block
# FP8 with E8M0 scales (transformers' scale_fmt "ue8m0") was one; it clips by powers of two.
CLIP_REFUSED: dict[str, str] = {}
IMPORT_NAMES = {
    "compressed-tensors": "compressed_tensors",
    "bitsandbytes": "bitsandbytes",
    "autoawq": "awq",
    "auto-gptq": "auto_gptq",
    "transformers": "transformers",
}


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors file as (dtype, shape, payload bytes), parsed here from
    the format's definition: 8-byte little-endian header length, JSON header, data."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    return {
        name: (
            entry["dtype"],
            entry["shape"],
            data[entry["data_offsets"][0] : entry["data_offsets"][1]],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }


def weight_rows(run: Run) -> dict[str, dict[str, Any]]:
    assert run.code == 0, run.stderr
    return {row["name"]: row for row in run.json()["tensors"]}


def global_norm(case: dict[str, Any]) -> float:
    figures = [*case["weights"].values(), *case["plain"].values()]
    return math.sqrt(sum(figure["norm"] ** 2 for figure in figures))


def assert_matches(rows: dict[str, dict[str, Any]], weights: dict[str, Any], case: str) -> None:
    for name, expected in weights.items():
        row = rows[name]
        assert (row["quantization"] or {}).get("scheme"), (case, name)
        assert row["in_global"] is True, (case, name)
        assert row["norm"] == pytest.approx(expected["norm"], rel=REL, abs=0), (case, name)
        # NVFP4: compressed-tensors' dequantize computes q * (s / g), rounding twice; clipcli's
        # q * s / g rounds once (q * s is exact in float64), so the two may part by one ulp
        # (seen: 31.66985826829409 exact, 31.669858268294092 theirs). Everything else: equal.
        ulps = 1 if row["quantization"]["scheme"] == "nvfp4" else 0
        gap = abs(row["max_abs"] - expected["max_abs"])
        assert gap <= ulps * math.ulp(expected["max_abs"]), (case, name)
        assert row["nonfinite"] == expected["nonfinite"], (case, name)


def assert_only_scales_changed(before: Path, after: Path, rescaled: list[str]) -> set[str]:
    """Every stored tensor byte-identical except the scales a clip may rewrite (and the
    plain tensor, a plain weight); returns the names that changed."""
    old, new = raw_tensors(before), raw_tensors(after)
    assert old.keys() == new.keys()
    changed = set()
    for name, (dtype, shape, payload) in old.items():
        assert new[name][:2] == (dtype, shape), name
        if new[name][2] != payload:
            changed.add(name)
            assert name == PLAIN or name.endswith(tuple("." + s for s in rescaled)), name
    return changed


# ------------------------------------------------------------------ pinned files (always)


def test_pinned_files_are_small_and_unchanged() -> None:
    """The committed files are the ones the reference was computed from (no hand edit
    without re-running make_reference.py) and stay small."""
    total = 0
    for name, case in CASES.items():
        blob = (REFERENCE_DIR / name / "model.safetensors").read_bytes()
        assert hashlib.sha256(blob).hexdigest() == case["sha256"], name
        assert len(blob) < 100_000, name
        total += len(blob) + (REFERENCE_DIR / name / "config.json").stat().st_size
    assert total < 1_000_000
    assert {*IMPORT_NAMES, "torch"} <= REFERENCE["versions"].keys()
    assert {case["producer"] for case in CASES.values()} == IMPORT_NAMES.keys()


@pytest.mark.parametrize("case", DECODED)
def test_pinned_norms_equal_the_projects_own_decompression(
    case: str, run_main: Callable[..., Run]
) -> None:
    rows = weight_rows(run_main("norms", REFERENCE_DIR / case, "--json"))
    assert_matches(rows, CASES[case]["weights"], case)
    assert rows[PLAIN]["norm"] == CASES[case]["plain"][PLAIN]["norm"]
    assert run_main("norms", REFERENCE_DIR / case, "--json").json()["global_norm"] == (
        pytest.approx(global_norm(CASES[case]), rel=REL, abs=0)
    )


@pytest.mark.parametrize("case", DECODED)
def test_pinned_clip_global_rewrites_only_scales(
    case: str, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    """The project's own files through `clip --global` at half their norm: only scales
    change, the result (as clipcli reads it) is within the limit. The bound against the
    projects' own decoder is checked where they are installed (below)."""
    limit = global_norm(CASES[case]) / 2
    out = tmp_path / "out"
    run = run_main("clip", REFERENCE_DIR / case, out, "--global", repr(limit))
    if case in CLIP_REFUSED:
        assert run.code == 4
        assert CLIP_REFUSED[case] in run.stderr
        assert not out.exists()
        return
    assert run.code == 0, run.stderr
    changed = assert_only_scales_changed(
        REFERENCE_DIR / case / "model.safetensors",
        out / "model.safetensors",
        CASES[case]["rescaled"],
    )
    assert changed
    after = run_main("norms", out, "--json").json()["global_norm"]
    assert limit / 2 <= after <= limit


@pytest.mark.parametrize("case", UNDECODED)
def test_pinned_undecoded_layout_is_named_as_what_it_is(
    case: str, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    """compressed-tensors' int-quantized (naive compressor) int8 codes + scale + zero point:
    recognised, not decoded. The warning and the refusal name them as int8 codes; they
    used to say `per-tensor/channel fp8`, which these codes are not."""
    norms = run_main("norms", REFERENCE_DIR / case, "--json")
    assert norms.code == 0
    assert "int8 codes with scales" in norms.stderr
    assert "fp8" not in norms.stderr
    clip = run_main("clip", REFERENCE_DIR / case, tmp_path / "out", "--global", "1")
    assert clip.code == 4
    assert "int8 codes with scales" in clip.stderr
    assert "fp8" not in clip.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the projects' own code


@functools.cache
def maker() -> ModuleType:
    """make_reference.py, loaded once from its path (it is data, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "make_reference", REFERENCE_DIR / "make_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def projects_for(case: str) -> ModuleType:
    """make_reference.py where torch and the case's producer import, else a skip that says
    why (the project's own environment has neither; docs/DEVELOPMENT.md says how)."""
    producer = CASES[case]["producer"]
    for package in ("torch", "safetensors", IMPORT_NAMES[producer]):
        if importlib.util.find_spec(package) is None:
            pytest.skip(
                f"{package} is not importable: the {producer} cross-check runs in a throwaway "
                "venv with the projects installed (docs/DEVELOPMENT.md, 'Quantization "
                "projects as a reference')"
            )
    return maker()


def fresh_case(module: ModuleType, case: str, directory: Path, seed: int) -> Any:
    by_name = {c.name: c for c in (*module.CASES, *module.UNDECODED_CASES)}
    spec = by_name[case]
    module.write_case(spec, directory, seed)
    return spec


@pytest.mark.parametrize("case", DECODED)
def test_fresh_norms_equal_the_projects_own_decompression(
    case: str, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    module = projects_for(case)
    directory = tmp_path / case
    for seed in (101, 202):
        spec = fresh_case(module, case, directory, seed)
        expected = {
            name: module.stats(values)
            for name, values in module.dequantize_case(spec, directory).items()
        }
        rows = weight_rows(run_main("norms", directory, "--json"))
        assert_matches(rows, expected, f"{case} seed {seed}")


@pytest.mark.parametrize("case", DECODED)
@pytest.mark.parametrize("fraction", [0.999, 0.5, 0.01])
def test_clip_global_checked_by_the_projects_own_decompression(
    case: str, fraction: float, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    """clipcli clips the project's file; the project's own code decompresses the result:
    the global norm is within the limit, as tight as the scale dtype allows, and only the
    scales changed (codes byte-identical)."""
    module = projects_for(case)
    directory = tmp_path / "in"
    spec = fresh_case(module, case, directory, 303)
    before = module.dequantize_case(spec, directory)
    plain = 1.0  # model.norm.weight: ones(8), scaled with everything else
    norm_before = math.sqrt(
        sum(float(np.sum(np.square(v))) for v in before.values()) + 8 * plain**2
    )
    limit = norm_before * fraction
    out = tmp_path / "out"
    run = run_main("clip", directory, out, "--global", repr(limit))
    if case in CLIP_REFUSED:
        assert run.code == 4
        assert CLIP_REFUSED[case] in run.stderr
        return
    assert run.code == 0, run.stderr
    assert (out / "config.json").read_bytes() == (directory / "config.json").read_bytes()
    changed = assert_only_scales_changed(
        directory / "model.safetensors", out / "model.safetensors", CASES[case]["rescaled"]
    )
    assert changed
    after = module.dequantize_case(spec, out)
    factor = float(np.frombuffer(raw_tensors(out / "model.safetensors")[PLAIN][2], "<f4")[0])
    norm_after = math.sqrt(sum(float(np.sum(np.square(v))) for v in after.values()) + 8 * factor**2)
    assert norm_after <= limit
    scale_dtypes = {
        dtype
        for name, (dtype, _, _) in raw_tensors(directory / "model.safetensors").items()
        if name in changed and ".quant_state." not in name  # the JSON whose offset moved
    }
    # the coarsest scale step: E8M0 (MXFP4's U8, ue8m0 F8_E8M0) halves, fp8 e4m3 steps by 1/8,
    # float16 by 2**-10 (AWQ, GPTQ); float32 scales are tight to rounding
    slack = {"U8": 0.5, "F8_E8M0": 0.5, "F8_E4M3": 0.125, "F16": 2**-10}
    tightest = 1 - max((slack.get(d, 1e-6) for d in scale_dtypes), default=1e-6)
    assert norm_after >= limit * tightest, (norm_after, limit, scale_dtypes)


@pytest.mark.parametrize("case", UNDECODED)
def test_fresh_undecoded_layout_is_refused_for_clip(
    case: str, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    module = projects_for(case)
    fresh_case(module, case, tmp_path / "in", 404)
    run = run_main("clip", tmp_path / "in", tmp_path / "out", "--global", "1")
    assert run.code == 4
    assert "int8 codes with scales" in run.stderr
    shutil.rmtree(tmp_path / "in")


@pytest.mark.parametrize("case", DECODED)
def test_every_value_equals_the_projects_own_decompression(
    case: str, run_main: Callable[..., Run], tmp_path: Path
) -> None:
    """Element by element, not only norms: the projects' float64 decompression written as a
    plain float64 file, then `clipcli diff` of the quantized directory against it."""
    module = projects_for(case)
    from safetensors.numpy import save_file

    directory = tmp_path / "in"
    spec = fresh_case(module, case, directory, 505)
    values = module.dequantize_case(spec, directory)
    plain = tmp_path / "plain.safetensors"
    # C order first: safetensors 0.8.0's numpy save_file writes a strided view's underlying
    # buffer as is (compressed-tensors' block decompress returns a slice of a padded tensor)
    contiguous = {name: np.ascontiguousarray(array) for name, array in values.items()}
    save_file({**contiguous, PLAIN: np.ones(8, dtype=np.float32)}, str(plain))
    run = run_main("diff", directory, plain, "--json")
    assert run.code == 0, run.stderr
    rows = {row["name"]: row for row in run.json()["tensors"]}
    for name, expected in values.items():
        peak = float(np.max(np.abs(expected)))
        # NVFP4: one ulp apart at most (assert_matches says why); the rest bit for bit
        tolerance = math.ulp(peak) if rows[name]["norm_a"] and "nvfp4" in case else 0.0
        assert rows[name]["max_abs_diff"] <= tolerance, (name, rows[name])
