"""The `--axes` factors of a tensor of more slices than one group holds (numerics.slices.
slice_groups), kept in a temporary file while the writing pass needs them: 8 bytes a
slice on disk rather than in memory (two-element columns of a 1 GiB bfloat16 tensor are
2**28 slices).

The file has no name, but another process of this user can still open it through
/proc/<pid>/fd. So each group is read back whole and checked against a keyed digest kept
in memory: a group rewritten (even with factors between 0 and 1, which would take slices
over the limit), or cut short and grown again by the next group's write (its hole reads
as zeros), is exit 5, never applied (attack s46).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os
from types import TracebackType

import numpy as np

from clipcli.errors import WriteError
from clipcli.system import scratch


class SpilledFactors:
    """Each group's factors, put in order, then read back by runs of slices."""

    def __init__(self, groups: list[slice], name: str) -> None:
        fd, _ = scratch.unnamed_file("clipcli-factors-")
        self._file = os.fdopen(fd, "r+b", buffering=0)  # closed at the latest when collected
        self._groups = groups
        self._starts = [group.start for group in groups]
        self._key = os.urandom(16)
        self._digests: list[bytes] = []
        self._name = name  # the tensor's, for a message
        self._cached: tuple[int, np.ndarray] | None = None  # the group read back last

    def __enter__(self) -> SpilledFactors:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._cached = None
        self._file.close()

    def put(self, factors: np.ndarray) -> None:
        """The next group's factors (float64, one per slice of the group)."""
        group = self._groups[len(self._digests)]
        if factors.shape != (group.stop - group.start,) or factors.dtype != np.float64:
            raise ValueError(f"{factors.shape} {factors.dtype} factors for slices {group}")
        data = memoryview(np.ascontiguousarray(factors)).cast("B")  # type: ignore[arg-type]
        scratch.write_at(self._file.fileno(), data, group.start * 8)
        self._digests.append(self._digest(data))

    def of(self, held: range) -> np.ndarray:
        """The factors of the slices `held` (consecutive: a box's, slices.box_slices)."""
        out = np.empty(len(held))
        at = bisect.bisect_right(self._starts, held.start) - 1
        position = held.start
        while position < held.stop:
            group = self._groups[at]
            end = min(held.stop, group.stop)
            factors = self._group(at)
            out[position - held.start : end - held.start] = factors[
                position - group.start : end - group.start
            ]
            position, at = end, at + 1
        return out

    def _group(self, at: int) -> np.ndarray:
        """Group `at` read back whole and checked (the boxes come in C order, so a group is
        read once for each run of boxes that uses it: once per row of a [k, n] --axes 0)."""
        if self._cached is not None and self._cached[0] == at:
            return self._cached[1]
        self._cached = None  # its memory given back before the next group is read
        group = self._groups[at]
        factors = np.empty(group.stop - group.start)
        data = memoryview(factors).cast("B")  # type: ignore[arg-type]
        scratch.read_at(self._file.fileno(), data, group.start * 8)
        # Grown past its last factor too: no factor read changes, but the file is not what
        # was written (attack s46b).
        grown = scratch.size_of(self._file.fileno()) != self._groups[-1].stop * 8
        if grown or not hmac.compare_digest(self._digest(data), self._digests[at]):
            raise WriteError(
                f"a temporary file of clipcli's was changed while in use ({self._name!r})"
            )
        self._cached = at, factors
        return factors

    def _digest(self, data: memoryview) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=16).digest()
