"""Where each safetensors tensor begins, found by name (formats.safetensors.offsets): the
sorted-name index against a plain dict, and through the reader against the bytes the
safetensors library reads back."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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
