"""Every scheme module the quantized view asks, in order (each implements scheme.Scheme)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clipcli.logical.quantized import fp8_block, fp8_scaled, mxfp4, nvfp4

if TYPE_CHECKING:
    from clipcli.logical.quantized.scheme import Scheme

SCHEMES: tuple[Scheme, ...] = (fp8_block, fp8_scaled, mxfp4, nvfp4)
