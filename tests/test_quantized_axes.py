"""--norm --axes cannot act on a quantized weight through its stored tensors (one scale
per block is not one factor per slice): refused with exit 4 before OUT exists, never
carried out as a silent copy of the codes and scales."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quant_reference import write_raw_safetensors
from test_quantized_cli import finite_fp8_weight

from clipcli.errors import ExitCode


def test_axes_clip_of_a_block_fp8_weight_is_refused_before_writing(
    tmp_path: Path, run_main: Any
) -> None:
    stored, _ = finite_fp8_weight(1, 130, 260, (128, 128))
    src = write_raw_safetensors(tmp_path / "in.safetensors", stored)
    out = tmp_path / "out.safetensors"
    refused = run_main("clip", "--norm", "1e-3", "--axes", "1", src, out)
    assert refused.code == ExitCode.REFUSED_DATA, refused.stderr
    assert "layer.weight: a fp8-block weight cannot be clipped by axes" in refused.stderr
    assert not out.exists()
