"""GGUF's block types as values: a block-quantized tensor's real values are float32 as
`gguf.quants.dequantize` gives them (what llama.cpp computes with), streamed a bounded run
of blocks at a time. The reader presents them so (`infos`); clipcli.logical.gguf makes the
same mapping a View over the stored blocks.

Plain tensors (F32, F16, BF16, F64, I8..I64) are their own logical tensors. A block type
that gguf.quants cannot dequantize (Q8_1, Q8_K, Q1_0 in gguf 0.19; any block type of a
big-endian file, whose block layouts gguf.quants does not read) stays its uint8 rows of
blocks: a non-float tensor, left out of the global norm, named by warnings().
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from clipcli.formats.base import TensorInfo
from clipcli.formats.gguf.header import GGML_TYPES, Header, TensorEntry

if TYPE_CHECKING:
    import numpy as np

SCHEME_PREFIX = "gguf-"  # a logical tensor's scheme: "gguf-Q4_0"

# Where each block type keeps the float16 scales its values are linear in: byte offsets
# inside one block (ggml-common.h's block_* structs; gguf.quants splits blocks the same
# way). Every value of a block is d * f(payload) (Q4_1, Q5_1: + m; the K-quants Q2_K,
# Q4_K, Q5_K: - dmin * g(payload)), so multiplying these fields by s multiplies every
# value by s before the fields' own float16 rounding; the payload is left as it is.
# Not here (a clip of them is refused): IQ1_M (its scale is packed into the high bits of
# the sub-block scales), MXFP4 (an E8M0 exponent: powers of two only), NVFP4 (fp8 UE4M3
# sub-block scales), and the types gguf.quants cannot dequantize (Q8_1, Q8_K, Q1_0).
SCALE_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),  # d, m
    "Q5_0": (0,),
    "Q5_1": (0, 2),  # d, m
    "Q8_0": (0,),
    "Q2_K": (80, 82),  # after scales[16], qs[64]: d, dmin
    "Q3_K": (108,),  # after hmask[32], qs[64], scales[12]
    "Q4_K": (0, 2),  # d, dmin
    "Q5_K": (0, 2),  # d, dmin
    "Q6_K": (208,),  # after ql[128], qh[64], scales[16]
    "TQ1_0": (52,),  # after qs[48], qh[4]
    "TQ2_0": (64,),  # after qs[64]
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


@functools.cache
def can_dequantize(type_name: str) -> bool:
    """Whether gguf.quants dequantizes this ggml block type (tried on one zero block, which
    also builds the type's lookup grids once, before worker threads share them)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    _, _, type_size = GGML_TYPES[qtype.value]
    try:
        dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize_blocks(ggml_type: int, raw: np.ndarray) -> np.ndarray:
    """Whole blocks' bytes (flat uint8) to their float32 values, flat, in order."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    # Any bytes are a block: an inf or NaN scale makes inf - inf inside gguf's arithmetic,
    # which is the value (counted as non-finite by the measurement), not a fault.
    with np.errstate(all="ignore"):
        out = dequantize(raw.reshape(1, -1), GGMLQuantizationType(ggml_type))
    return out.reshape(-1)


class BlockTensor(NamedTuple):
    """One tensor as its values: `info` (float32 for a dequantized block type, else the
    stored tensor), the stored tensor, and the scheme ("gguf-Q4_0"; None: as stored)."""

    info: TensorInfo
    stored: TensorInfo
    scheme: str | None


class BlockTypes:
    """The value tensors of one GGUF file, in file order."""

    def __init__(self, header: Header, stored_infos: list[TensorInfo]) -> None:
        """`stored_infos`: the reader's, one per header tensor, in order."""
        import numpy as np

        self._header = header
        self._tensors: list[BlockTensor] = []
        self._undecodable: list[TensorEntry] = []
        self._decoded: set[str] = set()
        float32 = np.dtype(np.float32)
        for entry, stored in zip(header.tensors, stored_infos, strict=True):
            if entry.plain or not self._decodable(entry):
                if not entry.plain:
                    self._undecodable.append(entry)
                self._tensors.append(BlockTensor(stored, stored, None))
                continue
            info = TensorInfo(entry.name, float32, entry.shape, math.prod(entry.shape) * 4)
            self._decoded.add(entry.name)
            self._tensors.append(BlockTensor(info, stored, SCHEME_PREFIX + entry.type_name))

    def _decodable(self, entry: TensorEntry) -> bool:
        return not self._header.big_endian and can_dequantize(entry.type_name)

    def tensors(self) -> list[BlockTensor]:
        return self._tensors

    def undecodable(self) -> list[tuple[str, str]]:
        """(tensor, "GGUF <type>") of each block tensor read as its stored bytes."""
        order = " (big-endian)" if self._header.big_endian else ""
        return [(e.name, f"GGUF {e.type_name}{order}") for e in self._undecodable]

    def warnings(self) -> list[str]:
        if not self._undecodable:
            return []
        types = sorted({e.type_name for e in self._undecodable})
        names = ", ".join(repr(e.name) for e in self._undecodable[:3])
        more = f" and {len(self._undecodable) - 3} more" if len(self._undecodable) > 3 else ""
        order = " of a big-endian file" if self._header.big_endian else ""
        return [
            f"{len(self._undecodable)} GGUF tensors of block types{order} that cannot be "
            f"dequantized ({', '.join(types)}: {names}{more}) are left out of the global norm "
            "(measured as their stored bytes)"
        ]

    def decoder(
        self, entry: TensorEntry, info: TensorInfo
    ) -> Callable[[np.ndarray], np.ndarray] | None:
        """How to turn the tensor's stored bytes into `info`'s values; None: as stored."""
        if info.name not in self._decoded:
            return None
        return functools.partial(dequantize_blocks, entry.ggml_type)
