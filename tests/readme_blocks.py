"""The `$ clipcli ...` examples of README.md: parsed here for tests/test_readme.py, and
rewritten from the real output by `python tests/readme_blocks.py --update` (then read the
diff before committing it)."""

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


@dataclass(frozen=True)
class Example:
    argv: tuple[str, ...]  # after "clipcli"
    output: str  # the block's text after the command line
    start: int  # line numbers of the block's text in README.md (after the $ line, to the fence)
    end: int


def examples(text: str) -> list[Example]:
    """Every fenced block whose first line is `$ clipcli ...`, in README order."""
    lines = text.splitlines(keepends=True)
    found = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(FENCE) and i + 1 < len(lines):  # an opening fence, any language
            first = lines[i + 1]
            end = i + 2
            while end < len(lines) and lines[end].rstrip("\n") != FENCE:
                end += 1
            if first.startswith("$ clipcli "):
                argv = tuple(shlex.split(first[len("$ clipcli ") :]))
                found.append(Example(argv, "".join(lines[i + 2 : end]), i + 2, end))
            i = end + 1
        else:
            i += 1
    return found


def run_in_copy(commands: list[tuple[str, ...]]) -> list[str]:
    """Each command's stdout, run in order (clip writes out.safetensors, which diff reads)
    in a fresh copy of sample_data/, with no COLUMNS: a pipe gets the full table."""
    from clipcli.cli import main

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


def update() -> None:
    text = README.read_text(encoding="utf-8")
    found = examples(text)
    outputs = run_in_copy([e.argv for e in found])
    lines = text.splitlines(keepends=True)
    for example, output in reversed(list(zip(found, outputs, strict=True))):
        lines[example.start : example.end] = [output]
    README.write_text("".join(lines), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update()
    else:
        print(__doc__)
