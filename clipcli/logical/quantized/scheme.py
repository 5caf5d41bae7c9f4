"""The interface every quantization scheme module implements.

A scheme module recognises its weights among a checkpoint's stored tensors (by names,
dtypes and shapes, and by `config.json`'s `quantization_config` when a model directory
has one) and decodes their real values from the stored codes and scales. It reads no
file: the view (clipcli.logical.quantized.view) hands it arrays.

Decoding is by rows of the real weight, seen as 2-D [rows, columns] (rows = the product
of every dimension but the last), so that a weight of any size streams in bounded memory:
`decode_rows` gets the stored code rows that cover real rows [start, stop) and the whole
small tensors (scales, zero points, g_idx, global scales, quant maps), which the view
reads once per weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo
    from clipcli.logical.view import Part


class Recognised(NamedTuple):
    """One quantized weight found among the stored tensors."""

    name: str  # the weight it stands for: "X.weight" (gpt-oss "X_blocks": "X")
    scheme: str  # e.g. "fp8-block", "mxfp4", "nvfp4", "gptq-int4", "awq-int4", "bnb-nf4"
    shape: tuple[int, ...]  # the real weight's shape (Linear weights: [out, in])
    codes: str  # the stored tensor holding the payload (kept byte for byte by a clip)
    parts: tuple[Part, ...]  # every stored tensor it is made of (codes first), with roles
    side: tuple[Part, ...] = ()  # stored tensors beside it that are not values (input_scale)
    params: Mapping[str, Any] = {}  # bits, block or group size, version, ...
    # True when the codes hold the weight's transpose (GPTQ, AWQ store Linear weights as
    # [in, out]): `shape` is still the real weight's [out, in], but code_rows/decode_rows
    # count rows of the transpose (shape reversed) and decode_rows returns them. Norms
    # need no reordering; a view that writes C order of `shape` transposes.
    transposed: bool = False


# Reads one small stored tensor whole (the scheme checks its size first): what recognise
# needs when a real shape is stored as data (compressed-tensors' `weight_shape`,
# bitsandbytes' JSON quant state), not in a header.
ReadSmall = Callable[[str], "np.ndarray"]


class Scheme(Protocol):
    """A scheme module (e.g. clipcli.logical.quantized.fp8_block) satisfies this."""

    NAMES: Sequence[str]  # the scheme names it recognises

    def recognise(
        self,
        stored: Mapping[str, TensorInfo],
        config: Mapping[str, Any] | None,
        read: ReadSmall | None = None,
    ) -> list[Recognised]:
        """Its weights among `stored` (name -> info). Refuses (clipcli.errors, exit 3)
        what is ambiguous or inconsistent (a scale whose shape does not fit), never
        guesses. `read` reads a small stored tensor whole; schemes whose real shape is
        stored as data need it (without it they refuse the weights they find)."""
        ...

    def code_rows(self, weight: Recognised, start: int, stop: int) -> tuple[int, int]:
        """The rows of the stored codes tensor (seen as 2-D [rows, last dim]) that hold
        real rows [start, stop)."""
        ...

    def decode_rows(
        self,
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
    ) -> np.ndarray:
        """Real rows [start, stop) as float64 [stop - start, columns], exact (every real
        value these schemes define is a float64 exactly, products of a code and a scale
        included), from `codes` = code_rows' rows and `small` = the other parts, whole."""
        ...

    def scaled_parts(self, weight: Recognised) -> list[str]:
        """What a clip multiplies: the scales (and offsets that scale with the weight),
        never the codes or zero points. A scheme may also define
        `stored_scaler(weight, part) -> (chunk, mantissa, exponent) -> chunk | None` for a
        part whose bytes hold a scale (bitsandbytes' JSON nested_offset): the view and the
        write pass then rewrite that part with it instead of scaling its values."""
        ...

    # Optional (looked up with getattr): `stored_scaler(weight, part)`, the function
    # (chunk, mantissa, exponent) -> chunk for a scaled part whose bytes are not float
    # values a factor rounds into (E8M0 exponents: rules.lower_e8m0_exponents), or
    # None; and `power_of_two` in Recognised.params when that function takes the factor
    # rounded down to a power of two (View.power_of_two_factors).
    #
    # Faster paths, each optional and each giving what decoding gives:
    # - `code_tables(weight, codes, start, stop, small)` -> (counts, values) | None: how
    #   often each code occurs per block and the values it stands for (block FP8, MXFP4,
    #   NVFP4); `measure_rows` (rules.measured_through) measures a run through them, and
    #   the factor search counts a run under each factor's scales through them.
    # - `code_energies(weight, codes, start, stop, small)` -> (first scale, energies) |
    #   None, with ENERGY_UNIT: the exact sums of the codes' squared values under each
    #   scale (in units of 2**-ENERGY_UNIT), kept by the view for every check of a clip.
    # - `scale_energies(...)` -> (energies, scales) | None: the same per run, for a check
    #   where the weight's energies are not kept (integer codes).
    # - `decode_columns(weight, codes, start, stop, small, (first, last))`: a transposed
    #   weight's rows restricted to some columns (the view's gathering into C order).
    # The integer schemes make theirs from their CodeTerms (intcodes.term_hooks).


def row_for_row(weight: Recognised, start: int, stop: int) -> tuple[int, int]:  # noqa: ARG001
    """code_rows for the schemes whose codes hold one real row per stored row."""
    return start, stop
