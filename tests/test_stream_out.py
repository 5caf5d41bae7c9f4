"""`clip IN -` streams the clipped safetensors file to standard output (issue 11 item 9).

Outputs are read back with safetensors.numpy only; the streamed bytes are compared with
the same clip written to a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import RunCli
from expect import one_error_line
from safetensors.numpy import load, save_file


def clipcli(
    *args: str | Path, stdout: int | None = subprocess.PIPE
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        check=False,
        timeout=120,
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    path = tmp_path / "in.safetensors"
    tensors: dict[str, np.ndarray] = {
        "embed": rng.normal(size=(16, 8)).astype(np.float32),
        "bias": rng.normal(size=8).astype(np.float16),
        "steps": np.arange(3, dtype=np.int64),
    }
    save_file(tensors, str(path), metadata={"format": "np"})
    return path


@pytest.mark.slow  # two interpreters per case (~1 s each on a loaded machine)
@pytest.mark.parametrize("mode", [("--global", "1"), ("--value", "100")])
def test_stream_equals_the_file_output_byte_for_byte(
    tmp_path: Path, model: Path, mode: tuple[str, str]
) -> None:
    streamed = clipcli("clip", *mode, model, "-")
    assert streamed.returncode == 0, streamed.stderr
    assert b"changed" in streamed.stderr  # the report went to stderr, not into the file
    out = tmp_path / "out.safetensors"
    assert clipcli("clip", "-q", *mode, model, out).returncode == 0
    assert streamed.stdout == out.read_bytes()
    tensors = load(streamed.stdout)
    assert sorted(tensors) == ["bias", "embed", "steps"]
    np.testing.assert_array_equal(tensors["steps"], np.arange(3))


def test_stream_with_quiet_writes_only_the_file(model: Path) -> None:
    run = clipcli("clip", "-q", "--global", "1e9", model, "-")
    assert run.returncode == 0
    assert run.stderr == b""
    assert run.stdout == model.read_bytes()  # nothing over the limit: bit-identical


@pytest.mark.slow  # an interpreter per test: standard output must be real
def test_a_terminal_stdout_is_refused(model: Path) -> None:
    leader, follower = os.openpty()
    try:
        run = clipcli("clip", "--global", "1", model, "-", stdout=follower)
    finally:
        os.close(follower)
        os.close(leader)
    assert run.returncode == 2
    assert b"terminal" in run.stderr
    assert run.stderr.count(b"\n") == 1


@pytest.mark.slow  # an interpreter per test: standard output must be real
def test_other_formats_do_not_stream(tmp_path: Path) -> None:
    src = tmp_path / "m.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
    run = clipcli("clip", "--global", "1", src, "-")
    assert run.returncode == 2
    assert run.stdout == b""
    assert b"safetensors only" in run.stderr
    assert not (tmp_path / "-").exists()
    assert not Path("-").exists()


@pytest.mark.slow  # an interpreter per test: standard output must be real
def test_stdout_that_is_the_input_is_refused(model: Path) -> None:
    before = model.read_bytes()
    with open(model, "ab") as same:
        run = clipcli("clip", "--global", "1", model, "-", stdout=same.fileno())
    assert run.returncode == 2
    assert b"input" in run.stderr
    assert model.read_bytes() == before


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    """4 MiB of float32: far more than a pipe holds, so the writer meets a closed pipe."""
    path = tmp_path / "big.safetensors"
    save_file(
        {"w": np.random.default_rng(1).normal(size=(1024, 1024)).astype(np.float32)}, str(path)
    )
    return path


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_error_on_the_stream_is_exit_5_one_line(big_model: Path) -> None:
    """F13: standard output that fails (a full disk) is exit 5 (write failed), not 70."""
    with open("/dev/full", "wb") as full:
        run = clipcli("clip", "-q", "--global", "5", big_model, "-", stdout=full.fileno())
    assert run.returncode == 5, run.stderr
    lines = run.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "No space left on device" in lines[0]
    assert "cut short" in lines[0]


def test_a_reader_that_goes_away_mid_stream_is_never_exit_0(big_model: Path) -> None:
    """F14: `clip ... - | head -c 100`: the clipped file is cut short, so the run fails
    (exit 5, "standard output closed after N bytes"), unlike a report to a closed pipe."""
    process = subprocess.Popen(
        [sys.executable, "-m", "clipcli", "clip", "-q", "--global", "5", str(big_model), "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    assert len(process.stdout.read(100)) == 100
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 5, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "standard output closed after" in lines[0]


def test_input_changed_mid_stream_does_not_claim_nothing_was_written(tmp_path: Path) -> None:
    """F14: "no output written" is said of a staged file; on a stream that already carried
    bytes, the message says the stream was cut short after them."""
    from clipcli.errors import InputError
    from clipcli.formats.safetensors import SafetensorsStreamWriter
    from clipcli.output.stream_target import StdoutTarget

    class Sent:
        sent = 4096

    saved = SafetensorsStreamWriter.stream
    SafetensorsStreamWriter.stream = Sent()  # type: ignore[assignment]
    try:
        with pytest.raises(InputError) as caught, StdoutTarget(force=False, durable=False).stage():
            raise InputError(
                tmp_path / "in.safetensors", "changed while it was being read; no output written"
            )
    finally:
        SafetensorsStreamWriter.stream = saved
    message = str(caught.value)
    assert "no output written" not in message
    assert "cut short after 4096 bytes" in message


# ------------------------------------------------- issue 23, item 12: '-' as an input

STDIN_LINES = [
    ["ls", "-"],
    ["norms", "-"],
    ["clip", "--global", "1", "-", "o.safetensors"],
    ["convert", "-", "o.safetensors"],
    ["diff", "-", "m.safetensors"],
    ["diff", "m.safetensors", "-"],
]


@pytest.mark.parametrize("args", STDIN_LINES)
def test_standard_input_is_not_an_input(
    args: list[str], tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    done = run_main(*args)
    assert done.code == 2
    line = one_error_line(done.stderr)
    assert "reading a checkpoint from standard input is not supported" in line
    assert "write it to a file first" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("command", [["clip", "--global", "100"], ["convert"]])
def test_the_report_says_standard_output_not_dash(
    command: list[str], tmp_path: Path, run_subprocess: RunCli
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": np.full(3, 2.0, np.float32)}, source)
    done = run_subprocess(*command, source, "-")
    assert done.code == 0, done.stderr
    assert "wrote safetensors to standard output" in done.stderr
    assert "wrote -" not in done.stderr
    assert "wrote" not in done.stdout  # stdout is the safetensors file and nothing else
    header = json.loads(done.stdout[8 : 8 + int.from_bytes(done.stdout[:8].encode(), "little")])
    assert header["w"]["shape"] == [3]
