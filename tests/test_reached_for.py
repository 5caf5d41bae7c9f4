"""What users reached for (issue 23): `--json`, `-q` on the read-only commands, and `.npy`
files (read since issue 19). Reports are checked against numpy's own reading of the
file, and the --json report against the --format json one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from handmade import write_safetensors

from clipcli.cli.entry import main


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_safetensors(
        tmp_path / "m.safetensors",
        {"a": np.full(4, 3.0, np.float32), "b": np.ones(2, np.float32)},
    )


def run(argv: list[str | Path], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------ --json


@pytest.mark.parametrize(
    "argv",
    [
        lambda m, _o: ["ls", m],
        lambda m, _o: ["norms", m],
        lambda m, _o: ["diff", m, m],
        lambda m, o: ["clip", "--global", "1", "--dry-run", m, o],
    ],
)
def test_json_is_format_json(
    argv: object, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = argv(model, tmp_path / "o.safetensors")  # type: ignore[operator]
    code, spelled, _ = run([*line, "--format", "json"], capsys)
    assert code == 0
    code, short, _ = run([*line, "--json"], capsys)
    assert code == 0
    assert short == spelled
    json.loads(short)
    code, both, _ = run([*line, "--json", "--format", "json"], capsys)
    assert (code, both) == (0, spelled)


def test_json_report_holds_numpys_norm(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["norms", model, "--json"], capsys)
    assert code == 0
    from safetensors.numpy import load_file

    tensors = load_file(str(model))
    expected = math.sqrt(sum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors.values()))
    assert json.loads(out)["global_norm"] == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("other", ["csv", "jsonl"])
def test_json_with_another_format_is_refused(
    other: str, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["norms", model, "--json", "--format", other], capsys)
    assert (code, out) == (2, "")
    assert one_error_line(err) == (
        f"clipcli: error: --json is --format json; it cannot be --format {other} too"
    )


def test_json_through_the_quick_parser_and_typer_alike(model: Path) -> None:
    """The quick parser and Typer both take --json (the table test holds them together;
    here a real program run, as a shell does it)."""
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", "norms", str(model), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["tensors"][0]["name"] == "a"


# ------------------------------------------------------------------ -q


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (lambda m: ["ls", m], 0),
        (lambda m: ["norms", m], 0),
        (lambda m: ["norms", m, "--fail-above", "7"], 0),  # norm sqrt(38) = 6.16
        (lambda m: ["diff", m, m, "--fail-above", "0"], 0),
    ],
)
@pytest.mark.parametrize("spelling", ["-q", "--quiet"])
def test_quiet_prints_no_report(
    argv: object, code: int, spelling: str, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = argv(model)  # type: ignore[operator]
    assert run([*line, spelling], capsys) == (code, "", "")


def test_quiet_fail_above_still_decides_the_exit_code(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At the limit and past it: sqrt(38) is not above itself, it is above 6.16."""
    norm = math.sqrt(38.0)
    code, out, err = run(["norms", model, "-q", "--fail-above", repr(norm)], capsys)
    assert (code, out, err) == (0, "", "")
    code, out, err = run(["norms", model, "-q", "--fail-above", "6.16"], capsys)
    assert (code, out) == (1, "")
    assert err.startswith("clipcli: global norm 6.16441 exceeds --fail-above 6.16")
    b = write_safetensors(tmp_path / "b.safetensors", {"a": np.full(4, 3.0, np.float32)})
    code, out, _ = run(["diff", model, b, "-q", "--fail-above", "0"], capsys)
    assert (code, out) == (1, "")  # b has no tensor 'b'


def test_quiet_ls_still_refuses_a_malformed_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    code, out, err = run(["ls", bad, "-q"], capsys)
    assert (code, out) == (3, "")
    one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "asked"),
    [
        (lambda m: ["norms", m, "--format", "csv"], "--format csv"),
        (lambda m: ["ls", m, "--json"], "--json"),
        (lambda m: ["diff", m, m, "-f", "jsonl"], "--format jsonl"),
        (lambda m: ["norms", m, "--chart"], "--chart"),
    ],
)
def test_quiet_with_a_report_asked_for_is_refused(
    argv: object, asked: str, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = argv(model)  # type: ignore[operator]
    code, out, err = run([*line, "-q"], capsys)
    assert (code, out) == (2, "")
    assert one_error_line(err) == f"clipcli: error: --quiet prints no report; it cannot be {asked}"


def test_quiet_norms_still_writes_the_plot(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "p.svg"
    assert run(["norms", model, "-q", "--plot", picture], capsys) == (0, "", "")
    assert picture.read_bytes().lstrip().startswith(b"<?xml")


# ------------------------------------------------------------------ .npy


def test_npy_is_read_as_one_tensor_named_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 19 changed this: a .npy file, once refused with a hint to make an npz of it, is
    now read (formats.npy), its one tensor named "array"; the norm is numpy's."""
    monkeypatch.chdir(tmp_path)
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save("w.npy", weight)
    code, out, err = run(["ls", "w.npy", "--json"], capsys)
    assert (code, err) == (0, "")
    assert [(t["name"], t["shape"]) for t in json.loads(out)["tensors"]] == [("array", [2, 3])]
    code, out, err = run(["norms", "w.npy", "--json"], capsys)
    assert (code, err) == (0, "")
    assert json.loads(out)["global_norm"] == pytest.approx(
        math.sqrt(float(np.sum(weight.astype(np.float64) ** 2))), rel=1e-15
    )


def test_npy_under_another_name_is_known_by_its_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "w.npy", np.ones(3))
    disguised = tmp_path / "w.npz"
    (tmp_path / "w.npy").rename(disguised)
    code, _, err = run(["ls", disguised], capsys)
    assert code == 3
    # Issue 19: .npy is a format now, so the content is named as any other format's is.
    assert one_error_line(err).endswith("extension says npz but the content is npy")
