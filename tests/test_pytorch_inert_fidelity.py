"""The PyTorch reader's inert values are what Python and torch make of the same pickle, and
what they refuse is refused (exit 3, one line).

Before: pathlib.PureWindowsPath lost a drive (`PureWindowsPath('C:\\\\a', '\\\\b')` is
`C:\\\\b`), a UNC share's closing separator and `//a`'s root, and PosixPath of a Windows
path differed from Python's; torch.device('cuda', -1), 'cuda:01' and ('cuda', 2**62)
were accepted where torch raises (or wraps the index to another device); BUILD of a dict
state on a defaultdict was accepted where Python raises AttributeError; a named
datetime.timezone was shown by its offset, not as str() shows it.

Now paths are made by Python's own pure classes (string manipulation only) from checked
text parts, compared here with pathlib over many combinations of parts; torch.device
follows c10/core/Device.cpp (a pinned table, and torch itself where it installs); BUILD
on a defaultdict takes None only, as the C unpickler does.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import pathlib
import pickle
from pathlib import Path

import pytest
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
)

from clipcli.cli.entry import main
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import inert, unpickler

EMPTY_LIST, APPENDS, NONE = b"]", b"e", b"N"

# ------------------------------------------------------------------ paths

PARTS = [
    "", ".", "..", "a", "b/c", "a\\b", "/", "\\", "//", "\\\\", "///x", "C:", "C:\\", "C:/",
    "c:a", "D:b", "\\\\server\\share", "//server/share", "//server/share/x", "//?/C:/x",
    "\\\\?\\UNC\\s\\h", "C:\\a", "\\b", "a/", "a//b", "./a", "a/./b", "a/../b", "/a/", "//a",
    "x:y", " ", "CON", "\\\\.\\pipe\\x", "\u00e9/\u00df", "a\\\\b//c",
]  # fmt: skip
CLASSES = {"posix": pathlib.PurePosixPath, "windows": pathlib.PureWindowsPath}
GLOBALS = {"posix": "PurePosixPath", "windows": "PureWindowsPath"}
Part = str | tuple[str, str]  # text, or (flavour, text): a path made of that text first


def _opcodes(part: Part) -> bytes:
    if isinstance(part, str):
        return text(part)
    flavour, inner = part
    return call(glob("pathlib", GLOBALS[flavour]), text(inner))


def _real(part: Part) -> str | pathlib.PurePath:
    if isinstance(part, str):
        return part
    flavour, inner = part
    return CLASSES[flavour](inner)


def _combinations() -> list[tuple[Part, ...]]:
    singles: list[tuple[Part, ...]] = [(p,) for p in PARTS]
    pairs: list[tuple[Part, ...]] = list(itertools.product(PARTS, repeat=2))
    few = ["", ".", "a", "C:", "C:\\", "\\b", "//s/h", "\\\\s\\h", "/", "..", "D:b"]
    triples: list[tuple[Part, ...]] = list(itertools.product(few, repeat=3))
    nested: list[tuple[Part, ...]] = [
        ((flavour, inner), *rest)
        for flavour in CLASSES
        for inner in PARTS
        for rest in ((), ("x",), ("\\y",), ("C:z",))
    ]
    nested += [("q", (flavour, inner)) for flavour in CLASSES for inner in PARTS]
    return [(), *singles, *pairs, *triples, *nested]


COMBINATIONS = _combinations()


@pytest.mark.parametrize("flavour", sorted(CLASSES))
def test_paths_are_what_pathlib_makes_of_the_same_parts(flavour: str) -> None:
    """Every combination of drives, UNC shares, roots, '.', '..', empty parts, both
    slashes, and paths of either flavour as parts: one pickle of a list of all of them,
    read by the interpreter, equal item by item to Python's pathlib of the same parts; and
    each no longer than the length reserved for it (inert.path_length_bound)."""
    made_of = glob("pathlib", GLOBALS[flavour])
    data = (
        b"\x80\x02"
        + EMPTY_LIST
        + MARK
        + b"".join(made_of + MARK + b"".join(map(_opcodes, c)) + b"t" + b"R" for c in COMBINATIONS)
        + APPENDS
        + STOP
    )
    made = unpickler.Interpreter(data).load()
    assert isinstance(made, list)
    assert len(made) == len(COMBINATIONS)
    expected = [str(CLASSES[flavour](*map(_real, c))) for c in COMBINATIONS]
    mismatches = [(c, m, e) for c, m, e in zip(COMBINATIONS, made, expected, strict=True) if m != e]
    assert not mismatches, mismatches[:5]
    kind = inert.WindowsPathText if flavour == "windows" else inert.PathText
    assert all(type(m) is kind for m in made)
    for combination, value in zip(COMBINATIONS, made, strict=True):
        # the texts the constructor gets: a path part is its text, of a stand-in type
        given = [p if isinstance(p, str) else inert.PathText(_real(p)) for p in combination]
        assert len(value) <= inert.path_length_bound(given, flavour == "windows"), combination


REPRO = {  # the attacker's cases (repro_windows_paths.py), Python 3's values
    "drive_then_rooted": (("windows", "C:\\a", "\\b"), "C:\\b"),
    "drive_then_root": (("windows", "C:", "\\"), "C:\\"),
    "two_slashes": (("windows", "//a"), "\\a"),
    "unc_share_only": (("windows", "\\\\server\\share"), "\\\\server\\share\\"),
}


@pytest.mark.parametrize("case", sorted(REPRO))
def test_the_repro_paths_are_pythons(case: str, tmp_path: Path) -> None:
    (flavour, *parts), expected = REPRO[case]
    assert str(CLASSES[flavour](*parts)) == expected  # the reference
    value = call(glob("pathlib", GLOBALS[flavour]), *map(text, parts))
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(), meta=value))
    with open_reader(path) as opened:
        assert opened.metadata["meta"] == expected


def test_a_posix_path_of_a_windows_path_is_pythons() -> None:
    inner = call(glob("pathlib", "PureWindowsPath"), text("C:/a"))
    data = b"\x80\x02" + call(glob("pathlib", "PosixPath"), inner) + STOP
    expected = str(pathlib.PurePosixPath(pathlib.PureWindowsPath("C:/a")))
    assert unpickler.Interpreter(data).load() == expected


def test_a_windows_path_on_linux_is_shown_as_a_windows_path() -> None:
    """pathlib.WindowsPath cannot be made on Linux (NotImplementedError, and torch cannot
    load such a file there): clipcli shows it as PureWindowsPath would (docs/FORMATS)."""
    data = b"\x80\x02" + call(glob("pathlib", "WindowsPath"), text("C:/a"), text("b")) + STOP
    made = unpickler.Interpreter(data).load()
    assert made == str(pathlib.PureWindowsPath("C:/a", "b"))
    assert type(made) is inert.WindowsPathText


@pytest.mark.parametrize(
    ("components", "refused"),
    [(inert.MAX_PATH_COMPONENTS, False), (inert.MAX_PATH_COMPONENTS + 1, True)],
)
def test_path_components_exactly_at_the_limit_and_one_past(components: int, refused: bool) -> None:
    """pathlib works one component at a time with no look for a signal: a path of more
    components than the limit is refused before it starts."""
    part = "/".join(["a"] * components)  # `components` components in one part
    data = b"\x80\x02" + call(glob("pathlib", "PurePosixPath"), text(part)) + STOP
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="components"):
            unpickler.Interpreter(data).load()
    else:
        assert unpickler.Interpreter(data).load() == str(pathlib.PurePosixPath(part))


# ------------------------------------------------------------------ torch.device

# (arguments, the text torch shows, or None where torch raises): torch 2.x's rules
# (c10/core/Device.cpp and torch.device's argument parser), checked against torch 2.14.
DEVICES: list[tuple[tuple[object, ...], str | None]] = [
    (("cpu",), "cpu"),
    (("cuda",), "cuda"),
    (("cuda:0",), "cuda:0"),
    (("cuda:1",), "cuda:1"),
    (("cuda:10",), "cuda:10"),
    (("cuda", 0), "cuda:0"),
    (("cuda", 127), "cuda:127"),
    (("cuda", None), "cuda"),
    (("cpu", 1), "cpu:1"),
    (("meta",), "meta"),
    (("mps", 0), "mps:0"),
    (("xla:1",), "xla:1"),
    (("privateuseone",), "privateuseone"),
    (("cuda:127",), "cuda:127"),
    (("cuda", -1), None),  # "Device index must not be negative"
    (("cuda", -2), None),
    (("cuda:01",), None),  # "Invalid device string"
    (("cuda:00",), None),
    (("cuda:-1",), None),
    (("cuda:+1",), None),
    (("cuda: 1",), None),
    (("cuda:",), None),
    (("cuda:0:0",), None),
    ((" cuda",), None),
    (("cuda ",), None),
    (("",), None),  # "Device string must not be empty"
    (("CUDA",), None),  # "Expected one of cpu, cuda, ..."
    (("foo",), None),
    (("cuda_",), None),
    (("cuda:\u0661",), None),  # an Arabic-Indic digit: not an ASCII digit
    (("\uff43uda",), None),
    (("cuda:1", 1), None),  # "type (string) must not include an index ..."
    (("cuda:1", None), None),
    (("cuda", True), None),  # "must be int, not bool"
    (("cuda", 128), None),  # torch wraps DeviceIndex (int8): another device; refused
    (("cuda", 255), None),
    (("cuda", 2**62), None),
    (("cuda:128",), None),
    (("cuda:2147483647",), None),
    (("cuda:9999999999999999999",), None),  # "Could not parse device index"
]
WRAPPED = {128, 255, 2**62, "cuda:128", "cuda:2147483647"}  # torch accepts, wrapped


def _device_pickle(args: tuple[object, ...]) -> bytes:
    def one(arg: object) -> bytes:
        if arg is None:
            return NONE
        if arg is True:
            return b"\x88"
        return text(arg) if isinstance(arg, str) else integer(arg)  # type: ignore[arg-type]

    return b"\x80\x02" + call(glob("torch", "device"), *map(one, args)) + STOP


@pytest.mark.parametrize(("args", "expected"), DEVICES)
def test_torch_device_is_made_or_refused_as_torch_does(
    args: tuple[object, ...], expected: str | None
) -> None:
    data = _device_pickle(args)
    if expected is None:
        with pytest.raises(unpickler.PickleProblem, match="torch.device"):
            unpickler.Interpreter(data).load()
    else:
        made = unpickler.Interpreter(data).load()
        assert made == unpickler.Device(expected)


@pytest.mark.parametrize(("args", "expected"), DEVICES)
def test_the_device_table_is_torchs(args: tuple[object, ...], expected: str | None) -> None:
    """The pinned table against torch itself, where it installs."""
    torch = pytest.importorskip("torch")
    try:
        made = str(pickle.loads(_device_pickle(args)))
    except (RuntimeError, TypeError):
        assert expected is None
        return
    wrapped = args[-1] in WRAPPED or args[0] in WRAPPED
    assert made == expected or (expected is None and wrapped), (made, torch.__version__)


@pytest.mark.parametrize(
    ("index", "refused"),
    [(unpickler.DEVICE_INDEX_MAX, False), (unpickler.DEVICE_INDEX_MAX + 1, True)],
)
def test_a_device_index_exactly_at_the_limit_and_one_past(index: int, refused: bool) -> None:
    for args in (("cuda", index), (f"cuda:{index}",)):
        data = _device_pickle(args)
        if refused:
            with pytest.raises(unpickler.PickleProblem, match="device index"):
                unpickler.Interpreter(data).load()
        else:
            assert unpickler.Interpreter(data).load() == unpickler.Device(f"cuda:{index}")


def test_a_refused_device_is_one_line_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    value = call(glob("torch", "device"), text("cuda"), integer(-1))
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(), meta=value))
    assert main(["ls", str(path)]) == 3
    assert "torch.device" in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ defaultdict BUILD


def _defaultdict_built(state_opcodes: bytes) -> bytes:
    made = call(glob("collections", "defaultdict"), glob("builtins", "list"))
    return b"\x80\x02" + made + state_opcodes + BUILD + STOP


DEFAULTDICT_STATES = {
    "none": (NONE, False),
    "empty_dict": (EMPTY_DICT, True),
    "dict": (EMPTY_DICT + MARK + text("a") + integer(1) + SETITEMS, True),
}


@pytest.mark.parametrize("case", sorted(DEFAULTDICT_STATES))
def test_build_on_a_defaultdict_is_refused_as_python_refuses_it(case: str) -> None:
    """Python's (C) unpickler, as torch.load runs it: a dict state, even empty, is
    AttributeError (a defaultdict has no __dict__); None sets nothing."""
    opcodes, refused = DEFAULTDICT_STATES[case]
    data = _defaultdict_built(opcodes)
    if refused:
        with pytest.raises(AttributeError):
            pickle.loads(data)
        with pytest.raises(unpickler.PickleProblem, match="defaultdict"):
            unpickler.Interpreter(data).load()
    else:
        assert pickle.loads(data) == collections.defaultdict(list)
        assert unpickler.Interpreter(data).load() == {}


# ------------------------------------------------------------------ a named time zone

ZONES = {
    "named": ((0, 3_600, 0), "CET"),
    "named_negative": ((-1, 82_800, 0), "EST-ish"),
    "named_like_utc": ((0, 0, 0), "UTC"),
    "unnamed": ((0, 3_600, 0), None),
    "control_characters": ((0, 0, 0), "A\nB\x1b[31m"),
}


@pytest.mark.parametrize("case", sorted(ZONES))
def test_a_time_zone_is_shown_as_str_shows_its_name(case: str) -> None:
    (days, seconds, micro), name = ZONES[case]
    delta = call(glob("datetime", "timedelta"), integer(days), integer(seconds), integer(micro))
    args = (delta,) if name is None else (delta, text(name))
    data = b"\x80\x02" + call(glob("datetime", "timezone"), *args) + STOP
    real = pickle.loads(data)
    made = unpickler.Interpreter(data).load()
    assert isinstance(made, inert.Zone)
    if name is None:  # unnamed: its offset as isoformat() writes it (as before)
        offset = datetime.datetime(2024, 1, 1, tzinfo=real).isoformat()[19:]
        assert made.text() == f"timezone {offset}"
    else:
        assert made.text() == f"timezone {real}"


def test_a_time_zones_name_is_escaped_as_other_metadata_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    delta = call(glob("datetime", "timedelta"), integer(0), integer(0), integer(0))
    value = call(glob("datetime", "timezone"), delta, text("A\nB\x1b[31m"))
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(), meta=value))
    assert main(["ls", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    line = next(line for line in out.splitlines() if "timezone" in line)
    assert "timezone A\\nB\\x1b[31m" in line
