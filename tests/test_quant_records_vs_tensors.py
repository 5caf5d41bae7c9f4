"""Records that disagree with the tensors (issue 21, second attack; R5 in
docs/THREAT_MODEL.md): two tensors claiming one logical name, a bitsandbytes quant state
naming a dtype bitsandbytes never writes, and a GPTQ group_size in config.json that the
stored groups contradict. Each is refused in one line (exit 3) for every command, never
read silently one way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_quant_bnb import four_bit
from test_quant_gptq_awq import gptq_arrays

from clipcli.formats.base import Reader
from clipcli.logical.reader import LogicalReader
from clipcli.logical.view import LogicalTensor, Part, View

COMMANDS = ["ls", "norms", "clip", "convert"]


def command(name: str, path: Path, out: Path) -> list[str | Path]:
    commands: dict[str, list[str | Path]] = {
        "ls": ["ls", path],
        "norms": ["norms", path],
        "clip": ["clip", "--global", "1", path, out],
        "convert": ["convert", "--dtype", "float16", path, out],
    }
    return commands[name]


def refused(run_main: Any, name: str, path: Path, out: Path, *words: str) -> None:
    run = run_main(*command(name, path, out))
    assert run.code == 3, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("clipcli: error: ")
    for word in words:
        assert word in run.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", COMMANDS)
def test_a_plain_weight_beside_the_quantized_one_of_its_name_is_refused(
    tmp_path: Path, run_main: Any, name: str
) -> None:
    arrays = gptq_arrays(32, 16, 4, 2)[0]
    arrays["m.weight"] = np.ones((16, 32), np.float16)
    path = tmp_path / "m.safetensors"
    save_file(arrays, str(path))
    refused(run_main, name, path, tmp_path / "o.safetensors", "m.weight", "gptq")


def test_without_the_plain_weight_the_same_file_is_read(tmp_path: Path, run_main: Any) -> None:
    path = tmp_path / "m.safetensors"
    save_file(gptq_arrays(32, 16, 4, 2)[0], str(path))
    assert run_main("norms", path).code == 0


class _TwoOfOneName(View):
    """A view that (wrongly) makes two logical tensors of one name: the LogicalReader must
    refuse it whatever view made it."""

    def __init__(self, infos: list[Any]) -> None:
        self._infos = infos

    def tensors(self) -> list[LogicalTensor]:
        first = self._infos[0]
        return [LogicalTensor(i, (Part(i.name, "values"),)) for i in self._infos] + [
            LogicalTensor(first, (Part(first.name, "values"),))
        ]

    def chunks(
        self,
        reader: Reader,  # noqa: ARG002 - interface
        tensor: LogicalTensor,  # noqa: ARG002 - interface
        chunk_elems: int | None = None,  # noqa: ARG002 - interface
    ) -> Iterator[np.ndarray]:
        raise AssertionError("never read")


def test_the_logical_reader_refuses_one_name_twice(tmp_path: Path) -> None:
    from clipcli.errors import InputError
    from clipcli.formats.opening import open_reader

    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, str(path))
    with open_reader(path) as reader:
        view = _TwoOfOneName(list(reader.infos))
        with pytest.raises(InputError, match="two tensors claim the name 'a'"):
            LogicalReader(reader, view)


def bnb_file(tmp_path: Path, dtype: object) -> Path:
    arrays = four_bit((16, 64), 64)[0]
    state_name = "m.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(arrays[state_name].tobytes())
    state["dtype"] = dtype
    arrays[state_name] = np.frombuffer(json.dumps(state).encode(), np.uint8)
    path = tmp_path / "m.safetensors"
    save_file(arrays, str(path))
    return path


@pytest.mark.parametrize("dtype", ["float64", "foo", "int8", "", 16, ["float16"]])
@pytest.mark.parametrize("name", COMMANDS)
def test_a_quant_state_dtype_bnb_never_writes_is_refused(
    tmp_path: Path, run_main: Any, dtype: object, name: str
) -> None:
    path = bnb_file(tmp_path, dtype)
    refused(run_main, name, path, tmp_path / "o.safetensors", "quant_state", "dtype")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "torch.float16"])
def test_the_dtypes_bnb_writes_are_shown(tmp_path: Path, run_main: Any, dtype: str) -> None:
    run = run_main("norms", "--format", "json", bnb_file(tmp_path, dtype))
    assert run.code == 0, run.stderr
    (row,) = [t for t in json.loads(run.stdout)["tensors"] if t["name"] == "m.weight"]
    assert row["dtype"] == dtype.removeprefix("torch.")


def gptq_directory(tmp_path: Path, groups: int, group_size: int, g_idx: bool = True) -> Path:
    arrays = gptq_arrays(64, 16, 4, groups)[0]
    if not g_idx:
        del arrays["m.g_idx"]
    directory = tmp_path / "model"
    directory.mkdir()
    save_file(arrays, str(directory / "model.safetensors"))
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size}
    (directory / "config.json").write_text(json.dumps({"quantization_config": config}))
    return directory


@pytest.mark.parametrize("g_idx", [True, False])
@pytest.mark.parametrize(
    ("groups", "group_size", "agrees"),
    [
        (4, 15, False),  # ceil(64 / 15) = 5 groups, 4 stored
        (4, 16, True),  # the smallest size that makes 4 groups of 64 inputs
        (4, 21, True),  # the largest (ceil(64 / 21) = 4: the last group shorter)
        (4, 22, False),  # ceil(64 / 22) = 3: one past
        (4, 8, False),
        (1, -1, True),
        (2, -1, False),  # -1: one group, two stored
    ],
)
def test_a_gptq_group_size_the_tensors_contradict_is_refused(
    tmp_path: Path, run_main: Any, groups: int, group_size: int, agrees: bool, g_idx: bool
) -> None:
    directory = gptq_directory(tmp_path, groups, group_size, g_idx)
    out = tmp_path / "out"
    if agrees:
        assert run_main("norms", directory).code == 0
        return
    for name in COMMANDS:
        refused(run_main, name, directory, out, "group_size", f"{groups} groups")
