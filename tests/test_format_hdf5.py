"""HDF5 reader and structure-preserving writer: files are generated in tmp_path with h5py."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.errors import InputError, WriteError
from clipcli.formats.base import Checkpoint, Reader, TensorInfo
from clipcli.formats.hdf5 import Hdf5Reader, Hdf5Writer, flat_range_blocks
from clipcli.jobs.pipeline import write_tensors

RNG = np.random.default_rng(1234)

# ---------------------------------------------------------------------------------------
# flat_range_blocks


@st.composite
def shapes_and_ranges(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    stop = draw(st.integers(start, numel))
    return shape, start, stop


@given(shapes_and_ranges())
@settings(max_examples=500, deadline=None)
def test_flat_range_blocks_cover_the_range_in_order(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = case
    array = np.arange(math.prod(shape)).reshape(shape)
    blocks = list(flat_range_blocks(shape, start, stop))
    pieces = [array[block].reshape(-1) for block in blocks]
    flat = np.concatenate(pieces) if pieces else np.empty(0, dtype=array.dtype)
    np.testing.assert_array_equal(flat, np.arange(start, stop))
    assert all(len(block) == len(shape) for block in blocks)
    assert all(array[block].size > 0 for block in blocks)
    assert len(blocks) <= 2 * len(shape) + 1
    assert len(blocks) <= max(1, 2 * len(shape) - 1)  # the tighter bound the code promises


def test_flat_range_blocks_rejects_ranges_outside_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"range \[4, 7\) is not inside a tensor of 6 elements"):
        flat_range_blocks((2, 3), 4, 7)
    with pytest.raises(ValueError, match=r"range \[3, 2\) is not inside a tensor of 6 elements"):
        flat_range_blocks((2, 3), 3, 2)


# ---------------------------------------------------------------------------------------
# Comparing two files: every group, link, attribute, dataset property and byte of data


def assert_same_attrs(a: Any, b: Any) -> None:
    where = a.name
    assert list(a.attrs) == list(b.attrs), where
    for name in a.attrs:
        ida, idb = a.attrs.get_id(name), b.attrs.get_id(name)
        assert ida.get_type() == idb.get_type(), (where, name)  # H5Tequal: exact HDF5 type
        assert ida.dtype == idb.dtype, (where, name)
        assert ida.shape == idb.shape, (where, name)
        va, vb = a.attrs[name], b.attrs[name]
        assert type(va) is type(vb), (where, name)
        if isinstance(va, h5py.Empty):
            assert va.dtype == vb.dtype
        elif np.asarray(va).dtype.kind == "O":
            assert np.asarray(va).tolist() == np.asarray(vb).tolist(), (where, name)
        else:
            assert np.asarray(va).tobytes() == np.asarray(vb).tobytes(), (where, name)


def dataset_properties(d: Any) -> dict[str, Any]:
    plist = d.id.get_create_plist()
    return {
        "dtype": d.dtype,
        "shape": d.shape,
        "maxshape": d.maxshape,
        "chunks": d.chunks,
        "compression": d.compression,
        "compression_opts": d.compression_opts,
        "shuffle": d.shuffle,
        "fletcher32": d.fletcher32,
        "scaleoffset": d.scaleoffset,
        "fillvalue": np.asarray(d.fillvalue).tobytes(),
        "layout": plist.get_layout(),
        "filters": [plist.get_filter(i) for i in range(plist.get_nfilters())],
        "attr_order": plist.get_attr_creation_order(),
    }


def assert_same_dataset(a: Any, b: Any) -> None:
    assert dataset_properties(a) == dataset_properties(b), a.name
    assert a.id.get_type() == b.id.get_type(), a.name
    if a.shape is None:  # an empty dataspace holds nothing
        assert b.shape is None, a.name
        return
    da, db = np.asarray(a[()]), np.asarray(b[()])
    assert da.dtype == db.dtype, a.name
    assert da.shape == db.shape, a.name
    if da.dtype.kind == "O":  # variable-length values: compare them, not their pointers
        assert _nested(da.tolist()) == _nested(db.tolist()), a.name
    else:
        assert da.tobytes() == db.tobytes(), a.name


def _nested(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tobytes())
    if isinstance(value, list):
        return [_nested(v) for v in value]
    return value


def assert_same_group(a: Any, b: Any) -> None:
    ga, gb = a.id.get_create_plist(), b.id.get_create_plist()
    assert ga.get_link_creation_order() == gb.get_link_creation_order(), a.name
    assert ga.get_attr_creation_order() == gb.get_attr_creation_order(), a.name
    assert list(a) == list(b), a.name  # same members in the same order
    assert_same_attrs(a, b)
    for name in a:
        link = name.encode()
        assert a.id.links.get_info(link).cset == b.id.links.get_info(link).cset, (a.name, name)
        assert type(a.get(name, getlink=True)) is type(b.get(name, getlink=True))
        x, y = a[name], b[name]
        assert type(x) is type(y), x.name
        if isinstance(x, h5py.Group):
            assert_same_group(x, y)
        elif isinstance(x, h5py.Dataset):
            assert_same_dataset(x, y)
            assert_same_attrs(x, y)
        else:
            assert x.id == y.id, x.name
            assert_same_attrs(x, y)


def assert_same_file(expected: Path, actual: Path) -> None:
    with h5py.File(expected, "r") as a, h5py.File(actual, "r") as b:
        assert_same_group(a["/"], b["/"])


def copy_checkpoint(
    src: Path, out: Path, chunk_elems: int | None = None, raw: bool = False
) -> None:
    """Through clipcli's one write loop: every tensor streamed (or, raw, copied as it is)."""
    with Hdf5Reader(src) as reader:
        writer = Hdf5Writer(out, Checkpoint(list(reader.infos), dict(reader.metadata), reader))
        write_tensors(
            reader, writer, lambda info: None if raw else reader.chunks(info, chunk_elems)
        )


# ---------------------------------------------------------------------------------------
# Fixture files


def make_mixed(path: Path) -> None:
    """Nested groups (creation-ordered and not), many dtypes and storage settings."""
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs["zeta_first"] = "creation order, not name order"
        f.attrs["count"] = np.int64(3)
        f.attrs["names"] = np.array([b"one", b"three"])
        f.attrs["nothing"] = h5py.Empty("f4")
        f.attrs.create("fixed_utf8", "h\u00e9".encode(), dtype=h5py.string_dtype("utf-8", 8))
        f.attrs["vlen_list"] = ["a", "bb"]
        f.attrs["complex"] = np.array([1 + 2j, 3 - 4j])
        f.attrs["flag"] = np.bool_(True)
        f.attrs["matrix"] = np.arange(6, dtype=">i4").reshape(2, 3)

        model = f.create_group("model", track_order=True)
        model.attrs["b"] = 1
        model.attrs["a"] = 2
        later = model.create_group("z_layer", track_order=True)
        model.create_group("a_layer")  # name-ordered inside
        f.create_group("empty").create_group("deeper")
        utf8_link = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        utf8_link.set_char_encoding(h5py.h5t.CSET_UTF8)  # h5py itself marks names ASCII
        h5py.h5g.create(f["empty"].id, "gr\u00fc\u00dfe".encode(), lcpl=utf8_link)

        later.create_dataset("f16", data=RNG.standard_normal((4, 5)).astype(np.float16))
        later.create_dataset("f32", data=RNG.standard_normal((3, 7)).astype(np.float32))
        later.create_dataset("f64", data=RNG.standard_normal(11))
        d = later["f64"]
        d.attrs["role"] = "bias"
        a = model["a_layer"]
        a.create_dataset("i32", data=RNG.integers(-1000, 1000, (5, 2), dtype=np.int32))
        a.create_dataset("u8", data=RNG.integers(0, 255, 9, dtype=np.uint8))
        a.create_dataset("bool", data=RNG.integers(0, 2, (2, 3)).astype(bool))
        a.create_dataset("c64", data=(RNG.standard_normal(4) + 1j).astype(np.complex64))
        a.create_dataset("big_f4", data=RNG.standard_normal((2, 3)).astype(">f4"))
        a.create_dataset("big_i8", data=np.arange(5, dtype=">i8"))
        f.create_dataset("scalar", data=np.float64(2.5))
        f.create_dataset("empty_1d", shape=(0,), dtype="f4")
        f.create_dataset("empty_2d", shape=(3, 0), maxshape=(None, None), dtype="f4", chunks=(2, 2))
        f.create_dataset(
            "gzip",
            data=RNG.standard_normal((50, 37)).astype(np.float32),
            chunks=(7, 5),
            compression="gzip",
            compression_opts=6,
            shuffle=True,
            fletcher32=True,
        )
        f.create_dataset(
            "lzf", data=np.arange(300, dtype=np.int16), chunks=(64,), compression="lzf"
        )
        f.create_dataset(
            "scaled", data=np.arange(200, dtype=np.int32) * 3, scaleoffset=0, chunks=(50,)
        )
        f.create_dataset(
            "resizable", data=np.ones((4, 10)), maxshape=(None, 10), chunks=(2, 10), fillvalue=-1.0
        )
        compact = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        compact.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple((6,))
        h5py.h5d.create(f.id, b"compact", h5py.h5t.STD_I16LE, space, dcpl=compact)
        f["compact"][...] = np.arange(6)
        f["named_type"] = np.dtype("<f4")
        f["named_type"].attrs["about"] = "a committed datatype"
        typed = f.create_dataset("typed", data=np.arange(3.0), dtype=f["named_type"])
        ordered = later.create_dataset("poids_\u00e9", data=np.ones(2), track_order=True)
        ordered.attrs["z"] = 1  # a UTF-8 link name, attributes in creation order
        ordered.attrs["a"] = 2
        typed.attrs["unit"] = np.bytes_(b"m/s")


def make_keras3(path: Path) -> None:
    """The layout Keras 3 writes to model.weights.h5."""
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = "3.4.1"
        f.attrs["date_saved"] = "2024-07-01@12:00:00"
        layers = f.create_group("layers")
        for name, shapes in {"dense": [(8, 16), (16,)], "dense_1": [(16, 2), (2,)]}.items():
            group = layers.create_group(name)
            variables = group.create_group("vars")
            for index, shape in enumerate(shapes):
                variables.create_dataset(str(index), data=RNG.standard_normal(shape).astype("f4"))
        layers.create_group("dropout").create_group("vars")  # a layer without weights
        optimizer = f.create_group("optimizer")
        opt_vars = optimizer.create_group("vars")
        opt_vars.create_dataset("0", data=np.int64(10))
        opt_vars.create_dataset("1", data=np.zeros((8, 16), "f4"))
        f.create_group("vars")


def make_keras_legacy(path: Path) -> None:
    """The layout tf.keras 2 writes to model.h5 (save with include_optimizer=True)."""
    layers = {
        "dense": {"kernel:0": (8, 16), "bias:0": (16,)},
        "dense_1": {"kernel:0": (16, 2), "bias:0": (2,)},
        "flatten": {},
    }
    with h5py.File(path, "w") as f:
        # h5py 2 (which tf.keras used) stored bytes as fixed-length strings; np.bytes_ still does.
        f.attrs["backend"] = np.bytes_(b"tensorflow")
        f.attrs["keras_version"] = np.bytes_(b"2.15.0")
        config = {"class_name": "Sequential", "config": {"name": "sequential", "layers": []}}
        f.attrs["model_config"] = np.bytes_(json.dumps(config).encode("utf-8"))
        f.attrs["training_config"] = json.dumps({"loss": "mse"})  # a variable-length str
        weights = f.create_group("model_weights")
        weights.attrs["layer_names"] = np.array([name.encode() for name in layers])
        weights.attrs["backend"] = np.bytes_(b"tensorflow")
        weights.attrs["keras_version"] = np.bytes_(b"2.15.0")
        for layer, variables in layers.items():
            group = weights.create_group(layer)
            names = [f"{layer}/{var}".encode() for var in variables]
            group.attrs["weight_names"] = np.array(names, dtype="S") if names else np.array([])
            inner = group.create_group(layer) if variables else None
            for var, shape in variables.items():
                assert inner is not None
                inner.create_dataset(var, data=RNG.standard_normal(shape).astype("f4"))
        optimizer = f.create_group("optimizer_weights")
        opt_names = [b"Adam/iter:0", b"Adam/dense/kernel/m:0", b"Adam/dense/kernel/v:0"]
        optimizer.attrs["weight_names"] = np.array(opt_names)
        adam = optimizer.create_group("Adam")
        adam.create_dataset("iter:0", data=np.int64(100))
        kernel = adam.create_group("dense").create_group("kernel")
        kernel.create_dataset("m:0", data=np.zeros((8, 16), "f4"))
        kernel.create_dataset("v:0", data=np.full((8, 16), 1e-3, "f4"))


# ---------------------------------------------------------------------------------------
# Reading


def test_lists_datasets_in_link_order_with_dtypes_and_shapes(tmp_path: Path) -> None:
    path = tmp_path / "mixed.h5"
    make_mixed(path)
    with Hdf5Reader(path) as reader:
        names = [info.name for info in reader.infos]
        assert names == [
            "model/z_layer/f16",
            "model/z_layer/f32",
            "model/z_layer/f64",
            "model/z_layer/poids_\u00e9",
            "model/a_layer/big_f4",
            "model/a_layer/big_i8",
            "model/a_layer/bool",
            "model/a_layer/c64",
            "model/a_layer/i32",
            "model/a_layer/u8",
            "scalar",
            "empty_1d",
            "empty_2d",
            "gzip",
            "lzf",
            "scaled",
            "resizable",
            "compact",
            "typed",
        ]
        infos = {info.name: info for info in reader.infos}
        assert infos["model/a_layer/big_f4"].dtype == np.dtype(">f4")
        assert infos["scalar"].shape == ()
        assert infos["empty_2d"].shape == (3, 0)
        assert infos["gzip"].nbytes == 50 * 37 * 4
        with h5py.File(path, "r") as f:
            for info in reader.infos:
                expected = np.asarray(f[info.name][()])
                got = reader.read(info)
                assert got.dtype == expected.dtype
                assert got.shape == expected.shape
                assert got.tobytes() == expected.tobytes()
                for chunk_elems in (1, 3, 7, 1000):
                    pieces = list(reader.chunks(info, chunk_elems))
                    assert all(p.ndim == 1 and 0 < p.size <= chunk_elems for p in pieces)
                    assert all(p.dtype == info.dtype for p in pieces)  # byte order kept
                    flat = b"".join(p.tobytes() for p in pieces)
                    assert flat == expected.tobytes(), (info.name, chunk_elems)


def test_chunks_are_aligned_to_whole_rows(tmp_path: Path) -> None:
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.arange(1000.0).reshape(10, 100))
    with Hdf5Reader(path) as reader:
        sizes = [piece.size for piece in reader.chunks(reader.infos[0], 250)]
    assert sizes == [200] * 5


@given(
    shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple),
    chunk_elems=st.integers(1, 50),
    chunked=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_chunks_reassemble_any_shape(
    shape: tuple[int, ...], chunk_elems: int, chunked: bool
) -> None:
    data = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.h5"
        with h5py.File(path, "w") as f:
            options = {"chunks": True, "compression": "gzip"} if chunked and shape else {}
            f.create_dataset("t", data=data, **options)
        with Hdf5Reader(path) as reader:
            flat = np.concatenate(list(reader.chunks(reader.infos[0], chunk_elems)))
    np.testing.assert_array_equal(flat, data.reshape(-1))


def test_metadata_is_root_string_attributes(tmp_path: Path) -> None:
    path = tmp_path / "meta.h5"
    with h5py.File(path, "w") as f:
        f.attrs["text"] = "hello"
        f.attrs["utf8_bytes"] = "caf\u00e9".encode()
        f.attrs["not_utf8"] = np.bytes_(b"\xff\xfe")
        f.attrs["number"] = 3
        f.attrs["list"] = np.array([b"a", b"b"])
        f.create_group("g").attrs["nested"] = "ignored"
    with Hdf5Reader(path) as reader:
        assert dict(reader.metadata) == {"text": "hello", "utf8_bytes": "caf\u00e9"}
        assert reader.infos == []


def test_reader_does_not_import_h5py_until_used_and_disables_plugins() -> None:
    script = (
        "import os, sys\n"
        "os.environ.pop('HDF5_PLUGIN_PRELOAD', None)\n"
        "import clipcli.formats.hdf5 as m\n"
        "assert 'h5py' not in sys.modules\n"
        "h5py = m.load_h5py()\n"
        "assert os.environ['HDF5_PLUGIN_PRELOAD'] == '::'\n"
        "assert h5py.h5pl.size() == 0\n"
        "print('ok')\n"
    )
    env = dict(os.environ, HDF5_PLUGIN_PATH="/nonexistent/plugins")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------
# Round trips


def test_round_trip_preserves_structure_attributes_and_data(tmp_path: Path) -> None:
    src, out = tmp_path / "mixed.h5", tmp_path / "out.h5"
    make_mixed(src)
    copy_checkpoint(src, out)
    assert_same_file(src, out)


def test_round_trip_with_tiny_chunks_and_raw_chunk_copy(tmp_path: Path) -> None:
    src = tmp_path / "mixed.h5"
    make_mixed(src)
    copy_checkpoint(src, tmp_path / "tiny.h5", chunk_elems=3)
    assert_same_file(src, tmp_path / "tiny.h5")
    copy_checkpoint(src, tmp_path / "raw.h5", raw=True)
    assert_same_file(src, tmp_path / "raw.h5")


def test_keras3_weights_round_trip(tmp_path: Path) -> None:
    src, out = tmp_path / "model.weights.h5", tmp_path / "out.weights.h5"
    make_keras3(src)
    with Hdf5Reader(src) as reader:
        assert [info.name for info in reader.infos] == [
            "layers/dense/vars/0",
            "layers/dense/vars/1",
            "layers/dense_1/vars/0",
            "layers/dense_1/vars/1",
            "optimizer/vars/0",
            "optimizer/vars/1",
        ]
        assert reader.metadata["keras_version"] == "3.4.1"
    copy_checkpoint(src, out)
    assert_same_file(src, out)


def test_legacy_keras_round_trip_keeps_fixed_length_name_lists(tmp_path: Path) -> None:
    src, out = tmp_path / "model.h5", tmp_path / "out.h5"
    make_keras_legacy(src)
    with Hdf5Reader(src) as reader:
        assert "model_weights/dense/dense/kernel:0" in [info.name for info in reader.infos]
        assert reader.metadata["backend"] == "tensorflow"
        assert json.loads(reader.metadata["model_config"])["class_name"] == "Sequential"
    copy_checkpoint(src, out)
    assert_same_file(src, out)
    with h5py.File(out, "r") as f:
        names = f["model_weights"].attrs["layer_names"]
        assert names.dtype == np.dtype("S7")
        assert names.tolist() == [b"dense", b"dense_1", b"flatten"]
        weight_names = f["model_weights/dense"].attrs["weight_names"]
        assert weight_names.tolist() == [b"dense/kernel:0", b"dense/bias:0"]
        assert f.attrs.get_id("backend").dtype == np.dtype("S10")  # still fixed-length
        assert f.attrs["backend"] == b"tensorflow"
        assert "optimizer_weights/Adam/dense/kernel/m:0" in f


class ListReader(Reader):
    """A non-HDF5 source: tensors held in memory."""

    format_name = "memory"

    def __init__(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
        super().__init__(Path("memory"))
        self._tensors = dict(tensors)
        self._metadata = dict(metadata)

    @property
    def infos(self) -> list[TensorInfo]:
        return [TensorInfo(n, a.dtype, a.shape, a.nbytes) for n, a in self._tensors.items()]

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        flat = self._tensors[info.name].reshape(-1)
        step = chunk_elems or 4
        for start in range(0, flat.size, step):
            yield flat[start : start + step]


def write_from(reader: Reader, out: Path) -> None:
    """Every tensor copied as it is, through the engine's one write loop (chunks of 5)."""
    writer = Hdf5Writer(out, Checkpoint(list(reader.infos), dict(reader.metadata), reader))
    write_tensors(reader, writer, lambda _info: None, chunk_elems=5)


def test_writes_a_non_hdf5_source_as_contiguous_datasets(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "z.weight": RNG.standard_normal((3, 4)).astype(np.float32),
        "encoder/layer0/w": RNG.standard_normal((2, 2, 3)),
        "encoder/layer0/b": np.arange(3, dtype=">i4"),
        "a_scalar": np.array(1.5, dtype=np.float16),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "mask": np.array([True, False]),
    }
    out = tmp_path / "out.h5"
    write_from(ListReader(tensors, {"format": "pt", "note": "h\u00e9"}), out)
    with h5py.File(out, "r") as f:
        assert dict(f.attrs) == {"format": "pt", "note": "h\u00e9"}
        for name, array in tensors.items():
            dataset = f[name]
            assert dataset.chunks is None
            assert dataset.compression is None
            assert dataset.dtype == array.dtype
            assert dataset.shape == array.shape
            assert np.asarray(dataset[()]).tobytes() == array.tobytes()
    with Hdf5Reader(out) as reader:  # the checkpoint's order survives
        assert [info.name for info in reader.infos] == list(tensors)
        assert dict(reader.metadata) == {"format": "pt", "note": "h\u00e9"}


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        (["a//b"], "empty path component"),
        (["/abs"], "starts with '/'"),
        (["a/./b"], "'.' path component"),
        (["x", "x/y"], "x/y"),
        (["x/y", "x"], "'x'"),
    ],
)
def test_tensor_names_that_cannot_be_hdf5_paths(
    tmp_path: Path, names: list[str], fragment: str
) -> None:
    tensors = {name: np.zeros(2, np.float32) for name in names}
    with pytest.raises(WriteError, match=fragment):
        write_from(ListReader(tensors, {}), tmp_path / "out.h5")


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn]
)
def test_check_dtype_refuses_ml_dtypes(dtype: Any) -> None:
    info = TensorInfo("w", np.dtype(dtype), (2,), 2 * np.dtype(dtype).itemsize)
    reason = Hdf5Writer.check_dtype(info)
    assert reason is not None
    assert np.dtype(dtype).name in reason
    assert ".safetensors" in reason


@pytest.mark.parametrize("dtype", ["f2", "f4", ">f8", "i1", "u8", "c16", "?"])
def test_check_dtype_accepts_numpy_numbers(dtype: str) -> None:
    info = TensorInfo("w", np.dtype(dtype), (2,), 2 * np.dtype(dtype).itemsize)
    assert Hdf5Writer.check_dtype(info) is None


def test_writer_refuses_to_copy_reference_attributes(tmp_path: Path) -> None:
    src = tmp_path / "refs.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.ones(3))
        f["w"].attrs["points_at"] = f["w"].ref
    with Hdf5Reader(src) as reader, pytest.raises(InputError, match="references"):
        Hdf5Writer(tmp_path / "out.h5", Checkpoint(list(reader.infos), {}, reader))


# ---------------------------------------------------------------------------------------
# Refusals


def build(tmp_path: Path, fill: Callable[[Any, Path], None], name: str = "bad.h5") -> Path:
    """A file with one good dataset and whatever `fill` adds; fill gets the tmp dir too."""
    path = tmp_path / name
    with h5py.File(path, "w") as f:
        f.create_dataset("good", data=np.arange(4.0))
        fill(f, tmp_path)
    return path


def other_file(tmp_path: Path) -> Path:
    """A file a hostile checkpoint might try to reach."""
    path = tmp_path / "secret.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(10.0, dtype="f4"))
    return path


def add_external_link(f: Any, tmp: Path) -> None:
    f["group/leak"] = h5py.ExternalLink(str(other_file(tmp)), "/x")


def add_soft_link(f: Any, _tmp: Path) -> None:
    f["alias"] = h5py.SoftLink("/good")


def add_dangling_soft_link(f: Any, _tmp: Path) -> None:
    f["dangling"] = h5py.SoftLink("/nowhere")


def add_soft_link_loop(f: Any, _tmp: Path) -> None:
    f["loop_a"] = h5py.SoftLink("/loop_b")
    f["loop_b"] = h5py.SoftLink("/loop_a")


def add_second_hard_link(f: Any, _tmp: Path) -> None:
    f["copy"] = f["good"]


def add_hard_link_cycle(f: Any, _tmp: Path) -> None:
    group = f.create_group("g")
    group["myself"] = group


def add_external_storage(f: Any, tmp: Path) -> None:
    raw = tmp / "raw.bin"
    raw.write_bytes(np.arange(10, dtype="<f4").tobytes())
    f.create_dataset("ext", shape=(10,), dtype="<f4", external=[(str(raw), 0, 40)])


def add_dev_zero_storage(f: Any, _tmp: Path) -> None:
    f.create_dataset("zeros", shape=(10,), dtype="<f4", external=[("/dev/zero", 0, 40)])


def add_virtual_dataset(f: Any, tmp: Path) -> None:
    layout = h5py.VirtualLayout(shape=(10,), dtype="f4")
    layout[:] = h5py.VirtualSource(str(other_file(tmp)), "x", shape=(10,))
    f.create_virtual_dataset("virtual", layout)


def add_compound(f: Any, _tmp: Path) -> None:
    f.create_dataset("rec", data=np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]))


def add_vlen_string(f: Any, _tmp: Path) -> None:
    f.create_dataset("text", data=["a", "bc"], dtype=h5py.string_dtype())


def add_fixed_string(f: Any, _tmp: Path) -> None:
    f.create_dataset("text", data=np.array([b"ab", b"cd"]))


def add_reference(f: Any, _tmp: Path) -> None:
    f.create_dataset("refs", data=[f["good"].ref], dtype=h5py.ref_dtype)


def add_opaque(f: Any, _tmp: Path) -> None:
    f.create_dataset("blob", data=np.zeros(3, dtype="V4"))


def add_enum(f: Any, _tmp: Path) -> None:
    kind = h5py.enum_dtype({"RED": 0, "GREEN": 1}, basetype="u1")
    f.create_dataset("colour", data=np.array([0, 1], dtype="u1"), dtype=kind)


def add_vlen_floats(f: Any, _tmp: Path) -> None:
    dataset = f.create_dataset("ragged", shape=(2,), dtype=h5py.vlen_dtype(np.float32))
    dataset[0] = np.ones(2, np.float32)


def add_null_dataspace(f: Any, _tmp: Path) -> None:
    f.create_dataset("nothing", data=h5py.Empty("f4"))


def add_8tb_dataset(f: Any, _tmp: Path) -> None:
    f.create_dataset("huge", shape=(2**40,), dtype="f8", chunks=(2**16,), compression="gzip")
    f["huge"][:10] = 1.0


def add_sparse_2gb_dataset(f: Any, _tmp: Path) -> None:
    f.create_dataset("sparse", shape=(2**28,), dtype="f8", chunks=(2**16,), compression="gzip")
    f["sparse"][:10] = 1.0


def add_unknown_filter(f: Any, _tmp: Path) -> None:
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_chunk((4,))
    plist.set_filter(32123, h5py.h5z.FLAG_OPTIONAL)  # registered by nobody
    space = h5py.h5s.create_simple((8,))
    h5py.h5d.create(f.id, b"filtered", h5py.h5t.IEEE_F32LE, space, dcpl=plist)
    f["filtered"][...] = np.arange(8)


def add_non_utf8_name(f: Any, _tmp: Path) -> None:
    f.create_dataset(b"\xff\xfe", data=np.zeros(2))


REFUSALS = [
    (add_external_link, "external link"),
    (add_soft_link, "soft link to '/good'"),
    (add_dangling_soft_link, "soft link to '/nowhere'"),
    (add_soft_link_loop, "soft link to '/loop_b'"),
    (add_second_hard_link, "'/good' is a second hard link to '/copy'"),
    (add_hard_link_cycle, "second hard link to '/g'"),
    (add_external_storage, "external storage in file '.*raw.bin'"),
    (add_dev_zero_storage, "external storage in file '/dev/zero'"),
    (add_virtual_dataset, "virtual dataset"),
    (add_8tb_dataset, "declares 8796093022208 bytes, over the"),
    (add_sparse_2gb_dataset, "declares 2147483648 bytes but stores only"),
    (add_unknown_filter, "uses unavailable HDF5 filter 32123"),
    (add_non_utf8_name, "not UTF-8"),
]


# Datasets that are not numeric tensors: listed apart, never refused (issue 11 item 6).
NON_TENSORS = [
    (add_compound, "rec", "compound dtype"),
    (add_vlen_string, "text", "variable-length string dtype"),
    (add_fixed_string, "text", "fixed-length string dtype"),
    (add_reference, "refs", "reference dtype"),
    (add_opaque, "blob", "opaque dtype"),
    (add_enum, "colour", "enum dtype"),
    (add_vlen_floats, "ragged", "variable-length dtype"),
    (add_null_dataspace, "nothing", "empty (null) dataspace"),
]


@pytest.mark.parametrize(
    ("fill", "name", "kind"), NON_TENSORS, ids=[f.__name__ for f, _, _ in NON_TENSORS]
)
def test_non_numeric_datasets_are_listed_as_non_tensors(
    tmp_path: Path, fill: Callable[[Any, Path], None], name: str, kind: str
) -> None:
    path = build(tmp_path, fill)
    with Hdf5Reader(path) as reader:
        assert [info.name for info in reader.infos] == ["good"]
        assert [item.name for item in reader.non_tensors] == [name]
        assert kind in reader.non_tensors[0].kind


@pytest.mark.parametrize(("fill", "fragment"), REFUSALS, ids=[f.__name__ for f, _ in REFUSALS])
def test_refuses_unsafe_or_unsupported_content(
    tmp_path: Path, fill: Callable[[Any, Path], None], fragment: str
) -> None:
    path = build(tmp_path, fill)
    with pytest.raises(InputError, match=fragment) as caught:
        Hdf5Reader(path)
    assert str(path) in str(caught.value)


def test_non_hdf5_file_named_h5(tmp_path: Path) -> None:
    path = tmp_path / "fake.h5"
    path.write_bytes(b"this is not HDF5 at all" * 20)
    with pytest.raises(InputError, match="cannot open as HDF5"):
        Hdf5Reader(path)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "model.h5"
    make_keras_legacy(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cannot open as HDF5.*truncated"):
        Hdf5Reader(path)


def test_contiguous_data_past_the_end_of_the_file(tmp_path: Path) -> None:
    """Cut a file inside its last dataset and patch the superblock's end address to match,
    so HDF5 opens the file: the dataset must still be refused."""
    path = tmp_path / "cut.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("w", data=np.arange(100_000, dtype="f8"))
    data = bytearray(path.read_bytes())
    assert data[8] == 0  # superblock version 0: the end-of-file address is at byte 40
    new_size = len(data) - 4000
    del data[new_size:]
    struct.pack_into("<Q", data, 40, new_size)
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="'/w'|'w'"):
        Hdf5Reader(path)


def test_corrupt_chunk_is_an_input_error_when_read(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=RNG.standard_normal(4096), chunks=(1024,), compression="gzip")
        where = f["w"].id.get_chunk_info(1)
    with open(path, "r+b") as handle:
        handle.seek(where.byte_offset)
        handle.write(b"\x00garbage!" * (where.size // 9))
    with Hdf5Reader(path) as reader:
        info = reader.infos[0]
        with pytest.raises(InputError, match="tensor 'w'"):
            list(reader.chunks(info))
        with pytest.raises(InputError, match="tensor 'w'"):
            reader.read(info)


def test_changed_metadata_is_written_over_the_copied_root_attributes(tmp_path: Path) -> None:
    src, out = tmp_path / "model.weights.h5", tmp_path / "out.h5"
    make_keras3(src)
    with Hdf5Reader(src) as reader:
        metadata = dict(reader.metadata, keras_version="3.5.0", clipped_by="clipcli")
        writer = Hdf5Writer(out, Checkpoint(list(reader.infos), metadata, reader))
        write_tensors(
            reader,
            writer,
            lambda info: (chunk.astype(np.float64) for chunk in reader.chunks(info)),
        )
    with h5py.File(out, "r") as f:
        assert f.attrs["keras_version"] == "3.5.0"
        assert f.attrs["clipped_by"] == "clipcli"
        assert f.attrs["date_saved"] == "2024-07-01@12:00:00"
        assert f["layers/dense/vars/0"].dtype == np.dtype("f4")  # chunks cast to the dataset


def test_close_refuses_a_file_with_unwritten_tensors(tmp_path: Path) -> None:
    src = tmp_path / "model.weights.h5"
    make_keras3(src)
    with Hdf5Reader(src) as reader:
        writer = Hdf5Writer(tmp_path / "out.h5", Checkpoint(list(reader.infos), {}, reader))
        writer.write(reader.infos[0], reader.chunks(reader.infos[0]))
        with pytest.raises(RuntimeError, match="unwritten"):
            writer.close()
        assert not writer.file  # closed anyway


def test_writer_needs_the_checkpoint_to_match_an_hdf5_source(tmp_path: Path) -> None:
    src = tmp_path / "model.weights.h5"
    make_keras3(src)
    with Hdf5Reader(src) as reader, pytest.raises(ValueError, match="exactly its datasets"):
        Hdf5Writer(tmp_path / "out.h5", Checkpoint(reader.infos[1:], {}, reader))


def test_wrong_number_of_elements_is_a_caller_error(tmp_path: Path) -> None:
    tensors = {"w": np.zeros((2, 3), np.float32)}
    reader = ListReader(tensors, {})
    writer = Hdf5Writer(tmp_path / "out.h5", Checkpoint(reader.infos, {}, reader))
    with pytest.raises(ValueError, match="got 5 of 6"):
        writer.write(reader.infos[0], [np.zeros(5, np.float32)])
    with pytest.raises(ValueError, match="outside|not inside"):
        writer.write(reader.infos[0], [np.zeros(7, np.float32)])
    writer.abort()
    writer.abort()  # harmless twice
