"""Hostile inputs, each run through the real CLI in a subprocess with a memory cap and a
timeout. Every case must end in its documented exit code with exactly one
`clipcli: error:` line naming the file (and tensor), no traceback, and nothing written."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

MEMORY_CAP = 2 << 30  # address space: numpy and two threads need ~1 GiB of it mapped
TIMEOUT = 30
Builder = Callable[[Path], Path]


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def clipcli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        preexec_fn=limit_memory,
        cwd=cwd,
    )


def assert_refused(path: Path, code: int, *mentions: str) -> None:
    workdir = path.parent
    out = workdir / "out.safetensors"
    before = sorted(p.name for p in workdir.iterdir())
    for args in (["norms", str(path)], ["clip", "--global", "1", str(path), str(out)]):
        proc = clipcli(*args, cwd=workdir)
        assert proc.returncode == code, (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("clipcli: error: ")
        assert "\x1b" not in lines[0]
        assert str(path) in lines[0] or path.name in lines[0], lines[0]
        for mention in mentions:
            assert mention in lines[0], lines[0]
        assert sorted(p.name for p in workdir.iterdir()) == before  # no OUT, no temp file


# ------------------------------------------------------------------ safetensors


def safetensors_bytes(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def st_file(name: str, payload: bytes) -> Builder:
    def build(directory: Path) -> Path:
        path = directory / name
        path.write_bytes(payload)
        return path

    return build


def entry(dtype: str, shape: list[object], begin: object, end: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


SAFETENSORS_CASES: dict[str, tuple[bytes, str]] = {
    "under_8_bytes": (b"\x01\x02\x03", "at least 8"),
    "header_past_end": (struct.pack("<Q", 1000) + b"{}", "runs past the end"),
    "header_over_100MB": (struct.pack("<Q", 200_000_000) + b"{}" * 8, "exceeds"),
    "not_utf8": (safetensors_bytes(None, raw_header=b'{"\xff\xfe": 1}'), "UTF-8"),
    "not_json": (safetensors_bytes(None, raw_header=b"{this is not json"), "JSON"),
    "json_list": (safetensors_bytes([1, 2, 3]), "not a JSON object"),
    "json_number": (safetensors_bytes(7), "not a JSON object"),
    "deep_nesting": (safetensors_bytes(None, raw_header=b"[" * 100_000), "nested too deeply"),
    "duplicate_names": (
        safetensors_bytes(
            None,
            raw_header=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            data=b"\0" * 8,
        ),
        "duplicate",
    ),
    "trailing_bytes": (safetensors_bytes({"a": entry("F32", [1], 0, 4)}, b"\0" * 8), "trailing"),
    "missing_bytes": (safetensors_bytes({"a": entry("F32", [4], 0, 16)}, b"\0" * 8), "truncated"),
    "overlap": (
        safetensors_bytes(
            {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, b"\0" * 12
        ),
        "overlaps",
    ),
    "gap": (
        safetensors_bytes(
            {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, b"\0" * 12
        ),
        "gap",
    ),
    "begin_after_end": (
        safetensors_bytes({"a": entry("F32", [1], 8, 4)}, b"\0" * 8),
        "begin > end",
    ),
    "negative_offset": (
        safetensors_bytes({"a": entry("F32", [1], -4, 0)}, b"\0" * 4),
        "data_offsets",
    ),
    "float_offset": (
        safetensors_bytes({"a": entry("F32", [1], 0.0, 4.0)}, b"\0" * 4),
        "data_offsets",
    ),
    "bool_offset": (safetensors_bytes({"a": entry("U8", [1], False, True)}, b"\0"), "data_offsets"),
    "missing_offsets": (
        safetensors_bytes({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4),
        "data_offsets",
    ),
    "three_offsets": (
        safetensors_bytes(
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 4
        ),
        "data_offsets",
    ),
    "wrong_length": (safetensors_bytes({"a": entry("F32", [3], 0, 8)}, b"\0" * 8), "needs 12"),
    "shape_overflow": (
        safetensors_bytes({"a": entry("F32", [2**40, 2**40], 0, 4)}, b"\0" * 4),
        "overflows",
    ),
    "negative_dim": (safetensors_bytes({"a": entry("F32", [-1], 0, 4)}, b"\0" * 4), "shape"),
    "unknown_dtype": (
        safetensors_bytes({"a": entry("F128", [1], 0, 16)}, b"\0" * 16),
        "unknown dtype",
    ),
    "metadata_not_strings": (
        safetensors_bytes({"__metadata__": {"epoch": 3}, "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        "__metadata__",
    ),
    "metadata_not_object": (
        safetensors_bytes({"__metadata__": [1], "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        "__metadata__",
    ),
    "hostile_name": (
        safetensors_bytes({"evil\n\x1b[31mname": entry("F32", [3], 0, 8)}, b"\0" * 8),
        "evil\\n\\x1b[31mname",
    ),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_safetensors_corpus(tmp_path: Path, case: str) -> None:
    payload, mention = SAFETENSORS_CASES[case]
    path = st_file("bad.safetensors", payload)(tmp_path)
    assert_refused(path, 3, mention)


def test_a_million_empty_tensors_are_refused_fast(tmp_path: Path) -> None:
    header = {f"t{i}": entry("F32", [0], 0, 0) for i in range(10**6)}
    path = tmp_path / "many.safetensors"
    path.write_bytes(safetensors_bytes(header))
    assert_refused(path, 3, "200000")


# ------------------------------------------------------------------ npz


def npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def raw_npy(header: str) -> bytes:
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


def zip_of(members: list[tuple[str, bytes]], method: int = zipfile.ZIP_STORED) -> Builder:
    def build(directory: Path) -> Path:
        path = directory / "bad.npz"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with zipfile.ZipFile(path, "w", method) as archive:
                for name, data in members:
                    archive.writestr(name, data)
        return path

    return build


def zip_bomb(directory: Path) -> Path:
    path = directory / "bomb.npz"
    size = 200 << 20
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("a.npy", "w", force_zip64=True) as member:
            member.write(
                raw_npy(f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({size},), }}")
            )
            block = bytes(1 << 20)
            for _ in range(size >> 20):
                member.write(block)
    return path


def pickle_as_npz(directory: Path) -> Path:
    import pickle

    path = directory / "evil.npz"
    path.write_bytes(pickle.dumps({"a": np.zeros(3)}))
    return path


def truncated_npz(directory: Path) -> Path:
    path = directory / "cut.npz"
    np.savez(path, a=np.arange(1000.0))
    path.write_bytes(path.read_bytes()[:3000])
    return path


def bad_crc_npz(directory: Path) -> Path:
    path = directory / "crc.npz"
    np.savez(path, a=np.arange(1000.0))
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


NPZ_CASES: dict[str, tuple[Builder, str]] = {
    "object_array": (zip_of([("a.npy", npy(np.array([{"x": 1}], dtype=object)))]), "objects"),
    "pickle_disguised": (pickle_as_npz, "unknown leading bytes"),
    "header_over_cap": (
        zip_of(
            [
                (
                    "a.npy",
                    raw_npy(
                        "{'descr': '<f8', 'fortran_order': False, 'shape': (1,), "
                        + " " * 50_000
                        + "}"
                    ),
                )
            ]
        ),
        "exceeds",
    ),
    "declared_1e12_elements": (
        zip_of(
            [
                (
                    "a.npy",
                    raw_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }")
                    + b"\0" * 8,
                )
            ]
        ),
        "needs 8000000000000",
    ),
    "shape_overflow": (
        zip_of(
            [
                (
                    "a.npy",
                    raw_npy(
                        "{'descr': '<f8', 'fortran_order': False, "
                        "'shape': (4611686018427387904, 4), }"
                    ),
                )
            ]
        ),
        "overflows",
    ),
    "zip_bomb": (zip_bomb, "zip bomb"),
    "no_npy_magic": (zip_of([("a.npy", b"hello, world")]), "magic"),
    "duplicate_members": (
        zip_of([("a.npy", npy(np.zeros(2))), ("a.npy", npy(np.zeros(2)))]),
        "duplicate",
    ),
    "a_and_a_npy": (zip_of([("a.npy", npy(np.zeros(2))), ("a", b"x")]), "not a .npy"),
    "path_traversal": (zip_of([("../evil.npy", npy(np.zeros(2)))]), "escapes"),
    "extra_bytes": (zip_of([("a.npy", npy(np.zeros(2)) + b"\0" * 8)]), "needs 16"),
    "truncated_zip": (truncated_npz, "not a valid npz"),
    "bad_crc": (bad_crc_npz, "'a'"),
    "structured": (
        zip_of([("a.npy", npy(np.zeros(2, dtype=[("x", "<f4"), ("y", "<i4")])))]),
        "structured",
    ),
    "datetime": (
        zip_of([("a.npy", npy(np.array(["2026-11-22"], dtype="datetime64[D]")))]),
        "not numeric",
    ),
    "strings": (zip_of([("a.npy", npy(np.array(["hello"])))]), "not numeric"),
}


@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_npz_corpus(tmp_path: Path, case: str) -> None:
    build, mention = NPZ_CASES[case]
    assert_refused(build(tmp_path), 3, mention)


# ------------------------------------------------------------------ HDF5


def h5(name: str, fill: Callable[[h5py.File, Path], None]) -> Builder:
    def build(directory: Path) -> Path:
        path = directory / name
        with h5py.File(path, "w") as f:
            fill(f, directory)
        return path

    return build


def external_storage_to(target: Callable[[Path], str]) -> Callable[[h5py.File, Path], None]:
    def fill(f: h5py.File, directory: Path) -> None:
        f.create_dataset("x", shape=(16,), dtype="<f8", external=[(target(directory), 0, 128)])

    return fill


def other_file(directory: Path) -> str:
    secret = directory / "secret.bin"
    secret.write_bytes(b"S" * 128)
    return str(secret)


def fifo(directory: Path) -> str:
    path = directory / "pipe"
    os.mkfifo(path)
    return str(path)


def virtual(f: h5py.File, directory: Path) -> None:
    source = directory / "source.h5"
    with h5py.File(source, "w") as s:
        s["data"] = np.arange(4.0)
    layout = h5py.VirtualLayout(shape=(4,), dtype="<f8")
    layout[:] = h5py.VirtualSource(str(source), "data", shape=(4,))
    f.create_virtual_dataset("v", layout)


def unknown_filter(f: h5py.File, directory: Path) -> None:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk((4,))
    dcpl.set_filter(32123, h5py.h5z.FLAG_OPTIONAL)
    space = h5py.h5s.create_simple((4,))
    h5py.h5d.create(f.id, b"x", h5py.h5t.IEEE_F64LE, space, dcpl=dcpl)


def truncated_h5(directory: Path) -> Path:
    path = directory / "cut.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(10_000.0)
    path.write_bytes(path.read_bytes()[:4000])
    return path


def not_hdf5(directory: Path) -> Path:
    path = directory / "fake.h5"
    path.write_bytes(b"definitely not HDF5" * 10)
    return path


def opaque(f: h5py.File, directory: Path) -> None:
    f.create_dataset("x", data=np.void(b"\x01\x02\x03\x04"))


H5_CASES: dict[str, tuple[Builder, str]] = {
    "external_link": (
        h5("a.h5", lambda f, d: f.__setitem__("x", h5py.ExternalLink("/etc/passwd", "/"))),
        "external link",
    ),
    "soft_link": (
        h5(
            "a.h5",
            lambda f, d: (
                f.__setitem__("real", np.ones(2)),
                f.__setitem__("x", h5py.SoftLink("/real")),
            ),
        ),
        "soft link",
    ),
    "dangling_link": (
        h5("a.h5", lambda f, d: f.__setitem__("x", h5py.SoftLink("/nowhere"))),
        "soft link",
    ),
    "link_loop": (
        h5(
            "a.h5",
            lambda f, d: (
                f.__setitem__("a", h5py.SoftLink("/b")),
                f.__setitem__("b", h5py.SoftLink("/a")),
            ),
        ),
        "soft link",
    ),
    "external_storage_file": (h5("a.h5", external_storage_to(other_file)), "external"),
    "external_storage_dev_zero": (
        h5("a.h5", external_storage_to(lambda d: "/dev/zero")),
        "external",
    ),
    "external_storage_fifo": (h5("a.h5", external_storage_to(fifo)), "external"),
    "virtual_dataset": (h5("a.h5", virtual), "virtual"),
    "declares_8TB": (
        h5(
            "a.h5",
            lambda f, d: f.create_dataset(
                "x", shape=(2**40,), dtype="<f8", chunks=(1024,), compression="gzip"
            ),
        ),
        "'x'",
    ),
    "unknown_filter": (h5("a.h5", unknown_filter), "filter"),
    "vlen_string": (
        h5("a.h5", lambda f, d: f.create_dataset("x", data=["a", "bb"], dtype=h5py.string_dtype())),
        "'x'",
    ),
    "compound": (
        h5(
            "a.h5",
            lambda f, d: f.create_dataset(
                "x", data=np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])
            ),
        ),
        "'x'",
    ),
    "reference": (
        h5("a.h5", lambda f, d: f.create_dataset("x", data=[f.ref], dtype=h5py.ref_dtype)),
        "'x'",
    ),
    "opaque": (h5("a.h5", opaque), "'x'"),
    "empty_dataspace": (
        h5("a.h5", lambda f, d: f.create_dataset("x", data=h5py.Empty("<f8"))),
        "'x'",
    ),
    "not_hdf5": (not_hdf5, "HDF5"),
    "truncated": (truncated_h5, "cut.h5"),
}


@pytest.mark.parametrize("case", sorted(H5_CASES))
def test_hdf5_corpus(tmp_path: Path, case: str) -> None:
    build, mention = H5_CASES[case]
    assert_refused(build(tmp_path), 3, mention)


# ------------------------------------------------------------------ general


def test_directory_fifo_and_dev_zero(tmp_path: Path) -> None:
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    proc = clipcli("norms", str(empty), cwd=tmp_path)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1
    pipe = tmp_path / "pipe.safetensors"
    os.mkfifo(pipe)
    proc = clipcli("norms", str(pipe), cwd=tmp_path)  # must not block on the FIFO
    assert proc.returncode == 3 and "not a regular file" in proc.stderr
    proc = clipcli("norms", "/dev/zero", cwd=tmp_path)
    assert proc.returncode == 3 and "not a regular file" in proc.stderr


def test_extension_disagreeing_with_content(tmp_path: Path) -> None:
    path = tmp_path / "model.npz"
    path.write_bytes(safetensors_bytes({"a": entry("F32", [1], 0, 4)}, b"\0" * 4))
    assert_refused(path, 3, "extension says npz but the content is safetensors")


def write_st(path: Path, array: np.ndarray) -> Path:
    from safetensors.numpy import save_file

    save_file({"x": array}, str(path))
    return path


@pytest.mark.parametrize(
    ("array", "count"),
    [(np.array([1.0, np.nan]), 1), (np.array([np.inf, -np.inf, 1.0], dtype=np.float32), 2)],
)
def test_nonfinite_values(tmp_path: Path, array: np.ndarray, count: int) -> None:
    path = write_st(tmp_path / "nan.safetensors", array)
    proc = clipcli("norms", "--format", "json", str(path), cwd=tmp_path)
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["tensors"][0]["nonfinite"] == count
    workdir_before = sorted(p.name for p in tmp_path.iterdir())
    proc = clipcli(
        "clip", "--global", "1", str(path), str(tmp_path / "o.safetensors"), cwd=tmp_path
    )
    assert proc.returncode == 4
    assert f"'x' ({count} non-finite)" in proc.stderr and proc.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == workdir_before


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.array([1e200, 1e200]), 1.4142135623730951e200),
        (np.array([1e-200, 1e-200]), 1.4142135623730951e-200),
        (np.full(16, 65504.0, dtype=np.float16), 262016.0),
        (np.full(4, 1e-45, dtype=np.float32), 2 * float(np.float32(1e-45))),
    ],
)
def test_extreme_but_finite_values(tmp_path: Path, array: np.ndarray, expected: float) -> None:
    path = write_st(tmp_path / "x.safetensors", array)
    proc = clipcli("norms", "--format", "json", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors"][0]["norm"] == pytest.approx(expected, rel=1e-15)
