"""Hostile PyTorch files: pickles that run code under `pickle.load`, lie about their
storages, or blow a budget. Each is refused with exit 3 and one line, and nothing runs:
the payloads that would create a marker file under Python's own unpickler leave none.

The pickles are written here opcode by opcode (pickletools' table), not with pickle.dumps:
a hostile file is whatever bytes an attacker chooses."""

from __future__ import annotations

import pickle
import struct
import tarfile
import zipfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import pytest
from expect import one_error_line

from clipcli.cli.entry import main
from clipcli.formats.pytorch import unpickler

# ------------------------------------------------------------------ a pickle writer

STOP, REDUCE, BUILD, APPEND, SETITEM, SETITEMS = b".", b"R", b"b", b"a", b"s", b"u"
MARK, TUPLE, EMPTY_DICT, EMPTY_LIST, FALSE = b"(", b"t", b"}", b"]", b"\x89"


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def integer(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def call(function: bytes, *args: bytes) -> bytes:
    return function + tup(*args) + REDUCE


def hooks() -> bytes:
    return call(glob("collections", "OrderedDict"))


def storage(
    key: str = "0", numel: int = 4, kind: str = "FloatStorage", legacy: bool = False
) -> bytes:
    """A persistent id; the legacy stream's carries a sixth field (view metadata)."""
    view = b"N" if legacy else b""
    fields = (text("storage"), glob("torch", kind), text(key), text("cpu"), integer(numel))
    return tup(*fields, view) + b"Q"


def tensor(
    key: str = "0",
    offset: int = 0,
    size: tuple[int, ...] = (4,),
    stride: tuple[int, ...] = (1,),
    numel: int = 4,
    hook: bytes | None = None,
    legacy: bool = False,
) -> bytes:
    return call(
        glob("torch._utils", "_rebuild_tensor_v2"),
        storage(key, numel, legacy=legacy),
        integer(offset),
        tup(*map(integer, size)),
        tup(*map(integer, stride)),
        FALSE,
        hooks() if hook is None else hook,
    )


def state(**values: bytes) -> bytes:
    return (
        b"\x80\x02"
        + EMPTY_DICT
        + MARK
        + b"".join(text(k) + v for k, v in values.items())
        + SETITEMS
        + STOP
    )


def torch_zip(
    path: Path,
    pickled: bytes,
    storages: dict[str, bytes] | None = None,
    byteorder: bytes = b"little",
) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", byteorder)
        for key, data in (storages if storages is not None else {"0": bytes(16)}).items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", b"3\n")
    return path


def legacy(path: Path, obj: bytes, keys: list[str], tail: bytes) -> Path:
    head = b"".join(
        pickle.dumps(v, protocol=2)
        for v in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001})
    )
    path.write_bytes(head + obj + pickle.dumps(keys, protocol=2) + tail)
    return path


# ------------------------------------------------------------------ the corpus


def shell(marker: Path) -> bytes:
    return text(f"touch {marker}")


Make = Callable[[Path, Path], Path]  # (file to write, marker) -> the file


def zipped(make_pickle: Callable[[Path], bytes], **kwargs: object) -> Make:
    return lambda path, marker: torch_zip(path, make_pickle(marker), **kwargs)  # type: ignore[arg-type]


CORPUS: dict[str, tuple[Make, str]] = {
    "os_system_reduce": (
        zipped(lambda m: state(w=call(glob("os", "system"), shell(m)))),
        "global os.system, which is not on the allow-list",
    ),
    "posix_system": (
        zipped(lambda m: state(w=call(glob("posix", "system"), shell(m)))),
        "global posix.system",
    ),
    "builtins_eval": (
        zipped(lambda m: state(w=call(glob("builtins", "eval"), text(f"open('{m}', 'w')")))),
        "global builtins.eval",
    ),
    "builtins_exec": (
        zipped(lambda m: state(w=call(glob("builtins", "exec"), text(f"open('{m}', 'w')")))),
        "global builtins.exec",
    ),
    "getattr_chain": (
        zipped(
            lambda m: state(
                w=call(
                    call(
                        glob("builtins", "getattr"),
                        call(glob("builtins", "__import__"), text("os")),
                        text("system"),
                    ),
                    shell(m),
                )
            )
        ),
        "global builtins.getattr",
    ),
    "stack_global_os": (
        zipped(lambda m: state(w=text("os") + text("system") + b"\x93" + tup(shell(m)) + REDUCE)),
        "global os.system",
    ),
    "torch_load_itself": (
        zipped(lambda m: state(w=call(glob("torch", "load"), text(str(m))))),
        "global torch.load",
    ),
    "inst_subprocess": (
        zipped(lambda m: state(w=MARK + text("touch") + text(str(m)) + b"isubprocess\ncall\n")),
        "opcode INST is not allowed",
    ),
    "obj_of_an_allowed_class": (
        zipped(lambda _m: state(w=MARK + glob("collections", "OrderedDict") + b"o")),
        "opcode OBJ is not allowed",
    ),
    "newobj_of_an_allowed_class": (
        zipped(lambda _m: state(w=glob("collections", "OrderedDict") + b")\x81")),
        "opcode NEWOBJ is not allowed",
    ),
    "ext_code": (zipped(lambda _m: state(w=b"\x82\x01")), "opcode EXT1 is not allowed"),
    "build_on_a_tensor": (
        zipped(
            lambda _m: state(
                w=tensor() + EMPTY_DICT + text("__class__") + text("x") + SETITEM + BUILD
            )
        ),
        "sets the state of a Tensor (BUILD)",
    ),
    "nested_build": (
        zipped(lambda _m: state(w=hooks() + EMPTY_DICT + BUILD + tup(EMPTY_DICT) + BUILD)),
        "sets the state of a _OrderedDict (BUILD)",
    ),
    "reduce_on_a_dtype_from_the_memo": (
        zipped(lambda _m: state(w=glob("torch", "float32") + b"q\x00" + b"0" + b"h\x00" + b")R")),
        "calls a TorchDtype",
    ),
    "reduce_on_a_storage_class": (
        zipped(lambda _m: state(w=call(glob("torch", "FloatStorage"), integer(10**12)))),
        "calls a StorageClass",
    ),
    "memo_entry_never_set": (zipped(lambda _m: state(w=b"h\x07")), "memo entry 7"),
    "memo_makes_a_cycle": (
        zipped(lambda _m: state(w=EMPTY_LIST + b"q\x00" + b"h\x00" + APPEND)),
        "nests deeper than 64 levels (or refers to itself)",
    ),
    "deep_nesting": (
        zipped(lambda _m: state(w=EMPTY_LIST * 200 + APPEND * 199)),
        "nests deeper than 64 levels",
    ),
    "a_hundred_thousand_marks": (
        zipped(lambda _m: state(w=MARK * 100_000)),
        "nests more than 1000 marks",
    ),
    "millions_of_small_objects": (
        zipped(lambda _m: state(w=MARK + b"N" * (unpickler.MAX_OBJECTS + 1) + b"l")),
        f"makes more than {unpickler.MAX_OBJECTS} objects",
    ),
    "huge_long": (
        zipped(lambda _m: state(w=b"\x8b" + struct.pack("<i", 2**31 - 1))),
        "-byte integer",
    ),
    "string_of_2_to_the_63": (
        zipped(lambda _m: state(w=b"\x8d" + struct.pack("<Q", 2**63))),
        "truncated",
    ),
    "list_as_a_dict_key": (
        zipped(lambda _m: state(w=EMPTY_DICT + EMPTY_LIST + text("v") + SETITEM)),
        "uses a list as a dict key",
    ),
    "backward_hooks": (
        zipped(
            lambda _m: state(
                w=tensor(
                    hook=call(glob("collections", "OrderedDict"), tup(tup(text("k"), text("v"))))
                )
            )
        ),
        "backward hooks are not allowed",
    ),
    "storage_key_outside_the_zip": (
        zipped(lambda _m: state(w=tensor(key="../../etc/passwd"))),
        "is not a plain record name",
    ),
    "storage_key_without_a_record": (
        zipped(lambda _m: state(w=tensor(key="7"))),
        "has no record archive/data/7",
    ),
    "storage_record_of_another_size": (
        zipped(lambda _m: state(w=tensor(numel=8))),
        "holds 16 bytes; its tensors' storage declares 32",
    ),
    "size_past_numpy": (zipped(lambda _m: state(w=tensor(size=(2**64,)))), "past numpy's limit"),
    "sizes_whose_product_overflows": (
        zipped(lambda _m: state(w=tensor(size=(2**40, 2**40), stride=(2**40, 1)))),
        "past its storage of 16 bytes",
    ),
    "strides_run_past_the_storage": (
        zipped(lambda _m: state(w=tensor(size=(4,), stride=(5,)))),
        "past its storage of 16 bytes",
    ),
    "tensor_bigger_than_its_storage": (
        zipped(lambda _m: state(w=tensor(size=(100,)))),
        "ends at byte 400, past its storage of 16 bytes",
    ),
    "offset_past_the_storage": (
        zipped(lambda _m: state(w=tensor(offset=4, size=(1,)))),
        "ends at byte 20, past its storage",
    ),
    "negative_offset": (
        zipped(lambda _m: state(w=tensor(offset=-1))),
        "not a non-negative integer",
    ),
    "negative_stride": (zipped(lambda _m: state(w=tensor(stride=(-1,)))), "not a size"),
    "byteorder_middle": (
        zipped(lambda _m: state(w=tensor()), byteorder=b"middle"),
        "byteorder record",
    ),
    "two_tensors_one_name": (
        zipped(
            lambda _m: state(**{"a.b": tensor(), "a": EMPTY_DICT + text("b") + tensor() + SETITEM})
        ),
        "two tensors have one name",
    ),
    "storage_named_twice_with_another_dtype": (
        zipped(
            lambda _m: state(
                a=tensor(),
                b=call(
                    glob("torch._utils", "_rebuild_tensor_v2"),
                    storage(kind="DoubleStorage", numel=4),
                    integer(0),
                    tup(integer(1)),
                    tup(integer(1)),
                    FALSE,
                    hooks(),
                ),
            )
        ),
        "named twice with another dtype or size",
    ),
    "legacy_storage_count_lies": (
        lambda path, _m: legacy(
            path,
            b"\x80\x02" + EMPTY_DICT + text("w") + tensor(legacy=True) + SETITEM + STOP,
            ["0"],
            struct.pack("<q", 4000) + bytes(16),
        ),
        "holds 4000 elements; its tensors declare 4",
    ),
    "legacy_pickle_of_something_else": (
        lambda path, _m: _written(path, pickle.dumps({"w": 1}, protocol=2)),
        "is a pickle but not a PyTorch checkpoint",
    ),
    "sparse_2_gb_legacy_file": (
        lambda path, _m: _sparse(legacy(path, b"\x80\x02" + MARK, [], b""), 2 << 30, cut=True),
        "unknown opcode 0x00",
    ),
    "tar_member_escapes": (lambda path, _m: _tar(path, "../sys_info"), "is not one torch writes"),
}


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _sparse(path: Path, size: int, cut: bool = False) -> Path:
    """The file grown to `size` with a hole (zeros, no disk); `cut`: the last pickle (the
    storage keys) dropped first, so the object's pickle runs on into the zeros."""
    with path.open("r+b") as handle:
        if cut:
            handle.truncate(len(path.read_bytes()) - len(pickle.dumps([], protocol=2)))
        handle.truncate(size)
    return path


def _tar(path: Path, name: str) -> Path:
    with tarfile.open(path, "w:") as archive:
        info = tarfile.TarInfo(name)
        info.size = 1
        archive.addfile(info, BytesIO(b"x"))
    return path


def test_the_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_hostile_pytorch_is_refused_and_nothing_runs(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, says = CORPUS[case]
    marker = tmp_path / "MARKER"
    path = make(tmp_path / "pytorch_model.bin", marker)
    # the object budget costs seconds per run: one command is proof enough there
    commands = (
        [["norms"]] if case == "millions_of_small_objects" else [["ls"], ["norms"], ["convert"]]
    )
    for command in commands:
        argv = [*command, str(path)]
        if command == ["convert"]:
            argv.append(str(tmp_path / "out.safetensors"))
        assert main(argv) == 3, case
        line = one_error_line(capsys.readouterr().err)
        assert says in line, line
        assert len(line) < 400
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_the_code_payloads_do_run_under_pythons_own_unpickler(tmp_path: Path) -> None:
    """The corpus is real: Python's pickle would run it (which is why we never call it)."""
    marker = tmp_path / "MARKER"
    path = CORPUS["os_system_reduce"][0](tmp_path / "model.bin", marker)
    with zipfile.ZipFile(path) as archive:
        payload = archive.read("archive/data.pkl")
    pickle.loads(payload)  # on purpose: our own test payload
    assert marker.exists()


def test_nothing_is_imported_on_a_files_say_so(tmp_path: Path) -> None:
    """A global of a module not yet imported is refused without importing it."""
    import sys

    name = "clipcli_test_never_imported"
    path = torch_zip(tmp_path / "m.pt", state(w=call(glob(name, "run"), text("x"))))
    assert main(["ls", str(path)]) == 3
    assert name not in sys.modules


@pytest.mark.parametrize(
    ("depth", "refused"), [(unpickler.MAX_MARK_DEPTH, False), (unpickler.MAX_MARK_DEPTH + 1, True)]
)
def test_mark_depth_at_the_limit_and_one_past(depth: int, refused: bool) -> None:
    data = b"\x80\x02" + MARK * depth + TUPLE * depth + STOP
    machine = unpickler.Interpreter(data)
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="marks"):
            machine.load()
    else:
        machine.load()


@pytest.mark.parametrize(("count", "refused"), [(0, False), (1, True)])
def test_object_budget_at_the_limit_and_one_past(
    count: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unpickler, "MAX_OBJECTS", 100)
    # MARK + n NONEs + LIST: 1 + n + 1 objects; exactly 100 at n = 98
    data = b"\x80\x02" + MARK + b"N" * (98 + count) + b"l" + STOP
    machine = unpickler.Interpreter(data)
    if refused:
        with pytest.raises(unpickler.PickleProblem, match="objects"):
            machine.load()
    else:
        assert machine.load() == [None] * 98


@pytest.mark.parametrize(("depth", "refused"), [(64, False), (65, True)])
def test_tree_depth_at_the_limit_and_one_past(
    depth: int, refused: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the tensor sits `depth` levels down: {"k": {"k": ... tensor}}
    nested = tensor()
    for _ in range(depth - 1):
        nested = EMPTY_DICT + text("k") + nested + SETITEM
    path = torch_zip(tmp_path / "m.pt", state(k=nested))
    assert main(["ls", str(path)]) == (3 if refused else 0)
    capsys.readouterr()


@pytest.mark.parametrize(("numel", "refused"), [(4, False), (3, True)])
def test_view_ends_exactly_at_its_storage_and_one_past(
    numel: int, refused: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A view of 4 float32 ends at byte 16: a storage of 4 holds it, one of 3 does not."""
    path = torch_zip(tmp_path / "m.pt", state(w=tensor(numel=numel)), {"0": bytes(4 * numel)})
    assert main(["norms", str(path)]) == (3 if refused else 0)
    capsys.readouterr()
