"""Writing PyTorch's zip format (clipcli.formats.pytorch.writer): what `torch.save` writes
for a state dict, with a pickle of our own over the same globals. Checked without torch by
our reader, pickletools (which only lists opcodes) and the zip's own headers; and, where
torch installs, by `torch.load(weights_only=True)` itself (the values torch reported when
the fixtures were made, tests/data/pytorch/*.expected.npz, are the reference)."""

from __future__ import annotations

import io
import json
import pickletools
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT
from safetensors.numpy import save_file

from clipcli.cli.entry import main
from clipcli.formats.base import TensorInfo
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import PyTorchReader, PyTorchWriter

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
FIXTURES = sorted(p.name for p in DATA.iterdir() if p.suffix in (".pt", ".pth"))
# What torch's weights-only unpickler allows, and what our pickle may name.
ALLOWED_GLOBALS = {
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_tensor_v3",
    "torch.storage UntypedStorage",
    "collections OrderedDict",
}


def expected(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name.split('.')[0]}.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


def widened(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float64 if array.dtype.kind not in "biu" else array.dtype)


def converted(tmp_path: Path, name: str, suffix: str = ".pt") -> Path:
    out = tmp_path / (name.split(".")[0] + suffix)
    assert main(["convert", "--allow-lossy", "-q", str(DATA / name), str(out)]) == 0
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_our_reader_reads_back_what_we_wrote(tmp_path: Path, name: str) -> None:
    out = converted(tmp_path, name)
    want = expected(name)
    with open_reader(out) as reader:
        assert isinstance(reader, PyTorchReader)
        assert reader.metadata["pytorch.layout"] == "zip (archive/)"
        assert sorted(i.name for i in reader.infos) == sorted(want)
        for info in reader.infos:
            np.testing.assert_array_equal(widened(reader.read(info)), want[info.name])


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_every_suffix_writes_the_zip_layout(tmp_path: Path, suffix: str) -> None:
    out = converted(tmp_path, "zip_v2.pt", suffix)
    assert out.read_bytes()[:4] == b"PK\x03\x04"


def test_records_are_stored_aligned_and_the_pickle_names_only_allowed_globals(
    tmp_path: Path,
) -> None:
    out = converted(tmp_path, "zip_v2.pt")
    raw = out.read_bytes()
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        assert {"archive/data.pkl", "archive/byteorder", "archive/version"} <= set(names)
        assert archive.read("archive/byteorder") == b"little"
        assert archive.read("archive/.storage_alignment") == b"64"
        for entry in archive.infolist():
            assert entry.compress_type == zipfile.ZIP_STORED
            if entry.filename.startswith("archive/data/"):
                name_length, extra_length = struct.unpack_from("<HH", raw, entry.header_offset + 26)
                start = entry.header_offset + 30 + name_length + extra_length
                assert start % 64 == 0, entry.filename
        pickle = archive.read("archive/data.pkl")
    named = set()
    for opcode, argument, _ in pickletools.genops(io.BytesIO(pickle)):
        assert opcode.name not in ("INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD", "EXT1")
        if opcode.name == "GLOBAL":
            named.add(str(argument))
    storage_classes = {g for g in named if g.startswith("torch ") and g.endswith("Storage")}
    assert named - storage_classes <= ALLOWED_GLOBALS
    assert storage_classes == {
        "torch FloatStorage",
        "torch HalfStorage",
        "torch BFloat16Storage",
        "torch LongStorage",
        "torch BoolStorage",
    }


def test_a_tied_tensor_shares_its_storage_in_the_file(tmp_path: Path) -> None:
    out = converted(tmp_path, "zip_v2.pt")
    with open_reader(out) as reader:
        assert isinstance(reader, PyTorchReader)
        assert reader.tied() == {"lm_head.weight": "0.weight"}
        keys = {name: reader.tensor_layout(name)[0] for name in ("0.weight", "lm_head.weight")}
        assert keys["0.weight"] == keys["lm_head.weight"]
    with zipfile.ZipFile(out) as archive:
        records = [n for n in archive.namelist() if n.startswith("archive/data/")]
    assert len(records) == 16  # 17 tensors, one storage shared


def test_clip_into_pt_keeps_the_tie(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "clipped.pt"
    overlapping = ["--exclude", "transposed", "--exclude", "every_other"]
    argv = ["clip", "--global", "1", "--format", "json", *overlapping, str(DATA / "zip_v2.pt")]
    assert main([*argv, str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["global_norm_after"] <= 1
    with open_reader(out) as reader:
        assert isinstance(reader, PyTorchReader)
        assert reader.tied() == {"lm_head.weight": "0.weight"}
        infos = {i.name: i for i in reader.infos}
        np.testing.assert_array_equal(
            reader.read(infos["0.weight"]), reader.read(infos["lm_head.weight"])
        )
        assert not np.array_equal(
            widened(reader.read(infos["0.weight"])), expected("zip_v2.pt")["0.weight"]
        )


def test_dtypes_torch_lacks_are_refused_by_the_writer() -> None:
    import ml_dtypes

    for dtype in (np.float32, np.float16, np.int8, np.uint64, np.bool_, np.complex128):
        info = TensorInfo("w", np.dtype(dtype), (2,), 2 * np.dtype(dtype).itemsize)
        assert PyTorchWriter.check_dtype(info) is None
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        info = TensorInfo("w", np.dtype(dtype), (2,), 2)
        assert PyTorchWriter.check_dtype(info) is None
    four = TensorInfo("w", np.dtype(ml_dtypes.float4_e2m1fn), (2,), 2)
    assert PyTorchWriter.check_dtype(four) == (
        "PyTorch has no float4_e2m1fn dtype; write .safetensors instead"
    )


@pytest.mark.parametrize("nbytes", [952, 956])  # 952 * 1.05 < 1000 < 956 * 1.05
def test_zip64_records_stay_aligned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    """zipfile adds a zip64 field to a local header when a record may pass ZIP64_LIMIT;
    the padding must count it. The limit is lowered so that a small record crosses it."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)
    source = tmp_path / "m.safetensors"
    values = np.arange(nbytes, dtype=np.uint8)
    save_file({"w": values}, source)
    out = tmp_path / "o.pt"
    assert main(["convert", "-q", str(source), str(out)]) == 0
    monkeypatch.undo()
    raw = out.read_bytes()
    with zipfile.ZipFile(out) as archive:
        entry = archive.getinfo("archive/data/0")
        name_length, extra_length = struct.unpack_from("<HH", raw, entry.header_offset + 26)
        extra = raw[entry.header_offset + 30 + name_length :][:extra_length]
        assert (b"\x01\x00\x10\x00" in extra) == (nbytes * 1.05 > 1000)  # the zip64 field
        assert (entry.header_offset + 30 + name_length + extra_length) % 64 == 0
    with open_reader(out) as reader:
        np.testing.assert_array_equal(reader.read(reader.infos[0]), values)


# ---------------------------------------------------------------- torch itself


@pytest.mark.parametrize("name", FIXTURES)
def test_torch_loads_it_weights_only(tmp_path: Path, name: str) -> None:
    torch = pytest.importorskip("torch")
    out = converted(tmp_path, name)
    loaded = torch.load(out, weights_only=True)
    want = expected(name)
    assert sorted(loaded) == sorted(want)
    for key, tensor in loaded.items():
        values = tensor.double() if tensor.is_floating_point() else tensor
        np.testing.assert_array_equal(values.numpy(), want[key], err_msg=key)
    mapped = torch.load(out, weights_only=True, mmap=True)  # needs aligned records
    assert sorted(mapped) == sorted(want)


def test_torch_sees_one_storage_for_a_tie(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    loaded = torch.load(converted(tmp_path, "zip_v2.pt"), weights_only=True)
    first, tied = loaded["0.weight"], loaded["lm_head.weight"]
    assert first.untyped_storage().data_ptr() == tied.untyped_storage().data_ptr()
    assert loaded["transposed"].untyped_storage().data_ptr() != (
        loaded["offset_rows"].untyped_storage().data_ptr()
    )  # overlapping views are written as tensors of their own


def test_torch_loads_a_clipped_bin(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    out = tmp_path / "pytorch_model.bin"
    assert main(["clip", "--norm", "1", "-q", str(DATA / "zip_v3_fp8.pt"), str(out)]) == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["e4m3"].dtype == torch.float8_e4m3fn
    assert float(loaded["e4m3"].double().norm()) <= 1
    np.testing.assert_array_equal(loaded["u16"].numpy(), expected("zip_v3_fp8.pt")["u16"])
