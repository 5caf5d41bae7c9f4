"""The HDF5 structure record is input (issue 18 item 2): it may only describe what the
tensors already are. A tensor's dataset type is the tensor's own (either byte order), a
filter is one known to be lossless, and the chunks stay within the reader's chunk budget.

A record that disagrees with the tensors (a type, a shape, the set of names) is one that
describes other tensors (stale after an edit, or forged): like before, it is a structure
OUT cannot hold, refused with exit 2 unless --allow-lossy, which then writes the plain
layout with one warning; it never decides a value. A record asking for what no tensor
could be written with (a lossy or unknown filter, chunking over the budget) is malformed:
exit 3, one line, nothing written.

References: h5py reads OUT back; values are compared bit for bit with numpy.
"""

from __future__ import annotations

import functools
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
from safetensors.numpy import save_file

from clipcli.formats.hdf5 import limits
from clipcli.formats.hdf5.portable import Malformed, build_type, describe_type

STRUCTURE_KEY = "clipcli.hdf5_structure"
Cli = Callable[..., Run]


def _record(tensors: dict[str, np.ndarray], **datasets: dict[str, Any]) -> dict[str, Any]:
    """A structure record as clipcli writes it for plain datasets of these tensors, each
    node then updated with the fields given for it."""
    nodes: list[dict[str, Any]] = [
        {"path": "/", "kind": "group", "cset": 0, "links": 0, "attr_order": 0, "attrs": []}
    ]
    for name, array in tensors.items():
        shape = list(array.shape)
        node = {
            "path": "/" + name,
            "kind": "dataset",
            "cset": 0,
            "type": describe_type(h5py.h5t.py_create(array.dtype)),
            "space": (
                {"class": "simple", "shape": shape, "maxshape": shape}
                if shape
                else {"class": "scalar"}
            ),
            "layout": "contiguous",
            "chunks": None,
            "filters": [],
            "fill": None,
            "fill_time": 2,
            "alloc_time": 2,
            "attr_order": 0,
            "track_times": False,
            "tensor": True,
            "attrs": [],
        }
        node.update(datasets.get(name, {}))
        nodes.append(node)
    return {"format": STRUCTURE_KEY, "version": 1, "nodes": nodes}


def _forged(tmp_path: Path, tensors: dict[str, np.ndarray], record: dict[str, Any]) -> Path:
    path = tmp_path / "forged.safetensors"
    save_file(tensors, str(path), metadata={STRUCTURE_KEY: json.dumps(record)})
    return path


def _int_type(size: int, signed: bool, order: str = "<") -> dict[str, Any]:
    return {"class": "int", "size": size, "order": order, "signed": signed}


def _float_type(size: int, order: str = "<") -> dict[str, Any]:
    return {"class": "float", "size": size, "order": order}


def _compound(*members: tuple[str, int, dict[str, Any]], size: int) -> dict[str, Any]:
    fields = [{"name": n, "offset": o, "type": t} for n, o, t in members]
    return {"class": "compound", "size": size, "members": fields}


COMPLEX = (np.array([1.5 + 2.25j, -3.5 - 0.5j], np.complex64),)
LYING_TYPES: dict[str, tuple[np.ndarray, dict[str, Any]]] = {
    # Each once wrote other values than the tensor's (or failed with exit 70).
    "uint32_declared_int32": (np.array([2**32 - 1, 7], np.uint32), _int_type(4, True)),
    "complex64_declared_int_compound": (
        COMPLEX[0],
        _compound(("r", 0, _int_type(4, True)), ("i", 4, _int_type(4, True)), size=8),
    ),
    "bool_declared_enum_5_7": (
        np.array([True, False]),
        {"class": "enum", "base": _int_type(1, True), "members": [["FALSE", 5], ["TRUE", 7]]},
    ),
    "complex64_members_re_im": (
        COMPLEX[0],
        _compound(("re", 0, _float_type(4)), ("im", 4, _float_type(4)), size=8),
    ),
    "float32_declared_float16_pair": (
        np.array([1.0, 2.0], np.float32),
        _compound(("a", 0, _float_type(2)), ("b", 2, _float_type(2)), size=4),
    ),
    "float64_declared_int64": (np.array([0.5], np.float64), _int_type(8, True)),
    "int8_declared_uint8": (np.array([-1], np.int8), _int_type(1, False)),
    "complex_mixed_byte_orders": (
        COMPLEX[0],
        _compound(("r", 0, _float_type(4, "<")), ("i", 4, _float_type(4, ">")), size=8),
    ),
}


@pytest.mark.parametrize("case", sorted(LYING_TYPES))
def test_a_record_declaring_another_type_never_decides_a_value(
    clipcli: Cli, tmp_path: Path, case: str
) -> None:
    """Refused (exit 2, one line, nothing written); with --allow-lossy the record is
    ignored with one warning and the tensor is written as what it is."""
    array, declared = LYING_TYPES[case]
    tensors = {"t": array}
    src = _forged(tmp_path, tensors, _record(tensors, t={"type": declared}))
    out = tmp_path / "out.h5"
    for command in (["convert"], ["clip", "--norm", "1e9"]):
        run = clipcli(*command, src, out)
        assert run.returncode == 2, (case, run)
        assert run.stderr.count("\n") == 1, run.stderr
        assert "dataset 't'" in run.stderr
        assert not out.exists()
    run = clipcli("convert", "--allow-lossy", src, out)
    assert run.returncode == 0, run
    assert [line.split(":")[1] for line in run.stderr.splitlines()] == [" warning"]
    with h5py.File(out, "r") as f:
        assert f["t"].dtype == array.dtype
        assert f["t"][()].tobytes() == array.tobytes()


def test_a_record_with_a_scalar_declared_null_is_refused(clipcli: Cli, tmp_path: Path) -> None:
    tensors = {"s": np.array(2.5, np.float32)}
    src = _forged(tmp_path, tensors, _record(tensors, s={"space": {"class": "null"}}))
    run = clipcli("convert", src, tmp_path / "out.h5")
    assert run.returncode == 2, run
    assert "another shape" in run.stderr


ALLOWED_TYPES: dict[str, tuple[np.ndarray, dict[str, Any]]] = {
    "float32_big_endian": (np.array([1.5, -2.0e-40, np.inf], np.float32), _float_type(4, ">")),
    "uint64_big_endian": (np.array([2**64 - 1, 3], np.uint64), _int_type(8, False, ">")),
    "complex64_big_endian": (
        np.array([3e38 - 2j, 1e-45j], np.complex64),
        _compound(("r", 0, _float_type(4, ">")), ("i", 4, _float_type(4, ">")), size=8),
    ),
    "bool_enum_over_unsigned_byte_in_reverse": (
        np.array([True, False, True]),
        {"class": "enum", "base": _int_type(1, False), "members": [["TRUE", 1], ["FALSE", 0]]},
    ),
}


@pytest.mark.parametrize("case", sorted(ALLOWED_TYPES))
def test_a_record_of_the_tensors_own_type_is_written_exactly(
    clipcli: Cli, tmp_path: Path, case: str
) -> None:
    """The tensor's own type in the other byte order (or h5py's other bool enum) is what
    a real HDF5 file can hold: written as recorded, every value converted exactly."""
    array, declared = ALLOWED_TYPES[case]
    tensors = {"t": array}
    src = _forged(tmp_path, tensors, _record(tensors, t={"type": declared}))
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    assert run.returncode == 0, run
    assert run.stderr == ""
    with h5py.File(out, "r") as f:
        assert describe_type(f["t"].id.get_type()) == declared
        read = f["t"][()]
    assert read.dtype == array.dtype.newbyteorder(read.dtype.byteorder)
    assert read.astype(array.dtype).tobytes() == array.tobytes()


# ------------------------------------------------------------------ filters


LOSSY_FILTERS: dict[str, tuple[np.ndarray, list[Any]]] = {
    "float_scale_offset": (np.linspace(0, 10, 64, dtype=np.float32), [6, 1, [0, 2]]),
    "int_scale_offset_3_bits": (np.arange(64, dtype=np.int32), [6, 1, [2, 3]]),
    "int_scale_offset_float_scaling": (np.arange(64, dtype=np.int32), [6, 1, [0, 0]]),
    "unknown_plugin_filter": (np.ones(64, np.float32), [32013, 0, []]),
    "zfp_lossy_plugin": (np.ones(64, np.float32), [32013, 1, [3, 0, 0, 0, 0]]),
}


@pytest.mark.parametrize("case", sorted(LOSSY_FILTERS))
def test_a_record_asking_for_a_lossy_filter_is_malformed(
    clipcli: Cli, tmp_path: Path, case: str
) -> None:
    """Even `clip --norm 1e9`, where nothing is over the limit, once changed every value
    through scale-offset: now exit 3, one line, nothing written, with or without
    --allow-lossy."""
    array, entry = LOSSY_FILTERS[case]
    tensors = {"t": array}
    fields = {"layout": "chunked", "chunks": [16], "filters": [entry]}
    src = _forged(tmp_path, tensors, _record(tensors, t=fields))
    out = tmp_path / "out.h5"
    for command in (
        ["convert"],
        ["convert", "--allow-lossy"],
        ["clip", "--norm", "1e9"],
        ["clip", "--allow-lossy", "--norm", "1e9"],
    ):
        run = clipcli(*command, src, out)
        assert run.returncode == 3, (command, run)
        assert run.stderr.count("\n") == 1, run.stderr
        assert "malformed" in run.stderr
        assert not out.exists()


LOSSLESS_FILTERS: dict[str, tuple[np.ndarray, list[list[Any]]]] = {
    "gzip_shuffle_fletcher32": (
        np.linspace(-1, 1, 64, dtype=np.float32),
        [[2, 1, [4]], [1, 1, [6]], [3, 0, []]],
    ),
    "lzf": (np.arange(64, dtype=np.int16), [[32000, 1, []]]),
    "int_scale_offset_minimum_bits_by_the_library": (
        np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, 0, -1] * 16, np.int32),
        [[6, 1, [2, 0]]],
    ),
    "nbit": (np.linspace(-1e30, 1e30, 64, dtype=np.float32), [[5, 0, []]]),
}


@pytest.mark.parametrize("case", sorted(LOSSLESS_FILTERS))
def test_a_record_with_lossless_filters_is_written_exactly(
    clipcli: Cli, tmp_path: Path, case: str
) -> None:
    array, filters = LOSSLESS_FILTERS[case]
    tensors = {"t": array}
    fields = {"layout": "chunked", "chunks": [16], "filters": filters}
    src = _forged(tmp_path, tensors, _record(tensors, t=fields))
    out = tmp_path / "out.h5"
    run = clipcli("clip", "--norm", "1e38", src, out)
    assert run.returncode == 0, run
    with h5py.File(out, "r") as f:
        plist = f["t"].id.get_create_plist()
        codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert codes == [entry[0] for entry in filters]
        assert f["t"][()].tobytes() == array.tobytes()


# ------------------------------------------------------------------ chunks


def test_chunking_by_one_element_is_refused_before_anything_is_written(
    clipcli: Cli, tmp_path: Path
) -> None:
    """The issue's case: 800 KB chunked by one element (200,000 chunks) once cost 1.3 GB."""
    tensors = {"t": np.ones(200_000, np.float32)}
    fields = {"layout": "chunked", "chunks": [1], "space": _space(200_000, None)}
    src = _forged(tmp_path, tensors, _record(tensors, t=fields))
    run = clipcli("convert", "--allow-lossy", src, tmp_path / "out.h5")
    assert run.returncode == 3, run
    assert "chunks in all" in run.stderr
    assert run.stderr.count("\n") == 1
    assert not (tmp_path / "out.h5").exists()


def _space(size: int, top: int | None) -> dict[str, Any]:
    return {"class": "simple", "shape": [size], "maxshape": [top]}


@pytest.mark.parametrize("over", [0, 1])
def test_record_chunk_budget_exactly_at_the_limit(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    """Two tensors of 4,000 bytes in 100 and 39 chunks (the last one partial): 139 chunks
    for 8,000 bytes. With one chunk per 100 bytes and 59 free, the budget is exactly 139;
    one less refuses."""
    tensors: dict[str, np.ndarray] = {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.ones(500, np.float64),
    }
    record = _record(
        tensors,
        a={"layout": "chunked", "chunks": [10], "space": _space(1000, 1000)},
        b={"layout": "chunked", "chunks": [13], "space": _space(500, None)},
    )
    src = _forged(tmp_path, tensors, record)
    monkeypatch.setattr(limits, "BYTES_PER_CHUNK", 100)
    monkeypatch.setattr(limits, "FREE_CHUNKS", 59 - over)
    out = tmp_path / "out.h5"
    run = clipcli("convert", src, out)
    if over:
        assert run.returncode == 3, run
        assert "139 HDF5 chunks in all" in run.stderr
        assert not out.exists()
        return
    assert run.returncode == 0, run
    with h5py.File(out, "r") as f:
        assert (f["a"].chunks, f["b"].chunks, f["b"].maxshape) == ((10,), (13,), (None,))
        for name, array in tensors.items():
            assert f[name][()].tobytes() == array.tobytes()


# ------------------------------------------------------------------ every field, forged


_DTYPES = ["?", "i1", "u1", "<i2", ">u2", "<i4", "<u4", "<i8", ">u8"]
_DTYPES += ["<f2", ">f4", "<f8", "<c8", ">c16"]


def _values(dtype: np.dtype[Any]) -> np.ndarray:
    """Values that tell every type apart: extremes, signs, fractions."""
    if dtype.kind == "b":
        return np.array([True, False, True])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, info.max, 0, 1, info.max // 3], dtype)
    finite = np.finfo(dtype.char.lower() if dtype.kind == "c" else dtype)
    real = np.array([finite.max, -finite.tiny, 0.5, -1.25, finite.eps], dtype=finite.dtype)
    return (real + 1j * real[::-1]).astype(dtype) if dtype.kind == "c" else real.astype(dtype)


def _mutations(desc: Any) -> st.SearchStrategy[Any]:
    """The description with one field forged (any field, at any depth)."""
    if isinstance(desc, dict):
        options: list[st.SearchStrategy[Any]] = [st.just(desc)]
        for key, value in desc.items():
            replaced = st.one_of(
                _mutations(value),
                st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 16, -1, True, "<", ">", "r", "re"]),
            )
            options.append(replaced.map(functools.partial(_with_field, desc, key)))
        return st.one_of(options)
    if isinstance(desc, list):
        if not desc:
            return st.just(desc)
        return st.one_of(
            st.just(desc),
            st.just(desc[::-1]),
            st.integers(0, len(desc) - 1).flatmap(
                lambda i: _mutations(desc[i]).map(lambda new: [*desc[:i], new, *desc[i + 1 :]])
            ),
        )
    return st.just(desc)


def _with_field(desc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**desc, key: value}


@st.composite
def _forged_types(draw: st.DrawFn) -> tuple[np.dtype[Any], Any]:
    tensor = np.dtype(draw(st.sampled_from(_DTYPES)))
    base = np.dtype(draw(st.sampled_from([tensor.str, *_DTYPES])))
    return tensor, draw(_mutations(describe_type(h5py.h5t.py_create(base))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_forged_types())
def test_a_declared_type_is_accepted_only_where_every_value_comes_back(
    case: tuple[np.dtype[Any], Any],
) -> None:
    """Against h5py: whatever a record declares, a type the check accepts is one that
    writes the tensor's values and reads them back, bit for bit, as a tensor of its dtype
    (modulo byte order). And the tensor's own type, in both byte orders, is accepted."""
    from clipcli.formats.hdf5.record_check import tensor_type_problem

    dtype, declared = case
    try:
        type_id = build_type(declared)
    except Malformed:
        return  # refused as malformed (exit 3) before any check of fit
    for order in ("<", ">"):
        own = describe_type(h5py.h5t.py_create(dtype.newbyteorder(order)))
        assert tensor_type_problem(own, dtype) is None
    if tensor_type_problem(declared, dtype) is not None:
        return
    values = _values(dtype)
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        space = h5py.h5s.create_simple(values.shape)
        h5py.h5d.create(f.id, b"t", type_id, space)
        f["t"][...] = values
        read = f["t"][()]
    assert read.dtype == dtype.newbyteorder(read.dtype.byteorder), declared
    assert read.astype(dtype).tobytes() == values.tobytes(), declared


DATASET_FIELDS: dict[str, list[Any]] = {
    "cset": [0, 1, 2, True],
    "space": [
        {"class": "simple", "shape": [8], "maxshape": [None]},
        {"class": "simple", "shape": [4], "maxshape": [4]},
        {"class": "simple", "shape": [8, 1], "maxshape": [8, 1]},
        {"class": "scalar"},
        {"class": "null"},
    ],
    "layout": ["compact", "contiguous", "chunked", "virtual"],
    "chunks": [None, [1], [4], [8], [9], [0], [2, 2]],
    "filters": [[], [[1, 1, [9]]], [[6, 1, [0, 2]]], [[6, 1, [2, 0]]], [[32013, 0, []]]],
    "fill": [None, "AADAPw==", "AAAAAAAA8D8=", "AA=="],
    "fill_time": [0, 1, 2, 3],
    "alloc_time": [0, 1, 2, 3, 4],
    "attr_order": [0, 1, 3, 2],
    "track_times": [False, True, 1],
    "tensor": [True, False],
    "data": [None, {"raw": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}],
    "kind": ["dataset", "group", "datatype"],
    "path": ["/t", "/u"],
}


def _refused_or_exact(clipcli: Cli, tmp_path: Path, fields: dict[str, Any]) -> None:
    """The run refuses in one line (2: the record is not these tensors', 3: malformed)
    and writes nothing, or OUT holds exactly the tensor's values (h5py reads them back)."""
    array = np.linspace(-3, 5, 8, dtype=np.float32)
    tensors = {"t": array}
    stored = {"layout": "chunked", "chunks": [4], "filters": [[1, 1, [4]]]}  # as recorded
    src = _forged(tmp_path, tensors, _record(tensors, t={**stored, **fields}))
    out = tmp_path / "out.h5"
    run = clipcli("clip", "--norm", "1e9", src, out)
    assert run.returncode in (0, 2, 3), (fields, run)
    if run.returncode:
        assert run.stderr.count("\n") == 1, (fields, run)
        assert not out.exists()
        return
    with h5py.File(out, "r") as f:
        assert f["t"][()].tobytes() == array.tobytes(), fields


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in DATASET_FIELDS.items() for value in values],
    ids=lambda item: json.dumps(item)[:40] if not isinstance(item, str) else item,
)
def test_every_dataset_field_forged_is_refused_or_changes_no_value(
    clipcli: Cli, tmp_path: Path, field: str, value: Any
) -> None:
    _refused_or_exact(clipcli, tmp_path, {field: value})


# clipcli (main() in this process) reads capsys afresh on each run: safe to share.
_SHARED_FIXTURES = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=60, deadline=None, suppress_health_check=_SHARED_FIXTURES)
@given(st.dictionaries(st.sampled_from(sorted(DATASET_FIELDS)), st.integers(0, 6), max_size=3))
def test_any_forged_dataset_fields_are_refused_or_change_no_value(
    clipcli: Cli, tmp_path_factory: pytest.TempPathFactory, picks: dict[str, int]
) -> None:
    """Up to three fields of a tensor's node forged at once."""
    fields = {k: DATASET_FIELDS[k][i % len(DATASET_FIELDS[k])] for k, i in picks.items()}
    _refused_or_exact(clipcli, tmp_path_factory.mktemp("forged"), fields)
