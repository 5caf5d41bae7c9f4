"""Every scheme module the quantized view asks, in order (each implements scheme.Scheme).
The names' markers each scheme's recognise() needs are in markers.py, which a plain
checkpoint reads without importing any scheme."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clipcli.logical.quantized import (
    awq,
    bnb,
    fp8_block,
    fp8_scaled,
    gptq,
    mxfp4,
    nvfp4,
    packed_int,
)

if TYPE_CHECKING:
    from clipcli.logical.quantized.scheme import Scheme

SCHEMES: tuple[Scheme, ...] = (fp8_block, fp8_scaled, mxfp4, nvfp4, gptq, awq, packed_int, bnb)
