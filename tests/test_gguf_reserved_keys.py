"""Issue 22 item 5: `convert` into `.gguf` never writes a file gguf's own reader refuses.

gguf.GGUFReader files the header's version and counts as fields `GGUF.version`,
`GGUF.tensor_count` and `GGUF.kv_count`, and raises on metadata that names one again; it
also refuses a `general.alignment` that is not a uint32. Such metadata is refused (exit 2,
one line) before OUT is made. The reserved names are taken from gguf's reader itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import MainRun
from expect import one_error_line
from safetensors.numpy import save_file


def _source(tmp_path: Path, metadata: dict[str, str]) -> Path:
    path = tmp_path / "in.safetensors"
    save_file({"v": np.arange(4, dtype=np.float32)}, path, metadata=metadata)
    return path


def _readers_own_fields(tmp_path: Path, clipcli: Callable[..., MainRun]) -> list[str]:
    """The names gguf's reader gives fields of a file with no metadata at all."""
    out = tmp_path / "plain.gguf"
    assert clipcli("convert", "-q", _source(tmp_path, {}), out).returncode == 0
    return list(gguf.GGUFReader(out).fields)


def test_the_readers_own_fields_are_the_three_we_know(
    tmp_path: Path, clipcli: Callable[..., MainRun]
) -> None:
    assert sorted(_readers_own_fields(tmp_path, clipcli)) == [
        "GGUF.kv_count",
        "GGUF.tensor_count",
        "GGUF.version",
    ]


@pytest.mark.parametrize(
    "key",
    ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "GGUF.other", "general.alignment"],
)
def test_a_key_the_reader_would_refuse_is_refused_before_writing(
    tmp_path: Path, clipcli: Callable[..., MainRun], key: str
) -> None:
    out = tmp_path / "out.gguf"
    run = clipcli("convert", _source(tmp_path, {key: "3"}), out)
    assert run.returncode == 2, run.stderr
    assert repr(key) in one_error_line(run.stderr)
    assert not out.exists()


@pytest.mark.parametrize("key", ["GGUF", "gguf.version", "general.GGUF.version", "xGGUF.version"])
def test_keys_just_outside_the_namespace_are_written_and_read_back(
    tmp_path: Path, clipcli: Callable[..., MainRun], key: str
) -> None:
    out = tmp_path / "out.gguf"
    run = clipcli("convert", "-q", _source(tmp_path, {key: "3"}), out)
    assert run.returncode == 0, run.stderr
    field = gguf.GGUFReader(out).fields[key]
    assert bytes(field.parts[field.data[0]]) == b"3"
