"""Every scheme module the quantized view asks, in order (each implements scheme.Scheme)."""

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

# The names' markers live in markers.py (a plain checkpoint imports no scheme); they are
# named here too, beside the schemes whose recognise() needs one of them.
from clipcli.logical.quantized.markers import BARE_MARKERS as BARE_MARKERS
from clipcli.logical.quantized.markers import END_MARKERS as END_MARKERS
from clipcli.logical.quantized.markers import MARKERS as MARKERS
from clipcli.logical.quantized.markers import may_hold_quantized as may_hold_quantized

if TYPE_CHECKING:
    from clipcli.logical.quantized.scheme import Scheme

SCHEMES: tuple[Scheme, ...] = (fp8_block, fp8_scaled, mxfp4, nvfp4, gptq, awq, packed_int, bnb)
