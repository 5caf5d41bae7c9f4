"""A model directory's shards written side by side (issue 20, "shards in parallel").

`clip` and `convert` of a directory write its shards in several threads at once
(pipeline._write_parts): the files, the index and the report must be those of the run in
order, byte for byte, and a failure or a signal in any shard must leave nothing behind.
The shards are built here by hand (safetensors' own format: 8-byte header length, JSON,
data) and by the official `safetensors.numpy.save_file`, and read back with it."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clipcli.formats.base import TensorInfo
from clipcli.formats.sharded.writer import ShardedWriter
from clipcli.jobs import pipeline
from clipcli.system import parallel

INDEX = "model.safetensors.index.json"


def _bf16_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of BF16 tensors written by hand from float32 values (their upper
    16 bits), as the format describes it; the official numpy API cannot save bf16."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, values in tensors.items():
        raw = (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(values.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _model_dir(path: Path, shards: int = 5, rows: int = 256) -> Path:
    """`shards` shards of mixed dtypes: float32, float16 and bf16 weights, many small
    tensors, an integer tensor; an index and a config beside them."""
    rng = np.random.default_rng(20)
    path.mkdir()
    weight_map: dict[str, str] = {}
    total = 0
    tensors: dict[str, np.ndarray]
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        prefix = f"model.layers.{number}"
        if number % 3 == 2:
            tensors = {
                f"{prefix}.mlp.weight": rng.standard_normal((rows, 512), dtype=np.float32),
                f"{prefix}.norm.weight": rng.standard_normal((512,), dtype=np.float32),
            }
            _bf16_shard(path / name, tensors)
            total += sum(t.size * 2 for t in tensors.values())
        else:
            dtype = np.float32 if number % 3 == 0 else np.float16
            tensors = {
                f"{prefix}.attn.weight": rng.standard_normal((rows, 512)).astype(dtype),
                f"{prefix}.positions": np.arange(64, dtype=np.int64),
            }
            for k in range(40):  # small ones, written together
                tensors[f"{prefix}.small.{k}.bias"] = rng.standard_normal(8).astype(dtype)
            save_file(tensors, str(path / name), metadata={"format": "pt"})
            total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    return path


def _cli(
    *args: str | Path, threads: int, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CLIPCLI_THREADS=str(threads))
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ the same bytes


@pytest.mark.parametrize(
    "command",
    [
        ["clip", "--global", "1.0"],
        ["clip", "--global", "1e30"],
        ["clip", "--value", "0.5"],
        ["convert"],
    ],
)
def test_a_directory_is_written_the_same_with_1_and_4_threads(
    tmp_path: Path, command: list[str]
) -> None:
    """Every file (shards, index, config), the report on stdout (table and JSON) and
    stderr: the same whether the shards are written in order or four at a time."""
    src = _model_dir(tmp_path / "in")
    results = {}
    for threads in (1, 4):
        here = tmp_path / f"t{threads}"
        here.mkdir()
        out = here / "out"  # named the same from where it runs: the report shows it
        report = ["--format", "json"] if command[0] == "clip" else []
        argv: list[str | Path] = [command[0], src, "out", *command[1:], *report]
        done = _cli(*argv, threads=threads, cwd=here)
        assert done.returncode == 0, done.stderr
        results[threads] = (_files(out), done.stdout, done.stderr)
    assert results[1] == results[4]
    files = results[4][0]
    assert sorted(files) == sorted(_files(src))
    # The official reader takes each float32/float16 shard as written.
    for name in ("model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors"):
        loaded = load_file(str(tmp_path / "t4" / "out" / name))
        assert set(loaded) == set(load_file(str(src / name)))


def test_norms_of_a_directory_report_the_same_with_1_and_4_threads(tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "in")
    reports = [_cli("norms", src, "--format", "json", threads=t) for t in (1, 4)]
    assert reports[0].returncode == reports[1].returncode == 0, reports[0].stderr
    assert reports[0].stdout == reports[1].stdout
    names = [row["name"] for row in json.loads(reports[0].stdout)["tensors"]]
    assert len(names) == 4 * 42 + 2  # every tensor of the five shards


def test_the_shards_are_written_by_several_threads_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clipcli: Callable[..., Any]
) -> None:
    """Two shards' writers are open at the same moment, in two threads: the second part
    is begun while the first is still being written (a barrier both must reach; in order,
    the first would wait for the second forever: it times out instead and fails)."""
    src = _model_dir(tmp_path / "in")
    monkeypatch.setenv("CLIPCLI_THREADS", "4")
    barrier = threading.Barrier(2, timeout=60)
    threads: set[str] = set()
    real = ShardedWriter.part_writer

    def meeting(self: ShardedWriter, number: int) -> Any:
        threads.add(threading.current_thread().name)
        if number < 2:
            barrier.wait()
        return real(self, number)

    monkeypatch.setattr(ShardedWriter, "part_writer", meeting)
    done = clipcli("clip", src, tmp_path / "out", "--global", "1.0")
    assert done.returncode == 0, done.stderr
    assert len(threads) >= 2


# ------------------------------------------------------------------ how many at once


@pytest.mark.parametrize(
    ("workers", "parts", "slots"),
    [
        (1, 5, 1),  # one thread: in order
        (4, 1, 1),  # one shard: in order
        (4, 2, 2),
        (4, 5, 4),  # the threads cap the parts at once
        (32, 16, 16),  # at MAX_PARALLEL_PARTS
        (32, 17, 16),  # one past it
    ],
)
def test_parts_at_once_are_capped_by_threads_parts_and_the_shard_cap(
    monkeypatch: pytest.MonkeyPatch, workers: int, parts: int, slots: int
) -> None:
    assert pipeline.MAX_PARALLEL_PARTS == 16
    monkeypatch.setenv("CLIPCLI_THREADS", str(workers))
    infos = [TensorInfo(f"t{k}", np.dtype(np.float32), (1,), 4) for k in range(parts)]

    class Listing:
        pass

    reader: Any = Listing()
    reader.infos = infos
    assert pipeline._part_slots(reader, [[info] for info in infos]) == slots
    # Parts that are not the reader's tensors in order are written in order (and refused).
    assert pipeline._part_slots(reader, [[info] for info in reversed(infos)]) == 1


def test_threads_that_share_the_workers_keep_their_share_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memory budget holds whatever the shard count: `slots` threads sharing the
    workers each keep 2 * (workers // slots) chunks in flight, at most 2 per worker."""
    monkeypatch.setenv("CLIPCLI_THREADS", "8")
    assert parallel.worker_count() == 8
    with parallel.sharing(3):
        assert parallel.worker_count() == 2  # 8 // 3
    with parallel.sharing(8):
        assert parallel.worker_count() == 1  # inline
    with parallel.sharing(16):
        assert parallel.worker_count() == 1  # never none
    assert parallel.worker_count() == 8


# ------------------------------------------------------------------ failures leave nothing


def test_a_full_disk_in_a_later_shard_leaves_nothing(
    tmp_path: Path, mount_tmpfs: Callable[..., Path]
) -> None:
    """The output's file system has room for about two of five shards: the shards written
    at once fail where the disk fills (exit 5, one line), the others stop, and neither
    OUT nor any temp is left; the same directory fits on a bigger one."""
    src = _model_dir(tmp_path / "in", rows=1024)
    shard_bytes = max(p.stat().st_size for p in src.glob("*.safetensors"))
    small = mount_tmpfs("small", size=str(shard_bytes * 5 // 2))
    done = _cli("clip", src, small / "out", "--global", "1.0", threads=4)
    assert done.returncode == 5, done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("clipcli: error: ")
    assert os.listdir(small) == []
    big = mount_tmpfs("big", size=str(shard_bytes * 20))
    done = _cli("clip", src, big / "out", "--global", "1.0", threads=4)
    assert done.returncode == 0, done.stderr
    assert os.listdir(big) == ["out"]


# A `python -m clipcli` that stops itself (SIGSTOP) once the second shard's file exists
# (its writer is made, the file created in the staging directory), other shards possibly
# being written in other threads at that moment.
STOPPING_AT_SECOND_SHARD = """
import os, signal, sys
from clipcli.formats.sharded.writer import ShardedWriter
real = ShardedWriter.part_writer

def part_writer(self, number):
    writer = real(self, number)
    if number == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return writer

ShardedWriter.part_writer = part_writer
sys.argv[0] = "clipcli"
from clipcli.__main__ import run
run()
"""


@pytest.mark.parametrize("command", [["clip", "--global", "1.0"], ["convert"]])
def test_sigterm_while_shards_are_written_leaves_nothing(
    tmp_path: Path, command: list[str]
) -> None:
    src = _model_dir(tmp_path / "in", rows=1024)
    parent = tmp_path / "outs"
    parent.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPING_AT_SECOND_SHARD, command[0], str(src), str(parent / "out")]
        + command[1:],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, CLIPCLI_THREADS="4"),
    )
    _, status = os.waitpid(child.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        child.kill()
        pytest.fail(f"the run ended before its second shard (status {status})")
    staged = list(parent.rglob("*.safetensors"))
    assert any(p.name.startswith("model-00002") for p in staged)  # the known point
    os.kill(child.pid, signal.SIGTERM)
    os.kill(child.pid, signal.SIGCONT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, err
    assert err == "clipcli: error: terminated by SIGTERM; no output written\n"
    assert os.listdir(parent) == []
