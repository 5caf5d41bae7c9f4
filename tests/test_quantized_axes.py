"""--norm --axes cannot act on a quantized weight through its stored tensors (one scale
per block is not one factor per slice): refused with exit 4 before OUT exists, never
carried out as a silent copy of the codes and scales."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quant_reference import write_raw_safetensors
from test_quantized_cli import finite_fp8_weight

from clipcli.errors import ExitCode


def test_axes_clip_of_a_block_fp8_weight_is_refused_before_writing(
    tmp_path: Path, run_main: Any
) -> None:
    stored, _ = finite_fp8_weight(1, 130, 260, (128, 128))
    model = tmp_path / "model"  # a config says the block (the shapes alone fit several)
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
        )
    )
    write_raw_safetensors(model / "model.safetensors", stored)
    out = f"{tmp_path}/out/"
    refused = run_main("clip", "--norm", "1e-3", "--axes", "1", model, out)
    assert refused.code == ExitCode.REFUSED_DATA, refused.stderr
    assert "layer.weight: a fp8-block weight cannot be clipped by axes" in refused.stderr
    assert not (tmp_path / "out").exists()
