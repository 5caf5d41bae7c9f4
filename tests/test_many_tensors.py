"""Checkpoints of many small tensors (issue 20, "Many tensors"): small tensors are read in
one pread, measured together (clipcli.numerics.many), scaled and written together, with
the same results, bit for bit, as one at a time; the per-tensor Python costs are gone
from the header, the selection, the report and the writer's checks.

References share no code with clipcli: the per-tensor results come from clipcli's own
one-at-a-time route (the batching turned off), and the values from numpy in float64 and
the files from handmade (the layout written and read by hand) and safetensors' reader.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from handmade import read_safetensors, write_safetensors
from safetensors.numpy import load_file

from clipcli.cli.entry import main
from clipcli.errors import InputError
from clipcli.formats.base import Checkpoint, StoredBytes, TensorInfo
from clipcli.formats.opening import open_reader
from clipcli.formats.safetensors import reader as st_reader
from clipcli.formats.safetensors.header import build_header, header_length
from clipcli.formats.safetensors.writer import COPY_AHEAD_MIN_BYTES, SafetensorsWriter
from clipcli.jobs import pipeline
from clipcli.numerics.many import SHORT, accumulate_each, norms_each
from clipcli.numerics.norms import NormAccumulator
from clipcli.report import OutputFormat, render
from clipcli.report.model import Column, Report
from clipcli.report.serialize import JSON_ROWS_AT_ONCE
from clipcli.system import filecopy

FIELDS = ("numel", "max_abs", "min_value", "max_value", "nonfinite", "nan_count", "inf_count")


def one_at_a_time(array: np.ndarray) -> NormAccumulator:
    acc = NormAccumulator()
    if array.size:
        acc.add(array)
    return acc


def same_stats(a: NormAccumulator, b: NormAccumulator) -> bool:
    """Every statistic equal, bit for bit (NaN equal to NaN, -0.0 told from 0.0)."""
    pairs = [(getattr(a, f), getattr(b, f)) for f in FIELDS]
    pairs += [(a.sumsq.mant, b.sumsq.mant), (a.sumsq.exp, b.sumsq.exp)]
    return all(
        np.array([x], np.float64).tobytes() == np.array([y], np.float64).tobytes() for x, y in pairs
    )


SPECIAL = [0.0, -0.0, 1.0, -3.5, np.nan, np.inf, -np.inf, 1e-45, 3e38, 65504.0, 6e-8, 448.0]
DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(np.float64),
    np.dtype(np.int64),
    np.dtype(np.complex64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_measured_together_is_measured_one_at_a_time_bit_for_bit(dtype: np.dtype) -> None:
    rng = np.random.default_rng(7)
    arrays = []
    for size in [0, 1, 2, SHORT, SHORT + 1, 3, 5, 64]:  # SHORT: at the limit and past it
        for _ in range(40):
            values = rng.standard_normal(size) * rng.choice([1e-30, 1e-3, 1.0, 1e4])
            if size and rng.random() < 0.5:
                values[rng.integers(size)] = rng.choice(SPECIAL)
            with np.errstate(all="ignore"):
                arrays.append(values.astype(dtype))
    together = accumulate_each(arrays)
    for array, acc in zip(arrays, together, strict=True):
        assert same_stats(acc, one_at_a_time(array)), (array, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("longest", [1, 2])  # every array of one element, and one of two
def test_one_element_each_is_measured_one_at_a_time_bit_for_bit(
    dtype: np.dtype, longest: int
) -> None:
    """Arrays of one element each take no reductions (their one value is the extremes and
    its square the sum): the same statistics as add() and as the reductions give."""
    rng = np.random.default_rng(11)
    values = np.concatenate([SPECIAL, rng.standard_normal(200) * 1e3, [-1e-40, 7e-46]])
    with np.errstate(all="ignore"):
        arrays = [np.array([v]).astype(dtype) for v in values]
        if longest == 2:
            arrays.insert(5, np.array([-2.5, 4.0]).astype(dtype))
    together = accumulate_each(arrays)
    for array, acc in zip(arrays, together, strict=True):
        assert same_stats(acc, one_at_a_time(array)), (array, dtype)


def test_one_float64_element_each_at_the_safe_ranges_edges() -> None:
    """One float64 element each is measured together where add() squares it unscaled
    (|x| within [SAFE_LO, SAFE_HI], or 0): exactly at each edge, one ulp outside it, and
    the extremes of float64, with their signs; the same statistics and norms as add()."""
    from clipcli.numerics.norms import SAFE_HI, SAFE_LO

    edges = [SAFE_LO, SAFE_HI]
    values = [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]
    for edge in edges:
        values += [edge, float(np.nextafter(edge, 0.0)), float(np.nextafter(edge, np.inf))]
    values += [-v for v in values] + [np.nan, np.inf, -np.inf, 1.0, 3.0]
    arrays = [np.array([v], np.float64) for v in values]
    for array, acc, norm in zip(arrays, accumulate_each(arrays), norms_each(arrays), strict=True):
        assert same_stats(acc, one_at_a_time(array)), array
        assert same_float(norm, one_at_a_time(array).norm), array


def same_float(x: float, y: float) -> bool:
    return np.array([x], np.float64).tobytes() == np.array([y], np.float64).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_together_are_the_norms_one_at_a_time_bit_for_bit(dtype: np.dtype) -> None:
    """norms_each (what a clip keeps of small tensors it wrote together) gives each
    array's NormAccumulator norm, bit for bit, from the smallest float32 subnormal to the
    largest float32, NaN and infinities included; checked against Fraction sums."""
    from fractions import Fraction

    rng = np.random.default_rng(5)
    arrays = [np.array(v) for v in ([], [1e-45], [-1e-45, 1e-45], [3.4e38, -3.4e38], [0.0])]
    for size in [1, 1, 2, SHORT, SHORT + 1, 3, 64]:  # SHORT: at the limit and past it
        for _ in range(40):
            values = rng.standard_normal(size) * rng.choice([1e-40, 1e-3, 1.0, 1e30])
            if rng.random() < 0.5:
                values[rng.integers(size)] = rng.choice(SPECIAL)
            arrays.append(values)
    with np.errstate(all="ignore"):
        arrays = [a.astype(dtype) for a in arrays]
    for array, norm in zip(arrays, norms_each(arrays), strict=True):
        assert same_float(norm, one_at_a_time(array).norm), (array, dtype)
        wide = array.astype(np.complex128 if dtype.kind == "c" else np.float64)
        if dtype.kind == "f" and np.all(np.isfinite(wide)) and 0 < array.size <= SHORT:
            # The sum rounded once, its root once: within 2**-52 of the exact norm.
            exact = sum(Fraction(float(v)) ** 2 for v in wide)
            slack = Fraction(1, 2**52)
            low, high = Fraction(norm) * (1 - slack), Fraction(norm) * (1 + slack)
            assert low**2 <= exact <= high**2, (array, dtype)


def test_a_norm_accumulator_holds_no_dict() -> None:
    """Slots: ~300 bytes less per tensor, 60 MB on 200,000 tensors."""
    assert not hasattr(NormAccumulator(), "__dict__")
    assert not hasattr(NormAccumulator().sumsq, "__dict__")


# ---------------------------------------------------------------- runs of small tensors


def infos_of(sizes: list[int]) -> list[TensorInfo]:
    return [TensorInfo(f"t{i}", np.dtype(np.uint8), (n,), n) for i, n in enumerate(sizes)]


def test_runs_take_tensors_up_to_the_small_size_and_no_bigger() -> None:
    small = pipeline.SMALL_TENSOR_BYTES
    runs = list(pipeline.small_runs(infos_of([1, small, small + 1, 2, 3]), lambda _i: True))
    assert runs == [[0, 1], [2], [3, 4]]  # at the limit joins, one past stands alone


def test_runs_hold_at_most_many_tensors() -> None:
    count = pipeline.MANY_TENSORS
    runs = list(pipeline.small_runs(infos_of([1] * (count + 1)), lambda _i: True))
    assert [len(r) for r in runs] == [count, 1]
    assert [len(r) for r in pipeline.small_runs(infos_of([1] * count), lambda _i: True)] == [count]


def test_runs_hold_at_most_many_bytes() -> None:
    small = pipeline.SMALL_TENSOR_BYTES
    fit = pipeline.MANY_BYTES // small  # exactly MANY_BYTES together
    runs = list(pipeline.small_runs(infos_of([small] * fit), lambda _i: True))
    assert [len(r) for r in runs] == [fit]
    runs = list(pipeline.small_runs(infos_of([small] * fit + [1]), lambda _i: True))
    assert [len(r) for r in runs] == [fit, 1]


def test_runs_leave_out_what_joins_refuses() -> None:
    runs = list(pipeline.small_runs(infos_of([1, 1, 1, 1]), lambda i: i.name != "t1"))
    assert runs == [[0], [1], [2, 3]]


def count_preads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    return calls


ALL_KINDS = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int64]


def tiny_checkpoint(
    path: Path, count: int, seed: int = 0, kinds: list[type] = ALL_KINDS
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for i in range(count):
        size = int(rng.choice([0, 1, 2, 3, 7]))
        kind = kinds[i % len(kinds)]
        if np.dtype(kind).kind == "i":
            tensors[f"layers.{i}.w"] = rng.integers(-3, 4, size).astype(kind)
        else:
            tensors[f"layers.{i}.w"] = (rng.standard_normal(size) * 3).astype(kind)
    write_safetensors(path, tensors)
    return tensors


def test_norms_of_many_tiny_tensors_read_them_in_one_pread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "many.safetensors"
    tensors = tiny_checkpoint(src, 500)
    calls = count_preads(monkeypatch)
    assert main(["norms", "--format", "json", str(src)]) == 0
    assert len(calls) == 1  # was 500: one per tensor
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    for name, array in tensors.items():  # numpy's float64 norms
        expected = float(np.linalg.norm(array.astype(np.float64)))
        assert rows[name]["norm"] == pytest.approx(expected, rel=1e-12, abs=0)


def test_small_tensors_far_apart_are_read_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A selection that leaves a big tensor between two small ones: more than
    MANY_SPAN_BYTES between them is not read in one go."""
    monkeypatch.setattr(st_reader, "MANY_SPAN_BYTES", 4096)
    src = write_safetensors(
        tmp_path / "gap.safetensors",
        {
            "a": np.ones(2, np.float32),
            "big": np.ones(1024, np.float32),  # 4096 bytes
            "b": np.ones(2, np.float32),
        },
    )
    with open_reader(src) as reader:
        a, big, b = reader.infos
        assert reader.loader_of_many([a, b]) is None  # 8 + 4096 + 8 bytes: past the span
        monkeypatch.setattr(st_reader, "MANY_SPAN_BYTES", 4096 + 8)
        assert reader.loader_of_many([a, big]) is not None  # exactly the span
        monkeypatch.setattr(st_reader, "MANY_SPAN_BYTES", 4096 + 7)
        assert reader.loader_of_many([a, big]) is None  # one byte short of it
        assert reader.loader_of_many([b, a]) is None  # not in file order


@pytest.mark.parametrize(
    ("cut", "blamed"),
    [
        (0, "t0"),  # the file ends where the first tensor starts
        (8, "t1"),  # exactly at the end of t0: t1 is the first not read
        (9, "t1"),
        (8 * 7 + 3, "t7"),
        (8 * 9 + 7, "t9"),  # one byte short of the last
        (8 * 9 + 16, "t11"),  # in the unasked t10 and t11 ... t10 lies between, t11 asked
    ],
)
def test_a_file_cut_short_under_a_read_of_many_blames_the_first_tensor_not_read(
    tmp_path: Path, cut: int, blamed: str
) -> None:
    """One read for many small tensors: the tensor named when the file shrank under it is
    the first one the file ends inside (it was always the first of the batch: attack s37)."""
    tensors = {f"t{i}": np.full(2, i, np.float32) for i in range(12)}
    src = write_safetensors(tmp_path / "cut.safetensors", tensors)
    with open_reader(src) as reader:
        assert isinstance(reader, st_reader.SafetensorsReader)
        infos = [info for info in reader.infos if info.name != "t10"]
        start, _ = reader.byte_range(infos[0])
        load = reader.loader_of_many(infos)
        assert load is not None
        os.truncate(src, start + cut)
        with pytest.raises(InputError, match=f"tensor '{blamed}': file shrank while reading"):
            load()


MODES = [
    ["--global", "1"],
    ["--global", "1e9"],
    ["--norm", "0.5"],
    ["--average", "0.01"],
    ["--value", "0.3"],
    ["--norm", "1e-6"],  # float16 values flushed to zero and made subnormal, counted alike
]


@pytest.mark.parametrize("mode", MODES, ids=" ".join)
def test_clip_of_many_tiny_tensors_is_what_one_at_a_time_gives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    mode: list[str],
) -> None:
    src = tmp_path / "many.safetensors"
    tensors = tiny_checkpoint(src, 300, seed=3)
    together, apart = tmp_path / "together.safetensors", tmp_path / "apart.safetensors"
    assert main(["clip", *mode, "--format", "json", str(src), str(together)]) == 0
    report_together = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(pipeline, "SMALL_TENSOR_BYTES", -1)  # no runs: one at a time
    assert main(["clip", *mode, "--format", "json", str(src), str(apart)]) == 0
    report_apart = json.loads(capsys.readouterr().out)
    assert together.read_bytes() == apart.read_bytes()
    for report in (report_together, report_apart):
        report.pop("out")
    assert report_together == report_apart
    out = read_safetensors(together)
    if mode[0] == "--global" and mode[1] == "1":  # official reader agrees; norm <= 1
        official = load_file(str(together))
        assert official["layers.0.w"].tobytes() == out["layers.0.w"].tobytes()
        floats = [v for v in out.values() if v.dtype.kind != "i"]
        total = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in floats))
        assert total <= 1.0
    if mode[1] == "1e9":  # nothing changes: every tensor bit-identical
        assert all(out[name].tobytes() == array.tobytes() for name, array in tensors.items())


def test_small_tensors_are_written_in_order_from_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each small scaled tensor reaches the writer's write() (where faults and signals are
    tested) from the run's one read; unchanged ones go in one kernel copy per run."""
    src = tmp_path / "many.safetensors"
    # 8- and 16-bit floats are measured one by one for clip (each counts its bit patterns)
    tensors = tiny_checkpoint(src, 400, kinds=[np.float32, np.float64, np.int64])
    writes: list[str] = []
    real = SafetensorsWriter.write

    def spy(self: SafetensorsWriter, info: TensorInfo, chunks: object) -> None:
        writes.append(info.name)
        real(self, info, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(SafetensorsWriter, "write", spy)
    monkeypatch.setattr(SafetensorsWriter, "copy_unchanged", None)  # never asked
    copies: list[int] = []
    real_copy = filecopy.kernel_copy

    def copy_spy(*args: int) -> int:
        copies.append(args[2])
        return real_copy(*args)

    monkeypatch.setattr(filecopy, "kernel_copy", copy_spy)
    calls = count_preads(monkeypatch)
    out = tmp_path / "o.safetensors"
    assert main(["clip", "--global", "1", "-q", str(src), str(out)]) == 0
    assert writes == [f"layers.{i}.w" for i in range(400)]
    assert len(calls) == 2  # one to measure, one to write
    assert copies == []
    writes.clear()
    assert main(["clip", "--global", "1e9", "-q", "--force", str(src), str(out)]) == 0
    assert writes == []
    assert copies == [sum(a.nbytes for a in tensors.values())]  # the run: one copy
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize(
    ("nbytes", "ahead"), [(COPY_AHEAD_MIN_BYTES - 4, False), (COPY_AHEAD_MIN_BYTES, True)]
)
def test_only_tensors_of_some_size_are_copied_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, ahead: bool
) -> None:
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.ones(nbytes // 4, np.float32)})
    copies: list[int] = []
    real = SafetensorsWriter._copy_range

    def spy(self: SafetensorsWriter, *args: int) -> None:
        copies.append(1)
        real(self, *args)

    monkeypatch.setattr(SafetensorsWriter, "_copy_range", spy)
    out = tmp_path / "out.safetensors"
    assert main(["clip", "--global", "1e30", "-q", str(src), str(out)]) == 0
    assert out.read_bytes() == src.read_bytes()
    # Copied ahead, or (a single tensor, no run) kernel-copied in order: once either way.
    assert copies == [1]
    assert ahead == (nbytes >= COPY_AHEAD_MIN_BYTES)


def test_the_writer_checks_each_dtype_and_shape_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, ...]] = []
    real = SafetensorsWriter.check_shape.__func__  # type: ignore[attr-defined]

    def spy(cls: type[SafetensorsWriter], info: TensorInfo) -> str | None:
        asked.append(info.shape)
        return real(cls, info)  # type: ignore[no-any-return]

    monkeypatch.setattr(SafetensorsWriter, "check_shape", classmethod(spy))
    infos = [TensorInfo(f"t{i}", np.dtype(np.float32), (i % 3,), 4 * (i % 3)) for i in range(300)]
    assert list(SafetensorsWriter.tensor_problems(infos)) == []
    assert sorted(asked) == [(0,), (1,), (2,)]
    bad = [*infos, TensorInfo("__metadata__", np.dtype(np.float32), (1,), 4)]
    assert [i.name for i, _ in SafetensorsWriter.tensor_problems(bad)] == ["__metadata__"]


# ---------------------------------------------------------------- header and report


@pytest.mark.parametrize("count", [4095, 4096, 4097])
def test_header_length_in_batches_is_the_built_header(count: int) -> None:
    names = ['é"q\\', "\u2028", "plain", "日本"]
    infos = [
        TensorInfo(f"{names[i % 4]}{i}", np.dtype(np.float16), (i % 5, 2), (i % 5) * 4)
        for i in range(count)
    ]
    for metadata in ({}, {"k": "v", "ä": '"'}):
        assert header_length(infos, metadata) == len(build_header(infos, metadata)) - 8
        # The header as built after being measured (the batches kept), and as json spells
        # it: __metadata__ first, then the entries in order, space-padded to 8 bytes.
        header_length(infos, metadata)
        built = build_header(infos, metadata)
        entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for info in infos:
            span = [offset, offset + info.nbytes]
            entries[info.name] = {"dtype": "F16", "shape": list(info.shape), "data_offsets": span}
            offset += info.nbytes
        text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        assert built == len(text).to_bytes(8, "little") + text
        assert build_header(infos, metadata) == built  # and as built unmeasured


def test_a_plain_header_entry_and_a_dict_one_read_the_same(tmp_path: Path) -> None:
    """Entries parsed into compact tuples: shapes with a 0, extra keys, ints that are
    bools are still judged (and named) as before."""
    good = write_safetensors(
        tmp_path / "g.safetensors", {"a": np.zeros((0, 3), np.float32), "b": np.ones(2)}
    )
    reader = st_reader.SafetensorsReader(good)
    try:
        assert [(i.name, i.shape, i.nbytes) for i in reader.infos] == [
            ("a", (0, 3), 0),
            ("b", (2,), 16),
        ]
        begin, end = reader.byte_range(reader.infos[1])
        assert end - begin == 16
    finally:
        reader.close()
    header = b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}'
    bad = tmp_path / "b.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    assert main(["ls", str(bad)]) == 3


def rows_report(rows: list[tuple[str, float]]) -> Report:
    columns = (Column("name", "tensor"), Column("norm", "norm", numeric=True))
    return Report("t", columns, tuple(rows), (("path", "p"), ("global_norm", math.nan)))


@pytest.mark.parametrize("count", [0, 1, JSON_ROWS_AT_ONCE, JSON_ROWS_AT_ONCE + 1])
def test_json_in_batches_is_one_json_document(count: int) -> None:
    rows = [(f"t{i}", float(i)) for i in range(count)]
    if count:
        rows[-1] = (rows[-1][0], math.inf)  # a non-finite value in the last batch: null
    out = io.StringIO()
    render(rows_report(rows), OutputFormat.JSON, out)
    expected_rows = [{"name": n, "norm": v if math.isfinite(v) else None} for n, v in rows]
    expected = {"path": "p", "global_norm": None, "tensors": expected_rows}
    assert out.getvalue() == json.dumps(expected, allow_nan=False) + "\n"


def test_the_cli_collects_long_lived_objects_rarely() -> None:
    before = gc.get_threshold()
    try:
        assert main(["--help"]) == 0
        assert gc.get_threshold()[1:] == (100, 100)
        assert gc.get_threshold()[0] == before[0]
    finally:
        gc.set_threshold(*before)


# safetensors' dtype codes, from its format documentation, with numpy's names.
CODES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "C64": np.complex64, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
}  # fmt: skip


def _write_every_code(path: Path, names: list[str]) -> None:
    """A safetensors file (by hand) of one [k % 3, 2] tensor per name, codes in turn."""
    header, offset = {}, 0
    codes = list(CODES)
    for name in names:
        k = int(name.split(".")[1])
        shape, size = [k % 3, 2], (k % 3) * 2 * np.dtype(CODES[codes[k]]).itemsize
        header[name] = {"dtype": codes[k], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(offset))


def _fields(listing: list[Any]) -> list[tuple[Any, ...]]:
    return [(t.name, t.dtype_name, t.shape, t.nbytes, t.numel) for t in listing]


def test_the_listing_reads_the_same_once_the_infos_exist(tmp_path: Path) -> None:
    """A safetensors reader (a file, and a model directory of shards) lists its tensors
    from the header alone, then, once it has made its infos, gives those as its listing
    (one record of each tensor, not two): the same names, dtypes, shapes and sizes, every
    safetensors dtype among them, in the same order."""
    names = [f"t.{k}" for k in range(len(CODES))]
    single = tmp_path / "one.safetensors"
    _write_every_code(single, names)
    directory = tmp_path / "model"
    directory.mkdir()
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, held in halves.items():
        _write_every_code(directory / shard, held)
    weight_map = {n: shard for shard, held in halves.items() for n in held}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    expected_types = {n: np.dtype(CODES[list(CODES)[k]]).name for k, n in enumerate(names)}
    for path in (single, directory):
        with open_reader(path) as reader:
            before = _fields(list(reader.listing))
            infos = reader.infos
            assert _fields(list(reader.listing)) == before
            assert [(i.name, i.dtype_name, i.shape, i.nbytes) for i in infos] == [
                f[:4] for f in before
            ]
        assert {f[0]: f[1] for f in before} == expected_types


@pytest.mark.parametrize(
    "mode",
    [
        ["--value", "0.5"],
        ["--min", "0"],
        ["--global", "1", "--skip-nonfinite"],
        ["--norm", "1e-3", "--skip-nonfinite"],
    ],
    ids=" ".join,
)
def test_signalling_nans_among_many_small_tensors_warn_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    """float32 and float16 signalling NaNs (the quiet bit clear) in tensors measured and
    written together: widening them raises numpy's invalid-value flag, which must not
    reach stderr as a RuntimeWarning (the test run makes warnings errors: exit 70). Found
    by the session-34 attack."""
    patterns = [0x7F800001, 0xFF800001, 0x7FC00000, 0x7FBFFFFF, 0x3F800000, 0x00000001]
    others = [  # (bit patterns, dtype): NaNs with the quiet bit clear, then a number
        ([0x7C01, 0xFD00, 0x3C00], np.float16),
        ([0x7F81, 0xFF81, 0x3F80], ml_dtypes.bfloat16),
        ([0x7F, 0xFF, 0x38], ml_dtypes.float8_e4m3fn),
        ([0x7D, 0xFE, 0x3C], ml_dtypes.float8_e5m2),
        ([0x7FF0000000000001, 0xFFF0000000000001, 0x3FF0000000000000], np.float64),
    ]
    tensors: dict[str, np.ndarray] = {}
    for i in range(60):
        k = 1 + i % 3
        if i % 4 == 3:
            bits, kind = others[i // 4 % len(others)]
            unsigned = np.dtype(f"u{np.dtype(kind).itemsize}")
            tensors[f"n.{i}"] = np.array(bits[:k], unsigned).view(kind)
        else:
            bits = [patterns[(i + j) % len(patterns)] for j in range(k)]
            tensors[f"n.{i}"] = np.array(bits, np.uint32).view(np.float32)
    src = write_safetensors(tmp_path / "snan.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    assert main(["clip", *mode, "-q", str(src), str(out)]) == 0
    assert main(["norms", "-q", str(src)]) in (0, 1)
    err = capsys.readouterr().err
    assert all(line.startswith("clipcli: ") for line in err.splitlines()), err


def test_a_float64_signalling_nan_leaves_the_extremes_of_the_other_values() -> None:
    """np.nanmax warned "All-NaN slice" on [sNaN, 1.0] (float64, the quiet bit clear),
    a stray stderr line: the extremes --value clamps by are those of the values that are
    not NaN, with no warning (the test run makes warnings errors)."""
    for bits, high, low in [
        ([0x7FF0000000000001, 0x3FF0000000000000], 1.0, 1.0),
        ([0xFFF0000000000001, 0x7FF0000000000000, 0xBFF0000000000000], math.inf, -1.0),
    ]:
        acc = one_at_a_time(np.array(bits, np.uint64).view(np.float64))
        assert (acc.max_value, acc.min_value, acc.nan_count) == (high, low, 1)


# ---------------------------------------------------------------- the writer's layout


def _writer_of(tmp_path: Path, sizes: list[int]) -> tuple[SafetensorsWriter, list[TensorInfo]]:
    infos = [TensorInfo(f"t{k}", np.dtype(np.uint8), (n,), n) for k, n in enumerate(sizes)]
    return SafetensorsWriter(tmp_path / "w.safetensors", Checkpoint(infos, {})), infos


def test_the_writer_refuses_to_close_a_file_short_or_long_of_its_header(tmp_path: Path) -> None:
    """Tensors go where the one before ended (no offset of each is kept): a file whose
    bytes do not end where the header lays them out is never closed as done."""
    for written in (2, 3, 4):  # one byte short, exact, one byte more than the 3 laid out
        writer, (info,) = _writer_of(tmp_path, [3])
        writer.write(info, [np.zeros(written, np.uint8)])
        if written == 3:
            writer.close()
            assert load_file(str(tmp_path / "w.safetensors"))["t0"].tolist() == [0, 0, 0]
        else:
            with pytest.raises(RuntimeError, match="lays out"):
                writer.close()


def test_a_tensor_copied_ahead_must_come_in_its_place(tmp_path: Path) -> None:
    """A tensor big enough to be copied ahead keeps the offset the header gave it: reached
    anywhere else (out of order), the writer refuses rather than writing it there."""
    big = COPY_AHEAD_MIN_BYTES
    src = write_safetensors(
        tmp_path / "in.safetensors", {"t0": np.ones(4, np.uint8), "t1": np.ones(big, np.uint8)}
    )
    with open_reader(src) as reader:
        writer = SafetensorsWriter(tmp_path / "w.safetensors", Checkpoint(list(reader.infos), {}))
        try:
            with pytest.raises(RuntimeError, match="out of order"):
                writer.copy_unchanged(reader, reader.infos[1])  # before t0
        finally:
            writer.abort()


def test_runs_are_copied_whole_only_where_stored_sizes_are_theirs(tmp_path: Path) -> None:
    """copy_unchanged_many copies a run in one piece only when each tensor's stored bytes
    are exactly its size (what the header lays out here); else the caller writes them."""
    src = write_safetensors(tmp_path / "in.safetensors", {"a": np.ones(4, np.uint8)})
    fd = os.open(src, os.O_RDONLY)
    try:

        class Source:
            def __init__(self, spans: list[tuple[int, int]]) -> None:
                self.spans = dict(zip(["t0", "t1"], spans, strict=True))

            def stored_bytes(self, info: TensorInfo) -> StoredBytes:
                begin, end = self.spans[info.name]
                return StoredBytes(src, lambda: contextlib.nullcontext(fd), begin, end)

        for spans, whole in [([(8, 10), (10, 12)], True), ([(8, 11), (11, 12)], False)]:
            writer, infos = _writer_of(tmp_path, [2, 2])
            assert writer.copy_unchanged_many(Source(spans), infos) is whole  # type: ignore[arg-type]
            writer.abort()
    finally:
        os.close(fd)


def test_infos_asked_from_two_threads_at_once_are_made_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one thread makes a reader's infos (held at a known point, inside), a second
    thread asking for them waits and gets the same list, and the listing stays whole:
    the listing is let go once the infos exist, which without the lock left a second
    thread an empty list (attack s34c: 916 of 3,000 trials)."""
    import threading

    src = write_safetensors(
        tmp_path / "in.safetensors", {f"t{k}": np.ones(2, np.float32) for k in range(50)}
    )
    inside, release = threading.Event(), threading.Event()
    real = st_reader.dtype_of  # type: ignore[attr-defined]

    def held(code: str) -> np.dtype:
        inside.set()
        assert release.wait(30)
        return real(code)

    with open_reader(src) as reader:
        monkeypatch.setattr(st_reader, "dtype_of", held)
        got: dict[str, list[TensorInfo]] = {}
        first = threading.Thread(target=lambda: got.setdefault("first", reader.infos))
        first.start()
        assert inside.wait(30)
        second = threading.Thread(target=lambda: got.setdefault("second", reader.infos))
        second.start()
        assert len(reader.listing) == 50  # whole while the infos are being made
        release.set()
        first.join(30)
        second.join(30)
        assert got["first"] is got["second"] is reader.infos
        assert len(got["first"]) == 50
        assert list(reader.listing) == got["first"]
