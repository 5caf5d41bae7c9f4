"""A GGUF file's plain tensors read at any offset (issue 20): their chunks are RangeLoaders,
so a clip's measuring pass counts their bit patterns in helper processes as it does a
safetensors file's, and Reader.elements_loader reads any run of elements, so `--axes`
reads only the boxes a group of slices needs. References: the same command with the
helpers off (CLIPCLI_COUNTING_PROCESSES=0) or with every slice in one group, and gguf's
own reader for the values written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from test_counting_processes import _clip, _helpers_used, assert_helpers_count_as_threads
from test_format_gguf import write_gguf

from clipcli.formats import base
from clipcli.formats.gguf import GgufReader
from clipcli.jobs import execution, pipeline
from clipcli.numerics import slices
from clipcli.system import counting


def _weights(tmp_path: Path, name: str = "m.gguf", quantized: bool = False, **writer: Any) -> Path:
    """Plain float16 and float32 weights; given `quantized`, a Q8_0 one too (the file is
    then read through clipcli.logical, whose plain tensors have no stored bytes yet)."""
    rng = np.random.default_rng(46)
    tensors: dict[str, tuple[np.ndarray, str | None]] = {
        "a.weight": ((rng.standard_normal((64, 512)) * 0.5).astype(np.float16), None),
        "b.weight": ((rng.standard_normal((2, 4096)) * 2).astype(np.float16), None),
        "c.weight": (rng.standard_normal((4, 64)).astype(np.float32), None),
    }
    if quantized:
        tensors["q.weight"] = (rng.standard_normal((4, 64)), "Q8_0")
    return write_gguf(tmp_path / name, tensors, **writer)


def official(path: Path) -> dict[str, np.ndarray]:
    """The plain tensors' values as gguf's own reader gives them (either byte order: its
    arrays carry it), float64, numpy order."""
    reader = gguf.GGUFReader(str(path))
    return {
        tensor.name: np.asarray(tensor.data)
        .astype(np.float64)
        .reshape(tuple(int(d) for d in reversed(tensor.shape)))
        for tensor in reader.tensors
        if tensor.tensor_type.name in ("F16", "F32")
    }


@pytest.mark.parametrize("mode", [["--global", "0.5"], ["--norm", "0.5"]], ids=" ".join)
def test_a_gguf_clip_is_counted_by_helpers_and_writes_what_threads_did(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, mode: list[str]
) -> None:
    assert_helpers_count_as_threads(run_main, monkeypatch, _weights(tmp_path), mode)


def test_a_big_endian_gguf_is_counted_in_the_threads(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its stored bytes are not the values' (they are swapped on reading): no helper."""
    src = _weights(tmp_path, "be.gguf", endianess=gguf.GGUFEndian.BIG)
    forked: list[int] = []
    real = counting.CountingProcesses.__init__

    def spy(self: counting.CountingProcesses, *args: Any) -> None:
        forked.append(1)
        real(self, *args)

    counted = _helpers_used(monkeypatch)
    monkeypatch.setattr(counting.CountingProcesses, "__init__", spy)
    by_threads = _clip(run_main, src, tmp_path / "a.gguf", ["--global", "0.5"])
    assert not counted
    assert not forked
    little = _weights(tmp_path)
    run = run_main("clip", "--global", "0.5", "--no-fsync", little, tmp_path / "le.gguf")
    assert run.code == 0, run.stderr
    for name, values in official(tmp_path / "le.gguf").items():
        assert np.array_equal(official(tmp_path / "a.gguf")[name], values), name
    assert by_threads[0]["global_norm_after"] <= 0.5


def test_helpers_are_not_forked_for_a_reader_whose_chunks_are_not_ranges(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .npy file has stored bytes but reads its chunks itself: forking helpers for it
    (a few ms, a process per thread) would count nothing."""
    path = tmp_path / "w.npy"
    np.save(path, np.random.default_rng(1).standard_normal((64, 64)).astype(np.float16))
    forked: list[int] = []
    real = counting.CountingProcesses.__init__

    def spy(self: counting.CountingProcesses, *args: Any) -> None:
        forked.append(1)
        real(self, *args)

    _helpers_used(monkeypatch)
    monkeypatch.setattr(counting.CountingProcesses, "__init__", spy)
    _clip(run_main, path, tmp_path / "out.npy", ["--global", "0.5"])
    assert not forked


def test_elements_of_a_plain_tensor_are_read_at_any_offset_up_to_its_end(
    tmp_path: Path,
) -> None:
    for writer in [{}, {"endianess": gguf.GGUFEndian.BIG}]:
        src = _weights(tmp_path, f"m{len(writer)}.gguf", quantized=True, **writer)
        want = official(src)
        with GgufReader(src) as reader:
            infos = {info.name: info for info in reader.infos}
            info = infos["a.weight"]
            flat = want["a.weight"].reshape(-1)
            for start, stop in [(0, 0), (0, info.numel), (5, 77), (info.numel, info.numel)]:
                load = reader.elements_loader(info, start, stop)
                assert load is not None
                assert np.array_equal(load().astype(np.float64), flat[start:stop])
            with pytest.raises(ValueError, match="not in tensor"):
                reader.elements_loader(info, 0, info.numel + 1)  # one past the end
            with pytest.raises(ValueError, match="not in tensor"):
                reader.elements_loader(info, 3, 2)
            assert reader.elements_loader(infos["q.weight"], 0, 1) is None  # a block type


@pytest.mark.parametrize("endian", ["little", "big"])
def test_gguf_axes_by_groups_write_what_one_group_does(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, endian: str
) -> None:
    """float16 [2, 4096] with --axes 0 (4,096 two-element columns), boxes of 8 elements:
    groups of 5 slices (read at their offsets) against one of all; the same bytes."""
    writer: dict[str, Any] = {"endianess": gguf.GGUFEndian.BIG} if endian == "big" else {}
    src = _weights(tmp_path, "in.gguf", **writer)
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 8)
    monkeypatch.setattr(base, "CHUNK_BYTES", 256)
    monkeypatch.setattr(pipeline, "INLINE_BELOW_BYTES", 0)
    grouped: list[str] = []
    real = execution._clip_slices_by_groups

    def spy(boxes: Any, groups: Any, tensor: Any, limit: float) -> Any:
        grouped.append(tensor.info.name)
        return real(boxes, groups, tensor, limit)

    monkeypatch.setattr(execution, "_clip_slices_by_groups", spy)
    outputs = []
    for group in [1 << 30, 5]:
        monkeypatch.setattr(slices, "SLICE_GROUP", group)
        out = tmp_path / f"out{group}.gguf"
        report, written = _clip(run_main, src, out, ["--norm", "1", "--axes", "0"])
        outputs.append((report, written))
    assert outputs[0] == outputs[1]
    assert "b.weight" in grouped
    clipped = official(tmp_path / "out5.gguf")["b.weight"]
    assert np.all(np.sqrt(np.sum(clipped**2, axis=0)) <= 1.0)


def test_a_quantized_checkpoints_plain_tensors_are_counted_by_helpers(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block-scaled fp8 checkpoint (read through clipcli.logical) whose embeddings and
    norms are bfloat16: those plain tensors have their stored bytes, so the helpers count
    them, with the bytes and report of counting in the threads."""
    import ml_dtypes
    from handmade import write_safetensors

    rng = np.random.default_rng(7)
    src = write_safetensors(
        tmp_path / "fp8.safetensors",
        {
            "model.embed_tokens.weight": rng.standard_normal((64, 512)).astype(ml_dtypes.bfloat16),
            "model.layers.0.mlp.down_proj.weight": rng.uniform(-448, 448, (2, 64)).astype(
                ml_dtypes.float8_e4m3fn
            ),
            "model.layers.0.mlp.down_proj.weight_scale_inv": np.array([[0.01], [0.02]], np.float32),
            "model.norm.weight": rng.standard_normal(4096).astype(ml_dtypes.bfloat16),
        },
    )
    report = assert_helpers_count_as_threads(run_main, monkeypatch, src, ["--global", "0.5"])
    assert any("down_proj" in t["name"] for t in report["tensors"])


def test_a_clip_that_counts_nothing_starts_no_helper_whatever_the_threshold(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--value counts no bit patterns: with the helpers' threshold at 0 bytes (a test's
    setting) the pass still runs without them (it raised StopIteration, exit 70: attack
    s46b)."""
    src = _weights(tmp_path)
    counted = _helpers_used(monkeypatch)
    run = run_main("clip", "--value", "0.1", "--no-fsync", "-q", src, tmp_path / "o.gguf")
    assert run.code == 0, run.stderr
    assert not counted
