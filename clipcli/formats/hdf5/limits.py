"""The HDF5 reader's budgets and the library's cache settings, in one place (tests adjust
them through this module)."""

from __future__ import annotations

from clipcli.formats import expansion

MAX_DECLARED_BYTES = 1 << 40  # 1 TiB: no checkpoint tensor is this large
# The one expansion policy (formats.expansion), as the zip readers apply it: a dataset
# inflating more than 200-fold to more than 64 MiB is almost surely a bomb. Read at each
# call: a test moves the HDF5 limit here.
SPARSE_CHECK_BYTES = expansion.FREE_BYTES
MAX_EXPANSION = expansion.RATIO
MAX_RANK = 32  # H5S_MAX_RANK: the library neither writes nor reads more dimensions
MAX_DEPTH = 64  # real checkpoints nest a handful of groups; thousands is an attack
# HDF5 decodes a whole chunk to read any part of it (h5py's automatic chunks are <= 1 MiB).
MAX_CHUNK_BYTES = 256 << 20
# Chunks: the library keeps state for every chunk a read touches (about 7 KiB each,
# measured with HDF5 2.0: 150,000 one-element chunks in a 6.2 MB file made `norms` peak at
# 1 GB, 17,900 at 130 MB more than a plain file) and indexes every chunk of the file. A
# stored chunk costs the file ~40 bytes at least, so bytes alone do not bound them: all
# datasets together may declare at most one chunk per 4 KiB of file, plus 8,192 for
# small files (h5py's automatic chunks are at least 8 KiB, or the whole dataset).
BYTES_PER_CHUNK = 4096
FREE_CHUNKS = 8192
# Objects (groups, datasets, named datatypes): walking one costs ~0.5 ms of CPU, and the
# smallest object HDF5 writes takes ~81 bytes of file (a named datatype in the latest
# format; an empty group ~160, datasets ~300, 300-800 bytes in the earliest format), so a
# plain file's own bytes bound its objects. The member of a .keras archive does not bound
# them: 100,000 scalar datasets deflate to a 1.65 MB archive (56 s to walk). At most one
# object per 64 bytes of the budget's size (Hdf5Reader's budget_size), plus 4,096 (128
# refused a plain file of 12,000 named datatypes: attack s32att2).
BYTES_PER_OBJECT = 64
FREE_OBJECTS = 4096
# Object headers and attributes (stored bytes, read from each header before any attribute
# is listed: the library loads all of an object's attributes to list their names). A plain
# file's are part of it; a .keras member's zeros deflate ~1,000-fold: at most the budget's
# size plus 64 MiB.
FREE_HEADER_BYTES = 64 << 20
# Variable-length attribute data (strings) read in all: Keras' names take kilobytes.
MAX_ATTRIBUTE_BYTES = 64 << 20
# Non-tensor datasets (a vocabulary of strings, a compound table) are copied, or encoded
# into safetensors metadata, a slice at a time: at most this many bytes in memory at once.
NON_TENSOR_SLICE_BYTES = 16 << 20


def expansion_budget(file_size: int) -> int:
    """The most bytes all datasets of a file of this size may declare together: the npz
    rule (200 times the file, plus 64 MiB so that small all-zero files still read)."""
    return expansion.budget(file_size, MAX_EXPANSION, SPARSE_CHECK_BYTES)


def chunk_budget(file_size: int) -> int:
    """The most HDF5 chunks all datasets of a file of this size may declare together
    (every chunk of a dataset's shape counts, stored or not: reading produces each)."""
    return file_size // BYTES_PER_CHUNK + FREE_CHUNKS


# One raw-data chunk cache per open dataset (we keep at most a couple open at a time).
# Large enough to hold a row of HDF5 chunks while we stream C-order pieces through them,
# so each compressed chunk is decoded (or encoded) once rather than once per piece.
CHUNK_CACHE_BYTES = 64 << 20
HEAP_SCAN_WINDOW = 16 << 20  # global-heap search: bytes read at a time
CHUNK_CACHE_SLOTS = 12_401  # a prime, as HDF5 recommends, ~100x the chunks that fit
# Evict fully read/written chunks first (we rarely revisit them), but not only those: at
# 1.0 the library (HDF5 2.0) never evicts a chunk read in part, whatever the cache's size,
# so C-order pieces through tall chunks kept every chunk of a band decoded (a 5.7 MB file's
# float16 [64, 2**23] held 1.1 GB; small bombs in them 2.6 GB: attack s47b).
CHUNK_CACHE_W0 = 0.99
# A compressed tensor whose chunks' bands (every chunk along its first axis' chunk rows)
# the cache cannot hold is read a band at a time into a buffer of this much at most; a
# larger band would be decoded once for each piece that crosses it, and is refused. An
# HDF5 output of the same layout holds a band of chunks written in part too: at 256 MiB a
# 8.8 MB file's clip to .h5 peaked at 646 MB (attack s47c).
MAX_BAND_BYTES = 128 << 20


def object_budget(file_size: int) -> int:
    """The most objects (groups, datasets, named datatypes, the root included) a file of
    this size may hold."""
    return file_size // BYTES_PER_OBJECT + FREE_OBJECTS


def header_budget(file_size: int) -> int:
    """The most bytes all objects' headers and attributes of a file of this size may take."""
    return file_size + FREE_HEADER_BYTES
