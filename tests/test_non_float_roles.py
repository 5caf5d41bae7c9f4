"""Integer and bool tensors are no parameters, and their role is not `weight` (issue 23,
item 9).

`ls` counted MiniLM's int64 `position_ids` and tiny_mlp's `step` as parameters, and
`norms` showed `step`'s role as `weight`, while the README says `ls` counts parameters as
`norms` counts them (in_global). Now: `ls`'s parameters are exactly the elements `norms`
puts in the global norm; a tensor named like a weight that is not floating point has the
role `non-float` (name rules first: an int64 optimizer counter stays `optimizer`), and
`--all-tensors` never brings it in. The references: numpy's dtype kinds and sums of
`numel` over names chosen here by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from layouts import legacy_keras_full_model
from safetensors.numpy import save_file

from clipcli.dtypes import dtype_named, is_floating
from clipcli.formats.safetensors.header import DTYPE_NAMES
from clipcli.jobs import roles

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "tiny_mlp.safetensors"


def _json(run_main: Any, *args: Any) -> Any:
    result = run_main(*args, "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def _minilm_like(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": rng.standard_normal((30, 8)).astype(np.float32),
        "embeddings.position_ids": np.arange(512, dtype=np.int64)[None],
        "embeddings.token_type_ids": np.zeros((1, 512), np.int64),
        "encoder.layer.0.attention.mask": np.ones((4, 4), np.bool_),
        "encoder.layer.0.attention.self.query.weight": rng.standard_normal((8, 8)).astype(
            np.float16
        ),
        "pooler.dense.bias": np.zeros(8, np.float64),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _keras_with_integer_counter(path: Path) -> None:
    """A Keras full model whose optimizer counter is int64 (TF 2 Adam's `iterations`)."""
    import h5py

    legacy_keras_full_model(path)
    with h5py.File(path, "r+") as f:
        del f["optimizer_weights/Adam/iterations:0"]
        f["optimizer_weights/Adam/iterations:0"] = np.int64(92494)


@pytest.mark.parametrize("fixture", ["tiny_mlp", "minilm", "keras", "keras-int-counter"])
def test_ls_parameters_are_what_norms_counts(run_main: Any, tmp_path: Path, fixture: str) -> None:
    if fixture == "tiny_mlp":
        path = tmp_path / "m.safetensors"
        shutil.copy(SAMPLE, path)
    elif fixture == "minilm":
        path = tmp_path / "m.safetensors"
        _minilm_like(path)
    elif fixture == "keras":
        path = tmp_path / "m.h5"
        legacy_keras_full_model(path)
    else:
        path = tmp_path / "m.h5"
        _keras_with_integer_counter(path)
    listed = _json(run_main, "ls", path)
    measured = _json(run_main, "norms", path)["tensors"]
    counted = sum(t["numel"] for t in measured if t["in_global"])
    assert listed["total_parameters"] == counted
    by_role: dict[str, int] = {}
    for t in measured:
        by_role[t["role"]] = by_role.get(t["role"], 0) + t["numel"]
    assert listed["training_state_parameters"] == by_role.get("optimizer", 0) + by_role.get(
        "buffer", 0
    )
    assert listed["non_float_elements"] == by_role.get("non-float", 0)
    assert sum(t["numel"] for t in measured) == (
        listed["total_parameters"]
        + listed["training_state_parameters"]
        + listed["non_float_elements"]
    )
    for t in measured:  # a non-float tensor is never a weight
        kind = np.dtype(t["dtype"]).kind if t["dtype"] in np.sctypeDict else "f"
        if kind in "biu":
            assert t["role"] != "weight", t
            assert not t["in_global"]


def test_tiny_mlp_counts(run_main: Any) -> None:
    out = run_main("ls", SAMPLE).stdout
    assert "7 tensors, 4,480 parameters (+1 non-float), 17,928 bytes" in out
    rows = {t["name"]: t for t in _json(run_main, "norms", SAMPLE)["tensors"]}
    assert rows["step"]["role"] == "non-float"
    assert rows["head.weight"]["role"] == "weight"
    # 4,480 = the float tensors' elements: 64*32 + 32*32 + 32 + 32*32 + 32 + 10*32
    assert 64 * 32 + 32 * 32 + 32 + 32 * 32 + 32 + 10 * 32 == 4480


def test_minilm_counts(run_main: Any, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = _minilm_like(path)
    floats = sum(a.size for a in tensors.values() if a.dtype.kind == "f")
    others = sum(a.size for a in tensors.values() if a.dtype.kind != "f")
    out = run_main("ls", path).stdout
    assert f"6 tensors, {floats:,} parameters (+{others:,} non-float), " in out
    rows = {t["name"]: t["role"] for t in _json(run_main, "norms", path)["tensors"]}
    assert rows["embeddings.position_ids"] == "non-float"
    assert rows["encoder.layer.0.attention.mask"] == "non-float"


def test_training_state_and_non_float_are_said_apart(run_main: Any, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file(
        {
            "w": np.ones(3, np.float32),
            "optimizer.state.0.step": np.array(5, np.int64),
            "optimizer.state.0.exp_avg": np.ones(3, np.float32),
            "ids": np.arange(2, dtype=np.int32),
        },
        str(path),
    )
    out = run_main("ls", path).stdout
    assert "4 tensors, 3 parameters (+4 in training state, +2 non-float), " in out
    rows = {t["name"]: t["role"] for t in _json(run_main, "norms", path)["tensors"]}
    assert rows == {
        "w": "weight",
        "optimizer.state.0.step": "optimizer",  # the name says training state first
        "optimizer.state.0.exp_avg": "optimizer",
        "ids": "non-float",
    }


def test_all_tensors_does_not_count_non_float(run_main: Any, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones(4, np.float32), "step": np.array(7, np.int64)}, str(path))
    document = _json(run_main, "norms", path, "--all-tensors")
    rows = {t["name"]: t for t in document["tensors"]}
    assert rows["step"]["in_global"] is False
    assert rows["step"]["role"] == "non-float"
    assert document["global_norm"] == 2.0
    result = run_main("norms", path)
    assert result.stderr == ""  # no "left out ... pass --all-tensors" for an int tensor
    clip = _json(run_main, "clip", "--global", "1", "--dry-run", path, tmp_path / "o.safetensors")
    notes = {r["name"]: r["note"] for r in clip["tensors"]}
    assert notes["step"] == "not floating point"


def test_an_integer_selection_alone_is_not_refused_as_training_state(
    run_main: Any, tmp_path: Path
) -> None:
    """--include of integer tensors only measures them (global norm 0 over none), as
    before: they are not training state, so no `pass --all-tensors` refusal."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones(4, np.float32), "ids": np.arange(3, dtype=np.int64)}, str(path))
    result = run_main("norms", path, "--include", "ids")
    assert result.code == 0, result.stderr
    assert "--all-tensors" not in result.stderr


# numpy's own types and every safetensors dtype clipcli reads, named as `ls` names them.
DTYPES = sorted(
    {np.dtype(t).name for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16)}
    | {np.dtype(t).name for t in (np.int32, np.uint32, np.int64, np.uint64)}
    | {np.dtype(t).name for t in (np.float16, np.float32, np.float64, np.longdouble)}
    | {np.dtype(t).name for t in (np.complex64, np.complex128, np.clongdouble)}
    | set(DTYPE_NAMES.values())
    | {"float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "int4", "uint4", "int2", "uint2"}
)


@pytest.mark.parametrize("name", DTYPES)
def test_floating_by_name_agrees_with_the_dtype(name: str) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else dtype_named(name)
    assert dtype.name == name
    assert roles.is_floating_name(name) == is_floating(dtype)
    expected = dtype.kind in "fc" or name.startswith(("bfloat16", "float8", "float6", "float4"))
    assert roles.is_floating_name(name) == expected
