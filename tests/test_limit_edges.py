"""Limits and name rules exactly at their edge and one past it: the tests that kill the
planted faults of tools/mutants.py (issue 19) that no other test noticed. Each one pins a
comparison (`<` vs `<=`) or a constant, against a reference that shares no code with
clipcli (zipfile, h5py, hand-built bytes, plain counting)."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from clipcli.errors import ExitCode
from clipcli.formats.hdf5 import limits
from clipcli.formats.hdf5.writer import HDF5_MAX_ATTRIBUTES, Hdf5Writer
from clipcli.formats.npz.writer import ZIP_NAME_BYTES, NpzWriter
from clipcli.formats.structure_record import (
    STRUCTURE_FORMAT,
    STRUCTURE_VERSION,
    MalformedStructure,
    parse_structure,
)
from clipcli.formats.zipsafe import member_name_problem

RunMain = Callable[..., Any]


# ---------------------------------------------------------------- zip member names


@pytest.mark.parametrize("name", ["\\x.npy", "\\\\server\\share.npy", "/x.npy", "a/../../x.npy"])
def test_member_names_that_escape_the_archive_are_refused(name: str) -> None:
    # A leading backslash is an absolute path to Windows' unzip, as '/' is to Unix's.
    assert member_name_problem(name) is not None


@pytest.mark.parametrize("name", ["x.npy", "a\\b.npy", "a/b.npy", "..x.npy"])
def test_member_names_inside_the_archive_are_accepted(name: str) -> None:
    assert member_name_problem(name) is None


def test_npz_member_name_exactly_at_the_zip_limit_and_one_past() -> None:
    # A zip stores a name's length in 16 bits: 65,535 bytes of UTF-8, '.npy' included.
    at_limit = "a" * (ZIP_NAME_BYTES - len(".npy"))
    assert len(f"{at_limit}.npy".encode()) == 0xFFFF
    assert NpzWriter.check_name(at_limit) is None
    assert NpzWriter.check_name(at_limit + "a") is not None
    # The reference: zipfile itself writes the name at the limit and refuses one past it.
    with zipfile.ZipFile(io.BytesIO(), "w") as archive:
        archive.writestr(f"{at_limit}.npy", b"")
        with pytest.raises((ValueError, struct.error)):
            archive.writestr(f"{at_limit}a.npy", b"")


# ---------------------------------------------------------------- .npy headers


def _npz_with_header_of(path: Path, header_len: int) -> None:
    """An npz whose one member's .npy (version 1) header is exactly header_len bytes."""
    body = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
    header = body + " " * (header_len - len(body) - 1) + "\n"
    assert len(header) == header_len
    member = b"\x93NUMPY\x01\x00" + struct.pack("<H", header_len) + header.encode("latin1")
    member += np.arange(2, dtype="<f4").tobytes()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("w.npy", member)


def test_npy_header_exactly_at_numpys_cap_is_read_and_one_past_refused(
    tmp_path: Path, run_main: RunMain
) -> None:
    at, past = tmp_path / "at.npz", tmp_path / "past.npz"
    _npz_with_header_of(at, 10_000)
    _npz_with_header_of(past, 10_001)
    # The reference: numpy's own reader, whose default cap is the same 10,000 bytes.
    assert np.load(at)["w"].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="max_header_size"):
        np.load(past)["w"]
    assert run_main("ls", at).code == ExitCode.OK
    refused = run_main("ls", past)
    assert refused.code == ExitCode.BAD_INPUT
    assert "10001 bytes exceeds the 10000 cap" in refused.stderr


# ---------------------------------------------------------------- safetensors tensor count


def _safetensors_with_escaped_keys(path: Path, count: int) -> None:
    """`count` empty tensors whose "data_offsets" key is spelled with a JSON escape, so a
    count of the raw bytes misses them and only the parsed header can tell."""
    entries = ", ".join(
        f'"t{i}": {{"dtype": "F32", "shape": [0], "data\\u005foffsets": [0, 0]}}'
        for i in range(count)
    )
    header = ("{" + entries + "}").encode()
    assert json.loads(header)["t0"]["data_offsets"] == [0, 0]
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_safetensors_tensor_count_exactly_at_the_cap_and_one_past(
    tmp_path: Path, run_main: RunMain, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clipcli.formats.safetensors import reader

    monkeypatch.setattr(reader, "MAX_TENSORS", 3)
    at, past = tmp_path / "at.safetensors", tmp_path / "past.safetensors"
    _safetensors_with_escaped_keys(at, 3)
    _safetensors_with_escaped_keys(past, 4)
    assert run_main("ls", at).code == ExitCode.OK
    refused = run_main("ls", past)
    assert refused.code == ExitCode.BAD_INPUT
    assert "header lists 4 tensors; the limit is 3" in refused.stderr


# ---------------------------------------------------------------- the HDF5 structure record


def _record(nodes: int) -> str:
    listed = [{"path": "/", "kind": "group", "attrs": []}] * nodes
    return json.dumps({"format": STRUCTURE_FORMAT, "version": STRUCTURE_VERSION, "nodes": listed})


def test_structure_record_node_count_exactly_at_the_cap_and_one_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clipcli.formats import structure_record

    monkeypatch.setattr(structure_record, "MAX_NODES", 5)
    assert len(parse_structure(_record(5)).nodes) == 5
    with pytest.raises(MalformedStructure, match="1 to 5 objects"):
        parse_structure(_record(6))


# ---------------------------------------------------------------- HDF5 budgets


def _chunked(path: Path, chunk_elements: int) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.zeros(chunk_elements, "<f4"), chunks=(chunk_elements,))


def test_hdf5_chunk_exactly_at_the_chunk_limit_and_one_past(
    tmp_path: Path, run_main: RunMain, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "MAX_CHUNK_BYTES", 4096)
    at, past = tmp_path / "at.h5", tmp_path / "past.h5"
    _chunked(at, 1024)  # 4,096 bytes a chunk
    _chunked(past, 1025)  # 4,100
    with h5py.File(at) as f:  # the reference: the library's own chunk shape
        assert f["w"].chunks == (1024,)
    assert run_main("norms", at).code == ExitCode.OK
    refused = run_main("norms", past)
    assert refused.code == ExitCode.BAD_INPUT
    assert "chunks of 4100 bytes" in refused.stderr


def test_hdf5_dataset_expansion_exactly_at_the_ratio_and_one_past(
    tmp_path: Path, run_main: RunMain, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "zeros.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.zeros(1 << 16, "<f4"), chunks=(1 << 14,), compression="gzip")
    with h5py.File(path) as f:  # the reference: what the library says it stores
        declared, stored = 4 << 16, int(f["w"].id.get_storage_size())
    ratio = -(-declared // stored)  # the smallest whole ratio the dataset stays within
    assert ratio > 2  # so that one less is a different limit
    monkeypatch.setattr(limits, "SPARSE_CHECK_BYTES", 0)
    monkeypatch.setattr(limits, "MAX_EXPANSION", ratio)
    assert run_main("norms", path).code == ExitCode.OK
    monkeypatch.setattr(limits, "MAX_EXPANSION", ratio - 1)
    refused = run_main("norms", path)
    assert refused.code == ExitCode.BAD_INPUT
    assert f"declares {declared} bytes but stores only {stored}" in refused.stderr


def test_hdf5_root_attribute_count_exactly_at_the_library_limit_and_one_past() -> None:
    # h5py/HDF5 fail the 65,536th attribute of an object that tracks creation order.
    at = {f"k{i}": "" for i in range(HDF5_MAX_ATTRIBUTES)}
    assert Hdf5Writer.check_metadata(at, None) is None  # type: ignore[arg-type]
    past = dict(at, one_more="")
    problem = Hdf5Writer.check_metadata(past, None)  # type: ignore[arg-type]
    assert problem is not None
    assert f"at most {HDF5_MAX_ATTRIBUTES} metadata keys" in problem


# ---------------------------------------------------------------- inputs and side files


def test_a_fifo_is_refused_on_its_descriptor_without_reading(tmp_path: Path) -> None:
    # Nobody writes to it: a FIFO that were read would block, or stream a forged file.
    from clipcli.errors import InputError
    from clipcli.system.inputs import open_input_fd

    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match=r"is not a regular file \(a FIFO\)"):
        open_input_fd(fifo)


def test_read_input_exactly_at_its_size_limit_and_one_past(tmp_path: Path) -> None:
    from clipcli.errors import InputError
    from clipcli.system.inputs import read_input

    path = tmp_path / "config.json"
    path.write_bytes(b"x" * 100)
    data, _ = read_input(path, 100)
    assert data == path.read_bytes()
    with pytest.raises(InputError, match="is 100 bytes; the limit is 99"):
        read_input(path, 99)


def test_quantization_config_exactly_at_the_size_limit_and_one_past(tmp_path: Path) -> None:
    # A config.json of 16 MiB is read; one byte more is never slurped (no quantization).
    from clipcli.jobs.quantized import CONFIG_LIMIT, declared_method

    assert CONFIG_LIMIT == 16 << 20
    text = json.dumps({"quantization_config": {"quant_method": "fp8"}})
    config = tmp_path / "config.json"
    config.write_text(text + " " * (CONFIG_LIMIT - len(text)))
    assert config.stat().st_size == 16 << 20
    assert declared_method(tmp_path) == "fp8"
    config.write_text(text + " " * (CONFIG_LIMIT - len(text) + 1))
    assert declared_method(tmp_path) is None


# ---------------------------------------------------------------- option values (the library face)


@pytest.mark.parametrize("flag", ["norm", "average", "global_", "value"])
@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0])
def test_limits_must_be_positive_numbers(flag: str, bad: float) -> None:
    # Checked in build_spec itself, not only by the command-line parser: api callers too.
    from clipcli.errors import UsageError
    from clipcli.jobs.spec import build_spec

    with pytest.raises(UsageError, match="must be a positive number"):
        build_spec(**{flag: bad})  # type: ignore[arg-type]


def test_min_equal_to_max_is_accepted_and_min_above_max_refused() -> None:
    from clipcli.errors import UsageError
    from clipcli.jobs.spec import build_spec

    spec = build_spec(low=0.5, high=0.5)
    assert (spec.low, spec.high) == (0.5, 0.5)
    with pytest.raises(UsageError, match="--min 0.5 is greater than --max 0.25"):
        build_spec(low=0.5, high=0.25)
    with pytest.raises(UsageError, match="--min 1 is greater than --max 0.5"):
        build_spec(low=1.0, high=0.5)


@pytest.mark.parametrize(("axis", "fits"), [(-3, False), (-2, True), (1, True), (2, False)])
def test_axes_exactly_at_the_rank_and_one_past(axis: int, fits: bool) -> None:
    from clipcli.errors import DataRefusedError
    from clipcli.jobs.spec import axes_fit, normalize_axes

    shape = (3, 4)
    assert axes_fit([axis], shape) is fits
    if fits:
        assert normalize_axes((axis,), shape, "t") == (axis % 2,)
    else:
        with pytest.raises(DataRefusedError, match=f"has no axis {axis} \\(rank 2\\)"):
            normalize_axes((axis,), shape, "t")


def test_use_norm_must_be_finite() -> None:
    # TF's factor C / inf is 0: every tensor would be zeroed.
    from clipcli.errors import UsageError
    from clipcli.jobs.spec import build_spec

    assert build_spec(global_=1.0, use_norm=1e308).use_norm == 1e308
    with pytest.raises(UsageError, match="--use-norm must be finite"):
        build_spec(global_=1.0, use_norm=math.inf)


# ---------------------------------------------------------------- verdicts of a plan


def test_infinity_without_nan_is_refused_where_a_norm_is_needed(
    tmp_path: Path, run_main: RunMain
) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    save_file({"a": np.array([np.inf, 1.0], "<f4"), "b": np.ones(2, "<f4")}, str(src))
    for mode in (["--global", "1"], ["--norm", "1"], ["--average", "1"]):
        refused = run_main("clip", *mode, src, tmp_path / "out.safetensors")
        assert refused.code == ExitCode.REFUSED_DATA
        assert "'a' (1 non-finite)" in refused.stderr
        assert not (tmp_path / "out.safetensors").exists()


def test_a_zero_tensor_is_kept_not_scaled_in_global_mode(tmp_path: Path, run_main: RunMain) -> None:
    from safetensors.numpy import load_file, save_file

    src, out = tmp_path / "m.safetensors", tmp_path / "out.safetensors"
    save_file({"a": np.array([3.0, 4.0], "<f4"), "z": np.array([0.0, -0.0], "<f4")}, str(src))
    done = run_main("clip", "--global", "1", "--format", "json", src, out)
    assert done.code == ExitCode.OK, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["tensors"]}
    assert rows["a"]["changed"] is True
    assert (rows["z"]["changed"], rows["z"]["scale"]) == (False, None)
    assert load_file(str(out))["z"].tobytes() == load_file(str(src))["z"].tobytes()


# ---------------------------------------------------------------- side files of a model directory


def test_one_side_file_one_byte_past_a_gib_is_refused_before_writing(
    tmp_path: Path, run_main: RunMain
) -> None:
    from safetensors.numpy import save_file

    from clipcli.output import policy

    assert policy.SIDE_FILE_LIMIT == 1 << 30  # 1 GiB: configs and tokenizers are far smaller
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.arange(8, dtype=np.float32)}, str(model / "model.safetensors"))
    with open(model / "vocab.txt", "wb") as handle:  # sparse: nothing is written
        handle.truncate((1 << 30) + 1)
    out = tmp_path / "out"
    refused = run_main("clip", "--global", "1", "-q", model, out)
    assert refused.code == ExitCode.USAGE
    assert "--allow-large-side-files" in refused.stderr
    assert not out.exists()
