"""HDF5 link names are names, never paths (threat model, Open item 4).

HDF5 never stores a link name with '/' in it, but a hand-made file can, and h5py and
libhdf5 read every name they are given as a path: a link named `e/x` is `x` reached
through `e`, so the library follows `e` (a soft link, or an external link whose file it
opens by name, without O_NONBLOCK) before the walk reaches `e` and refuses it.

The files are made by h5py and then one stored name is rewritten in place, to the same
length: in a version 2 object header (a group that tracks creation order) the Link
messages are covered by a Jenkins lookup3 checksum, recomputed here; in an old-style
symbol table group the names live in a local heap without a checksum. h5py, the official
reader, is asked each time that it sees the crafted name.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from hostile_cli import assert_refused, refuse_input, run_clipcli

from clipcli.errors import InputError
from clipcli.formats.hdf5 import Hdf5Reader
from clipcli.formats.hdf5 import reader as hdf5_reader

# ------------------------------------------------------------------ crafting

MASK = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & MASK


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = ((a - c) & MASK) ^ _rot(c, 4)
    c = (c + b) & MASK
    b = ((b - a) & MASK) ^ _rot(a, 6)
    a = (a + c) & MASK
    c = ((c - b) & MASK) ^ _rot(b, 8)
    b = (b + a) & MASK
    a = ((a - c) & MASK) ^ _rot(c, 16)
    c = (c + b) & MASK
    b = ((b - a) & MASK) ^ _rot(a, 19)
    a = (a + c) & MASK
    c = ((c - b) & MASK) ^ _rot(b, 4)
    b = (b + a) & MASK
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c = ((c ^ b) - _rot(b, 14)) & MASK
    a = ((a ^ c) - _rot(c, 11)) & MASK
    b = ((b ^ a) - _rot(a, 25)) & MASK
    c = ((c ^ b) - _rot(b, 16)) & MASK
    a = ((a ^ c) - _rot(c, 4)) & MASK
    b = ((b ^ a) - _rot(a, 14)) & MASK
    return ((c ^ b) - _rot(b, 24)) & MASK


def lookup3(data: bytes) -> int:
    """Bob Jenkins' hashlittle with initval 0: HDF5's H5_checksum_lookup3."""
    a = b = c = (0xDEADBEEF + len(data)) & MASK
    rest = data
    while len(rest) > 12:
        a = (a + int.from_bytes(rest[0:4], "little")) & MASK
        b = (b + int.from_bytes(rest[4:8], "little")) & MASK
        c = (c + int.from_bytes(rest[8:12], "little")) & MASK
        a, b, c = _mix(a, b, c)
        rest = rest[12:]
    if not rest:
        return c
    tail = rest + bytes(12 - len(rest))
    a = (a + int.from_bytes(tail[0:4], "little")) & MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & MASK
    return _final(a, b, c)


def _checksummed_block(data: bytes, at: int) -> tuple[int, int]:
    """(start, checksum offset) of the object header block (OHDR or continuation OCHK)
    holding byte `at`: the nearest signature before it, ended where the stored checksum
    equals lookup3 of the bytes so far. Finding it on the library's own file is what
    shows that lookup3 here is the library's."""
    start = max(data.rfind(b"OHDR", 0, at + 1), data.rfind(b"OCHK", 0, at + 1))
    assert start >= 0, "no object header before the name"
    for end in range(at, len(data) - 3):
        if lookup3(data[start:end]) == int.from_bytes(data[end : end + 4], "little"):
            return start, end
    raise AssertionError("no valid checksum after the name: not a version 2 object header")


def rewrite(path: Path, old: bytes, new: bytes, *, checksummed: bool) -> None:
    """Replace the one stored occurrence of `old` by `new` (same length), recomputing the
    object header checksum where there is one."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    assert data.count(old) == 1, f"{old!r} is stored {data.count(old)} times"
    at = data.index(old)
    span = _checksummed_block(bytes(data), at) if checksummed else None
    data[at : at + len(old)] = new
    if span is not None:
        start, end = span
        data[end : end + 4] = lookup3(bytes(data[start:end])).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def rewrite_in_heap_block(path: Path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` inside the fractal heap direct block (FHDB) that stores a
    group's links densely. Its checksum is lookup3 of the whole block with the checksum
    field zeroed; the field's place (after the heap address and the block offset) and
    the block's size (a power of two) are found by matching the library's own checksum."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    start = data.index(b"FHDB")
    at = data.index(old, start)
    spans = [
        (field, size)
        for field in range(start + 13, start + 22)
        for size in (1 << k for k in range(9, 20))
        if start + size <= len(data) and at + len(old) <= start + size
    ]

    def checksum(block: bytearray, field: int) -> int:
        zeroed = bytearray(block)
        zeroed[field - start : field - start + 4] = bytes(4)
        return lookup3(bytes(zeroed))

    matches = [
        (field, size)
        for field, size in spans
        if checksum(data[start : start + size], field)
        == int.from_bytes(data[field : field + 4], "little")
    ]
    assert len(matches) == 1, f"direct block checksum not found: {matches}"
    field, size = matches[0]
    data[at : at + len(old)] = new
    data[field : field + 4] = checksum(data[start : start + size], field).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def link_message_name(name: bytes) -> bytes:
    """A short name as stored in a Link message: its one-byte length, then the bytes."""
    return bytes([len(name)]) + name


Build = Callable[[h5py.File], object]


def crafted(path: Path, build: Build, old: bytes, new: bytes) -> Path:
    """A file whose root group tracks creation order (so a version 2 object header with
    compact Link messages: fewer than 8 links), one link name rewritten."""
    with h5py.File(path, "w", track_order=True) as f:
        build(f)
    rewrite(path, link_message_name(old), link_message_name(new), checksummed=True)
    return path


def root_names(path: Path) -> list[str]:
    with h5py.File(path, "r") as f:
        return list(f)


# ------------------------------------------------------------------ '/' in a link name


@pytest.mark.parametrize("kind", ["external", "soft to external"])
def test_a_slash_in_a_link_name_never_opens_the_external_target(tmp_path: Path, kind: str) -> None:
    """`e/x` (hard, created first) beside `e`: opening `e/x` made libhdf5 open `e`'s
    target by name. The target is a FIFO nobody writes to: opening it would hang (the run
    is killed at the timeout and the test fails)."""
    fifo = tmp_path / "target.h5"
    os.mkfifo(fifo)

    def build(f: h5py.File) -> None:
        f["exx"] = np.arange(4.0)
        if kind == "external":
            f["e"] = h5py.ExternalLink(str(fifo), "/x")
        else:
            f["e"] = h5py.SoftLink("/far")
            f["far"] = h5py.ExternalLink(str(fifo), "/")

    path = crafted(tmp_path / "hostile.h5", build, b"exx", b"e/x")
    assert root_names(path)[:2] == ["e/x", "e"]  # the official reader sees the name
    refuse_input(path, 3, "link named 'e/x'", "as a path")


class OpenWatch:
    """Counts the opens of one file by any process (inotify IN_OPEN): the kernel queues
    each event as the open happens, so after the runs have ended the count is complete."""

    IN_OPEN = 0x20
    IN_NONBLOCK = os.O_NONBLOCK

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self._fd >= 0, os.strerror(ctypes.get_errno())
        watch = self._libc.inotify_add_watch(self._fd, os.fsencode(path), self.IN_OPEN)
        assert watch >= 0, os.strerror(ctypes.get_errno())

    def opens(self) -> int:
        count = 0
        while True:
            try:
                events = os.read(self._fd, 4096)
            except BlockingIOError:
                return count
            offset = 0
            while offset < len(events):  # struct inotify_event: wd, mask, cookie, len, name
                _wd, mask, _cookie, size = struct.unpack_from("iIII", events, offset)
                count += bool(mask & self.IN_OPEN)
                offset += 16 + size

    def close(self) -> None:
        os.close(self._fd)


def test_a_slash_in_a_link_name_never_opens_another_file(tmp_path: Path) -> None:
    """With a regular file as the external target, the library opened the other file and
    the walk inspected its dataset as this file's `e/x` before it reached `e`."""
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.full(3, 7.0)

    def build(f: h5py.File) -> None:
        f["exx"] = np.arange(4.0)
        f["e"] = h5py.ExternalLink(str(other), "/")

    path = crafted(tmp_path / "hostile.h5", build, b"exx", b"e/x")
    watch = OpenWatch(other)
    try:
        with h5py.File(path, "r") as f:  # the official reader follows the path into `other`
            assert list(f) == ["e/x", "e"]
            assert f["e/x"].file.filename == str(other)
        assert watch.opens() >= 1  # the watch sees the library's open
        refuse_input(path, 3, "link named 'e/x'")
        assert watch.opens() == 0
    finally:
        watch.close()


def test_a_slash_in_a_densely_stored_link_name_never_opens_the_external_target(
    tmp_path: Path,
) -> None:
    """Past 8 links a group stores them in a fractal heap (names indexed by hash and by
    creation order): the rule is the same, whatever the storage."""
    fifo = tmp_path / "target.h5"
    os.mkfifo(fifo)
    path = tmp_path / "hostile.h5"
    with h5py.File(path, "w", track_order=True) as f:
        f["exx"] = np.arange(4.0)
        for index in range(12):
            f[f"pad{index:02d}"] = np.arange(2.0)
        f["e"] = h5py.ExternalLink(str(fifo), "/")
    rewrite_in_heap_block(path, b"exx", b"e/x")
    names = root_names(path)
    assert names == ["e/x", *(f"pad{index:02d}" for index in range(12)), "e"]
    refuse_input(path, 3, "link named 'e/x'")


def test_a_leading_slash_in_an_old_style_group_never_reaches_the_root(tmp_path: Path) -> None:
    """Old-style (symbol table) groups keep names in a local heap with no checksum, listed
    in name order: `/a` is walked before the root's `e`, and its link `/e` resolved from
    the root, through the external link `e`, into the FIFO."""
    fifo = tmp_path / "target.h5"
    os.mkfifo(fifo)
    path = tmp_path / "hostile.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_group("a")["Qe"] = np.arange(4.0)
        f["e"] = h5py.ExternalLink(str(fifo), "/x")
    rewrite(path, b"Qe\0", b"/e\0", checksummed=False)
    with h5py.File(path, "r") as f:
        assert list(f["a"]) == ["/e"]
    refuse_input(path, 3, "group '/a' has a link named '/e'")


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (b"Q", b".", "'.' is not a plain name"),
        (b"QZ", b"..", "'..' is not a plain name"),
        (b"Q", b"/", "reads a '/' in it as a path"),
        (b"QZ", b"Q/", "reads a '/' in it as a path"),
    ],
    ids=["dot", "dotdot", "slash", "trailing_slash"],
)
def test_names_that_are_not_one_plain_component_are_refused(
    tmp_path: Path, old: bytes, new: bytes, reason: str
) -> None:
    """'.' is the group itself to the library, '..' a name HDF5 never writes (and clipcli
    cannot write back), a trailing '/' still a path."""

    def build(f: h5py.File) -> None:
        f[old.decode()] = np.arange(4.0)

    path = crafted(tmp_path / "hostile.h5", build, old, new)
    assert root_names(path) == [new.decode()]
    refuse_input(path, 3, f"link named {new.decode()!r}", reason)


# ------------------------------------------------------------------ NUL, repeats, empty


@pytest.mark.parametrize("hard_first", [True, False], ids=["hard_first", "external_first"])
def test_a_nul_that_hides_a_link_is_refused_as_a_repeated_name(
    tmp_path: Path, hard_first: bool
) -> None:
    """A NUL ends a name in every HDF5 API: `a\\0x` is listed as `a`, and a lookup of `a`
    finds only one of the two links, so the other is hidden whichever it is."""
    fifo = tmp_path / "target.h5"
    os.mkfifo(fifo)

    def build(f: h5py.File) -> None:
        if hard_first:
            f["aQx"] = np.arange(4.0)
        f["a"] = h5py.ExternalLink(str(fifo), "/x")
        if not hard_first:
            f["aQx"] = np.arange(4.0)

    path = crafted(tmp_path / "hostile.h5", build, b"aQx", b"a\0x")
    assert root_names(path) == ["a", "a"]
    refuse_input(path, 3, "lists the link name 'a' twice")


def test_a_repeated_link_name_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "target.h5"
    os.mkfifo(fifo)

    def build(f: h5py.File) -> None:
        f["ab"] = np.arange(4.0)
        f["aQ"] = h5py.ExternalLink(str(fifo), "/x")

    path = crafted(tmp_path / "hostile.h5", build, b"aQ", b"ab")
    assert root_names(path) == ["ab", "ab"]
    refuse_input(path, 3, "lists the link name 'ab' twice")


def test_a_single_nul_truncated_name_reads_as_the_library_shows_it(tmp_path: Path) -> None:
    """With no other link to hide, `w\\0x` is `w` to every reader: clipcli lists what h5py
    reads, the same values."""

    def build(f: h5py.File) -> None:
        f["wQx"] = np.arange(4.0)

    path = crafted(tmp_path / "model.h5", build, b"wQx", b"w\0x")
    with h5py.File(path, "r") as f:
        assert list(f) == ["w"]
        expected = f["w"][()]
    with Hdf5Reader(path) as reader:
        assert [info.name for info in reader.infos] == ["w"]
        np.testing.assert_array_equal(reader.read(reader.infos[0]), expected)


def test_an_empty_link_name_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """The library itself refuses a stored name of length 0 when listing the group. The
    Link message is rebuilt by hand: length 0, then the object's address moved up."""
    path = tmp_path / "hostile.h5"
    with h5py.File(path, "w", track_order=True) as f:
        f["Q"] = np.arange(4.0)
        f["R"] = np.arange(3.0)
    data = bytearray(path.read_bytes())
    at = data.index(b"\x01Q")
    start, end = _checksummed_block(bytes(data), at)
    address = data[at + 2 : at + 10]
    data[at : at + 10] = b"\x00" + address + b"\x00"
    data[end : end + 4] = lookup3(bytes(data[start:end])).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="invalid name length"), h5py.File(path, "r") as f:
        list(f)
    refuse_input(path, 3, "cannot list group '/'")


# ------------------------------------------------------------------ attribute names


def test_attribute_names_are_names_not_paths(tmp_path: Path) -> None:
    """h5py writes attribute names with '/', '.' and '..', and opens attributes by name
    on their object (never as a path): they are read and copied as they are."""
    path = tmp_path / "model.h5"
    names = ["e/x", ".", "..", "/e"]
    with h5py.File(path, "w") as f:
        f["w"] = np.arange(4.0)
        for index, name in enumerate(names):
            f.attrs[name] = index
            f["w"].attrs[name] = index
    out = tmp_path / "out.h5"
    [run] = run_clipcli(["clip", "--global", "1", str(path), str(out)], cwd=tmp_path)
    assert run.returncode == 0, run.describe()
    with h5py.File(out, "r") as f:
        for obj in (f, f["w"]):
            assert {name: int(obj.attrs[name]) for name in names} == {
                name: index for index, name in enumerate(names)
            }


def test_a_repeated_attribute_name_is_refused(tmp_path: Path) -> None:
    """Two attributes stored as `ab`: h5py opens `ab` by name and finds one of them twice
    (an HDF5 OUT then failed with exit 5 creating `ab` again; the other was hidden)."""
    path = tmp_path / "hostile.h5"
    with h5py.File(path, "w", track_order=True) as f:
        f["w"] = np.arange(4.0)
        f.attrs["ab"] = np.arange(3.0)
        f.attrs["aQ"] = "hidden"
    rewrite(path, b"aQ\0", b"ab\0", checksummed=True)
    with h5py.File(path, "r") as f:
        assert list(f.attrs) == ["ab", "ab"]
    refuse_input(path, 3, "lists the attribute name 'ab' twice")
    assert_refused(
        ["clip", "--global", "1", str(path), str(tmp_path / "out.safetensors")],
        3,
        ["twice"],
        watch=tmp_path,
    )


def test_a_nul_in_an_attribute_name_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """The library checks an attribute name's stored length against the text: refused."""
    path = tmp_path / "hostile.h5"
    with h5py.File(path, "w", track_order=True) as f:
        f["w"] = np.arange(4.0)
        f.attrs["aQx"] = 1
    rewrite(path, b"aQx\0", b"a\0x\0", checksummed=True)
    refuse_input(path, 3, "attribute name has different length")


# ------------------------------------------------------------------ the backstop


def test_an_object_of_another_file_is_refused_even_if_a_name_check_missed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every object the walk opens must belong to this file (its fileno is the root's):
    with the name rule switched off, `e/x` leads into `other` and is still refused."""
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.full(3, 7.0)

    def build(f: h5py.File) -> None:
        f["exx"] = np.arange(4.0)
        f["e"] = h5py.ExternalLink(str(other), "/")

    path = crafted(tmp_path / "hostile.h5", build, b"exx", b"e/x")
    monkeypatch.setattr(hdf5_reader, "link_name_problem", lambda _name: None)
    with pytest.raises(InputError, match="'/e/x' lies in another file"):
        Hdf5Reader(path)
