"""The benchmark jobs (commands and their baselines) of each section, and the verdict rows
that compare them."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common import CLIPCLI, HERE, MIB, PY, human, log
from gen_files import Checkpoint, Files
from timing import Bench, Cmd, Stat


@dataclass
class Row:
    job: str
    ours: str
    baseline: str
    ratio: str
    target: str
    verdict: str
    rss: str


def secs(stat: Stat) -> str:
    return f"{stat.median:.3f} s" if stat.ok else "FAILED"


def mib(stat: Stat) -> str:
    return f"{stat.peak:.0f} MiB" if stat.ok else "-"


def verdict(ok: bool, info: bool = False) -> str:
    text = "MET" if ok else "NOT MET"
    return f"info: {text}" if info else text


def failed(ours: Stat, base: Stat | None = None) -> str | None:
    if not ours.ok:
        return "NOT MET (clipcli failed)"
    if base is not None and not base.ok:
        return "unknown (baseline failed)"
    return None


def at_most(
    job: str,
    ours: Stat,
    label: str,
    base: Stat,
    factor: float,
    target: str,
    info: bool = False,
    per_byte: tuple[int, int] | None = None,
) -> Row:
    """ours ≤ factor × base. per_byte=(our bytes, base bytes) compares seconds per byte."""
    bad = failed(ours, base)
    if bad:
        return Row(job, secs(ours), f"{label} {secs(base)}", "-", target, bad, mib(ours))
    scale = per_byte[1] / per_byte[0] if per_byte else 1.0
    ratio = ours.median * scale / base.median
    return Row(
        job,
        secs(ours),
        f"{label} {secs(base)}",
        f"{ratio:.2f}",
        target,
        verdict(ratio <= factor, info),
        mib(ours),
    )


def faster(job: str, ours: Stat, label: str, base: Stat, factor: float, target: str) -> Row:
    """base ≥ factor × ours."""
    bad = failed(ours, base)
    if bad:
        return Row(job, secs(ours), f"{label} {secs(base)}", "-", target, bad, mib(ours))
    speedup = base.median / ours.median
    return Row(
        job,
        secs(ours),
        f"{label} {secs(base)}",
        f"{ours.median / base.median:.2f} (speed-up {speedup:.1f}×)",
        target,
        verdict(speedup >= factor),
        mib(ours),
    )


def under(job: str, ours: Stat, seconds: float) -> Row:
    bad = failed(ours)
    return Row(
        job,
        secs(ours),
        "-",
        "-",
        f"≤ {seconds:g} s",
        bad or verdict(ours.median <= seconds),
        mib(ours),
    )


def rss_at_most(job: str, ours: Stat, limit: float, target: str) -> Row:
    bad = failed(ours)
    return Row(job, secs(ours), "-", "-", target, bad or verdict(ours.peak <= limit), mib(ours))


def rss_growth(job: str, small: Stat, big: Stat, small_label: str) -> Row:
    bad = failed(big, small)
    if bad:
        return Row(job, "-", "-", "-", "≤ +10% RSS", bad, mib(big))
    ratio = big.peak / small.peak
    return Row(
        job,
        f"{big.peak:.0f} MiB",
        f"{small_label} {small.peak:.0f} MiB",
        f"{ratio:.2f}",
        "≤ 1.10 (≤ +10% RSS)",
        verdict(ratio <= 1.10),
        mib(big),
    )


def info(job: str, ours: Stat, note: str = "") -> Row:
    return Row(job, secs(ours), note or "-", "-", "(info)", "-", mib(ours))


# ----------------------------------------------------------------------------- jobs


def norms(path: Path) -> Cmd:
    return Cmd([*CLIPCLI, "norms", "--format", "json", str(path)])


def floor(path: Path) -> Cmd:
    return Cmd([PY, str(HERE / "floor_norms.py"), str(path)])


def clip(mode: Sequence[str], src: Path, out: Path, *extra: str) -> Cmd:
    return Cmd([*CLIPCLI, "clip", *mode, str(src), str(out), "--force", "--quiet", *extra], out)


def run_sections(bench: Bench, f: Files, sections: set[str], size_note: str) -> list[Row]:
    rows: list[Row] = []
    out = bench.workdir / "out.safetensors"
    big, small, single = f.fp32.path, f.fp32_small.path, f.single.path
    B = size_note  # "2 GiB" (or the quick size)

    if "norms" in sections:
        log("norms")
        ours, flo, naive, bf, bflo, bnaive, half, hflo = bench.measure(
            norms(big),
            floor(big),
            Cmd([PY, str(HERE / "naive_norms.py"), str(big)]),
            norms(f.bf16.path),
            floor(f.bf16.path),
            Cmd([PY, str(HERE / "naive_norms.py"), str(f.bf16.path)]),
            norms(f.fp16.path),
            floor(f.fp16.path),
        )
        rows += [
            at_most(f"norms, {B} fp32", ours, "floor", flo, 1.25, "≤ 1.25 × floor"),
            faster(f"norms, {B} fp32", ours, "naive", naive, 5, "≥ 5× faster than naive"),
            at_most(
                f"norms, {B} bf16", bf, "fp32 floor (same bytes)", flo, 2.0, "≤ 2 × fp32 floor"
            ),
            at_most(
                f"norms, {B} bf16",
                bf,
                "bf16 floor",
                bflo,
                2.0,
                "(info) vs floor on bf16",
                info=True,
            ),
            faster(
                f"norms, {B} bf16", bf, "naive (hand-parsed bf16)", bnaive, 1, "(info) vs naive"
            ),
        ]
        rows[-1].verdict = "-"
        rows += [
            at_most(
                f"norms, {B} fp16",
                half,
                "fp32 floor (same bytes)",
                flo,
                2.0,
                "(info) ≤ 2 × fp32 floor, as bf16",
                info=True,
            ),
            at_most(
                f"norms, {B} fp16",
                half,
                "fp16 floor",
                hflo,
                2.0,
                "(info) vs floor on fp16",
                info=True,
            ),
        ]

    if "formats" in sections:
        log("formats")
        st, npz, h5 = bench.measure(
            norms(big), norms(f.npz.path), norms(f.h5.path), group="formats"
        )
        for label, ck, stat in (("npz (uncompressed)", f.npz, npz), ("HDF5", f.h5, h5)):
            rows.append(
                at_most(
                    f"norms, {B} {label}",
                    stat,
                    "safetensors",
                    st,
                    2.0,
                    "≤ 2 × safetensors per byte",
                    per_byte=(ck.size, f.fp32.size),
                )
            )

    if "clip" in sections:
        log("clip")
        cp = Cmd(["cp", str(big), str(out)], out)
        cp_sync = Cmd(
            [
                "sh",
                "-c",
                f"cp {shlex.quote(str(big))} {shlex.quote(str(out))}"
                f" && sync {shlex.quote(str(out))}",
            ],
            out,
        )
        naive = Cmd([PY, str(HERE / "naive_clip.py"), str(big), str(out), "1.0"], out)
        cp_s, cps_s, g, g_nf, naive_s, same, same_nf, g16 = bench.measure(
            cp,
            cp_sync,
            clip(["--global", "1.0"], big, out),
            clip(["--global", "1.0"], big, out, "--no-fsync"),
            naive,
            clip(["--global", "1e30"], big, out),
            clip(["--global", "1e30"], big, out, "--no-fsync"),
            clip(["--global", "1.0"], f.fp16.path, out),
        )
        rows += [
            at_most(f"clip --global 1.0, {B} fp32", g, "cp", cp_s, 1.5, "≤ 1.5 × cp"),
            at_most(
                f"clip --global 1.0, {B} fp32",
                g,
                "cp + sync",
                cps_s,
                1.5,
                "(info) ≤ 1.5 × cp+sync: both durable",
                info=True,
            ),
            at_most(
                f"clip --global 1.0 --no-fsync, {B} fp32",
                g_nf,
                "cp",
                cp_s,
                1.5,
                "(info) ≤ 1.5 × cp: neither syncs",
                info=True,
            ),
            faster(
                f"clip --global 1.0, {B} fp32", g, "naive", naive_s, 2, "≥ 2× faster than naive"
            ),
            at_most(
                f"clip --global 1e30 (nothing changes), {B} fp32",
                same,
                "cp",
                cp_s,
                1.2,
                "≤ 1.2 × cp",
            ),
            at_most(
                f"clip --global 1e30 (nothing changes), {B} fp32",
                same,
                "cp + sync",
                cps_s,
                1.2,
                "(info) ≤ 1.2 × cp+sync: both durable",
                info=True,
            ),
            at_most(
                f"clip --global 1e30 --no-fsync, {B} fp32",
                same_nf,
                "cp",
                cp_s,
                1.2,
                "(info) ≤ 1.2 × cp: neither syncs",
                info=True,
            ),
            at_most(
                f"clip --global 1.0, {B} fp16 (most outputs subnormal)",
                g16,
                "cp (same bytes)",
                cp_s,
                1.5,
                "(info) as fp32 vs cp",
                info=True,
            ),
        ]

    if "rss" in sections:
        log("rss")
        limit = "RSS ≤ 200 MiB"
        files = (
            (human(f.fp32_small.n_tensors * f.fp32_small.largest_tensor_bytes), small),
            (B, big),
            (f"one {human(f.single.largest_tensor_bytes)} tensor", single),
        )
        jobs: list[tuple[str, list[Cmd]]] = [("norms", [norms(p) for _, p in files])]
        jobs[0][1].insert(2, norms(f.bf16.path))
        for mode in (
            ["--global", "1.0"],
            ["--norm", "1.0"],
            ["--average", "1e-6"],
            ["--value", "0.5"],
        ):
            jobs.append((f"clip {' '.join(mode)}", [clip(mode, p, out) for _, p in files]))
        for name, cmds in jobs:
            stats = bench.measure(*cmds)
            labels = [label for label, _ in files]
            if name == "norms":
                labels.insert(2, f"{B} bf16")
            for label, stat in zip(labels, stats, strict=True):
                rows.append(rss_at_most(f"{name}, {label}", stat, 200, limit))
            rows.append(
                rss_growth(
                    f"{name}: RSS growth, {files[0][0]} → {B}",
                    stats[0],
                    stats[1],
                    f"{files[0][0]} file",
                )
            )

    if "axes" in sections:
        log("axes")
        for label, ck in (
            (f"{B} fp32 ({ck_shape(f.fp32)})", f.fp32),
            (f"one tensor ({ck_shape(f.single)})", f.single),
        ):
            (stat,) = bench.measure(clip(["--norm", "1", "--axes", "0"], ck.path, out))
            limit = 2 * ck.largest_tensor_bytes / MIB + 100
            rows.append(
                rss_at_most(
                    f"clip --norm 1 --axes 0, {label}",
                    stat,
                    limit,
                    f"RSS ≤ 2 × {human(ck.largest_tensor_bytes)} + 100 MiB = {limit:.0f} MiB",
                )
            )

    if "startup" in sections:
        log("startup")
        help_, tiny, bare, numpy_ = bench.measure(
            Cmd([*CLIPCLI, "--help"]),
            norms(f.tiny.path),
            Cmd([PY, "-c", "pass"]),
            Cmd([PY, "-c", "import numpy"]),
        )
        rows += [
            under("clipcli --help", help_, 0.25),
            under(f"clipcli norms, {human(f.tiny.size)} file", tiny, 0.45),
            info("python -c pass", bare, "interpreter start-up"),
            info("python -c 'import numpy'", numpy_, "numpy import"),
        ]
    if out.exists():
        out.unlink()
    return rows


def ck_shape(ck: Checkpoint) -> str:
    return f"{ck.n_tensors} × {list(ck.shape)}"
