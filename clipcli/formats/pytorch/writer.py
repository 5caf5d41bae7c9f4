"""PyTorchWriter: a state dict in torch's zip format (torch >= 1.6), which
`torch.load(weights_only=True)` accepts, written without torch.

The file is what `torch.save(state_dict, f)` writes: a zip of stored (uncompressed)
records under one folder (`archive/`): `data.pkl`, the pickle of a dict name -> tensor;
`data/<key>`, one record per storage, its data starting at a multiple of 64 bytes (torch's
`.storage_alignment`, so that `torch.load(mmap=True)` maps it); `.format_version`,
`.storage_alignment`, `byteorder` ("little") and `version` ("3").

The pickle is written here, opcode by opcode, and names only globals that torch's
weights-only unpickler allows and our own reader's allow-list resolves:
`torch._utils._rebuild_tensor_v2` with a typed storage class (`torch.FloatStorage`, ...)
where torch has one for the dtype, else `torch._utils._rebuild_tensor_v3` with
`torch.storage.UntypedStorage` and the dtype (`torch.float8_e4m3fn`, `torch.uint16`), as
torch itself saves them; `collections.OrderedDict` for the (empty) backward hooks.

Every tensor is C-contiguous in a storage of its own, except a tied tensor (the source
reader says which: the same view of one storage under a second name), which names its
first one's storage: shared storages are written once. Its bytes are checked to equal
the first one's as they stream past (the plan gives both the same action).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer, ordered_bytes
from clipcli.formats.npz.metadata import metadata_loss, metadata_loss_text

if TYPE_CHECKING:
    import numpy as np

ROOT = "archive"
ALIGNMENT = 64  # torch's _get_storage_alignment()
_PADDING_FIELD = 0x4246  # "FB": the extra field torch pads local headers with
_LOCAL_HEADER_BYTES = 30
_ZIP64_LOCAL_EXTRA = 20  # zipfile's zip64 field in a local header (id, size, two sizes)

# numpy's name -> torch's typed storage class (rebuilt by _rebuild_tensor_v2).
STORAGE_CLASSES = {
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
# numpy's name -> torch's dtype, for dtypes torch has no typed storage class for (an
# UntypedStorage of bytes, rebuilt by _rebuild_tensor_v3 with the dtype).
UNTYPED_DTYPES = {
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
}


# ---------------------------------------------------------------- the pickle


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])  # BININT1
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)  # BININT
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data  # LONG1


def _text(value: str) -> bytes:
    data = value.encode("utf-8")
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def _ints(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"  # MARK ... TUPLE


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tensor_pickle(info: TensorInfo, key: str) -> bytes:
    """The opcodes that rebuild `info` as a C-contiguous tensor over storage `key`."""
    dtype = info.dtype_name
    typed = STORAGE_CLASSES.get(dtype)
    if typed is not None:
        storage_class, numel = _global("torch", typed), info.numel
    else:
        storage_class, numel = _global("torch.storage", "UntypedStorage"), info.nbytes
    persistent = (
        b"(" + _text("storage") + storage_class + _text(key) + _text("cpu") + _int(numel) + b"t"
    ) + b"Q"  # BINPERSID
    hooks = _global("collections", "OrderedDict") + b")R"  # OrderedDict()
    arguments = (
        persistent + _int(0) + _ints(info.shape) + _ints(c_strides(info.shape)) + b"\x89" + hooks
    )
    if typed is not None:
        rebuild = _global("torch._utils", "_rebuild_tensor_v2")
    else:
        rebuild = _global("torch._utils", "_rebuild_tensor_v3")
        arguments += _global("torch", UNTYPED_DTYPES[dtype])
    return rebuild + b"(" + arguments + b"tR"  # REDUCE


def state_dict_pickle(tensors: Iterable[tuple[TensorInfo, str]]) -> bytes:
    """A protocol-2 pickle of {name: tensor} (a plain dict, as torch.save of a dict)."""
    items = b"".join(_text(info.name) + tensor_pickle(info, key) for info, key in tensors)
    return b"\x80\x02}(" + items + b"u."  # PROTO 2, EMPTY_DICT, MARK, ..., SETITEMS, STOP


# ---------------------------------------------------------------- the writer


class PyTorchWriter(Writer):
    format_name = "pytorch"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        self.check_tensors(checkpoint.infos)
        self._tied = _ties(checkpoint.source)
        self._firsts = set(self._tied.values())
        self._keys: dict[str, str] = {}  # tensor -> its storage's key
        self._digests: dict[str, bytes] = {}  # a tied tensor's first -> its bytes' digest
        self._written: list[tuple[TensorInfo, str]] = []
        self._storages = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() or abort()
        try:
            self._zip = zipfile.ZipFile(self._file, "w", zipfile.ZIP_STORED, allowZip64=True)
        except BaseException:
            self._file.close()
            raise

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        name = info.dtype_name
        if name in STORAGE_CLASSES or name in UNTYPED_DTYPES:
            return None
        return f"PyTorch has no {name} dtype; write .safetensors instead"

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """A state dict of tensors holds no file metadata. (What a PyTorch reader found
        about the file it read, `pytorch.layout` and the like, is not in joined_metadata.)"""
        losses = super().structure_losses(source)
        lost, _ = metadata_loss(source.joined_metadata())
        if lost:
            losses.append(metadata_loss_text(lost))
        nested = source.metadata.get("pytorch.nested")
        if nested:  # the reader's description of a nested PyTorch file
            losses.append(
                f"the nesting of the checkpoint's containers ({nested}): "
                "this .pt holds one flat dict of the dotted names"
            )
        return losses

    def _aligned(self, name: str, nbytes: int) -> tuple[zipfile.ZipInfo, bool]:
        """A record whose data will start at a multiple of ALIGNMENT: the local header's
        extra field pads it, as torch's writer does."""
        entry = zipfile.ZipInfo(f"{ROOT}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        entry.compress_type = zipfile.ZIP_STORED
        entry.file_size = nbytes
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own test when it writes
        start = self._zip.start_dir  # where the next local header goes
        fixed = _LOCAL_HEADER_BYTES + len(entry.filename.encode()) + 4
        fixed += _ZIP64_LOCAL_EXTRA if zip64 else 0
        pad = -(start + fixed) % ALIGNMENT
        assert (start + fixed + pad) % ALIGNMENT == 0
        entry.extra = struct.pack("<HH", _PADDING_FIELD, pad) + b"Z" * pad
        return entry, zip64

    def _record(self, name: str, data: bytes) -> None:
        entry = zipfile.ZipInfo(f"{ROOT}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        self._zip.writestr(entry, data, compress_type=zipfile.ZIP_STORED)

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        first = self._tied.get(info.name)
        if first is not None and first in self._keys:
            self._check_tie(info, first, chunks)
            return
        key = str(self._storages)
        entry, zip64 = self._aligned(f"data/{key}", info.nbytes)
        digest = hashlib.sha256() if info.name in self._firsts else None
        with self._zip.open(entry, "w", force_zip64=zip64) as record:
            for chunk in chunks:
                data = ordered_bytes(chunk, info.dtype, "<")  # the `byteorder` record says little
                record.write(data)
                if digest is not None:
                    digest.update(data)
        if digest is not None:
            self._digests[info.name] = digest.digest()
        self._storages += 1
        self._keys[info.name] = key
        self._written.append((info, key))

    def _check_tie(self, info: TensorInfo, first: str, chunks: Iterable[np.ndarray]) -> None:
        """A tied tensor names its first one's storage; its bytes must be that storage's."""
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(ordered_bytes(chunk, info.dtype, "<"))
        if digest.digest() != self._digests[first]:
            raise AssertionError(f"{info.name}: tied to {first} but written with other bytes")
        self._keys[info.name] = self._keys[first]
        self._written.append((info, self._keys[first]))

    def close(self) -> None:
        self._record("data.pkl", state_dict_pickle(self._written))
        self._record(".format_version", b"1")
        self._record(".storage_alignment", str(ALIGNMENT).encode())
        self._record("byteorder", b"little")
        self._record("version", b"3\n")
        self._zip.close()
        self._file.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._zip.close()
        with contextlib.suppress(OSError, ValueError):
            self._file.close()


def _ties(source: Reader | None) -> dict[str, str]:
    """Tied tensor -> its first, from a PyTorch source (the one reader that has ties)."""
    from clipcli.formats.pytorch.reader import PyTorchReader

    return source.tied() if isinstance(source, PyTorchReader) else {}
