"""Sharded Hugging Face model directories: reading, validation, writing, atomic output."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import RunCli
from expect import one_error_line
from layouts import bert_like
from safetensors import safe_open
from safetensors.numpy import load_file

from clipcli.errors import InputError, Interrupted, UsageError, WriteError
from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer
from clipcli.formats.safetensors import SafetensorsReader, SafetensorsWriter
from clipcli.formats.sharded import (
    DEFAULT_INDEX_NAME,
    ShardedReader,
    ShardedWriter,
    output_names,
    resolve_sharded,
    validate_sharded,
)
from clipcli.formats.sharded.layout import SAFETENSORS_NAMES
from clipcli.jobs.pipeline import write_tensors
from clipcli.output.target import DirectoryTarget, choose_target
from clipcli.system.footprint import InputFootprint

HIDDEN, INTERMEDIATE, VOCAB = 8, 16, 32
SHARDS = [f"model-{n:05d}-of-00003.safetensors" for n in (1, 2, 3)]
CONFIG = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}\n'
TOKENIZER = '{"version": "1.0", "model": {"type": "BPE"}}\n'


# ---------------------------------------------------------------- building model directories


def layer_shapes(n: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer, in the order a model defines (and HF's writer stores) them."""
    prefix = f"model.layers.{n}"
    return {
        f"{prefix}.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": (HIDDEN, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        f"{prefix}.input_layernorm.weight": (HIDDEN,),
    }


def shard_layout() -> list[dict[str, tuple[int, ...]]]:
    """Three shards: embeddings + layers 0-1, layers 2-3, layers 4-5 + final norm + head."""
    first = {"model.embed_tokens.weight": (VOCAB, HIDDEN)} | layer_shapes(0) | layer_shapes(1)
    second = layer_shapes(2) | layer_shapes(3)
    last = layer_shapes(4) | layer_shapes(5)
    last |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    return [first, second, last]


def bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """safetensors.numpy cannot save bf16; clipcli's streaming writer can."""
    infos = [TensorInfo(name, a.dtype, a.shape, a.nbytes) for name, a in tensors.items()]
    writer = SafetensorsWriter(path, Checkpoint(infos, metadata or {"format": "pt"}))
    for info in infos:
        writer.write(info, [tensors[info.name].reshape(-1)])
    writer.close()


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> Path:
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_size // 2},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = directory / DEFAULT_INDEX_NAME
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


@dataclass
class ModelDir:
    path: Path
    tensors: dict[str, np.ndarray]  # every tensor, by name
    shards: dict[str, list[str]]  # shard file -> tensor names in file order

    @property
    def index(self) -> Path:
        return self.path / DEFAULT_INDEX_NAME

    def load_index(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.index.read_text())
        return loaded

    def rewrite_index(self, edit: Callable[[dict[str, Any]], object]) -> None:
        index = self.load_index()
        edit(index)
        self.index.write_text(json.dumps(index))


def make_model_dir(directory: Path, seed: int = 0) -> ModelDir:
    directory.mkdir()
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    shards: dict[str, list[str]] = {}
    weight_map: dict[str, str] = {}
    for shard, shapes in zip(SHARDS, shard_layout(), strict=True):
        contents = {name: bf16(rng, shape) for name, shape in shapes.items()}
        write_safetensors(directory / shard, contents)
        tensors |= contents
        shards[shard] = list(contents)
        weight_map |= dict.fromkeys(contents, shard)
    write_index(directory, weight_map, sum(a.nbytes for a in tensors.values()))
    (directory / "config.json").write_text(CONFIG)
    (directory / "tokenizer.json").write_text(TOKENIZER)
    (directory / "generation_config.json").write_text('{"do_sample": true}\n')
    return ModelDir(directory, tensors, shards)


@pytest.fixture
def model(tmp_path: Path) -> ModelDir:
    return make_model_dir(tmp_path / "model")


@pytest.fixture
def single_file_model(tmp_path: Path) -> ModelDir:
    directory = tmp_path / "small"
    directory.mkdir()
    rng = np.random.default_rng(1)
    tensors = {name: bf16(rng, shape) for name, shape in shard_layout()[0].items()}
    write_safetensors(directory / "model.safetensors", tensors, {"format": "pt"})
    (directory / "config.json").write_text(CONFIG)
    return ModelDir(directory, tensors, {"model.safetensors": list(tensors)})


def open_model(path: Path) -> ShardedReader:
    resolved = resolve_sharded(path)
    assert resolved is not None
    return ShardedReader(*resolved)


@contextlib.contextmanager
def opened_model(path: Path) -> Iterator[ShardedReader]:
    reader = open_model(path)
    try:
        yield reader
    finally:
        reader.close()


@pytest.fixture
def reader(model: ModelDir) -> Iterator[ShardedReader]:
    opened = open_model(model.path)
    yield opened
    opened.close()


def drive(
    reader: Reader,
    writer: Writer,
    copy: bool = True,
    transform: Callable[[TensorInfo, np.ndarray], np.ndarray] | None = None,
) -> None:
    """Through clipcli's one write loop: a kernel copy where possible, else streamed chunks
    (transformed if asked); abort() on failure, close() after the last tensor."""

    def chunks_of(info: TensorInfo) -> Iterable[np.ndarray] | None:
        if transform is None and copy:
            return None
        chunks = reader.chunks(info, chunk_elems=20)
        if transform is None:
            return chunks
        return (transform(info, chunk) for chunk in chunks)

    write_tensors(reader, writer, chunks_of)


def clip_into(
    reader: ShardedReader | SafetensorsReader,
    out: Path,
    copy: bool = True,
    transform: Callable[[TensorInfo, np.ndarray], np.ndarray] | None = None,
) -> None:
    with atomic_directory(out, force=False, durable=False) as tmp:
        checkpoint = Checkpoint(list(reader.infos), dict(reader.metadata), reader)
        drive(reader, ShardedWriter(tmp, checkpoint), copy, transform)


@contextlib.contextmanager
def atomic_directory(
    out: Path, force: bool, durable: bool = True, expected: frozenset[str] = frozenset()
) -> Iterator[Path]:
    """A directory target checked (against an input elsewhere) and staged, as api.clip
    does: the body fills the staged directory, which then becomes OUT."""
    target = DirectoryTarget(out, force=force, durable=durable)
    target.check(InputFootprint(out.parent / "elsewhere", []), expected)
    with target.stage() as tmp:
        yield tmp


def same_files(left: Path, right: Path, names: list[str]) -> bool:
    return all(filecmp.cmp(left / name, right / name, shallow=False) for name in names)


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- resolve_sharded


def test_resolve_directory_and_index_file(model: ModelDir) -> None:
    assert resolve_sharded(model.path) == (model.path, model.index, SAFETENSORS_NAMES)
    assert resolve_sharded(model.index) == (model.path, model.index, SAFETENSORS_NAMES)


def test_resolve_single_file_directory(single_file_model: ModelDir) -> None:
    assert resolve_sharded(single_file_model.path) == (
        single_file_model.path,
        None,
        SAFETENSORS_NAMES,
    )


def test_resolve_plain_files_are_not_sharded(model: ModelDir, tmp_path: Path) -> None:
    assert resolve_sharded(model.path / SHARDS[0]) is None
    assert resolve_sharded(model.path / "config.json") is None
    assert resolve_sharded(tmp_path / "missing.safetensors") is None


def test_resolve_other_index_name(model: ModelDir) -> None:
    renamed = model.path / "diffusion_pytorch_model.safetensors.index.json"
    model.index.rename(renamed)
    assert resolve_sharded(model.path) == (model.path, renamed, SAFETENSORS_NAMES)


def test_resolve_prefers_model_index(model: ModelDir) -> None:
    (model.path / "other.safetensors.index.json").write_text("{}")
    assert resolve_sharded(model.path) == (model.path, model.index, SAFETENSORS_NAMES)


def test_resolve_refuses_two_indexes_without_model_index(model: ModelDir) -> None:
    model.index.rename(model.path / "a.safetensors.index.json")
    (model.path / "b.safetensors.index.json").write_text("{}")
    with pytest.raises(InputError, match="several safetensors indexes"):
        resolve_sharded(model.path)


def test_resolve_refuses_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no safetensors index or model file"):
        resolve_sharded(tmp_path)


def test_resolve_refuses_shards_without_index(model: ModelDir) -> None:
    model.index.unlink()
    with pytest.raises(InputError, match="3 safetensors files .* but no index"):
        resolve_sharded(model.path)


# ---------------------------------------------------------------- reading


def test_reader_lists_shards_in_name_order_tensors_in_file_order(
    model: ModelDir, reader: ShardedReader
) -> None:
    expected = [name for shard in SHARDS for name in model.shards[shard]]
    assert [info.name for info in reader.infos] == expected
    assert expected != sorted(expected)  # file order, not name order
    assert len(reader.infos) == 33
    assert reader.format_name == "safetensors-sharded"
    assert reader.shard_names == SHARDS
    assert reader.directory == model.path
    assert reader.index_path == model.index
    for shard, names in model.shards.items():
        assert all(reader.shard_of(name) == shard for name in names)
        assert reader.shard_reader(shard).path == model.path / shard


def test_reader_infos_match_the_data(model: ModelDir, reader: ShardedReader) -> None:
    for info in reader.infos:
        array = model.tensors[info.name]
        assert (info.dtype_name, info.shape, info.nbytes) == ("bfloat16", array.shape, array.nbytes)


def test_reader_data_equals_safe_open(model: ModelDir, reader: ShardedReader) -> None:
    for shard in SHARDS:
        with safe_open(str(model.path / shard), framework="np") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                info = next(i for i in reader.infos if i.name == name)
                official = handle.get_tensor(name)
                # bf16 is not a numpy dtype that safetensors knows; compare the raw bytes.
                assert reader.read(info).tobytes() == official.tobytes()
                assert reader.read(info).shape == tuple(handle.get_slice(name).get_shape())


def test_reader_chunks_and_loaders_cover_the_tensor(model: ModelDir, reader: ShardedReader) -> None:
    for info in reader.infos:
        expected = model.tensors[info.name].reshape(-1).tobytes()
        chunks = list(reader.chunks(info, chunk_elems=7))
        assert all(c.size <= 7 for c in chunks)
        assert b"".join(c.tobytes() for c in chunks) == expected
        loaded = b"".join(load().tobytes() for load in reader.chunk_loaders(info))
        assert loaded == expected


def test_reader_metadata_is_the_index_metadata_as_strings(
    model: ModelDir, reader: ShardedReader
) -> None:
    total = sum(a.nbytes for a in model.tensors.values())
    assert dict(reader.metadata) == {
        "total_size": str(total),
        "total_parameters": str(total // 2),
    }


def test_reader_other_files_and_skipped_entries(model: ModelDir) -> None:
    (model.path / "original").mkdir()
    (model.path / "original" / "consolidated.00.pth").write_bytes(b"weights")
    (model.path / "pytorch_model.bin").write_bytes(b"weights")
    (model.path / "pytorch_model.bin.index.json").write_text("{}")
    (model.path / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    with opened_model(model.path) as opened:
        assert [p.name for p in opened.other_files()] == [
            ".gitattributes",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
        ]
        # Folders are walked (sentence-transformers keeps modules there); weight files in
        # other formats are left out wherever they are.
        assert [p.name for p in opened.side_folders()] == ["original"]
        assert [p.relative_to(model.path).as_posix() for p in opened.skipped_files()] == [
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
            "original/consolidated.00.pth",
        ]


def test_reader_through_the_index_path(model: ModelDir) -> None:
    with opened_model(model.index) as opened:
        assert len(opened.infos) == 33


def test_single_file_directory_reader(single_file_model: ModelDir) -> None:
    with opened_model(single_file_model.path) as opened:
        assert opened.index_path is None
        assert opened.shard_names == ["model.safetensors"]
        assert [i.name for i in opened.infos] == single_file_model.shards["model.safetensors"]
        assert dict(opened.metadata) == {"format": "pt"}
        assert [p.name for p in opened.other_files()] == ["config.json"]


# ---------------------------------------------------------------- validation errors


def test_missing_shard_file(model: ModelDir) -> None:
    (model.path / SHARDS[1]).unlink()
    with pytest.raises(InputError, match=f"{SHARDS[1]}: shard listed in .* does not exist"):
        open_model(model.path)


def test_tensor_missing_from_its_shard(model: ModelDir) -> None:
    model.rewrite_index(
        lambda index: index["weight_map"].update({"model.phantom.weight": SHARDS[1]})
    )
    with pytest.raises(
        InputError, match=f"'model.phantom.weight': not found in shard '{SHARDS[1]}'"
    ):
        open_model(model.path)


def test_tensor_listed_under_the_wrong_shard(model: ModelDir) -> None:
    model.rewrite_index(lambda index: index["weight_map"].update({"lm_head.weight": SHARDS[0]}))
    with pytest.raises(InputError, match=f"not found in shard '{SHARDS[0]}' \\(it is in shard"):
        open_model(model.path)


def test_tensor_listed_twice_in_the_index_text(model: ModelDir) -> None:
    text = model.index.read_text()
    entry = f'"lm_head.weight": "{SHARDS[2]}"'
    assert entry in text
    model.index.write_text(text.replace(entry, f'"lm_head.weight": "{SHARDS[0]}",\n    {entry}'))
    with pytest.raises(InputError, match="tensor 'lm_head.weight': listed twice in the index"):
        open_model(model.path)


def test_tensor_stored_in_two_shards(model: ModelDir) -> None:
    rng = np.random.default_rng(5)
    contents = {name: model.tensors[name] for name in model.shards[SHARDS[2]]}
    contents["model.embed_tokens.weight"] = bf16(rng, (VOCAB, HIDDEN))
    write_safetensors(model.path / SHARDS[2], contents)
    with pytest.raises(InputError, match="'model.embed_tokens.weight': stored in shard .* again"):
        open_model(model.path)


def test_tensor_in_a_shard_but_not_in_the_index(model: ModelDir) -> None:
    model.rewrite_index(lambda index: index["weight_map"].pop("model.norm.weight"))
    with pytest.raises(InputError, match="'model.norm.weight': is in this shard but missing"):
        open_model(model.path)


@pytest.mark.parametrize(
    "shard",
    [
        f"../{SHARDS[0]}",
        f"sub/{SHARDS[0]}",
        f"/etc/{SHARDS[0]}",
        "..",
        "model-00001-of-00003.bin",
        "",
    ],
)
def test_shard_name_must_be_a_plain_file_name(model: ModelDir, shard: str) -> None:
    model.rewrite_index(lambda index: index["weight_map"].update({"lm_head.weight": shard}))
    with pytest.raises(InputError, match="is not a plain \\*.safetensors file name"):
        open_model(model.path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"metadata": {}}', 'no "weight_map" object'),
        ('{"weight_map": []}', 'no "weight_map" object'),
        ('{"weight_map": {}}', "lists no tensors"),
        ('{"weight_map": {"a": 3}}', "shard 3 is not a string"),
        ('{"metadata": 1, "weight_map": {"a": "x.safetensors"}}', '"metadata" is not an object'),
        ('{"metadata": {}, "metadata": {}, "weight_map": {}}', "key 'metadata' appears twice"),
    ],
)
def test_malformed_index(model: ModelDir, text: str, problem: str) -> None:
    model.index.write_text(text)
    with pytest.raises(InputError, match=problem):
        open_model(model.path)


def test_index_not_utf8(model: ModelDir) -> None:
    model.index.write_bytes(b'{"weight_map": {"\xff": "a.safetensors"}}')
    with pytest.raises(InputError, match="not valid UTF-8"):
        open_model(model.path)


def test_corrupt_shard_is_an_input_error(model: ModelDir) -> None:
    (model.path / SHARDS[1]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(InputError, match=SHARDS[1]):
        open_model(model.path)


def test_symlink_out_of_the_directory_is_refused(model: ModelDir, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (model.path / "tokenizer.json").unlink()
    (model.path / "tokenizer.json").symlink_to(secret)
    with pytest.raises(InputError, match="tokenizer.json: links to .*outside the model directory"):
        open_model(model.path)


def test_shard_symlink_out_of_the_directory_is_refused(model: ModelDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.safetensors"
    (model.path / SHARDS[0]).rename(elsewhere)
    (model.path / SHARDS[0]).symlink_to(elsewhere)
    with pytest.raises(InputError, match="outside the model directory"):
        open_model(model.path)


def test_dangling_symlink_is_refused(model: ModelDir, tmp_path: Path) -> None:
    (model.path / "vocab.txt").symlink_to(tmp_path / "gone")
    with pytest.raises(InputError, match="vocab.txt: is a dangling symlink"):
        open_model(model.path)


def test_fifo_is_refused(model: ModelDir) -> None:
    os.mkfifo(model.path / "pipe")
    with pytest.raises(InputError, match="pipe: is not a regular file"):
        open_model(model.path)


def test_symlinks_inside_the_directory_are_read(model: ModelDir) -> None:
    (model.path / "tokenizer_config.json").symlink_to("config.json")
    with opened_model(model.path) as opened:
        assert "tokenizer_config.json" in [p.name for p in opened.other_files()]


def test_hub_cache_snapshot_links_into_blobs(model: ModelDir, tmp_path: Path) -> None:
    """huggingface_hub stores files once in blobs/ and links them from snapshots/<rev>/."""
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, entry in enumerate(sorted(model.path.iterdir())):
        blob = blobs / f"blob{number}"
        entry.rename(blob)
        (snapshot / entry.name).symlink_to(os.path.relpath(blob, snapshot))
    with opened_model(snapshot) as opened:
        assert len(opened.infos) == 33
    validate_sharded(snapshot)


def test_validate_accepts_a_good_directory(model: ModelDir, single_file_model: ModelDir) -> None:
    validate_sharded(model.path)
    validate_sharded(model.index)
    validate_sharded(single_file_model.path)


def test_validate_checks_total_size(model: ModelDir) -> None:
    model.rewrite_index(lambda index: index["metadata"].update(total_size=12))
    with pytest.raises(InputError, match="total_size is 12 but the tensors hold"):
        validate_sharded(model.path)
    model.rewrite_index(lambda index: index["metadata"].pop("total_size"))
    with pytest.raises(InputError, match="total_size is None, not an integer"):
        validate_sharded(model.path)


def test_validate_reports_structural_errors(model: ModelDir) -> None:
    (model.path / SHARDS[2]).unlink()
    with pytest.raises(InputError, match="does not exist"):
        validate_sharded(model.path)


def test_validate_refuses_a_plain_file(model: ModelDir) -> None:
    with pytest.raises(InputError, match="not a model directory"):
        validate_sharded(model.path / "config.json")


# ---------------------------------------------------------------- writing


@pytest.mark.parametrize("copy", [True, False], ids=["kernel-copy", "streamed"])
def test_unchanged_round_trip_is_identical(
    model: ModelDir, reader: ShardedReader, tmp_path: Path, copy: bool
) -> None:
    out = tmp_path / "out"
    clip_into(reader, out, copy=copy)
    assert entries(out) == entries(model.path)
    assert same_files(model.path, out, SHARDS)
    assert same_files(model.path, out, ["config.json", "tokenizer.json", "generation_config.json"])
    assert json.loads((out / DEFAULT_INDEX_NAME).read_text()) == model.load_index()
    validate_sharded(out)


def test_written_index_is_sorted_like_transformers(reader: ShardedReader, tmp_path: Path) -> None:
    out = tmp_path / "out"
    clip_into(reader, out)
    text = (out / DEFAULT_INDEX_NAME).read_text()
    index = json.loads(text)
    assert list(index) == ["metadata", "weight_map"]
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert text.endswith("}\n")
    assert '\n  "metadata": {' in text


def test_changed_tensor_round_trip(model: ModelDir, reader: ShardedReader, tmp_path: Path) -> None:
    target = "model.layers.3.mlp.up_proj.weight"

    def halve(info: TensorInfo, chunk: np.ndarray) -> np.ndarray:
        if info.name != target:
            return chunk
        return (chunk.astype(np.float32) * 0.5).astype(chunk.dtype)

    out = tmp_path / "out"
    clip_into(reader, out, transform=halve)
    assert same_files(model.path, out, [SHARDS[0], SHARDS[2]])
    assert not same_files(model.path, out, [SHARDS[1]])
    assert json.loads((out / DEFAULT_INDEX_NAME).read_text()) == model.load_index()
    with opened_model(out) as written:
        for info in written.infos:
            expected = model.tensors[info.name]
            if info.name == target:
                expected = (expected.astype(np.float32) * 0.5).astype(expected.dtype)
            assert written.read(info).tobytes() == expected.tobytes()


def test_index_keeps_other_keys_and_recomputes_total_size(model: ModelDir, tmp_path: Path) -> None:
    def annotate(index: dict[str, Any]) -> None:
        index["metadata"] = {"total_size": 1, "quantization": {"bits": 16}}
        index["format_note"] = "kept"

    model.rewrite_index(annotate)
    with opened_model(model.path) as opened:
        assert opened.metadata["quantization"] == '{"bits": 16}'
        clip_into(opened, tmp_path / "out")
    index = json.loads((tmp_path / "out" / DEFAULT_INDEX_NAME).read_text())
    total = sum(a.nbytes for a in model.tensors.values())
    assert index["metadata"] == {"total_size": total, "quantization": {"bits": 16}}
    assert index["format_note"] == "kept"
    assert index["weight_map"] == model.load_index()["weight_map"]


@pytest.mark.usefixtures("reader")
def test_round_trip_keeps_subdirectories_and_skips_other_weights(
    model: ModelDir, tmp_path: Path
) -> None:
    """Subfolders are part of the model (issue 11: 1_Pooling/ was lost); weights in other
    formats are not clipped, so they are not copied, wherever they are."""
    (model.path / "original").mkdir()
    (model.path / "original" / "params.json").write_text("{}")
    (model.path / "original" / "consolidated.00.pth").write_bytes(b"unclipped")
    (model.path / "pytorch_model.bin").write_bytes(b"unclipped")
    with opened_model(model.path) as opened:
        clip_into(opened, tmp_path / "out")
    assert "pytorch_model.bin" not in entries(tmp_path / "out")
    assert entries(tmp_path / "out" / "original") == ["params.json"]


def test_copied_symlink_becomes_a_regular_file(model: ModelDir, tmp_path: Path) -> None:
    (model.path / "tokenizer_config.json").symlink_to("config.json")
    with opened_model(model.path) as opened:
        clip_into(opened, tmp_path / "out")
    copied = tmp_path / "out" / "tokenizer_config.json"
    assert not copied.is_symlink()
    assert copied.read_text() == CONFIG


def test_shard_writers_open_one_at_a_time(reader: ShardedReader, tmp_path: Path) -> None:
    """Lazily: a shard file exists only once its first tensor arrived."""
    target = tmp_path / "out"
    target.mkdir()
    writer = ShardedWriter(target, Checkpoint(list(reader.infos), dict(reader.metadata), reader))
    seen: list[list[str]] = []
    for info in reader.infos:
        assert writer.copy_unchanged(reader, info)
        seen.append(entries(target))
    writer.close()
    first_of_second = len(reader.shard_reader(SHARDS[0]).infos)
    assert seen[0] == [SHARDS[0]]
    assert seen[first_of_second] == SHARDS[:2]
    assert seen[-1] == SHARDS


def test_writer_refuses_tensors_out_of_order(reader: ShardedReader, tmp_path: Path) -> None:
    writer = ShardedWriter(tmp_path, Checkpoint(list(reader.infos), {}, reader))
    second = reader.infos[1]
    with pytest.raises(ValueError, match="arrived out of order"):
        writer.write(second, reader.chunks(second))
    writer.abort()


def test_writer_refuses_close_before_every_tensor(reader: ShardedReader, tmp_path: Path) -> None:
    writer = ShardedWriter(tmp_path, Checkpoint(list(reader.infos), {}, reader))
    first = reader.infos[0]
    writer.write(first, reader.chunks(first))
    with pytest.raises(ValueError, match="after 1 of 33 tensors"):
        writer.close()
    writer.abort()


def test_writer_needs_a_directory(reader: ShardedReader, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs an existing directory"):
        ShardedWriter(tmp_path / "absent", Checkpoint(list(reader.infos), {}, reader))


def test_writer_dtype_check_is_safetensors() -> None:
    info = TensorInfo("s", np.dtype("U4"), (1,), 16)
    assert ShardedWriter.check_dtype(info) == SafetensorsWriter.check_dtype(info)
    assert ShardedWriter.check_dtype(info) is not None


def test_single_file_model_round_trip(single_file_model: ModelDir, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened_model(single_file_model.path) as opened:
        clip_into(opened, out)
    assert entries(out) == ["config.json", "model.safetensors"]
    assert same_files(single_file_model.path, out, ["config.json", "model.safetensors"])
    validate_sharded(out)


def test_plain_safetensors_source_becomes_model_safetensors(
    model: ModelDir, tmp_path: Path
) -> None:
    source = SafetensorsReader(model.path / SHARDS[1])
    try:
        out = tmp_path / "out"
        with atomic_directory(out, force=False, durable=False) as tmp:
            infos = list(source.infos)
            drive(source, ShardedWriter(tmp, Checkpoint(infos, {"note": "hi"}, source)))
    finally:
        source.close()
    assert entries(out) == ["model.safetensors"]
    with SafetensorsReader(out / "model.safetensors") as written:
        assert dict(written.metadata) == {"note": "hi"}
        assert [i.name for i in written.infos] == model.shards[SHARDS[1]]


def test_shards_joined_into_one_file(
    model: ModelDir, reader: ShardedReader, tmp_path: Path
) -> None:
    """`clip model/ merged.safetensors`: the shards' shared __metadata__, streamed."""
    merged = tmp_path / "merged.safetensors"
    metadata = reader.common_shard_metadata()
    assert metadata == {"format": "pt"}
    drive(reader, SafetensorsWriter(merged, Checkpoint(list(reader.infos), metadata, reader)))
    with SafetensorsReader(merged) as written:
        assert dict(written.metadata) == {"format": "pt"}
        for info in written.infos:
            assert written.read(info).tobytes() == model.tensors[info.name].tobytes()


def test_common_shard_metadata_keeps_only_shared_entries(model: ModelDir) -> None:
    contents = {name: model.tensors[name] for name in model.shards[SHARDS[1]]}
    write_safetensors(model.path / SHARDS[1], contents, {"format": "pt", "extra": "only here"})
    with opened_model(model.path) as opened:
        assert opened.common_shard_metadata() == {"format": "pt"}


# ---------------------------------------------------------------- atomic_directory


def test_atomic_directory_appears_with_the_umask_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    umask = os.umask(0o022)
    try:
        with atomic_directory(out, force=False) as tmp:
            # OUT is made inside the run's private work directory (so that mkdir gives it
            # its final mode, setgid from a setgid parent included) and renamed out
            # (the writer's path reaches it through its descriptor, /proc/self/fd/N)
            work = tmp.parent.resolve()
            assert work.parent == tmp_path
            assert work.name.startswith(".out.")
            assert tmp.name == "out"
            assert not out.exists()
            (tmp / "a.txt").write_text("a")
    finally:
        os.umask(umask)
    assert entries(out) == ["a.txt"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert entries(tmp_path) == ["out"]


@pytest.mark.usefixtures("model")
def test_atomic_directory_removed_on_error_and_out_untouched(tmp_path: Path) -> None:
    out = make_model_dir(tmp_path / "out", seed=9).path
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with (  # noqa: PT012 (the failure must happen inside the atomic directory)
        pytest.raises(RuntimeError, match="boom"),
        atomic_directory(out, force=True, expected=frozenset(before)) as tmp,
    ):
        (tmp / "partial.safetensors").write_bytes(b"half")
        raise RuntimeError("boom")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert entries(tmp_path) == ["model", "out"]


def test_atomic_directory_interrupt_becomes_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(Interrupted), atomic_directory(out, force=False):
        raise KeyboardInterrupt
    assert entries(tmp_path) == []


def test_atomic_directory_oserror_becomes_write_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="no output written"), atomic_directory(out, False):
        raise OSError(28, "No space left on device")
    assert entries(tmp_path) == []


def test_atomic_directory_missing_parent_is_write_error(tmp_path: Path) -> None:
    with (
        pytest.raises(WriteError, match="does not exist"),
        atomic_directory(tmp_path / "no" / "out", force=False),
    ):
        pass


def test_atomic_directory_failed_writer_leaves_nothing(
    reader: ShardedReader, tmp_path: Path
) -> None:
    out = tmp_path / "out"

    def fail_midway(info: TensorInfo, chunk: np.ndarray) -> np.ndarray:
        if info.name == "model.layers.4.mlp.up_proj.weight":
            raise OSError(28, "No space left on device")
        return chunk

    with pytest.raises(WriteError, match="disk full"):
        clip_into(reader, out, transform=fail_midway)
    assert entries(tmp_path) == ["model"]


def test_atomic_directory_force_replaces_existing(
    model: ModelDir, reader: ShardedReader, tmp_path: Path
) -> None:
    out = make_model_dir(tmp_path / "out", seed=9).path
    os.chmod(out, 0o750)
    with atomic_directory(out, force=True, expected=output_names(reader)) as tmp:
        drive(reader, ShardedWriter(tmp, Checkpoint(list(reader.infos), {}, reader)))
    assert same_files(model.path, out, SHARDS)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert entries(tmp_path) == ["model", "out"]  # the old directory is gone


def test_atomic_directory_force_refuses_a_directory_with_other_files(
    reader: ShardedReader, tmp_path: Path
) -> None:
    """--force replaces only what clipcli itself would write: one stray file stops it."""
    out = make_model_dir(tmp_path / "out", seed=9).path
    (out / "stale.txt").write_text("old")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with (
        pytest.raises(UsageError, match="'stale.txt'"),
        atomic_directory(out, force=True, expected=output_names(reader)),
    ):
        pass
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert entries(tmp_path) == ["model", "out"]


def test_atomic_directory_force_replaces_a_file_or_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    with atomic_directory(link, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert not link.is_symlink()
    assert entries(link) == ["new.txt"]
    assert entries(target) == ["keep.txt"]  # the link's target is never touched
    file_out = tmp_path / "file"
    file_out.write_text("x")
    with atomic_directory(file_out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert entries(file_out) == ["new.txt"]
    assert entries(tmp_path) == ["file", "link", "target"]


def test_atomic_directory_without_force_refuses_existing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(UsageError, match="already exists"), atomic_directory(out, force=False):
        pass
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_directory(empty, force=False) as tmp:
        (tmp / "y").write_text("y")
    assert entries(empty) == ["y"]


# ---------------------------------------------------------------- choosing and checking OUT


def test_choose_target_directory_only_when_asked(tmp_path: Path) -> None:
    """A model directory IN with an extensionless OUT writes a directory; a single file IN
    gets one only for a trailing slash or an existing empty directory."""

    def kind(out: str, input_is_directory: bool) -> str:
        return choose_target(
            out, input_is_directory=input_is_directory, force=False, durable=False
        ).kind

    assert kind(str(tmp_path / "clipped"), True) == "directory"
    assert kind(str(tmp_path / "merged.safetensors"), True) == "file"
    assert kind(f"{tmp_path / 'clipped'}/", False) == "directory"
    (tmp_path / "empty").mkdir()
    assert kind(str(tmp_path / "empty"), False) == "directory"
    with pytest.raises(UsageError, match="unknown output extension"):
        kind(str(tmp_path / "clipped"), False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="name the file to write inside it"):
        kind(str(tmp_path / "full"), False)
    with pytest.raises(UsageError, match="standard output"):
        kind("-", False)


def test_directory_target_checks(model: ModelDir, reader: ShardedReader, tmp_path: Path) -> None:
    footprint = InputFootprint(model.path, reader.source_files())
    expected = output_names(reader)

    def check(out: Path, force: bool) -> None:
        DirectoryTarget(out, force=force, durable=False).check(footprint, expected)

    check(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check(tmp_path / "empty", force=False)
    other = make_model_dir(tmp_path / "other", seed=3).path
    with pytest.raises(UsageError, match="already exists"):
        check(other, force=False)
    check(other, force=True)
    for inside in (model.path, tmp_path, model.path / "sub", model.path / SHARDS[0]):
        with pytest.raises(UsageError, match="output (is|contains) .*input"):
            check(inside, force=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    with pytest.raises(UsageError, match="'notes.txt'"):
        check(home, force=True)
    with pytest.raises(WriteError, match="does not exist"):
        check(tmp_path / "no" / "out", force=False)


# ----------------------------------------------- issue 23, item 2: derived index keys


def test_joining_a_transformers5_directory_needs_no_allow_lossy(
    tmp_path: Path, run_main: RunCli
) -> None:
    model = bert_like(tmp_path / "bert-tiny")
    merged = tmp_path / "merged.safetensors"
    done = run_main("convert", model, merged)
    assert done.code == 0, done.stderr
    assert "warning" not in done.stderr
    expected: dict[str, np.ndarray] = {}
    for shard in sorted(model.glob("*.safetensors")):
        expected |= load_file(shard)
    written = load_file(merged)
    assert written.keys() == expected.keys()
    for name, array in expected.items():
        assert written[name].tobytes() == array.tobytes()
    with open(merged, "rb") as handle:  # the official reader's view of __metadata__
        header_size = int.from_bytes(handle.read(8), "little")
        assert json.loads(handle.read(header_size))["__metadata__"] == {"format": "pt"}


def test_any_other_index_key_is_still_refused(tmp_path: Path, run_main: RunCli) -> None:
    model = bert_like(tmp_path / "bert-tiny", {"total_flops": 7})
    done = run_main("convert", model, tmp_path / "merged.safetensors")
    assert done.code == 2
    line = one_error_line(done.stderr)
    assert "('total_flops')" in line
    assert "total_parameters" not in line
    assert not (tmp_path / "merged.safetensors").exists()


def test_allow_lossy_help_names_index_metadata(run_main: RunCli) -> None:
    done = run_main("convert", "--help")
    assert done.code == 0
    assert "index metadata" in " ".join(done.stdout.split())
