""".npy (issue 19, part 2): one package and one registry entry. `ls`, `norms`, `clip` and
`convert` work; the one tensor is named "array"; hostile headers are refused (exit 3);
more than one tensor into .npy is refused (exit 2). Outputs are read back with numpy's own
`np.load` (and safetensors' `load_file`), never with clipcli's readers."""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from expect import one_error_line
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.formats import registry
from clipcli.formats.npz import reader as npz_reader


def run(argv: list[str | Path], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def exact_norm(array: np.ndarray) -> float:
    """The L2 norm from exact rational arithmetic (no numpy reduction)."""
    total = sum((Fraction(float(v)) ** 2 for v in array.reshape(-1).tolist()), Fraction(0))
    return math.sqrt(total)


ARRAYS = {
    "c-float32": np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5,
    "fortran-float64": np.asfortranarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4)),
    "big-endian": np.arange(6, dtype=">f4").reshape(2, 3),
    "float16": np.linspace(-2, 2, 9).astype(np.float16),
    "scalar": np.array(3.0, np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "int8": np.arange(-4, 4, dtype=np.int8),
}


def test_the_registry_entry_is_the_format() -> None:
    entry = registry.BY_NAME["npy"]
    assert entry.suffixes == (".npy",)
    assert entry.output
    assert entry.refusal is None
    assert entry.reader_class().format_name == entry.writer_class().format_name == "npy"
    assert registry.ONE_TENSOR in entry.capabilities


@pytest.mark.parametrize("kind", sorted(ARRAYS))
def test_ls_and_norms_agree_with_numpy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    array = ARRAYS[kind]
    path = tmp_path / "w.npy"
    np.save(path, array)
    code, out, err = run(["ls", path, "--json"], capsys)
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert document["format"] == "npy"
    ((row),) = document["tensors"]
    assert (row["name"], row["shape"], row["dtype"]) == (
        "array",
        list(array.shape),
        array.dtype.name,
    )
    code, out, err = run(["norms", path, "--json"], capsys)
    assert (code, err) == (0, "")
    ((row),) = json.loads(out)["tensors"]
    assert row["norm"] == pytest.approx(exact_norm(array), rel=1e-12, abs=0)


@pytest.mark.parametrize("kind", sorted(ARRAYS))
def test_convert_to_safetensors_and_back_is_what_numpy_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    array = ARRAYS[kind]
    np.save(tmp_path / "w.npy", array)
    code, _, err = run(["convert", "-q", tmp_path / "w.npy", tmp_path / "w.safetensors"], capsys)
    assert (code, err) == (0, "")
    ((name, stored),) = load_file(str(tmp_path / "w.safetensors")).items()
    assert name == "array"
    assert stored.shape == array.shape
    assert np.array_equal(stored, array)
    assert stored.dtype.name == array.dtype.name
    code, _, err = run(["convert", "-q", tmp_path / "w.safetensors", tmp_path / "b.npy"], capsys)
    assert (code, err) == (0, "")
    back = np.load(tmp_path / "b.npy", allow_pickle=False)
    assert back.shape == array.shape
    assert back.dtype.name == array.dtype.name
    assert (
        back.astype(back.dtype.newbyteorder("<")).tobytes()
        == array.astype(array.dtype.newbyteorder("<")).tobytes()
    )


def test_large_column_major_data_goes_through_the_tiled_transpose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past FORTRAN_IN_MEMORY_BYTES (the npz reader's), the data is transposed on disk."""
    array = np.asfortranarray(np.arange(5 * 7 * 3, dtype=np.float32).reshape(5, 7, 3))
    np.save(tmp_path / "f.npy", array)
    monkeypatch.setattr(npz_reader, "FORTRAN_IN_MEMORY_BYTES", array.nbytes - 1)
    code, _, err = run(["convert", "-q", tmp_path / "f.npy", tmp_path / "f.safetensors"], capsys)
    assert (code, err) == (0, "")
    assert np.array_equal(load_file(str(tmp_path / "f.safetensors"))["array"], array)


def test_a_safetensors_file_of_one_tensor_becomes_an_npy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weight = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    save_file({"model.w": weight}, str(tmp_path / "m.safetensors"))
    code, _, err = run(["convert", tmp_path / "m.safetensors", tmp_path / "w.npy"], capsys)
    assert code == 0
    assert "reads back as 'array'" in err  # the name is not stored: said, not refused
    loaded = np.load(tmp_path / "w.npy", allow_pickle=False)
    assert loaded.dtype == weight.dtype
    assert np.array_equal(loaded, weight)


def test_clip_npy_to_npy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weight = np.array([[3.0, 4.0], [0.0, 12.0]], np.float32)  # norm 13
    np.save(tmp_path / "w.npy", weight)
    code, _, err = run(
        ["clip", "-q", "--norm", "1.3", tmp_path / "w.npy", tmp_path / "c.npy"], capsys
    )
    assert (code, err) == (0, "")
    clipped = np.load(tmp_path / "c.npy", allow_pickle=False)
    assert clipped.dtype == np.float32
    assert np.allclose(clipped, weight / 10, rtol=1e-6, atol=0)
    code, out, _ = run(["diff", tmp_path / "w.npy", tmp_path / "c.npy", "--json"], capsys)
    assert code == 0
    assert [row["status"] for row in json.loads(out)["tensors"]] == ["changed"]  # paired


@pytest.mark.parametrize("count", [0, 2])
def test_any_other_number_of_tensors_than_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int
) -> None:
    tensors: dict[str, Any] = {f"t{i}": np.ones(2, np.float32) for i in range(count)}
    np.savez(tmp_path / "m.npz", **tensors)
    code, out, err = run(["convert", tmp_path / "m.npz", tmp_path / "o.npy"], capsys)
    assert (code, out) == (2, "")
    assert f"a .npy file holds exactly one array, and IN has {count} tensors" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]


def test_a_model_directory_into_one_npy_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file(
        {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}, str(model / "model.safetensors")
    )
    code, _, err = run(["convert", model, tmp_path / "b.npy"], capsys)
    assert code == 2
    assert "holds exactly one array, and IN has 2 tensors" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_bfloat16_is_refused_as_npz_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_file({"w": np.ones(2, ml_dtypes.bfloat16)}, str(tmp_path / "m.safetensors"))
    code, _, err = run(["convert", tmp_path / "m.safetensors", tmp_path / "o.npy"], capsys)
    assert code == 2
    assert "cannot hold bfloat16" in one_error_line(err)
    assert not (tmp_path / "o.npy").exists()


# ------------------------------------------------------------------ hostile headers


def npy_bytes(header: str | bytes, data: bytes = b"", version: int = 1) -> bytes:
    raw = header.encode("latin1") if isinstance(header, str) else header
    size = len(raw).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + raw + data


HOSTILE = {
    "object dtype": (
        npy_bytes("{'descr': '|O', 'fortran_order': False, 'shape': (1,)}\n", bytes(8)),
        "Python objects",
    ),
    "structured dtype": (
        npy_bytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}\n", bytes(4)),
        "structured",
    ),
    "code in the header": (
        npy_bytes("__import__('os').system('touch PWNED')\n"),
        "not a valid Python literal",
    ),
    "header past the cap": (
        npy_bytes("{" + " " * 10_001 + "}", version=2),
        "exceeds the 10000 cap",
    ),
    "huge shape over a few bytes": (
        npy_bytes(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,)}\n", bytes(8)
        ),
        "needs 4000000000000 data bytes but the file holds 8",
    ),
    "negative dimension": (
        npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}\n"),
        "not a tuple of non-negative integers",
    ),
    "unknown version": (npy_bytes("{}", version=9), "unsupported .npy format version 9"),
    "extra key": (
        npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}\n", bytes(4)),
        "exactly descr, fortran_order and shape",
    ),
    "header cut short": (b"\x93NUMPY\x01\x00\xff\x00{'descr'", "truncated"),
    "overflowing shape": (
        npy_bytes(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 0)}\n"
        ),
        "overflows",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    content, fragment = HOSTILE[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.npy").write_bytes(content)
    for argv in (["ls", "h.npy"], ["norms", "h.npy"], ["convert", "h.npy", "o.safetensors"]):
        code, out, err = run(list(argv), capsys)
        assert (code, out) == (3, ""), err
        assert fragment in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.npy"]  # no PWNED, no OUT


@pytest.mark.parametrize(("extra", "accepted"), [(0, True), (-1, False), (1, False)])
def test_the_file_must_hold_exactly_the_declared_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: int, accepted: bool
) -> None:
    """header + nbytes exactly: one byte less (truncated) or more (trailing) is refused."""
    np.save(tmp_path / "w.npy", np.arange(4, dtype=np.float32))
    data = (tmp_path / "w.npy").read_bytes()
    (tmp_path / "w.npy").write_bytes(
        data[: len(data) + extra] if extra < 0 else data + bytes(extra)
    )
    code, _, err = run(["norms", tmp_path / "w.npy"], capsys)
    if accepted:
        assert (code, err) == (0, "")
    else:
        assert code == 3
        assert f"needs 16 data bytes but the file holds {16 + extra}" in one_error_line(err)


def test_a_version_2_header_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """numpy writes version 2 (a 4-byte header length) for headers past 65535 bytes; the
    version is what the reader must follow, not the header's size."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}"
    header += " " * (-(12 + len(header) + 1) % 64) + "\n"
    (tmp_path / "v2.npy").write_bytes(npy_bytes(header, struct.pack("<2f", 3.0, 4.0), version=2))
    assert np.array_equal(np.load(tmp_path / "v2.npy"), [3.0, 4.0])  # numpy agrees it is valid
    code, out, err = run(["norms", tmp_path / "v2.npy", "--json"], capsys)
    assert (code, err) == (0, "")
    assert json.loads(out)["global_norm"] == 5.0
