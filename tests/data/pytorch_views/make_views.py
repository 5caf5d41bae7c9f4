# mypy: ignore-errors
# (torch is not installed where CI type-checks: this script runs by hand, with torch)
"""Makes the PyTorch view fixtures in this folder with torch itself (run by hand; CI needs
no torch): `python tests/data/pytorch_views/make_views.py`.

torch.save keeps a view's strides: an `expand`ed tensor is saved as its small storage with
stride 0, an `as_strided` window as overlapping strides. Each `<name>.pt` (zip) and
`<name>_legacy.pt` (the legacy stream) comes with `<name>.expected.npz`: every tensor as
torch.load returns it, widened to float64 by torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def views() -> dict[str, torch.Tensor]:
    base = torch.arange(1, 9, dtype=torch.float32)  # 8 elements, 32 bytes
    return {
        "expanded": base[:4].expand(1000, 4),  # stride (0, 1): 16,000 bytes from 16
        "column": base[4:5].expand(3, 5),  # stride (0, 0) at offset 4
        "windows": base.as_strided((5, 4), (1, 1)),  # overlapping rows (a Hankel matrix)
    }


def main() -> None:
    tensors = views()
    for stride in (t.stride() for t in tensors.values()):
        assert 0 in stride or stride == (1, 1)
    torch.save(tensors, HERE / "expanded.pt")
    torch.save(tensors, HERE / "expanded_legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("expanded.pt", "expanded_legacy.pt"):
        loaded = torch.load(HERE / name, weights_only=True)
        for key, value in loaded.items():
            assert torch.equal(value, tensors[key])
            assert value.stride() == tensors[key].stride()
    np.savez(
        HERE / "expanded.expected.npz",
        **{k: v.to(torch.float64).contiguous().numpy() for k, v in tensors.items()},
    )


if __name__ == "__main__":
    main()
