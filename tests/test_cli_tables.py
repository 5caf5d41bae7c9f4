"""The exact table of every command at 60, 80 and 120 columns, and its exact CSV (issue 12,
item 1). A name is never wrapped or cut to nothing: it stays on one line, shortened in the
middle when it must be, after the least useful columns are hidden; CSV has every column
and the full names.

The expected outputs are files in tests/golden/, read by a person before they were
committed. After an intended change of the layout, regenerate them with
`CLIPCLI_UPDATE_GOLDEN=1 pytest tests/test_cli_tables.py` and read the diff.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import RunCli
from handmade import write_safetensors
from rich.cells import cell_len
from safetensors.numpy import save_file

from clipcli.cli.entry import main
from clipcli.jobs.groups import natural_key
from clipcli.report import Column, OutputFormat, Report, render

GOLDEN = Path(__file__).resolve().parent / "golden"
WIDTHS = (60, 80, 120)
# Real BERT names (Hugging Face transformers), an int64 buffer and a zero LayerNorm weight.
NAMES = (
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_ids",
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.0.attention.output.LayerNorm.weight",
    "bert.encoder.layer.1.intermediate.dense.bias",
    "bert.encoder.layer.11.output.dense.weight",
    "cls.predictions.bias",
)
COMMANDS = {
    "ls": ["ls", "a.safetensors"],
    "norms": ["norms", "a.safetensors"],
    "norms-group-by": ["norms", "a.safetensors", "--group-by", "layer"],
    "clip": ["clip", "--global", "1", "--dry-run", "a.safetensors", "o.safetensors"],
    "diff": ["diff", "a.safetensors", "b.safetensors"],
    "diff-changed-only": ["diff", "a.safetensors", "b.safetensors", "--changed-only"],
}


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(12)
    tensors: dict[str, np.ndarray] = {}
    for i, name in enumerate(NAMES):
        if name.endswith("position_ids"):
            tensors[name] = np.arange(16, dtype=np.int64)[None]
        elif name.endswith("LayerNorm.weight"):
            tensors[name] = np.zeros(8, np.float32)
        else:
            shape = (4, 8) if "weight" in name else (8,)
            tensors[name] = (rng.standard_normal(shape) * (i + 1)).astype(np.float32)
    return tensors


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """a.safetensors and b.safetensors (one tensor halved) in the current directory, so that
    the paths in the titles are the same on every machine."""
    tensors = _model()
    write_safetensors(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    tensors["bert.encoder.layer.11.output.dense.weight"] *= 0.5
    write_safetensors(tmp_path / "b.safetensors", tensors, {"format": "pt"})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "clipcli: error" not in err
    return out


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} differs; see the module docstring"


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_table_at_width(
    command: str, width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    out = _run(COMMANDS[command], capsys)
    _check_golden(f"{command}.{width}.txt", out)
    # Independent of the golden file: every table line fits, every row is one line.
    lines = out.splitlines()
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert all(cell_len(line) <= width for line in table), out
    rows = [line for line in table if line.startswith("│")]
    assert len(rows) == (1 if command == "diff-changed-only" else 4 if "group" in command else 7)


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_csv(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "60")  # CSV ignores the width: every column, full names
    out = _run([*COMMANDS[command], "--format", "csv"], capsys)
    path = GOLDEN / f"{command}.csv"
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        path.write_text(out, encoding="utf-8")
    rows = list(csv.reader(io.StringIO(out)))
    _check_csv_golden(path.name, rows, list(csv.reader(io.StringIO(path.read_text("utf-8")))))
    if command.startswith(("ls", "norms")) and "group" not in command:
        # natural name order is the default (issue 23, item 3); `--sort file` has file order
        assert [row[0] for row in rows[1:]] == sorted(NAMES, key=natural_key)


def _same_cell(got: str, want: str) -> bool:
    """Text exactly; a float's full repr to 1e-12 relative. The float64 sums of squares go
    through BLAS, whose summation order (and so the last bit or two of a 17-digit repr)
    depends on the processor's kernel; the numerics promise 1e-7 and are checked against
    exact references elsewhere. This file is about the layout."""
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return "." in want and abs(a - b) <= 1e-12 * max(abs(a), abs(b))


def _check_csv_golden(name: str, rows: list[list[str]], golden: list[list[str]]) -> None:
    assert [len(row) for row in rows] == [len(row) for row in golden], name
    for got, want in zip(rows, golden, strict=True):
        assert all(map(_same_cell, got, want)), (name, got, want)


def _one_row_report(name: str) -> Report:
    return Report(
        "t",
        (Column("name", "tensor"), Column("x", "x", numeric=True)),
        ((name, 1),),
        drop_order=("x",),
    )


def _table(report: Report, width: int) -> list[str]:
    stream = io.StringIO()
    render(report, OutputFormat.TABLE, stream, width)
    return [line for line in stream.getvalue().splitlines() if line.startswith("│")]


def test_a_table_exactly_as_wide_as_the_terminal_is_kept_whole() -> None:
    name = "n" * 40
    # rich's box: "│ " + name + " │ " + "1" padded to the title "x" + " │"
    exact = len("│ ") + 40 + len(" │ ") + 1 + len(" │")
    assert _table(_one_row_report(name), exact) == [f"│ {name} │ 1 │"]
    narrower = _table(_one_row_report(name), exact - 1)  # the x column goes first
    assert narrower == [f"│ {name} │"]


def test_a_name_is_shortened_in_the_middle_never_to_nothing() -> None:
    name = "model.layers.17.self_attn.q_proj.weight" + "x" * 40
    (row,) = _table(_one_row_report(name), 40)
    shown = row.strip("│ ")
    assert "…" in shown
    head, tail = shown.split("…")
    assert name.startswith(head)
    assert name.endswith(tail)
    assert cell_len(shown) >= 32


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize("width", WIDTHS)
def test_chart_at_width(
    width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    out = _run(["norms", "a.safetensors", "--chart", "--limit", "20"], capsys)
    _check_golden(f"chart.{width}.txt", out)
    bars = [line for line in out.splitlines() if line.startswith(" ")]
    assert len(bars) == len(NAMES)
    assert all(cell_len(line) <= width for line in bars)


HF_KINDS: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
HF_KINDS += ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _hf_names(layers: int = 29) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for layer in range(layers):
        names += [f"model.layers.{layer}.{kind}.weight" for kind in HF_KINDS]
    return names[:200]


@pytest.fixture
def hf_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 200-tensor Hugging Face model (h.safetensors) and a copy with one tensor halved."""
    rng = np.random.default_rng(5)
    tensors = {name: rng.standard_normal(4).astype(np.float32) for name in _hf_names()}
    write_safetensors(tmp_path / "h.safetensors", tensors)
    tensors["model.layers.3.mlp.up_proj.weight"] *= 0.5
    write_safetensors(tmp_path / "g.safetensors", tensors)
    monkeypatch.chdir(tmp_path)
    return tmp_path


HF_COMMANDS = {
    "norms": ["norms", "h.safetensors"],
    "chart": ["norms", "h.safetensors", "--chart"],
    "clip": ["clip", "--norm", "1", "--dry-run", "h.safetensors", "o.safetensors"],
    "diff": ["diff", "h.safetensors", "g.safetensors"],
    "ls": ["ls", "h.safetensors"],
}


@pytest.mark.usefixtures("hf_models")
@pytest.mark.parametrize("width", [40, 60, 80])
@pytest.mark.parametrize("command", sorted(HF_COMMANDS))
def test_shortened_names_stay_distinct(
    command: str, width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    out = _run(HF_COMMANDS[command], capsys)
    if command == "chart":
        rows = [line.split()[0] for line in out.splitlines() if line.startswith(" model")]
    else:
        rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 200, out
    assert len(set(rows)) == 200, sorted(r for r in rows if rows.count(r) > 1)[:6]
    if width >= 60:  # at 40 the names keep their documented minimum: the table is wider
        assert all(cell_len(line) <= width for line in out.splitlines() if "│" in line)


def test_middle_ellipses_one_cut_per_list() -> None:
    from clipcli.report.table import NAME_MIN_CELLS, middle_ellipses

    names = _hf_names()
    short = middle_ellipses(names, NAME_MIN_CELLS)
    assert len(set(short)) == len(names)
    assert all(cell_len(s) <= NAME_MIN_CELLS for s in short)
    for name, s in zip(names, short, strict=True):
        if "…" in s:
            head, tail = s.split("…")
            assert name.startswith(head)
            assert name.endswith(tail)


def test_a_column_alike_on_every_row_goes_before_names_are_cut() -> None:
    names = _hf_names()[:20]
    report = Report(
        "t",
        (Column("name", "tensor"), Column("dtype", "dtype"), Column("norm", "norm", True)),
        tuple((n, "float32", 1.0) for n in names),
        drop_late=("dtype",),
    )
    stream = io.StringIO()
    longest = max(len(n) for n in names)
    render(report, OutputFormat.TABLE, stream, longest + 14)  # room without dtype only
    text = stream.getvalue()
    assert "float32 │" not in text
    assert all(n in text for n in names)  # no name cut
    assert "hidden at" in text
    assert "dtype (all float32)" in text


@pytest.mark.parametrize("width", [40, 60, 80])
def test_lines_under_the_table_fit(
    width: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The title, the footer, the metadata lines and the `hidden at` note fit the width
    wherever the table does; diff's metadata lines say values as they are (no repr quotes,
    no `None`)."""
    config = "{" + ", ".join(f'"dense_{i}": {{"units": 64}}' for i in range(300)) + "}"
    tensors = {name: np.ones(4, np.float32) for name in _hf_names()[:5]}
    monkeypatch.chdir(tmp_path)
    write_safetensors(Path("a.safetensors"), tensors, {"format": "pt", "model_config": config})
    b_name = "a_rather_long_directory_like_file_name_for_the_second_checkpoint.safetensors"
    write_safetensors(Path(b_name), tensors, {"added_key_with_a_long_name": "x" * 90})
    monkeypatch.setenv("COLUMNS", str(width))
    for argv in (["diff", "a.safetensors", b_name], ["ls", "a.safetensors"]):
        out = _run(argv, capsys)
        table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
        assert all(cell_len(line) <= width for line in table) or width < 60
        lines = [line for line in out.splitlines() if line not in table]
        assert all(cell_len(line) <= width for line in lines), [
            line for line in lines if cell_len(line) > width
        ]
        if argv[0] == "diff":
            text = "\n".join(lines)
            assert "None" not in text
            assert "'" not in text
            assert "metadata format: pt -> (absent)" in text
            assert "json" in text  # where the full values are


def test_names_apart_only_in_the_middle_keep_their_digit_runs() -> None:
    from clipcli.report.table import NAME_MIN_CELLS, middle_ellipses

    names = ["a" * 40 + f".{i}." + "b" * 40 for i in range(12)]
    short = middle_ellipses(names, NAME_MIN_CELLS)
    assert len(set(short)) == len(names)  # no single cut reaches the digits: they are kept
    assert all(cell_len(s) <= NAME_MIN_CELLS for s in short)
    assert all(f"…{i}…" in s for i, s in enumerate(short))


LAYER_NORMS = [f"bert.encoder.layer.{i}.attention.output.LayerNorm.weight" for i in range(4)]


def _layer_norm_file(directory: Path) -> Path:
    """Four LayerNorm weights of norm 8 (56-character names) and four small matrices."""
    rng = np.random.default_rng(5)
    tensors = {name: np.ones(64, np.float32) for name in LAYER_NORMS}
    tensors |= {
        f"bert.encoder.layer.{i}.attention.self.query.weight": (
            0.01 * rng.standard_normal((4, 4))
        ).astype(np.float32)
        for i in range(4)
    }
    save_file(tensors, directory / "m.safetensors")
    return directory / "m.safetensors"


def _header(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("┃"))


@pytest.mark.parametrize("width", WIDTHS)
def test_norms_sorted_by_norm_keeps_the_norm_column(
    width: int, tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Golden: `CLIPCLI_UPDATE_GOLDEN=1` rewrites tests/golden/issue23-*.txt; read the diff."""
    _layer_norm_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    done = run_main("norms", "--top", "4", "--sort", "norm", "m.safetensors")
    assert done.code == 0, done.stderr
    golden = GOLDEN / f"issue23-norms-sort-norm-top4.{width}.txt"
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        golden.write_text(done.stdout, encoding="utf-8")
    assert done.stdout == golden.read_text(encoding="utf-8")
    assert " norm " in _header(done.stdout)
    assert "norm (all" not in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 4
    assert all(" 8 │" in line for line in rows)
    if width == 60:  # names are shortened in the middle rather than the norm hidden
        assert all("…" in line for line in rows)


@pytest.mark.parametrize("width", WIDTHS)
def test_norms_sorted_by_size_keeps_the_numel_column(
    width: int, tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    _layer_norm_file(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    done = run_main("norms", "--top", "4", "--sort", "size", tmp_path / "m.safetensors")
    assert done.code == 0, done.stderr
    header = _header(done.stdout)
    assert " numel " in header
    assert " norm " in header


@pytest.mark.parametrize("width", WIDTHS)
def test_clip_keeps_the_norms_before_and_after(
    width: int, tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--norm 0.001 leaves every tensor at that norm: `after` reads the same on every row."""
    source = _layer_norm_file(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    done = run_main("clip", "--norm", "0.001", source, tmp_path / "o.safetensors")
    assert done.code == 0, done.stderr
    header = _header(done.stdout)
    assert " before " in header
    assert " after " in header
    assert "after (all" not in done.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_diff_keeps_the_change(
    width: int, tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file against its copy: every relative change is 0, and still shown."""
    source = _layer_norm_file(tmp_path)
    copy = tmp_path / "copy.npz"
    assert run_main("convert", source, copy).code == 0
    monkeypatch.setenv("COLUMNS", str(width))
    done = run_main("diff", source, copy, "--sort", "norm")
    assert done.code == 0, done.stderr
    header = _header(done.stdout)
    assert " ‖A−B‖/‖A‖ " in header
    assert " ‖A−B‖ " in header
