"""What a newcomer stumbled on following the README (issue 23), one test group per item.

Model directories here are written the way transformers 5.x saves them: shards by the
official safetensors writer with {"format": "pt"}, and an index whose metadata holds
total_size and total_parameters."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Run
from expect import one_error_line
from safetensors.numpy import load_file, save_file

from clipcli.cli import quick_args

RunCli = Callable[..., Run]


def transformers5_directory(
    directory: Path, tensors: dict[str, np.ndarray], extra_index_metadata: dict[str, object]
) -> Path:
    """Two shards and an index, as transformers 5 writes them."""
    directory.mkdir()
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    halves["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    for shard, members in halves.items():
        save_file({n: tensors[n] for n in members}, directory / shard, metadata={"format": "pt"})
    index = {
        "metadata": {
            "total_parameters": sum(int(a.size) for a in tensors.values()),
            "total_size": sum(int(a.nbytes) for a in tensors.values()),
            **extra_index_metadata,
        },
        "weight_map": {n: shard for shard, members in halves.items() for n in members},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text('{"model_type": "bert"}')
    return directory


def bert_like(directory: Path, extra_index_metadata: dict[str, object] | None = None) -> Path:
    rng = np.random.default_rng(23)
    tensors = {
        f"bert.encoder.layer.{i}.attention.self.query.weight": rng.standard_normal((4, 4)).astype(
            np.float32
        )
        for i in range(2)
    }
    tensors |= {
        f"bert.encoder.layer.{i}.attention.output.LayerNorm.weight": np.ones(64, np.float32)
        for i in range(2)
    }
    return transformers5_directory(directory, tensors, extra_index_metadata or {})


# ------------------------------------------------------------------ 2: derived index keys


def test_joining_a_transformers5_directory_needs_no_allow_lossy(
    tmp_path: Path, run_main: RunCli
) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    merged = tmp_path / "merged.safetensors"
    done = run_main("convert", model, merged)
    assert done.code == 0, done.stderr
    assert "warning" not in done.stderr
    expected: dict[str, np.ndarray] = {}
    for shard in sorted(model.glob("*.safetensors")):
        expected |= load_file(shard)
    written = load_file(merged)
    assert written.keys() == expected.keys()
    for name, array in expected.items():
        assert written[name].tobytes() == array.tobytes()
    with open(merged, "rb") as handle:  # the official reader's view of __metadata__
        header_size = int.from_bytes(handle.read(8), "little")
        assert json.loads(handle.read(header_size))["__metadata__"] == {"format": "pt"}


def test_any_other_index_key_is_still_refused(tmp_path: Path, run_main: RunCli) -> None:
    model = bert_like(tmp_path / "bert-tiny", {"total_flops": 7})
    done = run_main("convert", model, tmp_path / "merged.safetensors")
    assert done.code == 2
    line = one_error_line(done.stderr)
    assert "('total_flops')" in line
    assert "total_parameters" not in line
    assert not (tmp_path / "merged.safetensors").exists()


def test_allow_lossy_help_names_index_metadata(run_main: RunCli) -> None:
    done = run_main("convert", "--help")
    assert done.code == 0
    assert "index metadata" in " ".join(done.stdout.split())


# ------------------------------------------------------------------ 3: OUT's unknown extension


@pytest.mark.parametrize("out", ["o.pt", "b.npy", "b.gguf", "model.v2"])
@pytest.mark.parametrize("command", [["convert"], ["clip", "--global", "1"]])
def test_an_unknown_extension_is_refused_for_a_directory_input(
    tmp_path: Path, run_main: RunCli, out: str, command: list[str]
) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    done = run_main(*command, model, tmp_path / out)
    assert done.code == 2
    line = one_error_line(done.stderr)
    assert "unknown output extension" in line
    assert ".npz, .safetensors, .h5, .hdf5 or .keras" in line
    assert "end OUT with /" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-tiny"]


@pytest.mark.parametrize("out", ["o.pt", "b.gguf"])
def test_an_unknown_extension_reads_the_same_for_a_file_input(
    tmp_path: Path, run_main: RunCli, out: str
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": np.ones(3, np.float32)}, source)
    done = run_main("convert", source, tmp_path / out)
    assert done.code == 2
    assert ".npz, .safetensors, .h5, .hdf5 or .keras, or end OUT with /" in done.stderr


@pytest.mark.parametrize("out", ["merged", "llama-3.2-1b", "Qwen2.5-0.5B", "o.pt/"])
def test_a_directory_out_is_still_written_when_asked(
    tmp_path: Path, run_main: RunCli, out: str
) -> None:
    """No extension (a version number is none), or a trailing slash: a model directory."""
    model = bert_like(tmp_path / "bert-tiny")
    done = run_main(
        "convert", model, f"{tmp_path / out.rstrip('/')}{'/' if out[-1] == '/' else ''}"
    )
    assert done.code == 0, done.stderr
    written = tmp_path / out.rstrip("/")
    assert written.is_dir()
    assert (written / "model.safetensors.index.json").is_file()


def test_an_existing_directory_with_a_dot_is_still_the_target(
    tmp_path: Path, run_main: RunCli
) -> None:
    """A directory that already exists is what the user named: refused without --force as
    any existing OUT, replaced with it."""
    model = bert_like(tmp_path / "bert-tiny")
    first = run_main("convert", model, f"{tmp_path / 'out.v2'}/")
    assert first.code == 0, first.stderr
    again = run_main("convert", model, tmp_path / "out.v2")
    assert again.code == 2
    assert "already exists; pass --force" in again.stderr
    assert run_main("convert", model, tmp_path / "out.v2", "--force").code == 0


# ------------------------------------------------------------------ 4: diff dir vs joined file


def test_a_directory_and_its_joined_file_do_not_differ(tmp_path: Path, run_main: RunCli) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    joined = tmp_path / "bert1.safetensors"
    assert run_main("convert", model, joined).code == 0
    for a, b in ((model, joined), (joined, model)):
        done = run_main("diff", a, b, "--fail-above", "0", "--json")
        assert done.code == 0, done.stderr
        assert done.json()["metadata_changes"] == []


def test_a_directory_and_its_npz_differ_only_by_format(tmp_path: Path, run_main: RunCli) -> None:
    """npz holds no metadata: the shards' format=pt is what it lost, and nothing else."""
    model = bert_like(tmp_path / "bert-tiny")
    joined = tmp_path / "bert1.npz"
    assert run_main("convert", model, joined).code == 0
    done = run_main("diff", model, joined, "--json")
    assert done.code == 0, done.stderr
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("format", "pt", None)]


def test_other_index_keys_are_still_differences(tmp_path: Path, run_main: RunCli) -> None:
    plain = bert_like(tmp_path / "plain")
    edited = bert_like(tmp_path / "edited", {"total_flops": 7, "total_size": 1})
    done = run_main("diff", plain, edited, "--fail-above", "0", "--json")
    assert done.code == 1
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("total_flops", None, "7")]


def test_an_index_key_the_shards_carry_otherwise_is_shown_apart(
    tmp_path: Path, run_main: RunCli
) -> None:
    plain = bert_like(tmp_path / "plain")
    edited = bert_like(tmp_path / "edited", {"format": "tf"})
    done = run_main("diff", plain, edited, "--json")
    changes = done.json()["metadata_changes"]
    assert [(c["key"], c["a"], c["b"]) for c in changes] == [("index format", None, "tf")]


# ------------------------------------------------------------------ 5: narrow tables

GOLDEN = Path(__file__).resolve().parent / "golden"
WIDTHS = (60, 80, 120)
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


# ------------------------------------------------------------------ 9: --skip-low-rank


def _ranked_file(path: Path, ranks: list[int]) -> Path:
    save_file(
        {f"t{rank}.{i}": np.ones((2,) * rank, np.float32) for i, rank in enumerate(ranks)}, path
    )
    return path


@pytest.mark.parametrize(("axes", "ranks"), [("5", [1, 2, 5]), ("1", [1, 1]), ("-3", [2, 1])])
def test_skip_low_rank_that_leaves_nothing_is_refused(
    tmp_path: Path, run_main: RunCli, axes: str, ranks: list[int]
) -> None:
    """Past the limit: every tensor's rank is below what --axes needs."""
    source = _ranked_file(tmp_path / "m.safetensors", ranks)
    out = tmp_path / "x.safetensors"
    done = run_main("clip", "--norm", "1", "--axes", axes, "--skip-low-rank", source, out)
    assert done.code == 4
    line = one_error_line(done.stderr)
    assert f"--axes {axes} needs" in line
    assert f"the highest rank among the {len(ranks)} selected tensors is {max(ranks)}" in line
    assert not out.exists()


@pytest.mark.parametrize(("axes", "ranks"), [("5", [1, 2, 6]), ("1", [1, 2]), ("-3", [3, 1])])
def test_skip_low_rank_with_one_tensor_at_the_rank_clips_it(
    tmp_path: Path, run_main: RunCli, axes: str, ranks: list[int]
) -> None:
    """At the limit: one tensor has exactly the rank --axes needs."""
    source = _ranked_file(tmp_path / "m.safetensors", ranks)
    out = tmp_path / "x.safetensors"
    done = run_main("clip", "--norm", "1", "--axes", axes, "--skip-low-rank", source, out, "-q")
    assert done.code == 0, done.stderr
    written = load_file(out)
    assert sum(not np.array_equal(written[n], a) for n, a in load_file(source).items()) == 1


# ------------------------------------------------------------------ 10: an empty path

EMPTY_LINES = [
    ["ls", ""],
    ["ls", "", "--sort=size"],
    ["norms", ""],
    ["norms", "", "--top", "3"],
    ["norms", "m.npz", "--plot", ""],
    ["norms", "m.npz", "--plot="],
    ["clip", "--global", "1", "", "o.npz"],
    ["clip", "--global", "1", "m.npz", ""],
    ["convert", "", "o.npz"],
    ["convert", "m.npz", ""],
    ["diff", "", "m.npz"],
    ["diff", "m.npz", ""],
]


@pytest.mark.parametrize("args", EMPTY_LINES)
def test_an_empty_path_is_a_usage_error(
    args: list[str], tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never the current directory: here it holds a checkpoint that must not be read."""
    np.savez(tmp_path / "m.npz", w=np.ones(3))
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = run_main(*args)
    assert done.code == 2
    assert "an empty path (is a variable unset?)" in one_error_line(done.stderr)
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args", EMPTY_LINES)
def test_both_parsers_refuse_an_empty_path(args: list[str], cli: RunCli) -> None:
    """The quick parser hands such a line to Typer, and Typer itself refuses it."""
    assert quick_args.parse(args) is None
    done = cli(*args)  # Typer's app directly (CliRunner)
    assert done.code == 2
    assert "an empty path (is a variable unset?)" in done.stderr


# ------------------------------------------------------------------ 12: '-' as an input

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


# ------------------------------------------------------------------ 16: the plot's mode


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0, 0o666)])
def test_a_new_plot_gets_the_umask_mode_not_the_inputs(
    tmp_path: Path, run_main: RunCli, umask: int, expected: int
) -> None:
    pytest.importorskip("matplotlib")
    model = bert_like(tmp_path / "bert-tiny")
    for entry in model.iterdir():
        entry.chmod(0o600)  # private shards: the picture of their norms is no copy of them
    plot = tmp_path / "norms.png"
    old = os.umask(umask)
    try:
        done = run_main("norms", model, "--plot", plot)
    finally:
        os.umask(old)
    assert done.code == 0, done.stderr
    assert stat.S_IMODE(plot.stat().st_mode) == expected
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_replaced_plot_keeps_its_own_mode_less_set_id(tmp_path: Path, run_main: RunCli) -> None:
    pytest.importorskip("matplotlib")
    model = bert_like(tmp_path / "bert-tiny")
    plot = tmp_path / "norms.png"
    plot.write_bytes(b"old")
    plot.chmod(0o2640)
    done = run_main("norms", model, "--plot", plot, "--force")
    assert done.code == 0, done.stderr
    assert stat.S_IMODE(plot.stat().st_mode) == 0o640


# ------------------------------------------------------------------ 14: what -q silences
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


@pytest.mark.parametrize("command", ["ls", "norms", "clip", "convert", "diff"])
def test_quiet_help_says_exactly_what_it_silences(run_main: RunCli, command: str) -> None:
    done = run_main(command, "--help")
    text = " ".join(done.stdout.replace("│", " ").split())
    assert "Notes, warnings and errors still go to stderr." in text
    assert "Print nothing on success" not in text
