"""Correctness checks on the generated files: clipcli agrees with the floor script, clip
outputs keep their promises."""

from __future__ import annotations

import filecmp
import json
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from common import HERE, PY, log
from gen_files import Files
from jobs import clip, floor, norms
from timing import Failure


def run_text(argv: Sequence[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Failure(f"`{shlex.join(argv)}` exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def clipcli_global(path: Path) -> float:
    return float(json.loads(run_text(norms(path).argv))["global_norm"])


def floor_global(path: Path) -> float:
    return float(run_text(floor(path).argv).split()[-1])


def checks(f: Files, workdir: Path, sections: set[str]) -> list[tuple[str, bool, str]]:
    """The work being timed is the right work: every tool gets the same answer."""
    results: list[tuple[str, bool, str]] = []
    out = workdir / "check.safetensors"

    def check(name: str, fn: object) -> None:
        try:
            ok, detail = fn()  # type: ignore[operator]
        except Failure as exc:
            ok, detail = False, str(exc)
        results.append((name, ok, detail))
        log(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")

    def close(a: float, b: float, rel: float) -> tuple[bool, str]:
        return abs(a - b) <= rel * abs(b), f"{a!r} vs {b!r}"

    log("checks")
    need = sections & {"norms", "formats", "clip"}
    if not need:
        return results
    ref = floor_global(f.fp32.path)
    if "norms" in sections:
        check("norms fp32 = floor", lambda: close(clipcli_global(f.fp32.path), ref, 1e-9))
        naive = [PY, str(HERE / "naive_norms.py")]
        check(
            "naive fp32 = floor",
            lambda: close(float(run_text([*naive, str(f.fp32.path)])), ref, 1e-9),
        )
        bref = floor_global(f.bf16.path)
        check("norms bf16 = bf16 floor", lambda: close(clipcli_global(f.bf16.path), bref, 1e-9))
        check(
            "naive bf16 = bf16 floor",
            lambda: close(float(run_text([*naive, str(f.bf16.path)])), bref, 1e-9),
        )
        href = floor_global(f.fp16.path)
        check("norms fp16 = fp16 floor", lambda: close(clipcli_global(f.fp16.path), href, 1e-9))
    if "formats" in sections:
        check("norms npz = safetensors", lambda: close(clipcli_global(f.npz.path), ref, 1e-9))
        check("norms HDF5 = safetensors", lambda: close(clipcli_global(f.h5.path), ref, 1e-9))
    if "clip" in sections:

        def clipped(argv: list[str]) -> tuple[bool, str]:
            out.unlink(missing_ok=True)
            run_text(argv)
            return close(floor_global(out), 1.0, 1e-5)

        check(
            "clip --global 1.0: output norm 1",
            lambda: clipped(clip(["--global", "1.0"], f.fp32.path, out).argv),
        )
        check(
            "naive clip: output norm 1",
            lambda: clipped([PY, str(HERE / "naive_clip.py"), str(f.fp32.path), str(out), "1"]),
        )

        def unchanged() -> tuple[bool, str]:
            out.unlink(missing_ok=True)
            run_text(clip(["--global", "1e30"], f.fp32.path, out).argv)
            ok, detail = close(floor_global(out), ref, 0.0)
            same = filecmp.cmp(f.fp32.path, out, shallow=False)
            return ok, f"{detail}; output file byte-identical to input: {'yes' if same else 'no'}"

        check("clip --global 1e30: data unchanged", unchanged)

        def clipped_fp16() -> tuple[bool, str]:
            out.unlink(missing_ok=True)
            run_text(clip(["--global", "1.0"], f.fp16.path, out).argv)
            norm = floor_global(out)  # rounding to float16 may only shrink it, by < 1e-3
            return 0.999 <= norm <= 1.0, f"{norm!r} in [0.999, 1]"

        check("clip --global 1.0 fp16: output norm at most 1", clipped_fp16)
    out.unlink(missing_ok=True)
    return results
