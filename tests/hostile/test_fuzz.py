"""Fuzzing clipcli with hypothesis, in two layers (plus a differential check).

1. Valid random checkpoints, written with the official libraries (safetensors, numpy,
   h5py), clipped in-process through `main()`: the limit holds (checked in float64),
   tensors within the limit and integer tensors are bit-identical, names, dtypes and
   shapes are kept.
2. Mutated files (bit flips, truncations, insertions, safetensors length-prefix and JSON
   edits, .npy header edits inside a re-zipped npz): clipcli gives a correct output or a
   clean refusal (exit 2/3/4, one `clipcli: error:` line, no output, no temp file); never
   exit 70, never an exception escaping `main()`, never a crash.
3. Differential: whatever the official reader refuses (safe_open + every tensor,
   np.load(allow_pickle=False) + every array), clipcli refuses too (exit 3).

Layers 2 and 3 run `main()` in a forked child per example (with an address-space cap and
a timeout): in-process speed, but a segfault in a C library (libhdf5, zlib) or a runaway
allocation fails the example instead of killing pytest.

Profiles (tests/conftest.py): `ci` by default, HYPOTHESIS_PROFILE=long for
thousands of examples per property.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import io
import json
import math
import os
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np
import pytest
from hostile_cli import MEMORY_CAP, TIMEOUT, exact_norm
from hypothesis import assume, given, note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from clipcli.cli.entry import main
from clipcli.jobs import roles


def _preload_clipcli() -> None:
    """Import every clipcli module now. The forked children inherit them, so a long run
    tests one consistent snapshot of the package even while it is being edited (a module
    imported lazily mid-run from newer sources fails with spurious ImportErrors)."""
    import importlib
    import pkgutil

    import clipcli

    for module in pkgutil.walk_packages(clipcli.__path__, "clipcli."):
        if module.name.endswith("__main__"):
            continue
        with contextlib.suppress(ImportError):  # optional extras (matplotlib for plot)
            importlib.import_module(module.name)


_preload_clipcli()

SUFFIXES = (".safetensors", ".npz", ".h5")

# ================================================================== layer 1: valid files

DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
}


def _elements(dtype: np.dtype[Any]) -> st.SearchStrategy[Any]:
    if dtype.kind == "i":
        return st.integers(-(2**31), 2**31 - 1)
    if dtype.itemsize == 8:
        # Norms of up to 64 values of 1e300 stay finite; values whose norm overflows
        # float64 are test_general_hostile's float64-max case.
        return st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False)
    width: Literal[16, 32, 64] = {2: 16, 4: 32, 8: 64}[dtype.itemsize]  # type: ignore[assignment]
    return st.floats(allow_nan=False, allow_infinity=False, width=width)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    return draw(hnp.arrays(dtype, shape, elements=_elements(dtype)))


def _plain_name(name: str) -> bool:
    """Not a path: no "." or ".." component (with / or \\ as separators; clipcli refuses
    npz members named like "..\\x" on purpose), and not safetensors' "__metadata__"."""
    parts = name.replace("\\", "/").split("/")
    return name != "__metadata__" and not any(part in (".", "..") for part in parts)


# Any Unicode but surrogates, NUL and '/' (a path separator in HDF5 and zip).
NAMES = st.text(
    st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=12
).filter(_plain_name)
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8)


@dataclass
class ValidCase:
    suffix: str
    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]
    h5_chunked: bool
    npz_compressed: bool
    mode: str  # "--global" or "--norm"
    limit: float


@st.composite
def valid_cases(draw: st.DrawFn) -> ValidCase:
    # Names of model weights: a name that says optimizer state or a BatchNorm statistic
    # ("running_mean", found by this test) is kept out of every clip with a note, and a
    # checkpoint of nothing else is refused (exit 2): tests/test_checkpoint_scope.py.
    weights = NAMES.filter(lambda name: roles.classify(name) is roles.Role.WEIGHT)
    names = draw(st.lists(weights, min_size=1, max_size=5, unique=True))
    tensors = {name: draw(arrays()) for name in names}
    floats = [a for a in tensors.values() if a.dtype.kind == "f"]
    mode = draw(st.sampled_from(["--global", "--norm"]))
    # Limits near the interesting norms (just under or over them: a tie within one ulp of
    # an exact norm is ambiguous) as well as anywhere.
    norms = [exact_norm(a) for a in floats]
    if floats:
        norms.append(exact_norm(np.concatenate([a.ravel().astype(np.float64) for a in floats])))
    near = [n * f for n in norms if 0 < n < math.inf for f in (0.5, 1 - 1e-9, 1 + 1e-9, 2.0)]
    choices = st.floats(1e-3, 1e3)
    if near:
        choices = st.one_of(choices, st.sampled_from(near).filter(lambda c: 1e-300 < c < 1e300))
    return ValidCase(
        suffix=draw(st.sampled_from(SUFFIXES)),
        tensors=tensors,
        metadata=draw(st.dictionaries(NAMES, TEXT, max_size=2)),
        h5_chunked=draw(st.booleans()),
        npz_compressed=draw(st.booleans()),
        mode=mode,
        limit=draw(choices),
    )


def write_official(case: ValidCase, path: Path) -> None:
    if case.suffix == ".safetensors":
        save_file(case.tensors, str(path), metadata=case.metadata or None)
    elif case.suffix == ".npz":
        # What np.savez does, without its keyword-argument names ("file", "allow_pickle").
        method = zipfile.ZIP_DEFLATED if case.npz_compressed else zipfile.ZIP_STORED
        with zipfile.ZipFile(path, "w", method, allowZip64=True) as archive:
            for name, array in case.tensors.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
    else:
        with h5py.File(path, "w") as f:
            for key, value in case.metadata.items():
                f.attrs[key] = value
            for name, array in case.tensors.items():
                chunked = case.h5_chunked and array.ndim > 0 and array.size > 0
                if chunked:
                    f.create_dataset(name, data=array, chunks=True, compression="gzip")
                else:
                    f.create_dataset(name, data=array)


def read_official(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {key: loaded[key] for key in loaded.files}
    found: dict[str, np.ndarray] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            found[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


ULP_SLACK = 2.0**-50  # ~4 ulp: the checker's own norm is exact only to ~1 ulp
TIE = 1e-12  # a tensor norm this close to the limit may go either way


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _scaled_like(before: np.ndarray, after: np.ndarray, limit: float, norm: float) -> bool:
    """after == before * limit / norm, up to rounding to the tensor's dtype (and a looser
    bound for the small extra shrink a limit-keeping scale choice may apply). The scale is
    kept as mantissa ratio x 2**k: limit / norm alone can underflow float64 (1e-124 / 1e198),
    and so can before / norm (1e-284 / 1e39)."""
    info = np.finfo(before.dtype)
    (m_limit, e_limit), (m_norm, e_norm) = math.frexp(limit), math.frexp(norm)
    expected = np.ldexp(before.astype(np.float64) * (m_limit / m_norm), e_limit - e_norm)
    atol = 4 * float(info.smallest_subnormal)
    return bool(np.allclose(after.astype(np.float64), expected, rtol=2e-3, atol=atol))


def _representable(limit: float, array: np.ndarray) -> bool:
    """Whether values of a tensor scaled to norm `limit` stay well inside its dtype's
    normal range (else rounding them to zero is right, and no lower bound holds)."""
    return limit >= 1e4 * float(np.finfo(array.dtype).tiny) * math.sqrt(max(1, array.size))


def check_clip_invariants(case: ValidCase, out: dict[str, np.ndarray]) -> None:
    src = case.tensors
    assert sorted(out) == sorted(src), "tensor names changed"
    for name, array in src.items():
        assert out[name].dtype == array.dtype, name
        assert out[name].shape == array.shape, name
        if array.dtype.kind != "f":
            assert _same_bits(out[name], array), f"integer tensor {name!r} changed"
    floats = [name for name, array in src.items() if array.dtype.kind == "f"]
    limit = case.limit
    if case.mode == "--global":
        everything = [src[n].ravel().astype(np.float64) for n in floats]
        total = exact_norm(np.concatenate(everything)) if everything else 0.0
        note(f"global norm {total!r}, limit {limit!r}")
        if total <= limit * (1 - TIE):
            for name in floats:
                assert _same_bits(out[name], src[name]), f"{name!r} changed, G <= C"
        elif total >= limit * (1 + TIE):
            after = exact_norm(np.concatenate([out[n].ravel().astype(np.float64) for n in floats]))
            assert after <= limit * (1 + ULP_SLACK), f"global norm after {after!r} > {limit!r}"
            if all(_representable(limit, src[n]) for n in floats):
                assert after >= 0.99 * limit, f"over-clipped: {after!r} for limit {limit!r}"
            for name in floats:
                assert _scaled_like(src[name], out[name], limit, total), name
        return
    for name in floats:
        norm = exact_norm(src[name])
        if norm <= limit * (1 - TIE):
            assert _same_bits(out[name], src[name]), f"{name!r} changed, norm {norm!r} <= C"
        elif norm >= limit * (1 + TIE):
            after = exact_norm(out[name])
            assert after <= limit * (1 + ULP_SLACK), f"{name!r}: norm after {after!r} > C"
            if _representable(limit, src[name]):
                assert after >= 0.99 * limit, f"{name!r} over-clipped: {after!r}"
            assert _scaled_like(src[name], out[name], limit, norm), name


@given(case=valid_cases())
def test_valid_checkpoints_keep_the_clip_invariants(case: ValidCase) -> None:
    # numpy's repr rounds to 8 digits; a reproduction needs the exact values.
    note(f"exact: { {k: [float(x).hex() for x in v.ravel()] for k, v in case.tensors.items()} }")
    with tempfile.TemporaryDirectory() as directory:
        src = Path(directory) / f"in{case.suffix}"
        out = Path(directory) / f"out{case.suffix}"
        write_official(case, src)
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["clip", case.mode, repr(case.limit), "--quiet", str(src), str(out)])
        err = stderr.getvalue()
        assert code == 0, err
        assert err == ""
        check_clip_invariants(case, read_official(out))
        if case.suffix == ".safetensors":
            with safe_open(str(out), framework="np") as handle:
                assert (handle.metadata() or {}) == case.metadata
        assert [p.name for p in Path(directory).iterdir() if p.name.startswith(".")] == []


# ================================================================== layer 2: mutated files


def _seed_safetensors() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "seed.safetensors"
        save_file(
            {
                "embed.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
                "norm.bias": np.ones(4, np.float16),
                "head.weight": np.linspace(-1, 1, 5),
                "step": np.array(7, dtype=np.int64),
                "empty": np.zeros((0, 3), np.float32),
            },
            str(path),
            metadata={"format": "pt"},
        )
        return path.read_bytes()


def _seed_npz(compressed: bool) -> bytes:
    buffer = io.BytesIO()
    save = np.savez_compressed if compressed else np.savez
    save(
        buffer,
        a=np.arange(6.0).reshape(2, 3),
        b=np.ones(4, np.float16),
        c=np.array(3, np.int32),
        d=np.asfortranarray(np.arange(6, dtype=">f4").reshape(2, 3)),
    )
    return buffer.getvalue()


def _seed_h5(compressed: bool) -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "seed.h5"
        with h5py.File(path, "w") as f:
            f.attrs["note"] = "seed"
            f.create_dataset("g/a", data=np.arange(6.0).reshape(2, 3))
            kwargs: dict[str, Any] = {"chunks": (2,)}
            if compressed:
                kwargs.update(compression="gzip", shuffle=True, fletcher32=True)
            f.create_dataset("b", data=np.ones(4, np.float32), **kwargs)
            f.create_dataset("c", data=np.int32(5))
        return path.read_bytes()


SEEDS: dict[str, tuple[str, bytes]] = {
    "safetensors": (".safetensors", _seed_safetensors()),
    "npz_stored": (".npz", _seed_npz(False)),
    "npz_deflated": (".npz", _seed_npz(True)),
    "h5_contiguous": (".h5", _seed_h5(False)),
    "h5_filtered": (".h5", _seed_h5(True)),
}

ODD_NUMBERS: list[Any] = [
    -1, 0, 1, 3, 7, 2**31, 2**32 + 4, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, 10**30,
    1.5, 4.0, 1e308, True, False, None, "4", [], {}, [0, 4],
]  # fmt: skip
ODD_DTYPES = [
    "F32",
    "F16",
    "F64",
    "BF16",
    "I64",
    "U8",
    "BOOL",
    "C64",
    "F8_E4M3",
    "F4",
    "f32",
    "",
    5,
]


def _json_mutation(draw: st.DrawFn, header: dict[str, Any]) -> bytes:
    """Edit the parsed header: replace a number, a dtype or a whole field, delete a key,
    duplicate or swap entries. Returns the new header text (duplicates need raw text)."""
    names = [n for n in header if n != "__metadata__"]
    kind = draw(st.sampled_from(["number", "dtype", "delete", "duplicate", "swap", "metadata"]))
    if kind == "duplicate" and names:
        name = draw(st.sampled_from(names))
        text = json.dumps(header, separators=(",", ":"))
        again = json.dumps({name: header[name]}, separators=(",", ":"))[1:-1]
        return (text[:-1] + "," + again + "}").encode()
    if kind == "metadata":
        header["__metadata__"] = copy.deepcopy(
            draw(
                st.sampled_from(
                    [None, [], "x", {"k": 1}, {"k": None}, {"k": {"a": "b"}}, {"k": "v"}]
                )
            )
        )
    elif names:
        name = draw(st.sampled_from(names))
        entry = header[name]
        if kind == "number" and isinstance(entry, dict):
            field = draw(st.sampled_from(["shape", "data_offsets"]))
            values = entry.get(field)
            if isinstance(values, list) and values:
                at = draw(st.integers(0, len(values) - 1))
                odd = st.sampled_from(ODD_NUMBERS) | st.integers(-(2**65), 2**65)
                values[at] = copy.deepcopy(draw(odd))
            else:
                entry[field] = copy.deepcopy(draw(st.sampled_from(ODD_NUMBERS)))
        elif kind == "dtype" and isinstance(entry, dict):
            entry["dtype"] = draw(st.sampled_from(ODD_DTYPES))
        elif kind == "delete":
            target = draw(st.sampled_from(["entry", "dtype", "shape", "data_offsets"]))
            if target == "entry" or not isinstance(entry, dict):
                del header[name]
            else:
                entry.pop(target, None)
        elif kind == "swap" and len(names) >= 2:
            other = draw(st.sampled_from([n for n in names if n != name]))
            header[name], header[other] = header[other], header[name]
    return json.dumps(header, separators=(",", ":")).encode()


def _mutate_safetensors_header(draw: st.DrawFn, data: bytearray) -> bytearray:
    if len(data) < 8:
        return data
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
    except (ValueError, RecursionError):
        return data
    if not isinstance(header, dict):
        return data
    text = _json_mutation(draw, header)
    if draw(st.booleans()):
        text += b" " * (-len(text) % 8)
    prefix = len(text) if draw(st.integers(0, 3)) else length  # usually keep it consistent
    return bytearray(struct.pack("<Q", prefix) + text + bytes(data[8 + length :]))


NPY_EDITS = [
    ("'<f8'", ["'<f4'", "'>f8'", "'|O'", "'<U5'", "'|V8'", "'<M8[s]'", "[('a', '<f8')]", "'x'"]),
    ("False", ["True", "1", "None"]),
    ("(2, 3)", ["(3, 2)", "(6,)", "(2, 4)", "(0,)", "(-1, 6)", "(10**12,)", "()", "[2, 3]"]),
    ("'shape'", ["'shapes'", "'shape', 'x': 1"]),
]


def _mutate_npz_members(draw: st.DrawFn, data: bytearray) -> bytearray:
    """Re-zip the archive with one member's .npy bytes edited (so that CRCs stay valid
    and the mutation reaches clipcli's .npy parser rather than the zip layer)."""
    try:
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
            members = [(info, archive.read(info)) for info in archive.infolist()]
    except Exception:
        return data
    if not members:
        return data
    index = draw(st.integers(0, len(members) - 1))
    info, member = members[index]
    kind = draw(st.sampled_from(["header", "truncate", "append", "rename", "duplicate"]))
    name = info.filename
    if kind == "header":
        old, replacements = draw(st.sampled_from(NPY_EDITS))
        member = member.replace(old.encode(), draw(st.sampled_from(replacements)).encode(), 1)
    elif kind == "truncate":
        member = member[: draw(st.integers(0, len(member)))]
    elif kind == "append":
        member += draw(st.binary(min_size=1, max_size=16))
    elif kind == "rename":
        name = draw(st.sampled_from(["a.npy", "../x.npy", "/x.npy", "x", "x/", "a", "x.npy.npy"]))
    members[index] = (info, member)
    if kind == "duplicate":
        members.append((info, member))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names
        with zipfile.ZipFile(buffer, "w") as archive:
            for (original, payload), new_name in zip(
                members,
                [name if i == index else m[0].filename for i, m in enumerate(members)],
                strict=True,
            ):
                archive.writestr(new_name, payload, compress_type=original.compress_type)
    return bytearray(buffer.getvalue())


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[str, ...] = tuple(SEEDS)) -> tuple[str, bytes]:
    suffix, seed = SEEDS[draw(st.sampled_from(seeds))]
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["flip", "truncate", "insert", "zero", "delete", "repeat"]
        if suffix == ".safetensors":
            kinds += ["length", "json", "json"]
        if suffix == ".npz":
            kinds += ["member", "member"]
        kind = draw(st.sampled_from(kinds))
        if kind == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "zero" and data:
            start = draw(st.integers(0, len(data) - 1))
            stop = min(len(data), start + draw(st.integers(1, 64)))
            data[start:stop] = bytes(stop - start)
        elif kind == "delete" and data:
            start = draw(st.integers(0, len(data) - 1))
            del data[start : start + draw(st.integers(1, 32))]
        elif kind == "repeat" and data:
            start = draw(st.integers(0, len(data) - 1))
            data[start:start] = data[start : start + draw(st.integers(1, 64))]
        elif kind == "length" and len(data) >= 8:
            (length,) = struct.unpack("<Q", bytes(data[:8]))
            new = draw(
                st.sampled_from([0, 1, length - 1, length + 1, length + 8, 2**63, 2**64 - 1])
                | st.integers(0, 2**64 - 1)
            )
            data[:8] = struct.pack("<Q", max(0, min(new, 2**64 - 1)))
        elif kind == "json":
            data = _mutate_safetensors_header(draw, data)
        elif kind == "member":
            data = _mutate_npz_members(draw, data)
    return suffix, bytes(data)


# ------------------------------------------------------------------ running in a child


def _child_body(work: Callable[[], dict[str, Any]], result_path: Path, timeout: float) -> None:
    """Runs in the forked child: cap memory, run `work`, write its result, never return."""
    status = 0
    # Die on our own if the parent is gone (interrupted) and we are stuck in a C loop.
    signal.alarm(math.ceil(timeout) + 5)
    try:
        soft_limit = _current_address_space() + MEMORY_CAP
        resource.setrlimit(resource.RLIMIT_AS, (soft_limit, resource.RLIM_INFINITY))
        result = work()
    except BaseException:
        result = {"exception": traceback.format_exc()}
        status = 1
    try:
        result_path.write_text(json.dumps(result))
    finally:
        os._exit(status)


def _current_address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def in_child(work: Callable[[], dict[str, Any]], timeout: float = TIMEOUT) -> dict[str, Any]:
    """Run `work` in a forked child; its JSON result, or {"failure": ...} if it crashed
    (signal), blew the timeout or raised."""
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
            pid = os.fork()
        if pid == 0:
            _child_body(work, result_path, timeout)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                partial = result_path.read_text() if result_path.exists() else ""
                return {"failure": f"timed out after {timeout}s {partial}"}
            time.sleep(0.002)
        if os.WIFSIGNALED(status):
            return {"failure": f"killed by signal {os.WTERMSIG(status)}"}
        if not result_path.exists():
            return {"failure": f"child exited {os.WEXITSTATUS(status)} without a result"}
        result: dict[str, Any] = json.loads(result_path.read_text())
        if "exception" in result:
            return {"failure": "exception escaped: " + result["exception"]}
        return result


def call_main(args: list[str]) -> tuple[int, str, str]:
    """main(args) with stdout and stderr captured at both the Python and the fd level (a C
    library writing to fd 2 would add lines to the real CLI's stderr too). Child only."""
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as fd_err:
        saved = os.dup(2)
        os.dup2(fd_err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(args)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        fd_err.seek(0)
        raw = fd_err.read().decode("utf-8", "replace")
    return code, out.getvalue(), err.getvalue() + raw


# ------------------------------------------------------------------ the official readers


NUMPY_SAFETENSORS = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "F32",
                     "F64", "C64"}  # fmt: skip


def official_verdict(path: Path) -> tuple[bool | None, bool]:
    """(refused, refused_at_open): does the official reader refuse this file, and does it
    refuse it before reading any data? refused is None when the official numpy reader
    cannot judge (bf16/fp8 tensors, which safetensors.numpy cannot load)."""
    if path.suffix == ".safetensors":
        try:
            handle = safe_open(str(path), framework="np")
        except Exception:
            return True, True
        with handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                dtype = handle.get_slice(key).get_dtype()
                if dtype not in NUMPY_SAFETENSORS:
                    return None, False
            try:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    handle.get_tensor(key)
            except Exception:
                return True, False
        return False, False
    try:
        # Our own handle: np.load leaks its file when it raises on a broken zip.
        with open(path, "rb") as raw:
            try:
                loaded = np.load(raw, allow_pickle=False)
            except Exception:
                return True, True
            with loaded:
                for key in loaded.files:
                    loaded[key]
    except Exception:
        return True, False
    return False, False


def output_problem(out: Path) -> str | None:
    """Why clipcli's own output is unreadable (by clipcli or the official reader), or None."""
    code, _, err = call_main(["norms", "--format", "json", str(out)])
    if code != 0:
        return f"clipcli cannot read its own output: {err}"
    try:
        if out.suffix == ".safetensors":
            # safe_open validates the whole header; safetensors.numpy cannot load bf16 and
            # fp8 tensors (clipcli can), so only the others are loaded.
            with safe_open(str(out), framework="np") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if handle.get_slice(key).get_dtype() in NUMPY_SAFETENSORS:
                        handle.get_tensor(key)
        else:
            read_official(out)
    except Exception as exc:
        return f"the official reader refuses clipcli's output: {type(exc).__name__}: {exc}"
    return None


def _check_refusal(step: str, code: int, err: str) -> None:
    assert code != 70, f"{step}: internal error (a bug): {err}"
    assert code in (0, 2, 3, 4), f"{step}: exit {code}: {err}"
    if code:
        assert err.endswith("\n"), f"{step}: {err!r}"
        assert err.count("\n") == 1, f"{step}: {err!r}"
        assert err.startswith("clipcli: error: "), f"{step}: {err!r}"
        assert "Traceback" not in err, f"{step}: {err!r}"
        assert "\x1b" not in err, f"{step}: {err!r}"
    else:
        assert err == "", f"{step}: exit 0 but stderr {err!r}"


def fuzz_one(suffix: str, data: bytes, differential: bool) -> dict[str, Any]:
    """Child only: run clipcli (and the official reader) on one mutated file."""
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        src = workdir / f"in{suffix}"
        src.write_bytes(data)
        out = workdir / f"out{suffix}"
        result: dict[str, Any] = {"log": []}
        if differential:
            refused, at_open = official_verdict(src)
            result["official"] = [refused, at_open]
        for step, args in (
            ("ls", ["ls", "--format", "json", str(src)]),
            ("norms", ["norms", "--format", "json", str(src)]),
            ("clip", ["clip", "--global", "1", "--quiet", str(src), str(out)]),
        ):
            code, _, err = call_main(args)
            result["log"].append([step, code, err])
        result["out_exists"] = out.exists()
        result["leftovers"] = sorted(p.name for p in workdir.iterdir() if p not in (src, out))
        if out.exists():
            result["output_problem"] = output_problem(out)
        return result


def _describe(data: bytes) -> str:
    return f"{len(data)} bytes: {data[:200]!r}..."


FAMILIES = {
    "safetensors": ("safetensors",),
    "npz": ("npz_stored", "npz_deflated"),
    "hdf5": ("h5_contiguous", "h5_filtered"),
}
# Healthy examples take ~0.1 s; a hung one is cut short so that shrinking stays bearable.
FUZZ_TIMEOUT = 10.0


@pytest.mark.slow  # ~2 s per family
@pytest.mark.parametrize("family", list(FAMILIES))
@given(data=st.data())
def test_mutated_files_give_output_or_clean_refusal(family: str, data: st.DataObject) -> None:
    """One property per format family, so that a finding in one (e.g. a libhdf5 hang)
    does not hide the others."""
    suffix, payload = data.draw(mutated(seeds=FAMILIES[family]), label="case")
    note(_describe(payload))
    result = in_child(lambda: fuzz_one(suffix, payload, differential=False), FUZZ_TIMEOUT)
    assert "failure" not in result, result["failure"]
    for step, code, err in result["log"]:
        _check_refusal(step, code, err)
    clip_code = result["log"][2][1]
    assert result["leftovers"] == [], f"temp files left behind: {result['leftovers']}"
    if clip_code:
        assert not result["out_exists"], "refused, yet OUT was written"
    else:
        assert result["out_exists"]
        assert result["output_problem"] is None, result["output_problem"]


@pytest.mark.slow  # ~2 s
@given(case=mutated(seeds=("safetensors", "npz_stored", "npz_deflated")))
def test_what_the_official_readers_refuse_clipcli_refuses(case: tuple[str, bytes]) -> None:
    """safetensors: refused by safe_open -> `ls` and `norms` exit 3; refused only when
    reading a tensor -> `norms` exits 3. npz the same with np.load(allow_pickle=False)."""
    suffix, data = case
    note(_describe(data))
    result = in_child(lambda: fuzz_one(suffix, data, differential=True), FUZZ_TIMEOUT)
    assert "failure" not in result, result["failure"]
    refused, at_open = result["official"]
    assume(refused is not None)
    log = {step: (code, err) for step, code, err in result["log"]}
    for step in log:
        _check_refusal(step, *log[step])
    if refused:
        assert log["norms"][0] == 3, f"official reader refuses; clipcli norms: {log['norms']}"
        if at_open:
            assert log["ls"][0] == 3, f"official reader refuses at open; clipcli ls: {log['ls']}"


def test_seeds_are_valid_and_clean() -> None:
    """Every seed passes through clipcli cleanly, so that what the mutations find is theirs."""
    for name, (suffix, data) in SEEDS.items():
        result = in_child(functools.partial(fuzz_one, suffix, data, differential=True))
        assert "failure" not in result, (name, result["failure"])
        assert [code for _, code, _ in result["log"]] == [0, 0, 0], (name, result["log"])
        assert result["output_problem"] is None, (name, result["output_problem"])
        if suffix != ".h5":
            assert result["official"] == [False, False], name


def test_a_crash_in_the_child_is_reported() -> None:
    """The fork harness itself: a segfault and a hang are failures, not silence."""

    def segfault() -> dict[str, Any]:
        faulthandler.disable()  # no traceback dump on pytest's stderr for this one
        os.kill(os.getpid(), signal.SIGSEGV)
        return {}

    assert "signal" in in_child(segfault)["failure"]

    def hang() -> dict[str, Any]:
        time.sleep(5)
        return {}

    assert "timed out" in in_child(hang, timeout=0.5)["failure"]
    assert "exception" in in_child(lambda: 1 / 0)["failure"]  # type: ignore[arg-type, return-value]
