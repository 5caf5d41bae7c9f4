"""A small pickle that references one big memo'd value many times must not make an output
far bigger than itself (the PyTorch reader's own interpreter and its inert constructors).

A memo reference (BINGET) costs 2 bytes of pickle however big the value it repeats.
Before: `pathlib.PosixPath(*parts)` with N references to one long memo'd string joined
them quadratically and charged the result only once made: a 1 MB pickle reached 3.2 GB of
RSS and ran for 13+ minutes, and SIGTERM then gave exit 3 after minutes, not 143. Now
every constructor (and every opcode that builds a container) reserves the size of what it
will make, computed from its arguments' sizes, before making it; joining is linear; long
work (parts joined, key items hashed or compared) is counted and acts on a pending signal.

Checked with real `prlimit --as` runs (exit 3 with the budget's line, never an
allocation failure), the child's own peak RSS, exact at-the-budget/one-past cases against
sizes computed here (sys.getsizeof, Python's pathlib for the joined text), and real
signals delivered while the process is stopped inside the constructor.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from expect import one_error_line, signalled_where_it_stops
from test_pytorch_hostile import (
    BUILD,
    EMPTY_DICT,
    EMPTY_LIST,
    MARK,
    REDUCE,
    SETITEMS,
    STOP,
    TUPLE,
    glob,
    integer,
    state,
    tensor,
    text,
    torch_zip,
)

from clipcli.cli.entry import main
from clipcli.errors import Interrupted
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import inert, reader, unpickler
from clipcli.system import interrupts

PUT1, GET1, POP, APPENDS, NONE = b"q\x01", b"h\x01", b"0", b"e", b"N"
NEWOBJ, EMPTY_TUPLE, FROZENSET, TUPLE1 = b"\x81", b")", b"\x91", b"\x85"
CLIPCLI = [sys.executable, "-m", "clipcli"]
ADDRESS_SPACE_MIB = 384  # a few hundred MiB: before, these files asked for gigabytes
RSS_BUDGET = 300 << 20


def memoized(value: bytes) -> bytes:
    """`value` put in memo slot 1 and taken off the stack: referenced later by GET1 only."""
    return value + PUT1 + POP


def many(piece: bytes, count: int) -> bytes:
    return MARK + piece * count


# Each: a value built from one big memo'd value referenced many times (2-6 bytes each).
BIG_TEXT = memoized(text("x" * 50_000))
BIG_LIST = memoized(EMPTY_LIST + MARK + b"".join(integer(i) for i in range(20_000)) + APPENDS)
BIG_PAIRS = memoized(
    EMPTY_LIST + MARK + b"".join(integer(i) + NONE + b"\x86" for i in range(20_000)) + APPENDS
)
BIG_DICT = memoized(
    EMPTY_DICT + MARK + b"".join(text(f"k{i}") + NONE for i in range(20_000)) + SETITEMS
)
BIG_TUPLE = memoized(MARK + b"".join(integer(i) for i in range(20_000)) + TUPLE)
AMPLIFIERS: dict[str, tuple[bytes, str]] = {
    "posix_path_of_one_part_many_times": (
        BIG_TEXT + glob("pathlib", "PosixPath") + many(GET1, 40_000) + TUPLE + REDUCE,
        "pathlib.PosixPath of 2000039999 characters",
    ),
    "windows_path_of_one_part_many_times": (
        BIG_TEXT + glob("pathlib", "PureWindowsPath") + many(GET1, 40_000) + TUPLE + REDUCE,
        "pathlib.PureWindowsPath of 2000039999 characters",
    ),
    "codecs_encode_of_one_text_many_times": (
        BIG_TEXT
        + EMPTY_LIST
        + many(glob("_codecs", "encode") + GET1 + text("latin1") + b"\x86" + REDUCE, 2_000)
        + APPENDS,
        "_codecs.encode of 50000 characters",
    ),
    "set_of_one_list_many_times": (
        BIG_LIST
        + EMPTY_LIST
        + many(glob("builtins", "set") + GET1 + TUPLE1 + REDUCE, 2_000)
        + APPENDS,
        "builtins.set of 20000 items",
    ),
    "ordered_dict_of_one_pair_list_many_times": (
        BIG_PAIRS
        + EMPTY_LIST
        + many(glob("collections", "OrderedDict") + GET1 + TUPLE1 + REDUCE, 2_000)
        + APPENDS,
        "collections.OrderedDict of 20000 items",
    ),
    "namespaces_built_from_one_dict": (
        BIG_DICT
        + EMPTY_LIST
        + many(glob("argparse", "Namespace") + EMPTY_TUPLE + NEWOBJ + GET1 + BUILD, 2_000)
        + APPENDS,
        "argparse.Namespace of 20000 attributes",
    ),
    "one_tuple_as_a_dict_key_many_times": (
        BIG_TUPLE + EMPTY_DICT + many(GET1 + NONE, 40_000) + SETITEMS,
        "steps of work",
    ),
    "one_tuple_in_frozensets_many_times": (
        BIG_TUPLE + EMPTY_LIST + many(MARK + GET1 + GET1 + FROZENSET, 10_000) + APPENDS,
        "steps of work",
    ),
}


def _checkpoint(path: Path, value: bytes) -> Path:
    return torch_zip(path, state(w=tensor(), meta=value))


_PEAK_PROBE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL)\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(done.returncode)\n"
)


@pytest.mark.parametrize("case", sorted(AMPLIFIERS))
def test_an_amplifying_pickle_is_refused_before_it_is_built(case: str, tmp_path: Path) -> None:
    """Under a real address-space limit, exit 3 with the budget's line naming what would
    have been made; the child's peak RSS stays far below what the output would take."""
    value, says = AMPLIFIERS[case]
    path = _checkpoint(tmp_path / "m.pt", value)
    assert path.stat().st_size < 400_000
    peak = tmp_path / "peak"
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, str(peak),
         "prlimit", f"--as={ADDRESS_SPACE_MIB << 20}", *CLIPCLI, "ls", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    line = one_error_line(done.stderr)
    assert says in line, line
    if "steps" not in says:  # refused before it was made, not charged after
        assert "would take more than" in line, line
    assert int(peak.read_text()) << 10 < RSS_BUDGET


# ------------------------------------------------------------------ exactly at the budget


def _path_pickle(part: str, count: int) -> bytes:
    return (
        b"\x80\x02"
        + memoized(text(part))
        + glob("pathlib", "PosixPath")
        + many(GET1, count)
        + TUPLE
        + REDUCE
        + STOP
    )


def _encode_pickle(value: str) -> bytes:
    return (
        b"\x80\x02"
        + memoized(text(value))
        + glob("_codecs", "encode")
        + GET1
        + text("latin1")
        + b"\x86"
        + REDUCE
        + STOP
    )


def _memory_of(data: bytes) -> int:
    machine = unpickler.Interpreter(data)
    machine.load()
    return machine._memory  # what the budget was charged: the same sum at every run


AT_THE_BUDGET: dict[str, tuple[bytes, object, str]] = {
    "posix_path": (
        _path_pickle("part", 3_000),
        str(pathlib.PurePosixPath(*["part"] * 3_000)),
        "pathlib.PosixPath of 14999 characters",
    ),
    "codecs_encode": (_encode_pickle("y" * 30_000), b"y" * 30_000, "_codecs.encode of 30000"),
}


@pytest.mark.parametrize("case", sorted(AT_THE_BUDGET))
@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_a_constructors_output_exactly_at_the_budget_and_one_past(
    case: str, slack: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output is the last thing charged: a budget of exactly what the run takes makes
    it (its text as Python's pathlib writes it); one byte less is refused by the
    reservation, before the output exists."""
    data, expected, says = AT_THE_BUDGET[case]
    needed = _memory_of(data)
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 0)
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", needed + slack)
    machine = unpickler.Interpreter(data)
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="would take more than") as caught:
            machine.load()
        assert says in str(caught.value)
    else:
        made = machine.load()
        assert made == expected
        assert machine._memory == needed


@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_work_exactly_at_the_budget_and_one_past(slack: int, refused: bool) -> None:
    """A tuple's hash is not cached: each time it is a key, its items count as work."""
    data = b"\x80\x02" + BIG_TUPLE + EMPTY_DICT + many(GET1 + NONE, 50) + SETITEMS + STOP
    counted = unpickler.Interpreter(data)
    counted.load()
    steps = counted._steps
    assert steps > 50 * 20_000  # every key's items, each time
    machine = unpickler.Interpreter(data)
    machine.object_budget = steps + slack
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="steps of work"):
            machine.load()
    else:
        assert machine.load() == {tuple(range(20_000)): None}


def test_a_long_path_within_the_budget_is_shown_shortened(tmp_path: Path) -> None:
    """Metadata text is bounded as every other value's (MAX_VALUE_TEXT characters)."""
    path = _checkpoint(
        tmp_path / "m.pt",
        memoized(text("p" * 1_000)) + glob("pathlib", "PosixPath") + many(GET1, 100) + TUPLE
        + REDUCE,
    )  # fmt: skip
    with open_reader(path) as opened:
        value = opened.metadata["meta"]
    assert len(value) == reader.MAX_VALUE_TEXT
    assert value == ("p" * 1_000 + "/")[: reader.MAX_VALUE_TEXT - 3] + "..."
    assert main(["ls", str(path)]) == 0


# ------------------------------------------------------------------ signals


def test_a_pending_signal_stops_the_constructor() -> None:
    """A signal recorded before a long join (100,000 parts): its count of work raises."""
    machine = unpickler.Interpreter(b"")
    with interrupts.deferred():
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by interrupts._record, not acted on
        assert interrupts.pending() == signal.SIGTERM
        with pytest.raises(Interrupted) as caught:
            inert.CALLS["posix_path"]("pathlib.PosixPath", ("a",) * 100_000, machine)
    assert caught.value.exit_code == 143


# Runs clipcli with the path constructor stopping its own process on entry (SIGSTOP): the
# test sees it stopped inside the constructor, sends SIGTERM, and lets it go on.
_STOPPED_IN_THE_CONSTRUCTOR = """
import os, signal, sys
from clipcli.formats.pytorch import unpickler
made = unpickler._CALLS["posix_path"]
def stopping(name, args, room):
    os.kill(os.getpid(), signal.SIGSTOP)
    return made(name, args, room)
unpickler._CALLS["posix_path"] = stopping
from clipcli.cli.entry import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("signum", "code", "says"), [
    (signal.SIGTERM, 143, "terminated by SIGTERM"),
    (signal.SIGINT, 130, "interrupted"),
])  # fmt: skip
def test_a_signal_inside_the_path_constructor_ends_the_run_as_that_signal(
    signum: int, code: int, says: str, tmp_path: Path
) -> None:
    """The repro's file (a 1 MB-part path of 300,000 parts: minutes before, then exit 3):
    a signal that arrives while the constructor runs is 143 (130), one line."""
    part = memoized(text("x" * 1_000_000))
    path = _checkpoint(
        tmp_path / "m.pt", part + glob("pathlib", "PosixPath") + many(GET1, 300_000) + TUPLE
        + REDUCE,
    )  # fmt: skip
    returncode, err = signalled_where_it_stops(
        _STOPPED_IN_THE_CONSTRUCTOR, ["ls", str(path)], signum
    )
    assert returncode == code, err
    assert says in one_error_line(err)
