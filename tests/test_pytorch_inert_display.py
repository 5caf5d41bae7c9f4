"""What the PyTorch reader shows of inert values and names, against Python's own output.

1. A fixed time zone's offset is shown as datetime's isoformat() shows it: before, a
   sub-minute or negative offset came out as `-00:00+1us` or `+00:00+1000001us`. The
   reference is Python itself: `pickle.dumps` of a real datetime (protocol 2, as
   torch.save writes) read by our interpreter, compared with the datetime's isoformat().
   Offsets Python refuses (a day or more either way) stay refused: at the limit and past.
2. A global is named in messages as the file spells it: REDUCE on `__builtin__.long`
   (protocol 2, Python 2 pickles) said `builtins.int`.
3. A path's parts are joined as Python's pathlib joins them (now in linear passes).
"""

from __future__ import annotations

import datetime
import pathlib
import pickle
from pathlib import Path

import pytest
from expect import one_error_line
from test_pytorch_hostile import call, glob, integer, state, tensor, text, torch_zip
from test_pytorch_lightning import EMPTY_TUPLE

from clipcli.cli.entry import main
from clipcli.formats.pytorch import unpickler

MICROSECONDS_A_DAY = 86_400_000_000
EDGES = [
    (-1, 86_399, 999_999),  # -1 microsecond
    (0, 1, 1),
    (-1, 68_400, 0),  # -05:00
    (0, 86_399, 999_999),  # +23:59:59.999999, the largest
    (-1, 0, 1),  # -23:59:59.999999, the smallest
    (0, 0, 0),
    (0, 59, 0),
    (-1, 86_340, 0),  # -00:01
    (0, 19_800, 0),  # +05:30
]
# A sweep over the whole range by a step that is no round number of seconds or minutes.
SWEEP = [
    divmod(offset, MICROSECONDS_A_DAY)
    for offset in range(-MICROSECONDS_A_DAY + 1, MICROSECONDS_A_DAY, 7_777_777_777)
]
OFFSETS = EDGES + [(days, *divmod(rest, 1_000_000)) for days, rest in SWEEP]


def _read(value: object) -> object:
    return unpickler.Interpreter(pickle.dumps(value, protocol=2)).load()


@pytest.mark.parametrize("offset", OFFSETS)
def test_a_fixed_offset_is_shown_as_isoformat_shows_it(offset: tuple[int, int, int]) -> None:
    zone = datetime.timezone(datetime.timedelta(*offset))
    stamp = datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=zone)
    assert _read(stamp) == stamp.isoformat()
    clock = datetime.time(3, 4, 5, tzinfo=zone)
    assert _read(clock) == clock.isoformat()


@pytest.mark.parametrize(
    ("offset", "refused"),
    [
        ((0, 86_399, 999_999), False),  # the largest Python makes
        ((1, 0, 0), True),  # one microsecond more: a day
        ((-1, 0, 1), False),  # the smallest
        ((-1, 0, 0), True),  # one microsecond less: minus a day
    ],
)
def test_an_offset_at_a_day_is_refused_as_python_refuses_it(
    offset: tuple[int, int, int], refused: bool
) -> None:
    delta = call(glob("datetime", "timedelta"), *map(integer, offset))
    data = b"\x80\x02" + call(glob("datetime", "timezone"), delta) + b"."
    if refused:
        with pytest.raises(ValueError, match="strictly between"):  # Python refuses it too
            datetime.timezone(datetime.timedelta(*offset))
        with pytest.raises(unpickler.PickleProblem, match="an offset of a day or more"):
            unpickler.Interpreter(data).load()
    else:
        zone = datetime.timezone(datetime.timedelta(*offset))
        made = unpickler.Interpreter(data).load()
        stamp = datetime.datetime(2024, 1, 2, tzinfo=zone).isoformat()
        assert f"timezone {stamp[19:]}" == made.text()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("module", "name"),
    [("__builtin__", "long"), ("__builtin__", "unicode"), ("__builtin__", "list"),
     ("builtins", "int"), ("__builtin__", "set")],
)  # fmt: skip
def test_a_refused_call_names_the_global_as_the_file_spells_it(
    module: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    called = call(glob(module, name), EMPTY_TUPLE if name != "set" else integer(1))
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(), meta=called))
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert f"{module}.{name}" in line, line
    if module == "__builtin__":
        assert "builtins." not in line, line


def test_a_python2_factory_is_still_known_by_what_it_is() -> None:
    """`defaultdict(__builtin__.long)`: the factory is builtins.int, as pickle maps it."""
    data = b"\x80\x02" + call(glob("collections", "defaultdict"), glob("__builtin__", "long"))
    made = unpickler.Interpreter(data + b".").load()
    assert made.factory == "builtins.int"  # type: ignore[attr-defined]


PATHS = [
    ("/", "data", "train"), ("//", "a"), ("a", "//b", "c"), ("///", "x"), ("a", "/", "b"),
    ("a/./b", ".", "./c/."), (".", "./.", "/./"), ("a//", "//"), ("a/././././b",),
    ("a//////b/",), ("",), (), ("a/..", ".x/"), ("/./a",),
]  # fmt: skip
WINDOWS_PATHS = [("C:\\", "x"), ("\\", "a"), ("\\\\srv\\share\\", "x"), ("a\\.\\b", "c/d")]


@pytest.mark.parametrize("parts", PATHS)
def test_a_posix_path_is_joined_as_pathlib_joins_it(parts: tuple[str, ...]) -> None:
    """Joined in a few linear passes (a memo'd part may repeat 500,000 times), with
    pathlib's result: the last absolute part restarts, `.` and empty components go."""
    data = call(glob("pathlib", "PurePosixPath"), *map(text, parts))
    assert unpickler.Interpreter(b"\x80\x02" + data + b".").load() == str(
        pathlib.PurePosixPath(*parts)
    )


@pytest.mark.parametrize("parts", WINDOWS_PATHS)
def test_a_windows_path_is_joined_as_pathlib_joins_it(parts: tuple[str, ...]) -> None:
    data = call(glob("pathlib", "PureWindowsPath"), *map(text, parts))
    assert unpickler.Interpreter(b"\x80\x02" + data + b".").load() == str(
        pathlib.PureWindowsPath(*parts)
    )
