"""HDF5 types, dataspaces and creation settings as plain JSON values, and back.

The description is our own, not the library's binary H5Tencode: the decoding side reads
it from a stranger's safetensors header, and a description we check field by field can
only ever build an ordinary HDF5 type. What it covers is what checkpoints hold: integers,
IEEE floats, strings (fixed or variable length, with their character set and padding),
compound, array, enum, opaque and bitfield types, and variable-length strings inside none
of these. References, time types and variable-length sequences are not described
(Unportable): their values have no meaning outside the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.formats.base import utf8_encodable
from clipcli.formats.hdf5.library import load_h5py

Json = dict[str, Any]

MAX_TYPE_DEPTH = 8  # compound/array nesting; real files nest once or twice
MAX_TYPE_SIZE = 1 << 20  # bytes per element
MAX_MEMBERS = 4096  # compound fields or enum members
MAX_RANK = limits.MAX_RANK  # HDF5's own limit


class Unportable(ValueError):
    """An HDF5 type or setting that this description does not cover."""


class Malformed(ValueError):
    """A description that does not describe a valid HDF5 type or space."""


# ---------------------------------------------------------------------- types


def describe_type(type_id: Any, depth: int = 0) -> Json:
    h5t = load_h5py().h5t
    kind = type_id.get_class()
    size = int(type_id.get_size())
    if depth > MAX_TYPE_DEPTH:
        raise Unportable("a type nested too deeply")
    if kind == h5t.INTEGER:
        return {
            "class": "int",
            "size": size,
            "order": _order(type_id),
            "signed": type_id.get_sign() == h5t.SGN_2,
        }
    if kind == h5t.FLOAT:
        standard = h5t.py_create(np.dtype(f"<f{size}")) if size in (2, 4, 8) else None
        layout = (type_id.get_offset(), type_id.get_precision(), type_id.get_fields())
        if standard is None or layout != (
            standard.get_offset(),
            standard.get_precision(),
            standard.get_fields(),
        ):
            raise Unportable(f"a {size}-byte float type that is not IEEE")
        return {"class": "float", "size": size, "order": _order(type_id)}
    if kind == h5t.STRING:
        variable = bool(type_id.is_variable_str())
        return {
            "class": "string",
            "size": None if variable else size,
            "cset": int(type_id.get_cset()),
            "pad": int(type_id.get_strpad()),
        }
    if kind == h5t.COMPOUND:
        members: list[Json] = []
        for index in range(type_id.get_nmembers()):
            member = type_id.get_member_type(index)
            members.append(
                {
                    "name": _text(type_id.get_member_name(index)),
                    "offset": int(type_id.get_member_offset(index)),
                    "type": describe_type(member, depth + 1),
                }
            )
            if holds_variable_string(members[-1]["type"]):
                raise Unportable("a variable-length string inside a compound type")
        return {"class": "compound", "size": size, "members": members}
    if kind == h5t.ARRAY:
        base = describe_type(type_id.get_super(), depth + 1)
        if holds_variable_string(base):
            raise Unportable("an array of variable-length strings")
        return {"class": "array", "dims": [int(d) for d in type_id.get_array_dims()], "base": base}
    if kind == h5t.ENUM:
        values: list[list[Any]] = []
        for index in range(type_id.get_nmembers()):
            values.append(
                [_text(type_id.get_member_name(index)), int(type_id.get_member_value(index))]
            )
        return {
            "class": "enum",
            "base": describe_type(type_id.get_super(), depth + 1),
            "members": values,
        }
    if kind == h5t.OPAQUE:
        return {"class": "opaque", "size": size, "tag": _text(type_id.get_tag())}
    if kind == h5t.BITFIELD:
        return {"class": "bitfield", "size": size, "order": _order(type_id)}
    names = {h5t.REFERENCE: "a reference type", h5t.VLEN: "a variable-length sequence type"}
    raise Unportable(names.get(kind, f"an HDF5 type of class {kind}"))


def _order(type_id: Any) -> str:
    return ">" if type_id.get_order() == load_h5py().h5t.ORDER_BE else "<"


def _text(raw: bytes | str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Unportable(f"a member name or tag that is not UTF-8: {raw!r}") from None


def holds_variable_string(desc: Json) -> bool:
    """Variable-length strings are portable only as a whole type, never inside another."""
    return desc["class"] == "string" and desc["size"] is None


def build_type(desc: object, depth: int = 0) -> Any:
    """The HDF5 type a description names; Malformed for anything that is not exactly one
    of the shapes describe_type produces, within the limits above."""
    h5t = load_h5py().h5t
    if depth > MAX_TYPE_DEPTH:
        raise Malformed("types nest too deeply")
    if not isinstance(desc, dict):
        raise Malformed("a type is not an object")
    kind = desc.get("class")
    if kind == "int":
        size = _int(desc, "size", {1, 2, 4, 8})
        code = ("i" if _bool(desc, "signed") else "u") + str(size)
        return h5t.py_create(np.dtype(_order_char(desc) + code)).copy()
    if kind == "float":
        size = _int(desc, "size", {2, 4, 8})
        return h5t.py_create(np.dtype(f"{_order_char(desc)}f{size}")).copy()
    if kind == "string":
        type_id = h5t.C_S1.copy()
        if desc.get("size") is None:
            type_id.set_size(h5t.VARIABLE)
        else:
            type_id.set_size(_int(desc, "size", range(1, MAX_TYPE_SIZE + 1)))
        type_id.set_cset(_int(desc, "cset", {h5t.CSET_ASCII, h5t.CSET_UTF8}))
        type_id.set_strpad(_int(desc, "pad", {h5t.STR_NULLTERM, h5t.STR_NULLPAD, h5t.STR_SPACEPAD}))
        return type_id
    if kind == "compound":
        size = _int(desc, "size", range(1, MAX_TYPE_SIZE + 1))
        members = _list(desc, "members")
        type_id = h5t.create(h5t.COMPOUND, size)
        for member in members:
            if not isinstance(member, dict) or not _is_name(member.get("name")):
                raise Malformed("a compound member without a valid name")
            inner = build_type(member.get("type"), depth + 1)
            offset = _int(member, "offset", range(size))
            if offset + inner.get_size() > size or holds_variable_string(member["type"]):
                raise Malformed("a compound member outside its type or of variable length")
            type_id.insert(member["name"].encode("utf-8"), offset, inner)
        return type_id
    if kind == "array":
        dims = _list(desc, "dims")
        if not 1 <= len(dims) <= MAX_RANK or not all(_is_int(d) and d >= 1 for d in dims):
            raise Malformed("array dimensions")
        base = desc.get("base")
        inner = build_type(base, depth + 1)
        if int(np.prod(dims, dtype=object)) * inner.get_size() > MAX_TYPE_SIZE:
            raise Malformed("an array type too large")
        if isinstance(base, dict) and holds_variable_string(base):
            raise Malformed("an array of variable-length strings")
        return h5t.array_create(inner, tuple(dims))
    if kind == "enum":
        base = build_type(desc.get("base"), depth + 1)
        if base.get_class() != h5t.INTEGER:
            raise Malformed("an enum over a type that is not an integer")
        type_id = h5t.enum_create(base)
        bits = 8 * int(base.get_size())
        low, high = (
            (-(1 << (bits - 1)), 1 << (bits - 1))
            if _bool(desc["base"], "signed")
            else (0, 1 << bits)
        )
        names: set[str] = set()
        for member in _list(desc, "members"):
            if not (
                isinstance(member, list)
                and len(member) == 2
                and _is_name(member[0])
                and _is_int(member[1])
            ):
                raise Malformed("an enum member")
            if not low <= member[1] < high:
                raise Malformed(f"enum member {member[0]!r} = {member[1]} outside its base type")
            if member[0] in names:
                raise Malformed(f"enum member {member[0]!r} named twice")
            names.add(member[0])
            type_id.enum_insert(member[0].encode("utf-8"), member[1])
        return type_id
    if kind == "opaque":
        type_id = h5t.create(h5t.OPAQUE, _int(desc, "size", range(1, MAX_TYPE_SIZE + 1)))
        tag = desc.get("tag")
        if not isinstance(tag, str) or len(tag) > 255 or "\x00" in tag or not utf8_encodable(tag):
            raise Malformed("an opaque tag")
        type_id.set_tag(tag.encode("utf-8"))
        return type_id
    if kind == "bitfield":
        size = _int(desc, "size", {1, 2, 4, 8})
        # The library's predefined types in each order: h5py's bitfield type has no
        # set_order (calling it was an AttributeError, exit 70).
        little = {1: h5t.STD_B8LE, 2: h5t.STD_B16LE, 4: h5t.STD_B32LE, 8: h5t.STD_B64LE}
        big = {1: h5t.STD_B8BE, 2: h5t.STD_B16BE, 4: h5t.STD_B32BE, 8: h5t.STD_B64BE}
        return (big if _order_char(desc) == ">" else little)[size].copy()
    raise Malformed(f"unknown type class {kind!r}")


def _is_name(value: object) -> bool:
    """A member name HDF5 stores as written: non-empty UTF-8 text without NUL."""
    return isinstance(value, str) and bool(value) and "\x00" not in value and utf8_encodable(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(desc: Json, key: str, allowed: Any) -> int:
    value = desc.get(key)
    if not _is_int(value) or value not in allowed:
        raise Malformed(f"{key} {value!r}")
    return int(str(value))


def _bool(desc: Json, key: str) -> bool:
    value = desc.get(key)
    if not isinstance(value, bool):
        raise Malformed(f"{key} {value!r}")
    return value


def _list(desc: Json, key: str) -> list[Any]:
    value = desc.get(key)
    if not isinstance(value, list) or len(value) > MAX_MEMBERS:
        raise Malformed(f"{key} is not a list of at most {MAX_MEMBERS}")
    return value


def _order_char(desc: Json) -> str:
    order = desc.get("order")
    if order not in ("<", ">"):
        raise Malformed(f"byte order {order!r}")
    return str(order)


# ---------------------------------------------------------------------- dataspaces


def describe_space(space: Any) -> Json:
    h5s = load_h5py().h5s
    kind = space.get_simple_extent_type()
    if kind == h5s.NULL:
        return {"class": "null"}
    if kind == h5s.SCALAR:
        return {"class": "scalar"}
    shape = [int(d) for d in space.shape]
    maxshape = [None if d == h5s.UNLIMITED else int(d) for d in space.get_simple_extent_dims(True)]
    return {"class": "simple", "shape": shape, "maxshape": maxshape}


def build_space(desc: object) -> Any:
    h5s = load_h5py().h5s
    if not isinstance(desc, dict):
        raise Malformed("a dataspace is not an object")
    kind = desc.get("class")
    if kind == "null":
        return h5s.create(h5s.NULL)
    if kind == "scalar":
        return h5s.create(h5s.SCALAR)
    if kind != "simple":
        raise Malformed(f"dataspace class {kind!r}")
    shape, maxshape = _list(desc, "shape"), _list(desc, "maxshape")
    if not 1 <= len(shape) <= MAX_RANK or len(maxshape) != len(shape):
        raise Malformed("dataspace rank")
    for dim, top in zip(shape, maxshape, strict=True):
        if not _is_int(dim) or dim < 0 or dim >= 1 << 62:
            raise Malformed(f"dimension {dim!r}")
        if top is not None and (not _is_int(top) or top < dim or top >= 1 << 62):
            raise Malformed(f"maximum dimension {top!r}")
    limits = tuple(h5s.UNLIMITED if top is None else top for top in maxshape)
    return h5s.create_simple(tuple(shape), limits)


def space_points(desc: Json) -> int:
    """Elements in a described dataspace (0 for a null one)."""
    if desc["class"] == "null":
        return 0
    if desc["class"] == "scalar":
        return 1
    return int(np.prod(desc["shape"], dtype=object))
