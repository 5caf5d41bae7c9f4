"""Issue 22: Lightning and research checkpoints read as inert data.

A Lightning `.ckpt` (checkpoint_connector.dump_checkpoint: epoch, global_step,
pytorch-lightning_version, state_dict, loops, callbacks with ModelCheckpoint's
best_model_score tensor, optimizer_states, lr_schedulers, hparams_name, hyper_parameters)
holds numpy scalars and arrays, an argparse.Namespace or Lightning's AttributeDict,
pathlib paths, dates, defaultdicts, sets, slices and complex numbers. Each was refused
(exit 3 naming the global); now each is built by a constructor of ours (inert.py) into
plain values shown by `ls`, and anything else stays refused with nothing run.

Fixtures: hand-written pickles (our opcodes for the structure and the tensors; Python's
own pickler, protocol 2 as torch.save uses, for the real numpy/argparse/pathlib objects),
always run; and torch.save of the same objects where torch installs. References: numpy
and Python's own values (repr of the real object), torch's tensors, safetensors' reader.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
import json
import math
import pathlib
import pickle
import struct
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MainRun
from expect import one_error_line
from test_pytorch_hostile import (
    BUILD,
    EMPTY_DICT,
    MARK,
    SETITEMS,
    STOP,
    call,
    glob,
    integer,
    state,
    tensor,
    text,
    torch_zip,
    tup,
)

LIGHTNING_MODULE = "lightning_fabric.utilities.data"
FALSE, TRUE, NONE, EMPTY_TUPLE, NEWOBJ = b"\x89", b"\x88", b"N", b")", b"\x81"


@contextmanager
def attribute_dict_class() -> Iterator[type[dict[str, Any]]]:
    """Lightning's AttributeDict (a plain dict subclass), under its real module name for as
    long as Python's pickler needs to find it there; gone before clipcli reads anything."""
    names = ["lightning_fabric", "lightning_fabric.utilities", LIGHTNING_MODULE]
    saved = {name: sys.modules.get(name) for name in names}
    module = types.ModuleType(LIGHTNING_MODULE)
    made = type("AttributeDict", (dict,), {"__module__": LIGHTNING_MODULE})
    module.AttributeDict = made  # type: ignore[attr-defined]
    for name in names:
        sys.modules[name] = module if name == LIGHTNING_MODULE else types.ModuleType(name)
    try:
        yield made
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def opcodes(value: object, protocol: int = 2) -> bytes:
    """`value` as Python's pickler writes it (protocol 2: torch.save's default), without
    memo, PROTO or STOP: to splice into a pickle written opcode by opcode."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol)
    pickler.fast = True  # no memo: the pieces can be joined
    pickler.dump(value)
    data = buffer.getvalue()
    assert data[:2] == b"\x80" + bytes([protocol])
    assert data[-1:] == STOP
    return data[2:-1]


def a_dict(**items: bytes) -> bytes:
    return EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in items.items()) + SETITEMS


def encoded(raw: bytes) -> bytes:
    """Bytes as protocol 2 spells them: _codecs.encode(latin-1 text, 'latin1')."""
    return call(glob("_codecs", "encode"), text(raw.decode("latin-1")), text("latin1"))


def numpy_dtype(code: str, order: str) -> bytes:
    dtype_state = tup(
        integer(3), text(order), NONE, NONE, NONE, integer(-1), integer(-1), integer(0)
    )
    return call(glob("numpy", "dtype"), text(code), FALSE, TRUE) + dtype_state + BUILD


def numpy_scalar(code: str, order: str, raw: bytes) -> bytes:
    return call(glob("numpy._core.multiarray", "scalar"), numpy_dtype(code, order), encoded(raw))


def hyper_parameters(attribute_dict: type[dict[str, Any]]) -> dict[str, Any]:
    hparams = attribute_dict()
    hparams.update(
        lr=np.float32(0.1),
        layers=np.int64(3),
        dropout=np.float16(0.3),
        gain=np.complex64(1 - 2j),
        flag=np.bool_(True),
        top=np.uint64(2**64 - 1),
        small=np.int8(-5),
        betas=np.array([0.9, 0.999]),
        grid=np.arange(12, dtype=">i2").reshape(3, 4),
        data_dir=pathlib.PurePosixPath("/data/train"),
        windows_dir=pathlib.PureWindowsPath("C:/runs/x"),
        started=datetime.datetime(2024, 5, 6, 7, 8, 9, 10, tzinfo=datetime.timezone.utc),
        day=datetime.date(2023, 12, 31),
        budget=datetime.timedelta(hours=5),
        counts=collections.defaultdict(int, {"a": 1}),
        tags={"x", "y"},
        frozen=frozenset({1}),
        window=slice(0, 10, 2),
        z=complex(1.5, -2),
        args=argparse.Namespace(seed=np.int32(42), name="run", nested=argparse.Namespace()),
    )
    return hparams


def expected_metadata() -> dict[str, str]:
    """What `ls` shows for hyper_parameters, from the real objects' own values."""
    return {
        "hyper_parameters.lr": repr(float(np.float32(0.1))),
        "hyper_parameters.layers": "3",
        "hyper_parameters.dropout": repr(float(np.float16(0.3))),
        "hyper_parameters.gain": repr(complex(np.complex64(1 - 2j))),
        "hyper_parameters.flag": "True",
        "hyper_parameters.top": str(2**64 - 1),
        "hyper_parameters.small": "-5",
        "hyper_parameters.betas": "numpy float64 array [2]: [0.9, 0.999]",
        "hyper_parameters.grid": (
            "numpy int16 array [3, 4]: [0, 1, 2, 3, 4, 5, 6, 7, ... (12 items)]"
        ),
        "hyper_parameters.data_dir": "/data/train",
        "hyper_parameters.windows_dir": "C:\\runs\\x",
        "hyper_parameters.started": "2024-05-06T07:08:09.000010+00:00",
        "hyper_parameters.day": "2023-12-31",
        "hyper_parameters.budget": "timedelta(days=0, seconds=18000, us=0)",
        "hyper_parameters.counts.a": "1",
        "hyper_parameters.window": "slice(0, 10, 2)",
        "hyper_parameters.z": "(1.5-2j)",
        "hyper_parameters.args.seed": "42",
        "hyper_parameters.args.name": "run",
        "hyper_parameters.args.nested": "a Namespace",
    }


def hand_written_checkpoint(path: Path, protocol: int = 2) -> Path:
    """dump_checkpoint's layout: tensors by our own opcodes (storages 0-4), every other
    value by Python's pickler from the real object (`torch.save(pickle_protocol=)`)."""
    with attribute_dict_class() as attribute_dict:
        hparams = opcodes(hyper_parameters(attribute_dict), protocol)
    score = tensor(key="2", size=(), stride=(), numel=1)
    pickled = (
        b"\x80\x02"
        + a_dict(
            epoch=opcodes(3),
            global_step=opcodes(30),
            **{"pytorch-lightning_version": opcodes("2.4.0")},
            state_dict=a_dict(
                **{
                    "layer.weight": tensor(key="0", size=(2, 2), stride=(2, 1)),
                    "layer.bias": tensor(key="1"),
                }
            ),
            loops=opcodes(
                {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}}
            ),
            callbacks=a_dict(
                **{
                    "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": a_dict(
                        monitor=text("val_loss"),
                        best_model_score=score,
                        best_model_path=text("/ckpt/epoch=2.ckpt"),
                        best_k_models=a_dict(**{"/ckpt/epoch=2.ckpt": score}),
                    )
                }
            ),
            optimizer_states=b"]"
            + a_dict(
                state=EMPTY_DICT
                + integer(0)
                + a_dict(
                    step=tensor(key="3", size=(), stride=(), numel=1),
                    exp_avg=tensor(key="4"),
                )
                + b"s",
                param_groups=opcodes([{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]),
            )
            + b"a",
            lr_schedulers=opcodes([{"step_size": 2, "gamma": 0.1, "_last_lr": [0.001]}]),
            hparams_name=text("hparams"),
            hyper_parameters=hparams,
            big_endian_scalar=numpy_scalar("f8", ">", struct.pack(">d", 1.5)),
        )
        + STOP
    )
    storages = {
        "0": np.array([1, 2, 3, 4], "<f4").tobytes(),
        "1": np.array([0.5, 0.5, 0.5, 0.5], "<f4").tobytes(),
        "2": np.array([0.25], "<f4").tobytes(),
        "3": np.array([7], "<f4").tobytes(),
        "4": np.array([9, 9, 9, 9], "<f4").tobytes(),
    }
    return torch_zip(path, pickled, storages)


def _json(clipcli: Callable[..., MainRun], *args: str | Path) -> dict[str, Any]:
    run = clipcli(*args, "--format", "json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_hand_written_lightning_checkpoint_lists_its_values(
    protocol: int, clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    path = hand_written_checkpoint(tmp_path / "epoch=2.ckpt", protocol)
    listing = _json(clipcli, "ls", path)
    metadata = listing["metadata"]
    for key, value in expected_metadata().items():
        assert metadata[key] == value, key
    assert metadata["big_endian_scalar"] == "1.5"  # byte order honoured
    assert metadata["epoch"] == "3"
    assert metadata["hparams_name"] == "hparams"
    assert metadata["pytorch-lightning_version"] == "2.4.0"
    assert metadata["hyper_parameters.tags"] in ("[x, y]", "[y, x]")
    names = {row["name"] for row in listing["tensors"]}
    assert (
        "callbacks.ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}.best_model_score" in names
    )
    assert "optimizer_states.0.state.0.exp_avg" in names
    # nothing was imported on the file's say-so
    assert "lightning_fabric" not in sys.modules


def test_a_hand_written_lightning_checkpoint_measures_and_converts(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    from safetensors.numpy import load_file

    path = hand_written_checkpoint(tmp_path / "last.ckpt")
    norms = _json(clipcli, "norms", path)
    rows = {row["name"]: row for row in norms["tensors"]}
    assert rows["state_dict.layer.weight"]["norm"] == pytest.approx(math.sqrt(30), rel=1e-15)
    assert rows["optimizer_states.0.state.0.exp_avg"]["role"] == "optimizer"
    # the trainer's state is training state too: ModelCheckpoint's score is a loss value
    score = "callbacks.ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}.best_model_score"
    assert rows[score]["role"] == "optimizer"
    assert rows[score]["in_global"] is False
    # the global norm is the model's: [1, 2, 3, 4] and four 0.5s
    assert norms["global_norm"] == pytest.approx(math.sqrt(31), rel=1e-15)
    out = tmp_path / "model.safetensors"
    run = clipcli("convert", path, out)
    assert run.returncode == 0, run.stderr
    read = load_file(str(out))
    np.testing.assert_array_equal(read["state_dict.layer.weight"], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(read["state_dict.layer.bias"], [0.5] * 4)


def test_a_torch_saved_lightning_checkpoint_reads_with_torchs_values(
    clipcli: Callable[..., MainRun], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    path = tmp_path / "epoch=0-step=1.ckpt"
    with attribute_dict_class() as attribute_dict:
        torch.save(
            {
                "epoch": 0,
                "global_step": 1,
                "pytorch-lightning_version": "2.4.0",
                "state_dict": model.state_dict(),
                "loops": {"fit_loop": {"state_dict": {}}},
                "callbacks": {
                    "ModelCheckpoint{'monitor': 'val_loss'}": {
                        "monitor": "val_loss",
                        "best_model_score": torch.tensor(0.25),
                        "best_model_path": "/ckpt/e.ckpt",
                    }
                },
                "optimizer_states": [optimizer.state_dict()],
                "lr_schedulers": [scheduler.state_dict()],
                "hparams_name": "hparams",
                "hyper_parameters": hyper_parameters(attribute_dict),
            },
            path,
        )
    metadata = _json(clipcli, "ls", path)["metadata"]
    for key, value in expected_metadata().items():
        assert metadata[key] == value, key
    assert metadata["optimizer_states.0.param_groups.0.lr"] == "0.001"
    out = tmp_path / "m.safetensors"
    assert clipcli("convert", path, out).returncode == 0
    read = load_file(str(out))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(read[f"state_dict.{name}"], value.numpy())
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    np.testing.assert_array_equal(read["optimizer_states.0.state.0.exp_avg"], exp_avg.numpy())


# ------------------------------------------------------------------ still refused

Make = Callable[[Path], bytes]


def _newobj(module: str, name: str, args: bytes = EMPTY_TUPLE) -> bytes:
    return glob(module, name) + args + NEWOBJ


REFUSED: dict[str, tuple[bytes, str]] = {
    "object_dtype": (call(glob("numpy", "dtype"), text("O8"), FALSE, TRUE), "'O8' is not"),
    "scalar_of_the_wrong_length": (
        numpy_scalar("f8", "<", b"\x00" * 4),
        "4 bytes for a float64 of 8",
    ),
    "scalar_of_a_dtype_without_byte_order": (
        call(
            glob("numpy.core.multiarray", "scalar"),
            call(glob("numpy", "dtype"), text("f4"), FALSE, TRUE),
            encoded(b"\x00" * 4),
        ),
        "before its byte order is set",
    ),
    "dtype_built_twice": (
        numpy_dtype("f4", "<") + tup(integer(3), text(">"), *[NONE] * 3, *[integer(0)] * 3) + BUILD,
        "state is set twice",
    ),
    "dtype_with_fields": (
        call(glob("numpy", "dtype"), text("f4"), FALSE, TRUE)
        + tup(integer(3), text("<"), NONE, tup(text("a")), NONE, *[integer(0)] * 3)
        + BUILD,
        "a state other than a plain numeric dtype's",
    ),
    "object_array": (
        call(
            glob("numpy.core.multiarray", "_reconstruct"),
            glob("numpy", "ndarray"),
            tup(integer(0)),
            encoded(b"b"),
        )
        + tup(integer(1), tup(integer(1)), numpy_dtype("f8", "<"), FALSE, b"]")
        + BUILD,
        "its data is a list, not bytes",
    ),
    "array_data_shorter_than_its_shape": (
        call(
            glob("numpy._core.multiarray", "_reconstruct"),
            glob("numpy", "ndarray"),
            tup(integer(0)),
            encoded(b"b"),
        )
        + tup(integer(1), tup(integer(2**40)), numpy_dtype("f8", "<"), FALSE, encoded(b"\0" * 8))
        + BUILD,
        "8 bytes of data for 1099511627776 values",
    ),
    "reconstruct_of_another_class": (
        call(
            glob("numpy.core.multiarray", "_reconstruct"),
            glob("builtins", "list"),
            tup(integer(0)),
            encoded(b"b"),
        ),
        "only numpy.ndarray is rebuilt",
    ),
    "reduce_on_ndarray": (
        call(glob("numpy", "ndarray"), tup(integer(10**9))),
        "calls numpy.ndarray",
    ),
    "reduce_on_a_factory": (
        call(glob("__builtin__", "list"), EMPTY_TUPLE),
        "calls __builtin__.list",
    ),
    "numpy_type_object": (glob("numpy", "float32"), "global numpy.float32, which is not on"),
    "masked_array": (
        glob("numpy.ma.core", "_mareconstruct"),
        "global numpy.ma.core._mareconstruct",
    ),
    "newobj_of_a_numpy_dtype": (_newobj("numpy", "dtype"), "opcode NEWOBJ is not allowed"),
    "newobj_of_a_namespace_with_arguments": (
        _newobj("argparse", "Namespace", tup(integer(1))),
        "called with 1 arguments",
    ),
    "namespace_state_not_a_dict": (
        _newobj("argparse", "Namespace") + b"]" + BUILD,
        "its state is not a dict",
    ),
    "setitems_on_a_namespace": (
        _newobj("argparse", "Namespace") + MARK + text("k") + integer(1) + SETITEMS,
        "sets items of a Namespace, not a dict",
    ),
    "defaultdict_factory_not_allowed": (
        call(glob("collections", "defaultdict"), glob("collections", "OrderedDict")),
        "a factory other than",
    ),
    "defaultdict_factory_os_system": (
        call(glob("collections", "defaultdict"), glob("os", "system")),
        "global os.system",
    ),
    "datetime_month_13": (
        call(glob("datetime", "datetime"), encoded(bytes([7, 232, 13, 1, 0, 0, 0, 0, 0, 0]))),
        "the month is not an integer from 1 to 12",
    ),
    "timezone_of_two_days": (
        call(
            glob("datetime", "timezone"),
            call(glob("datetime", "timedelta"), integer(2), integer(0), integer(0)),
        ),
        "an offset of a day or more",
    ),
    "timezone_of_pytz": (glob("pytz", "_p"), "global pytz._p"),
    "path_of_numbers": (call(glob("pathlib", "PosixPath"), integer(1)), "a part that is not text"),
    "slice_of_floats": (
        call(glob("builtins", "slice"), b"G" + struct.pack(">d", 1.5)),
        "made from something other than integers",
    ),
    "attribute_dict_from_another_module": (
        _newobj("lightning_fabric.evil", "AttributeDict"),
        "global lightning_fabric.evil.AttributeDict",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_is_not_inert_data_stays_refused(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipcli.cli.entry import main

    value, says = REFUSED[case]
    path = torch_zip(tmp_path / "m.ckpt", state(w=tensor(), hyper_parameters=value))
    assert main(["ls", str(path)]) == 3, case
    line = one_error_line(capsys.readouterr().err)
    assert says in line, line
    assert "lightning_fabric" not in sys.modules
    assert "pytz" not in sys.modules or case != "timezone_of_pytz"
