# mypy: ignore-errors
# (torch is not installed where CI type-checks: this script runs by hand, with torch)
"""Makes the PyTorch fixtures in this folder with torch itself (run by hand; CI needs no
torch): `python tests/data/pytorch/make_fixtures.py`.

Each `<name>.pt` comes with `<name>.expected.npz`: every tensor as torch.load returns it,
widened to float64 (int64 for integers) by torch, under its clipcli name (the dotted path).
The files torch cannot write today (big-endian, `_rebuild_tensor` v1 with `cuda:0`, the
legacy tar) are written here by hand and checked by loading them with torch."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def state_dict() -> collections.OrderedDict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(6, 4), torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)
    )
    model[2].running_mean.add_(0.5)
    model[2].num_batches_tracked.add_(7)
    sd = model.state_dict()
    sd["lm_head.weight"] = sd["0.weight"]  # tied: the same view of the same storage
    big = torch.randn(5, 7)
    sd["transposed"] = big.t()  # non-contiguous view
    sd["offset_rows"] = big[2:4]  # a view at a storage offset
    sd["every_other"] = big[:, ::2]  # non-contiguous, offset 0
    sd["half"] = torch.randn(3, 2).half()
    sd["bf16"] = (torch.randn(4) * 100).bfloat16()
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    sd["mask"] = torch.tensor([True, False, True])
    return sd


def flat(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            out.update(flat(value, f"{prefix}.{index}" if prefix else str(index)))
    return out


def expected(path: Path, loaded: object) -> None:
    arrays: dict[str, Any] = {}
    for name, tensor in flat(loaded).items():
        tensor = tensor.detach()
        if tensor.dtype.is_floating_point:
            arrays[name] = tensor.to(torch.float64).numpy()
        elif tensor.dtype == torch.bool:
            arrays[name] = tensor.numpy()
        else:
            arrays[name] = tensor.to(torch.int64).numpy()
    np.savez(path.with_suffix(".expected.npz"), **arrays)


def save(name: str, obj: object, **kwargs: Any) -> Path:
    path = HERE / name
    torch.save(obj, path, **kwargs)
    expected(path, torch.load(path, weights_only=True))
    return path


def big_endian(source: Path, name: str) -> None:
    """The zip layout as a big-endian machine writes it: byteorder 'big', storages swapped."""
    loaded = torch.load(source, weights_only=True)
    storage_dtypes: dict[str, int] = {}
    with zipfile.ZipFile(source) as archive:
        pickle_bytes = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))

        class Reader(pickle.Unpickler):  # our own file, written just now: safe to load
            def persistent_load(self, pid: Any) -> Any:
                storage_dtypes[pid[2]] = torch._utils._element_size(pid[1].dtype)
                return None

            def find_class(self, module: str, name: str) -> Any:
                if name.startswith("_rebuild"):
                    return lambda *_args: None
                return super().find_class(module, name)

        Reader(io.BytesIO(pickle_bytes)).load()
        path = HERE / name
        root = path.stem
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
            for info in archive.infolist():
                data = archive.read(info)
                member = info.filename.split("/", 1)[1]
                if member == "byteorder":
                    data = b"big"
                elif member.startswith("data/"):
                    size = storage_dtypes[member[5:]]
                    data = (
                        np.frombuffer(data, f"<u{size}").byteswap().tobytes() if size > 1 else data
                    )
                out.writestr(f"{root}/{member}", data)
    reread = torch.load(path, weights_only=True)
    for key, value in flat(loaded).items():
        assert torch.equal(flat(reread)[key], value), key
    expected(path, reread)


class _Storage:
    def __init__(self, key: str, tensor: torch.Tensor) -> None:
        self.key, self.tensor = key, tensor


def legacy_v1_cuda(name: str) -> None:
    """A legacy stream as torch 0.4 wrote it: `_rebuild_tensor` (v1), locations 'cuda:0'."""
    torch.manual_seed(1)
    tensors = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3).double()}
    tensors["layer.weight_t"] = tensors["layer.weight"].t()
    storages: dict[int, _Storage] = {}

    class Writer(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                storage_class = {
                    torch.float32: torch.FloatStorage,
                    torch.float64: torch.DoubleStorage,
                }[obj.tensor.dtype]
                numel = obj.tensor.untyped_storage().nbytes() // obj.tensor.element_size()
                return ("storage", storage_class, obj.key, "cuda:0", numel, None)
            return None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                key = obj.untyped_storage().data_ptr()
                if key not in storages:
                    storages[key] = _Storage(str(len(storages)), obj)
                return (
                    torch._utils._rebuild_tensor,
                    (storages[key], obj.storage_offset(), tuple(obj.shape), obj.stride()),
                )
            return NotImplemented

    buffer = io.BytesIO()
    for value in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(value, buffer, protocol=2)
    Writer(buffer, protocol=2).dump(collections.OrderedDict(tensors))
    pickle.dump([s.key for s in storages.values()], buffer, protocol=2)
    for storage in storages.values():
        raw = bytes(storage.tensor.untyped_storage())
        buffer.write(struct.pack("<q", len(raw) // storage.tensor.element_size()) + raw)
    path = HERE / name
    path.write_bytes(buffer.getvalue())
    expected(path, torch.load(path, map_location="cpu", weights_only=True))


def legacy_tar(name: str) -> None:
    """The tar layout torch wrote before 0.1.10: members sys_info, storages, tensors, pickle."""
    torch.manual_seed(2)
    base = torch.randn(4, 3)
    objects = {"w": base, "w_rows": base[1:3], "b": torch.arange(5, dtype=torch.int64)}
    storage_list = [("10", base), ("11", objects["b"])]
    storages = io.BytesIO()
    pickle.dump(len(storage_list), storages, protocol=2)
    for key, tensor in storage_list:
        storage_class = {torch.float32: torch.FloatStorage, torch.int64: torch.LongStorage}
        pickle.dump((key, "cpu", storage_class[tensor.dtype]), storages, protocol=2)
        raw = bytes(tensor.untyped_storage())
        storages.write(struct.pack("<q", len(raw) // tensor.element_size()) + raw)
    pickle.dump([], storages, protocol=2)
    tensors = io.BytesIO()
    layout = {"w": "10", "w_rows": "10", "b": "11"}
    pickle.dump(len(objects), tensors, protocol=2)
    for index, (key, tensor) in enumerate(objects.items()):
        pickle.dump((100 + index, layout[key], torch.FloatTensor), tensors, protocol=2)
        tensors.write(struct.pack("<i", tensor.dim()) + b"\0" * 4)
        tensors.write(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
        tensors.write(struct.pack(f"<{tensor.dim()}q", *tensor.stride()))
        tensors.write(struct.pack("<q", tensor.storage_offset()))

    class Tagged:
        def __init__(self, key: str) -> None:
            self.key = key

    class Writer(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return obj.key if isinstance(obj, Tagged) else None

    pickled = io.BytesIO()
    Writer(pickled, protocol=2).dump(
        {key: Tagged(str(100 + index)) for index, key in enumerate(objects)}
    )
    path = HERE / name
    with tarfile.open(path, "w:", format=tarfile.PAX_FORMAT) as archive:
        for member, data in (
            ("sys_info", pickle.dumps({"protocol_version": 1000, "little_endian": True})),
            ("storages", storages.getvalue()),
            ("tensors", tensors.getvalue()),
            ("pickle", pickled.getvalue()),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    expected(path, torch.load(path, weights_only=False))  # our own file: safe to load


def main() -> None:
    sd = state_dict()
    zip_v2 = save("zip_v2.pt", sd)
    save("legacy.pt", sd, _use_new_zipfile_serialization=False)
    save(
        "zip_v3_fp8.pt",
        {
            "e4m3": torch.tensor([1.5, -2.0, 448.0, 0.015625]).to(torch.float8_e4m3fn),
            "e5m2": torch.tensor([3.0, -57344.0, 0.5]).to(torch.float8_e5m2),
            "u16": torch.tensor([0, 1, 65535], dtype=torch.int32).to(torch.uint16),
        },
    )
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save(
        "nested.pt",
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],
            "epoch": 3,
            "hyper_parameters": {"lr": 0.001, "name": "tiny", "betas": (0.9, 0.999)},
        },
    )
    big_endian(zip_v2, "zip_big_endian.pt")
    legacy_v1_cuda("legacy_v1_cuda.pth")
    legacy_tar("legacy_tar.pt")
    print("torch", torch.__version__, file=sys.stderr)


if __name__ == "__main__":
    main()
