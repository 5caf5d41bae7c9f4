"""The `$ clipcli ...` examples of README.md and docs/*.md: parsed here for
tests/test_readme.py, and rewritten from the real output by
`python tests/readme_blocks.py --update` (then read the diff before committing it).

A block may hold several commands (`$ clipcli clip ...` then `$ clipcli diff ...`): each
`$ clipcli` line starts an example whose output runs to the next such line or the fence."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = "```"
PROMPT = "$ clipcli "


def documents() -> list[Path]:
    """The README first, then every docs/*.md: each one's examples run in their own copy."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Example:
    argv: tuple[str, ...]  # after "clipcli"
    output: str  # the text after the command line, to the next command line or the fence
    start: int  # line numbers of that text in the document (after the $ line, to the end)
    end: int


def examples(text: str) -> list[Example]:
    """Every command of every fenced block whose first line is `$ clipcli ...`, in order."""
    lines = text.splitlines(keepends=True)
    found = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(FENCE) and i + 1 < len(lines):  # an opening fence, any language
            end = i + 1
            while end < len(lines) and lines[end].rstrip("\n") != FENCE:
                end += 1
            if lines[i + 1].startswith(PROMPT):
                commands = [n for n in range(i + 1, end) if lines[n].startswith(PROMPT)]
                for n, stop in zip(commands, [*commands[1:], end], strict=True):
                    argv = tuple(shlex.split(lines[n][len(PROMPT) :]))
                    found.append(Example(argv, "".join(lines[n + 1 : stop]), n + 1, stop))
            i = end + 1
        else:
            i += 1
    return found


def run_in_copy(commands: list[tuple[str, ...]]) -> list[str]:
    """Each command's stdout, run in order (clip writes out.safetensors, which diff reads)
    in a fresh copy of sample_data/, with no COLUMNS: a pipe gets the full table."""
    from clipcli.cli.entry import main

    outputs = []
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "sample_data", Path(tmp) / "sample_data")
        old_cwd, old_columns = os.getcwd(), os.environ.pop("COLUMNS", None)
        os.chdir(tmp)
        try:
            for argv in commands:
                out = io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                    code = main(list(argv))
                assert code == 0, (argv, code)
                outputs.append(out.getvalue())
        finally:
            os.chdir(old_cwd)
            if old_columns is not None:
                os.environ["COLUMNS"] = old_columns
    return outputs


def update(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    found = examples(text)
    outputs = run_in_copy([e.argv for e in found])
    lines = text.splitlines(keepends=True)
    for example, output in reversed(list(zip(found, outputs, strict=True))):
        lines[example.start : example.end] = [output]
    document.write_text("".join(lines), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        for document in documents():
            update(document)
    else:
        print(__doc__)
