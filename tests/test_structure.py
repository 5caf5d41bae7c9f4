"""HDF5 structure through conversions (issue 11 items 5 and 6): attributes, empty groups and
non-tensor datasets carried through safetensors and back exactly; formats that cannot hold
them refused unless --allow-lossy; `diff` reports every difference.

Files are built with h5py; outputs are read back with h5py, safetensors.safe_open and
numpy.load only. The exact HDF5 comparison is test_format_hdf5.assert_same_file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from layouts import (
    keras2_save_weights,
    keras3_nested_weights,
    legacy_keras_full_model,
    vocab_file,
)
from safetensors import safe_open
from safetensors.numpy import save_file
from test_format_hdf5 import assert_same_file

from clipcli.cli.entry import main

STRUCTURE_KEY = "clipcli.hdf5_structure"


Cli = Callable[..., Run]


def round_trip(clipcli: Cli, tmp_path: Path, src: Path) -> tuple[Path, Path]:
    mid, back = tmp_path / "mid.safetensors", tmp_path / "back.h5"
    for a, b in ((src, mid), (mid, back)):
        run = clipcli("convert", a, b)
        assert run.returncode == 0, run.stderr
        assert run.stderr == ""
    return mid, back


@pytest.mark.parametrize(
    "make", [legacy_keras_full_model, keras2_save_weights, keras3_nested_weights, vocab_file]
)
def test_hdf5_to_safetensors_and_back_is_exact(clipcli: Cli, tmp_path: Path, make: Any) -> None:
    src = tmp_path / "src.h5"
    make(src)
    mid, back = round_trip(clipcli, tmp_path, src)
    assert_same_file(src, back)  # every group, dataset, attribute value and HDF5 type
    with safe_open(str(mid), "np") as f, h5py.File(src, "r") as h:
        metadata = f.metadata()
        document = json.loads(metadata[STRUCTURE_KEY])
        assert (document["format"], document["version"]) == (STRUCTURE_KEY, 1)
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            np.testing.assert_array_equal(f.get_tensor(name), h[name][()])


def test_keras2_layer_names_survive_the_round_trip(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "w.h5"
    keras2_save_weights(src)
    _, back = round_trip(clipcli, tmp_path, src)
    with h5py.File(src, "r") as a, h5py.File(back, "r") as b:
        assert b.attrs.get_id("layer_names").get_type() == a.attrs.get_id("layer_names").get_type()
        assert list(b.attrs["layer_names"]) == list(a.attrs["layer_names"])


def test_clip_keeps_non_tensor_datasets_and_the_structure(clipcli: Cli, tmp_path: Path) -> None:
    src = vocab_file(tmp_path / "v.h5")
    out_h5, out_st = tmp_path / "c.h5", tmp_path / "c.safetensors"
    for out in (out_h5, out_st):
        run = clipcli("clip", "--global", "1", "-q", src, out)
        assert run.returncode == 0, run.stderr
    with h5py.File(src, "r") as a, h5py.File(out_h5, "r") as b:
        assert list(b["vocab"][()]) == list(a["vocab"][()]) == [b"a", b"b", b"\xc3\xa7", b""]
        assert b["table"][()].tobytes() == a["table"][()].tobytes()
        assert np.linalg.norm(np.concatenate([b["dense/kernel"][()].ravel(), b["bias"][()]])) <= 1
    back = tmp_path / "back.h5"
    assert clipcli("convert", out_st, back).returncode == 0
    assert_same_file(out_h5, back)


def test_ls_lists_non_tensors_and_norms_ignore_them(clipcli: Cli, tmp_path: Path) -> None:
    src = vocab_file(tmp_path / "v.h5")
    run = clipcli("ls", "--format", "json", src)
    assert run.returncode == 0, run.stderr
    listing = json.loads(run.stdout)
    assert [t["name"] for t in listing["tensors"]] == ["bias", "dense/kernel"]  # natural name order
    assert [n["name"] for n in listing["non_tensors"]] == [
        "vocab",
        "table",
        "scalar_text",
        "nothing",
    ]
    assert listing["non_tensors"][0]["shape"] == [4]
    table = clipcli("ls", src)
    assert "non-tensor vocab: a variable-length string dtype, shape [4]" in table.stdout
    norms = json.loads(clipcli("norms", "--format", "json", src).stdout)
    assert [t["name"] for t in norms["tensors"]] == ["bias", "dense/kernel"]


@pytest.mark.parametrize("suffix", [".npz"])
def test_a_target_without_structure_is_refused_unless_lossy(
    clipcli: Cli, tmp_path: Path, suffix: str
) -> None:
    src = tmp_path / "m.h5"
    weights = legacy_keras_full_model(src)
    out = tmp_path / f"out{suffix}"
    refused = clipcli("convert", src, out)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1
    assert "--allow-lossy" in refused.stderr
    assert "attributes" in refused.stderr
    assert not out.exists()
    lossy = clipcli("convert", "--allow-lossy", src, out)
    assert lossy.returncode == 0, lossy.stderr
    warnings = [line for line in lossy.stderr.splitlines() if line.startswith("clipcli: warning")]
    assert len(warnings) == 1
    assert "dropped" in warnings[0]
    with np.load(out, allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(f"{name}.npy" for name in weights) or sorted(
            npz.files
        ) == sorted(weights)
        for name, array in weights.items():
            np.testing.assert_array_equal(npz[name], array)


def test_clip_to_npz_refuses_a_vocab_without_the_flag(clipcli: Cli, tmp_path: Path) -> None:
    src = vocab_file(tmp_path / "v.h5")
    run = clipcli("clip", "--global", "1", src, tmp_path / "o.npz")
    assert run.returncode == 2
    assert "non-tensor datasets ('vocab'" in run.stderr


def test_safetensors_metadata_into_npz_needs_the_flag(clipcli: Cli, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    # A framework tag alone is dropped with a note (issue 23 item 7); real metadata is not.
    save_file({"w": np.ones(3, np.float32)}, str(src), metadata={"format": "np"})
    assert clipcli("convert", src, tmp_path / "tag.npz").returncode == 0
    metadata = {"format": "np", "license": "mit"}
    save_file({"w": np.ones(3, np.float32)}, str(src), metadata=metadata)
    assert clipcli("convert", src, tmp_path / "o.npz").returncode == 2
    assert clipcli("convert", "--allow-lossy", src, tmp_path / "o.npz").returncode == 0


def test_plain_hdf5_to_npz_loses_nothing_and_needs_no_flag(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "plain.h5"
    with h5py.File(src, "w") as f:
        f["a/b"] = np.arange(3.0)
    run = clipcli("convert", src, tmp_path / "o.npz")
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""


def test_unportable_attribute_into_safetensors_needs_the_flag(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "ref.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(2)
        f.attrs["r"] = f["w"].ref
        f.attrs["kept"] = 1.5
    out = tmp_path / "o.safetensors"
    refused = clipcli("convert", src, out)
    assert refused.returncode == 2
    assert "attribute 'r'" in refused.stderr
    lossy = clipcli("convert", "--allow-lossy", src, out)
    assert lossy.returncode == 0
    assert "attribute 'r'" in lossy.stderr
    back = tmp_path / "back.h5"
    assert clipcli("convert", out, back).returncode == 0
    with h5py.File(back, "r") as f:
        assert list(f.attrs) == ["kept"]
        assert f.attrs["kept"] == 1.5


def test_malformed_recorded_structure_is_exit_3_when_used(clipcli: Cli, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "bad.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(src), metadata={STRUCTURE_KEY: "{not json"})
    assert clipcli("ls", src).returncode == 0  # listing never needs the structure
    run = clipcli("convert", src, tmp_path / "o.h5")
    assert run.returncode == 3
    assert STRUCTURE_KEY in run.stderr
    assert not (tmp_path / "o.h5").exists()


def test_hostile_recorded_structure_is_refused_field_by_field(clipcli: Cli, tmp_path: Path) -> None:
    """A recorded node with raw values shorter than its dataspace needs must not make the
    library read past a buffer: refused (exit 3) before anything is written."""
    from safetensors.numpy import save_file

    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
        f.attrs["a"] = np.arange(4, dtype="<i8")
    mid = tmp_path / "mid.safetensors"
    assert clipcli("convert", src, mid).returncode == 0
    with safe_open(str(mid), "np") as f:
        document = json.loads(f.metadata()[STRUCTURE_KEY])
    document["nodes"][0]["attrs"][0]["space"]["shape"] = [4000]
    document["nodes"][0]["attrs"][0]["space"]["maxshape"] = [4000]
    bad = tmp_path / "bad.safetensors"
    save_file(
        {"w": np.ones(3, np.float32)}, str(bad), metadata={STRUCTURE_KEY: json.dumps(document)}
    )
    run = clipcli("convert", bad, tmp_path / "o.h5")
    assert run.returncode == 3, run.stderr
    assert "malformed" in run.stderr
    assert not (tmp_path / "o.h5").exists()


def test_structure_that_does_not_fit_the_tensors_needs_the_flag(
    clipcli: Cli, tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "src.h5"
    keras2_save_weights(src)
    mid = tmp_path / "mid.safetensors"
    assert clipcli("convert", src, mid).returncode == 0
    with safe_open(str(mid), "np") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["extra"] = np.zeros(2, np.float32)
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata=metadata)
    assert clipcli("convert", edited, tmp_path / "o.h5").returncode == 2
    run = clipcli("convert", "--allow-lossy", edited, tmp_path / "o.h5")
    assert run.returncode == 0
    assert "not the checkpoint's tensors" in run.stderr
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert "extra" in f


def test_diff_reports_every_structure_difference(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "m.h5"
    legacy_keras_full_model(src)
    npz = tmp_path / "m.npz"
    assert clipcli("convert", "--allow-lossy", src, npz).returncode == 0
    run = clipcli("diff", "--format", "json", src, npz)
    result = json.loads(run.stdout)
    keys = {change["key"] for change in result["metadata_changes"]}
    assert result["identical"] is False
    assert "/model_weights @layer_names" in keys
    assert "/model_weights/dense_1 @weight_names" in keys
    assert "keras_version" in keys
    same = json.loads(
        clipcli("diff", "--format", "json", src, round_trip(clipcli, tmp_path, src)[1]).stdout
    )
    assert same["metadata_changes"] == []
    assert same["identical"] is True


def test_diff_reports_a_changed_attribute_and_an_empty_group(clipcli: Cli, tmp_path: Path) -> None:
    a = vocab_file(tmp_path / "a.h5")
    b = vocab_file(tmp_path / "b.h5")
    with h5py.File(b, "a") as f:
        f["dense"].attrs["weight_names"] = np.array([b"other"])
        del f["empty"]
        f.create_group("new_empty")
    result = json.loads(clipcli("diff", "--format", "json", a, b).stdout)
    changes = {c["key"]: (c["a"], c["b"]) for c in result["metadata_changes"]}
    assert changes["group /empty"] == ("group", None)
    assert changes["group /new_empty"] == (None, "group")
    assert "/empty @note" in changes
    before, after = changes["/dense @weight_names"]
    assert before is not None
    assert after is not None
    assert before != after


# ---------------------------------------------------------------------------------------
# limits, each exactly at and one past its bound


def test_non_tensors_copied_in_many_small_slices_stay_exact(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clipcli.formats.hdf5 import limits

    src = tmp_path / "rows.h5"
    words = [f"word{i}" * (i % 4) for i in range(37)]
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
        f.create_dataset("vocab", data=words, dtype=h5py.string_dtype())
        f.create_dataset("grid", data=np.arange(7 * 5, dtype="<i2").reshape(7, 5).astype("S3"))
    monkeypatch.setattr(limits, "NON_TENSOR_SLICE_BYTES", 40)  # a few rows per slice
    assert clipcli("clip", "--global", "1", "-q", src, tmp_path / "c.h5").returncode == 0
    _, back = round_trip(clipcli, tmp_path, src)
    for out in (tmp_path / "c.h5", back):
        with h5py.File(src, "r") as a, h5py.File(out, "r") as b:
            assert list(b["vocab"][()]) == [w.encode() for w in words]
            assert b["grid"][()].tobytes() == a["grid"][()].tobytes()


def _vocab_only(path: Path, words: list[str]) -> Path:
    with h5py.File(path, "w") as f:
        f["w"] = np.ones(2, np.float32)
        f.create_dataset("vocab", data=words, dtype=h5py.string_dtype())
    return path


def test_variable_length_budget_exactly_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clipcli.errors import InputError
    from clipcli.formats.hdf5 import Hdf5Reader, limits
    from clipcli.formats.hdf5.nontensor import VlenBudget, read_rows

    words = ["abc", "de", "f" * 10]
    path = _vocab_only(tmp_path / "v.h5", words)
    total = sum(len(w) for w in words)
    reader = Hdf5Reader(path)
    try:
        item, dataset = reader.non_tensors[0], reader.file["/vocab"]
        monkeypatch.setattr(limits, "MAX_EXPANSION", 0)
        monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", total)  # a budget of 15 bytes
        exact = VlenBudget(path, file_size=0)
        rows = list(read_rows(dataset, item, reader.largest_heap_object, exact))
        assert [v for piece in rows for v in piece.values] == [w.encode() for w in words]
        monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", total - 1)
        short = VlenBudget(path, file_size=0)
        with pytest.raises(InputError, match="expand"):
            list(read_rows(dataset, item, reader.largest_heap_object, short))
    finally:
        reader.close()


def test_recorded_structure_size_exactly_at_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clipcli.formats.hdf5.record_read as hdf5_structure
    from clipcli.formats.hdf5 import Hdf5Reader

    path = vocab_file(tmp_path / "v.h5")
    reader = Hdf5Reader(path)
    try:
        size = len(hdf5_structure.read_structure(reader).to_text().encode("utf-8"))
        monkeypatch.setattr(hdf5_structure, "MAX_STRUCTURE_BYTES", size)
        assert hdf5_structure.read_structure(reader).document is not None
        monkeypatch.setattr(hdf5_structure, "MAX_STRUCTURE_BYTES", size - 1)
        over = hdf5_structure.read_structure(reader)
        assert over.document is None
        assert "cap" in over.dropped[0]
    finally:
        reader.close()


def test_parsed_structure_size_exactly_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    import clipcli.formats.structure_record as structure

    text = json.dumps(
        {
            "format": STRUCTURE_KEY,
            "version": 1,
            "nodes": [{"path": "/", "kind": "group", "attrs": []}],
        }
    )
    monkeypatch.setattr(structure, "MAX_STRUCTURE_BYTES", len(text))
    assert structure.parse_structure(text).nodes[0]["path"] == "/"
    monkeypatch.setattr(structure, "MAX_STRUCTURE_BYTES", len(text) - 1)
    with pytest.raises(structure.MalformedStructure, match="limit"):
        structure.parse_structure(text)


def _nested_array(depth: int) -> dict[str, Any]:
    desc: dict[str, Any] = {"class": "int", "size": 1, "order": "<", "signed": True}
    for _ in range(depth):
        desc = {"class": "array", "dims": [1], "base": desc}
    return desc


def test_recorded_type_limits_exactly_at_the_bound() -> None:
    from clipcli.formats.hdf5.portable import (
        MAX_TYPE_DEPTH,
        MAX_TYPE_SIZE,
        Malformed,
        build_type,
    )

    assert build_type(_nested_array(MAX_TYPE_DEPTH)).get_size() == 1
    with pytest.raises(Malformed, match="deeply"):
        build_type(_nested_array(MAX_TYPE_DEPTH + 1))
    opaque = {"class": "opaque", "size": MAX_TYPE_SIZE, "tag": "t"}
    assert build_type(opaque).get_size() == MAX_TYPE_SIZE
    with pytest.raises(Malformed):
        build_type({**opaque, "size": MAX_TYPE_SIZE + 1})
    with pytest.raises(Malformed):
        build_type({"class": "int", "size": 4, "order": "<", "signed": 1})  # not a bool


def test_root_string_attributes_travel_as_metadata(clipcli: Cli, tmp_path: Path) -> None:
    """Root string attributes are file metadata: a model directory keeps them (no flag);
    npz holds no metadata, so that loss is named."""
    src = tmp_path / "m.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
        f.attrs["format"] = "pt"
        f.attrs["license"] = "mit"  # real metadata: a framework tag alone would be no loss
    assert clipcli("convert", src, f"{tmp_path / 'dir'}/").returncode == 0
    with safe_open(str(tmp_path / "dir" / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt", "license": "mit"}
    refused = clipcli("convert", src, tmp_path / "m.npz")
    assert refused.returncode == 2
    assert "file metadata (2 keys: 'format', 'license')" in refused.stderr


@pytest.mark.parametrize(
    "edit",
    [
        "repeated_attribute",
        "dotdot_name",
        "orphan_path",
        "unknown_filter",
        "two_decompressors",
        "n_bit_after_gzip",
        "huge_chunk",
        "bad_base64",
    ],
)
def test_hostile_structure_edits_are_exit_3_and_write_nothing(
    clipcli: Cli, tmp_path: Path, edit: str
) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("g/w", data=np.ones((4, 4), np.float32), chunks=(2, 2))
        f["g"].attrs["a"] = np.arange(2)
    mid = tmp_path / "mid.safetensors"
    assert clipcli("convert", src, mid).returncode == 0
    with safe_open(str(mid), "np") as f:
        document = json.loads(f.metadata()[STRUCTURE_KEY])
    group, dataset = document["nodes"][1], document["nodes"][2]
    if edit == "repeated_attribute":
        group["attrs"].append(group["attrs"][0])
    elif edit == "dotdot_name":
        group["path"] = "/.."
    elif edit == "orphan_path":
        dataset["path"] = "/nowhere/w"
    elif edit == "unknown_filter":
        dataset["filters"] = [[32001, 0, []]]
    elif edit == "two_decompressors":  # what the reader refuses in OUT (hdf5/decoding)
        dataset["filters"] = [[1, 0, [4]], [32000, 1, []]]
    elif edit == "n_bit_after_gzip":
        dataset["filters"] = [[1, 0, [4]], [5, 0, []]]
    elif edit == "huge_chunk":
        dataset["chunks"] = [1 << 20, 1 << 20]
    else:
        group["attrs"][0]["data"]["raw"] = "not base64!"
    bad = tmp_path / "bad.safetensors"
    save_file(
        {"g/w": np.ones((4, 4), np.float32)},
        str(bad),
        metadata={STRUCTURE_KEY: json.dumps(document)},
    )
    # A path that is not a tree (dotdot, orphan) is malformed too: never a loss to accept.
    run = clipcli("convert", "--allow-lossy", bad, tmp_path / "o.h5")
    assert run.returncode == 3, run.stderr
    assert "malformed" in run.stderr
    if edit in ("two_decompressors", "n_bit_after_gzip"):
        assert "cannot be bounded" in run.stderr
    assert not (tmp_path / "o.h5").exists()


def _edited_record(
    tmp_path: Path, clipcli: Cli, edit: Callable[[list[dict[str, Any]]], None]
) -> Path:
    """A safetensors file converted from a small HDF5 file (a chunked gzip tensor, a
    vocabulary, an empty group), its structure record then edited."""
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("g/w", data=np.ones((4, 4), np.float32), chunks=(2, 2), compression="gzip")
        f.create_dataset("vocab", data=["a", "b"], dtype=h5py.string_dtype())
        f.create_group("empty")
        f.attrs["n"] = np.int32(5)
    mid = tmp_path / "mid.safetensors"
    assert clipcli("convert", src, mid).returncode == 0
    with safe_open(str(mid), "np") as handle:
        metadata = dict(handle.metadata())
    document = json.loads(metadata[STRUCTURE_KEY])
    edit(document["nodes"])
    bad = tmp_path / "bad.safetensors"
    save_file(
        load_file(str(mid)), str(bad), metadata={**metadata, STRUCTURE_KEY: json.dumps(document)}
    )
    return bad


def _node(nodes: list[dict[str, Any]], path: str) -> dict[str, Any]:
    return next(node for node in nodes if node["path"] == path)


def _set(path: str, **fields: Any) -> Callable[[list[dict[str, Any]]], None]:
    return lambda nodes: _node(nodes, path).update(fields)


def _move(path: str, new: str) -> Callable[[list[dict[str, Any]]], None]:
    return lambda nodes: _node(nodes, path).update(path=new)


def _add_group(path: str, at: int | None = None) -> Callable[[list[dict[str, Any]]], None]:
    def edit(nodes: list[dict[str, Any]]) -> None:
        group = {"path": path, "kind": "group", "cset": 0, "links": 0, "attr_order": 0, "attrs": []}
        nodes.insert(len(nodes) if at is None else at, group)

    return edit


def _root_attribute(**fields: Any) -> Callable[[list[dict[str, Any]]], None]:
    def edit(nodes: list[dict[str, Any]]) -> None:
        attr = {
            "name": "x",
            "type": {"class": "int", "size": 4, "order": "<", "signed": True},
            "space": {"class": "scalar"},
            "data": {"raw": "BQAAAA=="},
        }
        nodes[0]["attrs"].append({**attr, **fields})

    return edit


_ENUM = {
    "class": "enum",
    "base": {"class": "int", "size": 1, "order": "<", "signed": True},
    "members": [["A", 0], ["B", 100000]],
}

HOSTILE_RECORDS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    # F9: once exit 70 (the library failed, and closing the file masked it)
    "vlen_string_with_nul": _set("/vocab", data={"strings": ["a\x00b", "b"]}),
    "nul_in_path": _move("/empty", "/a\x00b"),
    "szip_filter": _set("/g/w", filters=[[4, 1, [4, 32]]]),
    "100_gzip_filters": _set("/g/w", filters=[[1, 1, [1]]] * 100),
    "chunks_larger_than_dataset": _set("/g/w", chunks=[8192, 8192]),
    "contiguous_with_chunks_and_filters": _set("/g/w", layout="contiguous"),
    # F10: once written with exit 0, not as recorded
    "nontensor_without_values": _set(
        "/vocab", space={"class": "simple", "shape": [10**12], "maxshape": [10**12]}, data=None
    ),
    "attribute_name_with_nul": _root_attribute(name="a\x00b"),
    "enum_value_out_of_range": _root_attribute(type=_ENUM, data={"raw": "AA=="}),
    "gzip_level_100": _set("/g/w", filters=[[1, 1, [100]]]),
    "track_times_yes": _set("/g/w", track_times="yes"),
    "chunk_bool": _set("/g/w", chunks=[True, 2]),
    "fill_time_bool": _set("/g/w", fill_time=True),
    # F11: once exit 2 ("cannot hold ... pass --allow-lossy")
    "dotdot": _move("/empty", "/../x"),
    "double_slash": _add_group("/empty//b"),
    "relative": _move("/empty", "rel"),
    "dot": _add_group("/empty/./b"),
    "no_root": lambda nodes: nodes.__delitem__(0),
    "parent_after_child": _add_group("/later/child", at=1),
    "group_under_tensor": _add_group("/g/w/sub"),
    "listed_twice": _add_group("/empty"),
}


@pytest.mark.parametrize("edit", sorted(HOSTILE_RECORDS))
def test_malformed_or_lying_record_is_exit_3_one_line_nothing_written(
    clipcli: Cli, tmp_path: Path, edit: str
) -> None:
    """A record that cannot be written as it says is malformed: exit 3, one line, no
    output, with or without --allow-lossy, never exit 70 (a library failure masked by
    the failing close) and never exit 0 with something else written."""
    bad = _edited_record(tmp_path, clipcli, HOSTILE_RECORDS[edit])
    for flags in ([], ["--allow-lossy"]):
        out = tmp_path / "o.h5"
        run = clipcli("convert", *flags, bad, out)
        assert run.returncode == 3, (edit, run.stderr)
        assert "malformed" in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert not out.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "bad.safetensors",
            "mid.safetensors",
            "src.h5",
        ]


def test_a_failing_close_never_masks_the_first_error(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the library says while rebuilding a record is reported (exit 3, one line,
    nothing written), even when closing the half-made file then fails too."""
    import clipcli.formats.hdf5.writer as writer_module

    bad = _edited_record(tmp_path, clipcli, lambda _nodes: None)

    def failing_create(_file: Any, _ready: Any) -> None:
        raise RuntimeError("the library refused the first object")

    # After the failure the writer points the library's descriptor at /dev/null, so the
    # close that follows fails too ("Can't decrement id ref count ... errno = 22").
    monkeypatch.setattr(writer_module, "create_nodes", failing_create)
    run = clipcli("convert", bad, tmp_path / "o.h5")
    monkeypatch.undo()
    assert run.returncode == 3, run.stderr
    assert "the library refused the first object" in run.stderr
    assert "decrement" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "o.h5").exists()


def test_root_attribute_named_like_the_record_is_escaped_never_the_record(
    clipcli: Cli, tmp_path: Path
) -> None:
    """F6: a root attribute named STRUCTURE_KEY is an attribute like others: the record
    under that key is always clipcli's own (the attribute cannot replace or forge it), the
    attribute travels inside it and comes back; a format that drops it names it."""
    forged = {
        "format": "clipcli.hdf5_structure",
        "version": 1,
        "nodes": [
            {"path": "/", "kind": "group", "cset": 0, "links": 0, "attr_order": 0, "attrs": []},
            {
                "path": "/injected",
                "kind": "group",
                "cset": 0,
                "links": 0,
                "attr_order": 0,
                "attrs": [],
            },
        ],
    }
    for value in ("hello", json.dumps(forged)):
        src = tmp_path / "src.h5"
        with h5py.File(src, "w") as f:
            f["w"] = np.ones(3, np.float32)
            f.attrs[STRUCTURE_KEY] = value
            f.attrs["other"] = "x"
        mid, back = round_trip(clipcli, tmp_path, src)
        with safe_open(str(mid), "np") as handle:
            metadata = handle.metadata()
        record = json.loads(metadata[STRUCTURE_KEY])
        assert [node["path"] for node in record["nodes"]] == ["/", "/w"]
        assert [a["name"] for a in record["nodes"][0]["attrs"]] == [STRUCTURE_KEY, "other"]
        with h5py.File(back, "r") as f:
            assert dict(f.attrs) == {STRUCTURE_KEY: value, "other": "x"}
            assert list(f) == ["w"]
        refused = clipcli("convert", src, tmp_path / "o.npz")
        assert refused.returncode == 2, refused.stderr
        assert f"root attribute {STRUCTURE_KEY!r}" in refused.stderr
        for path in (src, mid, back):
            path.unlink()


def test_invalid_record_key_is_exit_3_only_for_hdf5(clipcli: Cli, tmp_path: Path) -> None:
    """A safetensors key STRUCTURE_KEY that is no record is metadata to every other format."""
    from safetensors.numpy import save_file

    src = tmp_path / "s.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(src), metadata={STRUCTURE_KEY: "garbage"})
    assert clipcli("ls", src).returncode == 0
    assert clipcli("norms", src).returncode == 0
    assert clipcli("convert", src, tmp_path / "c.safetensors").returncode == 0
    assert clipcli("convert", src, f"{tmp_path / 'dir'}/").returncode == 0
    npz = clipcli("convert", src, tmp_path / "o.npz")
    assert npz.returncode == 2, npz.stderr
    assert "file metadata" in npz.stderr
    hdf5 = clipcli("convert", src, tmp_path / "o.h5")
    assert hdf5.returncode == 3, hdf5.stderr
    assert "malformed" in hdf5.stderr


def test_edited_metadata_wins_over_the_recorded_root_attributes(
    clipcli: Cli, tmp_path: Path
) -> None:
    """F3: with a structure record, what __metadata__ shows is what HDF5 gets: an edited
    key is written with its new value, a deleted key is not restored, an added key is
    added; untouched keys keep their exact recorded type (Keras' fixed-length bytes)."""
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
        f["w"].attrs["unit"] = "m"
        f.attrs["backend"] = np.bytes_(b"tensorflow")
        f.attrs["keras_version"] = np.bytes_(b"2.13.1")
        f.attrs["kept"] = np.bytes_(b"same")
        f.attrs["n"] = np.int32(3)
    mid = tmp_path / "mid.safetensors"
    assert clipcli("convert", src, mid).returncode == 0
    with safe_open(str(mid), "np") as handle:
        metadata = dict(handle.metadata())
    assert metadata["backend"] == "tensorflow"
    metadata["backend"] = "jax"
    del metadata["keras_version"]
    metadata["added"] = "new"
    edited = tmp_path / "edited.safetensors"
    save_file(load_file(str(mid)), str(edited), metadata=metadata)
    back = tmp_path / "back.h5"
    run = clipcli("convert", edited, back)
    assert run.returncode == 0, run.stderr
    with h5py.File(back, "r") as f:
        assert sorted(f.attrs) == ["added", "backend", "kept", "n"]
        assert f.attrs["backend"] == "jax"
        assert f.attrs.get_id("kept").dtype == np.dtype("S4")  # untouched: exact type
        assert f.attrs["kept"] == b"same"
        assert int(f.attrs["n"]) == 3
        assert f.attrs["added"] == "new"
        assert f["w"].attrs["unit"] == "m"


def test_a_model_directory_joined_into_one_file_names_the_metadata_it_drops(
    clipcli: Cli, tmp_path: Path
) -> None:
    """F4: the index's metadata (but total_size) and the shard __metadata__ not every shard
    shares cannot go into one file: a loss (exit 2 naming the keys) unless --allow-lossy;
    into a directory nothing is lost."""
    from safetensors.numpy import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file(
        {"a": np.ones(4, np.float32)},
        str(model / "s1.safetensors"),
        {"format": "pt", "note": "one"},
    )
    save_file(
        {"b": np.ones(4, np.float32)},
        str(model / "s2.safetensors"),
        {"format": "pt", "note": "two", "only2": "x"},
    )
    index = {
        "metadata": {"total_size": 32, "custom": "keep"},
        "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    for suffix in (".safetensors", ".h5"):
        out = tmp_path / f"one{suffix}"
        for command in (["convert"], ["clip", "--global", "1"]):
            refused = clipcli(*command, model, out)
            assert refused.returncode == 2, refused.stderr
            for key in ("'custom'", "'note'", "'only2'"):
                assert key in refused.stderr
            assert "'total_size'" not in refused.stderr
            assert "'format'" not in refused.stderr
            assert not out.exists()
        lossy = clipcli("convert", "--allow-lossy", model, out)
        assert lossy.returncode == 0, lossy.stderr
        assert "'custom'" in lossy.stderr
    assert clipcli("convert", model, f"{tmp_path / 'copy'}/").returncode == 0


def test_storage_settings_are_structure_for_npz_and_diff(clipcli: Cli, tmp_path: Path) -> None:
    """F7: chunks, filters, maximum shape and fill value are structure: HDF5 -> npz refuses
    to drop them without --allow-lossy (as any other structure), and `diff` reports them;
    a plain HDF5 file converts with no flag and diffs identical."""
    src = tmp_path / "comp.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset(
            "w",
            data=np.ones((16, 8), np.float32),
            chunks=(8, 8),
            compression="gzip",
            maxshape=(None, 8),
            fillvalue=7.0,
        )
    out = tmp_path / "o.npz"
    refused = clipcli("convert", src, out)
    assert refused.returncode == 2, refused.stderr
    assert "storage settings" in refused.stderr
    assert "chunks [8, 8]" in refused.stderr
    assert not out.exists()
    lossy = clipcli("convert", "--allow-lossy", src, out)
    assert lossy.returncode == 0, lossy.stderr
    assert "storage settings" in lossy.stderr
    diff = json.loads(clipcli("diff", "--format", "json", src, out).stdout)
    assert diff["identical"] is False
    assert "storage /w" in json.dumps(diff)

    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["w"] = np.ones((16, 8), np.float32)
    run = clipcli("convert", plain, tmp_path / "p.npz")
    assert run.returncode == 0, run.stderr
    same = json.loads(clipcli("diff", "--format", "json", plain, tmp_path / "p.npz").stdout)
    assert same["identical"] is True


def test_a_metadata_key_added_over_a_non_text_attribute_wins(tmp_path: Path) -> None:
    """The record holds epoch as int64 (not metadata); the user adds epoch='6' to
    __metadata__: back in HDF5 the user's value is written, never silently the old one."""
    import h5py
    from safetensors import safe_open

    src, mid, edited, back = (
        tmp_path / n for n in ("a.h5", "m.safetensors", "e.safetensors", "b.h5")
    )
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(4, np.float32)
        f.attrs["epoch"] = np.int64(5)
        f.attrs["names"] = np.array(["a", "b"], dtype=h5py.string_dtype())
    assert main(["convert", "-q", str(src), str(mid)]) == 0
    with safe_open(str(mid), "np") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    save_file(tensors, str(edited), metadata={**metadata, "epoch": "6"})
    assert main(["convert", "-q", str(edited), str(back)]) == 0
    with h5py.File(back, "r") as f:
        assert f.attrs["epoch"] == "6"
        assert list(f.attrs["names"]) == ["a", "b"]  # untouched: its recorded type
    unedited = tmp_path / "u.h5"
    assert main(["convert", "-q", str(mid), str(unedited)]) == 0
    with h5py.File(unedited, "r") as f:
        assert f.attrs["epoch"] == 5
