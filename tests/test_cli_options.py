"""Options either act or are refused before any data is read, with exit 2 (issue 12,
item 2). "Before any data is read" is checked with an input that does not exist: a refusal
that came after opening it would be exit 3."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import RunCli
from expect import one_error_line
from handmade import small_model, write_safetensors
from layouts import bert_like

from clipcli.cli.entry import main

MISSING = "no-such-model.safetensors"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """Weights of distinct norms, and an int64 buffer whose norm beats every weight."""
    rng = np.random.default_rng(5)
    tensors: dict[str, np.ndarray] = {
        "bert.embeddings.position_ids": np.arange(512, dtype=np.int64)[None],  # norm ~6,678
        **{
            f"bert.encoder.layer.{i}.output.dense.weight": (
                rng.standard_normal((4, 4)) * (i + 1)
            ).astype(np.float32)
            for i in range(5)
        },
    }
    return write_safetensors(tmp_path / "m.safetensors", tensors)


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--chart", "--format", "json"], "--chart"),
        (["--chart", "--format", "csv"], "--chart"),
        (["--limit", "3"], "--limit"),
        (["--limit", "nan", "--chart"], "--limit"),
        (["--fail-above", "nan"], "--fail-above"),
        (["--plot", "p.txt"], ".png or .svg"),
        (["--group-by", "("], "--group-by"),
    ],
)
def test_refused_before_any_data_is_read(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "norms", MISSING, *argv)
    assert code == 2
    assert out == ""
    assert says in one_error_line(err)


def test_diff_fail_above_nan_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "diff", MISSING, MISSING, "--fail-above", "nan")
    assert code == 2
    assert "--fail-above" in one_error_line(err)


def test_fail_above_exactly_at_the_global_norm_passes(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = _run(capsys, "norms", model, "--format", "json")
    g = json.loads(out)["global_norm"]
    assert _run(capsys, "norms", model, "--fail-above", repr(g))[0] == 0
    assert _run(capsys, "norms", model, "--fail-above", repr(float(np.nextafter(g, 0))))[0] == 1


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "table"])
def test_top_with_group_by(model: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "norms", model, "--group-by", "layer", "--top", "2", "--sort", "norm",
        "--format", fmt,
    )  # fmt: skip
    assert code == 0
    if fmt == "json":
        groups = [g["group"] for g in json.loads(out)["groups"]]
    elif fmt == "jsonl":
        groups = [json.loads(line)["group"] for line in out.splitlines()]
    elif fmt == "csv":
        groups = [row[0] for row in list(csv.reader(io.StringIO(out)))[1:]]
    else:
        groups = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    # the two largest layers; the int64 buffer is in no group
    assert groups == ["bert.encoder.layer.4", "bert.encoder.layer.3"]


def test_sort_norm_top_ranks_what_the_global_norm_counts(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = _run(capsys, "norms", model, "--sort", "norm", "--top", "3", "--format", "json")
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names == [f"bert.encoder.layer.{i}.output.dense.weight" for i in (4, 3, 2)]


def test_chart_draws_exactly_the_listed_rows(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, chart, _ = _run(capsys, "norms", model, "--sort", "norm", "--top", "3", "--chart")
    bars = chart.splitlines()[1:]
    assert len(bars) == 3
    assert [line.split()[0] for line in bars] == [
        f"bert.encoder.layer.{i}.output.dense.weight" for i in (4, 3, 2)
    ]
    # In file order the buffer is listed: it is drawn too, with the "not counted" glyph.
    _, chart, _ = _run(capsys, "norms", model, "--top", "2", "--chart")
    lines = chart.splitlines()
    assert "░" in lines[1]
    assert "█" in lines[2]
    assert lines[3] == "░ not in the global norm"


def test_plot_over_an_existing_file_needs_force(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "p.png"
    picture.write_bytes(b"mine")
    code, out, err = _run(capsys, "norms", MISSING, "--plot", picture)
    assert code == 2  # refused before reading: MISSING is never opened
    assert "--force" in one_error_line(err)
    assert out == ""
    assert picture.read_bytes() == b"mine"
    code, _, err = _run(capsys, "norms", model, "--plot", picture, "--force")
    assert (code, err) == (0, "")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "p.png"]  # no temp


def test_plot_into_a_missing_directory_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = _run(capsys, "norms", MISSING, "--plot", tmp_path / "nowhere" / "p.png")
    assert code == 5
    assert "does not exist" in one_error_line(err)


def test_chart_limit_exactly_at_a_norm_is_not_over(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = _run(capsys, "norms", model, "--sort", "norm", "--format", "json")
    largest = json.loads(out)["tensors"][0]["norm"]  # a weight: ranked first
    _, chart, _ = _run(capsys, "norms", model, "--chart", "--limit", repr(largest))
    assert chart.splitlines()[-1].startswith("limit ")
    assert chart.splitlines()[-1].endswith(": 0 of 5 over")  # the int64 buffer never counts
    below = repr(float(np.nextafter(largest, 0)))
    _, chart, _ = _run(capsys, "norms", model, "--chart", "--limit", below)
    assert chart.splitlines()[-1].endswith(": 1 of 5 over")


@pytest.mark.parametrize(
    "extra",
    [
        ["--chart", "--limit", "inf"],
        ["--chart", "--limit", "-1"],
        ["--chart", "--limit", "0"],
        ["--force"],
        ["--group-by", "layer", "--sort", "size"],
    ],
)
def test_options_that_cannot_act_are_refused_before_reading(
    tmp_path: Path, extra: list[str]
) -> None:
    """Pointed at a FIFO: reading it would hang, so exit 2 proves nothing was read."""
    import os

    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    assert main(["norms", str(fifo), *extra]) == 2


def test_the_smallest_positive_limit_is_accepted(tmp_path: Path) -> None:
    src = small_model(tmp_path)
    assert main(["norms", str(src), "--chart", "--limit", "5e-324"]) == 0


def test_quiet_with_a_report_format_is_refused(tmp_path: Path) -> None:
    src = small_model(tmp_path)
    out = tmp_path / "o.safetensors"
    assert main(["clip", "-q", "--format", "json", "--global", "1", str(src), str(out)]) == 2
    assert not out.exists()
    assert main(["clip", "-q", "--global", "1", str(src), str(out)]) == 0


# ------------------------------------------------ issue 23, item 14: what -q silences
# The README's stream rules: reports on stdout, diagnostics on stderr. -q silences the
# report; a note (what was left out) is a diagnostic and stays, and --help says so.


def test_quiet_convert_prints_no_report_and_keeps_the_diagnostics(
    tmp_path: Path, run_main: RunCli
) -> None:
    """llama-tiny into one file with --allow-lossy: a warning (index metadata dropped) and
    a note (config.json left out) on stderr; -q drops the 'wrote' line only."""
    model = bert_like(tmp_path / "llama-tiny", {"total_flops": 7})
    loud = run_main("convert", model, tmp_path / "a.safetensors", "--allow-lossy")
    assert loud.code == 0, loud.stderr
    assert loud.stdout.startswith("wrote ")
    quiet = run_main("convert", model, tmp_path / "b.safetensors", "--allow-lossy", "-q")
    assert quiet.code == 0
    assert quiet.stdout == ""
    assert quiet.stderr == loud.stderr.replace("a.safetensors", "b.safetensors")
    lines = quiet.stderr.splitlines()
    assert [line.split(":")[1] for line in lines] == [" warning", " note"]
