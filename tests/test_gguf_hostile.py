"""Hostile GGUF headers: each is refused with exit 3 and one line naming the file, before
anything is allocated or read from what it claims. The bytes are built by hand here (a
few bytes of header each), so that every case's reproduction is in the table."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_one_error_line

from clipcli.formats.gguf.header import (
    MAX_ALIGNMENT,
    MAX_DIMS,
    MAX_NESTING,
    MAX_TENSORS,
    MalformedGGUF,
    read_header,
)

U8, U32, U64, STRING, ARRAY = 0, 4, 10, 8, 9
F32, Q8_0 = 0, 8


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, value_type: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", value_type) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def info(name: str, ne: list[int], ggml_type: int = F32, offset: int = 0) -> bytes:
    dims = b"".join(struct.pack("<Q", d) for d in ne)
    return s(name) + struct.pack("<I", len(ne)) + dims + struct.pack("<IQ", ggml_type, offset)


def gguf(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    infos: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    alignment: int = 32,
    counts: tuple[int, int] | None = None,
    version: int = 3,
) -> bytes:
    """A GGUF file: header, KVs, tensor infos, padding to `alignment`, then `data`."""
    tensors, kv_count = counts if counts is not None else (len(infos), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, tensors, kv_count) + b"".join(kvs)
    head += b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


ONE = info("w", [4])  # one F32 tensor of 4 values: 16 bytes of data
GOOD = gguf([], [ONE], b"\0" * 16)

# case -> (file bytes, strings the error line must hold besides the path)
CASES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "empty": (b"", ("too short",)),
    "magic_only": (b"GGUF", ("inside the GGUF header",)),
    "version_1": (gguf(version=1), ("version 1",)),
    "version_4": (gguf(version=4), ("version 4",)),
    "counts_cut_short": (b"GGUF" + struct.pack("<IQ", 3, 0), ("past the end",)),
    "tensor_count_u64_max": (gguf(counts=(2**64 - 1, 0)), ("tensor count",)),
    "tensor_count_past_limit": (gguf(counts=(MAX_TENSORS + 1, 0)), ("tensor count",)),
    "tensor_count_past_the_file": (gguf(counts=(1000, 0)), ("tensor count 1000",)),
    "kv_count_u64_max": (gguf(counts=(0, 2**64 - 1)), ("metadata count",)),
    "kv_count_2_63": (gguf(counts=(0, 2**63)), ("metadata count",)),
    "key_length_2_63": (
        b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**63) + b"k" * 16,
        ("claims 9223372036854775808 bytes",),
    ),
    "string_value_length_2_63": (
        gguf([kv("k", STRING, struct.pack("<Q", 2**63) + b"abc")]),
        ("'k'", "claims 9223372036854775808"),
    ),
    "string_value_u64_max": (gguf([kv("k", STRING, struct.pack("<Q", 2**64 - 1))]), ("'k'",)),
    "array_of_2_40_u8": (
        gguf([kv("a", ARRAY, struct.pack("<IQ", U8, 2**40) + b"\0" * 64)]),
        ("'a'", "1099511627776 items"),
    ),
    "array_of_2_40_strings": (
        gguf([kv("a", ARRAY, struct.pack("<IQ", STRING, 2**40))]),
        ("'a'", "items"),
    ),
    "array_string_item_past_end": (
        gguf([kv("a", ARRAY, struct.pack("<IQ", STRING, 2) + s("x") + struct.pack("<Q", 2**62))]),
        ("'a'[1]",),
    ),
    "array_nested_too_deep": (
        gguf([kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * (MAX_NESTING + 1) + b"\0" * 64)]),
        ("nests arrays",),
    ),
    "unknown_value_type": (gguf([kv("k", 13, b"\0" * 8)]), ("unknown value type 13",)),
    "unknown_array_item_type": (
        gguf([kv("k", ARRAY, struct.pack("<IQ", 99, 0))]),
        ("unknown item type 99",),
    ),
    "key_not_utf8": (
        gguf([kv("k", U8, b"\0")]).replace(b"\x01\0\0\0\0\0\0\0k", b"\x01" + b"\0" * 7 + b"\xff"),
        ("UTF-8",),
    ),
    "duplicate_key": (gguf([u32("k", 1), u32("k", 2)]), ("'k' appears twice",)),
    "alignment_zero": (gguf([u32("general.alignment", 0)], [ONE], b"\0" * 16), ("alignment 0",)),
    "alignment_three": (gguf([u32("general.alignment", 3)], [ONE], b"\0" * 16), ("alignment 3",)),
    "alignment_past_limit": (
        gguf([u32("general.alignment", MAX_ALIGNMENT * 2)], [ONE], b"\0" * 16),
        ("alignment",),
    ),
    "alignment_not_u32": (
        gguf([kv("general.alignment", U64, struct.pack("<Q", 32))], [ONE], b"\0" * 16),
        ("not a uint32",),
    ),
    "too_many_dims": (gguf([], [info("w", [1] * (MAX_DIMS + 1))], b"\0" * 4), ("'w'", "5 dim")),
    "dimension_2_63": (gguf([], [info("w", [2**63, 0])]), ("'w'", "2**63")),
    "dims_product_overflows": (gguf([], [info("w", [2**62, 2**62])]), ("'w'", "overflows")),
    "dims_product_overflows_bytes": (gguf([], [info("w", [2**61, 1])]), ("'w'", "overflows")),
    "unknown_ggml_type": (gguf([], [info("w", [4], 4)], b"\0" * 16), ("'w'", "ggml type 4")),
    "removed_ggml_type_31": (gguf([], [info("w", [4], 31)], b"\0" * 16), ("ggml type 31",)),
    "ggml_type_u32_max": (gguf([], [info("w", [4], 2**32 - 1)], b"\0" * 16), ("ggml type",)),
    "partial_block_row": (gguf([], [info("w", [33], Q8_0)], b"\0" * 64), ("'w'", "whole blocks")),
    "block_type_without_dims": (gguf([], [info("w", [], Q8_0)], b"\0" * 64), ("'w'",)),
    "offset_misaligned": (gguf([], [info("w", [4], offset=4)], b"\0" * 48), ("'w'", "multiple")),
    "offset_u64_max": (gguf([], [info("w", [4], offset=2**64 - 32)], b"\0" * 16), ("'w'",)),
    "offset_past_end": (gguf([], [info("w", [4], offset=64)], b"\0" * 16), ("'w'", "gap")),
    "overlapping_tensors": (
        gguf([], [ONE, info("v", [4], offset=0)], b"\0" * 48),
        ("'v'", "overlaps"),
    ),
    "second_tensor_inside_first": (
        gguf([], [info("w", [16]), info("v", [4], offset=32)], b"\0" * 96),
        ("'v'", "overlaps"),
    ),
    "data_past_end": (gguf([], [info("w", [1000])], b"\0" * 16), ("'w'", "past the end")),
    "truncated_data": (GOOD[:-1], ("'w'", "past the end")),
    "trailing_bytes": (GOOD + b"\0" * 17, ("trailing bytes",)),
    "duplicate_tensor_name": (
        gguf([], [ONE, info("w", [4], offset=32)], b"\0" * 48),
        ("'w'", "twice"),
    ),
    "empty_tensor_name": (gguf([], [info("", [4])], b"\0" * 16), ("name is empty",)),
    "tensor_name_not_utf8": (
        gguf([], [info("w", [4])], b"\0" * 16).replace(b"\0w", b"\0\xff"),
        ("UTF-8",),
    ),
    "tensor_name_past_end": (
        b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 2**63) + b"\0" * 32,
        ("claims 9223372036854775808",),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_gguf_header_is_refused(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipcli.cli.entry import main

    content, mentions = CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    for argv in (["ls", str(path)], ["norms", str(path)]):
        assert main(argv) == 3, argv
        assert_one_error_line(capsys.readouterr().err, str(path), *mentions)


def test_the_good_case_of_the_table_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The builder makes readable files: each case is refused for its own fault."""
    from clipcli.cli.entry import main

    path = tmp_path / "m.gguf"
    for good in (
        GOOD,
        GOOD + b"",  # ends at the tensor's end (its padding is optional)
        gguf([], [ONE], b"\0" * 32),  # ends at the padded end
        gguf([u32("general.alignment", 1)], [ONE], b"\0" * 16, alignment=1),
        gguf([u32("general.alignment", MAX_ALIGNMENT)], [ONE], b"\0" * 16, alignment=MAX_ALIGNMENT),
        gguf([], [info("w", [1] * MAX_DIMS)], b"\0" * 4),
        gguf(
            [
                kv(
                    "a",
                    ARRAY,
                    struct.pack("<IQ", ARRAY, 1) * (MAX_NESTING - 1) + struct.pack("<IQ", U8, 0),
                )
            ]
        ),
        gguf([], [info("w", [32], Q8_0)], b"\0" * 34),
        gguf(),
    ):
        path.write_bytes(good)
        assert main(["norms", str(path)]) == 0, capsys.readouterr().err
        capsys.readouterr()


@pytest.mark.slow  # ~3 s: 200,000 tensor infos parsed twice
def test_tensor_count_at_the_limit_and_one_past(tmp_path: Path) -> None:
    entries = [info(f"t{i}", [0]) for i in range(MAX_TENSORS)]
    path = tmp_path / "many.gguf"
    path.write_bytes(gguf([], entries))
    with path.open("rb") as handle:
        header = read_header(handle.fileno(), path.stat().st_size)
    assert len(header.tensors) == MAX_TENSORS
    path.write_bytes(gguf([], [*entries, info("one_more", [0])]))
    with path.open("rb") as handle, pytest.raises(MalformedGGUF, match="tensor count 200001"):
        read_header(handle.fileno(), path.stat().st_size)


def _capped(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m clipcli ARGS` under `prlimit --as` (512 MiB): a reader that allocated what
    a header claims would fail with MemoryError, not this file's own refusal."""
    cap = 512 << 20
    return subprocess.run(
        ["prlimit", f"--as={cap}", sys.executable, "-m", "clipcli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "case",
    ["string_value_length_2_63", "array_of_2_40_u8", "kv_count_2_63", "dims_product_overflows"],
)
def test_huge_claims_are_refused_under_an_address_space_cap(case: str, tmp_path: Path) -> None:
    content, mentions = CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    done = _capped("norms", str(path))
    assert done.returncode == 3, done.stderr
    assert_one_error_line(done.stderr, str(path), *mentions)


def test_a_big_array_is_skipped_not_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB u8 array is skipped by its size, not read item by item."""
    import os

    big = kv("a", ARRAY, struct.pack("<IQ", U8, 16 << 20) + b"\0" * (16 << 20))
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf([big], [ONE], b"\0" * 16))
    reads: list[int] = []
    real = os.pread

    def counting(fd: int, count: int, offset: int) -> bytes:
        reads.append(count)
        return real(fd, count, offset)

    monkeypatch.setattr(os, "pread", counting)
    with path.open("rb") as handle:
        header = read_header(handle.fileno(), path.stat().st_size)
    assert [t.name for t in header.tensors] == ["w"]
    assert sum(reads) < 4 << 20
