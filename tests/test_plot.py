"""`norms --plot` pictures people can read for 10 to 1,000+ tensors (issue 12, item 3):
a bounded picture size whatever the tensor count, nothing on stderr (no matplotlib
warning), zero norms on a log axis. The pictures were also looked at by a person (the
commit message of this file says what changed after looking)."""

from __future__ import annotations

import json
import os
import stat
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RunCli
from handmade import small_model, write_safetensors
from layouts import bert_like
from safetensors.numpy import save_file

from clipcli.cli.entry import main

pytest.importorskip("matplotlib")

MAX_WIDTH, MAX_HEIGHT = 1600, 1300  # pixels


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _llama(layers: int) -> dict[str, np.ndarray]:
    """Hugging Face Llama names; a zero bias-like tensor, an outlier and an int64 buffer."""
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((16, 4)).astype(np.float32),
        "model.rotary_emb.inv_freq_ids": np.arange(4, dtype=np.int64),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(4, np.float32)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            tensors[p + part + ".weight"] = rng.standard_normal((4, 4)).astype(np.float32)
    tensors["model.layers.0.self_attn.q_proj.weight"] *= 1e4  # range > 1e3: a log axis
    tensors["model.norm.weight"] = np.zeros(4, np.float32)  # zero norm on that log axis
    tensors["lm_head.weight"] = rng.standard_normal((16, 4)).astype(np.float32)
    return tensors


def _plot(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str, layers: int) -> Path:
    model = write_safetensors(tmp_path / "m.safetensors", _llama(layers))
    picture = tmp_path / "p.png"
    capsys.readouterr()
    assert main(["norms", str(model), "--plot", str(picture), "--format", "json", *extra]) == 0
    assert capsys.readouterr().err == ""  # no matplotlib warning, no note
    return picture


def test_small_model_is_horizontal_bars(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    width, height = _png_size(_plot(tmp_path, capsys, "--limit", "3", layers=2))
    assert width <= MAX_WIDTH
    assert height <= MAX_HEIGHT


@pytest.mark.slow
@pytest.mark.parametrize("layers", [12, 200])
def test_layered_models_are_a_per_layer_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: int
) -> None:
    """12 layers: 52 tensors; 200 layers: 804 tensors (the old plot: 22,000 px wide)."""
    width, height = _png_size(_plot(tmp_path, capsys, "--limit", "2", layers=layers))
    assert width <= MAX_WIDTH
    assert height <= MAX_HEIGHT


@pytest.mark.slow
def test_many_groups_are_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = _plot(tmp_path, capsys, "--group-by", "layer", layers=200)
    width, height = _png_size(picture)
    assert width <= MAX_WIDTH
    assert height <= MAX_HEIGHT


@pytest.mark.slow
def test_svg_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_safetensors(tmp_path / "m.safetensors", _llama(1))
    capsys.readouterr()
    assert main(["norms", str(model), "--plot", str(tmp_path / "p.svg"), "-f", "csv"]) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def _figure_of(kind: str, labels: list[str], norms: list[float], limit: float | None) -> object:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clipcli.report import plot_figures as plot
    from clipcli.report.builders import Bars

    bars = Bars("t", tuple(labels), tuple(norms), tuple(True for _ in labels))
    draw = {
        "ranked": plot._ranked_figure,
        "groups": plot._group_profile_figure,
        "bars": plot._bar_figure,
    }[kind]
    fig = draw(plt, bars, limit)
    fig.canvas.draw()
    return fig


def test_ranked_log_line_keeps_a_zero_at_the_floor_marked_0() -> None:
    norms = [10.0 ** (i / 20) for i in range(80)] + [0.0]
    fig: Any = _figure_of("ranked", [f"w{i}" for i in range(81)], norms, None)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    ys = np.asarray(ax.lines[0].get_ydata(), dtype=float)
    assert len(ys) == 81
    assert np.isfinite(ys).all()  # the line does not stop at 80
    assert ys[-1] < min(norms[:80])  # the zero sits below every positive value
    assert "0" in [t.get_text() for t in ax.texts]


def test_other_group_is_not_a_point_of_the_layer_line() -> None:
    labels = [f"model.layers.{i}" for i in range(50)] + ["(other)"]
    norms = [1.0 + i % 3 for i in range(50)] + [40.0]
    fig: Any = _figure_of("groups", labels, norms, 10.0)
    ax = fig.axes[0]
    line = ax.lines[0]
    assert len(line.get_xdata()) == 50
    assert 40.0 not in list(line.get_ydata())
    assert any("(other)" in t.get_text() for t in ax.texts)  # drawn apart, labelled
    box = ax.get_legend().get_window_extent()
    renderer = fig.canvas.get_renderer()
    for label in ax.get_xticklabels():  # slanted group names below: the legend goes above
        assert not box.overlaps(label.get_window_extent(renderer))
    assert not box.overlaps(ax.get_window_extent())


def test_limit_legend_is_not_on_the_bars() -> None:
    labels = [f"layer.{i}.weight" for i in range(12)]
    norms = [30.0 - i for i in range(12)]  # long bars at the top right, where "best" went
    fig: Any = _figure_of("bars", labels, norms, 20.0)
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None
    box = legend.get_window_extent()
    for patch in ax.patches:
        assert not box.overlaps(patch.get_window_extent()), "the legend covers a bar"
    assert not box.overlaps(ax.get_window_extent())  # outside the plotting area


def test_plot_over_the_input_is_refused_even_with_force(tmp_path: Path) -> None:
    src = small_model(tmp_path, "m.png")  # a checkpoint that happens to be named .png
    before = src.read_bytes()
    assert main(["norms", str(src), "--plot", str(src), "--force"]) == 2
    link = tmp_path / "link.png"
    link.symlink_to(src)
    assert main(["norms", str(src), "--plot", str(link), "--force"]) == 2
    assert src.read_bytes() == before


def test_plot_into_a_model_directory_given_by_its_index_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(model / "model-00001-of-00001.safetensors"))
    index = model / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    for given in (model, index):
        assert main(["norms", str(given), "--plot", str(model / "q.png")]) == 2
    link = tmp_path / "shard.png"
    link.hardlink_to(model / "model-00001-of-00001.safetensors")
    assert main(["norms", str(index), "--plot", str(link), "--force"]) == 2
    assert not (model / "q.png").exists()


# ------------------------------------------------- issue 23, item 16: the plot's mode


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


# Norms matplotlib's log axes cannot draw as they are (its ticks overflow past ~1e250; no
# floor fits under a subnormal): drawn at the edge of report/plot.DRAWABLE, never exit 70,
# never a warning on stderr (found by the attack of 2026-11-27).
EXTREME_NORMS = [
    [1e300, 1.0],
    [1.7e308],
    [1e300, 5e-324],
    [5e-324, 1.0],
    [1e200, 1e-200],  # exactly at DRAWABLE's edges: drawn as they are
]


@pytest.mark.parametrize("values", EXTREME_NORMS, ids=str)
@pytest.mark.parametrize("count", [2, 200])  # bars; many rows (a ranked line)
def test_extreme_norms_are_drawn_without_warnings(
    tmp_path: Path, run_main: RunCli, values: list[float], count: int
) -> None:
    tensors = {f"t{i}": np.array([values[i % len(values)]]) for i in range(count)}
    model = tmp_path / "m.safetensors"
    save_file(tensors, str(model))
    picture = tmp_path / "p.png"
    with warnings.catch_warnings(record=True) as warned:  # in-process: pytest would take them
        warnings.simplefilter("always")
        result = run_main("norms", model, "--plot", picture, "-q")
    assert (result.code, result.stderr) == (0, "")
    assert [str(w.message) for w in warned] == []
    assert _png_size(picture)[0] > 0


def test_drawable_keeps_norms_inside_and_clamps_those_beyond() -> None:
    from clipcli.report.builders import Bars
    from clipcli.report.plot import DRAWABLE, _drawable

    low, high = DRAWABLE
    inside = Bars("t", ("a", "b", "c", "d"), (low, high, 0.0, float("inf")), (True,) * 4)
    assert _drawable(inside, high) == (inside, high)  # at the edges: as they are
    beyond = inside._replace(norms=(low / 2, high * 2, 0.0, float("nan")))
    drawn, limit = _drawable(beyond, 5e-324)
    assert drawn.norms[:3] == (low, high, 0.0)
    assert drawn.norms[3] != drawn.norms[3]  # NaN as it was
    assert limit == low
    assert "drawn at its edge" in drawn.title


def _annotations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text the figures annotate (value labels, the named largest), as drawn."""
    import matplotlib.axes

    texts: list[str] = []
    real = matplotlib.axes.Axes.annotate

    def annotate(self: Any, text: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(text)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", annotate)
    return texts


def test_a_norm_drawn_at_the_edge_is_labelled_with_itself(
    tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = _annotations(monkeypatch)
    model = tmp_path / "m.safetensors"
    save_file({"a": np.array([5e-324]), "b": np.array([np.finfo(np.float64).max])}, str(model))
    result = run_main("norms", model, "--plot", tmp_path / "p.svg", "-q")
    assert (result.code, result.stderr) == (0, "")
    assert f"{5e-324:.4g}" in texts  # not 1e-200, where it is drawn
    assert f"{np.finfo(np.float64).max:.4g}" in texts  # not 1e+200


def test_the_largest_named_are_the_largest_norms_not_the_edge(
    tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 rows (a ranking, its largest named beside it): norms from 1e-300 to 1e300,
    many beyond the drawable range; the named ones are the true largest, in order."""
    texts = _annotations(monkeypatch)
    exponents = np.linspace(-300, 300, 2000)
    rng = np.random.default_rng(5)
    rng.shuffle(exponents)
    tensors = {f"blk{i}.w": np.array([10.0**e]) for i, e in enumerate(exponents)}
    model = tmp_path / "m.safetensors"
    save_file(tensors, str(model))
    result = run_main("norms", model, "--plot", tmp_path / "p.png", "-q")
    assert (result.code, result.stderr) == (0, "")
    largest = sorted(tensors, key=lambda name: -float(tensors[name][0]))[:3]
    shown = [f"{float(tensors[name][0]):.4g}" for name in largest]
    assert all(text in texts for text in shown), (shown, texts[:20])
    assert "1e+200" not in texts
