"""clipcli benchmark harness: whole processes, warm page cache, median of N runs, peak RSS.

    python benchmarks/run.py                 # full run (2 GiB files), writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick         # smoke run with small files (< 1 min), prints only
    python benchmarks/run.py --keep /tmp/cb  # generate into / reuse checkpoints from /tmp/cb
    python benchmarks/run.py --only norms startup

Every checkpoint is generated here from a seeded generator in a temp dir (no downloads).
Sections for --only: norms, formats, clip, rss, axes, startup (default: all).
See benchmarks/README.md for what every row means.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
MIB = 1 << 20
GIB = 1 << 30
SECTIONS = ("norms", "formats", "clip", "rss", "axes", "startup")
GEN_CHUNK = 8 << 20  # elements generated at a time: bounded memory for any tensor size


def clipcli_command() -> list[str]:
    """The installed console script next to this interpreter (what users run), else -m."""
    script = Path(PY).parent / "clipcli"
    if script.exists():
        return [str(script)]
    found = shutil.which("clipcli")
    return [found] if found else [PY, "-m", "clipcli"]


CLIPCLI = clipcli_command()


# ----------------------------------------------------------------------------- data


@dataclass
class Checkpoint:
    path: Path
    kind: str  # "safetensors" | "npz" | "HDF5"
    dtype: str
    n_tensors: int
    shape: tuple[int, ...]  # of every tensor

    nbytes: int = 0  # remembered after generation: the files may be gone by report time

    @property
    def size(self) -> int:
        if not self.nbytes:
            self.nbytes = self.path.stat().st_size
        return self.nbytes

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype in ("BF16", "F16") else 4

    @property
    def largest_tensor_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.itemsize


def write_safetensors(ck: Checkpoint, seed: int) -> None:
    """Hand-written safetensors (8-byte LE header length, compact JSON padded with spaces to
    8 bytes, raw little-endian data), streamed chunk by chunk so memory stays bounded.
    BF16 = the top 16 bits of the float32 sample; F16 = the sample rounded to float16."""
    if ck.path.exists():
        return
    assert sys.byteorder == "little"
    itemsize = ck.itemsize
    numel = int(np.prod(ck.shape))
    header: dict[str, object] = {"__metadata__": {"format": "pt", "generator": "clipcli bench"}}
    offset = 0
    for i in range(ck.n_tensors):
        header[f"model.layers.{i}.weight"] = {
            "dtype": ck.dtype,
            "shape": list(ck.shape),
            "data_offsets": [offset, offset + numel * itemsize],
        }
        offset += numel * itemsize
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    partial = ck.path.with_name(ck.path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(ck.n_tensors):
            left = numel
            while left:
                n = min(left, GEN_CHUNK)
                values = rng.standard_normal(n, dtype=np.float32)
                if ck.dtype == "BF16":
                    values = (values.view(np.uint32) >> 16).astype(np.uint16)
                elif ck.dtype == "F16":
                    values = values.astype(np.float16)
                out.write(memoryview(values))
                left -= n
    os.replace(partial, ck.path)


def safetensors_entries(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def tensors_of(src: Path) -> list[tuple[str, np.ndarray]]:
    """(name, memmap view) per tensor of an F32 safetensors file: no copies."""
    base, header = safetensors_entries(src)
    data = np.memmap(src, dtype=np.uint8, mode="r", offset=base)
    out = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        out.append((name, data[begin:end].view("<f4").reshape(entry["shape"])))
    return out


def write_npz(src: Path, ck: Checkpoint) -> None:
    """What np.savez writes (a ZIP_STORED zip64 archive of NAME.npy members), but streamed
    from the safetensors file tensor by tensor instead of from arrays held in memory."""
    if ck.path.exists():
        return
    partial = ck.path.with_name(ck.path.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in tensors_of(src):
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    os.replace(partial, ck.path)


def write_h5(src: Path, ck: Checkpoint) -> None:
    """One contiguous (unchunked, uncompressed) dataset per tensor, same names and data."""
    if ck.path.exists():
        return
    import h5py

    partial = ck.path.with_name(ck.path.name + ".partial")
    with h5py.File(partial, "w") as f:
        for name, array in tensors_of(src):
            f.create_dataset(name, data=array)
    os.replace(partial, ck.path)


@dataclass
class Files:
    fp32: Checkpoint  # the 2 GiB fp32 file
    bf16: Checkpoint  # 2 GiB bf16 (same bytes, twice the elements)
    fp16: Checkpoint  # 2 GiB fp16 (same bytes, twice the elements)
    fp32_small: Checkpoint  # 0.5 GiB fp32: the RSS-growth check
    single: Checkpoint  # one 1 GiB fp32 tensor
    tiny: Checkpoint  # 1 MiB: start-up time
    npz: Checkpoint  # same data as fp32, np.savez layout, uncompressed
    h5: Checkpoint  # same data as fp32, HDF5

    def all(self) -> list[Checkpoint]:
        return [
            *(self.fp32, self.bf16, self.fp16, self.fp32_small, self.single, self.tiny),
            *(self.npz, self.h5),
        ]


def plan(directory: Path, quick: bool) -> Files:
    big, small, single = (64 * MIB, 16 * MIB, 32 * MIB) if quick else (2 * GIB, GIB // 2, GIB)
    cols = 1024

    def st(tag: str, total: int, n: int, dtype: str) -> Checkpoint:
        itemsize = 2 if dtype in ("BF16", "F16") else 4
        rows = total // n // itemsize // cols
        path = directory / f"{tag}-{dtype.lower()}-{n}x{rows}x{cols}.safetensors"
        return Checkpoint(path, "safetensors", dtype, n, (rows, cols))

    fp32 = st("big", big, 64, "F32")

    def same_as_fp32(suffix: str, kind: str) -> Checkpoint:
        return Checkpoint(fp32.path.with_suffix(suffix), kind, "F32", fp32.n_tensors, fp32.shape)

    return Files(
        fp32=fp32,
        bf16=st("big", big, 128, "BF16"),
        fp16=st("big", big, 128, "F16"),
        fp32_small=st("small", small, 64, "F32"),
        single=st("single", single, 1, "F32"),
        tiny=st("tiny", MIB, 8, "F32"),
        npz=same_as_fp32(".npz", "npz"),
        h5=same_as_fp32(".h5", "HDF5"),
    )


def generate(files: Files) -> None:
    # fp16 comes last so that the other files keep the seeds they had before it was added.
    safetensors = [files.fp32, files.bf16, files.fp32_small, files.single, files.tiny, files.fp16]
    for seed, ck in enumerate(safetensors):
        started = time.perf_counter()
        write_safetensors(ck, seed + 1)
        log(f"  {ck.path.name}: {human(ck.size)} in {time.perf_counter() - started:.1f} s")
    for ck, writer in ((files.npz, write_npz), (files.h5, write_h5)):
        started = time.perf_counter()
        writer(files.fp32.path, ck)
        log(f"  {ck.path.name}: {human(ck.size)} in {time.perf_counter() - started:.1f} s")


# ----------------------------------------------------------------------------- measuring

TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
# Fallback when GNU time is missing: one wrapper process per run, reporting its children's
# peak RSS (KiB on Linux), CPU seconds and blocks read from disk in the same "%M %U %S %I"
# format.
WRAPPER = (
    "import resource,subprocess,sys\n"
    "rc=subprocess.call(sys.argv[2:],stdout=subprocess.DEVNULL)\n"
    "u=resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "open(sys.argv[1],'w').write(f'{u.ru_maxrss} {u.ru_utime} {u.ru_stime} {u.ru_inblock}')\n"
    "sys.exit(rc)\n"
)


@dataclass
class Cmd:
    argv: list[str]
    fresh: Path | None = None  # OUT: deleted (and os.sync()ed) before every run

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(self.argv)


@dataclass
class Stat:
    cmd: Cmd
    group: str = ""  # set when a command is measured again inside a comparison group
    samples: list[Sample] = field(default_factory=list)  # the timed runs
    retried: int = 0  # runs redone because other processes were busy
    error: str | None = None

    @property
    def walls(self) -> list[float]:
        return [x.wall for x in self.samples]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def peak(self) -> float:
        return max(x.rss for x in self.samples)


class Failure(Exception):
    pass


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NOISY = 0.25  # cores of CPU used by other processes during a run: redo it (a few times)
RETRIES = 2


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait), incl. steal."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS


COLD_MIB = 8.0  # a run that reads more than this from the disk did not find a warm cache


@dataclass
class Sample:
    wall: float  # s
    rss: float  # peak RSS, MiB
    cpu: float  # user + sys of the command, s
    foreign: float  # load of other processes during the run, in cores
    disk: float  # MiB the command read from the block device (page-cache misses)

    @property
    def clean(self) -> bool:
        return self.foreign <= NOISY and self.disk <= COLD_MIB


def run_once(cmd: Cmd) -> Sample:
    if cmd.fresh is not None:
        cmd.fresh.unlink(missing_ok=True)
        os.sync()  # a quiet page cache: no writeback from earlier runs competes with this one
    with tempfile.NamedTemporaryFile("r", suffix=".rusage") as report:
        if TIME:
            argv = [TIME, "-f", "%M %U %S %I", "-o", report.name, *cmd.argv]
        else:
            argv = [PY, "-c", WRAPPER, report.name, *cmd.argv]
        busy = busy_seconds()
        started = time.perf_counter()
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - started
        busy = busy_seconds() - busy
        usage = report.read().split()
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()
        raise Failure(f"exit {proc.returncode}: {stderr[-2000:]}")
    rss_kib, user, system, blocks = usage[-4:]
    cpu = float(user) + float(system)
    # /proc/stat counts in clock ticks (10 ms): allow two ticks of rounding, or every
    # sub-0.1 s command would look loaded.
    foreign = max(0.0, busy - cpu - 2 / CLOCK_TICKS) / wall
    return Sample(wall, int(rss_kib) / 1024, cpu, foreign, int(blocks) * 512 / MIB)


class Pinned:
    """Input files mmap'ed and mlock'ed into the page cache while a group runs, so that "warm
    page cache" holds: some VMs evict idle page-cache pages within seconds (e.g. a DAMON
    `pageout` scheme), and a timed run would then read its input from the disk. The pages
    are mapped in this harness process only; the measured commands' RSS is unaffected."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]  # fmt: skip
        self.libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.maps: list[tuple[int, int]] = []
        self.failed: str | None = None

    def pin(self, paths: Sequence[Path]) -> None:
        import mmap

        for path in paths:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = self.libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if addr is None or addr == self.ctypes.c_void_p(-1).value:
                self.failed = f"mmap {path.name}: {os.strerror(self.ctypes.get_errno())}"
                continue
            self.maps.append((addr, size))
            if self.libc.mlock(addr, size) != 0:
                self.failed = f"mlock {path.name}: {os.strerror(self.ctypes.get_errno())}"

    def release(self) -> None:
        for addr, size in self.maps:
            self.libc.munmap(addr, size)
        self.maps = []


def quiet_load(window: float = 1.0) -> float:
    """Cores kept busy by other processes over `window` seconds (the harness is idle)."""
    before = busy_seconds()
    time.sleep(window)
    return (busy_seconds() - before) / window


class Bench:
    def __init__(self, runs: int, workdir: Path, max_wait: float, retries: int, pin: bool) -> None:
        self.pinned = Pinned() if pin else None
        self.runs = runs
        self.retries = retries
        self.workdir = workdir
        self.max_wait = max_wait
        self.waited = 0.0
        self.cache: dict[tuple[str, ...], Stat] = {}

    def wait_quiet(self) -> None:
        """Before each group: wait (at most max_wait s) until other processes use less than
        NOISY cores, so clipcli and its baselines run on an otherwise idle machine."""
        started = time.perf_counter()
        while time.perf_counter() - started < self.max_wait:
            if quiet_load() <= NOISY:
                break
        waited = time.perf_counter() - started
        if waited > 1.5:
            log(f"  (waited {waited:.0f} s for other processes to go quiet)")
        self.waited += waited

    def measure(self, *cmds: Cmd, group: str = "") -> list[Stat]:
        """One warm-up each, then `runs` rounds in which the commands take turns
        (interleaved), so slow drift in the machine affects clipcli and baselines alike.
        A command measured before is reused, unless `group` is given: then every command
        is measured afresh within the group (for comparisons whose ratio matters)."""
        keys = [(group, *c.key) if group else c.key for c in cmds]
        todo = [Stat(c, group) for c, k in zip(cmds, keys, strict=True) if k not in self.cache]
        for stat, key in zip(todo, [k for k in keys if k not in self.cache], strict=True):
            self.cache[key] = stat
        if todo:
            self.wait_quiet()
        inputs = sorted(
            {
                Path(arg)
                for stat in todo
                for arg in stat.cmd.argv
                if arg.startswith(str(self.workdir))
                and Path(arg) != stat.cmd.fresh
                and Path(arg).is_file()
            }
        )
        if self.pinned is not None:
            self.pinned.pin(inputs)
        try:
            for stat in todo:
                self._run(stat, record=False)
            for _ in range(self.runs):
                for stat in todo:
                    if stat.error is None:
                        self._run(stat, record=True)
        finally:
            if self.pinned is not None:
                self.pinned.release()
        for stat in todo:
            shown = f"{stat.median:.3f} s, {stat.peak:.0f} MiB" if stat.ok else "FAILED"
            log(f"  {shown:>22}  {self.show(stat.cmd)}")
        return [self.cache[k] for k in keys]

    def _run(self, stat: Stat, record: bool) -> None:
        """A timed run during which other processes kept > NOISY cores busy, or which read
        > COLD_MIB from the disk (its input had been evicted from the page cache), is redone
        (at most `retries` times; then the last attempt is kept and counted as unclean)."""
        for attempt in range(self.retries + 1):
            try:
                sample = run_once(stat.cmd)
            except Failure as exc:
                stat.error = str(exc)
                return
            if not record or sample.clean or attempt == self.retries:
                break
            stat.retried += 1
            time.sleep(0.5)
        if record:
            stat.samples.append(sample)

    def show(self, cmd: Cmd) -> str:
        return shlex.join(cmd.argv).replace(str(self.workdir), "$BENCH").replace(PY, "python")


# ----------------------------------------------------------------------------- rows


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


# ----------------------------------------------------------------------------- checks


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


# ----------------------------------------------------------------------------- report


def human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def compile_bytecode() -> str:
    """Compile clipcli's modules to bytecode first, as `pip install` does. An editable
    install under PYTHONDONTWRITEBYTECODE=1 (set on this sandbox) recompiles a dozen modules
    from source on every run instead: about 16 ms per command that an installed copy never
    pays. Returns the line for the report."""
    code = (
        "import clipcli, compileall, os, sys; "
        "sys.exit(not compileall.compile_dir(os.path.dirname(clipcli.__file__), quiet=1))"
    )
    ok = subprocess.run([PY, "-c", code], capture_output=True).returncode == 0
    env = (
        " (PYTHONDONTWRITEBYTECODE is set here)"
        if os.environ.get("PYTHONDONTWRITEBYTECODE")
        else ""
    )
    state = "compiled to bytecode before timing, as pip install does" if ok else "compile FAILED"
    return f"clipcli's modules: {state}{env}"


def machine() -> list[str]:
    import h5py
    import safetensors

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        ram = 0
    dirty = " (uncommitted changes in clipcli/)" if git("status", "--porcelain", "clipcli") else ""
    return [
        f"machine: {os.cpu_count()} cores ({cpu}), {human(ram)} RAM, {platform.system()} "
        f"{platform.release()}, {platform.machine()}",
        f"software: Python {platform.python_version()}, numpy {np.__version__}, "
        f"safetensors {safetensors.__version__}, h5py {h5py.__version__}",
        f"clipcli: git {git('rev-parse', '--short', 'HEAD')}{dirty}, "
        f"run as `{shlex.join(CLIPCLI)}`",
    ]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def loadavg(values: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in values)


def method(runs: int, pinned: Pinned | None) -> str:
    rss = "/usr/bin/time -f %M" if TIME else "a RUSAGE_CHILDREN ru_maxrss wrapper"
    if pinned is None:
        pin = "Input files are not pinned (--no-pin)."
    elif pinned.failed:
        pin = f"Pinning the input files into the page cache FAILED ({pinned.failed})."
    else:
        pin = (
            "Each group's input files are mmap'ed and mlock'ed by the harness while the group "
            "runs, so the page cache stays warm (the harness maps them, so they are not in the "
            "measured processes' RSS)."
        )
    return (
        f"whole processes; per command one warm-up run (page cache warm), then the median wall "
        f"time of {runs} runs, the commands of a group taking turns (interleaved); peak RSS = the "
        f"largest `{rss}` over those runs (file-backed pages count). Commands that write OUT "
        "(clipcli clip, cp, the naive script) get OUT deleted and `os.sync()` before every run, "
        "untimed, so each run writes a fresh file into a quiet page cache. "
        "`cp + sync` = `cp IN OUT && sync OUT`. " + pin
    )


def render(
    rows: Sequence[Row],
    file_rows: list[list[str]],
    results: list[tuple[str, bool, str]],
    bench: Bench,
    context: list[str],
    quick: bool,
) -> str:
    targets = [r for r in rows if not r.target.startswith("(info)")]
    met = sum(r.verdict == "MET" for r in targets)
    lines = ["# clipcli benchmark results", ""]
    if quick:
        lines += [
            "**Quick (smoke) run: the files are far too small for the targets to mean anything; "
            "start-up time dominates every row.**",
            "",
        ]
    lines += [f"- {line}" for line in context]
    stats = [st for st in bench.cache.values() if st.ok]
    redone = sum(st.retried for st in stats)
    loaded = sum(x.foreign > NOISY for st in stats for x in st.samples)
    cold = sum(x.disk > COLD_MIB for st in stats for x in st.samples)
    total = sum(len(st.samples) for st in stats)
    lines.append(
        f"- unclean runs: waited {bench.waited:.0f} s in all for other processes to go quiet "
        f"before groups; {redone} timed runs were redone because other processes kept more "
        f"than {NOISY} cores busy or the command read more than {COLD_MIB:g} MiB from the disk "
        f"(cold page cache); of the {total} kept runs, {loaded} still had such load and {cold} "
        "such disk reads"
    )
    lines += [
        "",
        f"## Results: {met} of {len(targets)} targets met",
        "",
        "ratio = clipcli time / baseline time (for RSS growth: peak RSS on the big file / on the "
        "small file). Rows whose target starts with (info) are diagnostics, not targets.",
        "",
        markdown(
            ["job", "clipcli", "baseline", "ratio", "target", "met?", "peak RSS"],
            [[r.job, r.ours, r.baseline, r.ratio, r.target, r.verdict, r.rss] for r in rows],
        ),
        "",
        "## Files",
        "",
        markdown(["file", "format", "dtype", "tensors × shape", "size", "bytes"], file_rows),
        "",
        "## Correctness checks (run once, before timing)",
        "",
        markdown(
            ["check", "result", "detail"],
            [[n, "ok" if ok else "FAILED", d] for n, ok, d in results],
        )
        if results
        else "(none for these sections)",
        "",
        "## Every command",
        "",
        f"`$BENCH` = the temp dir holding the generated files; `python` = `{PY}`. "
        "`other load` = CPU time the rest of the machine used during a run (from /proc/stat, "
        "minus the command's own CPU) / its wall time; `disk reads` = what the command read "
        "from the block device (`/usr/bin/time %I`), i.e. page-cache misses. A timed run with "
        f"more than {NOISY} cores of other load or {COLD_MIB:g} MiB of disk reads is redone, at "
        f"most {bench.retries} times; `unclean` counts the kept runs that still had either.",
        "",
    ]
    detail = []
    for s in bench.cache.values():
        shown = f"`{bench.show(s.cmd)}`" + (f" [{s.group} group]" if s.group else "")
        if s.ok:
            cpu = statistics.median(x.cpu for x in s.samples)
            unclean = sum(not x.clean for x in s.samples)
            foreign = max(x.foreign for x in s.samples)
            disk = max(x.disk for x in s.samples)
            detail.append(
                [shown, f"{s.median:.3f} s", f"{min(s.walls):.3f} s", f"{max(s.walls):.3f} s"]
                + [f"{cpu:.2f} s", f"{s.peak:.0f} MiB", f"{foreign:.2f}", f"{disk:.0f} MiB"]
                + [f"{s.retried} / {unclean}"]
            )
        else:
            detail.append([shown, "FAILED"] + ["-"] * 7)
    lines.append(
        markdown(
            ["command", "median", "min", "max", "CPU user+sys", "peak RSS"]
            + ["other load (max, cores)", "disk reads (max)", "redone / unclean"],
            detail,
        )
    )
    failures = [(bench.show(s.cmd), s.error) for s in bench.cache.values() if s.error]
    failures += [(name, text) for name, ok, text in results if not ok]
    if failures:
        lines += ["", "## Failures", ""]
        for cmd, err in failures:
            lines += [f"- `{cmd}`", "", "```", str(err), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small files (64 MiB / 16 MiB / 32 MiB), 3 runs: a smoke test",
    )
    parser.add_argument("--runs", type=int, help="timed runs per command (default 5; quick 3)")
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="generate checkpoints into DIR and reuse them on later runs",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="NAME",
        help=f"run only these sections: {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="don't mlock each group's input files into the page cache while it runs",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        metavar="S",
        help="before each group of commands, wait up to S seconds for other processes to "
        "go quiet (default 180; quick 0, and no runs are redone)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="write the report here (default: benchmarks/RESULTS.md for a full "
        "run of every section, nowhere otherwise)",
    )
    args = parser.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    sections = set(args.only or SECTIONS)
    output = args.output
    if output is None and not args.quick and not args.only:
        output = HERE / "RESULTS.md"

    workdir = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="clipcli-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    try:
        files = plan(workdir, args.quick)
        bytecode = compile_bytecode()
        log(bytecode)
        log(f"generating under {workdir}")
        generate(files)
        gen_seconds = time.perf_counter() - started
        results = checks(files, workdir, sections)
        max_wait = args.max_wait if args.max_wait is not None else (0 if args.quick else 180)
        bench = Bench(runs, workdir, max_wait, 0 if args.quick else RETRIES, not args.no_pin)
        nominal = human(files.fp32.n_tensors * files.fp32.largest_tensor_bytes)
        rows = run_sections(bench, files, sections, nominal)
        file_rows = [
            [ck.path.name, ck.kind, ck.dtype.lower(), ck_shape(ck), human(ck.size), f"{ck.size:,}"]
            for ck in files.all()
        ]
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()

    command = "python benchmarks/run.py" + "".join(
        [
            " --quick" if args.quick else "",
            f" --runs {args.runs}" if args.runs else "",
            f" --only {' '.join(args.only)}" if args.only else "",
        ]
    )
    context = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"command: `{command}` (total {time.perf_counter() - started:.0f} s, of which "
        f"generating the files {gen_seconds:.0f} s)",
        *machine(),
        bytecode,
        f"load average (1/5/15 min) before: {loadavg(load_before)}, after: {loadavg(load_after)}"
        " (other work on the machine skews timings; > 0.5 at the start deserves a re-run)",
        f"method: {method(runs, bench.pinned)}",
        f"sizes: {nominal} fp32, bf16 and fp16 files, the RSS-growth file "
        f"{human(files.fp32_small.n_tensors * files.fp32_small.largest_tensor_bytes)}, one "
        f"{human(files.single.largest_tensor_bytes)} tensor, a {human(files.tiny.size)} file; "
        "npz and HDF5 hold the same data and byte count as the big fp32 safetensors file (npz: "
        "np.savez layout, stored = uncompressed; HDF5: contiguous datasets), and their rows "
        "compare seconds per byte (the sizes differ by headers only).",
    ]
    report = render(rows, file_rows, results, bench, context, args.quick)
    print(report)
    if output is not None:
        output.write_text(report)
        log(f"wrote {output}")
    return 1 if "## Failures" in report else 0


if __name__ == "__main__":
    raise SystemExit(main())
