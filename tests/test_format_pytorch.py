"""PyTorch checkpoints read without torch: every layout and rebuild torch has written,
checked against the values torch itself reported when the fixtures were made
(tests/data/pytorch/make_fixtures.py; `<name>.expected.npz`, float64), which share no
code with clipcli."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line

from clipcli.cli.entry import main
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import PyTorchReader

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
FIXTURES = sorted(p.name for p in DATA.iterdir() if p.suffix in (".pt", ".pth"))


def expected(name: str) -> dict[str, np.ndarray]:
    stem = name.split(".")[0]
    with np.load(DATA / f"{stem}.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


def exact_norm(values: np.ndarray) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for v in values.astype(np.float64).ravel()))


def test_every_fixture_is_here() -> None:
    assert FIXTURES == [
        "legacy.pt",
        "legacy_tar.pt",
        "legacy_v1_cuda.pth",
        "nested.pt",
        "zip_big_endian.pt",
        "zip_v2.pt",
        "zip_v3_fp8.pt",
    ]


@pytest.mark.parametrize("name", FIXTURES)
def test_values_are_torchs(name: str) -> None:
    """Every tensor, read whole and in chunks of 1, 2 and 5 elements (strided views split
    across rows), equals what torch.load returned, bit for bit once widened."""
    want = expected(name)
    with open_reader(DATA / name) as reader:
        assert isinstance(reader, PyTorchReader)
        assert sorted(i.name for i in reader.infos) == sorted(want)
        for info in reader.infos:
            whole = reader.read(info)
            assert whole.shape == want[info.name].shape, info.name
            widened = whole.astype(np.float64 if whole.dtype.kind not in "biu" else whole.dtype)
            np.testing.assert_array_equal(widened, want[info.name], err_msg=info.name)
            for elems in (1, 2, 5):
                pieces = list(reader.chunks(info, elems))
                assert all(0 < p.size <= elems for p in pieces), info.name
                joined = np.concatenate(pieces) if pieces else np.zeros(0, info.dtype)
                np.testing.assert_array_equal(
                    joined.astype(widened.dtype), want[info.name].ravel(), err_msg=info.name
                )


@pytest.mark.parametrize("name", FIXTURES)
def test_norms_match_torchs_values(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    want = expected(name)
    assert main(["norms", "--all-tensors", "--format", "json", str(DATA / name)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["format"] == "pytorch"
    for row in document["tensors"]:
        reference = exact_norm(want[row["name"]])
        assert row["norm"] == pytest.approx(reference, rel=1e-7, abs=0), row["name"]


def test_layouts_rebuilds_and_dtypes() -> None:
    with open_reader(DATA / "zip_v2.pt") as reader:
        assert isinstance(reader, PyTorchReader)
        dtypes = {i.name: i.dtype_name for i in reader.infos}
        assert dtypes["half"] == "float16"
        assert dtypes["bf16"] == "bfloat16"
        assert dtypes["mask"] == "bool"
        assert dtypes["2.num_batches_tracked"] == "int64"
        assert reader.metadata["pytorch.layout"] == "zip (zip_v2/)"
        key, offset, shape, stride = reader.tensor_layout("transposed")
        assert (shape, stride) == ((7, 5), (1, 7))
        assert reader.tensor_layout("offset_rows")[1] == 14
    with open_reader(DATA / "zip_v3_fp8.pt") as reader:  # _rebuild_tensor_v3, UntypedStorage
        assert {i.name: i.dtype_name for i in reader.infos} == {
            "e4m3": "float8_e4m3fn",
            "e5m2": "float8_e5m2",
            "u16": "uint16",
        }
    with open_reader(DATA / "zip_big_endian.pt") as reader:
        assert reader.metadata["pytorch.byteorder"] == "big"
    with open_reader(DATA / "legacy_v1_cuda.pth") as reader:  # _rebuild_tensor, cuda:0
        assert reader.metadata["pytorch.layout"] == "legacy pickle"
    with open_reader(DATA / "legacy_tar.pt") as reader:
        assert reader.metadata["pytorch.layout"] == "legacy tar"


def test_tied_weights_are_named_in_ls(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(DATA / "zip_v2.pt")]) == 0
    out = capsys.readouterr().out
    assert "pytorch.tied = lm_head.weight = 0.weight" in out
    assert "transposed, offset_rows, every_other" in out  # one storage, three views
    with open_reader(DATA / "zip_v2.pt") as reader:
        assert isinstance(reader, PyTorchReader)
        assert reader.shared_with("lm_head.weight") == "0.weight"
        assert reader.shared_with("0.weight") is None
        assert reader.shared_with("offset_rows") is None  # a different view of one storage


def test_nested_dicts_are_paths_and_optimizer_state_is_training_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["norms", "--format", "json", str(DATA / "nested.pt")]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["state_dict.weight"]["in_global"] is True
    assert rows["optimizer_states.0.state.0.exp_avg"]["in_global"] is False
    assert rows["optimizer_states.0.state.0.exp_avg"]["role"] == "optimizer"
    assert main(["ls", str(DATA / "nested.pt")]) == 0
    out = capsys.readouterr().out
    assert "metadata epoch = 3" in out
    assert "metadata hyper_parameters.betas = [0.9, 0.999]" in out


@pytest.mark.parametrize("name", FIXTURES)
def test_convert_to_safetensors_reads_back_with_the_official_reader(
    name: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(DATA / name), str(out)]) == 0
    loaded = safetensors_values(out)
    want = expected(name)
    assert sorted(loaded) == sorted(want)
    for key, values in loaded.items():
        widened = values.astype(np.float64 if values.dtype.kind not in "biu" else values.dtype)
        np.testing.assert_array_equal(widened, want[key], err_msg=key)


def safetensors_values(path: Path) -> dict[str, np.ndarray]:
    """safetensors' own numpy loader; for fp8 (which it cannot hand to numpy) the file's
    header and bytes as the format's specification lays them out, through ml_dtypes."""
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except AttributeError:  # numpy has no float8
        import ml_dtypes

        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__", None)
        types = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "U16": "<u2"}
        out = {}
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            raw = data[8 + length + begin : 8 + length + end]
            out[key] = np.frombuffer(raw, types[entry["dtype"]]).reshape(entry["shape"])
        return out


def test_clip_to_safetensors_keeps_the_promise(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "clipped.safetensors"
    assert main(["clip", "--norm", "1", str(DATA / "zip_v2.pt"), str(out)]) == 0
    clipped = load_file(out)
    want = expected("zip_v2.pt")
    assert exact_norm(want["transposed"]) > 1.0
    for key, values in clipped.items():
        if values.dtype.name in ("float32", "float16", "bfloat16") and "running" not in key:
            assert exact_norm(values) <= 1.0, key
        else:  # integers, bools and BatchNorm statistics: copied bit for bit
            np.testing.assert_array_equal(values, want[key], err_msg=key)


def test_diff_of_the_same_state_dict_in_two_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    for other in ("legacy.pt", "zip_big_endian.pt"):
        assert main(["diff", "--format", "json", str(DATA / "zip_v2.pt"), str(DATA / other)]) == 0
        document = json.loads(capsys.readouterr().out)
        assert all(row["diff_norm"] in (0, 0.0, None) for row in document["tensors"])


def test_a_bin_holding_nothing_torch_wrote_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x02K\x01." + b"\x00" * 20)  # a pickle of 1, not torch's magic
    assert main(["ls", str(path)]) == 3
    assert "is a pickle but not a PyTorch checkpoint" in one_error_line(capsys.readouterr().err)
