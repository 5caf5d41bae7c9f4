"""Encoders and exact references for the integer quantization schemes' tests.

Written from each scheme's published definition with Python integers and Fractions; they
share no code with clipcli's decoders (clipcli.logical.quantized.*)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from clipcli.formats.base import TensorInfo
from clipcli.logical.quantized.scheme import Recognised
from clipcli.numerics.norms import accumulate


def info(name: str, array: np.ndarray) -> TensorInfo:
    return TensorInfo(name, array.dtype, tuple(array.shape), array.nbytes)


def infos(arrays: Mapping[str, np.ndarray]) -> dict[str, TensorInfo]:
    return {name: info(name, array) for name, array in arrays.items()}


def words_as_int32(words: Sequence[int]) -> np.ndarray:
    return np.array([w & 0xFFFFFFFF for w in words], dtype=np.uint32).view(np.int32)


def dense_stream(values: Sequence[int], bits: int) -> list[int]:
    """Element i at bit i*bits of one stream, least significant first, cut into 32-bit
    words (as many as the bits need)."""
    stream = 0
    for i, v in enumerate(values):
        assert 0 <= v < (1 << bits)
        stream |= v << (i * bits)
    count = -(-len(values) * bits // 32)
    return [(stream >> (32 * k)) & 0xFFFFFFFF for k in range(count)]


def per_word_stream(values: Sequence[int], bits: int) -> list[int]:
    """floor(32/bits) elements per word, element i at bit (i % f) * bits of word i // f."""
    factor = 32 // bits
    words = [0] * -(-len(values) // factor)
    for i, v in enumerate(values):
        assert 0 <= v < (1 << bits)
        words[i // factor] |= v << ((i % factor) * bits)
    return words


def pack_columns(
    matrix: Sequence[Sequence[int]], pack: Callable[[Sequence[int], int], list[int]], bits: int
) -> np.ndarray:
    """Each column of `matrix` packed down as one stream: words [n_words, columns]."""
    columns = [pack([row[j] for row in matrix], bits) for j in range(len(matrix[0]))]
    return np.array(
        [[columns[j][k] for j in range(len(columns))] for k in range(len(columns[0]))],
        dtype=np.uint32,
    ).view(np.int32)


def pack_rows(
    matrix: Sequence[Sequence[int]], pack: Callable[[Sequence[int], int], list[int]], bits: int
) -> np.ndarray:
    return np.array([pack(list(row), bits) for row in matrix], dtype=np.uint32).view(np.int32)


def fractions_of(array: np.ndarray) -> list[Any]:
    """Every value of a float array as an exact Fraction, nested like the array."""
    values: list[Any] = np.vectorize(lambda v: Fraction(float(v)), otypes=[object])(
        np.asarray(array).astype(np.float64)
    ).tolist()
    return values


def exact_sqrt(value: Fraction) -> float:
    """sqrt of a non-negative Fraction, correctly rounded enough to compare to ~1 ulp."""
    if value == 0:
        return 0.0
    shift = 2 * (120 - (value.numerator.bit_length() - value.denominator.bit_length()) // 2)
    scaled = (value.numerator << max(shift, 0)) // (value.denominator << max(-shift, 0))
    return math.ldexp(float(math.isqrt(scaled)), -shift // 2)


def decode_all(
    module: Any, weight: Recognised, arrays: Mapping[str, np.ndarray], step: int
) -> np.ndarray:
    """The whole real weight, decoded `step` rows at a time through code_rows/decode_rows
    (rows of the transpose where the weight is transposed), shaped as decoded."""
    shape = weight.shape[::-1] if weight.transposed else weight.shape
    rows = math.prod(shape[:-1])
    codes = arrays[weight.codes]
    codes2d = codes.reshape(-1, codes.shape[-1]) if codes.ndim > 1 else codes.reshape(-1, 1)
    small = {p.name: arrays[p.name] for p in weight.parts if p.name != weight.codes}
    pieces = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        first, last = module.code_rows(weight, start, stop)
        piece = module.decode_rows(weight, codes2d[first:last], start, stop, small)
        assert piece.dtype == np.float64
        assert piece.shape == (stop - start, shape[-1])
        pieces.append(piece)
    return np.concatenate(pieces).reshape(shape)


def assert_exact(decoded: np.ndarray, reference: Sequence[Any]) -> None:
    """Every decoded value equals its Fraction exactly, and the norm of the decoded values
    (clipcli's accumulator) is the exact norm to within an ulp."""
    flat_ref = list(np.array(reference, dtype=object).reshape(-1))
    flat = decoded.reshape(-1)
    assert len(flat_ref) == flat.size
    for got, want in zip(flat.tolist(), flat_ref, strict=True):
        assert Fraction(got) == want, (got, want)
    exact = exact_sqrt(sum((v * v for v in flat_ref), Fraction(0)))
    norm = accumulate([decoded.reshape(-1)]).norm
    assert abs(norm - exact) <= math.ulp(exact), (norm, exact)
