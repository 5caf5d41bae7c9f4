"""Weight files beside the ones read (issue 18, item 7): a model directory's other weight
files, known by suffix or by content and at any depth, are never copied into OUT (they would
ship unclipped weights), and each is named in a note; a model directory written to one file
says in one note line which of its files OUT leaves out.

The files judged by content are written by their own tools (safetensors, h5py, numpy,
pickle, zipfile)."""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from safetensors.numpy import save_file

Cli = Callable[..., Run]


def model_dir(directory: Path) -> Path:
    directory.mkdir()
    save_file({"w": np.full(4, 3.0, np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (directory / "tokenizer.json").write_text("{}")
    return directory


def every_file(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def keras_file(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", "{}")
        archive.writestr("model.weights.h5", b"\x89HDF\r\n\x1a\n")


def test_issue_example_model_keras_beside_model_safetensors(clipcli: Cli, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "in")
    keras_file(src / "model.keras")
    out = tmp_path / "out"
    run = clipcli("clip", "--global", "1", "--quiet", src, out)
    assert run.returncode == 0, run.stderr
    assert every_file(out) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert "left out model.keras" in run.stderr


def write_by_content(path: Path, kind: str) -> None:
    if kind == "safetensors":
        save_file({"x": np.ones(2, np.float32)}, str(path))
    elif kind == "hdf5":
        with h5py.File(path, "w") as f:
            f["x"] = np.ones(2)
    elif kind == "hdf5_user_block":
        with h5py.File(path, "w", userblock_size=512) as f:
            f["x"] = np.ones(2)
    elif kind == "npy":
        with open(path, "wb") as handle:
            np.save(handle, np.ones(2))
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"x": [1.0, 2.0]}, protocol=2))
    elif kind.startswith("text_pickle"):  # protocols 0 and 1 have no \x80 header
        protocol, count = (0, 4) if kind.endswith("0") else (1, 100_000)  # past the probe
        path.write_bytes(pickle.dumps({"w": np.ones(count, np.float32)}, protocol=protocol))
    elif kind == "zip":
        with open(path, "wb") as handle:
            np.savez(handle, x=np.ones(2))
    elif kind == "gguf":
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(16))
    elif kind == "tflite":
        path.write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(16))


CONTENT_KINDS = [
    "safetensors",
    "hdf5",
    "hdf5_user_block",
    "npy",
    "pickle",
    "text_pickle0",
    "text_pickle1",
    "zip",
    "gguf",
    "tflite",
]


@pytest.mark.parametrize("kind", CONTENT_KINDS)
@pytest.mark.parametrize("where", ["weights", "sub/blob"])
def test_weight_files_without_a_known_suffix_are_left_out_by_content(
    clipcli: Cli, tmp_path: Path, kind: str, where: str
) -> None:
    src = model_dir(tmp_path / "in")
    target = src / where
    target.parent.mkdir(exist_ok=True)
    write_by_content(target, kind)
    out = tmp_path / "out"
    run = clipcli("clip", "--global", "1", "--quiet", src, out)
    assert run.returncode == 0, run.stderr
    assert where not in every_file(out)
    assert f"left out {where}:" in run.stderr
    assert "weights in another format" in run.stderr


@pytest.mark.parametrize(
    "name",
    [
        "model.keras",
        "sub/arrays.npy",
        "model.tflite",
        "tf/saved_model.pb",
        "tf/variables/variables.data-00000-of-00001",
        "tf/variables/variables.index",
        "sklearn.pkl",
        "model.GGUF",
    ],
)
def test_weight_files_by_suffix_are_left_out_in_subfolders_too(
    clipcli: Cli, tmp_path: Path, name: str
) -> None:
    src = model_dir(tmp_path / "in")
    target = src / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not inspected: the suffix decides")
    out = tmp_path / "out"
    run = clipcli("clip", "--global", "1", "--quiet", src, out)
    assert run.returncode == 0, run.stderr
    assert name not in every_file(out)
    assert f"left out {name}:" in run.stderr


@pytest.mark.parametrize(
    "content",
    [
        b'{"model_type": "toy"}',
        b'{"abcdef{": 1}',  # '{' at byte 8, but the length its first 8 bytes spell is huge
        b"# README\n\x89HDF is not at a user-block offset",
        b"\x89HD",  # shorter than the signature
        b"",
        b"[PAD]\n[UNK]\n[CLS]\n" * 8000,  # a vocabulary: ']' and 'P' are pickle opcodes
        b"cat\ndog\n" * 10000,  # reads as a GLOBAL, then fails at once
        b"N.",  # a whole pickle (None) that names no class
    ],
)
def test_ordinary_side_files_are_still_copied(clipcli: Cli, tmp_path: Path, content: bytes) -> None:
    src = model_dir(tmp_path / "in")
    (src / "notes").write_bytes(content)
    out = tmp_path / "out"
    run = clipcli("clip", "--global", "1", "--quiet", src, out)
    assert run.returncode == 0, run.stderr
    assert (out / "notes").read_bytes() == content
    assert "left out" not in run.stderr


def test_hdf5_signature_ending_exactly_at_the_end_of_the_file(tmp_path: Path) -> None:
    """The user-block search looks at every offset whose 8 bytes fit in the file."""
    from clipcli.formats.sharded.layout import weights_by_content

    path = tmp_path / "f"
    path.write_bytes(bytes(512) + b"\x89HDF\r\n\x1a\n")  # ends at the file's last byte
    with open(path, "rb") as handle:
        assert weights_by_content(handle.fileno(), 520) == "an HDF5 file"
    path.write_bytes(bytes(512) + b"\x89HDF\r\n\x1a")  # the file ends one byte too soon
    with open(path, "rb") as handle:
        assert weights_by_content(handle.fileno(), 519) is None


def test_safetensors_length_at_the_file_size(tmp_path: Path) -> None:
    from clipcli.formats.sharded.layout import weights_by_content

    path = tmp_path / "f"
    body = b"{}      "
    path.write_bytes(len(body).to_bytes(8, "little") + body)  # length == size - 8
    with open(path, "rb") as handle:
        assert weights_by_content(handle.fileno(), 16) == "a safetensors file"
    path.write_bytes((len(body) + 1).to_bytes(8, "little") + body)  # one past
    with open(path, "rb") as handle:
        assert weights_by_content(handle.fileno(), 16) is None


def test_model_directory_into_one_file_says_what_it_leaves_out(
    clipcli: Cli, tmp_path: Path
) -> None:
    src = model_dir(tmp_path / "in")
    keras_file(src / "model.keras")
    out = tmp_path / "one.safetensors"
    run = clipcli("convert", src, out)
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if "left out" in line]
    assert len(notes) == 1, run.stderr
    for name in ("config.json", "tokenizer.json", "model.keras"):
        assert name in notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "one.safetensors"]


def test_single_file_input_has_no_such_note(clipcli: Cli, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "in")
    run = clipcli("convert", src / "model.safetensors", tmp_path / "one.npz")
    assert run.returncode == 0, run.stderr
    assert "left out" not in run.stderr
