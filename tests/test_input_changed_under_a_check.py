"""An input rewritten in place while a clip checks its output fails in one line, exit 3.

A float64 clip checks its factor on the rounded output, read again from the input (a
long slice's boxes with --axes, the whole tensor with --norm). Bytes written into the
input between the measuring pass and that check can read as inf or NaN, which the
certain sum of squares refused as an internal error (exit 70, a traceback's last line,
and numpy's warnings on stderr: attack s43). The run now asks the input's identity,
which says it changed: exit 3, one line, nothing written.

The file is changed at a known point (the first read of the check), not after a sleep.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors

from clipcli.cli.entry import main
from clipcli.errors import NotFiniteError
from clipcli.formats.base import TensorInfo
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.numerics import certain, slices

NAN_BYTES = np.full(64, np.nan).tobytes()


def _spoil(path: Path) -> None:
    """NaN written over values in the middle of the (only) tensor's data, in place."""
    data = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    middle = data + (os.path.getsize(path) - data) // 2 // 8 * 8  # on a float64's bytes
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, NAN_BYTES, middle)
    finally:
        os.close(fd)


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(args)
    return code, capsys.readouterr().err.splitlines()


def test_a_long_slice_check_of_a_changed_input_is_exit_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(slices, "STREAM_BOX_ELEMENTS", 256)
    monkeypatch.setattr(slices, "LONG_SLICE_BYTES", 1024 * 8)
    values = np.random.default_rng(3).standard_normal((4, 1024))
    src = write_safetensors(tmp_path / "in.safetensors", {"w": values})
    plain = SafetensorsReader.elements_loader
    spoiled: list[bool] = []

    def spoiling(
        self: SafetensorsReader, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        if not spoiled:  # the first read of the first check
            spoiled.append(True)
            _spoil(src)
        return plain(self, info, start, stop)

    monkeypatch.setattr(SafetensorsReader, "elements_loader", spoiling)
    out = tmp_path / "out.safetensors"
    code, err = _run(["clip", "--norm", "5", "--axes", "1", str(src), str(out)], capsys)
    assert spoiled
    assert code == 3
    assert len(err) == 1
    assert "was modified while it was being read" in err[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]  # no temp file


def test_a_whole_tensor_check_of_a_changed_input_is_exit_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    values = np.random.default_rng(4).standard_normal(1 << 16)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": values})
    plain = SafetensorsReader.chunk_loaders
    calls: list[int] = []

    def spoiling(self: SafetensorsReader, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
        calls.append(1)
        if len(calls) == 2:  # the measuring pass was the first
            _spoil(src)
        return plain(self, info)

    monkeypatch.setattr(SafetensorsReader, "chunk_loaders", spoiling)
    out = tmp_path / "out.safetensors"
    code, err = _run(["clip", "--norm", "5", str(src), str(out)], capsys)
    assert len(calls) >= 2
    assert code == 3
    assert len(err) == 1
    assert "was modified" in err[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]  # no temp file


def test_a_non_finite_value_in_a_certain_sum_is_its_own_error() -> None:
    """Without a changed input to blame, the error stands (exit 70 at the top)."""
    total = certain.CertainSumsq()
    for bad in (np.inf, np.nan, -np.inf):
        with pytest.raises(NotFiniteError):
            total.add(np.array([1.0, bad]))
        with pytest.raises(NotFiniteError):
            total.add_exactly(np.array([bad, 2.0]))
    total.add(np.array([1.0, 2.0]))  # finite values still add up
    assert total.total == 5
