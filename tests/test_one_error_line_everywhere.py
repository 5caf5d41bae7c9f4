"""A failed run's stderr is its one `clipcli: error:` line, in every command: the notes and
warnings said before the failure (a pattern that matches nothing, training state left out,
a loss accepted) are held until the command has succeeded, then printed.

Each failure is a real fault met by a real process: a file truncated under the reader, a
signal, a full standard output (/dev/full), NaN where a norm is needed. The child stops
itself (SIGSTOP) at a known point, after the warning was said and before any data is
read; the test acts (truncates the file, sends the signal) and lets it go on (SIGCONT):
nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Run, assert_one_error_line
from handmade import write_safetensors

# The child: `main(ARGS)` with `MODULE.FUNCTION` made to stop the process before it runs.
CHILD = """
import importlib, os, signal, sys
from clipcli.cli.entry import main
module_name, function_name = sys.argv[1].rsplit(".", 1)
module = importlib.import_module(module_name)
original = getattr(module, function_name)
def stopped_first(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    return original(*args, **kwargs)
setattr(module, function_name, stopped_first)
sys.exit(main(sys.argv[2:]))
"""

MEASURING = "clipcli.jobs.pipeline.measure"
COMPARING = "clipcli.jobs.pipeline.compare"
LISTING = "clipcli.report.builders.ls_report"  # after ls has checked its patterns
NOTHING = "absent.*"  # matches no tensor: a warning
WARNED = f"clipcli: warning: --include '{NOTHING}' matches no tensor"


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")
    env.pop("CLIPCLI_DEBUG", None)
    return env


def _model(path: Path, value: float = 1.0) -> Path:
    tensors = {
        "layers.0.w": np.full((64, 64), value, np.float32),
        "layers.1.w": np.full((64, 64), 2.0, np.float32),
    }
    return write_safetensors(path, tensors)


def _header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _stopped_at(point: str, args: list[str], act: Callable[[int], None]) -> Run:
    """Run clipcli ARGS in a child that stops itself when `point` is called; `act(pid)`
    while it is stopped, then let it go on."""
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, point, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    ) as child:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "the child ended before reaching the stop point"
        act(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=300)
        return Run(child.returncode, out, err)


def _run(args: list[str], stdout: int | None = subprocess.PIPE) -> Run:
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env=_env(),
    )
    return Run(done.returncode, done.stdout or "", done.stderr)


def _to_dev_full(args: list[str]) -> Run:
    with open("/dev/full", "w") as full:
        return _run(args, stdout=full.fileno())


def _signal(signum: int) -> Callable[[int], None]:
    return lambda pid: os.kill(pid, signum)


def _truncate(path: Path) -> Callable[[int], None]:
    end = _header_end(path)

    def truncate(pid: int) -> None:  # noqa: ARG001 - the child waits, stopped
        os.truncate(path, end)  # the header stays, the data is gone

    return truncate


def _include(*extra: str) -> list[str]:
    return ["--include", "layers.*", "--include", NOTHING, *extra]


# ------------------------------------------------------------------ ls


def test_ls_warning_then_full_stdout_is_one_line(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _to_dev_full(["ls", str(src), *_include()])
    assert done.code == 5
    assert_one_error_line(done.stderr, "standard output")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_ls_warning_then_signal_is_one_line(tmp_path: Path, signum: int, code: int) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _stopped_at(LISTING, ["ls", str(src), *_include()], _signal(signum))
    assert done.code == code
    assert_one_error_line(done.stderr, "interrupted" if code == 130 else "SIGTERM")
    assert done.stdout == ""


def test_ls_success_still_warns(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _run(["ls", str(src), *_include()])
    assert done.code == 0
    assert done.stderr.splitlines() == [WARNED]
    assert "layers.0.w" in done.stdout


# ------------------------------------------------------------------ norms


def test_norms_warning_then_file_truncated_is_one_line(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _stopped_at(MEASURING, ["norms", str(src), *_include()], _truncate(src))
    assert done.code == 3
    assert_one_error_line(done.stderr, "m.safetensors")
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [
        (signal.SIGTERM, 143, "SIGTERM"),
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGHUP, 129, "SIGHUP"),
    ],
)
def test_norms_warning_then_signal_is_one_line(
    tmp_path: Path, signum: int, code: int, said: str
) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _stopped_at(MEASURING, ["norms", str(src), *_include()], _signal(signum))
    assert done.code == code
    assert_one_error_line(done.stderr, said)
    assert done.stdout == ""


def test_norms_warning_then_full_stdout_is_one_line(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _to_dev_full(["norms", str(src), *_include()])
    assert done.code == 5
    assert_one_error_line(done.stderr, "standard output")


def test_norms_success_still_warns(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    done = _run(["norms", str(src), *_include()])
    assert done.code == 0
    assert done.stderr.splitlines() == [WARNED]


def test_norms_fail_above_is_a_verdict_its_warnings_come_first(tmp_path: Path) -> None:
    """--fail-above is no failure (README: exit 1, the command ran): its warnings are
    printed, then the verdict's line, last."""
    src = _model(tmp_path / "m.safetensors")
    done = _run(["norms", str(src), *_include("--fail-above", "1")])
    assert done.code == 1
    lines = done.stderr.splitlines()
    assert lines[0] == WARNED
    assert lines[1].startswith("clipcli: global norm ")
    assert "exceeds --fail-above 1" in lines[1]
    assert len(lines) == 2


# ------------------------------------------------------------------ diff


def test_diff_warning_then_file_truncated_is_one_line(tmp_path: Path) -> None:
    a = _model(tmp_path / "a.safetensors")
    b = _model(tmp_path / "b.safetensors", 3.0)
    done = _stopped_at(COMPARING, ["diff", str(a), str(b), *_include()], _truncate(b))
    assert done.code == 3
    assert_one_error_line(done.stderr, "b.safetensors")
    assert done.stdout == ""


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_diff_warning_then_signal_is_one_line(tmp_path: Path, signum: int, code: int) -> None:
    a = _model(tmp_path / "a.safetensors")
    b = _model(tmp_path / "b.safetensors", 3.0)
    done = _stopped_at(COMPARING, ["diff", str(a), str(b), *_include()], _signal(signum))
    assert done.code == code
    assert_one_error_line(done.stderr, "interrupted" if code == 130 else "SIGTERM")


def test_diff_warning_then_full_stdout_is_one_line(tmp_path: Path) -> None:
    a = _model(tmp_path / "a.safetensors")
    b = _model(tmp_path / "b.safetensors", 3.0)
    done = _to_dev_full(["diff", str(a), str(b), *_include()])
    assert done.code == 5
    assert_one_error_line(done.stderr, "standard output")


def test_diff_success_and_verdict_still_warn(tmp_path: Path) -> None:
    a = _model(tmp_path / "a.safetensors")
    b = _model(tmp_path / "b.safetensors", 3.0)
    done = _run(["diff", str(a), str(b), *_include()])
    assert done.code == 0
    assert done.stderr.splitlines() == [WARNED]
    over = _run(["diff", str(a), str(b), *_include("--fail-above", "0.5")])
    assert over.code == 1
    lines = over.stderr.splitlines()
    assert lines[0] == WARNED
    assert "exceeds --fail-above 0.5" in lines[1]
    assert len(lines) == 2


# ------------------------------------------------------------------ clip and convert


def test_clip_warning_then_nan_refused_is_one_line(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors", float("nan"))
    out = tmp_path / "out.safetensors"
    done = _run(["clip", "--global", "5", str(src), str(out), *_include()])
    assert done.code == 4
    assert_one_error_line(done.stderr)
    assert not out.exists()


def test_clip_warning_then_report_to_full_stdout_is_one_line(tmp_path: Path) -> None:
    """OUT is committed, the report cannot be written: exit 5, and the one line says OUT
    is whole (the warning, said once the clip succeeded, came before it)."""
    src = _model(tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    done = _to_dev_full(["clip", "--global", "5", str(src), str(out), *_include()])
    assert done.code == 5
    assert_one_error_line(done.stderr, "was written and is complete")
    assert out.exists()


def test_clip_warning_then_signal_is_one_line(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    args = ["clip", "--global", "5", str(src), str(out), *_include()]
    done = _stopped_at(MEASURING, args, _signal(signal.SIGTERM))
    assert done.code == 143
    assert_one_error_line(done.stderr, "SIGTERM")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_clip_success_still_warns(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    done = _run(["clip", "--global", "5", str(src), str(out), *_include()])
    assert done.code == 0
    assert done.stderr.splitlines() == [WARNED]


def _lossy_convert(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """safetensors metadata to .npz: dropped, with --allow-lossy a warning."""
    src = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)}, {"k": "v"})
    out = tmp_path / "out.npz"
    return src, out, ["convert", "--allow-lossy", str(src), str(out)]


def test_convert_warning_then_report_to_full_stdout_is_one_line(tmp_path: Path) -> None:
    _, out, args = _lossy_convert(tmp_path)
    done = _to_dev_full(args)
    assert done.code == 5
    assert_one_error_line(done.stderr, "was written and is complete")
    assert out.exists()


def test_convert_warning_then_signal_is_one_line(tmp_path: Path) -> None:
    _, out, args = _lossy_convert(tmp_path)
    done = _stopped_at("clipcli.jobs.pipeline.write_tensors", args, _signal(signal.SIGTERM))
    assert done.code == 143
    assert_one_error_line(done.stderr, "SIGTERM")
    assert not out.exists()


def test_convert_success_still_warns(tmp_path: Path) -> None:
    _, out, args = _lossy_convert(tmp_path)
    done = _run(args)
    assert done.code == 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("clipcli: warning: dropped from ")


# ------------------------------------------------------------------ the library face


def _truncated_first(monkeypatch: pytest.MonkeyPatch, function: str, path: Path) -> None:
    """`clipcli.jobs.pipeline.FUNCTION` finds `path` truncated to its header when it runs."""
    from clipcli.jobs import pipeline

    original = getattr(pipeline, function)
    end = _header_end(path)

    def truncated(*args: object, **kwargs: object) -> object:
        os.truncate(path, end)
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, function, truncated)


def test_api_measure_and_diff_say_nothing_when_they_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As clip and convert: a library caller's notify hears a job's lines only once it
    has succeeded."""
    from clipcli import api
    from clipcli.errors import ClipcliError
    from clipcli.jobs.selection import Selection

    chosen = Selection(("layers.*", NOTHING), ())
    a = _model(tmp_path / "a.safetensors")
    b = _model(tmp_path / "b.safetensors", 3.0)
    said: list[tuple[str, str]] = []

    def heard(level: str, text: str) -> None:
        said.append((level, text))

    api.measure(a, chosen, notify=heard)
    api.diff(a, b, chosen, notify=heard)
    assert len(said) == 2
    assert all(level == "warning" and NOTHING in text for level, text in said)

    said.clear()
    _truncated_first(monkeypatch, "measure", a)
    with pytest.raises(ClipcliError) as measured:
        api.measure(a, chosen, notify=heard)
    _truncated_first(monkeypatch, "compare", b)
    with pytest.raises(ClipcliError) as compared:
        api.diff(_model(tmp_path / "c.safetensors"), b, chosen, notify=heard)
    assert measured.value.exit_code == compared.value.exit_code == 3
    assert said == []


# ------------------------------------------------------------------ on a terminal


def _terminal_lines(args: list[str], stdout: int) -> tuple[int, list[str]]:
    """`python -m clipcli ARGS` with stderr on a real pseudo-terminal (the progress bar
    drawn): its exit code and the lines the terminal received that hold no control code."""
    primary, secondary = pty.openpty()
    with subprocess.Popen(
        [sys.executable, "-m", "clipcli", *args], stdout=stdout, stderr=secondary, env=_env()
    ) as child:
        os.close(secondary)
        received = b""
        while True:
            ready, _, _ = select.select([primary], [], [], 120)
            assert ready, "no output from the child in 120 s"
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            received += chunk
        code = child.wait()
    os.close(primary)
    text = received.decode("utf-8").replace("\r\n", "\n")
    return code, [line for line in text.split("\n") if line and "\x1b" not in line]


def test_on_a_terminal_a_failure_is_its_error_line_alone(tmp_path: Path) -> None:
    """The bar is drawn and erased; the warning is dropped; the error line starts a line of
    its own, after the codes that erased the bar."""
    src = _model(tmp_path / "m.safetensors")
    with open("/dev/full", "w") as full:
        code, lines = _terminal_lines(["norms", str(src), *_include()], full.fileno())
    assert code == 5
    assert len(lines) == 1
    assert lines[0].startswith("clipcli: error: standard output")


def test_on_a_terminal_a_success_warns_after_the_bar(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    code, lines = _terminal_lines(["norms", str(src), *_include()], subprocess.DEVNULL)
    assert code == 0
    assert lines == [WARNED]


# ------------------------------------------------------------------ a model directory


def _quantized_config_directory(root: Path) -> Path:
    """Two shards, and a config.json declaring a quantization no scheme reads (a warning:
    norms are of the stored tensors)."""
    root.mkdir()
    weight_map = {}
    for i in (1, 2):
        shard = f"model-0000{i}-of-00002.safetensors"
        tensors = {f"layers.{i}.w": np.full((64, 64), float(i), np.float32)}
        write_safetensors(root / shard, tensors)
        weight_map[f"layers.{i}.w"] = shard
    index = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"quantization_config": {"quant_method": "hqq"}}
    (root / "config.json").write_text(json.dumps(config))
    return root


QUANTIZED_WARNING = "clipcli: warning: config.json declares quantization_config"


def test_directory_warning_then_last_shard_truncated_is_one_line(tmp_path: Path) -> None:
    model = _quantized_config_directory(tmp_path / "model")
    last = model / "model-00002-of-00002.safetensors"
    done = _stopped_at(MEASURING, ["norms", str(model)], _truncate(last))
    assert done.code == 3
    assert_one_error_line(done.stderr, "model-00002-of-00002.safetensors")
    ok = _run(["norms", str(_quantized_config_directory(tmp_path / "again"))])
    assert ok.code == 0
    assert len(ok.stderr.splitlines()) == 1
    assert ok.stderr.startswith(QUANTIZED_WARNING)
