"""QuantizedView: the logical tensors of a checkpoint whose weights may be quantized.

Every scheme module of registry.SCHEMES is asked for its weights among the stored tensors
(with config.json's quantization_config when the reader is a model directory); a stored
tensor claimed twice, by two schemes or two weights, is a one-line refusal (exit 3), never
a guess. A quantized weight's small parts (scales, zero points, global scales) are read
whole once per pass over it; its codes stream by rows, so memory stays bounded by the
chunk size whatever the weight's size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipcli.errors import InputError
from clipcli.formats.base import TensorInfo, default_chunk_elems
from clipcli.logical.quantized.registry import SCHEMES
from clipcli.logical.view import LogicalTensor, Part, View

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import Reader
    from clipcli.logical.quantized.scheme import Recognised, Scheme
    from clipcli.numerics.casting import Cast

CONFIG_LIMIT = 16 << 20  # bytes: a config.json is a few KB; never slurp a huge one
# The small parts of one weight are read whole: more than this is no real layout's scales
# (DeepSeek's largest: ~32 KB; a group-32 scale of a 1 GiB weight: ~64 MiB).
SMALL_PARTS_LIMIT = 1 << 30


def quantization_config(directory: Path | None) -> Mapping[str, Any] | None:
    """config.json's quantization_config, or None when there is none. A config.json that is
    there but cannot be read as one object, or whose quantization_config is not an object,
    is refused: its scheme would otherwise be guessed from names."""
    if directory is None:
        return None
    from clipcli.formats.sharded.layout import allowed_roots, real_path_inside
    from clipcli.system.inputs import read_input

    path = directory / "config.json"
    if not path.exists() and not path.is_symlink():
        return None
    real = real_path_inside(path, allowed_roots(directory))
    raw, _ = read_input(path, CONFIG_LIMIT, real)
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(path, f"is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        return None  # not a Hugging Face config: says nothing about quantization
    quant = document.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise InputError(path, "quantization_config is not an object")
    return quant


class QuantizedView(View):
    """Quantized weights as one logical tensor each; every other stored tensor as itself."""

    def __init__(
        self,
        infos: Sequence[TensorInfo],
        config: Mapping[str, Any] | None,
        schemes: Sequence[Scheme] = SCHEMES,
    ) -> None:
        stored = {info.name: info for info in infos}
        self._stored = stored
        self.config = config
        self._weights: dict[str, tuple[Scheme, Recognised]] = {}
        owner: dict[str, tuple[str, str]] = {}  # stored name -> (weight, scheme)
        for scheme in schemes:
            for found in scheme.recognise(stored, config):
                for part in (*found.parts, *found.side):
                    if part.name not in stored:
                        raise InputError(part.name, f"named by {found.name} but not stored")
                    claim = owner.get(part.name)
                    if claim is not None:
                        raise InputError(
                            part.name,
                            f"claimed by both {claim[0]} ({claim[1]}) and {found.name} "
                            f"({found.scheme}): ambiguous, refusing to guess",
                        )
                    owner[part.name] = (found.name, found.scheme)
                if found.name in self._weights or (
                    found.name in stored and owner.get(found.name, (found.name,))[0] != found.name
                ):
                    raise InputError(found.name, "names two quantized weights: ambiguous")
                self._weights[found.name] = (scheme, found)
        self._by_codes = {rec.codes: rec.name for _, rec in self._weights.values()}
        self._owner = owner
        self._side: list[tuple[TensorInfo, str]] = []
        self._tensors: list[LogicalTensor] = []
        roles = {
            p.name: p.role
            for _, rec in self._weights.values()
            for p in (*rec.parts[1:], *rec.side)
            if p.name != rec.codes
        }
        for info in infos:
            weight = self._by_codes.get(info.name)
            if weight is not None:
                _, rec = self._weights[weight]
                self._tensors.append(_logical(rec))
            elif info.name in roles:
                self._side.append((info, roles[info.name]))
            elif info.name not in owner:
                self._tensors.append(LogicalTensor(info, (Part(info.name, "values"),)))

    @classmethod
    def of(cls, reader: Reader) -> QuantizedView:
        return cls(reader.infos, quantization_config(reader.model_directory))

    # ------------------------------------------------------------ what is there

    def tensors(self) -> list[LogicalTensor]:
        return list(self._tensors)

    def side_tensors(self) -> list[tuple[TensorInfo, str]]:
        return list(self._side)

    @property
    def identity(self) -> bool:
        return not self._weights

    def recognised(self, tensor: LogicalTensor) -> Recognised:
        return self._weights[tensor.info.name][1]

    # ------------------------------------------------------------ values

    def chunks(
        self, reader: Reader, tensor: LogicalTensor, chunk_elems: int | None = None
    ) -> Iterator[np.ndarray]:
        if tensor.plain:
            yield from reader.chunks(self._stored[tensor.parts[0].name], chunk_elems)
            return
        yield from self._decoded(reader, tensor, chunk_elems, None)

    def cast_chunks(
        self, reader: Reader, tensor: LogicalTensor, target: np.dtype[Any]
    ) -> Iterator[Cast]:
        """A scheme with cast_rows (256-entry tables per scale) gives each run of rows in
        `target` directly; else (and where its tables overflow) decode, then cast."""
        from clipcli.numerics.casting import Cast, cast_chunk

        if tensor.plain or not hasattr(self._weights[tensor.info.name][0], "cast_rows"):
            yield from super().cast_chunks(reader, tensor, target)
            return
        scheme, rec = self._weights[tensor.info.name]
        cast_rows = scheme.cast_rows  # type: ignore[attr-defined]  # optional, as checked
        for start, stop, codes, small in self._code_runs(reader, tensor, None, None):
            values = cast_rows(rec, codes, start, stop, small, target)
            if values is None:
                decoded = scheme.decode_rows(rec, codes, start, stop, small)
                yield cast_chunk(decoded.reshape(-1), target)
            else:
                yield Cast(values.reshape(-1), 0, 0.0)

    def scaled_chunks(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> Iterator[np.ndarray]:
        if tensor.plain:
            yield from super().scaled_chunks(reader, tensor, mantissa, exponent)
            return
        yield from self._decoded(reader, tensor, None, (mantissa, exponent))

    def _small_parts(
        self, reader: Reader, rec: Recognised, factor: tuple[float, int] | None, scheme: Scheme
    ) -> dict[str, np.ndarray]:
        small_infos = [self._stored[p.name] for p in rec.parts if p.name != rec.codes]
        total = sum(info.nbytes for info in small_infos)
        if total > SMALL_PARTS_LIMIT:
            raise InputError(
                rec.name,
                f"its scales and other small parts are {total} bytes; the limit is "
                f"{SMALL_PARTS_LIMIT}",
            )
        small = {info.name: reader.read(info) for info in small_infos}
        if factor is not None:
            from clipcli.numerics import rounding

            for name in scheme.scaled_parts(rec):
                small[name] = rounding.scale_chunk(small[name], factor[0], factor[1]).reshape(
                    small[name].shape
                )
        return small

    def _decoded(
        self,
        reader: Reader,
        tensor: LogicalTensor,
        chunk_elems: int | None,
        factor: tuple[float, int] | None,
    ) -> Iterator[np.ndarray]:
        scheme, rec = self._weights[tensor.info.name]
        columns = rec.shape[-1] if rec.shape else 1
        for start, stop, codes, small in self._code_runs(reader, tensor, chunk_elems, factor):
            values = scheme.decode_rows(rec, codes, start, stop, small)
            if values.shape != (stop - start, columns):
                raise AssertionError(f"{rec.scheme} decoded {values.shape} for rows {start}:{stop}")
            yield values.reshape(-1)

    def _code_runs(
        self,
        reader: Reader,
        tensor: LogicalTensor,
        chunk_elems: int | None,
        factor: tuple[float, int] | None,
    ) -> Iterator[tuple[int, int, np.ndarray, dict[str, np.ndarray]]]:
        """(start, stop, the code rows that hold real rows [start, stop), the small parts),
        a bounded run of rows at a time."""
        import numpy as np

        scheme, rec = self._weights[tensor.info.name]
        small = self._small_parts(reader, rec, factor, scheme)
        columns = rec.shape[-1] if rec.shape else 1
        rows = tensor.info.numel // columns if columns else 0
        if rows == 0 or columns == 0:
            return
        budget = chunk_elems or default_chunk_elems(np.dtype(np.float64))
        step = max(1, budget // columns)
        cursor = _RowCursor(reader, self._stored[rec.codes])
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            first, last = scheme.code_rows(rec, start, stop)
            yield start, stop, cursor.rows(first, last), small

    # ------------------------------------------------------------ clipping hooks

    def lowerable(self, tensor: LogicalTensor) -> str | None:
        """A factor is carried by the scales when they are floats that round as any float
        tensor does (float32, bfloat16, float16, fp8 e4m3/e5m2). Integer-stored or E8M0
        exponents (MXFP4) would need a power-of-two step of the exponent instead: refused."""
        if tensor.plain:
            return None
        from clipcli.dtypes import is_floating

        for name in self.scaled_parts(tensor):
            dtype = self._stored[name].dtype
            if not is_floating(dtype) or dtype.name == "float8_e8m0fnu":
                return (
                    f"{tensor.info.name}: clipping {tensor.scheme} through its {dtype.name} "
                    "scales is not supported"
                )
        return None

    def scaled_parts(self, tensor: LogicalTensor) -> list[str]:
        if tensor.plain:
            return [tensor.parts[0].name]
        scheme, rec = self._weights[tensor.info.name]
        return scheme.scaled_parts(rec)

    def power_of_two_factors(self, tensor: LogicalTensor) -> bool:
        if tensor.plain:
            return False
        return bool(self._weights[tensor.info.name][1].params.get("power_of_two", False))


def _logical(rec: Recognised) -> LogicalTensor:
    import numpy as np

    numel = 1
    for d in rec.shape:
        numel *= d
    dtype = np.dtype(np.float64)
    info = TensorInfo(rec.name, dtype, rec.shape, numel * dtype.itemsize)
    return LogicalTensor(info, rec.parts, rec.scheme)


class _RowCursor:
    """Rows [first, last) of a stored tensor seen as 2-D [rows, last dim], asked for in
    non-decreasing order (ranges may overlap the previous one), read once, in order."""

    def __init__(self, reader: Reader, info: TensorInfo) -> None:
        import numpy as np

        self._width = info.shape[-1] if info.shape else 1
        self._rows = info.numel // self._width if self._width else 0
        step = max(1, default_chunk_elems(info.dtype) // max(1, self._width)) * self._width
        self._chunks = reader.chunks(info, step) if self._width else iter(())
        self._buffer = np.empty(0, dtype=info.dtype)
        self._begin = 0  # the row the buffer starts at

    def rows(self, first: int, last: int) -> np.ndarray:
        import numpy as np

        if not self._begin <= first <= last <= self._rows:
            raise AssertionError(f"rows {first}:{last} asked after row {self._begin}")
        drop = (first - self._begin) * self._width
        self._buffer = self._buffer[drop:]
        self._begin = first
        need = (last - first) * self._width
        pieces = [self._buffer]
        held = self._buffer.size
        while held < need:
            piece = next(self._chunks)
            pieces.append(piece)
            held += piece.size
        if len(pieces) > 1:
            self._buffer = np.concatenate(pieces)
        return self._buffer[:need].reshape(last - first, self._width)


def quantized_view(reader: Reader) -> QuantizedView | None:
    """The view factory (clipcli.logical.views): a QuantizedView when some scheme claims a
    weight, else None (the identity view: the stored reader as it is)."""
    view = QuantizedView.of(reader)
    return None if view.identity else view
