"""A tensor whose norm is exactly C is left alone, whatever its size (NUMERICS: "<= C").
A tensor of over 2,048 nonzero values has over _EXACT_REST error terms: CertainSumsq.add
bounds their float64 sum, and an exact tie fell within that bound, read as over and was
clipped (attack s37b: k*k equal float32 values and C = k * value, k >= 46). Such a part
is now worked out exactly (CertainSumsq.add_exactly, certain.exact_sum) when a decision
falls within its bound. The references are fractions of the values (no clipcli code)."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import Run
from handmade import read_safetensors, write_safetensors

from clipcli.numerics import certain
from clipcli.numerics.certain import CertainSumsq, exact_sum

VALUE = np.float32(0.7)  # a full float32 mantissa


def exact_sumsq(array: np.ndarray) -> Fraction:
    if array.dtype.kind == "c":
        array = array.astype(np.complex128).view(np.float64)
    return sum((Fraction(float(v)) ** 2 for v in array.reshape(-1).tolist()), Fraction(0))


def wide_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    normal = rng.standard_normal(5000)
    spread = np.ldexp(rng.uniform(0.5, 1.0, 3000), rng.integers(-1070, 1020, 3000))
    spread *= rng.choice([-1.0, 1.0], 3000)
    bands = np.ldexp(1.0, np.arange(0, -1075, -1, dtype=np.int64))  # every power of two
    edge = np.array([1.0, 2.0**-400, np.nextafter(2.0**-400, 0.0), 2.0**-800, 5e-324])
    return [
        normal.astype(np.float32),
        normal,
        spread,
        bands,
        -bands,
        edge,  # exactly at a band's edge, one ulp under it, two bands down, the least
        edge * 0.75,
        np.full(4900, VALUE, np.float32),
        (normal[:2500] + 1j * normal[2500:]).astype(np.complex64),
        np.zeros(3000),
        np.array([], np.float64),
    ]


@pytest.mark.parametrize("index", range(len(wide_arrays())))
def test_add_exactly_is_the_exact_sum_of_squares(index: int) -> None:
    array = wide_arrays()[index]
    total = CertainSumsq()
    total.add_exactly(array[: len(array) // 2])
    total.add_exactly(array[len(array) // 2 :])
    assert total.exact
    assert total.total == exact_sumsq(array)


def test_exact_sum_is_exact_with_cancellation_and_any_spread() -> None:
    rng = np.random.default_rng(3)
    cases = [
        np.array([]),
        np.array([0.0, -0.0]),
        np.array([2.0**600, 1.0, -(2.0**600), 2.0**-600]),  # everything cancels but tails
        np.ldexp(rng.standard_normal(20000), rng.integers(-1000, 900, 20000)) * 2.0**-30,
        rng.standard_normal(100000) * 2.0**-60,
        np.array([5e-324] * 7 + [1.0]),
    ]
    for terms in cases:
        assert exact_sum(terms) == sum(map(Fraction, terms.tolist()), Fraction(0))


def test_a_bound_is_worked_out_only_when_it_cannot_decide() -> None:
    """Past _EXACT_REST error terms add() leaves a bound; at_most asks for the exact part
    only when the limit falls within it, and then decides exactly."""
    n = 2116  # 46 * 46: 4,231 error terms, past _EXACT_REST
    array = np.full(n, VALUE, np.float32)
    quick = CertainSumsq()
    quick.add(array)
    assert not quick.exact
    asked: list[int] = []

    def exactly() -> CertainSumsq:
        asked.append(1)
        part = CertainSumsq()
        part.add_exactly(array)
        return part

    limit = Fraction(float(VALUE) * 46)  # exactly the norm
    hair = Fraction(1, 2**200)  # far within the bound
    for at, within, works_out in [
        (limit, True, True),
        (limit * (1 - hair), False, True),
        (limit * (1 + hair), True, True),
        (Fraction(float(np.nextafter(float(limit), 0.0))), False, False),
        (Fraction(float(np.nextafter(float(limit), 99.0))), True, False),
        (limit * 2, True, False),
        (limit / 2, False, False),
    ]:
        asked.clear()
        total = CertainSumsq()
        total.add_bounded(quick.total, quick.bound, exactly)
        assert total.at_most(at) is within, at
        assert bool(asked) is works_out, at
        assert (Fraction(n) * Fraction(float(VALUE)) ** 2 <= Fraction(at) ** 2) is within


def test_the_rest_exactly_at_the_limit_is_summed_exactly_and_one_past_is_bounded() -> None:
    """The `<=` of _EXACT_REST: the largest tensor of equal values whose error terms are
    added as fractions has a bound of 0, the next one a bound (then worked out)."""
    sizes = range(2040, 2060)
    bounded = []
    for n in sizes:
        total = CertainSumsq()
        total.add(np.full(n, VALUE, np.float32))
        bounded.append(not total.exact)
        _, rest = certain.split_sumsq(np.ones((1, n)))
        assert (rest.shape[1] > certain._EXACT_REST) is bounded[-1], n
    assert bounded[0] is False
    assert bounded[-1] is True


@pytest.mark.parametrize("k", [45, 46, 100, 140])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_large_tensor_exactly_at_the_limit_is_left_alone(
    tmp_path: Path, run_main: Callable[..., Run], k: int, dtype: type
) -> None:
    """k * k equal values v: norm k * v exactly (float64 holds it: 24 + 8 bits). Left
    alone at C = k v and one ulp above; clipped to an exact norm <= C one ulp below."""
    array: np.ndarray = np.full(k * k, VALUE, dtype)
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    write_safetensors(src, {"t": array, "u": array.copy()})
    norm = float(VALUE) * k
    assert Fraction(norm) ** 2 == exact_sumsq(array)
    for limit in (norm, float(np.nextafter(norm, np.inf))):
        done = run_main("clip", "--norm", repr(limit), "-q", "--force", src, out)
        assert done.code == 0, done.stderr
        assert out.read_bytes() == src.read_bytes(), limit
    below = float(np.nextafter(norm, 0.0))
    assert run_main("clip", "--norm", repr(below), "-q", "--force", src, out).code == 0
    for name, written in read_safetensors(out).items():
        assert written.tobytes() != array.tobytes(), name
        assert exact_sumsq(written) <= Fraction(below) ** 2, name


def test_a_group_exactly_at_the_limit_is_left_alone(
    tmp_path: Path, run_main: Callable[..., Run]
) -> None:
    """--global over 2,500 values 3v (float64) and 2,500 values 4v (float32), v a full
    float32 mantissa: the norm is 250 v exactly."""
    v = float(VALUE)
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    tensors: dict[str, np.ndarray] = {
        "a": np.full(2500, 3 * v, np.float64),
        "b": np.full(2500, 4 * v, np.float32),
        "c": np.full(50, 0.0, np.float32),
    }
    write_safetensors(src, tensors)
    norm = 250 * v
    assert sum(map(exact_sumsq, tensors.values()), Fraction(0)) == Fraction(norm) ** 2
    done = run_main("clip", "--global", repr(norm), "-q", src, out)
    assert done.code == 0, done.stderr
    assert out.read_bytes() == src.read_bytes()
    below = float(np.nextafter(norm, 0))
    assert run_main("clip", "--global", repr(below), "-q", "--force", src, out).code == 0
    written = read_safetensors(out)
    total = sum((exact_sumsq(written[name]) for name in tensors), Fraction(0))
    assert total <= Fraction(below) ** 2


@pytest.mark.parametrize("chunk_bytes", [None, "4096"])
def test_ties_read_many_at_a_time_or_in_chunks_decide_alike(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_main: Callable[..., Run],
    chunk_bytes: str | None,
) -> None:
    """Small tensors (<= 64 KiB) are read whole, many at a time, to decide ties: the
    chunk size must not change the answer (with 4 KiB chunks each chunk's error terms were
    exact, read whole they were bounded: attack s37b)."""
    if chunk_bytes is not None:
        monkeypatch.setenv("CLIPCLI_CHUNK_BYTES", chunk_bytes)
    tensors = {f"t{i}": np.full(2500, VALUE, np.float32) for i in range(5)}
    tensors["over"] = np.full(2500, np.nextafter(VALUE, np.float32(1)), np.float32)
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    write_safetensors(src, tensors)
    assert run_main("clip", "--norm", repr(float(VALUE) * 50), "-q", src, out).code == 0
    written = read_safetensors(out)
    for name, array in tensors.items():
        assert (written[name].tobytes() == array.tobytes()) is (name != "over"), name
    assert exact_sumsq(written["over"]) <= (Fraction(float(VALUE)) * 50) ** 2


@pytest.mark.parametrize("factor", [(1.0, 0), (0.5, 0), (1.0, -3)])  # exact scalings
def test_the_checks_sums_are_certain_and_worked_out_exact(
    tmp_path: Path, factor: tuple[float, int]
) -> None:
    """_OutputCheck and its each(): small tensors read many at a time, consecutive members
    of a group summed as one array, members alone as rows (sumsq_each), large ones chunk
    by chunk. Every group's sum holds the exact one within its bound, and worked out it is
    the exact one; empty groups are 0 (a group whose members all have histograms)."""
    from clipcli.formats.opening import open_reader
    from clipcli.jobs import execution

    rng = np.random.default_rng(5)
    tensors: dict[str, np.ndarray] = {}
    for i in range(300):
        size = int(rng.choice([1, 2, 7, 3000, 20000]))
        dtype = [np.float64, np.float32, np.complex64][i % 3]
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-30, 30)
        if dtype is np.complex64:
            values = values + 1j * rng.standard_normal(size)
        tensors[f"t{i:03d}"] = values.astype(dtype)
    src = tmp_path / "in.safetensors"
    write_safetensors(src, tensors)
    mantissa, exponent = factor
    scale = Fraction(mantissa) * Fraction(2) ** exponent
    with open_reader(src) as reader:
        infos = {info.name: info for info in reader.infos}
        names = list(infos)
        cuts = sorted(rng.choice(len(names), 40, replace=True).tolist())
        parts = [names[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)], strict=True)]
        groups = [[infos[name] for name in part] for part in parts]  # some empty
        check = execution.output_check(reader)
        each = check.each(groups, mantissa, exponent)  # type: ignore[attr-defined]
        one_at_a_time = [check(group, mantissa, exponent) for group in groups]
        for sums in (each, one_at_a_time):
            for part, total in zip(parts, sums, strict=True):
                exact = sum((exact_sumsq(tensors[n]) for n in part), Fraction(0)) * scale**2
                assert total.total - total.bound <= exact <= total.total + total.bound
                total._work_out_loose()
                assert (total.total, total.bound) == (exact, 0)
