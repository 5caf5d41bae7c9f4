"""The HDF5 structure record against the reader's own limits (issue 18, the second attack
on the record): whatever a record makes the writer produce, clipcli reads back.

1. A record's non-tensor dataset must be one the HDF5 reader lists as a non-tensor
   (safety.non_tensor_kind): a numeric one would come back as a weight no input had.
2. The bytes the datasets allocate (a chunked one: every chunk its extent touches, in
   full) are charged to the expansion budget, 200 x the input's size + 64 MiB.
3. Groups nest at most as deep as the reader walks (limits.MAX_DEPTH).
4. Attributes pass the reader's attribute budget (variable-length elements x the largest
   global heap object), metadata written as root attributes included.
Each refusal is exit 3 (the record is malformed), one line, nothing written.

References: h5py writes the inputs and reads every OUT (storage sizes, attribute values);
safetensors' own reader and writer forge the records; budgets are Python int arithmetic.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from clipcli.formats.hdf5 import limits
from clipcli.formats.hdf5.portable import build_type, describe_type

STRUCTURE_KEY = "clipcli.hdf5_structure"
Cli = Callable[..., Run]
Record = dict[str, Any]


def _base_h5(path: Path) -> None:
    """A small Keras-like file: a float and an int tensor, a vocabulary, attributes."""
    with h5py.File(path, "w") as f:
        f.attrs["note"] = "hello"
        group = f.create_group("layers/dense")
        group.create_dataset("kernel", data=np.arange(12, dtype=np.float32).reshape(3, 4))
        group.create_dataset("bias", data=np.array([1, 2, 3], dtype=np.int32))
        f.create_dataset("vocab", data=np.array(["a", "bb"], dtype=h5py.string_dtype()))


@pytest.fixture
def converted(clipcli: Cli, tmp_path: Path) -> Path:
    """_base_h5 converted to safetensors by clipcli: a real record to forge."""
    src, out = tmp_path / "base.h5", tmp_path / "base.safetensors"
    _base_h5(src)
    run = clipcli("convert", src, out)
    assert run.returncode == 0, run
    return out


def _forge(
    src: Path, dst: Path, edit: Callable[[Record], None], metadata: dict[str, str] | None = None
) -> Path:
    """src with its record edited (and metadata keys added), written by safetensors."""
    with safe_open(str(src), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        header = dict(f.metadata())
    record = json.loads(header[STRUCTURE_KEY])
    edit(record)
    header[STRUCTURE_KEY] = json.dumps(record)
    header.update(metadata or {})
    save_file(tensors, str(dst), metadata=header)
    return dst


def _node(record: Record, path: str) -> Record:
    return next(node for node in record["nodes"] if node["path"] == path)


def _refused(run: Run, out: Path, words: str) -> None:
    assert run.returncode == 3, run
    assert run.stderr.count("\n") == 1, run.stderr
    assert "malformed" in run.stderr, run.stderr
    assert words in run.stderr, run.stderr
    assert not out.exists()


def _reads_back(clipcli: Cli, out: Path) -> Run:
    run = clipcli("ls", out)
    assert run.returncode == 0, run
    return run


# ------------------------------------------------------------------ 1: non-tensors


def _raw(values: np.ndarray) -> dict[str, str]:
    return {"raw": base64.b64encode(values.tobytes()).decode("ascii")}


_SIMPLE3 = {"class": "simple", "shape": [3], "maxshape": [3]}
_F32 = np.array([1e30, -1e30, 7.0], "<f4")
# type, dataspace, data of a forged non-tensor dataset
NON_TENSORS: dict[str, tuple[Record, Record, Any]] = {
    "float32": (describe_type(h5py.h5t.py_create(np.dtype("<f4"))), _SIMPLE3, _raw(_F32)),
    "int64_big_endian": (
        {"class": "int", "size": 8, "order": ">", "signed": True},
        _SIMPLE3,
        _raw(np.array([2**62, -1, 5], ">i8")),
    ),
    "float64_scalar": (
        {"class": "float", "size": 8, "order": "<"},
        {"class": "scalar"},
        _raw(np.array(1e300, "<f8")),
    ),
    "complex64_compound_r_i": (
        describe_type(h5py.h5t.py_create(np.dtype("<c8"))),
        _SIMPLE3,
        _raw(np.array([1e30j, 2, 3], "<c8")),
    ),
    "bool_enum": (
        describe_type(h5py.h5t.py_create(np.dtype("?"))),
        _SIMPLE3,
        _raw(np.array([1, 0, 1], "u1")),
    ),
    "bitfield_read_as_uint8": (
        {"class": "bitfield", "size": 1, "order": "<"},
        _SIMPLE3,
        _raw(np.array([255, 0, 9], "u1")),
    ),
    # What the reader lists as non-tensors, and a record may carry:
    "float32_null_dataspace": (
        {"class": "float", "size": 4, "order": "<"},
        {"class": "null"},
        None,
    ),
    "fixed_string": (
        {"class": "string", "size": 4, "cset": 0, "pad": 1},
        _SIMPLE3,
        _raw(np.array([b"ab", b"cdef", b""], "S4")),
    ),
    "variable_string": (
        {"class": "string", "size": None, "cset": 1, "pad": 0},
        _SIMPLE3,
        {"strings": ["x", "yy", ""]},
    ),
    "compound_int_float": (
        {
            "class": "compound",
            "size": 12,
            "members": [
                {
                    "name": "id",
                    "offset": 0,
                    "type": {"class": "int", "size": 4, "order": "<", "signed": True},
                },
                {"name": "w", "offset": 4, "type": {"class": "float", "size": 8, "order": "<"}},
            ],
        },
        _SIMPLE3,
        _raw(np.zeros(3, np.dtype([("id", "<i4"), ("w", "<f8")]))),
    ),
    "opaque": (
        {"class": "opaque", "size": 2, "tag": "t"},
        _SIMPLE3,
        _raw(np.arange(6, dtype="u1")),
    ),
    "array_of_float32": (
        {"class": "array", "dims": [2], "base": {"class": "float", "size": 4, "order": "<"}},
        _SIMPLE3,
        _raw(np.arange(6, dtype="<f4")),
    ),
    "int_enum": (
        {
            "class": "enum",
            "base": {"class": "int", "size": 1, "order": "<", "signed": False},
            "members": [["A", 0], ["B", 5]],
        },
        _SIMPLE3,
        _raw(np.array([0, 5, 0], "u1")),
    ),
}


def _reader_lists_as_tensor(tmp_path: Path, type_desc: Record, space: Record) -> bool:
    """How clipcli's HDF5 reader lists a dataset of this type, in a file h5py writes."""
    from clipcli.formats.opening import open_reader

    path = tmp_path / "kind.h5"
    with h5py.File(path, "w") as f:
        if space["class"] == "null":
            spaceid = h5py.h5s.create(h5py.h5s.NULL)
        elif space["class"] == "scalar":
            spaceid = h5py.h5s.create(h5py.h5s.SCALAR)
        else:
            spaceid = h5py.h5s.create_simple(tuple(space["shape"]))
        h5py.h5d.create(f.id, b"d", build_type(type_desc), spaceid)
    reader = open_reader(path)
    try:
        return [info.name for info in reader.infos] == ["d"]
    finally:
        reader.close()


@pytest.mark.parametrize("case", sorted(NON_TENSORS))
def test_a_record_non_tensor_is_only_what_the_reader_lists_as_one(
    clipcli: Cli, tmp_path: Path, converted: Path, case: str
) -> None:
    """The attack: a float32 non-tensor of 1e30 once came out of `clip --global 1` as a
    weight (global norm 3.5e30). A type the reader lists as a tensor is refused (exit 3);
    one it lists as a non-tensor is written, read back by clipcli and by h5py, and OUT's
    tensors are exactly the input's."""
    type_desc, space, data = NON_TENSORS[case]
    as_tensor = _reader_lists_as_tensor(tmp_path, type_desc, space)
    assert as_tensor == (
        case
        in {
            "float32",
            "int64_big_endian",
            "float64_scalar",
            "complex64_compound_r_i",
            "bool_enum",
            "bitfield_read_as_uint8",
        }
    )

    def add(record: Record) -> None:
        node = copy.deepcopy(_node(record, "/vocab"))
        node.update(path="/extra", type=type_desc, space=space, data=data)
        record["nodes"].append(node)

    src = _forge(converted, tmp_path / "forged.safetensors", add)
    out = tmp_path / "out.h5"
    for command in (["convert"], ["convert", "--allow-lossy"], ["clip", "--global", "1"]):
        run = clipcli(*command, src, out)
        if as_tensor:
            _refused(run, out, "non-tensor dataset '/extra' has a numeric type")
            continue
        assert run.returncode == 0, (command, run)
        listed = json.loads(clipcli("norms", "--format", "json", out).stdout)
        assert [t["name"] for t in listed["tensors"]] == [
            "layers/dense/bias",
            "layers/dense/kernel",
        ]
        with h5py.File(out, "r") as f:
            assert describe_type(f["extra"].id.get_type()) == type_desc
        out.unlink()


# ------------------------------------------------------------------ 2: allocation


def test_the_attack_one_element_tensors_in_256_mib_chunks_is_refused(
    clipcli: Cli, tmp_path: Path
) -> None:
    """Six one-element tensors, each in a 256 MiB chunk: a 3 KB input once wrote 1.6 GB.
    The budget is 200 x the input's size + 64 MiB, stated in the message."""
    src_h5 = tmp_path / "six.h5"
    with h5py.File(src_h5, "w") as f:
        f.attrs["n"] = 1  # a structure a plain layout would lose: recorded
        for index in range(6):
            f.create_dataset(f"t{index}", data=np.array([1.0], np.float32))
    mid = tmp_path / "six.safetensors"
    assert clipcli("convert", src_h5, mid).returncode == 0

    def chunk(record: Record) -> None:
        for node in record["nodes"][1:]:
            node.update(layout="chunked", chunks=[2**26], alloc_time=3, filters=[])
            node["space"]["maxshape"] = [None]

    src = _forge(mid, tmp_path / "forged.safetensors", chunk)
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    size = src.stat().st_size
    _refused(run, out, f"allocate {6 * 2**28} bytes in OUT")
    assert f"the {size}-byte input" in run.stderr
    assert f"({200 * size + 64 * 2**20})" in run.stderr


def _allocation_record(record: Record) -> None:
    """kernel [3,4] float32 in chunks [2,3]: 2 x 2 chunks of 24 bytes; bias [3] int32 in
    one chunk [2**20] (4 MiB, extensible); vocab contiguous: 2 x 16 bytes."""
    kernel = _node(record, "/layers/dense/kernel")
    kernel.update(layout="chunked", chunks=[2, 3], filters=[], alloc_time=2)
    bias = _node(record, "/layers/dense/bias")
    bias.update(layout="chunked", chunks=[2**20], filters=[], alloc_time=3)
    bias["space"]["maxshape"] = [None]


ALLOCATED = 2 * 2 * (2 * 3 * 4) + 2**20 * 4 + 2 * 16


@pytest.mark.parametrize("over", [0, 1])
def test_allocation_budget_exactly_at_the_limit_and_one_byte_past(
    clipcli: Cli, tmp_path: Path, converted: Path, monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    """Budget = MAX_EXPANSION x input size + SPARSE_CHECK_BYTES. With the second set so that
    the budget is exactly the bytes allocated, OUT is written, and h5py's storage sizes
    add up to exactly what was charged; one byte less refuses."""
    src = _forge(converted, tmp_path / "forged.safetensors", _allocation_record)
    size = src.stat().st_size
    assert limits.MAX_EXPANSION * size < ALLOCATED
    monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", ALLOCATED - 200 * size - over)
    assert limits.expansion_budget(size) == 200 * size + ALLOCATED - 200 * size - over
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    if over:
        _refused(run, out, f"allocate {ALLOCATED} bytes in OUT")
        assert f"({ALLOCATED - 1})" in run.stderr
        return
    assert run.returncode == 0, run
    with h5py.File(out, "r") as f:
        stored = sum(
            f[name].id.get_storage_size()
            for name in ("layers/dense/kernel", "layers/dense/bias", "vocab")
        )
        assert f["layers/dense/bias"].chunks == (2**20,)
        assert f["layers/dense/kernel"][()].tobytes() == np.arange(12, dtype=np.float32).tobytes()
    assert stored == ALLOCATED
    _reads_back(clipcli, out)


# ------------------------------------------------------------------ 3: depth


def _nest(depth: int) -> Callable[[Record], None]:
    def edit(record: Record) -> None:
        template = _node(record, "/layers")
        path = ""
        for _ in range(depth):
            path += "/d"
            record["nodes"].append({**copy.deepcopy(template), "path": path, "attrs": []})

    return edit


@pytest.mark.parametrize("depth", [limits.MAX_DEPTH - 1, limits.MAX_DEPTH])
def test_record_groups_nest_exactly_as_deep_as_the_reader_reads(
    clipcli: Cli, tmp_path: Path, converted: Path, depth: int
) -> None:
    """Groups 63 below the root are written and read back (clipcli and h5py); 64 (the
    attack nested 100) are refused before anything is written."""
    src = _forge(converted, tmp_path / "forged.safetensors", _nest(depth))
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    if depth >= limits.MAX_DEPTH:
        _refused(run, out, f"groups nest deeper than {limits.MAX_DEPTH} levels")
        return
    assert run.returncode == 0, run
    with h5py.File(out, "r") as f:
        assert isinstance(f["/d" * depth], h5py.Group)
    _reads_back(clipcli, out)


# ------------------------------------------------------------------ 4: attributes


def _string_attribute(name: str, strings: list[str]) -> Record:
    return {
        "name": name,
        "type": {"class": "string", "size": None, "cset": 1, "pad": 0},
        "space": {"class": "simple", "shape": [len(strings)], "maxshape": [len(strings)]},
        "data": {"strings": strings},
    }


def test_the_attack_2000_strings_one_of_40000_bytes_is_refused(
    clipcli: Cli, tmp_path: Path, converted: Path
) -> None:
    def add(record: Record) -> None:
        record["nodes"][0]["attrs"].append(_string_attribute("vs", ["x" * 40000] + ["y"] * 1999))

    src = _forge(converted, tmp_path / "forged.safetensors", add)
    out = tmp_path / "out.h5"
    # 2,000 elements + the root's "note" = 2,001, times 40,000 bytes
    _refused(clipcli("convert", src, out), out, "(80040000 in all")


# Where the largest heap object comes from: a record attribute, a non-tensor dataset's
# string or a metadata value the rebuild adds as a root attribute. "note" = "hello" (one
# element) is always there.
LARGEST_FROM = ["attribute", "dataset", "metadata"]


@pytest.mark.parametrize("over", [0, 1])
@pytest.mark.parametrize("largest_from", LARGEST_FROM)
def test_attribute_budget_exactly_at_the_limit_and_one_past(
    clipcli: Cli,
    tmp_path: Path,
    converted: Path,
    monkeypatch: pytest.MonkeyPatch,
    largest_from: str,
    over: int,
) -> None:
    """elements x largest heap object: 5 attribute strings + "note" + (metadata) 1, the
    largest 1,000 bytes. At the budget OUT is written and clipcli's reader (whose heap scan
    finds the largest object itself) reads it back; one byte less refuses."""
    big = "z" * 1000
    attribute = [big if largest_from == "attribute" else "a", "b", "c", "d", "e"]
    metadata = {"user.key": big if largest_from == "metadata" else "m"}

    def edit(record: Record) -> None:
        record["nodes"][0]["attrs"].append(_string_attribute("vs", attribute))
        if largest_from == "dataset":
            _node(record, "/vocab")["data"] = {"strings": ["a", big]}

    src = _forge(converted, tmp_path / "forged.safetensors", edit, metadata)
    elements = 5 + 1 + 1
    monkeypatch.setattr(limits, "MAX_ATTRIBUTE_BYTES", elements * 1000 - over)
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    if over:
        _refused(run, out, f"{elements} variable-length attribute values")
        return
    assert run.returncode == 0, run
    with h5py.File(out, "r") as f:
        assert list(f.attrs["vs"]) == attribute
        assert f.attrs["user.key"] == metadata["user.key"]
    _reads_back(clipcli, out)


# ------------------------------------------------------------------ siblings


def test_a_non_tensor_of_no_elements_whose_shape_numpy_cannot_make_is_refused(
    clipcli: Cli, tmp_path: Path, converted: Path
) -> None:
    """(2**40, 2**40, 0) strings hold no value, so the record needs none; the reader
    refuses the shape (numpy's size limit), so the writer must not make it."""

    def edit(record: Record) -> None:
        vocab = _node(record, "/vocab")
        shape = [2**40, 2**40, 0]
        vocab["space"] = {"class": "simple", "shape": shape, "maxshape": shape}
        vocab["data"] = {"strings": []}

    src = _forge(converted, tmp_path / "forged.safetensors", edit)
    out = tmp_path / "out.h5"
    _refused(clipcli("convert", src, out), out, "overflows numpy's size limit")


def _mutate(record: Record, mutation: str, size: int) -> None:
    root, vocab = record["nodes"][0], _node(record, "/vocab")
    if mutation == "deep":
        _nest(size)(record)
    elif mutation == "strings":
        root["attrs"].append(_string_attribute("vs", ["s" * (size * 20000)] + ["t"] * (size * 50)))
    elif mutation == "chunks":
        bias = _node(record, "/layers/dense/bias")
        bias.update(layout="chunked", chunks=[2 ** min(size, 26)], filters=[])
        bias["space"]["maxshape"] = [None]
    elif mutation == "non_tensor":
        node = copy.deepcopy(vocab)
        node.update(
            path=f"/n{size}",
            type={"class": "int", "size": 1, "order": "<", "signed": bool(size % 2)},
        )
        node["data"] = _raw(np.zeros(2, "u1"))
        record["nodes"].append(node)
    elif mutation == "vocab_shape":
        shape = [size, 2**size, 0]
        vocab["space"] = {"class": "simple", "shape": shape, "maxshape": shape}
        vocab["data"] = {"strings": []}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["deep", "strings", "chunks", "non_tensor", "vocab_shape"]),
            st.integers(0, 70),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_whatever_a_forged_record_makes_the_writer_write_clipcli_reads_back(
    clipcli: Cli, tmp_path_factory: pytest.TempPathFactory, mutations: list[tuple[str, int]]
) -> None:
    """Refused in one line with nothing written, or OUT is read back by `clipcli ls`."""
    tmp = tmp_path_factory.mktemp("forged")
    src_h5, mid = tmp / "base.h5", tmp / "base.safetensors"
    _base_h5(src_h5)
    assert clipcli("convert", src_h5, mid).returncode == 0

    def edit(record: Record) -> None:
        for mutation, size in mutations:
            _mutate(record, mutation, size)

    src = _forge(mid, tmp / "forged.safetensors", edit)
    out = tmp / "out.h5"
    run = clipcli("convert", src, out)
    assert run.returncode in (0, 2, 3), (mutations, run)
    if run.returncode:
        assert run.stderr.count("\n") == 1, (mutations, run)
        assert not out.exists()
        return
    _reads_back(clipcli, out)


def test_what_only_the_written_file_shows_is_refused_before_the_commit(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's chunk budget is taken on the bytes it describes: 100 chunks of 4 KiB
    for 400 KiB of zeros, exactly the budget with no free chunks. Compressed by gzip, OUT
    is a few KiB, which the reader allows 1 or 2 chunks: OUT is opened with the reader
    before the commit, and the run is refused (exit 3, one line, nothing written)."""
    src_h5, mid = tmp_path / "zeros.h5", tmp_path / "zeros.safetensors"
    with h5py.File(src_h5, "w") as f:
        f.attrs["n"] = 1
        f.create_dataset("z", data=np.zeros(100 * 1024, np.float32))
    assert clipcli("convert", src_h5, mid).returncode == 0

    def compress(record: Record) -> None:
        _node(record, "/z").update(layout="chunked", chunks=[1024], filters=[[1, 0, [9]]])

    src = _forge(mid, tmp_path / "forged.safetensors", compress)
    monkeypatch.setattr(limits, "FREE_CHUNKS", 0)
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    assert run.returncode == 3, run
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"clipcli: error: {src}: ")
    assert "would refuse to read back (OUT: datasets declare more than 2 HDF5 chunks" in run.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["zeros.h5", "zeros.safetensors", "forged.safetensors"]
    )
