"""What npz, a format that holds no file metadata, loses of a checkpoint's metadata."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# safetensors' `format` key says only which framework wrote the file (transformers checks
# it is "pt", "tf", "flax" or "mlx"; diffusers accepts "pt", "pd", "np"): it describes no
# tensor, so a format without metadata drops it with a note instead of refusing.
FRAMEWORK_KEY = "format"
FRAMEWORK_TAGS = frozenset({"pt", "tf", "flax", "mlx", "np", "pd"})


def metadata_loss(metadata: Mapping[str, str]) -> tuple[list[str], str | None]:
    """What a format holding no file metadata loses of `metadata`: (the keys that are a
    loss, the framework tag dropped with a note). A framework tag beside other keys (the
    recorded structure's own included) is one of the keys lost, not a note."""
    keys = list(metadata)
    tag = metadata.get(FRAMEWORK_KEY)
    if keys == [FRAMEWORK_KEY] and tag in FRAMEWORK_TAGS:
        return [], tag
    return keys, None


def metadata_loss_text(keys: Sequence[str]) -> str:
    """'file metadata (1 key: 'source')', naming the first few keys in sorted order (the
    same whatever order a writer stored them in)."""
    shown = ", ".join(repr(key) for key in sorted(keys)[:3])
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"file metadata ({len(keys)} key{'' if len(keys) == 1 else 's'}: {shown}{more})"


def metadata_losses(metadata: Mapping[str, str]) -> list[str]:
    """The loss line for a format that holds no file metadata (structure_losses), if any."""
    lost, _ = metadata_loss(metadata)
    return [metadata_loss_text(lost)] if lost else []


def framework_tag_notes(metadata: Mapping[str, str], format_name: str) -> list[str]:
    """The note that a lone framework tag is left out (structure_notes), if one is."""
    _, tag = metadata_loss(metadata)
    if tag is None:
        return []
    return [
        f"{format_name} holds no file metadata: {FRAMEWORK_KEY}={tag!r}, which only names "
        "the framework that wrote the file, is left out"
    ]
