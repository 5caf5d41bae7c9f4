"""Hostile .npz files: each is refused (exit 3) by `norms` and `clip --global 1`, run as
capped subprocesses, with one clean error line naming the file (and the tensor)."""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hostile_cli import assert_refused, refuse_input

Builder = Callable[[Path], Path]


def npy(array: np.ndarray) -> bytes:
    """What np.save writes, pickles included (for the object-array case)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def npy_header(header: str, version: int = 1) -> bytes:
    """A .npy magic, version and header text (padded as numpy pads it), without data."""
    text = header.encode("utf-8" if version >= 3 else "latin1")
    size_bytes = 2 if version == 1 else 4
    text += b" " * (-(8 + size_bytes + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(text).to_bytes(size_bytes, "little") + text


def f8_header(shape: str, descr: str = "<f8", fortran: str = "False") -> str:
    return f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}"


def zip_of(
    *members: tuple[str, bytes], method: int = zipfile.ZIP_STORED, name: str = "hostile.npz"
) -> Builder:
    """A zip with exactly these members (duplicates included: zipfile warns, we don't care)."""

    def build(directory: Path) -> Path:
        path = directory / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Duplicate name" for the duplicate-member case
            with zipfile.ZipFile(path, "w", method) as archive:
                for member, data in members:
                    archive.writestr(member, data)
        return path

    return build


def patched(build: Builder, edit: Callable[[bytearray], object]) -> Builder:
    """Build a valid file, then edit its bytes."""

    def wrapped(directory: Path) -> Path:
        path = build(directory)
        data = bytearray(path.read_bytes())
        edit(data)
        path.write_bytes(bytes(data))
        return path

    return wrapped


def _set_u16(signature: bytes, offset: int, value: int) -> Callable[[bytearray], None]:
    """Set a 16-bit field in every zip record with this signature."""

    def edit(data: bytearray) -> None:
        start = 0
        while (at := data.find(signature, start)) >= 0:
            data[at + offset : at + offset + 2] = value.to_bytes(2, "little")
            start = at + 4

    return edit


def _or_u16(signature: bytes, offset: int, bits: int) -> Callable[[bytearray], None]:
    def edit(data: bytearray) -> None:
        start = 0
        while (at := data.find(signature, start)) >= 0:
            data[at + offset] |= bits
            start = at + 4

    return edit


LOCAL, CENTRAL = b"PK\x03\x04", b"PK\x01\x02"
GOOD = npy(np.arange(4.0))


def zip_bomb(directory: Path) -> Path:
    """200 MiB of zeros deflated to ~200 KB, written as a stream so the test stays small."""
    path = directory / "bomb.npz"
    size = 200 << 20
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("bomb.npy", "w", force_zip64=True) as member,
    ):
        member.write(npy_header(f8_header(f"({size},)", "|u1")))
        block = bytes(1 << 20)
        for _ in range(size >> 20):
            member.write(block)
    return path


def pickle_renamed(directory: Path) -> Path:
    path = directory / "hostile.npz"
    path.write_bytes(pickle.dumps({"a": np.zeros(3)}))
    return path


def np_savez(compressed: bool, **arrays: np.ndarray) -> Builder:
    def build(directory: Path) -> Path:
        path = directory / "hostile.npz"
        if compressed:
            np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
        else:
            np.savez(path, **arrays)  # type: ignore[arg-type]
        return path

    return build


def truncated(keep: Callable[[int], int], compressed: bool = False) -> Builder:
    return patched(
        np_savez(compressed, a=np.arange(1000.0), b=np.ones(10)),
        lambda data: data.__delitem__(slice(keep(len(data)), None)),
    )


def flip_in_stored_data(data: bytearray) -> None:
    """Flip one byte inside the stored member's array data (not its .npy header)."""
    at = data.find(np.arange(1000.0)[500:501].tobytes())
    assert at > 0
    data[at + 3] ^= 0xFF


def corrupt_deflate_stream(data: bytearray) -> None:
    at = data.find(LOCAL)
    name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
    body = at + 30 + name_len + extra_len
    for i in range(body + 10, body + 40):
        data[i] ^= 0x5A


def sizes_lie(directory: Path) -> Path:
    """A stored member whose central-directory sizes claim ~4 GiB over 16 real bytes, with
    a .npy header that agrees with the claim."""
    claimed = 2**32 - 1  # the largest size without a zip64 record
    header = npy_header(f8_header(f"({claimed - 128},)", "|u1"))
    assert len(header) == 128
    path = zip_of(("lie.npy", header + bytes(16)))(directory)
    data = bytearray(path.read_bytes())
    at = data.find(CENTRAL)
    data[at + 20 : at + 28] = struct.pack("<II", claimed, claimed)  # compressed, uncompressed
    path.write_bytes(bytes(data))
    return path


T = "w_bad"  # the tensor every member-level case damages; its name must be in the error

# case -> (builder, strings the error line must contain besides the path)
CASES: dict[str, tuple[Builder, tuple[str, ...]]] = {
    # ---- code execution and disguises
    "object_array_pickle": (zip_of((f"{T}.npy", npy(np.array([{"x": 1}], dtype=object)))), (T,)),
    "pickle_renamed_npz": (pickle_renamed, ()),
    "zip_of_nothing_but_junk": (lambda d: _write(d, b"PK\x03\x04" + b"\0" * 100), ()),
    # ---- .npy headers
    "header_over_cap_v1": (
        zip_of((f"{T}.npy", npy_header(f8_header("(1,)")[:-1] + " " * 60_000 + "}") + bytes(8))),
        (T,),
    ),
    "header_100KB_v2": (
        zip_of(
            (f"{T}.npy", npy_header(f8_header("(1,)")[:-1] + " " * 100_000 + "}", 2) + bytes(8))
        ),
        (T,),
    ),
    "header_length_claims_4GB": (
        zip_of((f"{T}.npy", b"\x93NUMPY\x02\x00" + b"\xff\xff\xff\xff" + b"{}")),
        (T,),
    ),
    "declares_1e12_elements_over_8_bytes": (
        zip_of((f"{T}.npy", npy_header(f8_header("(1000000000000,)")) + bytes(8))),
        (T,),
    ),
    "declares_1e12_elements_deflated": (
        zip_of(
            (f"{T}.npy", npy_header(f8_header("(1000000000000,)")) + bytes(8)),
            method=zipfile.ZIP_DEFLATED,
        ),
        (T,),
    ),
    "shape_overflows_int64": (
        zip_of((f"{T}.npy", npy_header(f8_header("(4611686018427387904, 4)")))),
        (T,),
    ),
    "shape_overflows_int64_squared": (
        zip_of((f"{T}.npy", npy_header(f8_header(f"({2**40}, {2**40})")))),
        (T,),
    ),
    "shape_negative": (zip_of((f"{T}.npy", npy_header(f8_header("(-1,)")) + bytes(8))), (T,)),
    "shape_bool": (zip_of((f"{T}.npy", npy_header(f8_header("(True,)")) + bytes(8))), (T,)),
    "shape_float": (zip_of((f"{T}.npy", npy_header(f8_header("(1.0,)")) + bytes(8))), (T,)),
    "shape_not_tuple": (zip_of((f"{T}.npy", npy_header(f8_header("1")) + bytes(8))), (T,)),
    "fortran_order_not_bool": (
        zip_of((f"{T}.npy", npy_header(f8_header("(1,)", fortran="1")) + bytes(8))),
        (T,),
    ),
    "header_not_a_literal": (
        zip_of((f"{T}.npy", npy_header("__import__('os').system('true')") + bytes(8))),
        (T,),
    ),
    "header_not_a_dict": (zip_of((f"{T}.npy", npy_header("[1, 2, 3]") + bytes(8))), (T,)),
    "header_missing_key": (
        zip_of((f"{T}.npy", npy_header("{'descr': '<f8', 'shape': (1,)}") + bytes(8))),
        (T,),
    ),
    "header_deeply_nested": (
        zip_of((f"{T}.npy", npy_header("(" * 3000 + ")" * 3000) + bytes(8))),
        (T,),
    ),
    "npy_version_9": (
        zip_of((f"{T}.npy", b"\x93NUMPY\x09\x00" + npy_header(f8_header("(1,)"))[8:] + bytes(8))),
        (T,),
    ),
    "no_npy_magic": (zip_of((f"{T}.npy", b"hello, world, not an array")), (T,)),
    "member_shorter_than_magic": (zip_of((f"{T}.npy", b"\x93NUM")), (T,)),
    # ---- data size against the header
    "extra_bytes_after_data": (zip_of((f"{T}.npy", GOOD + b"\0" * 8)), (T,)),
    "missing_bytes_of_data": (zip_of((f"{T}.npy", GOOD[:-8])), (T,)),
    "extra_bytes_after_data_deflated": (
        zip_of((f"{T}.npy", GOOD + b"\0" * 8), method=zipfile.ZIP_DEFLATED),
        (T,),
    ),
    "central_directory_sizes_lie": (sizes_lie, ("lie",)),
    "zip_bomb_200MiB": (zip_bomb, ("bomb",)),
    # ---- member names
    "duplicate_members": (zip_of((f"{T}.npy", GOOD), (f"{T}.npy", GOOD)), (T,)),
    "both_a_and_a_npy": (zip_of((f"{T}.npy", GOOD), (T, GOOD)), (T,)),
    "member_not_npy": (zip_of(("a.npy", GOOD), ("notes.txt", b"hello")), ("notes.txt",)),
    "path_traversal": (zip_of(("../evil.npy", GOOD)), ("evil",)),
    "deep_path_traversal": (zip_of(("a/../../../evil.npy", GOOD)), ("evil",)),
    "absolute_member": (zip_of(("/etc/evil.npy", GOOD)), ("evil",)),
    "backslash_traversal": (zip_of(("..\\evil.npy", GOOD)), ("evil",)),
    "directory_member": (zip_of(("d/", b""), ("d/a.npy", GOOD)), ()),
    # ---- the zip container
    "truncated_zip_half": (truncated(lambda n: n // 2), ()),
    "truncated_zip_in_central_directory": (truncated(lambda n: n - 30), ()),
    "truncated_zip_after_local_header": (truncated(lambda _n: 40), ()),
    "truncated_compressed_zip": (truncated(lambda n: n - 200, compressed=True), ()),
    "bad_crc_in_stored_data": (
        patched(np_savez(False, a=np.arange(1000.0)), flip_in_stored_data),
        ("'a'",),
    ),
    "corrupt_deflate_stream": (
        patched(np_savez(True, a=np.random.default_rng(0).random(1000)), corrupt_deflate_stream),
        ("'a'",),
    ),
    "unknown_compression_method": (
        patched(
            zip_of((f"{T}.npy", GOOD)),
            lambda d: (_set_u16(LOCAL, 8, 99)(d), _set_u16(CENTRAL, 10, 99)(d)),
        ),
        (T,),
    ),
    "encrypted_member": (
        patched(
            zip_of((f"{T}.npy", GOOD)),
            lambda d: (_or_u16(LOCAL, 6, 1)(d), _or_u16(CENTRAL, 8, 1)(d)),
        ),
        (T,),
    ),
    "local_name_differs_from_central": (
        patched(zip_of(("aaaa.npy", GOOD)), lambda d: d.__setitem__(slice(30, 34), b"bbbb")),
        (),
    ),
    # ---- dtypes that are not tensors
    "structured_dtype": (
        zip_of((f"{T}.npy", npy(np.zeros(2, dtype=[("x", "<f4"), ("y", "<i4")])))),
        (T,),
    ),
    "datetime_dtype": (
        zip_of((f"{T}.npy", npy(np.array(["2026-11-22"], dtype="datetime64[D]")))),
        (T,),
    ),
    "timedelta_dtype": (zip_of((f"{T}.npy", npy(np.array([1], dtype="timedelta64[s]")))), (T,)),
    "unicode_dtype_U5": (zip_of((f"{T}.npy", npy(np.array(["hello"], dtype="<U5")))), (T,)),
    "bytes_dtype_S5": (zip_of((f"{T}.npy", npy(np.array([b"hello"], dtype="S5")))), (T,)),
    "void_dtype_V8": (zip_of((f"{T}.npy", npy(np.zeros(2, dtype="V8")))), (T,)),
    "subarray_descr": (
        zip_of((f"{T}.npy", npy_header(f8_header("(1,)", descr="(2,)<f4")) + bytes(8))),
        (T,),
    ),
    "unknown_descr": (
        zip_of((f"{T}.npy", npy_header(f8_header("(1,)", descr="<q7")) + bytes(8))),
        (T,),
    ),
}


def _write(directory: Path, data: bytes) -> Path:
    path = directory / "hostile.npz"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_npz_is_refused(tmp_path: Path, case: str) -> None:
    build, mentions = CASES[case]
    refuse_input(build(tmp_path), 3, *mentions)


def test_hostile_member_name_stays_on_one_line(tmp_path: Path) -> None:
    """A bad member whose name holds a newline and an ANSI escape: still one line."""
    path = zip_of(("evil\n\x1b[31mname.npy", npy(np.array(["x"]))))(tmp_path)
    refuse_input(path, 3, "evil", "name")


def test_crc_is_checked_for_every_member(tmp_path: Path) -> None:
    """The bad CRC sits in the second member; the first is fine."""
    path = tmp_path / "crc.npz"
    np.savez(path, first=np.ones(3), a=np.arange(1000.0))
    data = bytearray(path.read_bytes())
    flip_in_stored_data(data)
    path.write_bytes(bytes(data))
    refuse_input(path, 3, "'a'")


def test_bad_member_is_refused_even_when_not_selected(tmp_path: Path) -> None:
    """--include does not let a damaged member slip through unchecked into the output."""
    path = zip_of(("good.npy", GOOD), (f"{T}.npy", GOOD + b"junk"))(tmp_path)
    out = tmp_path / "out.npz"
    assert_refused(
        ["clip", "--include", "good", "--global", "1", str(path), str(out)],
        3,
        [str(path), T],
        watch=tmp_path,
    )
