"""The PyTorch reader's inert stand-ins have types of their own: a constructor that takes
text, bytes or numbers refuses a path, a date or a slice where the real one raises
TypeError (and torch.load would fail).

Before, the stand-ins for paths, dates and slices were plain `str`, so
numpy.dtype(PosixPath('f8')), numpy scalar(dtype, PosixPath(...)),
datetime.date(PosixPath(<state bytes>)), _codecs.encode(PosixPath), torch.device(PosixPath)
and PosixPath(datetime.date) were all accepted. Each pair here is checked against Python's
real constructor with the real object (torch.device: by its documented types, str or int;
torch is not installed here): every refused pair raises TypeError there too.
"""

from __future__ import annotations

import _codecs
import collections
import datetime
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from expect import one_error_line
from numpy._core import multiarray
from test_pytorch_hostile import (
    BUILD,
    FALSE,
    call,
    glob,
    integer,
    state,
    tensor,
    text,
    torch_zip,
    tup,
)
from test_pytorch_lightning import TRUE, encoded, numpy_dtype

from clipcli.cli.entry import main
from clipcli.formats.pytorch import unpickler

# stand-in -> (its opcodes, the real object)
STAND_INS: dict[str, tuple[bytes, object]] = {
    "posix_path": (call(glob("pathlib", "PosixPath"), text("f8")), pathlib.PurePosixPath("f8")),
    "windows_path": (
        call(glob("pathlib", "PureWindowsPath"), text("f8")),
        pathlib.PureWindowsPath("f8"),
    ),
    "date": (
        call(glob("datetime", "date"), encoded(bytes([7, 228, 1, 1]))),
        datetime.date(2020, 1, 1),
    ),
    "datetime": (
        call(glob("datetime", "datetime"), encoded(bytes([7, 228, 1, 1, 0, 0, 0, 0, 0, 0]))),
        datetime.datetime(2020, 1, 1),
    ),
    "time": (call(glob("datetime", "time"), encoded(bytes(6))), datetime.time(0, 0)),
    "slice": (call(glob("builtins", "slice"), integer(1)), slice(1)),
}


def _array_state(value: Any) -> None:
    array = np.ndarray((0,), np.uint8)
    state: Any = (1, (1,), np.dtype("u1"), False, value)
    array.__setstate__(state)


def _torch_device(value: object) -> None:
    # torch.device(type: str | int, index: int | None): anything else is a TypeError
    if type(value) not in (str, int):
        raise TypeError(f"torch.device of a {type(value).__name__}")


_REAL_DATE: Any = datetime.date  # called with a state only, as pickle calls it
_REAL_DATETIME: Any = datetime.datetime
ZERO_OFFSET = call(glob("datetime", "timedelta"), integer(0), integer(0), integer(0))
# constructor -> (its pickle around a stand-in's opcodes, the real one on the real object)
CONSTRUCTORS: dict[str, tuple[Callable[[bytes], bytes], Callable[[Any], object]]] = {
    "numpy.dtype": (
        lambda x: call(glob("numpy", "dtype"), x, FALSE, TRUE),
        lambda x: np.dtype(x),
    ),
    "numpy.scalar": (
        lambda x: call(glob("numpy._core.multiarray", "scalar"), numpy_dtype("u1", "|"), x),
        lambda x: multiarray.scalar(np.dtype("u1"), x),
    ),
    "numpy._reconstruct": (
        lambda x: call(
            glob("numpy._core.multiarray", "_reconstruct"),
            glob("numpy", "ndarray"),
            tup(integer(0)),
            x,
        ),
        lambda x: multiarray._reconstruct(np.ndarray, (0,), x),
    ),
    "numpy array data": (
        lambda x: (
            call(
                glob("numpy._core.multiarray", "_reconstruct"),
                glob("numpy", "ndarray"),
                tup(integer(0)),
                encoded(b"b"),
            )
            + tup(integer(1), tup(integer(1)), numpy_dtype("u1", "|"), FALSE, x)
            + BUILD
        ),
        _array_state,
    ),
    "datetime.date": (lambda x: call(glob("datetime", "date"), x), _REAL_DATE),
    "datetime.datetime": (
        lambda x: call(glob("datetime", "datetime"), x),
        _REAL_DATETIME,
    ),
    "datetime.time": (lambda x: call(glob("datetime", "time"), x), datetime.time),
    "datetime.timezone name": (
        lambda x: call(glob("datetime", "timezone"), ZERO_OFFSET, x),
        lambda x: datetime.timezone(datetime.timedelta(0), x),
    ),
    "_codecs.encode": (
        lambda x: call(glob("_codecs", "encode"), x, text("latin1")),
        lambda x: _codecs.encode(x, "latin1"),
    ),
    "pathlib.PosixPath": (lambda x: call(glob("pathlib", "PosixPath"), x), pathlib.PurePosixPath),
    "pathlib.PureWindowsPath": (
        lambda x: call(glob("pathlib", "PureWindowsPath"), x),
        pathlib.PureWindowsPath,
    ),
    "torch.device": (lambda x: call(glob("torch", "device"), x), _torch_device),
    "builtins.bytearray": (lambda x: call(glob("builtins", "bytearray"), x), bytearray),
    "builtins.complex": (lambda x: call(glob("builtins", "complex"), x), complex),
    "builtins.set": (lambda x: call(glob("builtins", "set"), x), set),
    "collections.defaultdict": (
        lambda x: call(glob("collections", "defaultdict"), x),
        collections.defaultdict,
    ),
    "collections.OrderedDict": (
        lambda x: call(glob("collections", "OrderedDict"), x),
        collections.OrderedDict,
    ),
}
# What the real constructors accept: a path is os.PathLike, a part of another path.
ACCEPTED = {
    (constructor, stand_in)
    for constructor in ("pathlib.PosixPath", "pathlib.PureWindowsPath")
    for stand_in in ("posix_path", "windows_path")
}
PAIRS = sorted(
    (constructor, stand_in)
    for constructor in CONSTRUCTORS
    for stand_in in STAND_INS
    if (constructor, stand_in) not in ACCEPTED
)


@pytest.mark.parametrize(("constructor", "stand_in"), PAIRS)
def test_a_stand_in_where_the_real_constructor_takes_none_is_refused(
    constructor: str, stand_in: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrap, real = CONSTRUCTORS[constructor]
    opcodes, real_value = STAND_INS[stand_in]
    with pytest.raises(TypeError):  # the reference: Python's own constructor
        real(real_value)
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(), meta=wrap(opcodes)))
    assert main(["ls", str(path)]) == 3
    one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(("constructor", "stand_in"), sorted(ACCEPTED))
def test_a_path_as_a_part_of_a_path_is_taken_as_pathlib_takes_it(
    constructor: str, stand_in: str
) -> None:
    wrap, real = CONSTRUCTORS[constructor]
    opcodes, real_value = STAND_INS[stand_in]
    inner = real_value if stand_in == "posix_path" else pathlib.PureWindowsPath("a\\b")
    if stand_in == "windows_path":
        opcodes = call(glob("pathlib", "PureWindowsPath"), text("a\\b"))
    made = unpickler.Interpreter(b"\x80\x02" + wrap(opcodes) + b".").load()
    assert made == str(real(inner))


@pytest.mark.parametrize("stand_in", sorted(STAND_INS))
def test_each_stand_in_alone_still_reads(stand_in: str) -> None:
    opcodes, real_value = STAND_INS[stand_in]
    made = unpickler.Interpreter(b"\x80\x02" + opcodes + b".").load()
    expected = real_value.isoformat() if hasattr(real_value, "isoformat") else str(real_value)
    assert made == expected
