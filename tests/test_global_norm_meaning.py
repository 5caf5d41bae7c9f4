""" "global norm" means one thing in `norms` and `diff` (issue 23, item 4).

On a legacy Keras full model (FER-2013 style: model_weights/ plus optimizer_weights/ with
Adam's float32 `iterations:0` = 92494), `norms` gave the weights' global norm while
`diff` summed every floating-point tensor, the step counter included. Both now count model
weights only by the same rules (clipcli.jobs.roles; --include/--exclude; --all-tensors brings
training state back). The references are numpy float64 sums over names chosen here by
hand, read back with h5py and safetensors' own readers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from layouts import legacy_keras_full_model
from safetensors import safe_open

from clipcli.api import diff
from clipcli.jobs.selection import Selection

OPTIMIZER = "optimizer_weights/"
BUFFERS = ("moving_mean:0", "moving_variance:0")


def _is_weight(name: str) -> bool:
    return not name.startswith(OPTIMIZER) and not name.endswith(BUFFERS)


def _reference(tensors: dict[str, np.ndarray], every: bool = False) -> float:
    total = sum(
        float(np.sum(np.square(a.astype(np.float64))))
        for name, a in tensors.items()
        if every or _is_weight(name)
    )
    return math.sqrt(total)


@pytest.fixture
def fer(tmp_path: Path, run_main: Any) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """fer.hdf5 (a Keras full model with optimizer state) and its lossless safetensors copy."""
    h5 = tmp_path / "fer.hdf5"
    legacy_keras_full_model(h5)
    st = tmp_path / "fer.safetensors"
    assert run_main("convert", h5, st).code == 0
    with h5py.File(h5, "r") as f:
        tensors: dict[str, np.ndarray] = {}
        f.visititems(
            lambda name, obj: (
                tensors.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    with safe_open(str(st), "np") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert handle.get_tensor(name).tobytes() == tensors[name].tobytes()
    return h5, st, tensors


def _json(run_main: Any, *args: Any) -> Any:
    result = run_main(*args, "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_diff_and_norms_give_the_same_global_norm(run_main: Any, fer: Any) -> None:
    h5, st, tensors = fer
    expected = _reference(tensors)
    assert tensors["optimizer_weights/Adam/iterations:0"] == np.float32(92494.0)
    assert expected < 100  # the counter alone would make it over 92494
    for a, b in [(h5, st), (st, h5), (h5, h5)]:
        document = _json(run_main, "diff", a, b)
        assert document["global_norm_a"] == pytest.approx(expected, rel=1e-12)
        assert document["global_norm_b"] == pytest.approx(expected, rel=1e-12)
        assert document["global_norm_a"] == _json(run_main, "norms", a)["global_norm"]
        assert document["global_norm_b"] == _json(run_main, "norms", b)["global_norm"]
        assert document["training_state"] == 5  # 3 optimizer slots, 2 BatchNorm statistics
        norms_rows = {r["name"]: r["in_global"] for r in _json(run_main, "norms", a)["tensors"]}
        assert {t.name: t.in_global for t in diff(a, b).tensors} == norms_rows


def test_all_tensors_counts_training_state_in_both(run_main: Any, fer: Any) -> None:
    h5, st, tensors = fer
    document = _json(run_main, "diff", h5, st, "--all-tensors")
    expected = _reference(tensors, every=True)
    assert expected > 92494
    assert document["global_norm_a"] == pytest.approx(expected, rel=1e-12)
    assert document["global_norm_a"] == _json(run_main, "norms", h5, "--all-tensors")["global_norm"]
    assert document["training_state"] == 0
    assert all(t.in_global for t in diff(h5, st, Selection(all_tensors=True)).tensors)


def test_include_and_exclude_select_the_same_tensors(run_main: Any, fer: Any) -> None:
    h5, st, tensors = fer
    pattern = "model_weights/dense_2/*"
    document = _json(run_main, "diff", h5, st, "--exclude", pattern)
    kept = {n: a for n, a in tensors.items() if not n.startswith("model_weights/dense_2/")}
    assert document["global_norm_a"] == pytest.approx(_reference(kept), rel=1e-12)
    assert (
        document["global_norm_a"]
        == _json(run_main, "norms", h5, "--exclude", pattern)["global_norm"]
    )


def test_the_global_difference_counts_weights_only(run_main: Any, fer: Any) -> None:
    """A clip copies training state unchanged; a changed optimizer slot (here by hand)
    is listed as changed but stays out of ‖A−B‖, as it stays out of the norm."""
    h5, _, tensors = fer
    edited = h5.with_name("edited.hdf5")
    edited.write_bytes(h5.read_bytes())
    with h5py.File(edited, "r+") as f:
        f["optimizer_weights/Adam/iterations:0"][()] = np.float32(92495.0)
    document = _json(run_main, "diff", h5, edited)
    rows = {r["name"]: r for r in document["tensors"]}
    assert rows["optimizer_weights/Adam/iterations:0"]["status"] == "changed"
    assert document["global_diff_norm"] == 0.0
    assert document["global_norm_a"] == pytest.approx(_reference(tensors), rel=1e-12)
    every = _json(run_main, "diff", h5, edited, "--all-tensors")
    assert every["global_diff_norm"] == 1.0


def test_the_footer_says_what_is_left_out(run_main: Any, fer: Any) -> None:
    h5, st, _ = fer
    out = run_main("diff", h5, st).stdout.splitlines()
    assert out[-1] == (
        "5 training-state tensors compared, not in the global figures (--all-tensors counts them)"
    )
    assert out[-3].startswith("global norm A 14.1122, B 14.1122,")
    assert "training-state" not in run_main("diff", h5, st, "--all-tensors").stdout


def test_a_plain_callable_selection_follows_the_default_rules(fer: Any) -> None:
    h5, st, tensors = fer
    result = diff(h5, st, lambda name: bool(name))
    assert result.global_norm_a == pytest.approx(_reference(tensors), rel=1e-12)
    assert result.training_state == 5
