"""Files that look like checkpoints but belong to other tools get a message that says what
they are and what to do (exit 3), not "member 'archive/data.pkl' is not a .npy array"."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from safetensors.numpy import load_file

from clipcli.cli.entry import main


def pytorch_zip(path: Path) -> Path:
    """The layout torch.save has written since 1.6: one top folder, data.pkl, storages."""
    with zipfile.ZipFile(path, "w") as archive:
        # PyTorch files are read now (test_format_pytorch.py); this one's pickle names a
        # global off the allow-list, refused by name without importing or calling it (a
        # pathlib path was that global until Lightning checkpoints made paths inert data).
        archive.writestr("archive/data.pkl", pickle.dumps({"w": Fraction(1, 3)}, protocol=2))
        archive.writestr("archive/data/0", b"\x00" * 16)
        archive.writestr("archive/version", "3\n")
    return path


def keras_archive(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", '{"keras_version": "3.6.0"}')
        archive.writestr("config.json", '{"class_name": "Sequential"}')
        archive.writestr("model.weights.h5", b"\x89HDF\r\n\x1a\n")
    return path


@pytest.mark.parametrize(
    ("make", "name", "says"),
    [
        (pytorch_zip, "pytorch_model.bin", "fractions.Fraction, which is not on the allow-list"),
        (pytorch_zip, "model.pt", "fractions.Fraction, which is not on the allow-list"),
        # .keras archives are read now (test_keras_archive.py); this one's weights are
        # a bare HDF5 signature, refused as what they are, inside the archive.
        (keras_archive, "model.keras", "model.keras[model.weights.h5]: cannot open as HDF5"),
        (
            lambda p: p.write_bytes(pickle.dumps({"w": 1}, protocol=4)) and p,
            "old.pth",
            "is a pickle but not a PyTorch checkpoint",
        ),
        # GGUF files are read now (test_format_gguf.py): this one, an empty header and
        # 16 bytes more than its padding, is refused by the GGUF reader for what it is.
        (
            lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 32) and p,
            "m.gguf",
            "trailing bytes",
        ),
    ],
)
@pytest.mark.parametrize("command", ["ls", "norms", "clip"])
def test_other_tools_files_are_named_for_what_they_are(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: object,
    name: str,
    says: str,
    command: str,
) -> None:
    path = tmp_path / name
    make(path)  # type: ignore[operator]
    argv = [command, str(path)]
    if command == "clip":
        argv = ["clip", "--global", "1", str(path), str(tmp_path / "out.safetensors")]
    assert main(argv) == 3
    line = one_error_line(capsys.readouterr().err)
    assert says in line
    assert name in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_an_npz_is_still_an_npz(tmp_path: Path) -> None:
    import numpy as np

    np.savez(tmp_path / "a.npz", data=np.ones(3, np.float32), config=np.zeros(2))
    assert main(["norms", "--format", "json", str(tmp_path / "a.npz")]) == 0


def _safetensors_with_header_length(path: Path, length: int) -> None:
    """One float32 tensor, the JSON header padded with spaces (as the format allows) to
    exactly `length` bytes."""
    data = np.arange(4, dtype=np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(data)]}})
    header = header.ljust(length)
    assert len(header) == length
    path.write_bytes(struct.pack("<Q", length) + header.encode() + data)


@pytest.mark.parametrize("length", [640, 896, 1152, 1408, 640 + 65536])
def test_a_header_length_that_looks_like_a_pickle_is_still_safetensors(
    tmp_path: Path, length: int
) -> None:
    """The 8-byte length 640 begins 80 02, a pickle protocol 2 opening."""
    path = tmp_path / "m.safetensors"
    _safetensors_with_header_length(path, length)
    assert path.read_bytes()[:1] == b"\x80"
    assert load_file(str(path))["w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the official reader
    assert main(["ls", str(path)]) == 0
    out = tmp_path / "o.safetensors"
    assert main(["clip", "-q", "--global", "1", str(path), str(out)]) == 0
    assert set(load_file(str(out))) == {"w"}


def test_a_real_pickle_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    path.write_bytes(b"\x80\x02}q\x00(X\x01\x00\x00\x00wq\x01K\x01u.")
    assert main(["ls", str(path)]) == 3
