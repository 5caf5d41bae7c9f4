"""A pickle interpreter of our own for PyTorch checkpoints: parsed, never executed.

Python's `pickle` resolves any global the stream names (importing its module) and calls
whatever REDUCE, BUILD, NEWOBJ or INST hand it: loading a stranger's `.bin` runs their
code. This module reads the opcodes itself (their meanings are pickletools' table) and
knows a short allow-list of globals, each mapped to a stand-in defined here; nothing is
imported and nothing outside this module is called on behalf of the file. Every other
global, every opcode that would call or construct an object of an unlisted class, and
every budget overrun raises PickleProblem (the reader turns it into exit 3, one line).

The allow-list (what `torch.save` of a state dict, a Lightning checkpoint or an optimizer
state uses; torch's own `weights_only` list is the model):
- torch._utils: _rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3,
  _rebuild_parameter, _rebuild_parameter_with_state
- torch: the typed storage classes (FloatStorage, BFloat16Storage, ...), the dtypes
  (torch.float32, torch.float8_e4m3fn, ...), Size, device; the legacy tensor types
  (FloatTensor, ...) as inert names (the tar layout's headers name them, nothing calls);
  torch.storage.UntypedStorage (with a dtype from _rebuild_tensor_v3)
- collections.OrderedDict; _codecs.encode (bytes in protocol 2);
  builtins set, frozenset, bytearray, complex (py2's __builtin__ too)
- plain containers and atoms: dict, list, tuple, str, bytes, int, float, bool, None;
- the inert data of Lightning and research checkpoints (numpy scalars, dtypes and arrays,
  argparse.Namespace, Lightning's AttributeDict, defaultdict, pathlib paths, datetime,
  slice): constructors of inert.py, the only classes NEWOBJ may make.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from clipcli.formats.pytorch import inert
from clipcli.formats.pytorch.problem import PickleProblem as PickleProblem
from clipcli.system import interrupts

# Budgets, per pickle. A real state dict costs about 10 objects per tensor; the reader
# caps tensors at 200,000, so these leave room for that and for bulky metadata.
# Objects: values made + stack slots + memo entries, all together, at most MAX_OBJECTS or
# one per PICKLE_BYTES_PER_OBJECT bytes of the pickle, whichever is more, so the cap follows
# what the user gave (a 7B model's pytorch_model.bin with a large vocabulary dict passes 4
# million). Real pickles make one object per 3-10 bytes (torch.save measured: a state dict
# 3.1, lists of ints 3.7, a str->int dict 6.2, floats 9); a stream of one-byte NONE or
# NEWTRUE opcodes makes one per byte, which is what the cap stops.
MAX_OBJECTS = 4_000_000
PICKLE_BYTES_PER_OBJECT = 2
MAX_MARK_DEPTH = 1_000  # MARKs open at once
MAX_LONG_BYTES = 32  # LONG1/LONG4 payload (the legacy magic number is 10 bytes)
MAX_LINE = 512  # GLOBAL's module and name lines, PUT/GET's text index
WORK_BETWEEN_CHECKS = 1 << 16  # objects made or steps of work between looks for a signal
# Memory: what the objects made take (sys.getsizeof, plus a reference to each), at most
# MEMORY_RATIO bytes per byte of pickle plus MEMORY_FREE_BYTES. One byte of pickle can
# make a 216-byte empty set: counting objects alone let a 3.9 MB pickle take 1 GB. A
# state dict's pickle costs 4-8 bytes of memory per byte (torch memoizes everything).
MEMORY_RATIO = 32
MEMORY_FREE_BYTES = 16 << 20
_REFERENCE = 8  # a slot on the stack, in a container or in the memo
# What counting a hashed container's keys by hash takes (Interpreter.insert), besides its
# entries (charged as they come): the table, its entry in the interpreter's, their slots.
_HASH_TABLE_BYTES = sys.getsizeof({}) + sys.getsizeof((None, None)) + 64


# ------------------------------------------------------------------ the stand-ins


class TorchDtype(NamedTuple):
    """torch.<dtype>: its numpy name and itemsize."""

    name: str  # numpy/ml_dtypes name: float32, bfloat16, float8_e4m3fn, ...
    itemsize: int


class StorageClass(NamedTuple):
    """torch.FloatStorage & co., or torch.storage.UntypedStorage (dtype uint8)."""

    dtype: TorchDtype
    untyped: bool


class Storage(NamedTuple):
    """A persistent id ('storage', class, key, location, numel[, view]): one storage.

    `numel` counts elements of `dtype` (bytes for an untyped storage). A legacy view
    (`view` = (view_key, offset, numel)) is a window of the root storage `key`."""

    key: str
    dtype: TorchDtype
    location: str
    numel: int
    view_offset: int = 0  # elements into the root storage (legacy views)
    view_key: str | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Tensor(NamedTuple):
    """A tensor: a strided view of a storage (offset, sizes, strides in `dtype` elements)."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: TorchDtype
    parameter: bool = False


class Device(NamedTuple):
    text: str


class _Callable(NamedTuple):
    """An allow-listed callable named by GLOBAL: which one (`kind`) and its full name."""

    kind: str
    name: str


class TensorType(NamedTuple):
    """torch.FloatTensor & co.: named (never called) by the legacy tar's tensor headers."""

    name: str


class _OrderedDict(dict[Any, Any]):
    """collections.OrderedDict's stand-in: a dict (ordered anyway) that BUILD may give
    attributes (a state dict's `_metadata`), kept apart and never applied."""

    attributes: dict[Any, Any] | None = None


# torch dtype globals -> (numpy name, itemsize). torch.float32 and torch.float are one.
_DTYPES: dict[str, TorchDtype] = {}
for _aliases, _numpy_name, _itemsize in (
    (("float32", "float"), "float32", 4),
    (("float64", "double"), "float64", 8),
    (("float16", "half"), "float16", 2),
    (("bfloat16",), "bfloat16", 2),
    (("float8_e4m3fn",), "float8_e4m3fn", 1),
    (("float8_e5m2",), "float8_e5m2", 1),
    (("float8_e4m3fnuz",), "float8_e4m3fnuz", 1),
    (("float8_e5m2fnuz",), "float8_e5m2fnuz", 1),
    (("float8_e8m0fnu",), "float8_e8m0fnu", 1),
    (("complex64", "cfloat"), "complex64", 8),
    (("complex128", "cdouble"), "complex128", 16),
    (("int64", "long"), "int64", 8),
    (("int32", "int"), "int32", 4),
    (("int16", "short"), "int16", 2),
    (("int8",), "int8", 1),
    (("uint8",), "uint8", 1),
    (("uint16",), "uint16", 2),
    (("uint32",), "uint32", 4),
    (("uint64",), "uint64", 8),
    (("bool",), "bool", 1),
):
    for _alias in _aliases:
        _DTYPES[_alias] = TorchDtype(_numpy_name, _itemsize)

_STORAGE_CLASSES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_UINT8 = _DTYPES["uint8"]
_TENSOR_TYPES = frozenset(name.replace("Storage", "Tensor") for name in _STORAGE_CLASSES)

_REBUILDS = {
    "_rebuild_tensor": "rebuild_v1",
    "_rebuild_tensor_v2": "rebuild_v2",
    "_rebuild_tensor_v3": "rebuild_v3",
    "_rebuild_parameter": "parameter",
    "_rebuild_parameter_with_state": "parameter_with_state",
}
_BUILTINS = {"set": "set", "frozenset": "frozenset", "bytearray": "bytearray", "complex": "complex"}


def resolve_global(module: str, name: str) -> object:
    """The stand-in for an allow-listed global; PickleProblem naming any other."""
    if module == "torch._utils" and name in _REBUILDS:
        return _Callable(_REBUILDS[name], f"{module}.{name}")
    if module == "torch":
        if name in _STORAGE_CLASSES:
            return StorageClass(_DTYPES[_STORAGE_CLASSES[name]], untyped=False)
        if name in _DTYPES:
            return _DTYPES[name]
        if name in _TENSOR_TYPES:
            return TensorType(name)
        if name == "Size":
            return _Callable("size", "torch.Size")
        if name == "device":
            return _Callable("device", "torch.device")
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return StorageClass(_UINT8, untyped=True)
    if (module, name) == ("collections", "OrderedDict"):
        return _Callable("ordered_dict", "collections.OrderedDict")
    if (module, name) == ("_codecs", "encode"):
        return _Callable("encode", "_codecs.encode")
    # Named in messages as the file spells it (`__builtin__.long`), known by what it is.
    spelled = f"{module}.{name}"
    if module in ("builtins", "__builtin__") and name in _BUILTINS:
        return _Callable(_BUILTINS[name], spelled)
    # The inert data of Lightning and research checkpoints (inert.py): constructors of
    # ours, and classes named only as their arguments.
    if module == "__builtin__":  # protocol 2 names int and str by their Python 2 names
        module, name = "builtins", inert.PYTHON2_NAMES.get(name, name)
    key = (module, name)
    if key in inert.GLOBALS:
        return _Callable(inert.GLOBALS[key], spelled)
    if key in inert.CLASSES:
        return inert.InertClass(spelled, f"{module}.{name}")
    raise PickleProblem(f"pickle names the global {module}.{name}, which is not on the allow-list")


# ------------------------------------------------------------------ the interpreter

_ATOMS = (str, bytes, int, float, bool, type(None), complex)


def _hashable(value: object) -> bool:
    """Dict keys and set items: atoms, or a tuple of atoms (nothing deep to hash)."""
    if isinstance(value, _ATOMS):
        return True
    return type(value) is tuple and all(isinstance(v, _ATOMS) for v in value)


def _index(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise PickleProblem(f"{what} is {_short(value)}, not a non-negative integer")
    return value


def _short(value: object) -> str:
    """A value named in a message without walking it (it may be huge or deep)."""
    if isinstance(value, inert.InertText):
        return f"a {value.kind}"
    if isinstance(value, _ATOMS):
        text = repr(value[:40] if isinstance(value, str | bytes) else value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


def _key_weight(key: object) -> int:
    """Work to compare a dict key or set item with another of the same hash once
    (_hashable checked it): text in full, a tuple item by item."""
    if isinstance(key, str | bytes):
        return max(1, len(key) >> 12)  # a compare reads 4 KiB in about a step's time
    if type(key) is tuple:
        return len(key) + sum(_key_weight(item) for item in key)
    return 1


class Interpreter:
    """Runs the opcodes of one pickle over `data` from `position` to its STOP.

    `persistent_load` turns a persistent id (an already-built value) into a value: the
    layouts say what a storage key means. Every value is one of the stand-ins above or a
    plain container/atom."""

    def __init__(
        self,
        data: bytes | memoryview,
        position: int = 0,
        persistent_load: Callable[[object], object] | None = None,
        file_size: int | None = None,
    ) -> None:
        self._data = memoryview(data)
        self._position = position
        self._persistent_load = persistent_load
        self._made = 0
        self._memory = 0
        self._steps = 0  # work counted: parts joined, key items hashed, equal keys compared
        # Measured against the bytes the file really holds: a deflated data.pkl of 13 KB
        # inflates to 26 MB, whose own size would allow 850 MB of objects.
        self._basis = len(self._data) if file_size is None else min(len(self._data), file_size)
        self._memory_budget = MEMORY_RATIO * self._basis + MEMORY_FREE_BYTES
        self.object_budget = max(MAX_OBJECTS, self._basis // PICKLE_BYTES_PER_OBJECT)
        # Per hashed container given a key whose hash the file chooses (insert): its id ->
        # (the container, kept so that the id stays its own; hash -> its keys of that hash).
        self._same_hash: dict[int, tuple[object, dict[int, int]]] = {}

    @property
    def position(self) -> int:
        """Where the last load() stopped (just past its STOP)."""
        return self._position

    def _count(self, made: object = None) -> None:
        """One more object (or stack slot, memo entry): `made`, whose memory is charged."""
        self._made += 1
        if not self._made & (WORK_BETWEEN_CHECKS - 1):  # a power of two
            interrupts.check()  # a long pickle: a signal must not wait for its end
        if self._made > self.object_budget:
            raise PickleProblem(
                f"pickle makes more than {self.object_budget} objects ({MAX_OBJECTS}, or one "
                f"per {PICKLE_BYTES_PER_OBJECT} of its {self._basis} bytes if more); refusing "
                "it (budget)"
            )
        self._charge(_REFERENCE + (sys.getsizeof(made) if made is not None else 0))

    def _charge(self, nbytes: int) -> None:
        self._memory += nbytes
        if self._memory > self._memory_budget:
            raise PickleProblem(self._over_budget("take"))

    def _over_budget(self, verb: str) -> str:
        return (
            f"pickle's objects {verb} more than {self._memory_budget} bytes of memory "
            f"({MEMORY_RATIO} times its {self._basis} bytes in the file plus "
            f"{MEMORY_FREE_BYTES >> 20} MiB); refusing it (budget)"
        )

    def reserve(self, nbytes: int, what: str) -> None:
        """Refuse, before it is made, a value of `nbytes` (sys.getsizeof's measure, its slot
        added here) that would not fit the memory budget: a small pickle referencing one
        big memo'd value many times asks for a value far bigger than itself. Nothing is
        charged: the value is, once made, by what it really takes."""
        if self._memory + nbytes + _REFERENCE > self._memory_budget:
            raise PickleProblem(f"{what}: " + self._over_budget("would take"))

    def work(self, steps: int) -> None:
        """Count `steps` of work against the object budget (each step is about as costly as
        making an object), acting on a signal at every WORK_BETWEEN_CHECKS steps."""
        before = self._steps
        self._steps += steps
        if self._steps > self.object_budget:
            raise PickleProblem(
                f"pickle asks for more than {self.object_budget} steps of work (parts "
                "joined, key items hashed or compared); refusing it (budget)"
            )
        if (before ^ self._steps) >= WORK_BETWEEN_CHECKS or steps >= WORK_BETWEEN_CHECKS:
            interrupts.check()

    def insert(self, target: dict[Any, Any] | set[Any], key: object, value: object = None) -> None:
        """Put `key` into `target` (with `value` for a dict), its cost counted as work first.

        Every key a pickle puts in a dict, set or frozenset comes here. CPython compares a
        key with each key already in the container whose hash is the same: text and bytes
        hash at random (per process), so for them only an equal key is the same hash, and
        is compared in full. Every other key's hash is the file's choice (the ints
        j*(2**61-1) all hash to 0, so do tuples of them; 1, 1.0 and True are one): for
        those the container's keys are counted by hash, and the keys already there with
        this key's hash are charged, before the insertion makes those compares. A run of
        colliding keys is quadratic work, which the budget then refuses; the work counted
        also acts on a pending signal."""
        if not _hashable(key):
            if isinstance(target, dict):
                raise PickleProblem(f"pickle uses {_short(key)} as a dict key")
            raise PickleProblem(f"pickle puts {_short(key)} in a set")
        if isinstance(key, str | bytes):
            self.work(1)
            size = len(target)
            self._put(target, key, value)
            if len(target) == size:  # an equal key was there: compared in full
                self.work(_key_weight(key))
            return
        if type(key) is tuple:  # its hash is not cached: computed again each time
            self.work(len(key))
        digest = hash(key)
        counts = self._hash_counts(target)
        same = counts.get(digest, 0)
        self.work(1 + (same * _key_weight(key) if same else 0))
        size = len(target)
        self._put(target, key, value)
        if len(target) != size:
            before = sys.getsizeof(counts)
            counts[digest] = same + 1
            # the table's growth, the hash kept (new) and its count (an int past 256)
            kept = sys.getsizeof(digest) if not same else 0
            kept += sys.getsizeof(same + 1) if same >= 256 else 0
            self._charge(sys.getsizeof(counts) - before + kept)

    @staticmethod
    def _put(target: dict[Any, Any] | set[Any], key: object, value: object) -> None:
        if isinstance(target, dict):
            target[key] = value
        else:
            target.add(key)

    def _hash_counts(self, target: object) -> dict[int, int]:
        """`target`'s keys counted by hash, made when its first key of a chosen hash comes."""
        entry = self._same_hash.get(id(target))
        if entry is None:
            entry = self._same_hash[id(target)] = (target, {})
            self._charge(_HASH_TABLE_BYTES)
        return entry[1]

    def forget(self, target: object) -> None:
        """`target` (a set copied into a frozenset) takes no more keys: its counts go."""
        self._same_hash.pop(id(target), None)

    def _reserve_references(self, count: int, what: str) -> None:
        """A tuple or list of `count` references (the stack's items), reserved before it is
        made: no more than it takes. Dicts, sets and what APPENDS/SETITEMS/ADDITEMS add
        hold items already charged on the stack, a few times their references at most,
        and are charged at once by what they take (equal items may take nothing)."""
        self.reserve(count * _REFERENCE, what)

    def _grown(self, target: object, before: int) -> None:
        """Charge what a container took on since it measured `before` bytes."""
        self._charge(sys.getsizeof(target) - before)

    def _take(self, n: int) -> bytes:
        end = self._position + n
        if n < 0 or end > len(self._data):
            raise PickleProblem("pickle is truncated (an opcode runs past the data)")
        piece = bytes(self._data[self._position : end])
        self._position = end
        return piece

    def _line(self) -> bytes:
        data = self._data
        start = self._position
        limit = min(len(data), start + MAX_LINE + 1)
        for index in range(start, limit):
            if data[index] == 0x0A:
                self._position = index + 1
                return bytes(data[start:index])
        raise PickleProblem(f"pickle has a text line longer than {MAX_LINE} bytes or no end")

    def load(self) -> object:  # one branch per opcode, read in one place
        stack: list[object] = []
        marks: list[list[object]] = []
        memo: dict[int, object] = {}
        count = self._count
        take = self._take
        while True:
            code = take(1)[0]
            if code == 0x80:  # PROTO
                if take(1)[0] > 5:
                    raise PickleProblem("pickle protocol is above 5")
            elif code == 0x95:  # FRAME: a length hint only
                take(8)
            elif code == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise PickleProblem("pickle stops with a malformed stack")
                self._same_hash.clear()  # no container of this pickle takes keys now
                return stack[0]
            elif code == 0x28:  # MARK
                if len(marks) >= MAX_MARK_DEPTH:
                    raise PickleProblem(f"pickle nests more than {MAX_MARK_DEPTH} marks")
                marks.append(stack)
                stack = []
                count(stack)
            elif code == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = self._pop_mark(marks)
            elif code == 0x31:  # POP_MARK
                stack = self._pop_mark(marks)
            elif code == 0x32:  # DUP
                stack.append(self._top(stack))
                count()  # a reference: the object is charged once
            # ---- atoms
            elif code == 0x4E:  # NONE
                stack.append(None)
                count()
            elif code == 0x88:  # NEWTRUE
                stack.append(True)
                count()
            elif code == 0x89:  # NEWFALSE
                stack.append(False)
                count()
            elif code == 0x4A:  # BININT
                stack.append(struct.unpack("<i", take(4))[0])
                count(stack[-1])
            elif code == 0x4B:  # BININT1
                stack.append(take(1)[0])
                count(stack[-1])
            elif code == 0x4D:  # BININT2
                stack.append(struct.unpack("<H", take(2))[0])
                count(stack[-1])
            elif code in (0x8A, 0x8B):  # LONG1, LONG4
                size = take(1)[0] if code == 0x8A else struct.unpack("<i", take(4))[0]
                if not 0 <= size <= MAX_LONG_BYTES:
                    raise PickleProblem(
                        f"pickle has a {size}-byte integer (limit {MAX_LONG_BYTES})"
                    )
                stack.append(int.from_bytes(take(size), "little", signed=True))
                count(stack[-1])
            elif code == 0x47:  # BINFLOAT
                stack.append(struct.unpack(">d", take(8))[0])
                count(stack[-1])
            elif code in (0x58, 0x8C, 0x8D):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                if code == 0x8C:
                    size = take(1)[0]
                elif code == 0x58:
                    size = struct.unpack("<I", take(4))[0]
                else:
                    size = struct.unpack("<Q", take(8))[0]
                try:
                    stack.append(take(size).decode("utf-8"))
                except UnicodeDecodeError:
                    raise PickleProblem("pickle holds a string that is not UTF-8") from None
                count(stack[-1])
            elif code in (0x42, 0x43, 0x8E):  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                if code == 0x43:
                    size = take(1)[0]
                elif code == 0x42:
                    size = struct.unpack("<I", take(4))[0]
                else:
                    size = struct.unpack("<Q", take(8))[0]
                stack.append(take(size))
                count(stack[-1])
            elif code in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str)
                size = take(1)[0] if code == 0x55 else struct.unpack("<i", take(4))[0]
                # Python 2's str: read as latin-1 text, as pickle's encoding='latin1' does.
                stack.append(take(size).decode("latin-1"))
                count(stack[-1])
            # ---- containers
            elif code == 0x29:  # EMPTY_TUPLE
                stack.append(())
                count(stack[-1])
            elif code == 0x5D:  # EMPTY_LIST
                stack.append([])
                count(stack[-1])
            elif code == 0x7D:  # EMPTY_DICT
                stack.append({})
                count(stack[-1])
            elif code == 0x8F:  # EMPTY_SET
                stack.append(set())
                count(stack[-1])
            elif code in (0x85, 0x86, 0x87):  # TUPLE1, TUPLE2, TUPLE3
                n = code - 0x84
                if len(stack) < n:
                    raise PickleProblem("pickle builds a tuple from an empty stack")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
                count(stack[-1])
            elif code == 0x74:  # TUPLE
                self._reserve_references(len(stack), "a tuple")
                items = tuple(stack)
                stack = self._pop_mark(marks)
                stack.append(items)
                count(stack[-1])
            elif code == 0x6C:  # LIST
                self._reserve_references(len(stack), "a list")
                items_list = list(stack)
                stack = self._pop_mark(marks)
                stack.append(items_list)
                count(stack[-1])
            elif code == 0x64:  # DICT
                items = tuple(stack)
                stack = self._pop_mark(marks)
                stack.append(self._dict_from(items, {}, self))
                count(stack[-1])
            elif code == 0x91:  # FROZENSET
                items = tuple(stack)
                stack = self._pop_mark(marks)
                stack.append(_frozen(self._set_from(items, set(), self), self))
                count(stack[-1])
            elif code == 0x61:  # APPEND
                value = self._pop(stack)
                target_list = self._list_of(self._top(stack))
                before = sys.getsizeof(target_list)
                target_list.append(value)
                self._grown(target_list, before)
            elif code == 0x65:  # APPENDS
                items = tuple(stack)
                stack = self._pop_mark(marks)
                target_list = self._list_of(self._top(stack))
                before = sys.getsizeof(target_list)
                target_list.extend(items)
                self._grown(target_list, before)
            elif code == 0x73:  # SETITEM
                value = self._pop(stack)
                key = self._pop(stack)
                target_dict = self._dict_of(self._top(stack))
                before = sys.getsizeof(target_dict)
                self._dict_from((key, value), target_dict, self)
                self._grown(target_dict, before)
            elif code == 0x75:  # SETITEMS
                items = tuple(stack)
                stack = self._pop_mark(marks)
                target_dict = self._dict_of(self._top(stack))
                before = sys.getsizeof(target_dict)
                self._dict_from(items, target_dict, self)
                self._grown(target_dict, before)
            elif code == 0x90:  # ADDITEMS
                items = tuple(stack)
                stack = self._pop_mark(marks)
                target = self._top(stack)
                if type(target) is not set:
                    raise PickleProblem(f"pickle adds set items to {_short(target)}")
                before = sys.getsizeof(target)
                self._set_from(items, target, self)
                self._grown(target, before)
            # ---- memo
            elif code in (0x71, 0x72, 0x70):  # BINPUT, LONG_BINPUT, PUT
                if code == 0x71:
                    index = take(1)[0]
                elif code == 0x72:
                    index = struct.unpack("<I", take(4))[0]
                else:
                    index = self._text_index()
                self._memoize(memo, index, self._top(stack))
            elif code == 0x94:  # MEMOIZE
                self._memoize(memo, len(memo), self._top(stack))
            elif code in (0x68, 0x6A, 0x67):  # BINGET, LONG_BINGET, GET
                if code == 0x68:
                    index = take(1)[0]
                elif code == 0x6A:
                    index = struct.unpack("<I", take(4))[0]
                else:
                    index = self._text_index()
                if index not in memo:
                    raise PickleProblem(f"pickle reads memo entry {index}, which was never set")
                stack.append(memo[index])
                count()  # one more reference to an object already charged
            # ---- globals, calls, objects
            elif code == 0x63:  # GLOBAL
                module = self._text(self._line())
                name = self._text(self._line())
                stack.append(resolve_global(module, name))
                count(stack[-1])
            elif code == 0x93:  # STACK_GLOBAL
                name_value = self._pop(stack)
                module_value = self._pop(stack)
                if type(module_value) is not str or type(name_value) is not str:
                    raise PickleProblem("pickle's STACK_GLOBAL names are not strings")
                stack.append(resolve_global(module_value, name_value))
                count(stack[-1])
            elif code == 0x52:  # REDUCE
                args = self._pop(stack)
                function = self._pop(stack)
                stack.append(self._reduce(function, args))
                count(stack[-1])
            elif code == 0x81:  # NEWOBJ: cls.__new__(cls, *args), for inert classes only
                args = self._pop(stack)
                cls = self._pop(stack)
                stack.append(self._newobj(cls, args))
                count(stack[-1])
            elif code == 0x62:  # BUILD
                state = self._pop(stack)
                self._build(self._top(stack), state)
            elif code == 0x51:  # BINPERSID
                pid = self._pop(stack)
                if self._persistent_load is None:
                    raise PickleProblem("pickle holds a persistent id where none is allowed")
                stack.append(self._persistent_load(pid))
                count(stack[-1])
            else:
                raise PickleProblem(_refused_opcode(code))
            if len(stack) > self.object_budget:
                raise PickleProblem(f"pickle's stack grows past {self.object_budget}; refusing it")

    # ---- helpers

    def _memoize(self, memo: dict[int, object], index: int, value: object) -> None:
        before = sys.getsizeof(memo)
        if index not in memo:
            self._count(index)  # the entry's key; the value is charged where it was made
        memo[index] = value
        self._grown(memo, before)

    @staticmethod
    def _pop_mark(marks: list[list[object]]) -> list[object]:
        if not marks:
            raise PickleProblem("pickle closes a MARK it never opened")
        return marks.pop()

    @staticmethod
    def _pop(stack: list[object]) -> object:
        if not stack:
            raise PickleProblem("pickle pops from an empty stack")
        return stack.pop()

    @staticmethod
    def _top(stack: list[object]) -> object:
        if not stack:
            raise PickleProblem("pickle reads from an empty stack")
        return stack[-1]

    @staticmethod
    def _text(raw: bytes) -> str:
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise PickleProblem("pickle names a global that is not ASCII") from None

    def _text_index(self) -> int:
        line = self._line()
        if not line.isdigit() or len(line) > 10:
            raise PickleProblem("pickle has a malformed memo index")
        return int(line)

    @staticmethod
    def _list_of(target: object) -> list[object]:
        if type(target) is not list:
            raise PickleProblem(f"pickle appends to {_short(target)}, not a list")
        return target

    @staticmethod
    def _dict_of(target: object) -> dict[Any, Any]:
        if type(target) not in (dict, _OrderedDict, inert.AttributeDict, inert.DefaultDict):
            raise PickleProblem(f"pickle sets items of {_short(target)}, not a dict")
        assert isinstance(target, dict)
        return target

    @staticmethod
    def _dict_from(
        items: tuple[object, ...], target: dict[Any, Any], room: inert.Room
    ) -> dict[Any, Any]:
        if len(items) % 2:
            raise PickleProblem("pickle sets dict items from an odd number of values")
        for index in range(0, len(items), 2):
            room.insert(target, items[index], items[index + 1])
        return target

    @staticmethod
    def _set_from(
        items: tuple[object, ...] | list[object], target: set[object], room: inert.Room
    ) -> set[object]:
        for item in items:
            room.insert(target, item)
        return target

    def _reduce(self, function: object, args: object) -> object:
        if type(function) is not _Callable:
            # Only our allow-listed callables are callable: a storage class, a dtype, a
            # container or any value REDUCE'd is refused by what it is, never called.
            what = function.name if type(function) is inert.InertClass else _short(function)
            raise PickleProblem(f"pickle calls {what}, which is not allowed")
        if type(args) is not tuple:
            raise PickleProblem(f"pickle calls {function.name} with {_short(args)}")
        return _CALLS[function.kind](function.name, args, self)

    def _newobj(self, cls: object, args: object) -> object:
        if type(cls) is not _Callable or cls.kind not in inert.NEWOBJ_KINDS:
            raise PickleProblem(f"pickle opcode NEWOBJ is not allowed on {_short(cls)}")
        if type(args) is not tuple:
            raise PickleProblem(f"pickle makes a {cls.name} with {_short(args)}")
        return _CALLS[cls.kind](cls.name, args, self)

    def _build(self, target: object, state: object) -> None:
        if inert.buildable(target):  # a numpy dtype or array, a Namespace: inert.py checks
            before = sys.getsizeof(target)
            inert.build(target, state, self)
            self._grown(target, before)
            return
        # BUILD sets attributes (or calls __setstate__): only an OrderedDict's attributes
        # (a state dict's _metadata) are accepted, kept aside, never applied to anything.
        if type(target) is _OrderedDict and (state is None or type(state) is dict):
            if target.attributes is None:  # the instance's attribute dict, made once
                self._charge(sys.getsizeof(vars(_OrderedDict())) + _REFERENCE)
            target.attributes = state if state is not None else {}
            return
        raise PickleProblem(f"pickle sets the state of {_short(target)} (BUILD), not allowed")


_OPCODE_NAMES = {
    0x69: "INST",
    0x6F: "OBJ",
    0x92: "NEWOBJ_EX",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x96: "BYTEARRAY8",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
    0x50: "PERSID",
    0x49: "INT",
    0x4C: "LONG",
    0x53: "STRING",
    0x56: "UNICODE",
    0x46: "FLOAT",
}


def _refused_opcode(code: int) -> str:
    name = _OPCODE_NAMES.get(code)
    if name is None:
        return f"pickle has an unknown opcode 0x{code:02x}"
    return f"pickle opcode {name} is not allowed in a checkpoint"


# ------------------------------------------------------------------ the allowed calls


def _arity(name: str, args: tuple[object, ...], low: int, high: int | None = None) -> None:
    high = low if high is None else high
    if not low <= len(args) <= high:
        raise PickleProblem(f"{name} called with {len(args)} arguments")


def _ints(name: str, value: object, what: str) -> tuple[int, ...]:
    if type(value) is not tuple:
        raise PickleProblem(f"{name}: {what} is {_short(value)}, not a tuple")
    for item in value:
        if type(item) is not int or item < 0:
            raise PickleProblem(f"{name}: {what} holds {_short(item)}, not a size")
    return value


def _tensor(
    name: str, storage: object, offset: object, size: object, stride: object, dtype: object
) -> Tensor:
    if type(storage) is not Storage:
        raise PickleProblem(f"{name}: the storage is {_short(storage)}, not a storage")
    shape = _ints(name, size, "size")
    strides = _ints(name, stride, "stride")
    if len(shape) != len(strides):
        raise PickleProblem(f"{name}: {len(shape)} sizes but {len(strides)} strides")
    if type(dtype) is not TorchDtype:
        raise PickleProblem(f"{name}: the dtype is {_short(dtype)}")
    return Tensor(storage, _index(offset, f"{name}: storage offset"), shape, strides, dtype)


def _empty_hooks(name: str, hooks: object) -> None:
    if not (isinstance(hooks, dict) and not hooks) and hooks is not None:
        raise PickleProblem(f"{name}: backward hooks are not allowed")


def _rebuild_v1(name: str, args: tuple[object, ...], _room: inert.Room) -> Tensor:
    _arity(name, args, 4)
    storage = args[0]
    dtype = storage.dtype if type(storage) is Storage else None
    return _tensor(name, args[0], args[1], args[2], args[3], dtype)


def _rebuild_v2(name: str, args: tuple[object, ...], room: inert.Room) -> Tensor:
    _arity(name, args, 6, 7)
    _empty_hooks(name, args[5])
    return _rebuild_v1(name, args[:4], room)


def _rebuild_v3(name: str, args: tuple[object, ...], _room: inert.Room) -> Tensor:
    _arity(name, args, 7, 8)
    _empty_hooks(name, args[5])
    storage = args[0]
    if type(storage) is Storage and not (storage.dtype is _UINT8 or storage.dtype == args[6]):
        raise PickleProblem(f"{name}: a typed storage of another dtype than the tensor's")
    return _tensor(name, storage, args[1], args[2], args[3], args[6])


def _parameter(name: str, args: tuple[object, ...], _room: inert.Room) -> Tensor:
    _arity(name, args, 3)
    _empty_hooks(name, args[2])
    if type(args[0]) is not Tensor:
        raise PickleProblem(f"{name}: the data is {_short(args[0])}, not a tensor")
    return args[0]._replace(parameter=True)


def _parameter_with_state(name: str, args: tuple[object, ...], room: inert.Room) -> Tensor:
    _arity(name, args, 4)
    if not (args[3] is None or (isinstance(args[3], dict | tuple) and not args[3])):
        raise PickleProblem(f"{name}: a parameter's extra state is not allowed")
    return _parameter(name, args[:3], room)


def _size(name: str, args: tuple[object, ...], _room: inert.Room) -> tuple[int, ...]:
    _arity(name, args, 0, 1)
    return _ints(name, args[0] if args else (), "size")


# torch.device as c10/core/Device.cpp takes it (torch 2.x): a type of its list, then
# optionally ':' and an index written without sign or leading zero; an index passed apart
# must be an int (not a bool), not negative, and not come with one in the text. Its
# DeviceIndex is an int8: torch wraps a larger index (cuda:128 is not cuda:128), so an
# index past DEVICE_INDEX_MAX is refused.
_DEVICE_TYPES = frozenset({
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
})  # fmt: skip
_DEVICE_TEXT = re.compile(r"([a-zA-Z_]+)(?::([1-9][0-9]*|0))?")
DEVICE_INDEX_MAX = 127


def _device(name: str, args: tuple[object, ...], _room: inert.Room) -> Device:
    _arity(name, args, 1, 2)
    kind, *index = args
    if type(kind) is not str or any(i is not None and type(i) is not int for i in index):
        raise PickleProblem(f"{name}: malformed device")
    parsed = _DEVICE_TEXT.fullmatch(kind) if len(kind) <= 64 else None
    if parsed is None:
        raise PickleProblem(f"{name}: {_short(kind)} is not a device (torch refuses it)")
    device_type, written = parsed.groups()
    if device_type not in _DEVICE_TYPES:
        raise PickleProblem(f"{name}: {_short(device_type)} is not a device type torch knows")
    if index and written is not None:
        raise PickleProblem(f"{name}: an index in the text and one apart (torch refuses it)")
    number = index[0] if index else None if written is None else int(written)
    if not isinstance(number, int):
        return Device(device_type)
    if not 0 <= number <= DEVICE_INDEX_MAX:
        raise PickleProblem(
            f"{name}: device index {_short(number)} is not from 0 to {DEVICE_INDEX_MAX}"
        )
    return Device(f"{device_type}:{number}")


def _ordered_dict(name: str, args: tuple[object, ...], room: inert.Room) -> _OrderedDict:
    _arity(name, args, 0, 1)
    made = _OrderedDict()
    if args:
        pairs = args[0]
        if type(pairs) not in (list, tuple):
            raise PickleProblem(f"{name}: made from {_short(pairs)}")
        assert isinstance(pairs, list | tuple)
        # A memo reference may repeat a long list of pairs: each dict is reserved first.
        room.reserve(
            inert.container_cost(_OrderedDict(), len(pairs), inert.DICT_ITEM_BYTES),
            f"{name} of {len(pairs)} items",
        )
        room.work(len(pairs))
        for pair in pairs:
            if type(pair) not in (list, tuple) or len(pair) != 2:
                raise PickleProblem(f"{name}: an item that is not a pair")
            Interpreter._dict_from(tuple(pair), made, room)
    return made


def _encode(name: str, args: tuple[object, ...], room: inert.Room) -> bytes:
    # Protocol 2 spells bytes as _codecs.encode(text, 'latin1').
    _arity(name, args, 1, 2)
    text = args[0]
    encoding = args[1] if len(args) == 2 else "utf-8"
    if type(text) is not str or type(encoding) is not str:
        # `_codecs.encode` of a path, a date or bytes is a TypeError in Python
        raise PickleProblem(f"{name}: made from {_short(text)}, not text")
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise PickleProblem(f"{name}: only text to latin1 or utf-8 is allowed")
    # A memo reference may repeat a long text for 2 bytes of pickle: what the bytes take is
    # reserved before they are made (a character is 1 byte in latin-1 or ASCII, <= 4).
    width = 1 if text.isascii() or encoding.startswith("latin") else 4
    room.reserve(sys.getsizeof(b"") + width * len(text), f"{name} of {len(text)} characters")
    try:
        return text.encode(encoding)
    except UnicodeEncodeError:
        raise PickleProblem(f"{name}: text not encodable as {encoding}") from None


def _set_items_of(name: str, args: tuple[object, ...], room: inert.Room) -> set[object]:
    _arity(name, args, 0, 1)
    items = args[0] if args else []
    if type(items) not in (list, tuple):
        raise PickleProblem(f"{name}: made from {_short(items)}")
    assert isinstance(items, list | tuple)
    # A memo reference may repeat a long list: the set's table is reserved first.
    room.reserve(
        inert.container_cost(set(), len(items), inert.SET_ITEM_BYTES),
        f"{name} of {len(items)} items",
    )
    return Interpreter._set_from(items, set(), room)


def _frozen(made: set[object], room: inert.Room) -> frozenset[object]:
    """A frozenset of the set `made` (copied with its hashes: no compares), reserved first."""
    room.forget(made)
    room.reserve(sys.getsizeof(made), f"a frozenset of {len(made)} items")
    return frozenset(made)


def _set(name: str, args: tuple[object, ...], room: inert.Room) -> set[object]:
    return _set_items_of(name, args, room)


def _frozenset(name: str, args: tuple[object, ...], room: inert.Room) -> frozenset[object]:
    return _frozen(_set_items_of(name, args, room), room)


def _bytearray(name: str, args: tuple[object, ...], _room: inert.Room) -> bytes:
    _arity(name, args, 0, 1)
    if not args:
        return b""
    data = args[0]
    if type(data) is not bytes:
        # bytearray(int) would allocate that many bytes: only bytes are accepted (kept,
        # not copied: a memo reference repeating them costs nothing more).
        raise PickleProblem(f"{name}: made from {_short(data)}")
    return data


def _complex(name: str, args: tuple[object, ...], _room: inert.Room) -> complex:
    _arity(name, args, 1, 2)
    if any(type(a) not in (int, float) for a in args):
        raise PickleProblem(f"{name}: made from something other than numbers")
    real = float(args[0])  # type: ignore[arg-type]
    imag = float(args[1]) if len(args) == 2 else 0.0  # type: ignore[arg-type]
    return complex(real, imag)


_CALLS: dict[str, inert.Constructor] = {
    "rebuild_v1": _rebuild_v1,
    "rebuild_v2": _rebuild_v2,
    "rebuild_v3": _rebuild_v3,
    "parameter": _parameter,
    "parameter_with_state": _parameter_with_state,
    "size": _size,
    "device": _device,
    "ordered_dict": _ordered_dict,
    "encode": _encode,
    "set": _set,
    "frozenset": _frozenset,
    "bytearray": _bytearray,
    "complex": _complex,
    **inert.CALLS,
}


def storage_from_pid(pid: object, legacy: bool) -> tuple[StorageClass, str, str, int, object]:
    """(class, key, location, numel, view metadata) of a persistent id, checked."""
    if type(pid) is not tuple or not pid or pid[0] != "storage":
        raise PickleProblem(f"persistent id {_short(pid)} is not a storage")
    expected = 6 if legacy else 5
    if len(pid) != expected:
        raise PickleProblem(f"a storage persistent id has {len(pid)} fields, not {expected}")
    storage_class, key, location, numel = pid[1:5]
    if type(storage_class) is not StorageClass:
        raise PickleProblem(f"storage class is {_short(storage_class)}")
    if type(key) is not str or type(location) not in (str, Device):
        raise PickleProblem("a storage key or location is not text")
    where = location.text if isinstance(location, Device) else location
    assert isinstance(where, str)
    return storage_class, key, where, _index(numel, "a storage's size"), pid[5] if legacy else None
