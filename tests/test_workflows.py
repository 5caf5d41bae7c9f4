"""Model-surgery workflows through the real CLI: sharded HF directories, Keras HDF5 files,
layer groups, diff, convert, charts and plots."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from expect import SAMPLE_DATA
from handmade import write_safetensors
from safetensors import safe_open
from typer.testing import CliRunner

from clipcli.cli.entry import main
from clipcli.cli.typer_app import app

runner = CliRunner()
BF16 = np.dtype(ml_dtypes.bfloat16)


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})
    return result.exit_code, result.stdout, result.stderr


def run_json(*args: str) -> dict:  # type: ignore[type-arg]
    code, out, err = run(*args, "--format", "json")
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((32, 16)).astype(BF16)}
    for layer in range(7):
        scale = 10.0 if layer == 3 else 1.0  # one exploded layer
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
            name = f"model.layers.{layer}.{part}.weight"
            tensors[name] = (rng.standard_normal((16, 16)) * scale).astype(BF16)
    tensors["lm_head.weight"] = rng.standard_normal((32, 16)).astype(BF16)
    return tensors


def make_hf_dir(directory: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A 3-shard Hugging Face model directory with config and tokenizer files."""
    directory.mkdir()
    names = list(tensors)
    shards = [names[0:10], names[10:20], names[20:]]
    weight_map = {}
    for number, members in enumerate(shards, start=1):
        shard = f"model-{number:05d}-of-00003.safetensors"
        write_safetensors(directory / shard, {n: tensors[n] for n in members}, {"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 7}')
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    return directory


def read_bf16(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a model directory, read with the official safe_open (as raw bf16)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for name, shard in index["weight_map"].items():
        with safe_open(str(directory / shard), framework="np") as handle:
            assert name in handle.keys()  # noqa: SIM118 (safe_open is not iterable)
        out[name] = read_tensor_bytes(directory / shard, name)
    return out


def read_tensor_bytes(path: Path, name: str) -> np.ndarray:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + length])[name]
    begin, end = entry["data_offsets"]
    raw = data[8 + length + begin : 8 + length + end]
    return np.frombuffer(raw, dtype=BF16).reshape(entry["shape"])


def test_sharded_norms_equal_norms_of_merged_file(tmp_path: Path) -> None:
    tensors = hf_tensors()
    model = make_hf_dir(tmp_path / "model", tensors)
    merged = tmp_path / "merged.safetensors"
    write_safetensors(merged, tensors, {"format": "pt"})
    sharded = run_json("norms", str(model))
    single = run_json("norms", str(merged))
    assert sharded["format"] == "safetensors-sharded"
    assert sharded["global_norm"] == single["global_norm"]
    by_name = {t["name"]: t["norm"] for t in single["tensors"]}
    assert {t["name"]: t["norm"] for t in sharded["tensors"]} == by_name
    # The index file names the same checkpoint as its directory.
    via_index = run_json("norms", str(model / "model.safetensors.index.json"))
    assert via_index["global_norm"] == single["global_norm"]


def nearest_bf16(exact: np.ndarray) -> np.ndarray:
    """float64 values rounded once to the nearest bfloat16, ties to even: of a first guess
    and its two neighbours, the closest (a float64 difference of such close values is exact)."""
    guess = exact.astype(np.float32).astype(BF16).view(np.uint16).astype(np.int32)
    best = guess.astype(np.uint16)
    for step in (-1, 1):
        other = (guess + step).astype(np.uint16)
        d_best = np.abs(best.view(BF16).astype(np.float64) - exact)
        d_other = np.abs(other.view(BF16).astype(np.float64) - exact)
        better = (d_other < d_best) | ((d_other == d_best) & (other % 2 == 0))
        best = np.where(better, other, best)
    return best.view(BF16)


def exact_squares(array: np.ndarray) -> int:
    """The exact sum of squares of bfloat16/float32 values, in units of 2**-300: every such
    value is an integer multiple of 2**-150, so the sum is an exact Python integer."""
    wide = array.astype(np.float64).ravel()
    return sum(int(v * 2.0**150) ** 2 for v in wide.tolist())


def exact_norm_at_most(squares: int, limit: float) -> bool:
    """sqrt(squares * 2**-300) <= limit, decided exactly."""
    return Fraction(squares, 2**300) <= Fraction(limit) ** 2


def best_uniform_bf16(tensors: dict[str, np.ndarray], limit: float) -> dict[str, np.ndarray]:
    """An independent reference for `--global`: of all float64 factors s, the largest whose
    once-rounded output round(x * s) has an exact global norm <= limit (bisection over the
    factor's bit patterns; the output norm never decreases as s grows)."""

    def output(factor: float) -> dict[str, np.ndarray]:
        return {n: nearest_bf16(a.astype(np.float64) * factor) for n, a in tensors.items()}

    def fits(factor: float) -> bool:
        return exact_norm_at_most(sum(exact_squares(a) for a in output(factor).values()), limit)

    low = 0  # bit pattern of 0.0: fits
    high = struct.unpack("<q", struct.pack("<d", 1.0))[0]  # 1.0: over (the norm is > limit)
    assert not fits(1.0)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(struct.unpack("<d", struct.pack("<q", middle))[0]):
            low = middle
        else:
            high = middle
    return output(struct.unpack("<d", struct.pack("<q", low))[0])


def test_sharded_clip_writes_a_loadable_model_directory(tmp_path: Path) -> None:
    tensors = hf_tensors()
    model = make_hf_dir(tmp_path / "model", tensors)
    out = tmp_path / "clipped"
    report = run_json("clip", "--global", "20", str(model), str(out))
    # Loadable as transformers would load it: every shard the index names opens with the
    # official reader and holds exactly the tensors the index maps to it.
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in set(weight_map.values()):
        with safe_open(str(out / shard), "np") as f:
            held = set(f.keys())
        assert held == {name for name, where in weight_map.items() if where == shard}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in model.iterdir())
    assert (out / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    index_in = json.loads((model / "model.safetensors.index.json").read_text())
    index_out = json.loads((out / "model.safetensors.index.json").read_text())
    assert index_out["weight_map"] == index_in["weight_map"]
    assert index_out["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    # Exactly the expected values, from a reference that shares nothing with clipcli (not
    # even the scale it reported): one uniform factor, each value rounded once to bf16
    # (issue 10: it was a float32 product rounded again), the largest such output whose
    # exact global norm is <= 20.
    clipped = read_bf16(out)
    expected = best_uniform_bf16(tensors, 20.0)
    for name in tensors:
        assert clipped[name].tobytes() == expected[name].tobytes(), name
    squares = sum(exact_squares(a) for a in clipped.values())
    assert exact_norm_at_most(squares, 20.0)
    assert not exact_norm_at_most(squares, 20.0 * (1 - 4e-3))  # bf16 rounding
    assert report["global_norm_after"] <= 20.0


def test_sharded_index_errors_are_exit_3(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    (model / "model-00002-of-00003.safetensors").unlink()
    code, _, err = run("norms", str(model))
    assert code == 3
    assert err.startswith("clipcli: error:")
    assert "model-00002-of-00003.safetensors" in err


def test_per_layer_clipping_with_group_by(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    groups = run_json("norms", str(model), "--group-by", "layer")["groups"]
    names = [g["group"] for g in groups]
    assert names == [f"model.layers.{i}" for i in range(7)] + ["(other)"]
    assert sum(g["share"] for g in groups) == pytest.approx(1.0, rel=1e-12)
    assert all(g["tensors"] == 4 for g in groups[:-1])
    out = tmp_path / "clipped"
    assert main(["clip", "--global", "30", "--group-by", "layer", "-q", str(model), str(out)]) == 0
    # Checked on the files (official reader, exact norms), not on clipcli's own report.
    original, clipped = read_bf16(model), read_bf16(out)
    members: dict[str, list[str]] = {}
    for name in original:
        found = re.match(r"model\.layers\.\d+", name)
        members.setdefault(found.group(0) if found else "(other)", []).append(name)
    assert sorted(members) == sorted(g["group"] for g in groups)
    for names in members.values():
        if exact_norm_at_most(sum(exact_squares(original[n]) for n in names), 30.0):
            for name in names:  # untouched groups stay bit-identical
                assert clipped[name].tobytes() == original[name].tobytes(), name
        else:
            after = sum(exact_squares(clipped[n]) for n in names)
            assert exact_norm_at_most(after, 30.0)
            assert not exact_norm_at_most(after, 30.0 * (1 - 4e-3))


def test_group_by_needs_global(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    code, _, err = run(
        "clip", "--norm", "1", "--group-by", "layer", str(model), str(tmp_path / "o")
    )
    assert code == 2
    assert "--group-by is valid only with --global" in err


def test_group_by_custom_regex_and_bad_regex(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    groups = run_json("norms", str(model), "--group-by", r"(self_attn|mlp)")["groups"]
    assert [g["group"] for g in groups] == ["mlp", "self_attn", "(other)"]
    code, _, err = run("norms", str(model), "--group-by", "(unclosed")
    assert code == 2
    assert "not a valid regex" in err


def make_keras3(path: Path) -> None:
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = "3.6.0"
        f.attrs["date_saved"] = "2026-11-22@10:00:00"
        for layer, shape in (("dense", (8, 16)), ("dense_1", (16, 4))):
            group = f.create_group(f"layers/{layer}/vars")
            group.create_dataset("0", data=rng.standard_normal(shape).astype(np.float32) * 5)
            group.create_dataset("1", data=np.zeros(shape[1], dtype=np.float32))
        f.create_group("optimizer/vars").create_dataset("0", data=np.array(12, dtype=np.int64))


def make_legacy_keras(path: Path) -> None:
    rng = np.random.default_rng(4)
    with h5py.File(path, "w") as f:
        f.attrs["backend"] = np.bytes_("tensorflow")
        f.attrs["keras_version"] = np.bytes_("2.15.0")
        f.attrs["model_config"] = np.bytes_(json.dumps({"class_name": "Sequential"}))
        weights = f.create_group("model_weights")
        weights.attrs["layer_names"] = np.array([b"dense", b"dense_1"])
        for layer, shape in (("dense", (8, 16)), ("dense_1", (16, 4))):
            group = weights.create_group(layer)
            group.attrs["weight_names"] = np.array(
                [f"{layer}/kernel:0".encode(), f"{layer}/bias:0".encode()]
            )
            inner = group.create_group(layer)
            inner.create_dataset(
                "kernel:0",
                data=rng.standard_normal(shape).astype(np.float32) * 5,
                chunks=True,
                compression="gzip",
                compression_opts=4,
            )
            inner.create_dataset("bias:0", data=np.zeros(shape[1], dtype=np.float32))
        f.create_group("optimizer_weights")


def walk(path: Path) -> dict[str, object]:
    """Every group and dataset with its attributes (value and dtype) and storage settings."""
    seen: dict[str, object] = {}
    with h5py.File(path, "r") as f:

        def attrs(obj: h5py.HLObject) -> dict[str, object]:
            return {k: (repr(obj.attrs[k]), obj.attrs.get_id(k).dtype.str) for k in obj.attrs}

        seen["/"] = attrs(f)

        def visit(name: str, obj: h5py.HLObject) -> None:
            if isinstance(obj, h5py.Dataset):
                seen[name] = (
                    "dataset",
                    obj.dtype.str,
                    obj.shape,
                    obj.chunks,
                    obj.compression,
                    obj.compression_opts,
                    attrs(obj),
                )
            else:
                seen[name] = ("group", attrs(obj))

        f.visititems(visit)
    return seen


@pytest.mark.parametrize("maker", [make_keras3, make_legacy_keras])
def test_keras_files_round_trip_through_clip(tmp_path: Path, maker: object) -> None:
    src = tmp_path / "model.weights.h5"
    maker(src)  # type: ignore[operator]
    out = tmp_path / "clipped.weights.h5"
    report = run_json("clip", "--norm", "2", str(src), str(out))
    assert any(row["changed"] for row in report["tensors"])
    assert walk(out) == walk(src)
    with h5py.File(out) as f:
        squares = {
            name: exact_squares(f[name][()])
            for name in (row["name"] for row in report["tensors"])
            if f[name].dtype.kind == "f"
        }
    assert squares
    assert all(exact_norm_at_most(n, 2.0) for n in squares.values())


def test_diff_against_itself_is_all_zero(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    code, out, _ = run("diff", str(model), str(model), "--format", "json", "--fail-above", "0")
    assert code == 0
    document = json.loads(out)
    assert document["identical"] is True
    assert document["global_diff_norm"] == 0.0
    assert all(t["status"] == "same" and t["diff_norm"] == 0.0 for t in document["tensors"])


def test_diff_reports_the_scales_clip_applied(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    src = tmp_path / "a.safetensors"
    write_safetensors(
        src,
        {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) * (i + 1) for i in range(4)},
        {},
    )
    out = tmp_path / "b.safetensors"
    clip_rows = {
        r["name"]: r for r in run_json("clip", "--norm", "100", str(src), str(out))["tensors"]
    }
    diff_rows = {r["name"]: r for r in run_json("diff", str(src), str(out))["tensors"]}
    for name, row in clip_rows.items():
        ratio = diff_rows[name]["norm_ratio"]
        if row["changed"]:
            assert ratio == pytest.approx(row["scale"], rel=1e-6)  # float32 rounding
            assert diff_rows[name]["cosine"] == pytest.approx(1.0, abs=1e-6)
        else:
            assert diff_rows[name]["status"] == "same"
            assert ratio == 1.0
    code, _, err = run("diff", str(src), str(out), "--fail-above", "0.01")
    assert code == 1
    assert "(w3) exceeds --fail-above 0.01" in err  # issue 23 item 2: one grammatical line


def test_convert_between_formats_is_lossless(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    rng = np.random.default_rng(6)
    tensors: dict[str, np.ndarray] = {
        "x": rng.standard_normal((5, 7)).astype(np.float32),
        "n": np.arange(6),
    }
    write_safetensors(src, tensors, {"format": "pt"})
    canonical = tmp_path / "canonical.safetensors"
    h5 = tmp_path / "a.h5"
    back = tmp_path / "b.safetensors"
    assert main(["convert", "-q", str(src), str(canonical)]) == 0
    assert main(["convert", "-q", str(canonical), str(h5)]) == 0
    assert main(["convert", "-q", str(h5), str(back)]) == 0
    # Same bytes after a trip through HDF5: names, order, dtypes, values and metadata.
    assert back.read_bytes() == canonical.read_bytes()
    with safe_open(str(back), framework="np") as handle:
        assert handle.metadata() == {"format": "pt"}
        for name, array in tensors.items():
            assert handle.get_tensor(name).tobytes() == array.tobytes()
    code, _, err = run(
        "convert", str(SAMPLE_DATA / "tiny_mlp_bf16.safetensors"), str(tmp_path / "x.h5")
    )
    assert code == 2
    assert "bfloat16" in err


def test_convert_sharded_to_single_file_and_back(tmp_path: Path) -> None:
    tensors = hf_tensors()
    model = make_hf_dir(tmp_path / "model", tensors)
    single = tmp_path / "single.safetensors"
    assert main(["convert", "-q", str(model), str(single)]) == 0
    with safe_open(str(single), framework="np") as handle:
        assert sorted(handle.keys()) == sorted(tensors)
        assert handle.metadata() == {"format": "pt"}
    again = tmp_path / "again"
    assert main(["convert", "-q", str(single), f"{again}/"]) == 0
    assert [p.name for p in again.iterdir()] == ["model.safetensors"]


def test_terminal_chart_draws_bars_and_limit(tmp_path: Path) -> None:
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    code, out, _ = run("norms", str(model), "--group-by", "layer", "--chart", "--limit", "40")
    assert code == 0
    lines = [line for line in out.splitlines() if "model.layers." in line]
    assert len(lines) == 7
    assert all("│" in line for line in lines)
    exploded = next(line for line in lines if "model.layers.3 " in line)
    assert exploded.count("█") > max(line.count("█") for line in lines if line is not exploded)
    assert "limit 40 (│): 1 of 8 over" in out


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = make_hf_dir(tmp_path / "model", hf_tensors())
    png = tmp_path / "profile.png"
    code, _, err = run(
        "norms", str(model), "--group-by", "layer", "--plot", str(png), "--limit", "40"
    )
    assert code == 0, err
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300
    assert height > 200


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(
        ["norms", str(SAMPLE_DATA / "tiny_mlp.safetensors"), "--plot", str(tmp_path / "p.png")]
    )
    assert code == 2
    err = capsys.readouterr().err
    # The hint fits how clipcli runs (issue 23, item 14): this one from its checkout.
    assert f"-m pip install -e '{SAMPLE_DATA.parent}[plot]'" in err
    assert err.count("\n") == 1


def test_jsonl_streams_one_row_per_line() -> None:
    code, out, _ = run("norms", str(SAMPLE_DATA / "tiny_mlp.safetensors"), "--format", "jsonl")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["name"] for r in rows][:2] == ["embed.weight", "head.weight"]  # natural order
    assert set(rows[0]) == {
        "name",
        "dtype",
        "shape",
        "numel",
        "norm",
        "max_abs",
        "nonfinite",
        "in_global",
        "role",
    }


def test_subprocess_recipe_check_then_clip(tmp_path: Path) -> None:
    """The README recipe: `norms --fail-above C || clip --global C`."""
    src = str(SAMPLE_DATA / "tiny_mlp.safetensors")
    out = tmp_path / "fixed.safetensors"
    cli = [sys.executable, "-m", "clipcli"]
    check = subprocess.run([*cli, "norms", "--fail-above", "5", src], capture_output=True)
    assert check.returncode == 1
    subprocess.run([*cli, "clip", "--global", "5", "-q", src, str(out)], check=True)
    again = subprocess.run([*cli, "norms", "--fail-above", "5", str(out)], capture_output=True)
    assert again.returncode == 0


def test_groups_and_name_sort_follow_layer_numbers_not_text_order(tmp_path: Path) -> None:
    """safetensors stores names sorted as text (layers.10 before layers.2); a per-layer
    profile must still read 0, 1, 2, ..., 11, with the unmatched tensors last."""
    tensors = {
        f"model.layers.{i}.mlp.weight": np.full(4, float(i + 1), np.float32) for i in range(12)
    }
    tensors["lm_head.weight"] = np.ones(4, np.float32)
    in_text_order = {name: tensors[name] for name in sorted(tensors)}  # as HF writers store them
    path = write_safetensors(tmp_path / "m.safetensors", in_text_order)
    groups = run_json("norms", str(path), "--group-by", "layer")["groups"]
    assert [g["group"] for g in groups] == [f"model.layers.{i}" for i in range(12)] + ["(other)"]
    assert [g["norm"] for g in groups[:-1]] == [2.0 * (i + 1) for i in range(12)]
    rows = run_json("norms", str(path), "--sort", "name")["tensors"]
    assert [r["name"] for r in rows] == ["lm_head.weight"] + [
        f"model.layers.{i}.mlp.weight" for i in range(12)
    ]
