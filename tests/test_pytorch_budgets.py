"""Issue 22: budgets of the PyTorch reader that a readers' attack found missing.

1. Views that present more bytes than their storage holds (stride 0 from torch's `expand`,
   overlapping strides) are charged to the expansion budget (200 × the file + 64 MiB),
   refused with exit 3 naming the tensor before anything is read or OUT is made; real
   `torch.save` files with `expand`ed tensors still read, with torch's values.
2. The pickle interpreter charges what it builds by its memory cost, proportional to the
   pickle's size: millions of empty sets or dicts are refused within 300 MiB, and an
   allocation that fails under `prlimit --as` is exit 5 "out of memory", never 70.
3. Zip members with a symbolic-link (or device) mode, and a zip whose end record hides a
   second one in its comment, are refused with a precise line.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line
from test_pytorch_hostile import MARK, STOP, legacy, state, tensor, text, torch_zip

from clipcli.cli.entry import main
from clipcli.errors import InputError
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import reader as pytorch_reader
from clipcli.formats.pytorch import unpickler
from clipcli.system import address_space

VIEWS = REPO_ROOT / "tests" / "data" / "pytorch_views"
RSS_BUDGET = 300 << 20  # bytes of peak resident memory (docs/UNTRUSTED_INPUT.md)


def _expected() -> dict[str, np.ndarray]:
    with np.load(VIEWS / "expanded.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


# ------------------------------------------------------------------ 1. views


def _fixture_charge() -> int:
    """What the fixture's views present beyond their one storage, from torch's own shapes
    (the expected arrays) and the storage torch saved: 8 float32, 32 bytes."""
    return sum(a.size * 4 for a in _expected().values()) - 8 * 4


@pytest.mark.parametrize("name", ["expanded.pt", "expanded_legacy.pt"])
def test_torch_saved_expand_views_read_with_torchs_values(name: str) -> None:
    want = _expected()
    with open_reader(VIEWS / name) as reader:
        assert sorted(i.name for i in reader.infos) == sorted(want)
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info).astype(np.float64), want[info.name])


@pytest.mark.parametrize("name", ["expanded.pt", "expanded_legacy.pt"])
@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_view_charge_exactly_at_the_budget_and_one_past(
    name: str,
    slack: int,
    refused: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A budget of exactly what the views generate reads; one byte less is refused, naming
    the tensor whose view crossed it (the last one, in pickle order)."""
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 0)
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", _fixture_charge() + slack)
    assert main(["ls", str(VIEWS / name)]) == (3 if refused else 0)
    err = capsys.readouterr().err
    if refused:
        line = one_error_line(err)
        assert "tensor 'windows'" in line, line
        assert f"present {_fixture_charge()} bytes more than their storages hold" in line


@pytest.mark.parametrize("ratio_part", [0, 1])
def test_the_budget_grows_with_the_files_size(
    ratio_part: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 bytes per byte of file: the free bytes set so that the file's share brings the
    budget exactly to the charge (accepted), or one byte short of it (refused)."""
    path = VIEWS / "expanded.pt"
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 2)
    free = _fixture_charge() - 2 * path.stat().st_size - ratio_part
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", free)
    assert main(["ls", "-q", str(path)]) == (3 if ratio_part else 0)


def _stride0(path: Path, elements: int) -> Path:
    """One float32 storage element viewed as [elements] with stride [0] (the attack)."""
    pickled = state(w=tensor(size=(elements,), stride=(0,), numel=1))
    return torch_zip(path, pickled, {"0": np.float32(-5).tobytes()})


def _stride0_legacy(path: Path, elements: int) -> Path:
    obj = state(w=tensor(size=(elements,), stride=(0,), numel=1, legacy=True))[:-1] + STOP
    return legacy(path, obj, ["0"], (1).to_bytes(8, "little") + np.float32(-5).tobytes())


@pytest.mark.parametrize("make", [_stride0, _stride0_legacy])
@pytest.mark.parametrize("command", ["ls", "norms", "convert"])
def test_a_tiny_file_expanding_to_a_gibibyte_is_refused_before_out_exists(
    make: object, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make(tmp_path / "m.pt", 1 << 28)  # type: ignore[operator]
    assert path.stat().st_size < 1024
    out = tmp_path / "out.safetensors"
    argv = [command, str(path), *([str(out)] if command == "convert" else [])]
    assert main(argv) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "tensor 'w'" in line, line
    assert "expansion bomb" in line, line
    assert f"present {(1 << 30) - 4} bytes" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_a_hankel_window_claiming_a_thousand_times_its_storage_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 MiB of storage viewed as [2^20 - 1024, 1024] with strides [1, 1]: 4 GiB."""
    n = 1 << 20
    pickled = state(w=tensor(size=(n - 1024, 1024), stride=(1, 1), numel=n))
    path = torch_zip(tmp_path / "m.pt", pickled, {"0": bytes(4 * n)})
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert f"present {(n - 1024) * 1024 * 4 - 4 * n} bytes" in line, line


def test_a_storage_split_among_its_tensors_is_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused storage viewed by three disjoint tensors generates nothing: no budget at all
    still reads it."""
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 0)
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", 0)
    parts = {f"p{i}": tensor(offset=4 * i, size=(4,), numel=12) for i in range(3)}
    path = torch_zip(tmp_path / "m.pt", state(**parts), {"0": bytes(48)})
    assert main(["norms", "-q", str(path)]) == 0


# ------------------------------------------------------------------ 2. memory

EMPTY_SET, EMPTY_DICT, LIST = b"\x8f", b"}", b"l"
BOMB_OPCODES = 3_900_000  # the attack: 3.9 MB of one-byte opcodes


def _bomb(path: Path, opcode: bytes) -> Path:
    """A state dict with one real tensor and, beside it, a list of 3.9 M empty sets (or
    dicts): each one byte of pickle, each a 216-byte (64-byte) object."""
    junk = MARK + opcode * BOMB_OPCODES + LIST
    return torch_zip(path, state(w=tensor(), junk=junk))


def test_memory_charge_exactly_at_the_budget_and_one_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """One empty set costs a reference and what sys.getsizeof says a set takes."""
    cost = 8 + sys.getsizeof(set())
    data = b"\x80\x04" + EMPTY_SET + STOP
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 0)
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", cost)
    assert unpickler.Interpreter(data).load() == set()
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", cost - 1)
    with pytest.raises(unpickler.PickleProblem, match="bytes of memory"):
        unpickler.Interpreter(data).load()


@pytest.mark.parametrize("ratio_part", [0, 1])
def test_the_memory_budget_grows_with_the_pickles_size(
    ratio_part: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two bytes of budget per byte of pickle: the free bytes set so that the pickle's share
    brings the budget exactly to the charge, or one byte short of it."""
    data = b"\x80\x04" + EMPTY_SET + STOP
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 2)
    monkeypatch.setattr(
        unpickler, "MEMORY_FREE_BYTES", 8 + sys.getsizeof(set()) - 2 * len(data) - ratio_part
    )
    if ratio_part:
        with pytest.raises(unpickler.PickleProblem, match="bytes of memory"):
            unpickler.Interpreter(data).load()
    else:
        unpickler.Interpreter(data).load()


def test_appended_items_are_charged_by_what_the_container_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list filled by APPENDS is charged what the list took on (sys.getsizeof), besides
    each item and the MARK's own list: a budget of exactly that reads, one byte less not."""
    n = 1000
    data = b"\x80\x04]" + MARK + b"N" * n + b"e" + STOP
    grown = sys.getsizeof([None] * n) - sys.getsizeof([])  # list.extend of a tuple: exact
    cost = (8 + sys.getsizeof([])) * 2 + 8 * n + grown
    monkeypatch.setattr(unpickler, "MEMORY_RATIO", 0)
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", cost)
    assert unpickler.Interpreter(data).load() == [None] * n
    monkeypatch.setattr(unpickler, "MEMORY_FREE_BYTES", cost - 1)
    with pytest.raises(unpickler.PickleProblem, match="bytes of memory"):
        unpickler.Interpreter(data).load()


# Runs the command as its only child and writes that child's peak RSS (KiB) to argv[1].
_PEAK_PROBE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL)\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(done.returncode)\n"
)
CLIPCLI = [sys.executable, "-m", "clipcli"]


@pytest.mark.parametrize("opcode", [EMPTY_SET, EMPTY_DICT], ids=["sets", "dicts"])
@pytest.mark.parametrize("command", ["ls", "norms"])
def test_millions_of_empty_containers_are_refused_within_300_mib(
    opcode: bytes, command: str, tmp_path: Path
) -> None:
    """Before: ~1 GB of RSS and exit 0 (sets), or 1.1 GB and 21 s before exit 3 (dicts)."""
    path = _bomb(tmp_path / "m.pt", opcode)
    peak = tmp_path / "peak"
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, str(peak), *CLIPCLI, command, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr
    assert "bytes of memory" in one_error_line(done.stderr)
    assert int(peak.read_text()) << 10 < RSS_BUDGET


def _limited(mib: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["prlimit", f"--as={mib << 20}", *CLIPCLI, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("mib", [64, 96, 128, 160, 192, 300])
def test_under_an_address_space_limit_the_bomb_is_exit_5_or_3_never_70(
    mib: int, tmp_path: Path
) -> None:
    """Wherever the allocation fails (a MemoryError, or CPython's SystemError from a C call
    in the interpreter's loop), the run ends with one line: out of memory (5), or the
    budget's refusal (3) where the limit leaves room for the budget."""
    done = _limited(mib, "ls", str(_bomb(tmp_path / "m.pt", EMPTY_SET)))
    assert done.returncode in (3, 5), done.stderr
    line = one_error_line(done.stderr)
    assert ("out of memory" if done.returncode == 5 else "bytes of memory") in line, line
    assert "SystemError" not in line


_SYSTEM_ERROR_UNDER_A_LIMIT = """
import resource, sys
from clipcli.cli import boundary
if sys.argv[1] == "limited":
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
sys.exit(boundary.exit_code_for(SystemError("error return without exception set")))
"""


@pytest.mark.parametrize(("limited", "code"), [("limited", 5), ("unlimited", 70)])
def test_a_null_without_exception_is_out_of_memory_only_under_a_limit(
    limited: str, code: int
) -> None:
    """Without an address-space limit an allocation does not fail in Python (the kernel
    ends the process): the same SystemError is then a bug, exit 70."""
    done = subprocess.run(
        [sys.executable, "-c", _SYSTEM_ERROR_UNDER_A_LIMIT, limited],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_unlimit_address_space,
    )
    assert done.returncode == code, done.stderr
    line = one_error_line(done.stderr)
    assert line == "clipcli: error: out of memory" if code == 5 else "internal error" in line


def _unlimit_address_space() -> None:
    import resource

    for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        hard = resource.getrlimit(kind)[1]
        resource.setrlimit(kind, (hard, hard))


def test_refused_memory_says_no_to_other_system_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(address_space, "_limited", lambda: True)
    assert address_space.refused_memory(SystemError("error return without exception set"))
    assert not address_space.refused_memory(SystemError("bad argument to internal function"))


# ------------------------------------------------------------------ 2. the tree walk


def _tensor_stand_in() -> unpickler.Tensor:
    float32 = unpickler.TorchDtype("float32", 4)
    storage = unpickler.Storage("0", float32, "cpu", 1)
    return unpickler.Tensor(storage, 0, (1,), (1,), float32)


@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_tree_work_counts_container_items_at_the_limit_and_one_past(
    slack: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """{"m": [L] * 10}, L a list of 10 Nones (one memo entry, referenced 10 times): the root
    (1 + 1 item), the outer list (1 + 10), each L (1 + 10): 3 + 12 * 10 = 123 units. A
    count of values alone (22) let a million references to a million-item list walk a
    trillion items."""
    shared = [None] * 10
    monkeypatch.setattr(pytorch_reader, "MAX_VISITS", 123 + slack)
    tree = {"m": [shared] * 10}
    if refused:
        with pytest.raises(InputError, match="more than 122 values"):
            pytorch_reader.flatten(Path("m.pt"), tree)
    else:
        assert pytorch_reader.flatten(Path("m.pt"), tree)[1]["m.9"].startswith("[None")


@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_names_at_their_character_budget_and_one_past(
    slack: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long key under a memo-shared dict names every tensor beneath it: names are charged
    by their characters ("k.0.w" and "k.1.w": 10)."""
    monkeypatch.setattr(pytorch_reader, "MAX_NAME_CHARS", 10 + slack)
    shared = {"w": _tensor_stand_in()}
    tree = {"k": [shared, shared]}
    if refused:
        with pytest.raises(InputError, match="names take more than 9 characters"):
            pytorch_reader.flatten(Path("m.pt"), tree)
    else:
        named, _ = pytorch_reader.flatten(Path("m.pt"), tree)
        assert [name for name, _ in named] == ["k.0.w", "k.1.w"]


def test_a_long_tuple_key_is_shortened_in_names() -> None:
    key = ("x" * 10_000, 1)
    named, _ = pytorch_reader.flatten(Path("m.pt"), {key: _tensor_stand_in()})
    assert len(named[0][0]) == pytorch_reader.MAX_VALUE_TEXT


def test_a_pickle_of_a_state_dict_stays_within_the_budgets(tmp_path: Path) -> None:
    """A real-sized tree: 432 tensors named as an LLM's, each its own storage."""
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(432)]
    body = b"".join(text(n) + tensor(key=str(k), numel=4) for k, n in enumerate(names))
    pickled = b"\x80\x02}" + MARK + body + b"u" + STOP
    path = torch_zip(tmp_path / "m.pt", pickled, {str(k): bytes(16) for k in range(432)})
    assert main(["ls", "-q", str(path)]) == 0


# ------------------------------------------------------------------ 3. zip records


def _with_mode(path: Path, record: str, mode: int) -> Path:
    """A torch zip whose `record` carries the Unix file type `mode` (as unzip reads it)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", state(w=tensor()))
        archive.writestr("archive/byteorder", b"little")
        entry = zipfile.ZipInfo("archive/data/0")
        entry.external_attr = mode << 16
        archive.writestr(entry, bytes(16) if record == "archive/data/0" else b"")
    return path


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (stat.S_IFLNK | 0o777, "symbolic link"),
        (stat.S_IFIFO | 0o644, "FIFO"),
        (stat.S_IFCHR | 0o644, "character device"),
    ],
)
def test_a_record_with_a_special_unix_mode_is_refused(
    mode: int, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_mode(tmp_path / "m.pt", "archive/data/0", mode)
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert f"record 'archive/data/0' is a {kind}, not a file" in line, line


@pytest.mark.parametrize("mode", [0, stat.S_IFREG | 0o644, stat.S_IFREG | 0o600])
def test_a_record_of_a_plain_file_mode_reads(mode: int, tmp_path: Path) -> None:
    path = _with_mode(tmp_path / "m.pt", "archive/data/0", mode)
    assert main(["ls", "-q", str(path)]) == 0


def _with_comment(path: Path, comment: bytes) -> Path:
    torch_zip(path, state(w=tensor()))
    with zipfile.ZipFile(path, "a") as archive:
        archive.comment = comment
    return path


FAKE_END = b"PK\x05\x06" + bytes(18)  # an end record of an empty zip, with no comment


@pytest.mark.parametrize("name", ["m.pt", "m.npz", "m.bin"])
def test_an_end_record_hidden_in_the_comment_is_refused_precisely(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """zipfile (and unzip) take the fake record at the end: an empty zip, which made a
    torch.save file `an npz` (exit 3 saying the extension was wrong) or, named .npz, an
    empty npz (exit 0, its tensors unseen)."""
    path = _with_comment(tmp_path / name, FAKE_END)
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == []  # what Python's zip reader sees
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "2 end-of-central-directory records" in line, line


@pytest.mark.parametrize("comment", [b"", b"saved by hand", b"PK\x03\x04 and PK\x01\x02"])
def test_a_zip_comment_without_a_second_record_reads(comment: bytes, tmp_path: Path) -> None:
    path = _with_comment(tmp_path / "m.pt", comment)
    assert main(["ls", "-q", str(path)]) == 0


def test_a_bare_end_signature_in_the_comment_is_refused_precisely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signature whose record is garbage: zipfile takes it and fails (Bad offset for
    central directory), which made the file `an npz`; the record ending the file is real."""
    path = _with_comment(tmp_path / "m.pt", b"PK\x05\x06 is a signature, not a record")
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(path)
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "2 end-of-central-directory records" in line, line
