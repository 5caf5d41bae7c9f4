"""Model directories: finding one, staying inside it, and its index file.

See clipcli.formats.sharded for the layout and the choices made.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from clipcli.errors import InputError
from clipcli.formats import registry
from clipcli.formats.safetensors import MAX_HEADER_BYTES
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import is_pseudo_path, out_of_descriptors, read_input, real_path_of

# What the shards are is the registry's to say (the model directory's entry names them).
SHARD_FORMAT = registry.shard_format(registry.MODEL_DIRECTORY)
FORMAT_NAME = registry.MODEL_DIRECTORY.name
SHARD_SUFFIX = SHARD_FORMAT.suffixes[0]
INDEX_SUFFIX = SHARD_SUFFIX + ".index.json"
DEFAULT_INDEX_NAME = "model" + INDEX_SUFFIX
SINGLE_FILE_NAME = "model" + SHARD_SUFFIX


class DirectoryNames(NamedTuple):
    """How one kind of model directory names its files (transformers' names)."""

    format: registry.Format  # the directory's registry entry
    shard_suffix: str
    index_suffix: str
    default_index: str
    single_file: str
    # A directory without an index: its one file of shard_suffix (safetensors), or only
    # the file named single_file (PyTorch: a `.bin` beside it may be training_args.bin).
    single_by_suffix: bool

    @property
    def shard_format(self) -> registry.Format:
        return registry.shard_format(self.format)

    @property
    def label(self) -> str:
        return self.shard_format.label


SAFETENSORS_NAMES = DirectoryNames(
    registry.MODEL_DIRECTORY,
    SHARD_SUFFIX,
    INDEX_SUFFIX,
    DEFAULT_INDEX_NAME,
    SINGLE_FILE_NAME,
    single_by_suffix=True,
)
PYTORCH_NAMES = DirectoryNames(
    registry.PYTORCH_DIRECTORY,
    ".bin",
    ".bin.index.json",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    single_by_suffix=False,
)
# In the order a directory is searched: safetensors first, where a model has both.
DIRECTORY_KINDS = (SAFETENSORS_NAMES, PYTORCH_NAMES)
_PYTORCH_STEM = "pytorch_model"


def as_safetensors_name(name: str) -> str:
    """The name transformers gives the safetensors twin of a PyTorch shard or index
    (pytorch_model-00001-of-00002.bin -> model-00001-of-00002.safetensors,
    pytorch_model.bin.index.json -> model.safetensors.index.json); other names as they are.
    A directory written out is always safetensors (the model directory's writer)."""
    for suffix, new_suffix in (
        (PYTORCH_NAMES.index_suffix, INDEX_SUFFIX),
        (PYTORCH_NAMES.shard_suffix, SHARD_SUFFIX),
    ):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if stem.startswith(_PYTORCH_STEM):
                stem = "model" + stem[len(_PYTORCH_STEM) :]
            return stem + new_suffix
    return name


MAX_INDEX_BYTES = MAX_HEADER_BYTES  # an index is smaller than the headers it summarises
# Index metadata that only summarises the tensors (transformers writes total_size, and
# since 5.x total_parameters): one joined file loses nothing without it, and diff does not
# count it as a difference.
DERIVED_INDEX_KEYS = frozenset({"total_size", "total_parameters"})

# Files (at any depth) that hold the model's weights in another form, by suffix: never
# copied beside clipped weights, which they would ship again unclipped. Files of no known
# suffix are also judged by content (weights_by_content). Every suffix a reader of the
# registry claims is one, whatever this list says.
OTHER_WEIGHT_SUFFIXES = frozenset(
    {
        SHARD_SUFFIX,
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".hdf5",
        ".keras",
        ".npz",
        ".npy",
        ".msgpack",
        ".gguf",
        ".ggml",
        ".onnx",
        ".onnx_data",
        ".tflite",
        ".pb",  # a TensorFlow graph, frozen graphs holding the weights as constants
        ".pkl",
        ".pickle",
        ".joblib",
        ".ot",  # rust-bert
        ".params",  # MXNet
        ".pdparams",  # PaddlePaddle
        ".mlmodel",
        ".pte",  # ExecuTorch
        ".distcp",  # torch.distributed checkpoints
        ".llamafile",
    }
) | {suffix for fmt in registry.FORMATS if fmt.readable for suffix in fmt.suffixes}
# TensorFlow checkpoints: variables.data-00000-of-00001 and its variables.index.
_TF_CHECKPOINT = re.compile(r"\.data-\d+-of-\d+$|\.index$")

# Folders that hold the weights again in another form, or version-control objects (a
# git-lfs clone keeps every weight file again under .git/lfs): never copied.
LEFT_OUT_FOLDERS = frozenset({"onnx", "openvino", ".git"})
MAX_SIDE_ENTRIES = 100_000  # files and folders beside the weights; real models hold dozens
MAX_SIDE_DEPTH = 16


# ---------------------------------------------------------------- finding a model directory


def resolve_sharded(path: Path) -> tuple[Path, Path | None, DirectoryNames] | None:
    """(directory, index, names) for a sharded checkpoint, (directory, None, names) for a
    single-file model directory, None when PATH is not a directory or an index (an
    ordinary file). Safetensors files are looked for first, then PyTorch's
    (pytorch_model.bin.index.json, pytorch_model.bin): a model saved both ways is read
    from its safetensors, and the `.bin` files are left out (ShardedReader says so).

    A directory is always a model directory or an error: there is nothing else to read.
    """
    if path.is_dir():
        _check_listable(path)
        for names in DIRECTORY_KINDS:
            index = find_index(path, names)
            if index is not None:
                return path, index, names
            if single_model_file(path, names, required=False) is not None:
                return path, None, names
        single_model_file(path, SAFETENSORS_NAMES)  # raises: none of either
    for names in DIRECTORY_KINDS:
        if path.name.endswith(names.index_suffix) and os.path.lexists(path):
            return path.parent, path, names  # a FIFO or device is refused when it is opened
    return None


def _check_listable(directory: Path) -> None:
    """glob() passes over a directory it may not list, or list but not enter, in silence,
    which would then be called a directory with no model in it: say why instead."""
    try:
        with os.scandir(directory):
            pass
    except OSError as exc:
        problem = f"cannot list the directory: {exc.strerror}"
        raise out_of_descriptors(exc, directory) or InputError(directory, problem) from None
    try:
        os.stat(os.path.join(directory, "."))  # (pathlib would drop the ".")
    except OSError as exc:
        raise InputError(directory, f"cannot enter the directory: {exc.strerror}") from None


def not_a_directory(path: Path) -> bool:
    """Files, FIFOs, devices, dangling links: entries that are refused by name when they
    are not regular files (is_file() would pass over them in silence)."""
    return os.path.lexists(path) and not path.is_dir()


def find_index(directory: Path, names: DirectoryNames = SAFETENSORS_NAMES) -> Path | None:
    """model.safetensors.index.json, else the one *.safetensors.index.json present (and
    PyTorch's pytorch_model.bin.index.json, *.bin.index.json likewise)."""
    default = directory / names.default_index
    if os.path.lexists(default):
        return default
    found = sorted(p for p in directory.glob("*" + names.index_suffix) if not_a_directory(p))
    if len(found) > 1:
        listed = ", ".join(p.name for p in found)
        raise InputError(
            directory, f"several {names.label} indexes ({listed}); pass the one to use"
        )
    return found[0] if found else None


def single_model_file(
    directory: Path, names: DirectoryNames = SAFETENSORS_NAMES, required: bool = True
) -> Path | None:
    """The directory's one *.safetensors file (or its pytorch_model.bin), for a model saved
    without shards; None when there is none and none is `required`."""
    pattern = "*" + names.shard_suffix if names.single_by_suffix else names.single_file
    found = sorted(p for p in directory.glob(pattern) if not_a_directory(p))
    if not found:
        if not required:
            return None
        raise InputError(
            directory,
            "no safetensors index or model file in this directory "
            f"(nor {PYTORCH_NAMES.single_file} or {PYTORCH_NAMES.default_index})",
        )
    if len(found) > 1:
        listed = ", ".join(p.name for p in found)
        raise InputError(
            directory, f"{len(found)} {names.label} files ({listed}) but no index to join them"
        )
    return found[0]


# ---------------------------------------------------------------- staying inside the directory


def allowed_roots(directory: Path) -> list[Path]:
    """Where the directory's files may really live.

    - The model directory itself, as the user named it (symlinks in the name the user
      typed are the user's choice), resolved. Never `/`: that would allow every file.
    - For a Hugging Face hub cache snapshot (<entry>/snapshots/<revision>/, where <entry>
      is models--org--name), the entry's own blobs/ store, and only when blobs/ is a real
      directory: a blobs/ symlink (to `/`, to a home directory) is a link the user did not
      name, and following it would let the snapshot's files point anywhere.
    Nothing above the cache entry is ever a root.
    """
    real = directory.resolve()
    if real == Path(real.anchor):
        raise InputError(directory, "the filesystem root is not a model directory")
    if is_pseudo_path(real):
        raise InputError(directory, "is a kernel or device directory (/proc, /sys, /dev)")
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent != real.parent:
        entry = real.parent.parent
        blobs = entry / "blobs"
        if not blobs.is_symlink() and blobs.is_dir() and entry != Path(entry.anchor):
            roots.append(blobs)
    return roots


def opened_inside(fd: int, entry: Path, roots: Iterable[Path]) -> None:
    """Refuse an opened file that does not lie inside `roots`, judged by where the
    descriptor itself leads (`inputs:real_path_of`: the kernel's name for it, or without
    /proc the resolved name only if it is this very file): checking a name and then
    opening it leaves a moment in which a link or a folder on the way can be swapped."""
    real = real_path_of(fd, entry)
    if is_pseudo_path(real) or not any(real.is_relative_to(root) for root in roots):
        raise InputError(
            entry,
            f"turned out to be {real}, outside the model directory "
            "(swapped while being opened); refusing it",
        )


def real_path_inside(entry: Path, roots: Iterable[Path]) -> Path:
    """The file `entry` stands for, refusing dangling links, links out of `roots` and
    kernel or device files."""
    try:
        real = entry.resolve(strict=True)
    except FileNotFoundError:
        problem = "is a dangling symlink" if entry.is_symlink() else "does not exist"
        raise InputError(entry, problem) from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise InputError(entry, f"cannot resolve: {exc}") from None
    if is_pseudo_path(real):
        raise InputError(entry, f"links to {real}, a kernel or device file; refusing it")
    if not any(real.is_relative_to(root) for root in roots):
        raise InputError(entry, f"links to {real}, outside the model directory; refusing it")
    return real


def check_shard_name(
    index_path: Path, tensor: str, shard: object, suffix: str = SHARD_SUFFIX
) -> str:
    """A shard must be a plain *.safetensors (*.bin) file name: no path may leave the
    directory."""
    if not isinstance(shard, str):
        raise InputError(index_path, f"shard {shard!r} is not a string", tensor)
    plain = shard not in ("", ".", "..") and not any(c in shard for c in "/\\\0")
    if not plain or not shard.endswith(suffix):
        raise InputError(index_path, f"shard {shard!r} is not a plain *{suffix} file name", tensor)
    return shard


# ---------------------------------------------------------------- the index file


def load_index(
    index_path: Path, real: Path | None = None, names: DirectoryNames = SAFETENSORS_NAMES
) -> tuple[dict[str, Any], dict[str, str], FileIdentity]:
    """The index document, its weight map, with every structural check done, and the
    identity of the file read."""
    raw, identity = read_input(index_path, MAX_INDEX_BYTES, real)
    document, duplicates = parse_json_object(index_path, raw)
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise InputError(index_path, 'index has no "weight_map" object')
    for key, owner in duplicates:
        if owner is weight_map:
            raise InputError(index_path, "listed twice in the index", key)
        raise InputError(index_path, f"key {key!r} appears twice in the index")
    if not weight_map:
        raise InputError(index_path, "the index's weight_map lists no tensors")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise InputError(index_path, 'index "metadata" is not an object')
    suffix = names.shard_suffix
    checked = {t: check_shard_name(index_path, t, s, suffix) for t, s in weight_map.items()}
    return document, checked, identity


def parse_json_object(
    index_path: Path, raw: bytes
) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """The JSON object, and each duplicate key with the object it was repeated in.

    json keeps the last of two equal keys silently; a tensor mapped to two shards must be
    an error instead, so duplicates are collected and judged once we know which object
    (the weight map or another one) holds them.
    """
    duplicates: list[tuple[str, dict[str, Any]]] = []

    def collect(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                duplicates.append((key, result))
            result[key] = value
        return result

    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=collect)
    except UnicodeDecodeError:
        raise InputError(index_path, "index is not valid UTF-8") from None
    except RecursionError:
        raise InputError(index_path, "index JSON is nested too deeply") from None
    except ValueError as exc:
        raise InputError(index_path, f"index is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InputError(index_path, "index is not a JSON object")
    return document, duplicates


def flatten(metadata: Mapping[str, Any]) -> dict[str, str]:
    """String metadata as every format reports it: non-strings as their JSON text."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def holds_weights(name: str) -> bool:
    """Whether a file's name says it holds weights (or indexes them)."""
    return (
        name.endswith(".index.json")
        or Path(name).suffix.lower() in OTHER_WEIGHT_SUFFIXES
        or _TF_CHECKPOINT.search(name) is not None
    )


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_PICKLES = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))
_GGML = (b"GGUF", b"lmgg", b"tjgg", b"fmgg", b"algg")  # GGUF, and GGML's older magics


# Protocols 0 and 1 have no \x80 header: a pickle is known by parsing its opcodes (never
# running them) from the start. Text files fail within a few bytes.
_TEXT_PICKLE_STARTS = frozenset(b"(c}])NILFSVXUKJMGT")
_PICKLE_PROBE = 64 << 10
_PICKLE_TAIL = 1 << 10  # a probe cut inside an opcode fails this close to its end


def _is_text_pickle(fd: int, size: int) -> bool:
    """Whether the file starts with a protocol-0/1 pickle that names a class (GLOBAL or
    INST, as every pickled array does): parsed to its STOP, or without a fault until the
    probe cuts it short. pickletools only reads opcodes; nothing is imported or run."""
    head = os.pread(fd, _PICKLE_PROBE, 0)
    if not head or head[0] not in _TEXT_PICKLE_STARTS:
        return False
    import io
    import pickletools

    seen: set[str] = set()
    stream = io.BytesIO(head)
    try:
        for opcode, _, _ in pickletools.genops(stream):
            seen.add(opcode.name)
            if opcode.name == "STOP":
                return _builds_an_object(seen)
    except (ValueError, UnicodeDecodeError, EOFError):
        # Garbage fails where it starts; a pickle cut by the probe, where the probe ends.
        cut_short = size > len(head) and stream.tell() >= len(head) - _PICKLE_TAIL
        return cut_short and _builds_an_object(seen)
    return False


def _builds_an_object(opcodes: set[str]) -> bool:
    """A class named (GLOBAL/INST) and something built with it (MARK, REDUCE, BUILD): lines
    of text can read as GLOBALs alone ("cat\ndog\n" is the global cat.dog)."""
    return bool(opcodes & {"GLOBAL", "INST"}) and bool(opcodes & {"MARK", "REDUCE", "BUILD"})


def weights_by_content(fd: int, size: int) -> str | None:
    """What weight format a file's first bytes say it is, whatever its name, or None: a
    `weights` file without a suffix, or a renamed checkpoint, is still weights."""
    head = os.pread(fd, 16, 0)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "a zip archive (npz, .keras and PyTorch checkpoints are zips)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array"
    if head.startswith(_PICKLES) or _is_text_pickle(fd, size):
        return "a pickle (PyTorch's older checkpoints)"
    if head.startswith(_GGML):
        return "a GGUF/GGML file"
    if head[4:8] == b"TFL3":
        return "a TensorFlow Lite model"
    # safetensors: an 8-byte header length that fits the file, then the JSON header. (A
    # JSON file's first 8 bytes read as a length are ~10**18, far past its size.)
    if head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= size - 8:
        return "a safetensors file"
    offset = 0  # HDF5: at 0, or after a user block of 512, 1024, 2048, ... bytes
    while offset + len(_HDF5_SIGNATURE) <= size:
        if os.pread(fd, len(_HDF5_SIGNATURE), offset) == _HDF5_SIGNATURE:
            return "an HDF5 file"
        offset = max(512, offset * 2)
    return _readable_by_content(fd)


def _readable_by_content(fd: int) -> str | None:
    """What format of the registry recognises the file (as formats.opening would choose
    one), or None: whatever clipcli itself reads (a PyTorch legacy tar, a format added
    later) is weights, without a second list here to keep in step. A format with no magic
    of its own (safetensors: one '{' at byte 8) is judged by the stricter test above
    instead, so that a JSON or text file is still copied."""
    with open(fd, "rb", closefd=False) as handle:  # the caller's descriptor stays open
        handle.seek(0)
        found = registry.recognised(registry.Probe(handle))
    if found is None or found.claims_without_magic:
        return None
    return f"a {found.label} file"
