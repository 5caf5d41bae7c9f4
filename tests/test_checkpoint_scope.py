"""Issue 11, items 2, 3, 4, 8, 10: what norms/clip/diff act on in real checkpoint layouts.

Fixtures come from tests/layouts.py (h5py and hand-written safetensors); outputs are read
back with h5py and safetensors.safe_open, norms checked against exact Fraction sums."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RunCli
from expect import one_error_line
from handmade import write_safetensors
from layouts import (
    block_fp8_shard,
    hf_names,
    keras2_save_weights,
    keras3_nested_weights,
    legacy_keras_full_model,
)
from safetensors.numpy import load_file, save_file

from clipcli.formats.base import TensorInfo
from clipcli.jobs import quantized, roles, scope
from clipcli.jobs.groups import compile_group_by, group_key


def exact_norm(arrays: list[np.ndarray]) -> float:
    """sqrt of the exact sum of squares (Fractions of the stored values)."""
    total = sum(
        (Fraction(float(v)) ** 2 for a in arrays for v in np.asarray(a, np.float64).ravel()),
        Fraction(0),
    )
    return math.sqrt(total)


def read_h5(path: Path) -> dict[str, np.ndarray]:
    import h5py

    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    return out


def stderr_lines(text: str, level: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"clipcli: {level}:")]


# ------------------------------------------------------------------ item 2: roles


ROLE_EXAMPLES = {
    roles.Role.WEIGHT: [
        "model_weights/dense_1/dense_1/kernel:0",
        "model.layers.0.self_attn.q_proj.weight",
        "layers/dense/vars/0",
        "bn.weight",
        "optimizer_head.weight",  # a layer named like an optimizer is still a weight
        "model.optimizer.weight",  # only the first component marks optimizer state
    ],
    roles.Role.OPTIMIZER: [
        "optimizer_weights/Adam/iterations:0",
        "optimizer_weights/training/Adam/dense_1/kernel/m:0",
        "optimizer/vars/0",
        "optimizer.state.0.exp_avg",
        "optim_state.state.3.exp_avg_sq",
        "optimizer_state/step",
    ],
    roles.Role.BUFFER: [
        "model_weights/bn/bn/moving_mean:0",
        "bn/bn/moving_variance:0",
        "encoder.bn1.running_mean",
        "encoder.bn1.running_var",
        "encoder.bn1.num_batches_tracked",
    ],
    # Named like weights, but integer or bool (classified with floating=False).
    roles.Role.NON_FLOAT: [
        "bert.embeddings.position_ids",
        "step",
        "model.layers.0.self_attn.q_proj.weight",
    ],
}


@pytest.mark.parametrize("role", roles.BY_NAME)
def test_every_role_has_examples_that_classify_to_it(role: roles.Role) -> None:
    assert ROLE_EXAMPLES[role]
    for name in ROLE_EXAMPLES[role]:
        assert roles.classify(name, floating=role is not roles.Role.NON_FLOAT) is role, name
    assert role.description


def test_every_role_is_decided_by_name_or_by_a_view() -> None:
    assert set(roles.BY_NAME) | {roles.Role.QUANTIZATION} == set(roles.Role)
    assert roles.Role.QUANTIZATION.description
    assert roles.Role.QUANTIZATION.kept_apart
    assert not roles.Role.QUANTIZATION.training_state  # --all-tensors does not bring it in
    # A name alone never makes a quantization part, whatever it says.
    names = [n for examples in ROLE_EXAMPLES.values() for n in examples]
    names += ["model.layers.0.mlp.down_proj.weight_scale_inv", "x.weight_scale", "x_scales"]
    assert all(roles.classify(n) is not roles.Role.QUANTIZATION for n in names)


def test_norms_on_legacy_keras_count_model_weights_only(tmp_path: Path, run_main: Any) -> None:
    path = tmp_path / "m.h5"
    tensors = legacy_keras_full_model(path)
    result = run_main("norms", path, "--format", "json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {r["name"]: r for r in report["tensors"]}
    expected_roles = {n: roles.classify(n).value for n in tensors}
    assert {n: r["role"] for n, r in rows.items()} == expected_roles
    weights = [a for n, a in tensors.items() if expected_roles[n] == "weight"]
    assert report["global_norm"] == pytest.approx(exact_norm(weights), rel=1e-12)
    assert report["global_norm"] < 100  # the step counter (92494) is not in it
    for name, row in rows.items():
        assert row["in_global"] is (expected_roles[name] == "weight"), name
    # The one line about what was left out goes to stderr; stdout stays pure JSON.
    (note,) = stderr_lines(result.stderr, "note")
    assert "3 optimizer tensors" in note  # countable nouns since issue 23, item 6
    assert "2 BatchNorm statistics" in note
    assert "--all-tensors" in note


def test_all_tensors_brings_training_state_back(tmp_path: Path, run_main: Any) -> None:
    path = tmp_path / "m.h5"
    tensors = legacy_keras_full_model(path)
    result = run_main("norms", path, "--format", "json", "--all-tensors")
    assert result.code == 0
    report = json.loads(result.stdout)
    assert report["global_norm"] == pytest.approx(exact_norm(list(tensors.values())), rel=1e-12)
    assert all(r["in_global"] for r in report["tensors"])
    assert not stderr_lines(result.stderr, "note")


def test_clip_global_scales_weights_and_copies_training_state(
    tmp_path: Path, run_main: Any
) -> None:
    path, out = tmp_path / "m.h5", tmp_path / "out.h5"
    tensors = legacy_keras_full_model(path)
    result = run_main("clip", "--global", "5", path, out, "--format", "json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    written = read_h5(out)
    weights = [n for n in tensors if roles.classify(n) is roles.Role.WEIGHT]
    before = exact_norm([tensors[n] for n in weights])
    after = exact_norm([written[n] for n in weights])
    assert after <= 5.0
    assert after == pytest.approx(5.0, rel=1e-6)
    for name in weights:  # one factor for all weights: 5 / G, G of the weights alone
        nonzero = tensors[name] != 0
        ratio = written[name][nonzero].astype(np.float64) / tensors[name][nonzero]
        assert ratio == pytest.approx(5.0 / before, rel=1e-6), name
    for name in set(tensors) - set(weights):
        assert written[name].tobytes() == tensors[name].tobytes(), name
        assert written[name].dtype == tensors[name].dtype
    notes = {r["name"]: r["note"] for r in report["tensors"]}
    assert notes["optimizer_weights/Adam/iterations:0"] == "optimizer state, left unchanged"
    assert report["global_norm_before"] == pytest.approx(before, rel=1e-12)


def test_clip_all_tensors_rewrites_training_state_too(tmp_path: Path, run_main: Any) -> None:
    path, out = tmp_path / "m.h5", tmp_path / "out.h5"
    tensors = legacy_keras_full_model(path)
    result = run_main("clip", "--global", "5", "--all-tensors", "-q", path, out)
    assert result.code == 0, result.stderr
    written = read_h5(out)
    assert exact_norm(list(written.values())) == pytest.approx(5.0, rel=1e-6)
    assert (
        written["optimizer_weights/Adam/iterations:0"]
        != tensors["optimizer_weights/Adam/iterations:0"]
    )


def test_pytorch_style_training_state_in_safetensors(tmp_path: Path, run_main: Any) -> None:
    path, out = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    tensors: dict[str, np.ndarray] = {
        "conv.weight": np.full((2, 2), 3.0, np.float32),
        "bn.running_mean": np.full(2, 1e4, np.float32),
        "bn.running_var": np.full(2, 1e4, np.float32),
        "bn.num_batches_tracked": np.array(7, np.int64),
        "optimizer.state.0.exp_avg": np.full((2, 2), 1e3, np.float32),
    }
    write_safetensors(path, tensors)
    result = run_main("clip", "--norm", "1", path, out, "-q")
    assert result.code == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert exact_norm([got["conv.weight"]]) == pytest.approx(1.0, rel=1e-6)
    for name in tensors.keys() - {"conv.weight"}:
        assert got[name].tobytes() == tensors[name].tobytes(), name


def test_selection_of_training_state_only_is_exit_2(tmp_path: Path, run_main: Any) -> None:
    path = tmp_path / "m.h5"
    legacy_keras_full_model(path)
    result = run_main("norms", path, "--include", "optimizer_weights/*")
    assert result.code == 2
    assert "--all-tensors" in result.stderr
    assert "optimizer state" in result.stderr
    assert run_main("norms", path, "--include", "optimizer_weights/*", "--all-tensors").code == 0


def test_diff_compares_training_state(tmp_path: Path, run_main: Any) -> None:
    """diff is about files: training state is compared (and identical after a clip)."""
    path, out = tmp_path / "m.h5", tmp_path / "out.h5"
    legacy_keras_full_model(path)
    assert run_main("clip", "--global", "5", "-q", path, out).code == 0
    result = run_main("diff", path, out, "--format", "json")
    rows = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}
    assert rows["optimizer_weights/Adam/iterations:0"]["status"] == "same"
    assert rows["model_weights/dense_1/dense_1/kernel:0"]["status"] == "changed"


def test_nonfinite_training_state_does_not_block_a_clip(tmp_path: Path, run_main: Any) -> None:
    """Adam moments holding NaN are not weights: no refusal, and copied as they are."""
    path, out = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    moments = np.array([np.nan, 1.0, np.inf], np.float32)
    write_safetensors(
        path, {"w": np.full(4, 2.0, np.float32), "optimizer.state.0.exp_avg": moments}
    )
    result = run_main("clip", "--global", "1", "-q", path, out)
    assert result.code == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        assert f.get_tensor("optimizer.state.0.exp_avg").tobytes() == moments.tobytes()
    assert run_main("clip", "--global", "1", "--all-tensors", path, tmp_path / "x.npz").code == 4


# ------------------------------------------------------------------ item 3: empty selection


def _small(tmp_path: Path) -> Path:
    return write_safetensors(
        tmp_path / "m.safetensors",
        {
            "layers.0.attention.weight": np.ones((2, 2), np.float32),
            "layers.0.mlp.weight": np.ones((2, 2), np.float32),
        },
    )


@pytest.mark.parametrize("command", ["norms", "clip", "diff"])
def test_empty_selection_is_exit_2_with_a_hint(tmp_path: Path, run_main: Any, command: str) -> None:
    path = _small(tmp_path)
    out = tmp_path / "out.safetensors"
    args = {
        "norms": ["norms", path],
        "clip": ["clip", "--global", "1", path, out],
        "diff": ["diff", path, path, "--fail-above", "0"],
    }[command]
    result = run_main(*args, "--include", "attention")
    assert result.code == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("clipcli: error: no tensor selected by --include 'attention'")
    assert "'*attention*'" in line
    assert not out.exists()


def test_empty_selection_without_hint_names_every_pattern(tmp_path: Path, run_main: Any) -> None:
    path = _small(tmp_path)
    result = run_main(
        "clip", "--global", "1", path, tmp_path / "o.safetensors", "-i", "nomatch*", "-x", "zz"
    )
    assert result.code == 2
    assert "--include 'nomatch*' --exclude 'zz'" in result.stderr
    assert "did you mean" not in result.stderr


def test_exclude_of_everything_is_an_empty_selection(tmp_path: Path, run_main: Any) -> None:
    path = _small(tmp_path)
    assert run_main("norms", path, "--exclude", "*").code == 2


def test_dead_pattern_beside_live_one_is_a_warning(tmp_path: Path, run_main: Any) -> None:
    path = _small(tmp_path)
    result = run_main(
        "norms", path, "--format", "json", "-i", "*mlp*", "-i", "attention", "-x", "nothing"
    )
    assert result.code == 0
    assert [r["name"] for r in json.loads(result.stdout)["tensors"]] == ["layers.0.mlp.weight"]
    warnings = stderr_lines(result.stderr, "warning")
    assert warnings == [
        "clipcli: warning: --include 'attention' matches no tensor (did you mean '*attention*'?)",
        "clipcli: warning: --exclude 'nothing' matches no tensor",
    ]


def test_empty_selection_is_refused_before_any_data_is_read(tmp_path: Path) -> None:
    """A reader whose data cannot be read at all: the selection check comes first."""
    from clipcli.api import measure_reader
    from clipcli.errors import UsageError
    from clipcli.jobs.selection import Selection

    class NoData:
        path = tmp_path / "x"
        format_name = "test"
        metadata: dict[str, str] = {}
        infos = [TensorInfo("a", np.dtype(np.float32), (2,), 8)]

        def chunk_loaders(self: object, _info: TensorInfo) -> None:
            raise AssertionError("data was read")

        chunks = chunk_loaders

    with pytest.raises(UsageError, match="no tensor selected"):
        measure_reader(NoData(), Selection(("b",)))  # type: ignore[arg-type]


# ------------------------------------------------------------------ item 4: --group-by layer


LAYER_CASES = {
    "keras2-save-weights": (
        ["dense_1/dense_1/kernel:0", "dense_1/dense_1/bias:0", "dense_2/dense_2/kernel:0"],
        ["dense_1", "dense_1", "dense_2"],
    ),
    "keras3-flat-and-nested": (
        ["layers/dense/vars/0", "block1/layers/conv2d/vars/0", "layers/seq/layers/d/vars/1"],
        ["dense", "block1/layers/conv2d", "seq/layers/d"],
    ),
    "legacy-keras": (
        ["model_weights/dense_1/dense_1/kernel:0", "model_weights/bn/bn/gamma:0"],
        ["dense_1", "bn"],
    ),
    "hf": (
        [
            "model.layers.3.mlp.up_proj.weight",
            "transformer.h.11.attn.c_attn.weight",
            "bert.encoder.layer.2.attention.self.query.weight",
            "blocks.4.attn.qkv.weight",
            "layers.10.feed_forward.w1.weight",
            "h.7.mlp.c_fc.weight",
            "model.embed_tokens.weight",
        ],
        [
            "model.layers.3",
            "transformer.h.11",
            "bert.encoder.layer.2",
            "blocks.4",
            "layers.10",
            "h.7",
            "(other)",
        ],
    ),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_preset_names_groups(case: str) -> None:

    names, groups = LAYER_CASES[case]
    pattern = compile_group_by("layer")
    assert [group_key(n, pattern) for n in names] == groups


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (keras2_save_weights, {"dense_1", "dense_2"}),
        (keras3_nested_weights, {"block1/layers/conv2d", "dense"}),
        (legacy_keras_full_model, {"dense_1", "dense_2", "batch_normalization_1"}),
    ],
    ids=["keras2", "keras3", "legacy"],
)
def test_group_by_layer_on_keras_files(
    tmp_path: Path, run_main: Any, build: Any, expected: set[str]
) -> None:
    path = tmp_path / "w.h5"
    build(path)
    result = run_main("norms", path, "--group-by", "layer", "--format", "json")
    assert result.code == 0, result.stderr
    assert {g["group"] for g in json.loads(result.stdout)["groups"]} == expected
    assert not stderr_lines(result.stderr, "warning")


def test_per_layer_clip_of_keras2_file_clips_each_layer(tmp_path: Path, run_main: Any) -> None:
    path, out = tmp_path / "w.h5", tmp_path / "o.h5"
    tensors = keras2_save_weights(path)
    limit = 1.0
    assert (
        run_main("clip", "--global", str(limit), "--group-by", "layer", "-q", path, out).code == 0
    )
    written = read_h5(out)
    for layer in ("dense_1", "dense_2"):
        names = [n for n in tensors if n.startswith(layer + "/")]
        assert exact_norm([tensors[n] for n in names]) > limit
        assert exact_norm([written[n] for n in names]) == pytest.approx(limit, rel=1e-6)


@pytest.mark.parametrize(("count", "warned"), [(1, False), (2, True)])
def test_one_group_taking_every_tensor_is_said(
    tmp_path: Path, run_main: Any, count: int, warned: bool
) -> None:
    """At the limit: one tensor in one group is no news; two in one group are."""
    tensors = {f"w{i}": np.full(3, 2.0, np.float32) for i in range(count)}
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    for args in (
        ["norms", path, "--group-by", "layer"],
        [
            "clip",
            "--global",
            "1",
            "--group-by",
            "layer",
            "-q",
            path,
            tmp_path / f"o{count}.safetensors",
        ],
    ):
        result = run_main(*args)
        assert result.code == 0, result.stderr
        warnings = stderr_lines(result.stderr, "warning")
        assert bool(warnings) is warned
        if warned:
            assert "all 2 tensors into one group '(other)'" in warnings[0]


def test_two_groups_are_not_warned(tmp_path: Path, run_main: Any) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", hf_names("model.layers.", 2))
    result = run_main("norms", path, "--group-by", "layer")
    assert result.code == 0
    assert not stderr_lines(result.stderr, "warning")


def test_group_by_layer_on_sentence_transformers_directory(tmp_path: Path, run_main: Any) -> None:
    model = tmp_path / "st"
    (model / "1_Pooling").mkdir(parents=True)
    (model / "modules.json").write_text(json.dumps([{"path": "1_Pooling"}]))
    (model / "1_Pooling" / "config.json").write_text("{}")
    (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": np.ones((3, 2), np.float32)
    }
    for i in range(2):
        tensors[f"encoder.layer.{i}.attention.self.query.weight"] = np.full((2, 2), i + 1.0)
        tensors[f"encoder.layer.{i}.attention.self.query.bias"] = np.ones(2, np.float32)
    tensors = {n: a.astype(np.float32) for n, a in tensors.items()}
    write_safetensors(model / "model.safetensors", tensors)
    result = run_main("norms", model, "--group-by", "layer", "--format", "json")
    assert result.code == 0, result.stderr
    groups = {g["group"]: g["tensors"] for g in json.loads(result.stdout)["groups"]}
    assert groups == {"encoder.layer.0": 2, "encoder.layer.1": 2, "(other)": 1}
    assert not result.stderr


# ------------------------------------------------------------------ item 8: quantized


def _mxfp4(tmp_path: Path) -> Path:
    return write_safetensors(
        tmp_path / "gpt.safetensors",
        {
            "model.layers.0.mlp.experts.down_proj_blocks": np.zeros((2, 4, 16), np.uint8),
            "model.layers.0.mlp.experts.down_proj_scales": np.full((2, 4), 127, np.uint8),
            "model.layers.0.attn.weight": np.ones((2, 2), np.float32) * 9,
        },
    )


def _channel_fp8(tmp_path: Path) -> Path:
    import ml_dtypes

    return write_safetensors(
        tmp_path / "ct.safetensors",
        {
            "layers.0.q.weight": np.ones((4, 4), ml_dtypes.float8_e4m3fn),
            "layers.0.q.weight_scale": np.full((4, 1), 0.5, np.float32),
            "layers.0.q.input_scale": np.array([0.1], np.float32),
            "layers.0.norm.weight": np.ones(4, np.float32) * 9,
        },
    )


@pytest.mark.parametrize(
    ("build", "scheme"),
    [
        (lambda p: block_fp8_shard(p / "fp8.safetensors") and p / "fp8.safetensors", "block"),
        (_mxfp4, "mxfp4"),
        (_channel_fp8, "fp8-channel"),  # issue 21: read through its scale now
    ],
    ids=["block-fp8", "mxfp4", "channel-fp8"],
)
def test_quantized_weights_are_read_by_norms_and_refused_by_clip(
    tmp_path: Path, run_main: Any, build: Any, scheme: str
) -> None:
    path = build(tmp_path)
    norms = run_main("norms", path, "--format", "json")
    assert norms.code == 0
    json.loads(norms.stdout)
    diff = run_main("diff", path, path)
    assert diff.code == 0
    # issue 21: every layout here is measured as its real values now, nothing to warn of
    assert not stderr_lines(norms.stderr, "warning")
    assert not stderr_lines(diff.stderr, "warning")
    # issue 21: a factor goes through float scales (tests/test_quantized_clip.py) and, as
    # a power of two, through MXFP4's E8M0 exponents (tests/test_quant_mxfp4_clip.py);
    # --value is never linear in the scales
    for mode in (["--global", "1"], ["--norm", "1"], ["--average", "1"]):
        out = tmp_path / "scaled.safetensors"
        clip = run_main("clip", *mode, path, out, "-q")
        assert clip.code == 0, (mode, clip.stderr)
        out.unlink()
    refused = [["--value", "1"]]
    for mode in refused:
        out = tmp_path / "out.safetensors"
        clip = run_main("clip", *mode, path, out)
        assert clip.code == 4, (mode, clip.stderr)
        (line,) = clip.stderr.splitlines()
        assert "quantized" in line
        assert "--exclude" in line
        assert scheme in line
        assert not out.exists()


def test_clip_leaving_quantized_tensors_out_is_allowed(tmp_path: Path, run_main: Any) -> None:
    path, out = tmp_path / "fp8.safetensors", tmp_path / "o.safetensors"
    tensors = block_fp8_shard(path)
    result = run_main("clip", "--norm", "1", path, out, "-q", "-x", "*down_proj.weight*")
    assert result.code == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        norm = f.get_tensor("model.norm.weight")
    assert scale.tobytes() == tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].tobytes()
    assert exact_norm([norm]) == pytest.approx(1.0, rel=1e-6)


def test_model_directory_with_quantization_config(tmp_path: Path, run_main: Any) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", {"w.qweight": np.ones((2, 2), np.float32)})
    (model / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}})
    )
    # Issue 21: the config's scheme is read, and tensors that do not make up its weights
    # are a refusal (exit 3, one line), never raw codes measured with a warning.
    norms = run_main("norms", model)
    assert norms.code == 3
    (line,) = norms.stderr.splitlines()
    assert "w.qweight" in line
    assert "w.qzeros" in line
    clip = run_main("clip", "--global", "1", model, tmp_path / "out/")
    assert clip.code == 3
    assert "w.qzeros" in clip.stderr
    assert not (tmp_path / "out").exists()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not stderr_lines(run_main("norms", model).stderr, "warning")


@pytest.mark.parametrize(
    ("dtype", "found"),
    [(np.uint8, True), (np.int8, True), (np.float16, False)],
    ids=["1-byte", "int8", "2-byte"],
)
def test_scale_companion_needs_one_byte_codes(dtype: Any, found: bool) -> None:
    """At the limit: itemsize 1 is a code; a float16 'weight' beside a weight_scale is not."""
    infos = [
        TensorInfo("x.weight", np.dtype(dtype), (4,), 4 * np.dtype(dtype).itemsize),
        TensorInfo("x.weight_scale", np.dtype(np.float32), (), 4),
    ]
    assert bool(quantized.detect(infos)) is found


def test_oversized_config_is_not_read(tmp_path: Path, monkeypatch: Any) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    size = config.stat().st_size
    monkeypatch.setattr(quantized, "CONFIG_LIMIT", size)
    assert quantized.declared_method(tmp_path) == "fp8"
    monkeypatch.setattr(quantized, "CONFIG_LIMIT", size - 1)
    assert quantized.declared_method(tmp_path) is None


# ------------------------------------------------------------------ item 10: --axes


def _attention_model(tmp_path: Path, biases: int = 5) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {}
    for i in range(biases):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = rng.normal(size=(4, 6)).astype(
            np.float32
        )
        tensors[f"model.layers.{i}.self_attn.q_proj.bias"] = rng.normal(size=4).astype(np.float32)
    return write_safetensors(tmp_path / "m.safetensors", tensors), tensors


def test_axes_refusal_is_short_and_names_the_fix(tmp_path: Path, run_main: Any) -> None:
    path, _ = _attention_model(tmp_path)
    out = tmp_path / "o.safetensors"
    result = run_main("clip", "--norm", "1", "--axes", "1", "--include", "*self_attn*", path, out)
    assert result.code == 4
    (line,) = result.stderr.splitlines()
    assert "5 selected tensors have too few dimensions for --axes 1" in line
    assert "'model.layers.0.self_attn.q_proj.bias' [4]" in line
    assert "and 2 more" in line
    assert "--skip-low-rank" in line
    assert len(line) < 400
    assert not out.exists()


def test_readme_recipe_with_skip_low_rank(tmp_path: Path, run_main: Any) -> None:
    path, tensors = _attention_model(tmp_path)
    out = tmp_path / "o.safetensors"
    result = run_main(
        "clip", "--norm", "1", "--axes", "1", "--include", "*self_attn*", "--skip-low-rank",
        path, out, "--format", "json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    (note,) = stderr_lines(result.stderr, "note")
    assert "5 tensors have too few dimensions for --axes 1" in note
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    rows = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}
    for name, array in tensors.items():
        if name.endswith("bias"):
            assert got[name].tobytes() == array.tobytes()
            assert rows[name]["note"] == "skipped: too few dimensions for --axes"
            assert rows[name]["changed"] is False
        else:
            for row in range(array.shape[0]):
                assert exact_norm([got[name][row]]) <= 1.0
                assert exact_norm([got[name][row]]) == pytest.approx(
                    min(1.0, exact_norm([array[row]])), rel=1e-6
                )


@pytest.mark.parametrize(
    ("axes", "shape", "fits"),
    [((0,), (3,), True), ((-1,), (3,), True), ((1,), (3,), False), ((-2,), (3,), False),
     ((1,), (3, 4), True), ((-2,), (3, 4), True), ((2,), (3, 4), False)],
)  # fmt: skip
def test_axes_fit_at_the_rank_limit(
    axes: tuple[int, ...], shape: tuple[int, ...], fits: bool
) -> None:
    assert scope.axes_fit(axes, shape) is fits


def test_skip_low_rank_needs_axes(tmp_path: Path, run_main: Any) -> None:
    path, _ = _attention_model(tmp_path, 1)
    result = run_main("clip", "--norm", "1", "--skip-low-rank", path, tmp_path / "o.safetensors")
    assert result.code == 2
    assert "--skip-low-rank" in result.stderr


@pytest.mark.parametrize(
    ("count", "text"), [(3, "'a0', 'a1', 'a2'"), (4, "'a0', 'a1', 'a2' and 1 more")]
)
def test_first_few_at_the_limit(count: int, text: str) -> None:
    assert scope.first_few([f"a{i}" for i in range(count)]) == text


@pytest.mark.parametrize(
    ("command", "options"),
    [("norms", ["--all-tensors"]), ("clip", ["--all-tensors", "--skip-low-rank"])],
)
def test_help_documents_the_new_options(run_main: Any, command: str, options: list[str]) -> None:
    result = run_main(command, "--help")
    assert result.code == 0
    for option in options:
        assert option in result.stdout


# -------------------------------------------------- issue 23, item 9: --skip-low-rank


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


@pytest.mark.parametrize("all_tensors", [False, True])
def test_the_weights_acted_on_are_those_left_out_lets_through(all_tensors: bool) -> None:
    """check_weights classifies each name once and gives the tensors a clip acts on: the
    same as asking left_out() of each (optimizer state, buffers, quantization parts)."""
    from clipcli.jobs.selection import Selection

    names = [
        "model.w",
        "optimizer.state.0.exp_avg",
        "bn.running_mean",
        "bn.num_batches_tracked",
        "layers.0.weight_scale_inv",
        "callbacks.x",
        "loops.y",
        "moving_mean_like.w",
        "decoder.optim_w",
        "z",
    ]
    infos = [TensorInfo(n, np.dtype(np.float32), (2,), 8) for n in names]
    selection = Selection(all_tensors=all_tensors, parts=frozenset({"layers.0.weight_scale_inv"}))
    acted_on = selection.check_weights(infos, lambda *_: None, writes=True)
    assert acted_on == [i for i in infos if selection.left_out(i.name) is None]
    assert "model.w" in [i.name for i in acted_on]
    assert len(acted_on) < len(infos)
