"""Which HDF5 filters give back every value exactly: an allow-list, not a deny-list.

A filter that is not known to be lossless (scale-offset on floats, which rounds to a
number of decimal digits; scale-offset on integers with a fixed bit count; any filter
from a plugin: zfp, sz and jpeg are lossy) would make what OUT holds differ from what was
measured and reported. Such filters are never written: a dataset that had one is written
without it, and a recorded structure that asks for one is refused.

Lossless, by the HDF5 reference manual and checked by our tests:
- deflate (gzip), lzf and szip: lossless compression;
- shuffle and fletcher32: a byte reordering and a checksum;
- n-bit: packs exactly the bits the type's precision holds, nothing else;
- scale-offset on an integer type with the minimum bit count left to the library
  (H5Z_SO_INT, scale factor 0): it stores value - minimum in as many bits as the range
  needs. With a scale factor > 0 it keeps only that many bits (lossy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFLATE, SHUFFLE, FLETCHER32, SZIP, NBIT, SCALEOFFSET, LZF = 1, 2, 3, 4, 5, 6, 32000
LOSSLESS = frozenset({DEFLATE, SHUFFLE, FLETCHER32, SZIP, NBIT, LZF})
SO_INT = 2  # H5Z_SO_INT: the scale type for integers
SO_INT_MINBITS_DEFAULT = 0  # the library finds the bits the values need: lossless

NAMES = {
    DEFLATE: "gzip",
    SHUFFLE: "shuffle",
    FLETCHER32: "fletcher32",
    SZIP: "szip",
    NBIT: "nbit",
    SCALEOFFSET: "scale-offset",
    LZF: "lzf",
}


def name_of(code: int) -> str:
    return NAMES.get(code, f"filter {code}")


def is_lossless(code: int, values: Sequence[int], integer_type: bool) -> bool:
    """True when the filter, with these parameters on a type of this class, gives back
    every value exactly."""
    if code in LOSSLESS:
        return True
    return (
        code == SCALEOFFSET
        and integer_type
        and len(values) >= 2
        and values[0] == SO_INT
        and values[1] == SO_INT_MINBITS_DEFAULT
    )


def lossy_filters(create_plist: Any, integer_type: bool) -> list[int]:
    """The codes of the filters in a dataset creation property list that are not known to
    be lossless (in pipeline order)."""
    lossy: list[int] = []
    for index in range(create_plist.get_nfilters()):
        code, _flags, values, _name = create_plist.get_filter(index)
        if not is_lossless(int(code), [int(v) for v in values], integer_type):
            lossy.append(int(code))
    return lossy


def describe_lossy(by_dataset: dict[str, list[int]], limit: int = 3) -> str:
    """'x' (scale-offset), 'y' (filter 32013) and 2 more, for one note line."""
    items = list(by_dataset.items())
    shown = ", ".join(
        f"{name!r} ({', '.join(name_of(code) for code in codes)})" for name, codes in items[:limit]
    )
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
