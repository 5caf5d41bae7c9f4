"""GGUF's logical tensors as a View (clipcli.logical.view): a block-quantized tensor is a
view over its blocks (one stored uint8 tensor of rows of blocks, role "blocks"), its real
values float32 from gguf.quants, streamed a bounded run of blocks at a time
(clipcli.formats.gguf.blocks). Plain tensors are their own logical tensors.

A clip scales a block tensor through the float16 scales inside its blocks
(blocks.SCALE_FIELDS: `d`; Q4_1/Q5_1 `m`, K-quants `dmin` too), each rounded once to
float16; every other byte of every block is kept. The factor search checks the values
that scaled blocks dequantize to (scaled_chunks), and the write pass rewrites the same
fields with the same function (stored_scaler), so the promise holds for what is written.
MXFP4 blocks (an E8M0 exponent byte e, then 16 bytes of e2m1 codes; gguf reads every e as
2**(e - 127), 0xFF included) take the factor rounded down to 2**-k (power_of_two_factors):
e -> e - k, exactly; a block whose e is below k under nonzero codes refuses the clip
(refused_factor), one of zero codes keeps its byte.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from clipcli.formats.base import Reader, default_chunk_elems
from clipcli.formats.gguf import GgufReader
from clipcli.formats.gguf.blocks import SCALE_FIELDS, SCHEME_PREFIX, dequantize_blocks
from clipcli.formats.gguf.header import GGML_TYPES
from clipcli.logical.view import LogicalTensor, Part, View

if TYPE_CHECKING:
    import numpy as np


class GGUFView(View):
    """The logical tensors of one GGUF file, in file order."""

    stored_format = "gguf"

    def __init__(self, reader: GgufReader) -> None:
        self._reader = reader
        self._stored = {info.name: info for info in reader.stored_infos}
        self._tensors = [
            LogicalTensor(
                tensor.info,
                (Part(tensor.stored.name, "values" if tensor.scheme is None else "blocks"),),
                tensor.scheme,
            )
            for tensor in reader.blocks.tensors()
        ]

    def tensors(self) -> list[LogicalTensor]:
        return self._tensors

    def chunks(
        self,
        reader: Reader,  # noqa: ARG002 - the GGUF reader it was made for dequantizes
        tensor: LogicalTensor,
        chunk_elems: int | None = None,
    ) -> Iterator[np.ndarray]:
        return self._reader.values(tensor.info, chunk_elems)

    def warnings(self) -> list[str]:
        return self._reader.blocks.warnings()

    def undecoded(self) -> list[tuple[str, str]]:
        return self._reader.blocks.undecodable()

    def lowerable(self, tensor: LogicalTensor) -> str | None:
        if tensor.plain:
            return None
        type_name = _type_name(tensor)
        if type_name in SCALE_FIELDS or type_name == POWER_OF_TWO_TYPE:
            return None
        why = {
            "NVFP4": "its sub-block scales are 8-bit UE4M3 floats",
            "IQ1_M": "its scale is packed into the high bits of the sub-block scales",
        }.get(type_name, "it has no float16 block scale that all its values are linear in")
        return f"{tensor.info.name}: clipping GGUF {type_name} blocks is not supported ({why})"

    def scaled_parts(self, tensor: LogicalTensor) -> list[str]:
        return [tensor.parts[0].name]

    def power_of_two_factors(self, tensor: LogicalTensor) -> bool:
        return not tensor.plain and _type_name(tensor) == POWER_OF_TWO_TYPE

    def refused_factor(
        self,
        reader: Reader,  # noqa: ARG002 - the GGUF reader it was made for reads the blocks
        tensor: LogicalTensor,
        mantissa: float,
        exponent: int,
    ) -> str | None:
        """MXFP4: a block whose exponent byte is below k under a nonzero code (its values
        would need an exponent below 0): refused, naming the tensor, the byte, the block."""
        if not self.power_of_two_factors(tensor):
            return None
        import numpy as np

        from clipcli.numerics.rounding import power_of_two_steps

        steps = power_of_two_steps(mantissa, exponent)
        _, block_values, type_size = _block_type(POWER_OF_TWO_TYPE)
        stored = self._stored[tensor.parts[0].name]
        first_block = 0
        step = max(1, default_chunk_elems(np.dtype(np.float32)) // block_values) * type_size
        for raw in self._reader.chunks(stored, step):
            blocks = raw.reshape(-1, type_size)
            exponents = blocks[:, 0]
            nonzero = (blocks[:, 1:] & 0x77).any(axis=1)  # a code other than +-0
            hit = np.flatnonzero((exponents < steps) & nonzero)
            if hit.size:
                block = first_block + int(hit[0])
                return (
                    f"{tensor.info.name}: scaling by 2**-{steps} would take its E8M0 block "
                    f"exponent {int(exponents[hit[0]])} at block {block} below 0 under "
                    "nonzero codes"
                )
            first_block += blocks.shape[0]
        return None

    def stored_scaler(
        self, tensor: LogicalTensor, part: str
    ) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
        """A block tensor: its blocks' float16 scales scaled (scale_fields)."""
        if tensor.plain:
            return super().stored_scaler(tensor, part)
        return functools.partial(scale_fields, _type_name(tensor))

    def scaled_chunks(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> Iterator[np.ndarray]:
        """The values the scaled blocks dequantize to (float32, as gguf.quants gives them):
        the blocks as the write pass writes them (scale_fields), then dequantized."""
        if tensor.plain:
            yield from super().scaled_chunks(reader, tensor, mantissa, exponent)
            return
        import numpy as np

        type_name = _type_name(tensor)
        ggml_type, block, type_size = _block_type(type_name)
        step = max(1, default_chunk_elems(np.dtype(np.float32)) // block) * type_size
        if type_name == POWER_OF_TWO_TYPE:
            # The values times 2**-k, exactly in float64: what the lowered exponents decode
            # to, and for a block whose exponent cannot take the step (refused_factor
            # refuses the clip) the value it would need, never the block left unscaled.
            from clipcli.numerics.rounding import power_of_two_steps

            steps = power_of_two_steps(mantissa, exponent)
            for raw in self._reader.chunks(self._stored[tensor.parts[0].name], step):
                values = dequantize_blocks(ggml_type, raw).astype(np.float64)
                yield np.ldexp(values, -steps)
            return
        for raw in self._reader.chunks(self._stored[tensor.parts[0].name], step):
            scaled = scale_fields(type_name, raw, mantissa, exponent)
            yield dequantize_blocks(ggml_type, scaled)


# The block type whose scale is an E8M0 exponent byte (the first of each block).
POWER_OF_TWO_TYPE = "MXFP4"


def scale_fields(type_name: str, raw: np.ndarray, mantissa: float, exponent: int) -> np.ndarray:
    """Whole blocks of `type_name` (flat uint8) with their float16 scale fields
    (SCALE_FIELDS) multiplied by mantissa * 2**exponent, each rounded once to float16 as a
    float16 tensor's values are (rounding.scale_chunk); every other byte as it was. MXFP4:
    the exponent byte lowered by k, the factor rounded down to 2**-k."""
    import numpy as np

    from clipcli.numerics import rounding

    _, _, type_size = _block_type(type_name)
    if raw.size % type_size:  # the reader cuts block tensors at whole blocks
        raise AssertionError(f"{raw.size} bytes are not whole {type_name} blocks")
    blocks = raw.reshape(-1, type_size).copy()
    if type_name == POWER_OF_TWO_TYPE:  # the E8M0 byte: e -> e - k where e >= k
        steps = rounding.power_of_two_steps(mantissa, exponent)
        e = blocks[:, 0].astype(np.int64)
        blocks[:, 0] = np.where(e >= steps, e - steps, e).astype(np.uint8)
        return blocks.reshape(-1)
    little = np.dtype("<f2")
    for offset in SCALE_FIELDS[type_name]:
        field = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(little).reshape(-1)
        scaled = rounding.scale_chunk(field.astype(np.float16), mantissa, exponent)
        blocks[:, offset : offset + 2] = scaled.astype(little).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _type_name(tensor: LogicalTensor) -> str:
    assert tensor.scheme is not None
    assert tensor.scheme.startswith(SCHEME_PREFIX)
    return tensor.scheme[len(SCHEME_PREFIX) :]


@functools.cache
def _block_type(type_name: str) -> tuple[int, int, int]:
    """(ggml type code, elements per block, bytes per block)."""
    for code, (name, block, type_size) in GGML_TYPES.items():
        if name == type_name:
            return code, block, type_size
    raise KeyError(type_name)


def gguf_view(reader: Reader) -> View | None:
    """The VIEW_FACTORIES entry: a GGUFView for a GGUF file with block-quantized tensors,
    those gguf cannot dequantize included (their bytes mean something only in GGUF:
    View.stored_format keeps them from being written into another format as they are)."""
    if not isinstance(reader, GgufReader):
        return None
    view = GGUFView(reader)
    return None if all(t.plain for t in view.tensors()) and not view.undecoded() else view
