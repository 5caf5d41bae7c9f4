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


def gptq_int4(weight: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """A Linear weight [out, in] as GPTQ v1 stores it (AutoGPTQ's layout): codes of the
    transpose packed 8 to an int32 down each column, float16 scales per group of inputs
    and output, zero points 8 (stored as 7: v1 adds one), W = scale * (q - 8)."""
    out, inputs = weight.shape
    transposed = weight.T.astype(np.float64)  # [in, out]
    groups = inputs // group
    by_group = np.abs(transposed).reshape(groups, group, out).max(axis=1)
    scales = (by_group / 7).astype(np.float16)
    full = np.repeat(scales.astype(np.float64), group, axis=0)
    q = np.clip(np.rint(transposed / full) + 8, 0, 15).astype(np.uint32)
    qweight = np.zeros((inputs // 8, out), dtype=np.uint32)
    for k in range(8):  # input 8r + k in bits 4k..4k+3 of row r
        qweight |= q[k::8] << np.uint32(4 * k)
    zeros = np.full((groups, out), 7, dtype=np.uint32)
    qzeros = np.zeros((groups, out // 8), dtype=np.uint32)
    for k in range(8):
        qzeros |= zeros[:, k::8] << np.uint32(4 * k)
    return {
        "qweight": qweight.view(np.int32),
        "qzeros": qzeros.view(np.int32),
        "scales": scales,
        "g_idx": (np.arange(inputs) // group).astype(np.int32),
    }


def tiny_mlp_gptq(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """tiny_mlp with its two layers' weights in GPTQ int4 (groups of 16 inputs)."""
    quantized: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if name.startswith("layers.") and name.endswith(".weight"):
            module = name[: -len(".weight")]
            for part, packed in gptq_int4(array, 16).items():
                quantized[f"{module}.{part}"] = packed
        else:
            quantized[name] = array
    return quantized


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
    write_safetensors(HERE / "tiny_mlp_gptq.safetensors", tiny_mlp_gptq(tensors), meta)


if __name__ == "__main__":
    main()
