"""Where a name stands among many (formats.names) and where each safetensors tensor
begins (formats.safetensors.offsets): the sorted-name index against a plain dict, asked in
every order a caller asks (in order, each name a few times, runs started again, out of
order, from racing threads), and through the reader against the bytes the safetensors
library reads back."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clipcli.formats.names import NamePositions
from clipcli.formats.safetensors.offsets import TensorOffsets
from clipcli.formats.safetensors.reader import SafetensorsReader


def _names(count: int, rng: random.Random) -> list[str]:
    """Names whose file order is not their sorted order: prefixes of each other, digits
    that sort as text (layers.10 before layers.2), non-ASCII, the empty string."""
    pool = {"", "a", "a.b", "a.b.c", "layers.2", "layers.10", "é", "\U0001f600", "Z"}
    while len(pool) < count:
        pool.add("".join(rng.choice("ab.19é") for _ in range(rng.randint(1, 8))))
    names = sorted(pool)[:count]
    rng.shuffle(names)
    return names


@pytest.mark.parametrize("count", [0, 1, 2, 3, 50, 1000])
def test_every_name_is_found_as_a_dict_finds_it(count: int) -> None:
    rng = random.Random(count)
    names = _names(count, rng)
    begins = sorted(rng.sample(range(10**12), count))
    reference = dict(zip(names, begins, strict=True))
    offsets = TensorOffsets(names, begins)
    assert len(offsets) == count
    for name in rng.sample(names, count):
        assert offsets.begin(name) == reference[name]
        assert names[offsets.position(name)] == name
    # Runs in file order, runs out of order, repeats, and runs that leave the file's end.
    for _ in range(200 if count else 1):
        start = rng.randrange(count) if count else 0
        run = names[start : start + rng.randint(0, 6)]
        mixed = [rng.choice(names) for _ in range(rng.randint(1, 6))] if count else []
        for asked in (run, mixed, run + mixed, mixed + run, run[::-1]):
            assert offsets.begins(asked) == [reference[n] for n in asked]
            assert NamePositions(names).of_run(asked) == [names.index(n) for n in asked]


@pytest.mark.parametrize("count", [0, 1, 2, 3, 500])
def test_positions_in_every_order_a_caller_asks(count: int) -> None:
    rng = random.Random(count)
    names = _names(count, rng)
    position = NamePositions(names)
    assert len(position) == count
    # The writer's pattern: each name asked a few times in a row, in list order; then a
    # run asked ahead (joins) and asked again from its start (kept, outputs).
    for at, name in enumerate(names):
        assert [position(name) for _ in range(3)] == [at] * 3
    for start in range(0, count, 7):
        run = names[start : start + 7]
        for _ in range(2):
            assert [position(n) for n in run] == list(range(start, start + len(run)))
    for _ in range(3 * count):  # out of order, and backwards
        at = rng.randrange(count)
        assert position(names[at]) == at
        assert position(names[at - 1]) == (at - 1) % count


def test_positions_are_right_whichever_thread_moves_the_hint() -> None:
    """Four threads each sweep the names in their own order at once; the hint they share
    is only ever a guess, so every answer is the name's own position."""
    names = _names(2000, random.Random(7))
    position = NamePositions(names)
    orders = [list(range(2000)), list(range(1999, -1, -1))]
    orders += [random.Random(seed).sample(range(2000), 2000) for seed in (1, 2)]
    start = threading.Barrier(len(orders))
    wrong: list[tuple[int, int]] = []

    def sweep(order: list[int]) -> None:
        start.wait()
        for _ in range(5):
            wrong.extend((at, got) for at in order if (got := position(names[at])) != at)

    threads = [threading.Thread(target=sweep, args=(order,)) for order in orders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


@pytest.mark.parametrize("missing", ["", "a.b.", "layers.1", "layers.20", "\uffff", "zz"])
def test_a_name_the_file_lacks_is_a_key_error(missing: str) -> None:
    names = ["a", "a.b", "layers.10", "layers.2", "z"]
    offsets = TensorOffsets(names, [0, 4, 8, 12, 16])
    with pytest.raises(KeyError):
        offsets.begin(missing)
    with pytest.raises(KeyError):
        offsets.begins(["a", missing])  # found after a name that is found
    with pytest.raises(KeyError):
        offsets.begins([missing, "a"])
    position = NamePositions(names)
    for before in ("a", "z"):  # the hint at either end
        position(before)
        with pytest.raises(KeyError):
            position(missing)


def test_the_reader_reads_each_tensor_where_the_library_does(tmp_path: Path) -> None:
    """Tensors whose byte order (the library writes by dtype size, then name) differs from
    their name order: each read gives the library's values."""
    rng = np.random.default_rng(0)
    tensors = {
        f"layers.{i}.{kind}": rng.standard_normal(int(rng.integers(1, 9))).astype(dtype)
        for i in (0, 1, 2, 10, 11, 20)
        for kind, dtype in (("w", np.float32), ("b", np.float16), ("s", np.float64))
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    reference = load_file(str(path))
    reader = SafetensorsReader(path)
    try:
        infos = reader.infos
        assert [i.name for i in infos] != sorted(tensors)  # file order is not name order
        for info in random.Random(1).sample(infos, len(infos)):
            (chunk,) = reader.chunks(info)
            assert chunk.tobytes() == reference[info.name].tobytes()
        for start in range(len(infos)):
            for stop in range(start + 1, len(infos) + 1):
                load = reader.loader_of_many(infos[start:stop])
                assert load is not None
                for info, array in zip(infos[start:stop], load(), strict=True):
                    assert array.tobytes() == reference[info.name].tobytes()
    finally:
        reader.close()


@pytest.mark.parametrize("names", [["a", "a"], ["a", "b", "a"], ["", "x", ""], ["é", "e", "é"]])
def test_a_repeated_name_is_refused(names: list[str]) -> None:
    """Bisection would find one of two equal names (a dict kept the last): refused."""
    with pytest.raises(ValueError, match="twice"):
        NamePositions(names)
    NamePositions(sorted(set(names)))  # the same names once each are fine
