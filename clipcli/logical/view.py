"""The layer between what a reader stores and what a job acts on.

A Reader lists *stored* tensors. A View maps them to *logical* tensors: the ones a user
means, and the ones jobs select, measure, plan, clip, diff and report. The identity view
serves plain checkpoints (every stored tensor is its own logical tensor). Other views:

- a quantized weight: codes + scales (+ zero points), its real values codes x scales;
- a torch tensor: a strided view of a storage (several tensors may share one);
- a GGUF block-quantized tensor: a view over its blocks.

A plan decides on logical tensors and is then *lowered* to a plan on stored tensors (a
quantized weight scaled by f: codes KEEP, scales SCALE), which the write pass carries out
as today. Stored tensors that belong to a logical one but are not values themselves
(scales, zero points, activation scales) are listed with a role of their own and never
enter a global norm.

Nothing here reads a file on its own: every method gets the stored Reader it maps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from fractions import Fraction

    import numpy as np

    from clipcli.formats.base import Reader, TensorInfo
    from clipcli.numerics.casting import Cast
    from clipcli.numerics.norms import NormAccumulator


class Part(NamedTuple):
    """One stored tensor a logical tensor is made of, and what it is to it."""

    name: str  # the stored tensor's name
    role: str  # e.g. "values", "codes", "scale", "zero_point", "global_scale", "half"


class Quantization(NamedTuple):
    """What the row of a quantized weight says of it (norms, ls): its scheme, the stored
    tensors it is made of (codes first), and the dtype its row shows: the dtype a
    framework dequantizes it to (its float16/bfloat16/float32 scales' dtype, or the one
    its quant state names; float32 where the scales are 8-bit). Its values themselves are
    measured exactly, in float64, whatever that dtype."""

    scheme: str
    stored: tuple[str, ...]
    dtype: str


class QuantizedRows(NamedTuple):
    """What the rows of a checkpoint with quantized weights say of them: each weight's
    Quantization, and each stored tensor listed with a role (a scale, a zero point) ->
    (its role, the weight it belongs to or None)."""

    weights: Mapping[str, Quantization]
    parts: Mapping[str, tuple[str, str | None]]

    def cell(self, name: str) -> dict[str, Any] | None:
        """The `quantization` object of a row (JSON), None for a plain tensor."""
        q = self.weights.get(name)
        if q is not None:
            return {"scheme": q.scheme, "stored": list(q.stored)}
        part = self.parts.get(name)
        if part is not None:
            return {"role": part[0], "of": part[1]}
        return None

    def dtype(self, name: str, stored: str) -> str:
        q = self.weights.get(name)
        return stored if q is None else q.dtype


class LogicalTensor(NamedTuple):
    """A tensor as a user means it.

    `info` is the logical tensor: its name (the weight it stands for, e.g. `X.weight`),
    the dtype of its real values (what its chunks are), its real shape, and nbytes =
    numel x itemsize of that dtype. `parts` are the stored tensors behind it; `scheme`
    names how they combine (None: a plain tensor, one part, values as stored).
    """

    info: TensorInfo
    parts: tuple[Part, ...]
    scheme: str | None = None

    @property
    def plain(self) -> bool:
        return self.scheme is None


class View(ABC):
    """How the stored tensors of one checkpoint make its logical tensors."""

    # The format whose files alone give the stored parts their meaning (GGUF: rows of
    # blocks), None when they are tensors any format holds. Into another format, convert
    # writes the logical tensors (dequantized) and a clip is refused.
    stored_format: str | None = None

    @abstractmethod
    def tensors(self) -> list[LogicalTensor]:
        """Every logical tensor, in the order of the stored tensors they start at. Every
        stored tensor appears in exactly one logical tensor's parts or in side_tensors()."""

    def undecoded(self) -> list[tuple[str, str]]:
        """(stored tensor, layout) of each quantized tensor this view reads as its stored
        bytes, its real values not decoded (GGUF block types gguf cannot dequantize): a
        convert that writes real values refuses them (clipcli.jobs.scope.refuse_undecoded)."""
        return []

    def side_tensors(self) -> list[tuple[TensorInfo, str]]:
        """Stored tensors that are part of a logical tensor without being values (scales,
        zero points, activation scales), each with its role: listed, never in a norm."""
        return []

    @abstractmethod
    def chunks(
        self, reader: Reader, tensor: LogicalTensor, chunk_elems: int | None = None
    ) -> Iterator[np.ndarray]:
        """The real values of `tensor`, flat, in C order, in chunks (bounded memory)."""

    def cast_chunks(
        self, reader: Reader, tensor: LogicalTensor, target: np.dtype[Any]
    ) -> Iterator[Cast]:
        """The real values of `tensor` cast to `target` (clipcli.numerics.casting), in
        chunks: what `convert --dtype` writes. A view may compute them faster (tables)."""
        from clipcli.numerics.casting import cast_chunk

        for chunk in self.chunks(reader, tensor):
            yield cast_chunk(chunk, target)

    def measured_loaders(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensor: LogicalTensor,  # noqa: ARG002 - interface
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """Thread-safe loaders of the statistics of `tensor`'s values, piece by piece (a
        quantized weight measured through per-block tables, without its values), whose
        merge is what measuring chunks() gives; None (the default): measure chunks()."""
        return None

    @property
    def identity(self) -> bool:
        """True when every logical tensor is one stored tensor, unchanged."""
        return False

    def lowerable(self, tensor: LogicalTensor) -> str | None:  # noqa: ARG002 - interface
        """Why a clip cannot act on `tensor` through its stored tensors (one line), or
        None when it can."""
        # None by default: clipcli.logical.lowering carries a SCALE out for any view (its
        # scaled_parts); a view says here which of its tensors it cannot (quantfp, issue 21).
        return None

    def scaled_parts(self, tensor: LogicalTensor) -> list[str]:
        """Lowering a SCALE: the stored tensors a factor multiplies (each rounded once, as
        a plain tensor's values are); every other part is kept byte for byte. Identity and
        plain tensors: the tensor itself. Quantized: its scales (and offsets that scale
        with the weight), never its codes or zero points."""
        return [p.name for p in tensor.parts]

    def stored_scaler(
        self,
        tensor: LogicalTensor,  # noqa: ARG002 - interface
        part: str,  # noqa: ARG002 - interface
    ) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
        """Lowering a SCALE onto the stored part `part` (one of scaled_parts()) when the
        factor multiplies fields inside the part's bytes rather than its values (GGUF: the
        float16 scales inside every block of a uint8 tensor of blocks): the function
        (chunk, mantissa, exponent) -> the chunk with those fields scaled and rounded, every
        other byte kept. The stored reader's chunks of such a part hold whole blocks.
        None (the default): the part is a float tensor, scaled and rounded value by value
        (clipcli.numerics.rounding.scale_chunk)."""
        return None

    def refused_factor(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensor: LogicalTensor,  # noqa: ARG002 - interface
        mantissa: float,  # noqa: ARG002 - interface
        exponent: int,  # noqa: ARG002 - interface
    ) -> str | None:
        """Why the stored tensors cannot carry a SCALE of `tensor` by this very factor (one
        line naming it), None when they can: checked once the plan is made, before
        anything is written (clipcli.jobs.lowering.check_lowerable). MXFP4: an E8M0 scale
        byte that would have to go below 0 under nonzero codes, or a NaN scale byte."""
        return None

    def scaled_chunks(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> Iterator[np.ndarray]:
        """The real values `tensor` has once scaled_parts() are scaled by mantissa *
        2**exponent and rounded exactly as the write pass rounds them
        (clipcli.numerics.rounding.scale_chunk): what the factor search checks against
        the limit, so the bound holds for what is written. Float64 or the values' dtype."""
        from clipcli.numerics import rounding

        for chunk in self.chunks(reader, tensor):
            yield rounding.scale_chunk(chunk, mantissa, exponent)

    def scaled_measured_loaders(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensor: LogicalTensor,  # noqa: ARG002 - interface
        mantissa: float,  # noqa: ARG002 - interface
        exponent: int,  # noqa: ARG002 - interface
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """As measured_loaders, of the values scaled_chunks() gives (what a clip wrote:
        the report's norm after), piece by piece in any order; None (the default):
        measure scaled_chunks()."""
        return None

    def energy_sumsq_together(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensors: Sequence[LogicalTensor],  # noqa: ARG002 - interface
        mantissa: float,  # noqa: ARG002 - interface
        exponent: int,  # noqa: ARG002 - interface
    ) -> tuple[frozenset[str], tuple[Fraction, Fraction] | None]:
        """The sum of squares of scaled_chunks()' values of as many of `tensors` as the
        view can give at once, within a bound of about 2**-48 of it on either side (a
        quantized view: the weights whose code energies it keeps): (their names, (sum,
        bound)). Default: none of them, (empty, None)."""
        return frozenset(), None

    def scaled_sumsq_loaders(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensor: LogicalTensor,  # noqa: ARG002 - interface
        mantissa: float,  # noqa: ARG002 - interface
        exponent: int,  # noqa: ARG002 - interface
    ) -> Iterator[Callable[[], tuple[Fraction, Fraction] | None]] | None:
        """Thread-safe loaders of the sum of squares of scaled_chunks()' values, piece by
        piece, each (sum, a bound of its error on either side), or None for a piece whose
        values hold NaN or infinity: the factor search's check of a quantized weight from
        its code counts, without decoding it (clipcli.numerics.coded.bounded_table_sumsq).
        None (the default): the check sums scaled_chunks() itself."""
        return None

    def quantization(self, tensor: LogicalTensor) -> Quantization | None:  # noqa: ARG002 - interface
        """What the row of a quantized weight says of it; None for any other tensor."""
        return None

    def power_of_two_factors(self, tensor: LogicalTensor) -> bool:  # noqa: ARG002 - interface
        """True when the stored scales hold only powers of two (E8M0): a factor is then
        rounded down to a power of two."""
        return False

    def shared_with(self, tensor: LogicalTensor) -> str | None:  # noqa: ARG002 - interface
        """The name of an earlier logical tensor whose values `tensor` shares exactly
        (tied weights: counted once in a global norm), or None."""
        return None

    def overlapping(self) -> list[tuple[str, ...]]:
        """Groups of logical tensors whose values overlap in part without being the same
        (views of one storage at other offsets or strides): each counts on its own, and a
        global norm counts their shared values once per tensor."""
        return []

    def stored_names(self, tensors: Sequence[LogicalTensor]) -> list[str]:
        """The stored tensors behind `tensors`, each once, in order."""
        seen: dict[str, None] = {}
        for t in tensors:
            for part in t.parts:
                seen.setdefault(part.name)
        return list(seen)
