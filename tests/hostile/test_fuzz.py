"""Mutation fuzzing: a damaged checkpoint gives a correct output or a clean refusal, never an
internal error; and what the official readers refuse, clipcli refuses too.

Fast in CI (the `ci` profile); `HYPOTHESIS_PROFILE=long` runs thousands of examples.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from clipcli.cli import main

# capsys is read after every call, so sharing it between examples is safe.
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def seed_safetensors() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]},
        "c": {"dtype": "I64", "shape": [], "data_offsets": [32, 40]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = np.arange(6, dtype=np.float32).tobytes() + np.ones(4, np.float16).tobytes()
    return struct.pack("<Q", len(text)) + text + data + np.int64(7).tobytes()


def seed_npz(compressed: bool) -> bytes:
    buffer = io.BytesIO()
    save = np.savez_compressed if compressed else np.savez
    save(buffer, a=np.arange(6.0).reshape(2, 3), b=np.ones(4, np.float16))
    return buffer.getvalue()


def seed_h5() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "seed.h5"
        with h5py.File(path, "w") as f:
            f.attrs["note"] = "seed"
            f.create_dataset("g/a", data=np.arange(6.0).reshape(2, 3))
            f.create_dataset("b", data=np.ones(4, np.float32), chunks=(2,), compression="gzip")
        return path.read_bytes()


SEEDS = {
    ".safetensors": seed_safetensors(),
    ".npz": seed_npz(False),
    ".zip.npz": seed_npz(True),
    ".h5": seed_h5(),
}


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    suffix = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[suffix])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "length", "json", "zero"]))
        if kind == "flip" and data:
            index = draw(st.integers(0, len(data) - 1))
            data[index] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "insert":
            index = draw(st.integers(0, len(data)))
            data[index:index] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "zero" and data:
            start = draw(st.integers(0, len(data) - 1))
            data[start : start + draw(st.integers(1, 64))] = bytes(min(64, len(data) - start))
        elif kind == "length" and suffix == ".safetensors" and len(data) >= 8:
            data[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        elif kind == "json" and suffix == ".safetensors" and len(data) >= 8:
            (length,) = struct.unpack("<Q", bytes(data[:8]))
            text = bytes(data[8 : 8 + length])
            replacement = draw(
                st.sampled_from(
                    [
                        b"-1",
                        b"1e300",
                        b"true",
                        b"null",
                        b'"x"',
                        b"[]",
                        b"{}",
                        b"99999999999999999999",
                    ]
                )
            )
            digits = [i for i, ch in enumerate(text) if chr(ch).isdigit()]
            if digits:
                at = draw(st.sampled_from(digits))
                text = text[:at] + replacement + text[at + 1 :]
                data[:] = struct.pack("<Q", len(text)) + text + data[8 + length :]
    return suffix.replace(".zip", ""), bytes(data)


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


@SETTINGS
@given(case=mutated())
def test_mutated_files_give_output_or_clean_refusal(
    case: tuple[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    suffix, data = case
    with tempfile.TemporaryDirectory() as directory:
        src = Path(directory) / f"in{suffix}"
        src.write_bytes(data)
        out = Path(directory) / f"out{suffix}"
        for args in (
            ["norms", "--format", "json", str(src)],
            ["clip", "--global", "1", "-q", str(src), str(out)],
        ):
            code, err = run(args, capsys)
            assert code in (0, 2, 3, 4), err  # never 70: an internal error is a bug
            if code:
                assert err.count("\n") == 1 and err.startswith("clipcli: error: "), err
        if out.exists():
            assert main(["norms", "-f", "json", str(out)]) == 0
            capsys.readouterr()
        leftovers = [p.name for p in Path(directory).iterdir() if "clipcli-tmp" in p.name]
        assert leftovers == []


def official_refuses(path: Path) -> bool:
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="np") as handle:
                for key in handle.keys():
                    handle.get_tensor(key)
        else:
            # Our own handle: np.load leaks its file when it raises on a broken zip.
            with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as loaded:
                for key in loaded.keys():
                    loaded[key]
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


@SETTINGS
@given(case=mutated())
def test_what_official_readers_refuse_clipcli_refuses(
    case: tuple[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    suffix, data = case
    if suffix == ".h5":
        return
    with tempfile.TemporaryDirectory() as directory:
        src = Path(directory) / f"in{suffix}"
        src.write_bytes(data)
        if official_refuses(src):
            code, err = run(["norms", "--format", "json", str(src)], capsys)
            assert code == 3, err


def test_seeds_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    for suffix, data in SEEDS.items():
        with tempfile.TemporaryDirectory() as directory:
            src = Path(directory) / f"in{suffix.replace('.zip', '')}"
            src.write_bytes(data)
            assert main(["norms", str(src)]) == 0
            capsys.readouterr()
    assert zipfile.is_zipfile(io.BytesIO(SEEDS[".npz"]))
