"""What clipcli writes, clipcli and the format's official reader read back (issue 18, item 5):
names, depths, header sizes and counts that OUT's format cannot hold are refused (exit 2)
before anything is written.

References: np.load (by key), h5py, safetensors.safe_open; the header size is computed by
json.dumps of the whole header, apart from clipcli's piecewise sum."""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from conftest import RunCli
from expect import one_error_line
from handmade import write_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layouts import bert_like
from safetensors import safe_open
from safetensors.numpy import save_file

import clipcli.formats.hdf5.limits as hdf5_limits
from clipcli import api
from clipcli.cli.boundary import exit_code_for
from clipcli.errors import ClipcliError
from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors import header as st_header
from clipcli.formats.safetensors import reader as st_reader

Cli = Callable[..., Run]


def official(path: Path, name: str) -> np.ndarray:
    """One tensor by its name, as the format's own reader looks it up."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return np.asarray(loaded[name])
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            return np.asarray(f[name][()])
    with safe_open(str(path), framework="np") as f:
        return np.asarray(f.get_tensor(name))


def clipcli_names(path: Path) -> list[str]:
    return [t.name for t in api.listing(path).tensors]


def refused_before_writing(run: Run, out: Path, *fragments: str) -> None:
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    for fragment in fragments:
        assert fragment in run.stderr, run.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


# ------------------------------------------------------------------ npz


def test_issue_example_a_and_a_npy_into_npz(clipcli: Cli, tmp_path: Path) -> None:
    """np.load(out)['a.npy'] returned a's values, and `clipcli ls out` exited 3."""
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.ones(2), "a.npy": np.zeros(3)})
    out = tmp_path / "out.npz"
    refused_before_writing(clipcli("convert", src, out), out, "'a.npy'", "np.load")


@pytest.mark.parametrize(
    "pair",
    [("a/b", "a//b"), ("a/b", "a/./b"), ("a/b", "a\\b"), ("b", "./b")],
    ids=["double_slash", "dot", "backslash", "dot_slash"],
)
def test_names_that_normalise_alike_are_refused_for_npz(
    clipcli: Cli, tmp_path: Path, pair: tuple[str, str]
) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {pair[0]: np.ones(2), pair[1]: np.ones(1)})
    out = tmp_path / "out.npz"
    refused_before_writing(clipcli("convert", src, out), out, "one zip member")


@pytest.mark.parametrize("name", ["\\x", "a\\..\\b", "/x", "x/"])
def test_npz_member_names_the_readers_refuse_are_not_written(
    clipcli: Cli, tmp_path: Path, name: str
) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {name: np.ones(2)})
    out = tmp_path / "out.npz"
    refused_before_writing(clipcli("convert", src, out), out, "escape")


def test_npz_keeps_names_that_are_distinct_members(tmp_path: Path) -> None:
    names = ["a.npy", "A", "a\\b", "./c"]
    src = write_safetensors(
        tmp_path / "in.safetensors", {n: np.full(i + 1, float(i)) for i, n in enumerate(names)}
    )
    out = tmp_path / "out.npz"
    api.convert(src, out)
    assert clipcli_names(out) == names
    for i, name in enumerate(names):
        np.testing.assert_array_equal(official(out, name), np.full(i + 1, float(i)))


# ------------------------------------------------------------------ HDF5


def deep_name(components: int) -> str:
    return "/".join(f"g{i}" for i in range(components - 1)) + "/t"


def test_hdf5_depth_at_the_limit_reads_back(tmp_path: Path) -> None:
    name = deep_name(hdf5_limits.MAX_DEPTH)
    src = write_safetensors(tmp_path / "in.safetensors", {name: np.arange(3.0)})
    out = tmp_path / "out.h5"
    api.convert(src, out)
    assert clipcli_names(out) == [name]
    np.testing.assert_array_equal(official(out, name), np.arange(3.0))


def test_hdf5_depth_past_the_limit_is_refused(clipcli: Cli, tmp_path: Path) -> None:
    """The issue's 70 components; and exactly one past the limit."""
    for components in (70, hdf5_limits.MAX_DEPTH + 1):
        src = write_safetensors(tmp_path / "in.safetensors", {deep_name(components): np.ones(1)})
        out = tmp_path / "out.h5"
        refused_before_writing(clipcli("convert", src, out), out, "at most 64 components")


@pytest.mark.parametrize("name", ["a/../b", "..", "a//b", "a/./b", "/a"])
def test_hdf5_paths_with_dot_dot_or_empty_components_are_refused(
    clipcli: Cli, tmp_path: Path, name: str
) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {name: np.ones(1)})
    out = tmp_path / "out.h5"
    refused_before_writing(clipcli("convert", src, out), out, "HDF5 dataset path")


def test_hdf5_group_and_dataset_clash_is_refused(clipcli: Cli, tmp_path: Path) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.ones(1), "a/b": np.ones(1)})
    out = tmp_path / "out.h5"
    refused_before_writing(clipcli("convert", src, out), out, "HDF5 group")


def test_keras_writer_asks_the_hdf5_name_rules() -> None:
    from clipcli.formats.hdf5 import Hdf5Writer
    from clipcli.formats.keras_archive import KerasArchiveWriter

    for name in ("a/../b", deep_name(65), "ok/name"):
        assert KerasArchiveWriter.check_name(name) == Hdf5Writer.check_name(name)
    assert KerasArchiveWriter.check_names(["a", "a/b"]) is not None


def attribute_metadata(count: int, largest: int) -> dict[str, str]:
    return {f"k{i}": "x" * (largest if i == 0 else 1) for i in range(count)}


def test_hdf5_metadata_at_the_attribute_budget_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each metadata value is a heap string; the reader bounds count x largest."""
    monkeypatch.setattr(hdf5_limits, "MAX_ATTRIBUTE_BYTES", 4 * 1000)
    src = write_safetensors(
        tmp_path / "in.safetensors", {"t": np.ones(2)}, attribute_metadata(4, 1000)
    )
    out = tmp_path / "out.h5"
    api.convert(src, out)
    assert api.listing(out).metadata == attribute_metadata(4, 1000)
    with h5py.File(out, "r") as f:
        assert f.attrs["k0"] == "x" * 1000


def test_hdf5_metadata_past_the_attribute_budget_is_refused(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hdf5_limits, "MAX_ATTRIBUTE_BYTES", 4 * 1000 - 1)
    src = write_safetensors(
        tmp_path / "in.safetensors", {"t": np.ones(2)}, attribute_metadata(4, 1000)
    )
    out = tmp_path / "out.h5"
    refused_before_writing(clipcli("convert", src, out), out, "metadata values")


# ------------------------------------------------------------------ safetensors


def full_header_length(infos: list[TensorInfo], metadata: dict[str, str]) -> int:
    """The reference: json.dumps of the whole header, as the official writer lays it out."""
    return len(st_header.build_header(infos, metadata)) - 8


def test_header_length_is_exactly_the_built_header() -> None:
    infos = [
        TensorInfo("w", np.dtype(np.float32), (3, 4), 48),
        TensorInfo('é"\\\n', np.dtype(np.float16), (), 2),
    ]
    for metadata in ({}, {"a": "b"}, {"ü": "\u2603" * 7, "x": ""}):
        for count in range(len(infos) + 1):
            assert st_header.header_length(infos[:count], metadata) == full_header_length(
                infos[:count], metadata
            )


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.text(min_size=1, max_size=6), unique=True, max_size=4),
    metadata=st.dictionaries(st.text(max_size=5), st.text(max_size=9), max_size=3),
)
def test_header_length_property(names: list[str], metadata: dict[str, str]) -> None:
    names = [n for n in names if n == n.encode("utf-8", "ignore").decode()]
    metadata = {
        k: v
        for k, v in metadata.items()
        if k == k.encode("utf-8", "ignore").decode() and v == v.encode("utf-8", "ignore").decode()
    }
    infos = [TensorInfo(n, np.dtype(np.float64), (i,), 8 * i) for i, n in enumerate(names)]
    assert st_header.header_length(infos, metadata) == full_header_length(infos, metadata)


def test_header_at_the_official_limit_is_accepted_and_one_past_refused() -> None:
    """100,000,000 bytes is the official reader's limit (HeaderTooLarge past it)."""
    infos = [TensorInfo("t", np.dtype(np.float32), (2,), 8)]
    limit = st_header.MAX_HEADER_BYTES
    empty = {"__metadata__": {"m": ""}, "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    unpadded = len(json.dumps(empty, separators=(",", ":")))
    at_limit = {"m": "x" * (limit - unpadded)}  # no padding needed: the limit is 8k
    assert st_header.header_length(infos, at_limit) == limit
    assert st_header.header_problem(infos, at_limit) is None
    past = {"m": at_limit["m"] + "x"}
    assert st_header.header_length(infos, past) == limit + 8  # padded to 8
    problem = st_header.header_problem(infos, past)
    assert problem is not None
    assert "100000000" in problem


def shrink_safetensors_limits(monkeypatch: pytest.MonkeyPatch, header: int, tensors: int) -> None:
    for module in (st_header, st_reader):
        monkeypatch.setattr(module, "MAX_HEADER_BYTES", header)
        monkeypatch.setattr(module, "MAX_TENSORS", tensors)


def h5_with_root_attributes(path: Path, value_bytes: int) -> Path:
    with h5py.File(path, "w") as f:
        f["t"] = np.ones(2, np.float32)
        f.attrs["big"] = "x" * value_bytes
    return path


def test_hdf5_attributes_into_safetensors_at_and_past_the_header_limit(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's 102 MB of root attributes, at a limit scaled down to 4,096 bytes: at it,
    written and read back by clipcli and safe_open; one past it, exit 2."""
    src = h5_with_root_attributes(tmp_path / "in.h5", 1000)
    out = tmp_path / "out.safetensors"
    with clipcli_reader(src) as reader:
        needed = st_header.header_length(reader.infos, dict(reader.metadata))
    shrink_safetensors_limits(monkeypatch, needed, 10)
    run = clipcli("convert", src, out)
    assert run.returncode == 0, run.stderr
    assert clipcli_names(out) == ["t"]
    np.testing.assert_array_equal(official(out, "t"), np.ones(2, np.float32))
    (length,) = struct.unpack("<Q", out.read_bytes()[:8])
    assert length == needed
    out.unlink()
    shrink_safetensors_limits(monkeypatch, needed - 1, 10)
    refused_before_writing(clipcli("convert", src, out), out, "safetensors header")


def clipcli_reader(path: Path):  # type: ignore[no-untyped-def]
    from clipcli.formats.opening import open_reader

    return open_reader(path)


def test_tensor_count_at_and_past_the_reader_cap(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clipcli's reader caps a safetensors file at MAX_TENSORS; it writes no more."""
    shrink_safetensors_limits(monkeypatch, st_header.MAX_HEADER_BYTES, 3)
    arrays = {f"t{i}": np.full(2, float(i)) for i in range(4)}
    src = tmp_path / "in.npz"
    np.savez(src, **dict(list(arrays.items())[:3]))  # type: ignore[arg-type]
    out = tmp_path / "out.safetensors"
    assert clipcli("convert", src, out).returncode == 0
    assert clipcli_names(out) == ["t0", "t1", "t2"]
    out.unlink()
    np.savez(src, **arrays)  # type: ignore[arg-type]
    refused_before_writing(clipcli("convert", src, out), out, "at most 3 tensors")


def test_metadata_as_a_tensor_name_is_refused(clipcli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "in.npz"
    np.savez(src, __metadata__=np.ones(2))
    out = tmp_path / "out.safetensors"
    refused_before_writing(clipcli("convert", src, out), out, "__metadata__")


def sharded_dir(directory: Path, metadata: dict[str, str]) -> Path:
    directory.mkdir()
    write_safetensors(directory / "model-1.safetensors", {"a": np.ones(2)}, metadata)
    write_safetensors(directory / "model-2.safetensors", {"b": np.ones(3)}, metadata)
    index = {
        "metadata": {"total_size": 40},
        "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_each_shard_header_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's header is the input shard's, which the reader already held to the same
    limits; checked anyway, with the limit lowered after reading, at it and one past it."""
    from clipcli.formats.sharded import ShardedWriter

    src = sharded_dir(tmp_path / "in", {"format": "pt", "note": "y" * 500})
    with clipcli_reader(src) as reader:
        first = reader.shard_reader("model-1.safetensors")
        needed = st_header.header_length(first.infos, dict(first.metadata))
        shrink_safetensors_limits(monkeypatch, needed, 10)
        assert ShardedWriter.check_metadata(reader.metadata, reader) is None
        shrink_safetensors_limits(monkeypatch, needed - 1, 10)
        problem = ShardedWriter.check_metadata(reader.metadata, reader)
        assert problem is not None
        assert "shard 'model-1.safetensors'" in problem
        shrink_safetensors_limits(monkeypatch, needed, 0)
        problem = ShardedWriter.check_metadata(reader.metadata, reader)
        assert problem is not None
        assert "at most 0 tensors" in problem


# ------------------------------------------------------------------ the round trip


NAME_PARTS = st.sampled_from(["a", "A", "b", ".", "..", "/", "\\", ".npy", "npy", "_", "é"])
NAMES = st.lists(
    st.lists(NAME_PARTS, min_size=1, max_size=5).map("".join), min_size=1, max_size=4, unique=True
)


def round_trip(names: list[str], suffix: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        arrays = {name: np.full(i + 1, i + 0.5) for i, name in enumerate(names)}
        src = write_safetensors(workdir / "in.safetensors", arrays)
        out = workdir / f"out{suffix}"
        refusal: ClipcliError | None = None
        try:
            api.convert(src, out, durable=False)
        except ClipcliError as exc:
            refusal = exc
        if refusal is not None:
            assert exit_code_for(refusal) == 2, refusal
            assert sorted(p.name for p in workdir.iterdir()) == ["in.safetensors"]
            return
        assert clipcli_names(out) == names  # clipcli reads back exactly these names
        with clipcli_reader(out) as reader:
            for info in reader.infos:
                np.testing.assert_array_equal(reader.read(info), arrays[info.name])
        for name, array in arrays.items():  # and the official reader, by name
            np.testing.assert_array_equal(official(out, name), array)


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=NAMES)
def test_written_names_read_back_with_clipcli_and_the_official_reader(
    suffix: str, names: list[str]
) -> None:
    round_trip(names, suffix)


# ------------------------------------------ issue 23, item 3: OUT's unknown extension


# (b.npy was here until issue 19 made .npy a format: tests/test_format_npy.py refuses a
# model directory into one .npy file, exit 2, as one line; b.gguf until issue 22 made
# .gguf one: tests/test_gguf_writer.py.)
@pytest.mark.parametrize("out", ["o.ckpt", "model.v2"])
@pytest.mark.parametrize("command", [["convert"], ["clip", "--global", "1"]])
def test_an_unknown_extension_is_refused_for_a_directory_input(
    tmp_path: Path, run_main: RunCli, out: str, command: list[str]
) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    done = run_main(*command, model, tmp_path / out)
    assert done.code == 2
    line = one_error_line(done.stderr)
    assert "unknown output extension" in line
    assert ".npz, .safetensors, .h5, .hdf5, .keras, .npy, .pt, .pth, .bin or .gguf" in line
    assert "end OUT with /" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-tiny"]


@pytest.mark.parametrize("out", ["o.ckpt", "o.ggml"])
def test_an_unknown_extension_reads_the_same_for_a_file_input(
    tmp_path: Path, run_main: RunCli, out: str
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": np.ones(3, np.float32)}, source)
    done = run_main("convert", source, tmp_path / out)
    assert done.code == 2
    listed = ".npz, .safetensors, .h5, .hdf5, .keras, .npy, .pt, .pth, .bin or .gguf"
    assert f"{listed}, or end OUT with /" in done.stderr


@pytest.mark.parametrize("out", ["merged", "llama-3.2-1b", "Qwen2.5-0.5B", "o.pt/"])
def test_a_directory_out_is_still_written_when_asked(
    tmp_path: Path, run_main: RunCli, out: str
) -> None:
    """No extension (a version number is none), or a trailing slash: a model directory."""
    model = bert_like(tmp_path / "bert-tiny")
    done = run_main(
        "convert", model, f"{tmp_path / out.rstrip('/')}{'/' if out[-1] == '/' else ''}"
    )
    assert done.code == 0, done.stderr
    written = tmp_path / out.rstrip("/")
    assert written.is_dir()
    assert (written / "model.safetensors.index.json").is_file()


def test_an_existing_directory_with_a_dot_is_still_the_target(
    tmp_path: Path, run_main: RunCli
) -> None:
    """A directory that already exists is what the user named: refused without --force as
    any existing OUT, replaced with it."""
    model = bert_like(tmp_path / "bert-tiny")
    first = run_main("convert", model, f"{tmp_path / 'out.v2'}/")
    assert first.code == 0, first.stderr
    again = run_main("convert", model, tmp_path / "out.v2")
    assert again.code == 2
    assert "already exists; pass --force" in again.stderr
    assert run_main("convert", model, tmp_path / "out.v2", "--force").code == 0
