"""Sharded Hugging Face checkpoints: a model directory of safetensors shards plus an index.

A model directory holds either

- `model.safetensors.index.json` (`{"metadata": {"total_size": N, ...}, "weight_map":
  {tensor: shard}}`) and the shards `model-00001-of-0000K.safetensors` it names, or
- a single `model.safetensors` and no index,

next to config.json, tokenizer files and the like, which `clip` copies unchanged.

Choices made here (see FORMATS.md, "Sharded Hugging Face checkpoints"):

- The index must be complete: every tensor in a shard's header must be in the weight map.
  A tensor the index leaves out would be invisible to `transformers`, yet would still be
  read, clipped and counted in the global norm; refusing keeps both views equal.
- Each tensor lives in exactly one shard; a tensor stored in two shards is refused.
- `total_size` is not checked when reading: it is advisory, and loaders do not check it
  either. `validate_sharded` checks it, and the writer always writes it fresh.
- Files are read only inside the model directory. A symlink may point elsewhere only in a
  Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`), whose files all link into
  the repo's own `blobs/` store, and only when that `blobs/` is a real directory (a
  `blobs -> /` link would allow every file). Anything else could make `clip` copy a file
  such as ~/.ssh/id_rsa into an output that the user then publishes. Kernel and device
  files (/proc, /sys, /dev) and non-regular side files are refused.
- Shards are parsed once at start, then their descriptors are closed and reopened on
  demand, at most MAX_OPEN_SHARDS at a time.
- Copied unchanged: the regular files at the top level. Not copied: subdirectories
  (`original/`, `onnx/`, `.cache/`), other weight files (`pytorch_model*.bin`, `*.pth`,
  `consolidated.safetensors`, ...) and other indexes. Those hold the weights again in
  another form, unclipped; copying them would ship unclipped weights beside clipped ones.
  `skipped_files()` lists them so that the CLI can say so.

The writer is imported on first use of its names (PEP 562 module __getattr__), as in
clipcli.formats.safetensors: `ls model_dir/` lists the shards' headers without numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clipcli.formats.sharded.layout import (
    DEFAULT_INDEX_NAME,
    FORMAT_NAME,
    INDEX_SUFFIX,
    resolve_sharded,
)
from clipcli.formats.sharded.reader import ShardedReader, validate_sharded

if TYPE_CHECKING:
    from clipcli.formats.sharded.writer import ShardedWriter, output_names


def __getattr__(name: str) -> Any:
    if name in ("ShardedWriter", "output_names"):
        from clipcli.formats.sharded import writer

        return getattr(writer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_INDEX_NAME",
    "FORMAT_NAME",
    "INDEX_SUFFIX",
    "ShardedReader",
    "ShardedWriter",
    "output_names",
    "resolve_sharded",
    "validate_sharded",
]
