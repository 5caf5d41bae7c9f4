"""Inert stand-ins for the other objects real checkpoints carry: built from checked
arguments into plain values, never by importing or calling the class a pickle names.

A Lightning checkpoint holds more than tensors: its `hyper_parameters` are an
`argparse.Namespace` or Lightning's `AttributeDict`, they hold numpy scalars and arrays,
`pathlib` paths, dates, `defaultdict`s and slices. `pickle` rebuilds each by calling the
class the stream names; here each allowed global maps to a constructor of this module that
checks its arguments (types, sizes, byte counts) and makes plain Python values:

- `argparse.Namespace`, Lightning's `AttributeDict` -> a dict of their own class (Namespace,
  AttributeDict: marked as what they were); `collections.defaultdict` -> a DefaultDict
  holding its factory's name only (builtins list/dict/set/... , never called);
- `numpy.core.multiarray.scalar` (numpy 2: `numpy._core.multiarray`) with a `numpy.dtype`
  -> the Python number its bytes hold, decoded by our own table of type codes with the byte
  order the dtype's state gives (bool, ints, uints, float16/32/64, complex64/128);
- `numpy.core.multiarray._reconstruct` of `numpy.ndarray` -> NumpyArray: dtype, shape and
  its first values, shown by `ls` as metadata (not a tensor: it has no storage in the file
  to read lazily, measure or clip in place, and research code keeps such arrays for
  bookkeeping: seeds, label maps, sample indices);
- `pathlib.PosixPath`/`WindowsPath`/`PurePosixPath`/`PureWindowsPath` -> PathText;
- `datetime.datetime`/`date`/`time` -> StampText, `builtins.slice` -> SliceText (text
  of a type of its own, so that a constructor taking text refuses it as the real one
  refuses a path, a date or a slice), `timedelta`/`timezone` -> Duration/Zone.

Every constructor gets the interpreter's budgets (`Room`): it computes the size of what it
will make from its arguments' sizes and reserves it before making it (a memo reference
costs 2 bytes of pickle, however big the value it repeats), and counts long work, which
also acts on a pending signal.

Everything else stays refused by the interpreter (unpickler.resolve_global).
"""

from __future__ import annotations

import math
import pathlib
import struct
import sys
from collections.abc import Callable
from typing import Any, Protocol

from clipcli.formats.pytorch.problem import PickleProblem

MAX_ARRAY_RANK = 64
SHOWN_ITEMS = 8  # values of an array kept for `ls`; the rest only counted


class Room(Protocol):
    """The interpreter's budgets, as a constructor spends them."""

    def reserve(self, nbytes: int, what: str) -> None:
        """Refuse (PickleProblem) unless `nbytes` more of memory fit; charges nothing (what
        is made is charged once made)."""

    def work(self, steps: int) -> None:
        """Count `steps` of work (parts joined, items hashed); acts on a pending signal."""

    def insert(self, target: dict[Any, Any] | set[Any], key: object, value: object = None) -> None:
        """Put `key` (and `value`) into a dict or set, its compares counted as work first:
        every insertion into a hashed container goes through this one rule."""

    def forget(self, target: object) -> None:
        """`target` takes no more keys (a set about to be frozen)."""


class InertText(str):
    """Text a stand-in shows, of a type of its own: the constructors that take text take
    `str` exactly, so a path, a date or a slice passed where text goes is refused, as the
    real constructor refuses it (TypeError) and torch.load would fail."""

    __slots__ = ()
    kind = "text"


class PathText(InertText):
    """pathlib.PosixPath/PurePosixPath: the path's text."""

    __slots__ = ()
    kind = "pathlib path"


class WindowsPathText(PathText):
    """pathlib.WindowsPath/PureWindowsPath: the path's text."""

    __slots__ = ()


class StampText(InertText):
    """datetime.datetime/date/time: its ISO text."""

    __slots__ = ()
    kind = "datetime value"


class SliceText(InertText):
    """builtins.slice: `slice(start, stop, step)`."""

    __slots__ = ()
    kind = "slice"


def kind_of(value: object) -> str:
    """What a value is, in a message: a stand-in by what it stands for."""
    return value.kind if isinstance(value, InertText) else type(value).__name__


def text_cost(length: int, ascii_only: bool, made: type[str] = str) -> int:
    """sys.getsizeof of a text of `length` characters (4 bytes each unless ASCII: an upper
    bound, without reading the characters)."""
    return sys.getsizeof(made()) + length * (1 if ascii_only else 4)


# Upper bounds on what a set or dict made item by item takes per item (sys.getsizeof,
# CPython 3.11-3.13): a set's table grows 4x at 60% full, up to 8 slots of 16 bytes per
# item; a dict's entries and indices, measured at most 60 bytes per item.
SET_ITEM_BYTES = 128
DICT_ITEM_BYTES = 64


def container_cost(empty: object, items: int, per_item: int) -> int:
    """An upper bound on sys.getsizeof of `empty`'s kind once it holds `items` items."""
    return sys.getsizeof(empty) + per_item * items


class Described:
    """A stand-in that `ls` shows by its text."""

    def text(self) -> str:
        raise NotImplementedError


class InertClass(Described):
    """A class named only as an argument (`numpy.ndarray` for `_reconstruct`, `builtins.list`
    as a defaultdict's factory): never called, never built."""

    __slots__ = ("key", "name")

    def __init__(self, name: str, key: str | None = None) -> None:
        self.name = name  # as the file spells it (`__builtin__.long`), for messages
        self.key = name if key is None else key  # what it is (`builtins.int`), for checks

    def text(self) -> str:
        return self.name


# numpy type code (`dtype.str` without its order) -> (struct format, itemsize, numpy name)
_NUMPY_CODES: dict[str, tuple[str, int, str]] = {
    "b1": ("?", 1, "bool"),
    "i1": ("b", 1, "int8"),
    "u1": ("B", 1, "uint8"),
    "i2": ("h", 2, "int16"),
    "u2": ("H", 2, "uint16"),
    "i4": ("i", 4, "int32"),
    "u4": ("I", 4, "uint32"),
    "i8": ("q", 8, "int64"),
    "u8": ("Q", 8, "uint64"),
    "f2": ("e", 2, "float16"),
    "f4": ("f", 4, "float32"),
    "f8": ("d", 8, "float64"),
    "c8": ("ff", 8, "complex64"),
    "c16": ("dd", 16, "complex128"),
}


class NumpyDtype(Described):
    """`numpy.dtype(code)`; its byte order comes from the BUILD that follows (once)."""

    __slots__ = ("code", "order")

    def __init__(self, code: str) -> None:
        self.code = code
        self.order: str | None = None  # '<', '>' or '|' once built

    @property
    def itemsize(self) -> int:
        return _NUMPY_CODES[self.code][1]

    @property
    def name(self) -> str:
        return _NUMPY_CODES[self.code][2]

    def decode(self, raw: bytes, count: int) -> list[object]:
        """The first `count` values of `raw` (checked to hold them), in this byte order."""
        if self.order is None and self.itemsize > 1:
            raise PickleProblem(f"numpy.dtype {self.code} is used before its byte order is set")
        fmt, itemsize, name = _NUMPY_CODES[self.code]
        order = ">" if self.order == ">" else "<"
        values = struct.unpack(order + fmt * count, raw[: itemsize * count])
        if name.startswith("complex"):
            return [complex(values[i], values[i + 1]) for i in range(0, len(values), 2)]
        return list(values)

    def text(self) -> str:
        return f"numpy.dtype {self.name}" + (" big-endian" if self.order == ">" else "")


class NumpyArray(Described):
    """A numpy array as metadata: dtype, shape, and its first SHOWN_ITEMS values."""

    __slots__ = ("dtype", "fortran", "shape", "shown")

    def __init__(self) -> None:
        self.dtype: NumpyDtype | None = None  # None until BUILD gives the state
        self.shape: tuple[int, ...] = ()
        self.fortran = False
        self.shown: list[object] = []

    def text(self) -> str:
        if self.dtype is None:
            return "a numpy array"
        numel = math.prod(self.shape)
        values = ", ".join(repr(v) for v in self.shown)
        more = f", ... ({numel} items)" if numel > len(self.shown) else ""
        order = " (Fortran order)" if self.fortran and len(self.shape) > 1 else ""
        return f"numpy {self.dtype.name} array {list(self.shape)}{order}: [{values}{more}]"


class Duration(Described):
    """datetime.timedelta(days, seconds, microseconds)."""

    __slots__ = ("days", "microseconds", "seconds")

    def __init__(self, days: int, seconds: int, microseconds: int) -> None:
        self.days, self.seconds, self.microseconds = days, seconds, microseconds

    def text(self) -> str:
        return f"timedelta(days={self.days}, seconds={self.seconds}, us={self.microseconds})"


class Zone(Described):
    """datetime.timezone: a fixed offset, kept as its ISO text (`+01:00`), and its name
    if it was given one (`timezone(timedelta(hours=1), 'CET')`), shown as str() shows it."""

    __slots__ = ("name", "offset")

    def __init__(self, offset: str, name: str | None = None) -> None:
        self.offset = offset
        self.name = name

    def text(self) -> str:
        return f"timezone {self.offset if self.name is None else self.name}"


class Namespace(dict[Any, Any]):
    """argparse.Namespace: its attributes as dict items (BUILD sets them)."""


class AttributeDict(dict[Any, Any]):
    """Lightning's AttributeDict (a dict subclass): filled by SETITEMS as a dict is."""


class DefaultDict(dict[Any, Any]):
    """collections.defaultdict: a dict; its factory kept by name, never called."""

    factory: str | None = None


# ------------------------------------------------------------------ argument checks


def _arity(name: str, args: tuple[object, ...], low: int, high: int | None = None) -> None:
    high = low if high is None else high
    if not low <= len(args) <= high:
        raise PickleProblem(f"{name} called with {len(args)} arguments")


def _raw_length(name: str, value: object, what: str) -> int:
    """The byte count of bytes as protocol 2 spells them (`_codecs.encode` made bytes) or
    Python 2's str (latin-1 text: one byte per character), read without copying them."""
    if type(value) is bytes or type(value) is str:
        return len(value)
    raise PickleProblem(f"{name}: {what} is a {kind_of(value)}, not bytes")


def _raw_bytes(name: str, value: object, what: str, length: int | None = None) -> bytes:
    """The first `length` bytes (all of them if None) of bytes or Python 2's str: a memo
    reference may hand a huge string where a few bytes are read, so only those are copied."""
    _raw_length(name, value, what)
    assert isinstance(value, bytes | str)
    piece = value if length is None else value[:length]
    if isinstance(piece, bytes):
        return piece
    try:
        return piece.encode("latin-1")
    except UnicodeEncodeError:
        raise PickleProblem(f"{name}: {what} is text, not bytes") from None


def _small_int(name: str, value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise PickleProblem(f"{name}: {what} is not an integer from {low} to {high}")
    return value


# ------------------------------------------------------------------ the constructors


def _numpy_dtype(name: str, args: tuple[object, ...], _room: Room) -> NumpyDtype:
    _arity(name, args, 1, 3)
    code = args[0]
    if type(code) is not str or code not in _NUMPY_CODES:
        shown = code if type(code) is str and len(code) <= 16 else kind_of(code)
        raise PickleProblem(f"{name}: type {shown!r} is not a plain numeric numpy dtype")
    if any(type(flag) not in (bool, int) for flag in args[1:]):
        raise PickleProblem(f"{name}: its flags are not booleans")
    return NumpyDtype(code)


def _build_dtype(target: NumpyDtype, state: object, _room: Room) -> None:
    # numpy's state: (version, byte order, subarray, names, fields, elsize, alignment,
    # flags); a plain numeric dtype has no subarray, names nor fields.
    if target.order is not None:
        raise PickleProblem("numpy.dtype: its state is set twice")
    if (
        type(state) is not tuple
        or len(state) != 8
        or state[0] not in (3, 4)
        or type(state[1]) is not str
        or state[1] not in ("<", ">", "|")
        or state[2:5] != (None, None, None)
        or any(type(v) is not int for v in state[5:])
    ):
        raise PickleProblem("numpy.dtype: a state other than a plain numeric dtype's")
    if state[1] == "|" and target.itemsize > 1:
        raise PickleProblem(f"numpy.dtype {target.code}: no byte order for a multi-byte type")
    target.order = state[1]


def _built_dtype(name: str, dtype: object) -> NumpyDtype:
    if type(dtype) is not NumpyDtype:
        raise PickleProblem(f"{name}: the dtype is a {kind_of(dtype)}, not a numpy.dtype")
    return dtype


def _numpy_scalar(name: str, args: tuple[object, ...], _room: Room) -> object:
    _arity(name, args, 2)
    dtype = _built_dtype(name, args[0])
    length = _raw_length(name, args[1], "the value")
    if length != dtype.itemsize:
        raise PickleProblem(f"{name}: {length} bytes for a {dtype.name} of {dtype.itemsize}")
    return dtype.decode(_raw_bytes(name, args[1], "the value"), 1)[0]


def _numpy_reconstruct(name: str, args: tuple[object, ...], _room: Room) -> NumpyArray:
    _arity(name, args, 3)
    subtype, shape, typecode = args
    if type(subtype) is not InertClass or subtype.key != "numpy.ndarray":
        raise PickleProblem(f"{name}: only numpy.ndarray is rebuilt")
    if type(shape) is not tuple or any(type(d) is not int for d in shape):
        raise PickleProblem(f"{name}: malformed arguments")
    _raw_length(name, typecode, "the type code")
    return NumpyArray()


def _build_array(target: NumpyArray, state: object, _room: Room) -> None:
    # ndarray.__setstate__((version, shape, dtype, is_fortran, raw bytes)); a list instead
    # of bytes is an object array: refused.
    if target.dtype is not None:
        raise PickleProblem("numpy array: its state is set twice")
    if type(state) is not tuple or len(state) != 5 or state[0] != 1:
        raise PickleProblem("numpy array: a state other than (1, shape, dtype, order, bytes)")
    _, shape, dtype, fortran, raw = state
    where = "numpy array"
    if type(shape) is not tuple or len(shape) > MAX_ARRAY_RANK:
        raise PickleProblem(f"{where}: a shape that is not a tuple of rank <= {MAX_ARRAY_RANK}")
    for dim in shape:
        _small_int(where, dim, "a dimension", 0, 2**63 - 1)
    built = _built_dtype(where, dtype)
    if type(fortran) is not bool:
        raise PickleProblem(f"{where}: its order flag is not a boolean")
    length = _raw_length(where, raw, "its data")
    numel = math.prod(shape)  # Python ints: no overflow; each dimension < 2**63
    if numel * built.itemsize != length:
        raise PickleProblem(
            f"{where}: {length} bytes of data for {numel} values of {built.itemsize} bytes"
        )
    shown = min(numel, SHOWN_ITEMS)
    target.dtype, target.shape, target.fortran = built, shape, fortran
    target.shown = built.decode(_raw_bytes(where, raw, "its data", shown * built.itemsize), shown)


def _empty_instance(
    kind: type[dict[Any, Any]],
) -> Callable[[str, tuple[object, ...], Room], object]:
    def make(name: str, args: tuple[object, ...], _room: Room) -> object:
        _arity(name, args, 0)
        return kind()

    return make


def _build_namespace(target: Namespace, state: object, room: Room) -> None:
    # Namespace's attributes are its __dict__: BUILD hands them as a dict, which a memo
    # reference may repeat for many Namespaces: each copy is reserved before it is made.
    if type(state) is not dict:
        raise PickleProblem("argparse.Namespace: its state is not a dict")
    room.reserve(
        container_cost(Namespace(), len(state), DICT_ITEM_BYTES),
        f"argparse.Namespace of {len(state)} attributes",
    )
    for key, value in state.items():
        room.insert(target, key, value)


def _build_kept_aside(target: dict[Any, Any], state: object, _room: Room) -> None:
    # A dict subclass's own attributes (none, for Lightning's AttributeDict): not applied.
    if state is not None and type(state) is not dict:
        raise PickleProblem(f"{type(target).__name__}: its state is not a dict")


def _build_default_dict(_target: DefaultDict, state: object, _room: Room) -> None:
    # A defaultdict has no attributes (no __dict__): pickle's BUILD of a dict state fails
    # with AttributeError, even an empty one (the C unpickler torch uses); None does nothing.
    if state is not None:
        raise PickleProblem(
            "collections.defaultdict: its state is set (BUILD), which Python refuses (it has "
            "no attributes)"
        )


# defaultdict factories named by their name only: what `defaultdict(list)` & co. write
_FACTORIES = frozenset(
    f"builtins.{n}" for n in ("list", "dict", "set", "frozenset", "int", "float", "str", "tuple")
)


def _default_dict(name: str, args: tuple[object, ...], _room: Room) -> DefaultDict:
    _arity(name, args, 0, 1)
    made = DefaultDict()
    if args and args[0] is not None:
        factory = args[0]
        factory_name = factory.key if type(factory) is InertClass else None
        if factory_name not in _FACTORIES:
            raise PickleProblem(f"{name}: a factory other than a builtin container or number")
        made.factory = factory_name
    return made


# A path is made by Python's own pure classes (pathlib.PurePosixPath, PureWindowsPath: string
# manipulation only, no I/O, nothing of the file imported or called) from parts checked to
# be text or paths of ours, once the result's size is reserved: its text is pathlib's
# however odd the parts (drives, UNC shares, roots, '.', '..', both slashes). pathlib works
# component by component, in Python, with no look for a signal and an object for each:
# a path of more than MAX_PATH_COMPONENTS components (Linux's PATH_MAX is 4096 bytes) is
# refused before it starts.
MAX_PATH_COMPONENTS = 1 << 16
_PURE_CLASSES: dict[type[PathText], type[pathlib.PurePath]] = {
    PathText: pathlib.PurePosixPath,
    WindowsPathText: pathlib.PureWindowsPath,
}


def path_length_bound(parts: list[str], windows: bool) -> int:
    """An upper bound on the length of the path pathlib makes of `parts`: their characters
    and a separator between each; one more after a path given as a part (Python 3.11 joins
    its drive and root to the rest with a separator: 'C:\\' '/' 'a'), and one more for a
    Windows UNC share alone (pathlib ends '\\\\server\\share' with a separator; with
    more parts, the separator between two pays for it). tests/test_pytorch_inert_fidelity.py
    checks it against pathlib over many combinations of parts."""
    paths = sum(1 for part in parts if type(part) is not str)
    unc_alone = int(windows and len(parts) == 1)
    return max(1, sum(len(part) for part in parts) + len(parts) - 1 + paths + unc_alone)


def _path(made: type[PathText]) -> Callable[[str, tuple[object, ...], Room], PathText]:
    pure = _PURE_CLASSES[made]

    def make(name: str, args: tuple[object, ...], room: Room) -> PathText:
        room.work(len(args))
        texts: list[str] = []
        for part in args:
            # A part is text or a path (os.PathLike), as pathlib takes them; a date, a
            # slice or bytes is a TypeError there, refused here.
            if type(part) is not str and not isinstance(part, PathText):
                raise PickleProblem(f"{name}: a part that is not text ({kind_of(part)})")
            texts.append(part)
        # The result is reserved before anything is copied (a memo reference repeats a
        # long part for 2 bytes of pickle).
        length = path_length_bound(texts, pure is pathlib.PureWindowsPath)
        ascii_only = all(text.isascii() for text in texts)  # O(1) each: CPython's flag
        room.reserve(text_cost(length, ascii_only, made), f"{name} of {length} characters")
        components = sum(text.count("/") + text.count("\\") + 1 for text in texts)
        room.work(components)
        if components > MAX_PATH_COMPONENTS:
            raise PickleProblem(
                f"{name}: a path of more than {MAX_PATH_COMPONENTS} components; refusing it"
            )
        # A path given as a part is a path again (pathlib takes a path's parts, not only
        # its text: its own flavour's rules apply), made of its text, which pathlib wrote.
        pieces = [t if type(t) is str else _PURE_CLASSES[type(t)](t) for t in texts]  # type: ignore[index]
        result = str(pure(*pieces))
        if len(result) > length:  # path_length_bound is wrong: refused, never over budget
            raise PickleProblem(f"{name}: a path longer than its parts allow")
        return made(result)

    return make


def _slice(name: str, args: tuple[object, ...], _room: Room) -> SliceText:
    _arity(name, args, 1, 3)
    if any(a is not None and type(a) is not int for a in args):
        raise PickleProblem(f"{name}: made from something other than integers")
    start, stop, step = (None, args[0], None) if len(args) == 1 else (*args, None)[:3]
    return SliceText(f"slice({start!r}, {stop!r}, {step!r})")  # as Python's repr shows it


def _zone_of(name: str, args: tuple[object, ...], index: int) -> str:
    if len(args) <= index or args[index] is None:
        return ""
    zone = args[index]
    if type(zone) is not Zone:
        raise PickleProblem(f"{name}: a time zone other than a fixed datetime.timezone")
    return zone.offset


def _clock(name: str, raw: bytes) -> str:
    hour = _small_int(name, raw[0] & 0x7F, "the hour", 0, 23)  # bit 7: the fold flag
    minute = _small_int(name, raw[1], "the minute", 0, 59)
    second = _small_int(name, raw[2], "the second", 0, 59)
    micro = _small_int(name, int.from_bytes(raw[3:6], "big"), "the microsecond", 0, 999_999)
    return f"{hour:02d}:{minute:02d}:{second:02d}" + (f".{micro:06d}" if micro else "")


def _day(name: str, raw: bytes) -> str:
    year = _small_int(name, int.from_bytes(raw[0:2], "big"), "the year", 1, 9999)
    month = _small_int(name, raw[2] & 0x7F, "the month", 1, 12)  # datetime's fold flag
    day = _small_int(name, raw[3], "the day", 1, 31)
    return f"{year:04d}-{month:02d}-{day:02d}"


def _stamp(
    length: int, make: Callable[[str, bytes], str]
) -> Callable[[str, tuple[object, ...], Room], StampText]:
    def construct(name: str, args: tuple[object, ...], _room: Room) -> StampText:
        _arity(name, args, 1, 2 if length != 4 else 1)
        given = _raw_length(name, args[0], "its state")
        if given != length:
            raise PickleProblem(f"{name}: a state of {given} bytes, not {length}")
        raw = _raw_bytes(name, args[0], "its state")
        return StampText(make(name, raw) + _zone_of(name, args, 1))

    return construct


def _datetime(name: str, raw: bytes) -> str:
    return _day(name, raw[:4]) + "T" + _clock(name, raw[4:])


def _timedelta(name: str, args: tuple[object, ...], _room: Room) -> Duration:
    _arity(name, args, 3)
    days = _small_int(name, args[0], "the days", -999_999_999, 999_999_999)
    seconds = _small_int(name, args[1], "the seconds", 0, 86_399)
    micro = _small_int(name, args[2], "the microseconds", 0, 999_999)
    return Duration(days, seconds, micro)


def offset_text(microseconds: int) -> str:
    """A UTC offset as datetime's isoformat() writes it: ±HH:MM, then :SS and .ffffff only
    where they are not zero (the sign is the offset's; the rest is its magnitude)."""
    sign = "-" if microseconds < 0 else "+"
    hours, rest = divmod(abs(microseconds), 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    seconds, micro = divmod(rest, 1_000_000)
    text = f"{sign}{hours:02d}:{minutes:02d}"
    if seconds or micro:
        text += f":{seconds:02d}" + (f".{micro:06d}" if micro else "")
    return text


def _timezone(name: str, args: tuple[object, ...], _room: Room) -> Zone:
    _arity(name, args, 1, 2)
    offset = args[0]
    if type(offset) is not Duration or len(args) == 2 and type(args[1]) is not str:
        raise PickleProblem(f"{name}: an offset that is not a timedelta")
    total = (offset.days * 86_400 + offset.seconds) * 1_000_000 + offset.microseconds
    if not -86_400_000_000 < total < 86_400_000_000:  # what datetime.timezone refuses
        raise PickleProblem(f"{name}: an offset of a day or more")
    name_given = args[1] if len(args) == 2 else None
    assert name_given is None or isinstance(name_given, str)
    return Zone(offset_text(total), name_given)


# ------------------------------------------------------------------ the tables

Constructor = Callable[[str, tuple[object, ...], Room], object]
CALLS: dict[str, Constructor] = {
    "numpy_dtype": _numpy_dtype,
    "numpy_scalar": _numpy_scalar,
    "numpy_reconstruct": _numpy_reconstruct,
    "namespace": _empty_instance(Namespace),
    "attribute_dict": _empty_instance(AttributeDict),
    "default_dict": _default_dict,
    "posix_path": _path(PathText),
    "windows_path": _path(WindowsPathText),
    "slice": _slice,
    "datetime": _stamp(10, _datetime),
    "date": _stamp(4, _day),
    "time": _stamp(6, _clock),
    "timedelta": _timedelta,
    "timezone": _timezone,
}
# What NEWOBJ (`cls.__new__(cls)`, protocol 2's way to make a plain object) may make.
NEWOBJ_KINDS = frozenset({"namespace", "attribute_dict"})

_NUMPY_MULTIARRAY = ("numpy.core.multiarray", "numpy._core.multiarray")
_ATTRIBUTE_DICTS = (
    "lightning_fabric.utilities.data",
    "lightning.fabric.utilities.data",
    "pytorch_lightning.utilities.parsing",
    "lightning.pytorch.utilities.parsing",
)
GLOBALS: dict[tuple[str, str], str] = {
    **{(module, "scalar"): "numpy_scalar" for module in _NUMPY_MULTIARRAY},
    **{(module, "_reconstruct"): "numpy_reconstruct" for module in _NUMPY_MULTIARRAY},
    ("numpy", "dtype"): "numpy_dtype",
    ("argparse", "Namespace"): "namespace",
    **{(module, "AttributeDict"): "attribute_dict" for module in _ATTRIBUTE_DICTS},
    ("collections", "defaultdict"): "default_dict",
    **{
        (module, name): kind
        for module in ("pathlib", "pathlib._local")
        for name, kind in (
            ("PosixPath", "posix_path"),
            ("PurePosixPath", "posix_path"),
            ("WindowsPath", "windows_path"),
            ("PureWindowsPath", "windows_path"),
        )
    },
    ("builtins", "slice"): "slice",
    **{("datetime", n): n for n in ("datetime", "date", "time", "timedelta", "timezone")},
}
# `__builtin__.long` is how protocol 2 spells int (pickle's _compat_pickle), `unicode` str.
PYTHON2_NAMES = {"long": "int", "unicode": "str"}
# Classes named only as arguments: numpy.ndarray (to _reconstruct), defaultdict factories.
CLASSES = frozenset(
    {("numpy", "ndarray")} | {("builtins", f.removeprefix("builtins.")) for f in _FACTORIES}
)


def buildable(target: object) -> bool:
    """Whether BUILD may give `target` its state (then `build` does)."""
    return type(target) in _BUILDS


def build(target: object, state: object, room: Room) -> None:
    _BUILDS[type(target)](target, state, room)


_BUILDS: dict[type, Callable[[Any, object, Room], None]] = {
    NumpyDtype: _build_dtype,
    NumpyArray: _build_array,
    Namespace: _build_namespace,
    AttributeDict: _build_kept_aside,
    DefaultDict: _build_default_dict,
}
