"""Issue 22: the pickle's object budget follows its size.

A fixed 4,000,000 objects refused real files: a 7B model's pytorch_model.bin (or a
checkpoint with a large vocabulary dict) makes more, at 3-10 bytes of pickle per object.
The budget is now MAX_OBJECTS or one object per PICKLE_BYTES_PER_OBJECT bytes of the pickle,
whichever is more; memory stays bounded by the separate byte budget (32 x the pickle).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from expect import one_error_line
from test_pytorch_hostile import torch_zip

from clipcli.cli.entry import main
from clipcli.formats.pytorch import unpickler

FLOOR = 100  # MAX_OBJECTS moved down, so the budget is the pickle's size's


def _padded_list(nones: int, padding: int) -> bytes:
    """[None * nones, "x" * padding]: MARK, the NONEs, the string and LIST make nones + 3
    objects in nones + 10 + padding bytes."""
    text = b"X" + struct.pack("<I", padding) + b"x" * padding
    return b"\x80\x02(" + b"N" * nones + text + b"l."


@pytest.mark.parametrize(("extra", "refused"), [(0, False), (1, True)])
def test_object_budget_follows_the_pickles_size_at_the_limit_and_one_past(
    extra: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", FLOOR)
    # 203 objects in 406 bytes: exactly one per 2 bytes; one NONE more is 204 in 407
    data = _padded_list(200 + extra, 196)
    assert len(data) == 406 + extra
    machine = unpickler.Interpreter(data)
    assert machine.object_budget == 203
    assert machine.object_budget > FLOOR  # the size decides, not the floor
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="more than 203 objects"):
            machine.load()
    else:
        loaded = machine.load()
        assert isinstance(loaded, list)
        assert len(loaded) == 201


@pytest.mark.parametrize(("nones", "refused"), [(98, False), (99, True)])
def test_the_floor_holds_for_small_pickles(
    nones: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below 2 x MAX_OBJECTS bytes the floor is the budget: 100 objects at the limit."""
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", FLOOR)
    data = b"\x80\x02(" + b"N" * nones + b"l."  # nones + 2 objects
    machine = unpickler.Interpreter(data)
    assert machine.object_budget == FLOOR
    if refused:
        with pytest.raises(unpickler.PickleProblem, match=f"more than {FLOOR} objects"):
            machine.load()
    else:
        machine.load()


def test_the_budget_is_measured_against_the_files_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deflated data.pkl is measured by the bytes the file holds, not what it inflates
    to (as the memory budget is): a small file cannot buy a large object budget."""
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", FLOOR)
    data = _padded_list(200, 196)
    assert unpickler.Interpreter(data, file_size=300).object_budget == 150
    assert unpickler.Interpreter(data, file_size=10).object_budget == FLOOR


@pytest.mark.parametrize(("extra", "refused"), [(0, False), (1, True)])
def test_through_the_cli_at_the_limit_and_one_past(
    extra: int,
    refused: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A checkpoint {"w": tensor, "vocab": [None...]} read by `ls`: exit 0 at the
    limit, exit 3 one line one object past it."""
    from test_pytorch_hostile import EMPTY_DICT, MARK, SETITEMS, STOP, tensor, text

    def build(nones: int, pad: int) -> bytes:
        return (
            b"\x80\x02"
            + EMPTY_DICT
            + MARK
            + text("w")
            + tensor()
            + text("pad")
            + b"X"
            + struct.pack("<I", pad)
            + b"x" * pad
            + text("vocab")
            + MARK
            + b"N" * nones
            + b"l"
            + SETITEMS
            + STOP
        )

    # the objects made do not depend on the pad's length: count them once, unbounded
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", 10**9)
    probe = unpickler.Interpreter(build(1000, 0), persistent_load=_storage)
    probe.load()
    made = probe._made
    pad = 2 * made - len(build(1000, 0))  # the pickle's bytes are then twice its objects
    assert pad > 0
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", FLOOR)
    pickled = build(1000 + extra, pad)
    assert unpickler.Interpreter(pickled).object_budget == made
    path = torch_zip(tmp_path / "m.pt", pickled)
    code = main(["ls", str(path)])
    err = capsys.readouterr().err
    if refused:
        assert code == 3
        assert "objects" in one_error_line(err)
    else:
        assert code == 0, err


def _storage(pid: object) -> object:
    assert isinstance(pid, tuple)
    return unpickler.Storage(str(pid[2]), pid[1].dtype, "cpu", int(pid[4]))


@pytest.mark.slow
def test_five_million_small_entries_read_without_any_patch() -> None:
    """A list of 5,000,000 small ints (BININT1 and one memo entry each: 2 objects per 4
    bytes, what torch.save writes) passed 4 million: read now."""
    count = 2_500_000
    body = b"".join(b"K" + bytes([i % 256]) + b"q" + bytes([i % 256]) for i in range(count))
    data = b"\x80\x02(" + body + b"l."
    machine = unpickler.Interpreter(data)
    assert machine.object_budget > unpickler.MAX_OBJECTS
    assert len(machine.load()) == count  # type: ignore[arg-type]
