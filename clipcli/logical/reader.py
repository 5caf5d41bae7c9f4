"""LogicalReader: a checkpoint's logical tensors, served as a Reader to the jobs.

Jobs (norms, diff, the measuring pass and plan of clip) read logical tensors through this
adapter exactly as they read stored ones: `infos` are the view's logical tensors and the
stored tensors beside them (scales: listed, with a role of their own), and `chunks` are
real values. What concerns files (identities, metadata, directory layout, side files) is
the stored reader's. The write pass never goes through it: a plan is lowered to stored
tensors first (clipcli.logical.lowering).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from clipcli.formats.base import Listed, Reader, StoredBytes, TensorInfo
from clipcli.logical.view import LogicalTensor, Quantization, QuantizedRows, View

if TYPE_CHECKING:
    from fractions import Fraction

    import numpy as np

    from clipcli.formats.base import DirectoryLayout, NonTensorInfo
    from clipcli.numerics.norms import NormAccumulator
    from clipcli.system.identity import FileIdentity


class LogicalReader(Reader):
    def __init__(self, stored: Reader, view: View) -> None:
        super().__init__(stored.path)
        self.stored = stored
        self.view = view
        self.format_name = stored.format_name  # type: ignore[misc]  # per instance, on purpose
        self.logical = view.tensors()
        self.by_name: dict[str, LogicalTensor] = {t.info.name: t for t in self.logical}
        self.part_roles: dict[str, str] = {info.name: role for info, role in view.side_tensors()}
        self._side = {info.name: info for info, _ in view.side_tensors()}
        _refuse_one_name_twice(stored, [*self.logical, *(info for info, _ in view.side_tensors())])
        self._infos = self._ordered()
        self._stored_infos = {info.name: info for info in stored.infos}
        # Tied tensors (the same values under a second name) -> the first name: counted
        # once in a global norm, given the first one's action (clipcli.jobs.plan).
        self.tied = {t.info.name: first for t in self.logical if (first := view.shared_with(t))}
        self.overlapping = view.overlapping()

    def _plain_part(self, info: TensorInfo) -> TensorInfo | None:
        """The stored tensor a plain logical tensor is (or a side tensor), else None."""
        logical = self.by_name.get(info.name)
        if logical is None:
            return self._side[info.name]
        if logical.plain and len(logical.parts) == 1:
            return self._stored_infos[logical.parts[0].name]
        return None

    def _ordered(self) -> list[TensorInfo]:
        """Logical tensors and side tensors, in the stored order of where each starts."""
        position = {info.name: i for i, info in enumerate(self.stored.infos)}

        def start(name: str) -> int:
            t = self.by_name.get(name)
            if t is None:
                return position[name]
            return min(position[p.name] for p in t.parts)

        names = [*self.by_name, *self._side]
        ordered = sorted(names, key=start)
        return [self.by_name[n].info if n in self.by_name else self._side[n] for n in ordered]

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def listing(self) -> list[Listed]:
        """What `ls` shows: a quantized weight with its real shape, the dtype its row
        shows and the bytes of its codes (its scales have rows of their own)."""
        listed = []
        quantized = self.quantization()
        for i in self._infos:
            q = quantized.get(i.name)
            if q is None:
                listed.append(Listed(i.name, i.dtype_name, i.shape, i.nbytes))
            else:
                codes = self._stored_infos[q.stored[0]]
                listed.append(Listed(i.name, q.dtype, i.shape, codes.nbytes))
        return listed

    def quantization(self) -> dict[str, Quantization]:
        """Each quantized weight's name -> what its row says of it."""
        found = {}
        for t in self.logical:
            q = self.view.quantization(t)
            if q is not None:
                found[t.info.name] = q
        return found

    def quantized_rows(self) -> QuantizedRows | None:
        """What the rows say of quantized weights and their parts; None when none."""
        weights = self.quantization()
        if not weights:
            return None
        owner = {p.name: t.info.name for t in self.logical if not t.plain for p in t.parts}
        parts = {name: (role, owner.get(name)) for name, role in self.part_roles.items()}
        return QuantizedRows(weights, parts)

    def shard_of(self, name: str) -> str | None:
        t = self.by_name.get(name)
        stored = t.parts[0].name if t is not None else name
        return self.stored.shard_of(stored)

    @property
    def metadata(self) -> Mapping[str, str]:
        return self.stored.metadata

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        part = self._plain_part(info)
        if part is not None:
            return self.stored.chunks(part, chunk_elems)
        return self.view.chunks(self.stored, self.by_name[info.name], chunk_elems)

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]] | None:
        part = self._plain_part(info)
        return None if part is None else self.stored.chunk_loaders(part)

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:
        """A plain tensor's bytes, as its stored tensor's (a quantized checkpoint's bf16
        embeddings and norms: their chunks are then counted where they lie)."""
        part = self._plain_part(info)
        return None if part is None else self.stored.stored_bytes(part)

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        part = self._plain_part(info)
        return None if part is None else self.stored.elements_loader(part, start, stop)

    def measured_loaders(self, info: TensorInfo) -> Iterator[Callable[[], NormAccumulator]] | None:
        if self._plain_part(info) is not None:
            return None
        return self.view.measured_loaders(self.stored, self.by_name[info.name])

    def constant(self, info: TensorInfo) -> np.ndarray | None:
        part = self._plain_part(info)
        return None if part is None else self.stored.constant(part)

    def stored_as_is(self, info: TensorInfo) -> bool:
        """True when `info` is one stored tensor whose values are as stored."""
        return self._plain_part(info) is not None

    def scaled_chunks(
        self, info: TensorInfo, mantissa: float, exponent: int
    ) -> Iterator[np.ndarray]:
        """The real values once the view's scaled parts are scaled and rounded (the factor
        search's check: what the write pass will make of the lowered plan)."""
        return self.view.scaled_chunks(self.stored, self.by_name[info.name], mantissa, exponent)

    def scaled_measured_loaders(
        self, info: TensorInfo, mantissa: float, exponent: int
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """View.scaled_measured_loaders of this tensor."""
        tensor = self.by_name[info.name]
        return self.view.scaled_measured_loaders(self.stored, tensor, mantissa, exponent)

    def energy_sumsq_together(
        self, infos: Sequence[TensorInfo], mantissa: float, exponent: int
    ) -> tuple[frozenset[str], tuple[Fraction, Fraction] | None]:
        """View.energy_sumsq_together of these tensors."""
        tensors = [self.by_name[info.name] for info in infos]
        return self.view.energy_sumsq_together(self.stored, tensors, mantissa, exponent)

    def scaled_sumsq_loaders(
        self, info: TensorInfo, mantissa: float, exponent: int
    ) -> Iterator[Callable[[], tuple[Fraction, Fraction] | None]] | None:
        """Loaders of the sum of squares of scaled_chunks()' values, piece by piece, within
        a bound (View.scaled_sumsq_loaders), or None: sum scaled_chunks()."""
        tensor = self.by_name[info.name]
        return self.view.scaled_sumsq_loaders(self.stored, tensor, mantissa, exponent)

    def warnings(self) -> list[str]:
        return self.stored.warnings()

    def source_files(self) -> list[Path]:
        return self.stored.source_files()

    def source_identities(self) -> dict[Path, FileIdentity]:
        return self.stored.source_identities()

    def archive_members(self) -> dict[str, str]:
        return self.stored.archive_members()

    @property
    def non_tensors(self) -> list[NonTensorInfo]:
        return self.stored.non_tensors

    def side_files(self) -> list[Path]:
        return self.stored.side_files()

    @property
    def model_directory(self) -> Path | None:
        return self.stored.model_directory

    def joined_metadata(self) -> dict[str, str]:
        return self.stored.joined_metadata()

    def descriptions(self) -> frozenset[str]:
        return self.stored.descriptions()

    def join_losses(self) -> list[str]:
        return self.stored.join_losses()

    def directory_layout(self) -> DirectoryLayout | None:
        return self.stored.directory_layout()

    def left_out_entries(self) -> list[tuple[str, str]]:
        return self.stored.left_out_entries()

    def close(self) -> None:
        self.stored.close()


def _refuse_one_name_twice(stored: Reader, tensors: list[LogicalTensor | TensorInfo]) -> None:
    """Any view's tensors (logical and side) each under its own name: two claiming one
    (a view's weight beside a stored tensor of that name) would leave one unread, and a
    write would drop it. Refused (exit 3), whichever view made them."""
    from clipcli.errors import InputError

    seen: set[str] = set()
    for tensor in tensors:
        name = tensor.info.name if isinstance(tensor, LogicalTensor) else tensor.name
        if name in seen:
            raise InputError(stored.path, f"two tensors claim the name {name!r}")
        seen.add(name)
