"""QuantizedView: the logical tensors of a checkpoint whose weights may be quantized.

Every scheme module of registry.SCHEMES is asked for its weights among the stored tensors
(with config.json's quantization_config when the reader is a model directory); a stored
tensor claimed twice, by two schemes or two weights, is a one-line refusal (exit 3), never
a guess. A quantized weight's small parts (scales, zero points, global scales) are read
whole once per pass over it; its codes stream by rows, so memory stays bounded by the
chunk size whatever the weight's size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.errors import InputError
from clipcli.formats.base import TensorInfo, default_chunk_elems
from clipcli.logical.quantized import rules, targets
from clipcli.logical.quantized.incomplete import refuse_incomplete
from clipcli.logical.quantized.markers import quantization_config
from clipcli.logical.quantized.registry import SCHEMES
from clipcli.logical.view import LogicalTensor, Part, Quantization, View

if TYPE_CHECKING:
    from fractions import Fraction

    import numpy as np

    from clipcli.formats.base import Reader
    from clipcli.logical.quantized.scheme import ReadSmall, Recognised, Scheme
    from clipcli.numerics.casting import Cast
    from clipcli.numerics.norms import NormAccumulator

# The small parts of one weight are read whole: more than this is no real layout's scales
# (DeepSeek's largest: ~32 KB; a group-32 scale of a 1 GiB weight: ~64 MiB).
SMALL_PARTS_LIMIT = 1 << 30
# The dtypes a quantized weight's row may show (Quantization.dtype).
SHOWN_DTYPES = frozenset({"float16", "bfloat16", "float32"})
# Elements per run of rows measured through tables (measured_loaders): 1 MiB of 8-bit
# codes, so that each run's tables and counts (256 entries per block) are few against its
# values (128 x 128 blocks of a 16384-column weight: 64 rows, 1/64 of them).
MEASURED_RUN_ELEMENTS = 1 << 20
# Code energies kept between the factor search's checks (QuantizedView._code_energies): one
# int64 per scale and the scale itself, 12 MiB per 64 GiB of 128 x 128-block FP8 codes,
# 10 bytes per 64 of group-128 int4 codes; weights past it are counted at each check.
ENERGY_BUDGET_BYTES = 64 << 20
# Codes a kept energy must stand for on average (QuantizedView._code_energies): a check
# costs ~40 ns a kept scale and decoding ~25 ns a value, so a weight of one scale for every
# code or two (1 x 1 blocks, groups of 1) is checked run by run instead (attack checks9att:
# 40 such weights clipped 10% slower than by decoding).
ENERGY_MIN_CODES = 16
# Scales a check works through at once (QuantizedView.energy_sumsq_together): its arrays
# are a few times this many float64 whatever the number of scales kept.
CHECK_PIECE = 1 << 20
# Real values held at once to put a transposed weight (GPTQ, AWQ) in C order: 32 MiB of
# float64, twice (the block and its transpose); a 4096 x 4096 weight takes 4 passes.
TRANSPOSE_ELEMENTS = 1 << 22
# Quantization parameters of activations a quantized checkpoint stores beside its weights
# (compressed-tensors' input/output activations and kv_cache_scheme, vLLM's and ModelOpt's
# FP8 KV-cache scales: `X.k_scale`, `X.self_attn.v_scale`, `X.k_proj.output_scale`): no
# weight, never in a norm, copied byte for byte. Read so only where the checkpoint is
# quantized (a quantization_config, or a quantized weight recognised): a plain model's own
# parameter of such a name stays a weight.
ACTIVATION_SUFFIXES = (
    *(f".{what}_scale" for what in ("input", "output", "q", "k", "v", "kv")),
    *(f".{what}_global_scale" for what in ("input", "output")),
    *(f".{what}_zero_point" for what in ("input", "output", "q", "k", "v")),
)
# The same parameters of the root module (names without a prefix: rules.module_prefix).
ACTIVATION_BARE = rules.bare_parts(ACTIVATION_SUFFIXES)
ACTIVATION_ROLE = "activation_scale"


def small_reader(reader: Reader) -> ReadSmall:
    """What recognise() reads small stored tensors whole with (compressed-tensors'
    `weight_shape`, bitsandbytes' JSON quant state): at most SMALL_PARTS_LIMIT bytes of
    them in all, whatever a file's names claim, each refused before it is read."""
    stored = {info.name: info for info in reader.infos}
    spent = 0

    def read(name: str) -> np.ndarray:
        nonlocal spent
        info = stored[name]
        if spent + info.nbytes > SMALL_PARTS_LIMIT:
            raise InputError(
                name,
                f"reading it to recognise a quantized weight would read more than "
                f"{SMALL_PARTS_LIMIT} bytes of small tensors",
            )
        spent += info.nbytes
        return reader.read(info)

    return read


class QuantizedView(View):
    """Quantized weights as one logical tensor each; every other stored tensor as itself."""

    def __init__(
        self,
        infos: Sequence[TensorInfo],
        config: Mapping[str, Any] | None,
        schemes: Sequence[Scheme] = SCHEMES,
        read: ReadSmall | None = None,
    ) -> None:
        stored = {info.name: info for info in infos}
        self._stored = stored
        self.config = config
        self._weights: dict[str, tuple[Scheme, Recognised]] = {}
        self._energies: dict[str, np.ndarray | None] = {}  # see _code_energies
        self._kept_scales: dict[str, np.ndarray] = {}
        self._energy_bytes = 0
        owner: dict[str, tuple[str, str]] = {}  # stored name -> (weight, scheme)
        assigned = targets.assign(stored, config) if config is not None else None
        units = [(stored, config)] if assigned is None else list(assigned.by_group.values())
        for scheme, (unit, unit_config) in ((s, u) for u in units for s in schemes):
            for found in scheme.recognise(unit, unit_config, read):
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
                if found.name in self._weights:
                    raise InputError(found.name, "names two quantized weights: ambiguous")
                self._weights[found.name] = (scheme, found)
        for name, (_, found) in self._weights.items():
            # A stored tensor of the weight's own name that is not one of its parts (a
            # plain X.weight beside X.qweight): two tensors would claim one logical name.
            if name in stored and owner.get(name, ("",))[0] != name:
                raise InputError(
                    name,
                    f"stored as a tensor and as a quantized weight ({found.scheme}, from "
                    f"{found.codes}): two tensors claim one name, refusing to guess",
                )
        if assigned is not None and config is not None:
            for module, (tensors, why) in assigned.undecided.items():
                _refuse_undecided(module, tensors, why, config, schemes)
        if config is not None:
            _refuse_undescribed(stored, owner, config, schemes)
        # A set missing a part is recognised by no scheme: refused, never read as plain
        # tensors (its codes measured as a weight, its scales in the global norm).
        refuse_incomplete(stored, owner, config, {rec.scheme for _, rec in self._weights.values()})
        self._by_codes = {rec.codes: rec.name for _, rec in self._weights.values()}
        self._owner = owner
        self._activation = (
            [
                name
                for name in stored
                if name not in owner
                # a module's, or the root module's bare one (rules.bare_parts)
                and (name.endswith(ACTIVATION_SUFFIXES) or name in ACTIVATION_BARE)
            ]
            if config is not None or self._weights
            else []
        )
        self._infos = infos
        # Laid out on first use: a plain checkpoint (no weight recognised) never needs them,
        # and 200,000 tensors' records cost a second.
        self._layout: tuple[list[LogicalTensor], list[tuple[TensorInfo, str]]] | None = None

    def _laid_out(self) -> tuple[list[LogicalTensor], list[tuple[TensorInfo, str]]]:
        if self._layout is not None:
            return self._layout
        side: list[tuple[TensorInfo, str]] = []
        tensors: list[LogicalTensor] = []
        roles = {
            p.name: p.role
            for _, rec in self._weights.values()
            for p in (*rec.parts[1:], *rec.side)
            if p.name != rec.codes
        }
        roles.update(dict.fromkeys(self._activation, ACTIVATION_ROLE))
        for info in self._infos:
            weight = self._by_codes.get(info.name)
            if weight is not None:
                _, rec = self._weights[weight]
                tensors.append(_logical(rec))
            elif info.name in roles:
                side.append((info, roles[info.name]))
            elif info.name not in self._owner:
                tensors.append(LogicalTensor(info, (Part(info.name, "values"),)))
        self._layout = tensors, side
        return self._layout

    @classmethod
    def of(cls, reader: Reader) -> QuantizedView:
        return cls(
            reader.infos,
            quantization_config(reader.model_directory),
            read=small_reader(reader),
        )

    # ------------------------------------------------------------ what is there

    def tensors(self) -> list[LogicalTensor]:
        return list(self._laid_out()[0])

    def side_tensors(self) -> list[tuple[TensorInfo, str]]:
        return list(self._laid_out()[1])

    @property
    def identity(self) -> bool:
        return not self._weights and not self._activation

    def quantization(self, tensor: LogicalTensor) -> Quantization | None:
        if tensor.plain:
            return None
        rec = self._weights[tensor.info.name][1]
        return Quantization(rec.scheme, tuple(p.name for p in rec.parts), self._shown_dtype(rec))

    def _shown_dtype(self, rec: Recognised) -> str:
        """The dtype a framework dequantizes `rec` to (Quantization.dtype)."""
        declared = rec.params.get("dtype")
        if isinstance(declared, str) and declared.removeprefix("torch.") in SHOWN_DTYPES:
            return declared.removeprefix("torch.")
        for part in rec.parts:
            dtype = self._stored[part.name].dtype.name
            if part.role == "scale" and dtype in SHOWN_DTYPES:
                return dtype
        return "float32"

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
            import numpy as np

            from clipcli.numerics import rounding

            for name in scheme.scaled_parts(rec):
                # A part whose bytes hold a scale (bitsandbytes' JSON nested_offset) is
                # rewritten by the same function the write pass applies (stored_scaler).
                rewrite = _scheme_scaler(scheme, rec, name) or rounding.scale_chunk
                with np.errstate(all="ignore"):  # an inf or NaN scale stays one
                    scaled = rewrite(small[name], factor[0], factor[1])
                small[name] = scaled.reshape(small[name].shape)
        return small

    def _decoded(
        self,
        reader: Reader,
        tensor: LogicalTensor,
        chunk_elems: int | None,
        factor: tuple[float, int] | None,
    ) -> Iterator[np.ndarray]:
        import numpy as np

        scheme, rec = self._weights[tensor.info.name]
        steps = None  # E8M0 scales: the values times 2**-k, exactly (see below)
        if factor is not None:
            factor, steps = _factor_or_steps(rec, *factor)
        small = self._small_parts(reader, rec, factor, scheme)
        budget = chunk_elems or default_chunk_elems(np.dtype(np.float64))
        if rec.transposed:
            yield from self._transposed(reader, scheme, rec, small, budget)
            return
        for _, _, values in self._decoded_rows(reader, scheme, rec, small, rec.shape, budget):
            if steps is None:
                yield values.reshape(-1)
            else:
                # What the rewritten bytes (stored_scaler) decode to wherever a byte can
                # take the step; a block whose byte cannot (below k, nonzero codes) shows
                # the value it would need, and refused_factor refuses the clip before any
                # write, so the search never takes it for a block left unscaled.
                yield np.ldexp(values, -steps).reshape(-1)

    def _decoded_rows(
        self,
        reader: Reader,
        scheme: Scheme,
        rec: Recognised,
        small: Mapping[str, np.ndarray],
        shape: tuple[int, ...],
        budget: int,
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, stop, rows [start, stop) as float64) of `shape` seen as 2-D, the shape
        the scheme decodes (the real one, or its transpose), about `budget` values each."""
        columns = shape[-1] if shape else 1
        for start, stop, codes in self._code_runs(reader, scheme, rec, shape, budget):
            values = _decode(scheme, rec, codes, start, stop, small)
            if values.shape != (stop - start, columns):
                raise AssertionError(f"{rec.scheme} decoded {values.shape} for rows {start}:{stop}")
            yield start, stop, values

    def _code_runs(
        self,
        reader: Reader,
        scheme: Scheme,
        rec: Recognised,
        shape: tuple[int, ...],
        budget: int,
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, stop, the code rows that hold rows [start, stop) of `shape`)."""
        columns = shape[-1] if shape else 1
        rows = math.prod(shape) // columns if columns else 0
        if rows == 0 or columns == 0:
            return
        step = max(1, budget // columns)
        cursor = _RowCursor(reader, self._stored[rec.codes])
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            first, last = scheme.code_rows(rec, start, stop)
            yield start, stop, cursor.rows(first, last)

    def measured_loaders(
        self, reader: Reader, tensor: LogicalTensor
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """A scheme with measure_rows (counts of each code per block and a 256-entry table
        per block; fp4: per scale code) measures each run of rows without decoding it; a
        weight stored transposed (GPTQ, AWQ) is measured as its codes hold it, each run of
        rows of the transpose decoded once (its values in C order would take a pass over
        the codes per TRANSPOSE_ELEMENTS values: statistics do not depend on the order).
        Loaders of those runs' statistics, for worker threads. None for the others (their
        chunks are measured)."""
        if tensor.plain:
            return None
        scheme, rec = self._weights[tensor.info.name]
        if not rec.transposed and not hasattr(scheme, "measure_rows"):
            return None
        return self._measured_runs(reader, scheme, rec)

    def scaled_measured_loaders(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """The statistics of what a clip wrote (the scales scaled by the factor, or the
        values times 2**-k where the scales are E8M0), measured as measured_loaders
        measures: through code tables where the scheme has them, else decoded once, run
        by run of the rows as the codes hold them (a transposed weight is not gathered)."""
        if tensor.plain:
            return None
        scheme, rec = self._weights[tensor.info.name]
        factor, steps = _factor_or_steps(rec, mantissa, exponent)
        return self._measured_runs(reader, scheme, rec, factor, steps)

    def _measured_runs(
        self,
        reader: Reader,
        scheme: Scheme,
        rec: Recognised,
        factor: tuple[float, int] | None = None,
        steps: int | None = None,
    ) -> Iterator[Callable[[], NormAccumulator]]:
        small = self._small_parts(reader, rec, factor, scheme)
        budget = MEASURED_RUN_ELEMENTS
        shape = rec.shape[::-1] if rec.transposed else rec.shape  # rows as decoded
        for start, stop, codes in self._code_runs(reader, scheme, rec, shape, budget):
            # Measured in a worker after this generator has read on: as every chunk the
            # measuring pipeline hands to workers, the reader's arrays are never reused.
            yield functools.partial(_measured, scheme, rec, codes, start, stop, small, steps)

    def scaled_sumsq_loaders(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> Iterator[Callable[[], tuple[Fraction, Fraction] | None]] | None:
        """The factor search's check (ten or so per clip) without decoding the weight and
        summing its squares exactly each time: a scheme with scale_energies (integer
        codes) sums the energy under each scale times the scale as the write pass will
        have scaled it; one with code_tables counts its codes under those scales, and
        with code_energies counts them once for every check. None for the other schemes
        (bitsandbytes) and transposed weights without scale_energies (the check decodes)."""
        if tensor.plain:
            return None
        scheme, rec = self._weights[tensor.info.name]
        if not hasattr(scheme, "scale_energies") and (
            rec.transposed or not hasattr(scheme, "code_tables")
        ):
            return None
        factor, steps = _factor_or_steps(rec, mantissa, exponent)
        small = self._small_parts(reader, rec, factor, scheme)
        return self._bounded_runs(reader, scheme, rec, small, steps)

    def _bounded_runs(
        self,
        reader: Reader,
        scheme: Scheme,
        rec: Recognised,
        small: Mapping[str, np.ndarray],
        steps: int | None,
    ) -> Iterator[Callable[[], tuple[Fraction, Fraction] | None]]:
        budget = MEASURED_RUN_ELEMENTS
        shape = rec.shape[::-1] if rec.transposed else rec.shape  # rows as decoded
        for start, stop, codes in self._code_runs(reader, scheme, rec, shape, budget):
            yield functools.partial(_bounded_sumsq, scheme, rec, codes, start, stop, small, steps)

    def energy_sumsq_together(
        self,
        reader: Reader,
        tensors: Sequence[LogicalTensor],
        mantissa: float,
        exponent: int,
    ) -> tuple[frozenset[str], tuple[Fraction, Fraction] | None]:
        """The factor search's check of the weights whose code energies are kept
        (_code_energies): sum(energy x scale**2) over all their scales at once, the scales
        scaled as the write pass scales them, each kind of scale in one array, within a
        bound (bounded_table_sumsq): a check of 100,000 expert weights is a few array
        operations, not 100,000 passes. (the names summed, the sum), or (no names, None)
        where a scale is NaN or infinite (each weight is then checked on its own)."""
        from fractions import Fraction

        import numpy as np

        from clipcli.numerics import coded, rounding

        kinds: dict[tuple[Any, ...], list[tuple[np.ndarray, np.ndarray]]] = {}
        names = []
        for tensor in tensors:
            if tensor.plain:
                continue
            scheme, rec = self._weights[tensor.info.name]
            energies = self._code_energies(reader, scheme, rec)
            if energies is None:
                continue
            scales = self._kept_scales[rec.name]
            power_of_two = bool(rec.params.get("power_of_two", False))
            part = scheme.scaled_parts(rec)[0]
            scaler = None if power_of_two else _scheme_scaler(scheme, rec, part)
            unit = scheme.ENERGY_UNIT  # type: ignore[attr-defined]  # with code_energies
            kind = (scales.dtype, power_of_two, scaler, unit)
            kinds.setdefault(kind, []).append((energies, scales))
            names.append(rec.name)
        if not names:
            return frozenset(), None
        total, bound = Fraction(0), Fraction(0)
        steps = rounding.power_of_two_steps(mantissa, exponent)
        for (_, power_of_two, scaler, unit), parts in kinds.items():
            for energies, scales in _pieces(parts, CHECK_PIECE):
                with np.errstate(all="ignore"):  # an inf or NaN scale stays one
                    if power_of_two:  # the values times 2**-k, as _decoded checks them
                        values = np.ldexp(rules.widened(scales), -steps)
                    else:
                        rewrite = scaler or rounding.scale_chunk
                        values = rules.widened(rewrite(scales, mantissa, exponent))
                if not np.isfinite(values).all():
                    return frozenset(), None
                bounded = coded.bounded_table_sumsq(energies, values)
                if bounded is None:
                    return frozenset(), None
                total += bounded[0] / 2**unit
                bound += bounded[1] / 2**unit
        return frozenset(names), (total, bound)

    def _code_energies(self, reader: Reader, scheme: Scheme, rec: Recognised) -> np.ndarray | None:
        """The weight's energies under each of its (flattened) scales, from its scheme's
        code_energies over every run of rows: counted at its first check and kept for
        the others while all the weights' energies stay within ENERGY_BUDGET_BYTES (one
        int64 per scale) and stand for ENERGY_MIN_CODES codes each on average; None where
        the scheme has none, declines, a run's energies fall outside the scales, or
        either rule says no (each check counts runs as it goes)."""
        if rec.name in self._energies:
            return self._energies[rec.name]
        import numpy as np

        code_energies = getattr(scheme, "code_energies", None)
        energy_slots = getattr(scheme, "energy_slots", None)
        scaled = scheme.scaled_parts(rec)
        scale_info = self._stored[scaled[0]] if len(scaled) == 1 else None
        # An energy per stored scale, or per slot where the scheme has slots (MXFP4: one
        # per scale code).
        slots = energy_slots(rec) if energy_slots is not None else None
        size = slots.size if slots is not None else scale_info.numel if scale_info else 0
        kept_bytes = slots.nbytes if slots is not None else scale_info.nbytes if scale_info else 0
        cost = 8 * size + kept_bytes
        energies: np.ndarray | None = None
        affordable = self._energy_bytes + cost <= ENERGY_BUDGET_BYTES
        pays = math.prod(rec.shape) >= ENERGY_MIN_CODES * size
        if code_energies is not None and scale_info is not None and size and affordable and pays:
            from clipcli.system.parallel import loaded

            small = self._small_parts(reader, rec, None, scheme)
            energies = np.zeros(size, dtype=np.int64)
            shape = rec.shape[::-1] if rec.transposed else rec.shape  # rows as decoded
            budget = MEASURED_RUN_ELEMENTS
            runs = self._code_runs(reader, scheme, rec, shape, budget)
            # counted in worker threads, as the measuring pass counts (the reader's arrays
            # are never reused), summed here in order
            counted = (functools.partial(code_energies, rec, c, a, b, small) for a, b, c in runs)
            for found in loaded(counted):
                if found is None or not 0 <= found[0] <= size - found[1].size:
                    energies = None
                    break
                first, partial = found
                energies[first : first + partial.size] += partial
        if energies is not None:
            assert scale_info is not None
            # the scales as stored, read once (or the slots)
            self._kept_scales[rec.name] = slots if slots is not None else reader.read(scale_info)
            self._energy_bytes += cost
        self._energies[rec.name] = energies
        return energies

    def cast_chunks(
        self, reader: Reader, tensor: LogicalTensor, target: np.dtype[Any]
    ) -> Iterator[Cast]:
        """A scheme with cast_rows (a 256-entry table per scale) gives each run of rows in
        `target` directly; else (and where its tables overflow) decode, then cast."""
        import numpy as np

        from clipcli.numerics.casting import Cast, cast_chunk

        if tensor.plain or not hasattr(self._weights[tensor.info.name][0], "cast_rows"):
            yield from super().cast_chunks(reader, tensor, target)
            return
        scheme, rec = self._weights[tensor.info.name]
        if rec.transposed:
            yield from super().cast_chunks(reader, tensor, target)
            return
        cast_rows = scheme.cast_rows  # type: ignore[attr-defined]  # optional, as checked
        small = self._small_parts(reader, rec, None, scheme)
        budget = default_chunk_elems(np.dtype(np.float64))
        for start, stop, codes in self._code_runs(reader, scheme, rec, rec.shape, budget):
            with np.errstate(all="ignore"):  # as _decode: hostile scales are data
                values = cast_rows(rec, codes, start, stop, small, target)
            if values is None:
                decoded = _decode(scheme, rec, codes, start, stop, small)
                yield cast_chunk(decoded.reshape(-1), target)
            else:
                yield Cast(values.reshape(-1), 0, 0.0)

    def _transposed(
        self,
        reader: Reader,
        scheme: Scheme,
        rec: Recognised,
        small: Mapping[str, np.ndarray],
        budget: int,
    ) -> Iterator[np.ndarray]:
        """C order of the real [out, in] weight from codes of its transpose [in, out]
        (GPTQ, AWQ): real rows [r0, r1) are columns [r0, r1) of the transpose, gathered
        over one pass through the codes into a block of at most TRANSPOSE_ELEMENTS
        values; a weight larger than that takes ceil(size / TRANSPOSE_ELEMENTS) passes,
        each decoding only its columns where the scheme can (decode_columns)."""
        import numpy as np

        out, inputs = rec.shape
        if out == 0 or inputs == 0:
            return
        width = max(1, TRANSPOSE_ELEMENTS // inputs)
        decode_columns = getattr(scheme, "decode_columns", None)
        for r0 in range(0, out, width):
            r1 = min(out, r0 + width)
            block = np.empty((inputs, r1 - r0), dtype=np.float64)
            if decode_columns is not None:  # each pass decodes its own outputs only
                for start, stop, codes in self._code_runs(
                    reader, scheme, rec, (inputs, out), budget
                ):
                    with np.errstate(all="ignore"):  # as _decode: hostile scales are data
                        block[start:stop] = decode_columns(rec, codes, start, stop, small, (r0, r1))
            else:
                for start, stop, values in self._decoded_rows(
                    reader, scheme, rec, small, (inputs, out), budget
                ):
                    block[start:stop] = values[:, r0:r1]
            rows = np.ascontiguousarray(block.T).reshape(-1)
            del block
            for first in range(0, rows.size, budget):
                yield rows[first : first + budget]

    # ------------------------------------------------------------ clipping hooks

    def lowerable(self, tensor: LogicalTensor) -> str | None:
        """A factor is carried by the scales when they are floats that round as any float
        tensor does (float32, bfloat16, float16, fp8 e4m3/e5m2), or when the scheme
        rewrites their bytes itself (stored_scaler: MXFP4's E8M0 exponents take the
        factor rounded down to a power of two). Other integer scales: refused."""
        if tensor.plain:
            return None
        refused = self._weights[tensor.info.name][1].params.get("clip_refused")
        if isinstance(refused, str):
            return refused
        from clipcli.dtypes import is_floating

        scheme, rec = self._weights[tensor.info.name]
        for name in self.scaled_parts(tensor):
            if _scheme_scaler(scheme, rec, name) is not None:
                continue  # its bytes take the factor their own way (E8M0: a power of two)
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

    def stored_scaler(
        self, tensor: LogicalTensor, part: str
    ) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
        if tensor.plain:
            return None
        scheme, rec = self._weights[tensor.info.name]
        return _scheme_scaler(scheme, rec, part)

    def power_of_two_factors(self, tensor: LogicalTensor) -> bool:
        if tensor.plain:
            return False
        return bool(self._weights[tensor.info.name][1].params.get("power_of_two", False))

    def refused_factor(
        self, reader: Reader, tensor: LogicalTensor, mantissa: float, exponent: int
    ) -> str | None:
        """A power-of-two weight (E8M0 scales; block FP8's float "ue8m0" scales: refused
        where one would leave float's normal range, _inexact_power_of_two): refused for a
        NaN scale byte (0xFF: its block is
        NaN, and no factor acts on it), and for a block whose byte s is below the k of
        2**-k with any nonzero code (2**(s - k - 127) is below E8M0's least value, and
        keeping s would leave the block unscaled). A block of zero codes below k keeps
        its byte: its values are zero whatever the scale."""
        if tensor.plain or not self.power_of_two_factors(tensor):
            return None
        import numpy as np

        from clipcli.numerics.rounding import power_of_two_steps

        scheme, rec = self._weights[tensor.info.name]
        name = tensor.info.name
        small = self._small_parts(reader, rec, None, scheme)
        scale_name = scheme.scaled_parts(rec)[0]
        if small[scale_name].dtype.itemsize != 1:  # float scales kept powers of two
            return _inexact_power_of_two(name, scale_name, small[scale_name], mantissa, exponent)
        raw = small[scale_name].view(np.uint8).reshape(-1)
        nan = np.flatnonzero(raw == 0xFF)
        if nan.size:
            return (
                f"{name}: its E8M0 scale {scale_name} holds the NaN byte 0xFF "
                f"({nan.size} of {raw.size} blocks, the first at block {int(nan[0])}): "
                "no factor can rescale a NaN block"
            )
        steps = power_of_two_steps(mantissa, exponent)
        if not steps or int(raw.min()) >= steps:
            return None
        low = raw < steps
        if "scale_block" not in rec.params:  # blocks of rows and columns (block FP8)
            first = int(np.flatnonzero(low)[0])
            return (
                f"{name}: scaling by 2**-{steps} would take its E8M0 scale byte "
                f"{int(raw[first])} at block {first} below 0 (2**-127 is E8M0's least value)"
            )
        block: int = rec.params["scale_block"]  # values per scale byte, along the last axis
        per_row = rules.ceil_div(rec.shape[-1], block)
        budget = max(per_row * block, default_chunk_elems(np.dtype(np.float64)))
        rows = self._decoded_rows(reader, scheme, rec, small, rec.shape, budget)
        for start, stop, values in rows:
            padded = np.zeros((stop - start, per_row * block))
            padded[:, : values.shape[1]] = values
            nonzero = (padded.reshape(-1, block) != 0).any(axis=1)
            hit = np.flatnonzero(nonzero & low[start * per_row : stop * per_row])
            if hit.size:
                first = start * per_row + int(hit[0])
                return (
                    f"{name}: scaling by 2**-{steps} would take its E8M0 scale byte "
                    f"{int(raw[first])} at block {first} below 0 (2**-127 is E8M0's least "
                    "value) under nonzero codes"
                )
        return None


def _inexact_power_of_two(
    name: str, scale_name: str, scales: np.ndarray, mantissa: float, exponent: int
) -> str | None:
    """Why float scales cannot take 2**-k exactly (rules.halve_float_scales), or None:
    a finite nonzero scale whose product would fall below its dtype's normal range."""
    import numpy as np

    from clipcli.logical.quantized.rules import halve_float_scales
    from clipcli.numerics.rounding import power_of_two_steps

    values = scales.reshape(-1)
    moved = halve_float_scales(values, mantissa, exponent)
    steps = power_of_two_steps(mantissa, exponent)
    with np.errstate(all="ignore"):
        wide = values.astype(np.float64)
        exact = np.ldexp(moved.astype(np.float64), steps) == wide
        tiny = np.abs(moved.astype(np.float64)) < np.finfo(values.dtype).tiny
    bad = np.flatnonzero(np.isfinite(wide) & (wide != 0) & (~exact | tiny))
    if not bad.size:
        return None
    first = int(bad[0])
    return (
        f"{name}: scaling its power-of-two scale {scale_name} by 2**-{steps} would take "
        f"{float(wide[first])!r} at block {first} out of {values.dtype.name}'s normal range"
    )


def _refuse_undecided(
    module: str,
    tensors: Mapping[str, TensorInfo],
    why: str,
    config: Mapping[str, Any],
    schemes: Sequence[Scheme],
) -> None:
    """A module whose config group is not known (targets.assign: none or two match it, or
    `ignore` names it) must hold no quantized codes: whatever a scheme would make of its
    tensors, by the config or by names and dtypes, is refused rather than guessed."""
    for scheme in schemes:
        for said in (config, None):
            try:
                found = scheme.recognise(tensors, said)
            except InputError as exc:
                problem = f"holds a part of a quantized weight ({exc})"
            else:
                if not found:
                    continue
                problem = f"holds a quantized weight ({found[0].scheme}, from {found[0].codes})"
            raise InputError(module or "(root module)", f"{why}, yet it {problem}")


def _refuse_undescribed(
    stored: Mapping[str, TensorInfo],
    owner: Mapping[str, tuple[str, str]],
    config: Mapping[str, Any],
    schemes: Sequence[Scheme],
) -> None:
    """A config.json that does not describe the tensors (another quant_method, a layout
    it does not declare) must not turn them into plain ones: codes read raw, a scale
    counted as a weight. What the config left unclaimed is read again by names and
    dtypes alone; a quantized weight found there, or one refused there, is refused."""
    rest = {name: info for name, info in stored.items() if name not in owner}
    method = config.get("quant_method")
    for scheme in schemes:
        try:
            found = scheme.recognise(rest, None)
        except InputError as exc:  # a layout only a config could settle: still quantized
            tensor = str(exc).split(": ", 1)[0]
            problem = f"{tensor} is a part of a quantized weight ({scheme.NAMES[0]})"
        else:
            if not found:
                continue
            problem = f"{found[0].name} is a quantized weight ({found[0].scheme})"
        raise InputError(
            "config.json",
            f"quantization_config (quant_method {method!r}) does not describe the tensors: "
            f"by names and dtypes, {problem}; refusing to read it as plain tensors",
        )


def _scheme_scaler(
    scheme: Scheme, rec: Recognised, part: str
) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
    """The scheme's own function for a scaled part's bytes (scheme.py: the optional
    stored_scaler), or None: the part is a float tensor, scaled value by value."""
    own = getattr(scheme, "stored_scaler", None)
    if own is None:
        return None
    scaler: Callable[[np.ndarray, float, int], np.ndarray] | None = own(rec, part)
    return scaler


def _decode(
    scheme: Scheme,
    rec: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> np.ndarray:
    """scheme.decode_rows with numpy's floating-point warnings off: an inf or NaN scale or
    zero point in a file is data (inf * 0 is NaN, counted as non-finite where it matters),
    not a RuntimeWarning on stderr beside the one-line report."""
    import numpy as np

    with np.errstate(all="ignore"):
        return scheme.decode_rows(rec, codes, start, stop, small)


def _measured(
    scheme: Scheme,
    rec: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
    steps: int | None = None,
) -> NormAccumulator:
    """The statistics of rows [start, stop) as the scheme decodes them: its measure_rows
    where it has one and its tables pay, else those of the decoded rows. Floating-point
    warnings off, as _decode."""
    import numpy as np

    from clipcli.numerics.norms import NormAccumulator

    if steps is not None:  # the values times 2**-steps (E8M0 scales lowered by steps)
        from clipcli.numerics import coded

        tables = getattr(scheme, "code_tables", None)
        with np.errstate(all="ignore"):
            found = tables(rec, codes, start, stop, small) if tables is not None else None
        if found is not None:
            return coded.table_statistics(found[0], np.ldexp(found[1], -steps))
        acc = NormAccumulator()
        with np.errstate(all="ignore"):
            values = np.ldexp(_decode(scheme, rec, codes, start, stop, small), -steps)
        acc.add(values.reshape(-1))
        return acc
    measure_rows = getattr(scheme, "measure_rows", None)
    if measure_rows is not None:
        with np.errstate(all="ignore"):
            measured = measure_rows(rec, codes, start, stop, small)
        if isinstance(measured, NormAccumulator):
            return measured
    acc = NormAccumulator()
    acc.add(_decode(scheme, rec, codes, start, stop, small).reshape(-1))
    return acc


def _factor_or_steps(
    rec: Recognised, mantissa: float, exponent: int
) -> tuple[tuple[float, int] | None, int | None]:
    """How a factor reaches the weight's values: its scales scaled by it, (factor, None);
    or, E8M0 scales (power_of_two), the values times 2**-k, (None, k)."""
    if rec.params.get("power_of_two", False):
        from clipcli.numerics.rounding import power_of_two_steps

        return None, power_of_two_steps(mantissa, exponent)
    return (mantissa, exponent), None


def _pieces(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], most: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(energies, scales flattened) of consecutive parts, joined or cut into pieces of at
    most `most` scales: a check's arrays stay that small, however many scales are kept."""
    import numpy as np

    held: list[tuple[np.ndarray, np.ndarray]] = []
    size = 0
    for energies, scales in parts:
        flat = scales.reshape(-1)
        for begin in range(0, energies.size, most):
            piece = (energies[begin : begin + most], flat[begin : begin + most])
            if size + piece[0].size > most:
                yield np.concatenate([e for e, _ in held]), np.concatenate([f for _, f in held])
                held, size = [], 0
            held.append(piece)
            size += piece[0].size
    if held:
        yield np.concatenate([e for e, _ in held]), np.concatenate([f for _, f in held])


def _bounded_sumsq(
    scheme: Scheme,
    rec: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
    steps: int | None,
) -> tuple[Fraction, Fraction] | None:
    """The sum of squares of rows [start, stop) (as the scheme decodes them) under
    `small`'s scales (times 2**-steps), within a bound: from the energy under each scale
    (integer codes), through the scheme's code tables where they pay, else of the decoded
    rows (CertainSumsq, whose bound is tighter still). None where a value is NaN or
    infinite (the check decodes the weight, as before)."""
    import numpy as np

    from clipcli.numerics import coded
    from clipcli.numerics.certain import CertainSumsq

    with np.errstate(all="ignore"):  # as _decode: hostile scales are data
        energies = getattr(scheme, "scale_energies", None)
        if energies is not None:  # integer codes: the energy under each scale
            found = energies(rec, codes, start, stop, small)
            if found is None:  # a NaN or infinite scale: decoded, as before
                return None
            if steps is not None:
                found = (found[0], np.ldexp(found[1], -steps))
            return coded.bounded_table_sumsq(*found)
        tables = scheme.code_tables(rec, codes, start, stop, small)  # type: ignore[attr-defined]
        if tables is not None:
            counts, values = tables
            if steps is not None:
                values = np.ldexp(values, -steps)
            return coded.bounded_table_sumsq(counts, values)
        values = _decode(scheme, rec, codes, start, stop, small)
        if steps is not None:
            values = np.ldexp(values, -steps)
    flat = values.reshape(-1)
    if not np.isfinite(flat).all():
        return None
    total = CertainSumsq()
    step = default_chunk_elems(flat.dtype)  # as scaled_chunks: its temporaries stay cached
    for begin in range(0, flat.size, step):
        total.add(flat[begin : begin + step])
    return total.total, total.bound


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
    """The view factory (clipcli.logical.views, which imports this module only where
    markers.py says a scheme may claim a weight): a QuantizedView when some scheme claims
    one, else None (the identity view: the stored reader as it is)."""
    view = QuantizedView.of(reader)
    return None if view.identity else view
