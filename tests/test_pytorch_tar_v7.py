"""A legacy torch tar in the old V7 header layout (no 'ustar' magic at byte 257; Python's
tarfile and torch.load read it) is a tar: recognised by its header checksum (sum of the
header's bytes with the checksum field as spaces, unsigned or signed, as tarfile accepts),
read like the ustar one, and left out of a directory OUT as weights. A checksum off by one
is not a tar. The V7 headers are written here by hand; tarfile is the reference."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import MainRun
from expect import REPO_ROOT
from safetensors.numpy import save_file

from clipcli.formats.opening import open_reader

PYTORCH = REPO_ROOT / "tests" / "data" / "pytorch"
HIGH_BYTE_AT = 400  # in the header's unused tail (V7 ends at 257): makes signed != unsigned


def _members() -> list[tuple[str, bytes]]:
    with tarfile.open(PYTORCH / "legacy_tar.pt") as archive:  # made by torch's layout
        return [
            (member.name, archive.extractfile(member).read())  # type: ignore[union-attr]
            for member in archive.getmembers()
            if member.isreg()
        ]


def _v7_header(name: str, size: int, checksum: str, high_byte: bool, off_by: int) -> bytes:
    header = bytearray(512)
    header[0 : len(name)] = name.encode()
    header[100:108] = b"0000644\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = b"%011o\0" % size
    header[136:148] = b"00000000000\0"
    header[156] = ord("0")
    if high_byte:
        header[HIGH_BYTE_AT] = 0xFF
    header[148:156] = b" " * 8
    unsigned = sum(header)
    signed = sum(byte - 256 if byte >= 0x80 else byte for byte in header)
    value = (unsigned if checksum == "unsigned" else signed) + off_by
    header[148:156] = b"%06o\0 " % value
    return bytes(header)


def v7_tar(
    path: Path, checksum: str = "unsigned", high_byte: bool = False, off_by: int = 0
) -> Path:
    data = bytearray()
    for name, payload in _members():
        data += _v7_header(name, len(payload), checksum, high_byte, off_by)
        data += payload + b"\0" * (-len(payload) % 512)
    data += b"\0" * 1024
    path.write_bytes(bytes(data))
    assert data[257:262] != b"ustar"
    return path


def _tarfile_reads(path: Path) -> bool:
    try:
        with tarfile.open(path, "r:") as archive:
            return bool(archive.getmembers())
    except tarfile.TarError:
        return False


@pytest.mark.parametrize(
    ("checksum", "high_byte"), [("unsigned", False), ("unsigned", True), ("signed", True)]
)
def test_a_v7_tar_is_read_like_the_ustar_one(
    clipcli: Callable[..., MainRun], tmp_path: Path, checksum: str, high_byte: bool
) -> None:
    path = v7_tar(tmp_path / "old.pt", checksum, high_byte)
    assert _tarfile_reads(path)
    with np.load(PYTORCH / "legacy_tar.expected.npz") as archive:
        want = {key: archive[key] for key in archive.files}  # what torch.load returned
    with open_reader(path) as reader:
        assert reader.metadata["pytorch.layout"] == "legacy tar"
        assert sorted(info.name for info in reader.infos) == sorted(want)
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info).astype(np.float64), want[info.name])
    unnamed = tmp_path / "checkpoint"  # a name that says nothing: content decides
    unnamed.write_bytes(path.read_bytes())
    run = clipcli("ls", unnamed)
    assert run.returncode == 0, run.stderr
    assert "(pytorch)" in run.stdout


@pytest.mark.parametrize("checksum", ["unsigned", "signed"])
@pytest.mark.parametrize("off_by", [-1, 1])
def test_a_checksum_off_by_one_is_not_a_tar(
    clipcli: Callable[..., MainRun], tmp_path: Path, checksum: str, off_by: int
) -> None:
    path = v7_tar(tmp_path / "checkpoint", checksum, high_byte=True, off_by=off_by)
    assert not _tarfile_reads(path)
    run = clipcli("ls", path)
    assert run.returncode == 3
    assert run.stderr.count("\n") == 1
    assert run.stderr.startswith("clipcli: error: ")
    assert "unknown leading bytes" in run.stderr


def test_a_v7_tar_beside_the_model_is_left_out_as_weights(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.arange(12, dtype=np.float32) * 10}, model / "model.safetensors")
    v7_tar(model / "old_v7.tar")
    out = tmp_path / "out"
    run = clipcli("clip", "-q", "--global", "1", model, out)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert "left out old_v7.tar" in run.stderr


def test_recognition_reads_only_the_first_block() -> None:
    from clipcli.formats.registry import is_tar_header

    block = _v7_header("pickle", 0, "unsigned", False, 0)
    assert is_tar_header(block)
    assert not is_tar_header(block[:511])
    assert not is_tar_header(bytes(512))  # all zeros: the sum is 256, the field empty
