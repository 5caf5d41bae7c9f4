"""HDF5 through h5py: a reader that refuses anything pointing outside the file, and a writer
that replicates the source file's groups, attributes and dataset storage settings.

h5py follows soft links, external links, external storage and virtual datasets silently;
that is how CVE-2026-1669 leaked local files through Keras. The reader therefore classifies
every link before touching its target and inspects every dataset's storage before any data
is read. Anything it cannot vouch for is an InputError naming the object.

Modules: library (h5py loaded safely, errors, type facts), limits (budgets), geometry (flat
ranges as hyperslabs), heap (global heap scan), safety (per-dataset checks), nontensor
(non-tensor datasets a slice at a time), reader, replica (an HDF5 source copied object by
object), writer; portable (types, dataspaces and settings as JSON), structure (a file's
structure recorded for another format) and rebuild (an HDF5 file made from a record).

Decisions worth knowing:
- Objects are listed in the file's own link order (creation order when a group tracks it,
  else name order), depth first, so tensor order is deterministic.
- An object reachable by two hard links is refused (it would be one tensor under two names,
  and a group linked into itself would make the walk endless).
- Datasets that are not numeric (strings such as a vocabulary, compound, enum, opaque,
  references, an empty dataspace) are non-tensors: listed, never measured, copied as
  they are to HDF5; the storage rules below apply to them too.
- Declared vs stored size: a dataset declaring more than MAX_DECLARED_BYTES (1 TiB) is
  refused outright; one declaring more than SPARSE_CHECK_BYTES (64 MiB) is refused when
  that is over MAX_EXPANSION (200) times its allocated storage, the npz zip-bomb rule.
  Contiguous data must lie inside the file. Groups may nest at most MAX_DEPTH (64) deep.
"""

from __future__ import annotations

from clipcli.formats.hdf5.geometry import flat_range_blocks
from clipcli.formats.hdf5.library import load_h5py
from clipcli.formats.hdf5.reader import Hdf5Reader
from clipcli.formats.hdf5.writer import HDF5_MAX_ATTRIBUTES, Hdf5Writer

__all__ = ["HDF5_MAX_ATTRIBUTES", "Hdf5Reader", "Hdf5Writer", "flat_range_blocks", "load_h5py"]
