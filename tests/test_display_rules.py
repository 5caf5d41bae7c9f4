"""What a person sees (issue 23, items 3, 5, 6, 10, 11 and 15): rows in natural name order
in every command and format, with --sort/--top on clip and diff too; narrow tables that
hide constant columns first; a short training-state note wrapped at word boundaries on a
terminal; a progress bar that reads without colour; --plot that says what it wrote and
summarises what the global norm counts; --chart bars that shrink before names are cut.

References share no code with clipcli: name order from int() of each digit run, norms
from numpy's float64 np.linalg.norm, JSON/CSV parsed by the standard library.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import write_safetensors
from rich.cells import cell_len

from clipcli.cli.entry import main
from clipcli.report import Column, Report
from clipcli.report.chart import BAR_MIN_WIDTH, render_chart
from clipcli.report.table import render_table

GOLDEN = Path(__file__).resolve().parent / "golden"
WIDTHS = (60, 80, 120)

# Stored in text order, as safetensors and h5py store names: layers.10 before layers.2.
NAMES = (
    "model.embed.weight",
    "model.layers.0.attention.query.weight",
    "model.layers.1.attention.query.weight",
    "model.layers.10.attention.query.weight",
    "model.layers.2.attention.query.weight",
    "model.layers.2.mlp.down.bias",
    "model.norm.weight",
)


def reference_order(names: Any) -> list[str]:
    """Natural order computed independently: digit runs compared as integers."""
    return sorted(
        names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)]
    )


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(23)
    return {
        name: (rng.standard_normal((4, 8) if "weight" in name else 8) * (i + 1)).astype(np.float32)
        for i, name in enumerate(NAMES)
    }


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """m.safetensors (every tensor floating point and nonzero: a global clip changes them
    all) and h.safetensors (one tensor halved), in the current directory so that titles
    are the same on every machine."""
    tensors = _tensors()
    write_safetensors(tmp_path / "m.safetensors", tensors)
    tensors["model.layers.10.attention.query.weight"] *= 0.5
    write_safetensors(tmp_path / "h.safetensors", tensors)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "m.safetensors"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr()


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} differs (tests/test_cli_tables.py)"


def _norm(array: np.ndarray) -> float:
    return float(np.linalg.norm(array.astype(np.float64).ravel()))


# ------------------------------------------------------------------ item 3: row order

COMMANDS = {
    "ls": ["ls", "m.safetensors"],
    "norms": ["norms", "m.safetensors"],
    "clip": ["clip", "--global", "1", "--dry-run", "m.safetensors", "o.safetensors"],
    "diff": ["diff", "m.safetensors", "h.safetensors"],
}


@pytest.mark.usefixtures("model")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_natural_order_is_the_default_in_every_command_and_format(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert list(NAMES) != reference_order(NAMES)  # the file's order is text order
    out, _ = _run(capsys, *COMMANDS[command], "--format", "json")
    report = json.loads(out)
    rows = report["tensors"]
    assert [r["name"] for r in rows] == reference_order(NAMES)
    out, _ = _run(capsys, *COMMANDS[command], "--format", "csv")
    assert [r[0] for r in list(csv.reader(io.StringIO(out)))[1:]] == reference_order(NAMES)
    out, _ = _run(capsys, *COMMANDS[command], "--format", "jsonl")
    assert [json.loads(line)["name"] for line in out.splitlines()] == reference_order(NAMES)
    out, _ = _run(capsys, *COMMANDS[command], "--sort", "file", "--format", "json")
    assert [r["name"] for r in json.loads(out)["tensors"]] == list(NAMES)


@pytest.mark.usefixtures("model")
def test_chart_rows_come_in_natural_order(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = _run(capsys, "norms", "m.safetensors", "--chart")
    rows = [line.split()[0] for line in out.splitlines()[1:] if line.startswith(" ")]
    assert rows == reference_order(NAMES)


def _ranked(norms: dict[str, float]) -> list[str]:
    return sorted(norms, key=lambda n: -norms[n])


@pytest.mark.usefixtures("model")
def test_clip_sort_norm_ranks_the_norms_before_the_clip(
    capsys: pytest.CaptureFixture[str],
) -> None:
    norms = {n: _norm(a) for n, a in _tensors().items()}
    out, _ = _run(capsys, *COMMANDS["clip"], "--sort", "norm", "--format", "json")
    rows = json.loads(out)["tensors"]
    assert [r["name"] for r in rows] == _ranked(norms)
    for row in rows:
        assert row["norm_before"] == pytest.approx(norms[row["name"]], rel=1e-12)
    out, _ = _run(capsys, *COMMANDS["clip"], "--sort", "size", "--format", "json")
    sizes = [_tensors()[r["name"]].nbytes for r in json.loads(out)["tensors"]]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.usefixtures("model")
def test_diff_sort_norm_ranks_the_difference(capsys: pytest.CaptureFixture[str]) -> None:
    a = _tensors()
    b = dict(a)
    b["model.layers.10.attention.query.weight"] = a["model.layers.10.attention.query.weight"] * 0.5
    out, _ = _run(capsys, *COMMANDS["diff"], "--sort", "norm", "--top", "1", "--format", "json")
    (row,) = json.loads(out)["tensors"]
    assert row["name"] == "model.layers.10.attention.query.weight"
    want = _norm(a[row["name"]] - b[row["name"]])
    assert row["diff_norm"] == pytest.approx(want, rel=1e-12)


@pytest.mark.usefixtures("model")
@pytest.mark.parametrize("command", ["clip", "diff"])
@pytest.mark.parametrize("top", [len(NAMES) - 1, len(NAMES), len(NAMES) + 1])
def test_top_on_clip_and_diff_at_and_past_the_row_count(
    command: str, top: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """--top N keeps the first N rows in every format; the table says so only when rows
    were left out (N one under the row count), not at the count or past it."""
    out, _ = _run(capsys, *COMMANDS[command], "--top", str(top), "--format", "json")
    assert [r["name"] for r in json.loads(out)["tensors"]] == reference_order(NAMES)[:top]
    out, _ = _run(capsys, *COMMANDS[command], "--top", str(top))
    said = f"showing {len(NAMES) - 1} of {len(NAMES)} tensors (--top {top})"
    assert (said in out) is (top < len(NAMES)), out


# ------------------------------------------------------------------ item 5: narrow tables


@pytest.mark.usefixtures("model")
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    ("case", "argv"),
    [
        ("clip-all-changed", COMMANDS["clip"]),
        ("norms-sort-norm-top", ["norms", "m.safetensors", "--sort", "norm", "--top", "5"]),
    ],
)
def test_narrow_tables_hide_constant_columns_first(
    case: str,
    argv: list[str],
    width: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    out, _ = _run(capsys, *argv)
    _check_golden(f"{case}.{width}.txt", out)
    assert "(all )" not in out
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert all(cell_len(line) <= width for line in table)
    header = table[1]
    # changed (yes on every row), global (yes) and role (weight): never kept while a
    # name is cut; said once with their one value.
    for title, value in (("changed", "yes"), ("global", "yes"), ("role", "weight")):
        if any(f"{title} (all {value})" in line for line in out.splitlines()):
            assert f" {title} " not in header
    if "…" in out:
        for title in ("changed", "global", "role", "nonfinite"):
            assert f" {title} " not in header, (title, out)


def _report(rows: list[tuple[Any, ...]]) -> Report:
    return Report(
        "t",
        (
            Column("name", "tensor"),
            Column("kept", "kept"),
            Column("note", "note"),
            Column("n", "n", numeric=True),
        ),
        tuple(rows),
        drop_order=("n",),
    )


def test_a_constant_column_goes_before_a_useful_one_and_an_empty_one_unsaid() -> None:
    rows = [("x" * 30, True, "", 1), ("y" * 30, True, "", 22)]
    out = io.StringIO()
    render_table(_report(rows), out, 40)  # name 30 + n 2 + borders 7 = 39
    text = out.getvalue()
    assert " n " in text.splitlines()[2]
    assert "kept (all yes)" in text
    assert "note" not in text  # empty on every row: nothing to say
    assert "x" * 30 in text  # no name cut


def test_constant_means_two_rows_or_more() -> None:
    """At the limit (two rows alike) a column is constant; one row is not evidence."""
    one = io.StringIO()
    render_table(_report([("x" * 30, True, "", 1)]), one, 40)
    assert "(all" not in one.getvalue()
    two = io.StringIO()
    render_table(_report([("x" * 30, True, "", 1), ("y" * 30, False, "", 1)]), two, 40)
    assert "kept (all" not in two.getvalue()  # yes and no: not constant
    assert "n (all 1)" in two.getvalue()


# ------------------------------------------------------------------ item 6: training state


def _keras_like(path: Path, optimizer: int, statistics: int) -> Path:
    rng = np.random.default_rng(6)
    tensors = {
        "model_weights/dense/dense/kernel:0": rng.standard_normal((4, 4)).astype(np.float32),
        "model_weights/dense/dense/bias:0": rng.standard_normal(4).astype(np.float32),
    }
    for i in range(optimizer):
        tensors[f"optimizer_weights/Adam/dense/kernel/m{i}:0"] = np.ones(4, np.float32)
    for i in range(statistics):
        tensors[f"model_weights/bn{i}/bn{i}/moving_mean:0"] = np.ones(4, np.float32)
    return write_safetensors(path, tensors)


@pytest.mark.parametrize(
    ("optimizer", "statistics", "said"),
    [
        (1, 0, "1 optimizer tensor "),
        (2, 1, "2 optimizer tensors and 1 BatchNorm statistic "),
        (0, 2, "2 BatchNorm statistics "),
    ],
)
def test_training_state_note_is_short_with_plurals_and_says_what_each_command_does(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    optimizer: int,
    statistics: int,
    said: str,
) -> None:
    src = _keras_like(tmp_path / "k.safetensors", optimizer, statistics)
    _, err = _run(capsys, "norms", str(src))
    (note,) = err.splitlines()
    assert note == (
        f"clipcli: note: training state left out of the global norm: {said}"
        "(--all-tensors counts them)"
    )
    _, err = _run(capsys, "clip", "--global", "1", str(src), str(tmp_path / "o.safetensors"))
    (note,) = err.splitlines()
    assert note == f"clipcli: note: training state left unchanged: {said}(--all-tensors clips them)"
    assert "copied unchanged" not in note
    assert len(note) <= 120


def _on_a_terminal(argv: list[str], columns: int, env: dict[str, str] | None = None) -> str:
    """`python -m clipcli ARGV` with stderr on a real pseudo-terminal (stdout a pipe):
    what the terminal received, read until the child closed it."""
    primary, secondary = pty.openpty()
    child_env = dict(os.environ, COLUMNS=str(columns), **(env or {}))
    child_env.pop("CLIPCLI_DEBUG", None)
    with subprocess.Popen(
        [sys.executable, "-m", "clipcli", *argv],
        stdout=subprocess.PIPE,
        stderr=secondary,
        env=child_env,
    ) as child:
        os.close(secondary)
        received = b""
        while True:
            ready, _, _ = select.select([primary], [], [], 120)
            assert ready, "no output from the child in 120 s"
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: every holder of the terminal's other end closed it
                break
            if not chunk:
                break
            received += chunk
        assert child.stdout is not None
        child.stdout.read()
        assert child.wait() == 0
    os.close(primary)
    return received.decode("utf-8").replace("\r\n", "\n")


def test_notes_wrap_between_words_on_a_terminal(tmp_path: Path) -> None:
    src = _keras_like(tmp_path / "k.safetensors", 105, 4)
    text = _on_a_terminal(["norms", str(src), "--format", "json"], 60)
    lines = [line for line in text.split("\n") if line and "\x1b" not in line]
    note = [line for line in lines if line.startswith("clipcli: note:")]
    assert len(note) == 1
    start = lines.index(note[0])
    wrapped = [lines[start]] + [
        line for line in lines[start + 1 :] if line.startswith("  ") and not line.startswith("   ")
    ]
    assert len(wrapped) >= 2
    assert all(len(line) <= 60 for line in wrapped)
    joined = " ".join(line.strip() for line in wrapped)
    assert joined == (
        "clipcli: note: training state left out of the global norm: 105 optimizer tensors "
        "and 4 BatchNorm statistics (--all-tensors counts them)"
    )


def test_notes_stay_one_line_in_a_pipe(tmp_path: Path) -> None:
    """A script reading stderr gets each note whole, whatever COLUMNS says."""
    src = _keras_like(tmp_path / "k.safetensors", 105, 4)
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", "norms", str(src), "--format", "json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="60"),
        timeout=120,
    )
    assert done.returncode == 0
    assert len(done.stderr.splitlines()) == 1


# ------------------------------------------------------------------ item 10: progress


@pytest.mark.parametrize("done", [0, 1, 50, 99, 100])
def test_progress_bar_without_colour_tells_filled_from_empty(done: int) -> None:
    from clipcli.report.progress_bar import bar_glyphs, bar_line

    glyphs = bar_glyphs(colour=False, encoding="utf-8")
    assert glyphs[0] != glyphs[1]
    pieces = bar_line("measuring", done, 100, None, 80, glyphs)
    filled, empty = pieces[1][0], pieces[2][0]
    cells_ = len(filled) + len(empty)
    assert set(filled) <= {glyphs[0]}
    assert set(empty) <= {glyphs[1]}
    assert len(filled) == cells_ * done // 100  # exact: floor of the fraction


def test_progress_glyphs_fall_back_to_ascii() -> None:
    from clipcli.report.progress_bar import ASCII_GLYPHS, bar_glyphs

    assert bar_glyphs(colour=False, encoding="ascii") == ASCII_GLYPHS
    assert bar_glyphs(colour=True, encoding="ascii") == ASCII_GLYPHS
    assert ASCII_GLYPHS[0] != ASCII_GLYPHS[1]


def test_progress_under_no_color_on_a_real_terminal(tmp_path: Path) -> None:
    """The bar is drawn once more when a pass ends (rich's stop): under NO_COLOR it has no
    colour codes and its cells are the plain glyph, not the colour-only line."""
    src = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(1 << 16, np.float32)})
    text = _on_a_terminal(["norms", str(src), "--format", "json"], 100, {"NO_COLOR": "1"})
    assert "█" * 10 in text  # the plain glyph for the done cells
    assert "━" not in text
    assert not re.search(r"\x1b\[[0-9;]*3[0-9]m", text)  # no foreground colour


# ------------------------------------------------------------------ item 11: --plot


@pytest.mark.usefixtures("model")
def test_plot_alone_says_what_it_wrote_and_prints_no_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    out, err = _run(capsys, "norms", "m.safetensors", "--plot", "p.png")
    assert (out, err) == ("wrote p.png\n", "")
    assert Path("p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out, err = _run(capsys, "norms", "m.safetensors", "--plot", "p.png", "--force", "-f", "table")
    assert out.startswith("m.safetensors (safetensors)\n┏")
    assert out.endswith("wrote p.png\n")
    out, _ = _run(capsys, "norms", "m.safetensors", "--plot", "p.png", "--force", "-f", "json")
    assert [r["name"] for r in json.loads(out)["tensors"]] == reference_order(NAMES)
    out, _ = _run(capsys, "norms", "m.safetensors", "--plot", "p.png", "--force", "--chart")
    assert out.endswith("wrote p.png\n")
    assert "█" in out


def _summary_axes(bars: Any) -> list[Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clipcli.report.plot import _figure

    fig = _figure(plt, bars, None, False)
    try:
        return [
            ([t.get_text() for t in ax.get_yticklabels()], ax.get_title(loc="left"))
            for ax in fig.axes
        ]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("layered", [False, True], ids=["ranked", "per-layer"])
def test_plot_summaries_show_what_the_global_norm_counts(layered: bool) -> None:
    """A Keras full model: optimizer slots and BatchNorm statistics with norms far above
    the weights. The ranking, its 'largest' panel and the profile's side panel hold
    weights only; the title says how many rows were left out."""
    pytest.importorskip("matplotlib")
    from clipcli.report.builders import Bars

    labels, norms, counted = [], [], []
    for i in range(30):
        layer = f"model.layers.{i}.dense.kernel" if layered else f"model_weights/d{i}/kernel:0"
        labels += [layer, f"optimizer_weights/Adam/d{i}/m:0"]
        norms += [1.0 + i, 1e4 + i]
        counted += [True, False]
    labels.append("optimizer_weights/Adam/iterations:0")
    norms.append(92494.0)
    counted.append(False)
    labels.append("model.embed.weight")
    norms.append(5.0)
    counted.append(True)
    panels = _summary_axes(Bars("t", tuple(labels), tuple(norms), tuple(counted)))
    drawn = [label for ticks, _ in panels for label in ticks]
    assert drawn
    assert not any("optimizer" in label for label in drawn), drawn
    titles = " ".join(title for _, title in panels)
    assert "31 rows not in the global norm left out" in titles


# ------------------------------------------------------------------ item 15: --chart

LONG = "model.layers.10.self_attention.query_key_value.weight"  # 53 cells


def _chart(width: int | None, norms: list[float], counted: list[bool]) -> list[str]:
    out = io.StringIO()
    labels = [LONG, "model.embed.weight", "model.position_ids"][: len(norms)]
    render_chart("t", labels, norms, None, out, width, counted)
    return out.getvalue().splitlines()


def test_chart_bars_shrink_before_names_are_cut() -> None:
    # " label  bar  norm": 5 cells around them; norms print as '1' and '2' (1 cell).
    at_the_limit = len(LONG) + BAR_MIN_WIDTH + 5 + 1
    lines = _chart(at_the_limit, [1.0, 2.0], [True, True])
    assert LONG in lines[1]
    assert all(cell_len(line) <= at_the_limit for line in lines[1:3])
    bars = lines[2].split()[1]
    assert len(bars) == BAR_MIN_WIDTH  # the largest norm fills its (shortest) bar
    lines = _chart(at_the_limit - 1, [1.0, 2.0], [True, True])
    assert LONG not in lines[1]  # one cell short: now the name is cut, the bar is not
    assert "…" in lines[1]
    assert all(cell_len(line) <= at_the_limit - 1 for line in lines[1:3])
    wide = _chart(120, [1.0, 2.0], [True, True])
    assert "█" * 40 in wide[2]  # room enough: full-length bars


@pytest.mark.parametrize(
    ("buffer", "cut"),
    [(2.0, False), (np.nextafter(2.0, 3.0), True), (6679.0, True), (float("inf"), True)],
)
def test_chart_out_of_global_bar_on_the_same_scale_cut_with_a_mark(
    buffer: float, cut: bool
) -> None:
    """The scale is what the global norm counts (largest 2.0): an int64 buffer exactly at
    it fills the bar unmarked; one past it is cut at the edge and marked '▸'."""
    lines = _chart(120, [1.0, 2.0, float(buffer)], [True, True, False])
    weight, largest, outside = lines[1], lines[2], lines[3]
    assert "█" * 20 in weight  # half the scale: half the bar
    assert "█" * 21 not in weight
    assert "█" * 40 in largest
    assert "░" * 40 in outside
    assert ("▸" in outside) is cut
    assert ("longer than the scale" in "\n".join(lines)) is cut
    assert cell_len(outside) == cell_len(largest)
