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
- `pathlib.PosixPath`/`WindowsPath`/`PurePosixPath`/`PureWindowsPath` -> text;
- `datetime.datetime`/`date`/`time`/`timedelta`/`timezone`, `builtins.slice` -> text (or a
  small Duration/Zone value while they are arguments of another).

Everything else stays refused by the interpreter (unpickler.resolve_global).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from clipcli.formats.pytorch.problem import PickleProblem

MAX_ARRAY_RANK = 64
SHOWN_ITEMS = 8  # values of an array kept for `ls`; the rest only counted


class Described:
    """A stand-in that `ls` shows by its text."""

    def text(self) -> str:
        raise NotImplementedError


class InertClass(Described):
    """A class named only as an argument (`numpy.ndarray` for `_reconstruct`, `builtins.list`
    as a defaultdict's factory): never called, never built."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

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
    """datetime.timezone: a fixed offset, kept as its ISO text (`+01:00`)."""

    __slots__ = ("offset",)

    def __init__(self, offset: str) -> None:
        self.offset = offset

    def text(self) -> str:
        return f"timezone {self.offset}"


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


def _raw_bytes(name: str, value: object, what: str) -> bytes:
    """Bytes as protocol 2 spells them (`_codecs.encode` made bytes) or Python 2's str."""
    if isinstance(value, bytes):
        return value
    if type(value) is str:
        try:
            return value.encode("latin-1")
        except UnicodeEncodeError:
            raise PickleProblem(f"{name}: {what} is text, not bytes") from None
    raise PickleProblem(f"{name}: {what} is a {type(value).__name__}, not bytes")


def _small_int(name: str, value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise PickleProblem(f"{name}: {what} is not an integer from {low} to {high}")
    return value


# ------------------------------------------------------------------ the constructors


def _numpy_dtype(name: str, args: tuple[object, ...]) -> NumpyDtype:
    _arity(name, args, 1, 3)
    code = args[0]
    if type(code) is not str or code not in _NUMPY_CODES:
        shown = code if type(code) is str and len(code) <= 16 else type(code).__name__
        raise PickleProblem(f"{name}: type {shown!r} is not a plain numeric numpy dtype")
    if any(type(flag) not in (bool, int) for flag in args[1:]):
        raise PickleProblem(f"{name}: its flags are not booleans")
    return NumpyDtype(code)


def _build_dtype(target: NumpyDtype, state: object) -> None:
    # numpy's state: (version, byte order, subarray, names, fields, elsize, alignment,
    # flags); a plain numeric dtype has no subarray, names nor fields.
    if target.order is not None:
        raise PickleProblem("numpy.dtype: its state is set twice")
    if (
        type(state) is not tuple
        or len(state) != 8
        or state[0] not in (3, 4)
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
        raise PickleProblem(f"{name}: the dtype is a {type(dtype).__name__}, not a numpy.dtype")
    return dtype


def _numpy_scalar(name: str, args: tuple[object, ...]) -> object:
    _arity(name, args, 2)
    dtype = _built_dtype(name, args[0])
    raw = _raw_bytes(name, args[1], "the value")
    if len(raw) != dtype.itemsize:
        raise PickleProblem(f"{name}: {len(raw)} bytes for a {dtype.name} of {dtype.itemsize}")
    return dtype.decode(raw, 1)[0]


def _numpy_reconstruct(name: str, args: tuple[object, ...]) -> NumpyArray:
    _arity(name, args, 3)
    subtype, shape, typecode = args
    if type(subtype) is not InertClass or subtype.name != "numpy.ndarray":
        raise PickleProblem(f"{name}: only numpy.ndarray is rebuilt")
    if type(shape) is not tuple or any(type(d) is not int for d in shape):
        raise PickleProblem(f"{name}: malformed arguments")
    _raw_bytes(name, typecode, "the type code")
    return NumpyArray()


def _build_array(target: NumpyArray, state: object) -> None:
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
    data = _raw_bytes(where, raw, "its data")
    numel = math.prod(shape)  # Python ints: no overflow; each dimension < 2**63
    if numel * built.itemsize != len(data):
        raise PickleProblem(
            f"{where}: {len(data)} bytes of data for {numel} values of {built.itemsize} bytes"
        )
    target.dtype, target.shape, target.fortran = built, shape, fortran
    target.shown = built.decode(data, min(numel, SHOWN_ITEMS))


def _empty_instance(kind: type[dict[Any, Any]]) -> Callable[[str, tuple[object, ...]], object]:
    def make(name: str, args: tuple[object, ...]) -> object:
        _arity(name, args, 0)
        return kind()

    return make


def _build_namespace(target: Namespace, state: object) -> None:
    # Namespace's attributes are its __dict__: BUILD hands them as a dict.
    if type(state) is not dict:
        raise PickleProblem("argparse.Namespace: its state is not a dict")
    target.update(state)


def _build_kept_aside(target: dict[Any, Any], state: object) -> None:
    # A dict subclass's own attributes (none, for Lightning's AttributeDict): not applied.
    if state is not None and type(state) is not dict:
        raise PickleProblem(f"{type(target).__name__}: its state is not a dict")


# defaultdict factories named by their name only: what `defaultdict(list)` & co. write
_FACTORIES = frozenset(
    f"builtins.{n}" for n in ("list", "dict", "set", "frozenset", "int", "float", "str", "tuple")
)


def _default_dict(name: str, args: tuple[object, ...]) -> DefaultDict:
    _arity(name, args, 0, 1)
    made = DefaultDict()
    if args and args[0] is not None:
        factory = args[0]
        factory_name = getattr(factory, "name", None) if not isinstance(factory, str) else None
        if factory_name not in _FACTORIES:
            raise PickleProblem(f"{name}: a factory other than a builtin container or number")
        made.factory = factory_name
    return made


def _path(separator: str) -> Callable[[str, tuple[object, ...]], str]:
    def make(name: str, args: tuple[object, ...]) -> str:
        if any(type(part) is not str for part in args):
            raise PickleProblem(f"{name}: a part that is not text")
        text = ""
        for part in args:
            assert isinstance(part, str)
            text = part if not text else text.rstrip(separator) + separator + part
        return text or "."

    return make


def _slice(name: str, args: tuple[object, ...]) -> str:
    _arity(name, args, 1, 3)
    if any(a is not None and type(a) is not int for a in args):
        raise PickleProblem(f"{name}: made from something other than integers")
    return f"slice({', '.join(repr(a) for a in args)})"


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


def _stamp(length: int, make: Callable[[str, bytes], str]) -> Callable[..., str]:
    def construct(name: str, args: tuple[object, ...]) -> str:
        _arity(name, args, 1, 2 if length != 4 else 1)
        raw = _raw_bytes(name, args[0], "its state")
        if len(raw) != length:
            raise PickleProblem(f"{name}: a state of {len(raw)} bytes, not {length}")
        return make(name, raw) + _zone_of(name, args, 1)

    return construct


def _datetime(name: str, raw: bytes) -> str:
    return _day(name, raw[:4]) + "T" + _clock(name, raw[4:])


def _timedelta(name: str, args: tuple[object, ...]) -> Duration:
    _arity(name, args, 3)
    days = _small_int(name, args[0], "the days", -999_999_999, 999_999_999)
    seconds = _small_int(name, args[1], "the seconds", 0, 86_399)
    micro = _small_int(name, args[2], "the microseconds", 0, 999_999)
    return Duration(days, seconds, micro)


def _timezone(name: str, args: tuple[object, ...]) -> Zone:
    _arity(name, args, 1, 2)
    offset = args[0]
    if type(offset) is not Duration or len(args) == 2 and type(args[1]) is not str:
        raise PickleProblem(f"{name}: an offset that is not a timedelta")
    total = (offset.days * 86_400 + offset.seconds) * 1_000_000 + offset.microseconds
    if not -86_400_000_000 < total < 86_400_000_000:
        raise PickleProblem(f"{name}: an offset of a day or more")
    sign = "-" if total < 0 else "+"
    minutes, micro = divmod(abs(total), 60_000_000)
    text = f"{sign}{minutes // 60:02d}:{minutes % 60:02d}" + (f"+{micro}us" if micro else "")
    return Zone(text)


# ------------------------------------------------------------------ the tables

CALLS: dict[str, Callable[[str, tuple[object, ...]], object]] = {
    "numpy_dtype": _numpy_dtype,
    "numpy_scalar": _numpy_scalar,
    "numpy_reconstruct": _numpy_reconstruct,
    "namespace": _empty_instance(Namespace),
    "attribute_dict": _empty_instance(AttributeDict),
    "default_dict": _default_dict,
    "posix_path": _path("/"),
    "windows_path": _path("\\"),
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


def build(target: object, state: object) -> None:
    _BUILDS[type(target)](target, state)


_BUILDS: dict[type, Callable[[Any, object], None]] = {
    NumpyDtype: _build_dtype,
    NumpyArray: _build_array,
    Namespace: _build_namespace,
    AttributeDict: _build_kept_aside,
    DefaultDict: _build_kept_aside,
}
