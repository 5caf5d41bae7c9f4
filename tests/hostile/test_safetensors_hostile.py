"""Hostile .safetensors files: each is refused (exit 3) by `norms` and `clip --global 1`,
run as capped subprocesses, with one clean error line naming the file (and the tensor).

The bytes are written by hand: every case is a few bytes of header, built here so that the
reproduction of any failure is in the case table.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from hostile_cli import SLOW_LIMIT, assert_refused, check_error_line, refuse_input, run_clipcli

U64 = struct.Struct("<Q")


def st(header: object, data: bytes = b"") -> bytes:
    """8-byte length, the header as compact JSON, then the data buffer."""
    return st_raw(json.dumps(header, separators=(",", ":")).encode(), data)


def st_raw(text: bytes, data: bytes = b"") -> bytes:
    return U64.pack(len(text)) + text + data


def entry(dtype: object, shape: object, offsets: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def f32(name: str, shape: object, offsets: object, data: bytes) -> bytes:
    """One tensor named `name` with the given shape and offsets."""
    return st({name: entry("F32", shape, offsets)}, data)


GOOD = entry("F32", [1], [0, 4])
T = "w.bad"  # the tensor every entry-level case damages; its name must be in the error

# case -> (file bytes, strings the error line must contain besides the path)
CASES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    # ---- the 8-byte prefix
    "empty_file": (b"", ()),
    "three_bytes": (b"\x01\x02\x03", ()),
    "seven_bytes": (b"\x10\x00\x00\x00\x00\x00\x00", ()),
    "header_len_past_end": (U64.pack(1000) + b'{"a":1}', ()),
    "header_len_u64_max": (U64.pack(2**64 - 1) + b"{}", ()),
    "header_len_100MB_plus_1_prefix_only": (U64.pack(100_000_001), ()),
    "header_len_200MB_prefix_only": (U64.pack(200_000_000), ()),
    "header_len_zero": (U64.pack(0), ()),
    "header_len_one_short": (U64.pack(6) + b'{"a":1}', ()),
    # ---- the header text
    "not_utf8": (st_raw(b'{"\xff\xfe":{}}'), ()),
    "utf8_bom": (st_raw(b"\xef\xbb\xbf{}"), ()),
    "not_json": (st_raw(b"{this is not json"), ()),
    "nul_padding": (
        st_raw(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}\0\0\0', b"1234"),
        (),
    ),
    "json_list": (st([1, 2, 3]), ()),
    "json_number": (st(7), ()),
    "json_string": (st("tensors"), ()),
    "json_null": (st(None), ()),
    "deep_list_nesting": (st_raw(b"[" * 100_000), ()),
    "deep_object_nesting": (st_raw(b'{"a":' * 50_000 + b"1" + b"}" * 50_000), ()),
    "deep_nesting_in_entry": (
        st_raw(b'{"w.bad":{"dtype":"F32","shape":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"),
        (),
    ),
    "duplicate_tensor_names": (
        st_raw(
            b'{"w.bad":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"w.bad":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            b"\0" * 8,
        ),
        (T,),
    ),
    "duplicate_metadata": (
        st_raw(
            b'{"__metadata__":{},"__metadata__":{},"a":{"dtype":"F32","shape":[1],'
            b'"data_offsets":[0,4]}}',
            b"\0" * 4,
        ),
        ("__metadata__",),
    ),
    "duplicate_field_in_entry": (
        st_raw(
            b'{"w.bad":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4
        ),
        (),
    ),
    # ---- layout of the data buffer
    "trailing_bytes": (f32("a", [1], [0, 4], b"\0" * 8), ()),
    "missing_bytes": (f32("a", [4], [0, 16], b"\0" * 8), ()),
    "no_data_at_all": (f32("a", [4], [0, 16], b""), ()),
    "overlapping_offsets": (
        st({"a": entry("F32", [2], [0, 8]), T: entry("F32", [2], [4, 12])}, b"\0" * 12),
        (T,),
    ),
    "same_offsets_twice": (
        st({"a": entry("F32", [1], [0, 4]), T: entry("F32", [1], [0, 4])}, b"\0" * 4),
        (T,),
    ),
    "gap_between_tensors": (
        st({"a": entry("F32", [1], [0, 4]), T: entry("F32", [1], [8, 12])}, b"\0" * 12),
        (T,),
    ),
    "not_starting_at_zero": (f32(T, [1], [4, 8], b"\0" * 8), (T,)),
    "begin_after_end": (f32(T, [1], [8, 4], b"\0" * 8), (T,)),
    # ---- data_offsets
    "offsets_negative": (f32(T, [1], [-4, 0], b"\0" * 4), (T,)),
    "offsets_float": (f32(T, [1], [0.0, 4.0], b"\0" * 4), (T,)),
    "offsets_bool": (st({T: entry("U8", [1], [False, True])}, b"\0"), (T,)),
    "offsets_string": (f32(T, [1], ["0", "4"], b"\0" * 4), (T,)),
    "offsets_null": (f32(T, [1], None, b"\0" * 4), (T,)),
    "offsets_missing": (st({T: {"dtype": "F32", "shape": [1]}}, b"\0" * 4), (T,)),
    "offsets_one": (f32(T, [1], [4], b"\0" * 4), (T,)),
    "offsets_three": (f32(T, [1], [0, 4, 8], b"\0" * 4), (T,)),
    "offsets_nested": (f32(T, [1], [[0], [4]], b"\0" * 4), (T,)),
    "offsets_object": (f32(T, [1], {"begin": 0, "end": 4}, b"\0" * 4), (T,)),
    "offsets_past_u64": (f32(T, [0], [2**64, 2**64], b""), (T,)),
    # ---- shape and dtype
    "length_short_of_shape": (f32(T, [3], [0, 8], b"\0" * 8), (T,)),
    "length_past_shape": (f32(T, [1], [0, 8], b"\0" * 8), (T,)),
    "shape_overflows_int64": (f32(T, [2**40, 2**40], [0, 4], b"\0" * 4), (T,)),
    "shape_bytes_overflow_int64": (f32(T, [2**62, 4], [0, 4], b"\0" * 4), (T,)),
    "shape_dim_past_u64_times_zero": (f32(T, [0, 2**70], [0, 0], b""), (T,)),
    "shape_negative_dim": (f32(T, [-1], [0, 4], b"\0" * 4), (T,)),
    "shape_negative_pair": (f32(T, [-2, -2], [0, 16], b"\0" * 16), (T,)),
    "shape_float_dim": (f32(T, [1.0], [0, 4], b"\0" * 4), (T,)),
    "shape_string_dim": (f32(T, ["1"], [0, 4], b"\0" * 4), (T,)),
    "shape_bool_dim": (f32(T, [True], [0, 4], b"\0" * 4), (T,)),
    "shape_not_a_list": (f32(T, 1, [0, 4], b"\0" * 4), (T,)),
    "shape_missing": (st({T: {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4), (T,)),
    "dtype_unknown": (st({T: entry("F128", [1], [0, 16])}, b"\0" * 16), (T,)),
    "dtype_lowercase": (st({T: entry("f32", [1], [0, 4])}, b"\0" * 4), (T,)),
    "dtype_number": (st({T: entry(5, [1], [0, 4])}, b"\0" * 4), (T,)),
    "dtype_missing": (st({T: {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), (T,)),
    "dtype_packed_f4": (st({T: entry("F4", [2], [0, 1])}, b"\0"), (T,)),
    "entry_not_object": (st({T: [1, 2]}), (T,)),
    "entry_null": (st({T: None}), (T,)),
    # ---- __metadata__
    "metadata_int_value": (st({"__metadata__": {"epoch": 3}, "a": GOOD}, b"\0" * 4), ("epoch",)),
    "metadata_null_value": (st({"__metadata__": {"k": None}, "a": GOOD}, b"\0" * 4), ()),
    "metadata_list_value": (st({"__metadata__": {"k": ["v"]}, "a": GOOD}, b"\0" * 4), ()),
    "metadata_nested_object": (
        st({"__metadata__": {"k": {"x": "y"}}, "a": GOOD}, b"\0" * 4),
        (),
    ),
    "metadata_is_list": (st({"__metadata__": ["a", "b"], "a": GOOD}, b"\0" * 4), ()),
    "metadata_is_string": (st({"__metadata__": "pt", "a": GOOD}, b"\0" * 4), ()),
    "metadata_shaped_like_tensor": (st({"__metadata__": GOOD}, b"\0" * 4), ()),
    # ---- text the official reader (serde_json) refuses: lone UTF-16 surrogates
    "lone_surrogate_in_tensor_name": (
        st_raw(b'{"w.bad\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
        ("w.bad",),
    ),
    "lone_surrogate_in_metadata_value": (
        st_raw(
            b'{"__metadata__":{"k":"\\udc00"},"a":{"dtype":"F32","shape":[1],'
            b'"data_offsets":[0,4]}}',
            b"\0" * 4,
        ),
        (),
    ),
    "lone_surrogate_in_metadata_key": (
        st_raw(
            b'{"__metadata__":{"\\ud800":"v"},"a":{"dtype":"F32","shape":[1],'
            b'"data_offsets":[0,4]}}',
            b"\0" * 4,
        ),
        (),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_safetensors_is_refused(tmp_path: Path, case: str) -> None:
    payload, mentions = CASES[case]
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(payload)
    refuse_input(path, 3, *mentions)


def test_hostile_tensor_name_stays_on_one_line(tmp_path: Path) -> None:
    """A bad tensor whose name holds a newline and an ANSI escape: the error is still one
    line, without a raw ESC or newline, and still identifies the tensor."""
    name = "evil\n\x1b[31mname"
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(st({name: entry("F32", [3], [0, 8])}, b"\0" * 8))  # 12 bytes needed
    runs = refuse_input(path, 3, "evil", "name")
    for run in runs:
        assert "[31mname" in run.stderr  # shown escaped, not swallowed


def test_hostile_metadata_stays_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(st({"__metadata__": {"k\n\x1b]0;pwned\x07": 1}, "a": GOOD}, b"\0" * 4))
    refuse_input(path, 3)


def _empty_tensors(count: int) -> bytes:
    header = {f"t{i}": entry("F32", [0], [0, 0]) for i in range(count)}
    return st(header)


@pytest.mark.slow  # a 1,000,000-tensor header: seconds by design
def test_a_million_empty_tensors_finish_in_time(tmp_path: Path) -> None:
    """10**6 empty tensors (a 60 MB header): clipcli may list them or refuse them, but
    either way within the timeout and without an internal error."""
    path = tmp_path / "million.safetensors"
    path.write_bytes(_empty_tensors(10**6))
    out = tmp_path / "out.safetensors"
    before = sorted(p.name for p in tmp_path.iterdir())
    start = time.monotonic()
    runs = run_clipcli(
        ["norms", "--format", "json", str(path)],
        ["clip", "--global", "1", str(path), str(out)],
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - start
    print(f"10**6 empty tensors: {[round(r.seconds, 1) for r in runs]} s per run, {elapsed:.1f} s")
    for run in runs:
        assert run.returncode in (0, 3), run.describe()
        if run.returncode == 3:
            check_error_line(run, 3, [str(path)])
    if runs[1].returncode != 0:
        assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow  # 50,000 tensors listed: seconds by design
def test_fifty_thousand_tensors_are_listed_in_time(tmp_path: Path) -> None:
    """50,000 empty tensors (a 3 MB header) are under clipcli's tensor limit, and real
    checkpoints come close (large MoE models have ~10**5 tensors), so `ls` and `norms`
    must list them, and quickly: `norms --format json` takes ~2 s for them."""
    path = tmp_path / "many.safetensors"
    path.write_bytes(_empty_tensors(50_000))
    runs = run_clipcli(["ls", str(path)], ["norms", str(path)], cwd=tmp_path, timeout=SLOW_LIMIT)
    for run in runs:
        assert run.returncode is not None, f"not done within {SLOW_LIMIT}s: {run.describe()}"
        assert run.returncode == 0, run.describe()


def test_clip_refusal_leaves_an_existing_output_alone(tmp_path: Path) -> None:
    """With --force and a hostile IN, the OUT that already exists keeps its bytes."""
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(CASES["missing_bytes"][0])
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    assert_refused(
        ["clip", "--force", "--global", "1", str(path), str(out)],
        3,
        [str(path)],
        watch=tmp_path,
    )
    assert out.read_bytes() == b"precious"
