"""The safetensors reader's compact-header route (formats/safetensors/header.compact_header):
a header spelled the way common writers spell it is read by regular expressions instead of
json.loads, and must give exactly what the JSON route gives (the same tensors, offsets and
metadata, or the same error), and must hand every other spelling to the JSON route.

References: the JSON route itself (compact_header turned off) and safetensors' own reader
(safe_open), which shares no code with clipcli.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from clipcli.errors import InputError
from clipcli.formats.safetensors import header as st_header
from clipcli.formats.safetensors import reader as st_reader


def is_compact(text: str) -> bool:
    """Whether the compact route reads the header itself (every block of it)."""
    compact = st_header.compact_header(text)
    if compact is None:
        return False
    try:
        for _ in compact.blocks():
            pass
    except st_header.NotCompact:
        return False
    return True


@pytest.fixture(params=["default blocks", "one entry a block"])
def block_chars(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header split in its usual blocks, or cut after every entry (as a header of
    hundreds of thousands of entries is): a problem in one block, an error in another."""
    if request.param == "one entry a block":
        monkeypatch.setattr(st_header, "_BLOCK_CHARS", 1)


def write_raw(path: Path, text: str, data_bytes: int) -> Path:
    raw = text.encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(
        struct.pack("<Q", len(raw))
        + raw
        + bytes(range(256)) * (data_bytes // 256)
        + bytes(data_bytes % 256)
    )
    return path


def outcome(path: Path) -> tuple[object, ...]:
    try:
        reader = st_reader.SafetensorsReader(path)
    except InputError as exc:
        return ("error", str(exc))
    try:
        return ("ok", reader.listing, reader._offsets, dict(reader.metadata))
    finally:
        reader.close()


def both_routes(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[object, ...], ...]:
    compact = outcome(path)
    with monkeypatch.context() as patched:
        patched.setattr(st_reader, "compact_header", lambda _text: None)
        via_json = outcome(path)
    return compact, via_json


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def compact_json(header: Mapping[str, object]) -> str:
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False)


# Headers the compact route reads itself: (text, data bytes).
COMPACT = {
    "plain": (compact_json({"a": entry("F32", [2, 3], 0, 24), "b": entry("I8", [], 24, 25)}), 25),
    "metadata first": (
        compact_json({"__metadata__": {"format": "pt"}, "w": entry("BF16", [4], 0, 8)}),
        8,
    ),
    "metadata spaced inside": (
        '{"__metadata__":{ "k" : "v" },"w":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}}',
        2,
    ),
    "unicode name, file order differs from header order": (
        compact_json({"zé€😀": entry("F64", [1], 8, 16), "a": entry("U8", [8], 0, 8)}),
        16,
    ),
    "20-digit dimension": (compact_json({"w": entry("F32", [0, 10**19], 0, 0)}), 0),
    "zero-size and scalar": (
        compact_json({"e": entry("F32", [0, 5], 0, 0), "s": entry("F64", [], 0, 8)}),
        8,
    ),
    "trailing whitespace": (compact_json({"w": entry("F32", [1], 0, 4)}) + " \t\r\n", 4),
    # Errors the reader words from the entry: the compact route must word them alike.
    "unknown dtype": (compact_json({"w": entry("F33", [1], 0, 4)}), 4),
    "packed dtype": (compact_json({"w": entry("F4", [2], 0, 1)}), 1),
    "rank 65": (compact_json({"w": entry("F32", [1] * 65, 0, 4)}), 4),
    "rank 64": (compact_json({"w": entry("F32", [1] * 64, 0, 4)}), 4),
    "size mismatch": (compact_json({"w": entry("F32", [2], 0, 4)}), 4),
    "begin after end": (compact_json({"w": entry("F32", [1], 4, 0)}), 4),
    "gap": (compact_json({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}), 12),
    "overflowing shape": (compact_json({"w": entry("F32", [2**32, 2**32, 0], 0, 0)}), 0),
    "u64 bytes overflow": (compact_json({"w": entry("U8", [2**61], 0, 2**61)}), 0),
    "trailing bytes": (compact_json({"w": entry("F32", [1], 0, 4)}), 8),
    "size error, then a gap": (
        compact_json({"a": entry("F32", [2], 0, 4), "b": entry("F32", [1], 8, 12)}),
        12,
    ),
    "metadata not strings": (
        compact_json({"__metadata__": {"n": 1}, "w": entry("F32", [1], 0, 4)}),
        4,
    ),
    "metadata shaped like an entry": (
        compact_json({"__metadata__": entry("F32", [1], 0, 4), "w": entry("F32", [1], 0, 4)}),
        4,
    ),
}

# Headers the compact route must hand to json.loads: (text, data bytes).
NOT_COMPACT = {
    "spaces": ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4),
    "keys in another order": ('{"w":{"shape":[1],"dtype":"F32","data_offsets":[0,4]}}', 4),
    "escaped name": ('{"w\\u0041":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "surrogate escape": ('{"w\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "control character": ('{"w\x01":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "leading zero": ('{"w":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}', 4),
    "negative": ('{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', 4),
    "float": ('{"w":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', 4),
    "21 digits": ('{"w":{"dtype":"F32","shape":[100000000000000000000],"data_offsets":[0,4]}}', 4),
    "5000 digits": ('{"w":{"dtype":"F32","shape":[1' + "0" * 5000 + '],"data_offsets":[0,4]}}', 4),
    "duplicate name": (
        '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        '"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        8,
    ),
    "duplicate metadata key": (
        '{"__metadata__":{"k":"a","k":"b"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        4,
    ),
    "metadata last": (
        '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"k":"v"}}',
        4,
    ),
    "metadata twice": (
        '{"__metadata__":{},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        '"__metadata__":{}}',
        4,
    ),
    "entry named __metadata__": (
        '{"__metadata__":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        4,
    ),
    "metadata alone": ('{"__metadata__":{"k":"v"}}', 0),
    "empty": ("{}", 0),
    "leading whitespace": (' {"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "trailing comma": ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},}', 4),
    "missing comma": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        8,
    ),
    "text after the object": ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}x', 4),
    "extra key": ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', 4),
    "size error, then a duplicate": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]},'
        '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
        '"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}',
        12,
    ),
    "size error, then spaces": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]},'
        '"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
        8,
    ),
    "metadata error, then a duplicate": (
        '{"__metadata__":{"n":1},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        8,
    ),
    "not an object": ('[{"dtype":"F32","shape":[1],"data_offsets":[0,4]}]', 4),
}


@pytest.mark.usefixtures("block_chars")
@pytest.mark.parametrize("case", COMPACT)
def test_compact_headers_read_alike_by_both_routes(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, data = COMPACT[case]
    assert is_compact(text)  # the compact route reads it
    compact, via_json = both_routes(write_raw(tmp_path / "x.safetensors", text, data), monkeypatch)
    assert compact == via_json


@pytest.mark.usefixtures("block_chars")
@pytest.mark.parametrize("case", NOT_COMPACT)
def test_other_spellings_go_to_json(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, data = NOT_COMPACT[case]
    assert not is_compact(text)
    compact, via_json = both_routes(write_raw(tmp_path / "x.safetensors", text, data), monkeypatch)
    assert compact == via_json


@pytest.mark.usefixtures("block_chars")
def test_the_limit_of_tensors_counts_on_the_compact_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At MAX_TENSORS entries a header is read; one more is refused, by both routes."""
    monkeypatch.setattr(st_reader, "MAX_TENSORS", 3)
    for count, refused in ((3, False), (4, True)):
        header = {f"t{i}": entry("F32", [1], 4 * i, 4 * i + 4) for i in range(count)}
        path = write_raw(tmp_path / f"{count}.safetensors", compact_json(header), 4 * count)
        compact, via_json = both_routes(path, monkeypatch)
        assert compact == via_json
        assert (compact[0] == "error") is refused


def test_a_written_checkpoint_reads_as_safetensors_reads_it(tmp_path: Path) -> None:
    """Mixed dtypes, shapes and names, as the official writer lays them out: the listing
    and the offsets agree with safe_open's."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    tensors = {
        f"model.layers.{i}.w{'é' * (i % 2)}": rng.standard_normal(
            [int(d) for d in rng.integers(0, 4, size=i % 4)]
        ).astype(["<f4", "<f2", "<f8", "<i4", "u1"][i % 5])
        for i in range(40)
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    raw = path.read_bytes()
    text = raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]].decode()
    assert st_header.compact_header(text) is not None
    reader = st_reader.SafetensorsReader(path)
    try:
        listed = {t.name: t for t in reader.listing}
        assert dict(reader.metadata) == {"format": "np"}
        with safe_open(str(path), "np") as reference:
            names = reference.keys()
            assert sorted(names) == sorted(listed)
            for name in names:
                array = reference.get_tensor(name)
                assert listed[name].shape == array.shape
                assert listed[name].nbytes == array.nbytes
                assert np.dtype(listed[name].dtype_name) == array.dtype
                begin = reader._offsets.begin(name)
                assert raw[begin : begin + array.nbytes] == array.tobytes()
    finally:
        reader.close()
