"""Regenerate the demo checkpoints in this folder (seeded, so the bytes are reproducible).

python sample_data/make_samples.py
"""

from __future__ import annotations

from pathlib import Path

import h5py
import ml_dtypes
import numpy as np

from clipcli.formats.base import Checkpoint, TensorInfo
from clipcli.formats.safetensors import SafetensorsWriter

HERE = Path(__file__).resolve().parent


def tiny_mlp(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A two-layer MLP with one exploded layer, so clipping has something to do."""
    return {
        "embed.weight": rng.standard_normal((64, 32), dtype=np.float32),
        "layers.0.weight": rng.standard_normal((32, 32), dtype=np.float32) * 0.1,
        "layers.0.bias": np.zeros(32, dtype=np.float32),
        "layers.1.weight": rng.standard_normal((32, 32), dtype=np.float32) * 25.0,
        "layers.1.bias": rng.standard_normal(32, dtype=np.float32),
        "head.weight": rng.standard_normal((10, 32), dtype=np.float32) * 0.5,
        "step": np.array(1000, dtype=np.int64),
    }


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str]) -> None:
    """With clipcli's own streaming writer, which (unlike safetensors.numpy) takes bf16."""
    infos = [TensorInfo(name, a.dtype, a.shape, a.nbytes) for name, a in tensors.items()]
    writer = SafetensorsWriter(path, Checkpoint(infos, meta))
    for info, array in zip(infos, tensors.values(), strict=True):
        writer.write(info, [array.reshape(-1)])
    writer.close()


def write_keras_like_h5(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Legacy-Keras layout: model_weights/<layer>/<layer>/<var>:0 with name attributes."""
    with h5py.File(path, "w") as f:
        f.attrs["backend"] = "tensorflow"
        f.attrs["keras_version"] = "2.15.0"
        weights = f.create_group("model_weights")
        layers = sorted({name.rsplit(".", 1)[0] for name in tensors if "." in name})
        weights.attrs["layer_names"] = np.array([n.encode() for n in layers])
        for layer in layers:
            group = weights.create_group(layer).create_group(layer)
            names = []
            for name, array in tensors.items():
                if name.rsplit(".", 1)[0] == layer:
                    var = ("kernel" if name.endswith("weight") else "bias") + ":0"
                    group.create_dataset(var, data=array, chunks=True, compression="gzip")
                    names.append(f"{layer}/{var}".encode())
            weights[layer].attrs["weight_names"] = np.array(names)
        f.create_dataset("optimizer_weights/iterations:0", data=tensors["step"])


def main() -> None:
    rng = np.random.default_rng(20261122)
    tensors = tiny_mlp(rng)
    meta = {"format": "pt", "source": "clipcli sample_data/make_samples.py"}
    write_safetensors(HERE / "tiny_mlp.safetensors", tensors, meta)
    bf16 = {
        k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v)
        for k, v in tensors.items()
    }
    write_safetensors(HERE / "tiny_mlp_bf16.safetensors", bf16, meta)
    np.savez_compressed(HERE / "tiny_mlp.npz", **tensors)
    write_keras_like_h5(HERE / "tiny_mlp_keras.h5", tensors)


if __name__ == "__main__":
    main()
