"""Integer codes packed into 32-bit words, and the checks only the integer schemes make
(the ones every scheme makes are clipcli.logical.quantized.rules).

A packed tensor holds one bit stream per row (or per column): word k holds bits
[32k, 32k + 32) of it, and element e's b bits start at bit position p(e), least
significant bit first. Two layouts exist:

- dense: p(e) = e * b, an element may straddle two words (compressed-tensors from 0.17,
  GPTQ's 3-bit layout);
- per word: floor(32 / b) elements per word and the rest of the word left as padding,
  p(e) = (e // f) * 32 + (e % f) * b (compressed-tensors before 0.17).

For b = 1, 2, 4, 8 the two are the same. Pure numpy: no file is read here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from clipcli.logical.quantized import rules

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    import numpy as np

    from clipcli.formats.base import TensorInfo
    from clipcli.logical.quantized.scheme import Recognised

WORD_BITS = 32

# A group larger than this is no real layout (real ones are 32 to 128): refused before it
# decides a read or an allocation.
MAX_GROUP = rules.MAX_BLOCK

# Scale dtypes whose product with a small integer is a float64 exactly.
FLOAT_SCALE_DTYPES = frozenset({"float16", "bfloat16", "float32"})
WORD_DTYPES = frozenset({"int32", "uint32"})
INDEX_DTYPES = frozenset({"int32", "int64"})


def per_word(bits: int) -> int:
    return WORD_BITS // bits


def words_for(count: int, bits: int, dense: bool) -> int:
    """Words one stream of `count` elements takes."""
    if dense:
        return rules.ceil_div(count * bits, WORD_BITS)
    return rules.ceil_div(count, per_word(bits))


def first_word(index: int, bits: int, dense: bool) -> int:
    """The word element `index` starts in."""
    return index * bits // WORD_BITS if dense else index // per_word(bits)


def bit_positions(indices: np.ndarray, bits: int, dense: bool) -> np.ndarray:
    """Where each element starts in its stream, as int64 bit positions."""
    import numpy as np

    indices = indices.astype(np.int64)
    if dense:
        return indices * bits
    factor = per_word(bits)
    positions: np.ndarray = (indices // factor) * WORD_BITS + (indices % factor) * bits
    return positions


def extract(words: np.ndarray, positions: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """The `bits`-bit fields starting at `positions` of each stream of `words` (2-D, the
    streams run along `axis`; positions count from the first word given), as uint16
    arrays shaped like `words` with `axis` replaced by len(positions)."""
    import numpy as np

    unsigned = np.ascontiguousarray(words).view(np.uint32).astype(np.uint64)
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, 1)  # the word after the last one, for fields that end in it
    unsigned = np.pad(unsigned, pad)
    word = positions // WORD_BITS
    shift = (positions % WORD_BITS).astype(np.uint64)
    low = np.take(unsigned, word, axis=axis)
    high = np.take(unsigned, word + 1, axis=axis)
    if axis == 0:
        shift = shift[:, None]
    both = low | (high << np.uint64(WORD_BITS))
    return ((both >> shift) & np.uint64((1 << bits) - 1)).astype(np.uint16)


def check_dtype(info: TensorInfo, allowed: frozenset[str], role: str) -> None:
    if rules.dtype_name(info) not in allowed:
        raise rules.refuse(
            info.name,
            f"{role} of dtype {rules.dtype_name(info)} is not one clipcli decodes "
            f"({', '.join(sorted(allowed))})",
        )


def whole_number(value: object, where: str, what: str, low: int, high: int) -> int:
    """An int from a config in [low, high] (bool is no int here)."""
    if type(value) is not int or not low <= value <= high:
        raise rules.refuse(where, f"{what} {value!r} is not a whole number from {low} to {high}")
    return value


def group_of_rows(
    g_idx: np.ndarray | None, start: int, stop: int, group: int, groups: int, where: str
) -> np.ndarray:
    """The group of each row (or column) in [start, stop): from g_idx when stored (checked
    to lie in [0, groups) before it indexes anything), else index // group."""
    import numpy as np

    if g_idx is None:
        return np.arange(start, stop, dtype=np.int64) // group
    chosen = g_idx.reshape(-1)[start:stop].astype(np.int64)
    if chosen.size and (int(chosen.min()) < 0 or int(chosen.max()) >= groups):
        bad = int(chosen[(chosen < 0) | (chosen >= groups)][0])
        raise rules.refuse(where, f"g_idx holds group {bad}, outside the {groups} groups stored")
    return chosen


def float64(array: np.ndarray) -> np.ndarray:
    """A float16/bfloat16/float32 array as float64, exactly."""
    import numpy as np

    return np.asarray(array).astype(np.float64)


def qweight_sets(
    stored: Mapping[str, TensorInfo], declared: bool, label: str
) -> Iterator[tuple[str, TensorInfo, TensorInfo, TensorInfo]]:
    """(module, qweight, qzeros, scales) of every `<module>qweight` stored with both its
    companions (GPTQ and AWQ name them alike); `module` is the prefix with its dot ("X.",
    "" for the root module's bare qweight: rules.module_prefix). A qweight missing one is
    refused where a config declares the scheme (its real values are unknown), else passed
    over."""
    for name, info in stored.items():
        module = rules.module_prefix(name, "qweight")
        if module is None:
            continue
        qzeros = stored.get(module + "qzeros")
        scales = stored.get(module + "scales")
        if qzeros is None or scales is None:
            if declared:
                missing = module + ("qzeros" if qzeros is None else "scales")
                raise rules.incomplete(
                    name, f"{label} codes without their {missing}: the real values are unknown"
                )
            continue
        yield module, info, qzeros, scales


class CodeTerms(NamedTuple):
    """Rows of an integer-coded weight as (code - zero point), each with the index of its
    scale in the flattened scale tensor: decoded = terms x scales.flat[index], exact."""

    terms: np.ndarray  # int64
    scale_at: np.ndarray  # int64, the shape of terms


def decoded(found: CodeTerms, scales: np.ndarray) -> np.ndarray:
    """The real values: each term times its scale (a float64 product, exact)."""
    values: np.ndarray = found.terms * float64(scales).reshape(-1)[found.scale_at]
    return values


def scale_energies(found: CodeTerms, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(sum of terms**2 under each scale the rows use, those scales as float64): the rows'
    sum of squares is sum(energy x scale**2), whatever the scales are scaled to (the
    factor search's check, clipcli.numerics.coded.bounded_table_sumsq). The energies are
    exact: squares of terms below 2**9 summed in float64, fewer than 2**35 of them. None
    when a scale the rows use is NaN or infinite (decoding makes NaN of it)."""
    import numpy as np

    index = found.scale_at.reshape(-1)
    if index.size == 0:
        return np.zeros(0), np.zeros(0)
    low, high = int(index.min()), int(index.max())
    used = np.bincount(index - low, minlength=high - low + 1) > 0
    squares = found.terms.reshape(-1).astype(np.float64) ** 2
    energies = np.bincount(index - low, weights=squares, minlength=high - low + 1)
    values = float64(scales).reshape(-1)[low : high + 1]
    if not np.isfinite(values[used]).all():
        return None
    return energies[used], values[used]


def code_energies(found: CodeTerms) -> tuple[int, np.ndarray]:
    """The sum of terms**2 under each scale from the least index the rows use to the
    largest (zero for one they do not): (that least index, the sums as int64), exact
    (squares below 2**18 summed in float64, fewer than 2**35 of them)."""
    import numpy as np

    index = found.scale_at.reshape(-1)
    if index.size == 0:
        return 0, np.zeros(0, dtype=np.int64)
    low, high = int(index.min()), int(index.max())
    squares = found.terms.reshape(-1).astype(np.float64) ** 2
    sums = np.bincount(index - low, weights=squares, minlength=high - low + 1)
    return low, sums.astype(np.int64)


# Energies of integer codes are the integer sums of (code - zero point)**2 (code_energies).
ENERGY_UNIT = 0

# A scheme's rows as CodeTerms: (weight, codes, start, stop, small, columns) -> CodeTerms.
Terms = Callable[..., CodeTerms]


class TermHooks(NamedTuple):
    """The scheme hooks an integer scheme makes of its CodeTerms (scheme.py)."""

    decode_rows: Callable[..., np.ndarray]
    decode_columns: Callable[..., np.ndarray]
    scale_energies: Callable[..., tuple[np.ndarray, np.ndarray] | None]
    code_energies: Callable[..., tuple[int, np.ndarray]]


def term_hooks(terms: Terms, scale: str) -> TermHooks:
    """decode_rows, decode_columns, scale_energies and code_energies of a scheme whose
    rows are `terms` and whose scales are the part named by weight.params[scale]."""

    def decode_rows(
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
    ) -> np.ndarray:
        """Rows [start, stop) as decoded (of the transpose where the weight is stored so)."""
        return decoded(terms(weight, codes, start, stop, small), small[weight.params[scale]])

    def decode_columns(
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
        columns: tuple[int, int],
    ) -> np.ndarray:
        """Rows [start, stop), columns [first, last) only: what the view gathers into a
        transposed weight's C order a block of outputs at a time."""
        found = terms(weight, codes, start, stop, small, columns)
        return decoded(found, small[weight.params[scale]])

    def rows_scale_energies(
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Rows [start, stop) as the energy under each scale and the scales: the factor
        search's check without decoding."""
        found = terms(weight, codes, start, stop, small)
        return scale_energies(found, small[weight.params[scale]])

    def rows_code_energies(
        weight: Recognised,
        codes: np.ndarray,
        start: int,
        stop: int,
        small: Mapping[str, np.ndarray],
    ) -> tuple[int, np.ndarray]:
        """Rows [start, stop)'s energy under each scale, kept by the view for every check."""
        return code_energies(terms(weight, codes, start, stop, small))

    return TermHooks(decode_rows, decode_columns, rows_scale_energies, rows_code_energies)
