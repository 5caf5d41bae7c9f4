"""Keys whose hashes collide must not make the PyTorch reader's pickle interpreter quadratic
for free, nor deaf to signals.

CPython compares a key put in a dict or set with every key already there of the same
hash. Text and bytes hash at random per process, but every other key's hash is the file's
choice: the ints j*(2**61-1) all hash to 0, so do tuples of them, and 1, 1.0, True and
the floats 2.0**(61*k) all hash to 1. Before: a 1.44 MB pickle of such keys (a dict, set,
frozenset or OrderedDict) ran 102 s of CPU and exited 0, and SIGTERM was honoured only
after 100 s; a set receiving one of two equal 1 MB strings a million times (BINGET) ran
24 s, its compares not counted as a dict's are. Now every insertion into a hashed
container goes through one rule (unpickler.Interpreter.insert): the keys already in that
container with the key's hash are charged as work before the insertion makes those
compares (an equal text as in dicts), so the work budget refuses the file (exit 3, one
line) and the work counted acts on a pending signal inside the insertion loop.

References: the number of compares is computed here from Python's own hash() over the
keys inserted so far (by definition, not by the interpreter's table); the values made
are compared with Python's pickle.loads of the same bytes.
"""

from __future__ import annotations

import argparse
import pickle
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from expect import one_error_line, signalled_where_it_stops
from test_pytorch_hostile import (
    BUILD,
    EMPTY_DICT,
    EMPTY_LIST,
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

from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import unpickler

M = 2**61 - 1  # CPython's hash modulus: j*M hashes to 0 for every j
NONE, SETITEM, DICT, APPENDS, EMPTY_TUPLE = b"N", b"s", b"d", b"e", b")"
EMPTY_SET, ADDITEMS, FROZENSET, NEWOBJ = b"\x8f", b"\x90", b"\x91", b"\x81"
PUT1, GET1, PUT2, GET2, POP = b"q\x01", b"h\x01", b"q\x02", b"h\x02", b"0"
CLIPCLI = [sys.executable, "-m", "clipcli"]


def floating(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)


def encode(value: object) -> bytes:
    """A key as pickle opcodes: ints, floats, bools, complex numbers and tuples of them."""
    if value is True:
        return b"\x88"
    if isinstance(value, int):
        return integer(value)
    if isinstance(value, float):
        return floating(value)
    if isinstance(value, complex):
        return call(glob("builtins", "complex"), floating(value.real), floating(value.imag))
    assert isinstance(value, tuple)
    return tup(*map(encode, value))


N = 300
KEYS: dict[str, list[object]] = {
    "ints": [j * M for j in range(N)],
    "tuples": [(j * M, (N - j) * M) for j in range(N)],
    "floats_and_ints": [*(2.0 ** (61 * k) for k in range(-16, 17)), *(1 + j * M for j in range(N))],
    "bools_ints_floats": [True, 1, 1.0, complex(1, 0), *(1 + j * M for j in range(1, N)), 1.0,
                          True, 1],
}  # fmt: skip


def compares(keys: list[object]) -> int:
    """By definition: for each key, the keys already in the container with its hash."""
    present: list[object] = []
    total = 0
    for key in keys:
        total += sum(1 for other in present if hash(other) == hash(key))
        if not any(other == key for other in present):
            present.append(key)
    return total


def _pairs(keys: list[object]) -> bytes:
    return b"".join(encode(k) + NONE for k in keys)


def _items(keys: list[object]) -> bytes:
    return b"".join(map(encode, keys))


def _list(keys: list[object]) -> bytes:
    return EMPTY_LIST + MARK + _items(keys) + APPENDS


# Each: the keys put into one container by one path of the interpreter.
CONTAINERS: dict[str, Callable[[list[object]], bytes]] = {
    "SETITEMS": lambda keys: EMPTY_DICT + MARK + _pairs(keys) + SETITEMS,
    "SETITEM": lambda keys: EMPTY_DICT + b"".join(encode(k) + NONE + SETITEM for k in keys),
    "DICT": lambda keys: MARK + _pairs(keys) + DICT,
    "EMPTY_SET+ADDITEMS": lambda keys: EMPTY_SET + MARK + _items(keys) + ADDITEMS,
    "FROZENSET": lambda keys: MARK + _items(keys) + FROZENSET,
    "builtins.set": lambda keys: call(glob("builtins", "set"), _list(keys)),
    "builtins.frozenset": lambda keys: call(glob("builtins", "frozenset"), _list(keys)),
    "OrderedDict(pairs)": lambda keys: call(
        glob("collections", "OrderedDict"),
        EMPTY_LIST + MARK + b"".join(tup(encode(k), NONE) for k in keys) + APPENDS,
    ),
    "OrderedDict+SETITEMS": lambda keys: call(glob("collections", "OrderedDict"))
    + MARK + _pairs(keys) + SETITEMS,
    "defaultdict+SETITEMS": lambda keys: call(
        glob("collections", "defaultdict"), glob("builtins", "list")
    ) + MARK + _pairs(keys) + SETITEMS,
    "Namespace BUILD": lambda keys: glob("argparse", "Namespace") + EMPTY_TUPLE + NEWOBJ
    + EMPTY_DICT + MARK + _pairs(keys) + SETITEMS + BUILD,
    "AttributeDict+SETITEMS": lambda keys: call(
        glob("lightning_fabric.utilities.data", "AttributeDict")
    ) + MARK + _pairs(keys) + SETITEMS,
}  # fmt: skip
# Paths whose keys are inserted twice (the state dict, then the Namespace from it).
TWICE = {"Namespace BUILD"}


def _pickle(value: bytes) -> bytes:
    return b"\x80\x02" + value + STOP


def _python(data: bytes) -> object:
    """Python's own reading of the pickle, as the interpreter's values compare with it."""
    made = pickle.loads(data)
    return vars(made) if isinstance(made, argparse.Namespace) else made


def _steps(data: bytes, budget: int | None = None) -> tuple[int, object]:
    machine = unpickler.Interpreter(data)
    if budget is not None:
        machine.object_budget = budget
    made = machine.load()
    return machine._steps, made


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("family", sorted(KEYS))
def test_colliding_keys_are_charged_their_compares(container: str, family: str) -> None:
    """Every path that puts keys into a hashed container charges, for each key, the keys of
    its hash already there: at least the compares counted here by definition. Before, a
    path charged one step a key (or none), whatever the collisions."""
    keys = KEYS[family]
    data = _pickle(CONTAINERS[container](keys))
    steps, made = _steps(data)
    needed = compares(keys)
    if container in TWICE:  # the state dict's keys (equal ones gone) go into the Namespace
        needed += compares(list(dict.fromkeys(keys)))
    assert needed > N * N // 3  # the family collides: quadratic
    assert steps >= needed
    assert steps <= 8 * needed + 10 * len(keys)  # and charged no more than a few times that
    if "AttributeDict" not in container:  # Lightning is not installed here
        assert made == _python(data)


def _assert_read_at_its_work_and_refused_past(data: bytes, slack: int, refused: bool) -> None:
    """A work budget of the steps `data` needs plus `slack`: read at 0, refused at -1."""
    needed, _ = _steps(data)
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="steps of work"):
            _steps(data, needed + slack)
    else:
        assert _steps(data, needed + slack)[0] == needed


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_colliding_keys_exactly_at_the_work_budget_and_one_past(
    container: str, slack: int, refused: bool
) -> None:
    """A work budget of exactly what the run counts makes the container; one step less is
    refused (PickleProblem: exit 3 in the CLI) before the last key's compares."""
    _assert_read_at_its_work_and_refused_past(
        _pickle(CONTAINERS[container](KEYS["ints"])), slack, refused
    )


def test_one_memo_list_of_colliding_keys_made_into_many_sets_is_charged_each_time() -> None:
    """A memo reference repeats a list of colliding keys for 2 bytes: each set made of it
    is charged its own compares (each container has its own count of hashes)."""
    keys = KEYS["ints"]
    made_of = _list(keys) + PUT1 + POP
    sets = 20
    value = made_of + EMPTY_LIST + MARK + call(glob("builtins", "set"), GET1) * sets + APPENDS
    steps, made = _steps(_pickle(value))
    assert steps >= sets * compares(keys)
    assert made == [set(keys)] * sets


def test_a_namespace_built_from_one_memo_dict_many_times_is_charged_each_time() -> None:
    keys = KEYS["ints"]
    state_dict = EMPTY_DICT + MARK + _pairs(keys) + SETITEMS + PUT1 + POP
    many = 20
    one = glob("argparse", "Namespace") + EMPTY_TUPLE + NEWOBJ + GET1 + BUILD
    steps, _ = _steps(_pickle(state_dict + EMPTY_LIST + MARK + one * many + APPENDS))
    assert steps >= (many + 1) * compares(keys)


# ------------------------------------------------------------------ equal text in sets

LONG = 100_000  # characters: a compare of two equal texts reads them all


def _equal_texts(container: str, count: int) -> bytes:
    """Two equal (not identical) long texts in memo slots 1 and 2; the container gets the
    first once, then the second `count` times by memo reference."""
    texts = text("a" * LONG) + PUT1 + POP + text("a" * LONG) + PUT2 + POP
    items = GET1 + GET2 * count
    listed = EMPTY_LIST + MARK + items + APPENDS
    made = {
        "EMPTY_SET+ADDITEMS": EMPTY_SET + MARK + items + ADDITEMS,
        "FROZENSET": MARK + items + FROZENSET,
        "builtins.set": call(glob("builtins", "set"), listed),
        "builtins.frozenset": call(glob("builtins", "frozenset"), listed),
        "SETITEMS": EMPTY_DICT + MARK + (GET1 + NONE) + (GET2 + NONE) * count + SETITEMS,
    }[container]
    return _pickle(texts + made)


SET_PATHS = ["EMPTY_SET+ADDITEMS", "FROZENSET", "builtins.set", "builtins.frozenset"]


@pytest.mark.parametrize("container", [*SET_PATHS, "SETITEMS"])
def test_an_equal_text_put_in_a_set_is_charged_as_in_a_dict(container: str) -> None:
    """Each equal text is compared in full (LONG characters, one step per 4 KiB): counted
    for sets as for dicts. Before, a set counted one step a key."""
    count = 1_000
    steps, made = _steps(_equal_texts(container, count))
    assert steps >= count * (LONG >> 12)
    assert len(made) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("container", SET_PATHS)
@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_equal_texts_in_a_set_exactly_at_the_work_budget_and_one_past(
    container: str, slack: int, refused: bool
) -> None:
    _assert_read_at_its_work_and_refused_past(_equal_texts(container, 100), slack, refused)


# ------------------------------------------------------------------ the CLI, end to end

BIG = 20_000  # colliding keys: 2e8 compares, fifty times the default work budget
ATTACKS: dict[str, bytes] = {
    "dict": EMPTY_DICT + MARK + _pairs([j * M for j in range(BIG)]) + SETITEMS,
    "set": EMPTY_SET + MARK + _items([j * M for j in range(BIG)]) + ADDITEMS,
    "frozenset": MARK + _items([j * M for j in range(BIG)]) + FROZENSET,
    "OrderedDict": CONTAINERS["OrderedDict(pairs)"]([j * M for j in range(BIG)]),
}


def _checkpoint(path: Path, value: bytes) -> Path:
    return torch_zip(path, state(w=tensor(), meta=value))


@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_the_repro_files_are_refused_with_one_line(case: str, tmp_path: Path) -> None:
    """The attacker's files (smaller): exit 3 with the budget's line, not minutes of CPU."""
    path = _checkpoint(tmp_path / "m.pt", ATTACKS[case])
    done = subprocess.run([*CLIPCLI, "ls", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "steps of work" in one_error_line(done.stderr)


# Runs clipcli with Interpreter.insert stopping its own process (SIGSTOP) when the first
# colliding key after the first comes: the test sees it stopped inside the insertion
# loop, sends the signal, and lets it go on. The rest of that loop alone would exceed the
# work budget (exit 3): only a check made inside it ends the run as the signal.
_STOPPED_IN_THE_LOOP = """
import os, signal, sys
from clipcli.formats.pytorch import unpickler
insert = unpickler.Interpreter.insert
seen = []
def stopping(self, target, key, value=None):
    if type(key) is int and key == %d:
        seen.append(key)
        os.kill(os.getpid(), signal.SIGSTOP)
    return insert(self, target, key, value)
unpickler.Interpreter.insert = stopping
from clipcli.cli.entry import main
code = main(sys.argv[1:])
assert seen, "never stopped"
sys.exit(code)
""" % (2 * M)  # noqa: UP031 - a program's text


@pytest.mark.parametrize("case", sorted(ATTACKS))
@pytest.mark.parametrize(("signum", "code", "says"), [
    (signal.SIGTERM, 143, "terminated by SIGTERM"),
    (signal.SIGINT, 130, "interrupted"),
])  # fmt: skip
def test_a_signal_inside_the_insertion_loop_ends_the_run_as_that_signal(
    case: str, signum: int, code: int, says: str, tmp_path: Path
) -> None:
    path = _checkpoint(tmp_path / "m.pt", ATTACKS[case])
    returncode, err = signalled_where_it_stops(_STOPPED_IN_THE_LOOP, ["ls", str(path)], signum)
    assert returncode == code, err
    assert says in one_error_line(err)


# ------------------------------------------------------------------ real checkpoints

TENSORS = 200_000


def test_an_optimizer_state_of_200000_parameters_is_charged_linearly() -> None:
    """torch.optim's state dict: int keys 0..N-1 (one per parameter) in `state` and in
    `param_groups`' lists, and N dicts with the same text keys: no hash is shared, so the
    work is a step or two a key, far inside the budget (no false refusal)."""
    optimizer = {
        "state": {
            i: {"step": 10.0, "exp_avg": (i, 0), "exp_avg_sq": (i, 1)} for i in range(TENSORS)
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(TENSORS))}],
    }
    data = pickle.dumps(optimizer, protocol=2)
    machine = unpickler.Interpreter(data)
    assert machine.load() == optimizer
    keys = TENSORS * 4 + 3
    assert machine._steps <= keys + 10
    assert machine._steps < machine.object_budget // 4


# ------------------------------------------------------------------ the reader's own tables


class _CollidingSize(int):
    """A size whose hash collides with every other's, counting the compares made with it:
    what ints j*(2**61-1) in an empty tensor's shape do to a table keyed by the shape."""

    compares = 0

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        _CollidingSize.compares += 1
        return int(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other


def test_the_readers_table_of_views_does_not_compare_colliding_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader finds identical views (shared storage) by a table: keyed by the view's
    tuple, 16,000 empty tensors of shapes (0, j*(2**61-1), ...) took 13 s (quadratic in
    the tensors; 200,000 would take most of an hour). Keyed by a digest of the view, a
    shape is compared only with an equal view's. Sizes that collide and count their
    compares stand in for such ints (the interpreter's shapes are wrapped)."""
    sizes = unpickler._ints

    def colliding(name: str, value: object, what: str) -> tuple[int, ...]:
        return tuple(_CollidingSize(v) for v in sizes(name, value, what))

    monkeypatch.setattr(unpickler, "_ints", colliding)
    count = 400
    body = b"".join(
        text(f"t{j}") + tensor(size=(0, j), stride=(1, 1)) for j in range(count)
    ) + text("same") + tensor(size=(0, 7), stride=(1, 1))  # fmt: skip
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + EMPTY_DICT + MARK + body + SETITEMS + STOP)
    _CollidingSize.compares = 0
    with open_reader(path) as opened:
        assert len(opened.infos) == count + 1
        assert opened.metadata["pytorch.shared_storage"].startswith("t0, t1")
    assert _CollidingSize.compares < 10 * count  # not count**2 / 2
