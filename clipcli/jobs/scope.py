"""What a command acts on, decided from tensor names alone, before any data is read.

- the --include/--exclude patterns: an empty selection is refused (exit 2) naming the
  patterns, a pattern that matches nothing while others match is a warning;
- roles (clipcli.jobs.roles): training state is left out unless --all-tensors, in one note line;
- quantized weights (clipcli.jobs.quantized): a warning for norms/diff, exit 4 for clip;
- --axes against each tensor's rank: a short refusal (exit 4) or, with --skip-low-rank,
  the tensors that cannot take the axes are left unchanged;
- --group-by: a warning when one group takes every tensor (grouping did nothing).

Nothing here prints: messages go to a Notify callback (level, text) that the CLI turns
into `clipcli: warning: ...` / `clipcli: note: ...` lines on stderr.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from clipcli.errors import DataRefusedError, UsageError
from clipcli.formats.base import TensorInfo
from clipcli.jobs import quantized, roles
from clipcli.jobs.groups import compile_group_by, group_key
from clipcli.words import count

Notify = Callable[[str, str], None]  # (level, text); level is "warning" or "note"

FIRST_FEW = 3  # names quoted in one-line messages before "and N more"


def ignore(level: str, text: str) -> None:
    pass


def first_few(names: Sequence[str], limit: int = FIRST_FEW, quote: bool = True) -> str:
    """'a', 'b', 'c' and 4 more"""
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _matches(pattern: str, names: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def _flags(option: str, patterns: Sequence[str]) -> str:
    return " ".join(f"{option} {p!r}" for p in patterns)


def check_patterns(
    names: Sequence[str],
    include: Sequence[str],
    exclude: Sequence[str],
    selected: Sequence[str],
    notify: Notify,
) -> None:
    """Refuse an empty selection (exit 2) and warn about patterns that match nothing.

    `names` are all tensor names, `selected` those the patterns keep. A pattern is a glob on
    the whole name, so `attention` matches only a tensor called exactly that; the hint says
    when `*attention*` would have matched."""
    if not include and not exclude:
        return
    dead_includes = [p for p in include if not _matches(p, names)]
    if not selected:
        flags = (_flags("--include", include), _flags("--exclude", exclude))
        given = " ".join(text for text in flags if text)
        hints = [f"*{p}*" for p in dead_includes if _matches(f"*{p}*", names)]
        hint = (
            "; patterns match whole names: did you mean " + " ".join(repr(h) for h in hints) + "?"
            if hints
            else ""
        )
        raise UsageError(f"no tensor selected by {given} (of {count(len(names), 'tensor')}){hint}")
    for option, patterns in (("--include", dead_includes), ("--exclude", exclude)):
        for pattern in patterns:
            if option == "--exclude" and _matches(pattern, names):
                continue
            wider = f"*{pattern}*"
            hint = f" (did you mean {wider!r}?)" if _matches(wider, names) else ""
            notify("warning", f"{option} {pattern!r} matches no tensor{hint}")


def left_out(infos: Sequence[TensorInfo], all_tensors: bool) -> dict[str, roles.Role]:
    """Selected tensors kept out of norms and clipping because of their role."""
    if all_tensors:
        return {}
    result: dict[str, roles.Role] = {}
    for info in infos:
        role = roles.classify(info.name)
        if role is not roles.Role.WEIGHT:
            result[info.name] = role
    return result


# What a role's tensors are called in the note, as countable nouns (roles.Role.description
# is a mass noun, "optimizer state": "105 optimizer state" read wrong).
_LEFT_OUT_NOUNS = {
    roles.Role.OPTIMIZER: "optimizer tensor",
    roles.Role.BUFFER: "BatchNorm statistic",
}


def left_out_note(kept_out: dict[str, roles.Role], writes: bool = False) -> str | None:
    """One short line: how much training state was left out, and what the command did
    with it (`norms` leaves it out of the global norm; `clip` copies it unchanged). None
    when nothing was."""
    if not kept_out:
        return None
    found = [
        count(n, noun)
        for role, noun in _LEFT_OUT_NOUNS.items()
        if (n := sum(r is role for r in kept_out.values()))
    ]
    what = " and ".join(found)
    if writes:
        return f"training state left unchanged: {what} (--all-tensors clips them)"
    return f"training state left out of the global norm: {what} (--all-tensors counts them)"


def _all_selected(n: int) -> str:
    return "the one selected tensor is" if n == 1 else f"all {n} selected tensors are"


def _have(n: int) -> str:
    return "has" if n == 1 else "have"


def check_roles(selected: Sequence[TensorInfo], kept_out: dict[str, roles.Role]) -> None:
    """A selection made only of training state is empty as far as weights go (exit 2)."""
    if selected and all(info.name in kept_out for info in selected):
        kinds = sorted({kept_out[i.name].description for i in selected})
        raise UsageError(
            f"no model weight selected: {_all_selected(len(selected))} "
            f"{' or '.join(kinds)}; pass --all-tensors to act on them"
        )


def _quantized_in(
    infos: Sequence[TensorInfo],
) -> tuple[list[quantized.QuantizedWeight], set[str]]:
    found = quantized.detect(infos)
    return found, {m for q in found for m in q.members}


def _schemes(found: Sequence[quantized.QuantizedWeight]) -> str:
    return ", ".join(sorted({q.scheme for q in found}))


def warn_quantized(infos: Sequence[TensorInfo], directory: Path | None, notify: Notify) -> None:
    """norms / diff: say that quantized weights are measured as their stored codes."""
    found, _ = _quantized_in(infos)
    method = quantized.declared_method(directory) if directory is not None else None
    if found:
        notify(
            "warning",
            f"{len(found)} quantized weights ({_schemes(found)}: "
            f"{first_few([q.codes for q in found])}) are measured as their stored codes and "
            "scales, not as the real weights; dequantize first for meaningful norms",
        )
    elif method is not None:
        notify(
            "warning",
            f"config.json declares quantization_config (quant_method {method!r}): norms are of "
            "the stored tensors, not of the real weights",
        )


def refuse_quantized(
    infos: Sequence[TensorInfo], targets: Sequence[TensorInfo], directory: Path | None
) -> None:
    """clip: exit 4 when a tensor it would act on belongs to a quantized weight."""
    found, members = _quantized_in(infos)
    touched = [q for q in found if any(t.name in q.members for t in targets)]
    if touched:
        codes = [q.codes for q in touched]
        raise DataRefusedError(
            f"{len(touched)} selected weights are quantized ({_schemes(touched)}: "
            f"{first_few(codes)}); clipcli cannot clip quantized weights yet: dequantize "
            "first, or leave them and their scales out with --exclude"
        )
    method = quantized.declared_method(directory) if directory is not None else None
    if method is not None and not found:
        raise DataRefusedError(
            f"{directory}/config.json declares quantization_config (quant_method {method!r}) "
            "in a layout clipcli does not recognise; clipcli cannot clip quantized weights "
            "yet: dequantize first"
        )


def refuse_undecoded(
    infos: Sequence[TensorInfo],
    undecoded: Sequence[tuple[str, str]],
    directory: Path | None,
    doing: str,
) -> None:
    """convert writing real values (--dtype; GGUF into another format): exit 4, nothing
    written, when a quantized weight is stored in a layout clipcli does not decode. Its
    codes and scales would be written as plain tensors (cast, config.json without its
    quantization_config: "dequantized"), which they are not. `undecoded`: the view's own
    (View.undecoded); `directory`: where config.json's quantization_config is read, None
    when the view decoded a weight (it read the config and claimed what it names)."""
    found, _ = _quantized_in(infos)
    layouts = [(q.codes, q.scheme) for q in found] + list(undecoded)
    if layouts:
        schemes = ", ".join(sorted({layout for _, layout in layouts}))
        raise DataRefusedError(
            f"{count(len(layouts), 'quantized weight')} in a layout clipcli does not decode "
            f"({schemes}: {first_few([name for name, _ in layouts])}): {doing} would write "
            "the stored codes as if they were the weights; nothing written. convert without "
            "--dtype into the same format copies them as stored"
        )
    method = quantized.declared_method(directory) if directory is not None else None
    if method is not None:
        raise DataRefusedError(
            f"{directory}/config.json declares quantization_config (quant_method {method!r}) "
            f"in a layout clipcli does not recognise: {doing} would write the stored tensors "
            "as the weights and drop the config; nothing written. convert without --dtype "
            "copies them as stored"
        )


def axes_fit(axes: Sequence[int], shape: Sequence[int]) -> bool:
    rank = len(shape)
    return all(-rank <= axis < rank for axis in axes)


def check_axes(
    targets: Sequence[TensorInfo], axes: Sequence[int], skip_low_rank: bool, notify: Notify
) -> set[str]:
    """The targets whose rank cannot take `axes`: exit 4 with a short message by default,
    or (with skip_low_rank) their names, which the plan leaves unchanged, unless that is
    every target: exit 4, as an empty selection is refused."""
    misfits = [t for t in targets if not axes_fit(axes, t.shape)]
    if not misfits:
        return set()
    axes_text = ",".join(map(str, axes))
    shown = first_few([f"{t.name!r} {list(t.shape)}" for t in misfits], quote=False)
    if not skip_low_rank:
        raise DataRefusedError(
            f"{count(len(misfits), 'selected tensor')} {_have(len(misfits))} too few "
            f"dimensions for --axes {axes_text}: "
            f"{shown}; pass --skip-low-rank to leave them unchanged, or narrow the selection "
            "with --include/--exclude"
        )
    if len(misfits) == len(targets):  # a mistyped axis would make the run a silent no-op
        needed = max(axis + 1 if axis >= 0 else -axis for axis in axes)
        highest = max(len(t.shape) for t in targets)
        raise DataRefusedError(
            f"--skip-low-rank leaves no selected tensor to clip: --axes {axes_text} needs "
            f"{needed} dimensions, and the highest rank among the "
            f"{count(len(targets), 'selected tensor')} is {highest}; check --axes"
        )
    notify(
        "note",
        f"--skip-low-rank: {count(len(misfits), 'tensor')} {_have(len(misfits))} too few "
        f"dimensions for --axes {axes_text} and {'is' if len(misfits) == 1 else 'are'} left "
        f"unchanged: {shown}",
    )
    return {t.name for t in misfits}


def check_groups(names: Sequence[str], group_by: str, notify: Notify) -> None:
    """Warn when --group-by puts every tensor into one group: it then changes nothing."""

    pattern = compile_group_by(group_by)
    keys = {group_key(n, pattern) for n in names}
    if len(names) > 1 and len(keys) == 1:
        notify(
            "warning",
            f"--group-by {group_by!r} puts all {len(names)} tensors into one group "
            f"{keys.pop()!r}: per-group clipping is global clipping here",
        )


def floating(infos: Sequence[TensorInfo]) -> list[TensorInfo]:
    from clipcli.dtypes import is_floating  # numpy: not for checks on names alone (ls)

    return [info for info in infos if is_floating(info.dtype)]
