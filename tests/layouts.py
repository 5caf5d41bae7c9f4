"""Fixtures reproducing real checkpoint layouts (FORMATS.md, "Layouts met in real
checkpoints"), written with h5py and by hand, independent of clipcli's writers."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import h5py
import numpy as np
from handmade import write_safetensors
from safetensors.numpy import save_file

from clipcli.formats.keras_archive import WEIGHTS_MEMBER


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def legacy_keras_full_model(path: Path) -> dict[str, np.ndarray]:
    """Keras 2 `model.save('m.h5')`: model_weights/ with layer_names and weight_names,
    optimizer_weights/ with Adam's moments and a float32 step counter, root attributes
    model_config/training_config. Returns every dataset by name."""
    import h5py

    rng = _rng(1)
    weights = {
        "model_weights/dense_1/dense_1/kernel:0": rng.normal(size=(8, 16)).astype(np.float32),
        "model_weights/dense_1/dense_1/bias:0": rng.normal(size=16).astype(np.float32),
        "model_weights/batch_normalization_1/batch_normalization_1/gamma:0": np.ones(
            16, np.float32
        ),
        "model_weights/batch_normalization_1/batch_normalization_1/beta:0": np.zeros(
            16, np.float32
        ),
        "model_weights/batch_normalization_1/batch_normalization_1/moving_mean:0": (
            rng.normal(size=16).astype(np.float32) * 50
        ),
        "model_weights/batch_normalization_1/batch_normalization_1/moving_variance:0": (
            rng.uniform(1, 90, size=16).astype(np.float32)
        ),
        "model_weights/dense_2/dense_2/kernel:0": rng.normal(size=(16, 4)).astype(np.float32),
        "model_weights/dense_2/dense_2/bias:0": rng.normal(size=4).astype(np.float32),
    }
    optimizer = {
        "optimizer_weights/Adam/iterations:0": np.array(92494.0, np.float32),
        "optimizer_weights/training/Adam/dense_1/kernel/m:0": rng.normal(size=(8, 16)).astype(
            np.float32
        ),
        "optimizer_weights/training/Adam/dense_1/kernel/v:0": rng.uniform(size=(8, 16)).astype(
            np.float32
        ),
    }
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = b"2.0.8"
        f.attrs["backend"] = b"tensorflow"
        f.attrs["model_config"] = json.dumps({"class_name": "Sequential", "config": []}).encode()
        f.attrs["training_config"] = json.dumps({"optimizer_config": {"class_name": "Adam"}})
        mw = f.create_group("model_weights")
        layers = ["dense_1", "batch_normalization_1", "dense_2"]
        mw.attrs["layer_names"] = np.array([n.encode() for n in layers], dtype="S21")
        for name, array in weights.items():
            f.create_dataset(name, data=array)
        for layer in layers:
            names = [n.split("/", 2)[2] for n in weights if n.split("/")[1] == layer]
            mw[layer].attrs["weight_names"] = np.array([n.encode() for n in names])
        ow = f.create_group("optimizer_weights")
        ow.attrs["weight_names"] = np.array([n.split("/", 1)[1].encode() for n in optimizer])
        for name, array in optimizer.items():
            f.create_dataset(name, data=array)
    return {**weights, **optimizer}


def keras2_save_weights(path: Path) -> dict[str, np.ndarray]:
    """Keras 2 `save_weights('w.h5')`: the layer groups at the root, layer_names a root
    attribute."""
    import h5py

    rng = _rng(2)
    tensors = {
        "dense_1/dense_1/kernel:0": rng.normal(size=(6, 8)).astype(np.float32) * 3,
        "dense_1/dense_1/bias:0": rng.normal(size=8).astype(np.float32),
        "dense_2/dense_2/kernel:0": rng.normal(size=(8, 2)).astype(np.float32),
        "dense_2/dense_2/bias:0": rng.normal(size=2).astype(np.float32),
    }
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense_1", b"dense_2"], dtype="S7")
        f.attrs["backend"] = b"tensorflow"
        for name, array in tensors.items():
            f.create_dataset(name, data=array)
    return tensors


def keras3_nested_weights(path: Path) -> dict[str, np.ndarray]:
    """Keras 3 `.weights.h5`: numbered variables, flat (layers/dense/vars/0) and nested
    (block1/layers/conv2d/vars/0), and the optimizer's variables under optimizer/vars/."""
    import h5py

    rng = _rng(3)
    tensors = {
        "block1/layers/conv2d/vars/0": rng.normal(size=(3, 3, 1, 4)).astype(np.float32),
        "block1/layers/conv2d/vars/1": rng.normal(size=4).astype(np.float32),
        "layers/dense/vars/0": rng.normal(size=(4, 3)).astype(np.float32) * 2,
        "layers/dense/vars/1": rng.normal(size=3).astype(np.float32),
        "optimizer/vars/0": np.array(1000.0, np.float32),
        "optimizer/vars/1": rng.normal(size=(4, 3)).astype(np.float32),
    }
    with h5py.File(path, "w") as f:
        for name, array in tensors.items():
            f.create_dataset(name, data=array)
        f["layers"].attrs["class_name"] = "Functional"
        f["block1"].attrs["class_name"] = "Sequential"
    return tensors


def hf_names(prefix: str, layers: int = 3) -> dict[str, np.ndarray]:
    """A Hugging Face/PyTorch-style state dict whose layers are `{prefix}N`."""
    rng = _rng(4)
    tensors = {"embed.weight": rng.normal(size=(5, 4)).astype(np.float32)}
    for i in range(layers):
        tensors[f"{prefix}{i}.attn.weight"] = rng.normal(size=(4, 4)).astype(np.float32)
        tensors[f"{prefix}{i}.attn.bias"] = rng.normal(size=4).astype(np.float32)
    return tensors


def block_fp8_shard(path: Path) -> dict[str, np.ndarray]:
    """A DeepSeek-V3-style block-scaled fp8 shard: X.weight F8_E4M3 [out, in] with
    X.weight_scale_inv F32 [ceil(out/128), ceil(in/128)], beside bf16-free plain weights.
    A file alone is read only where its shapes leave one block size (issue 21): 130 rows
    over 2 scale rows fit blocks of 65 to 129, so the weight has 2 rows, blocks of 1 row."""
    import ml_dtypes

    rng = _rng(5)
    codes = rng.uniform(-448, 448, size=(2, 64)).astype(ml_dtypes.float8_e4m3fn)
    tensors = {
        "model.layers.0.mlp.down_proj.weight": codes,
        "model.layers.0.mlp.down_proj.weight_scale_inv": np.array([[0.01], [0.02]], np.float32),
        "model.layers.0.input_layernorm.weight": np.ones(64, np.float32),
        "model.norm.weight": np.ones(64, np.float32),
    }
    write_safetensors(path, tensors)
    return tensors


KERAS_CONFIG = json.dumps({"class_name": "Functional", "config": {"name": "model"}}).encode()
KERAS_METADATA = json.dumps({"keras_version": "3.3.3", "date_saved": "2024-05-01@10:00:00"})


def keras_archive(path: Path) -> dict[str, np.ndarray]:
    """Keras 3 `model.save('m.keras')`: a zip of metadata.json, config.json and
    model.weights.h5 (the nested Keras 3 weights), plus an asset, in Keras' order. JSON
    members are deflated, the weights stored. Returns the weights by name."""
    import zipfile

    weights_file = path.with_name(path.name + ".weights.tmp.h5")
    tensors = keras3_nested_weights(weights_file)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", KERAS_METADATA, zipfile.ZIP_DEFLATED)
        archive.writestr("config.json", KERAS_CONFIG, zipfile.ZIP_DEFLATED)
        archive.write(weights_file, "model.weights.h5", zipfile.ZIP_STORED)
        archive.writestr("assets/vocab.txt", "a\nb\nc\n", zipfile.ZIP_DEFLATED)
    weights_file.unlink()
    return tensors


def vocab_file(path: Path) -> Path:
    """Weights beside a string vocabulary, a compound table, an empty group and attributes of
    many exact types (big-endian floats, fixed and variable strings, UTF-8 and ASCII)."""
    import h5py

    rng = np.random.default_rng(11)
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs["count"] = np.int64(3)
        f.attrs["scales"] = np.arange(3, dtype=">f4")
        f.attrs.create("fixed", np.array([b"a", b"bc"]), dtype="S5")
        f.attrs["text"] = "h\u00e9llo"
        f.attrs.create("ascii", b"plain", dtype=h5py.string_dtype("ascii"))
        f.create_dataset(
            "dense/kernel", data=rng.normal(size=(4, 3)).astype(np.float32), chunks=(2, 3)
        )
        f["dense"].attrs["weight_names"] = np.array([b"kernel"])
        f.create_dataset("vocab", data=["a", "b", "\u00e7", ""], dtype=h5py.string_dtype())
        f["vocab"].attrs["kind"] = b"tokens"
        f.create_dataset("table", data=np.array([(1.5, 2)], dtype=[("a", "<f4"), ("b", "<i4")]))
        f.create_dataset("scalar_text", data="one", dtype=h5py.string_dtype())
        f.create_dataset("nothing", data=h5py.Empty("f4"))
        f.create_group("empty").attrs["note"] = "kept"
        f.create_dataset("bias", data=np.ones(3, ">f8"), fillvalue=7.0, compression="gzip")
    return path


def write_h5(path: Path) -> Path:
    with h5py.File(path, "w") as handle:
        handle["dense/kernel"] = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
    return path


def write_keras(path: Path) -> Path:
    weights = path.with_name(path.name + ".weights.h5")
    write_h5(weights)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.0.0"}))
        archive.writestr("config.json", json.dumps({"class_name": "Sequential"}))
        archive.write(weights, WEIGHTS_MEMBER)
    weights.unlink()
    return path


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
