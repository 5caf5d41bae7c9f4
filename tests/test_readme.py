"""Every `$ clipcli ...` block of README.md and of docs/*.md is the real output (issue 12,
item 8; issue 23 moved most of the README into docs/).

The commands of each document run in order on a fresh copy of sample_data/ (seeded demo
files), from a directory that holds it, so the relative paths in titles are the document's.
Nothing is normalised: the examples print no timings, no absolute paths and no versions.
stderr is not part of the examples (the README shows what a pipe receives). After an intended change
of the output: `python tests/readme_blocks.py --update`, then read the diff."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from readme_blocks import README, ROOT, documents, examples, run_in_copy


def test_readme_has_the_examples() -> None:
    commands = [e.argv[0] for e in examples(README.read_text(encoding="utf-8"))]
    assert {"ls", "norms", "clip", "diff"} <= set(commands)


def test_the_docs_have_examples_too() -> None:
    """The guard against a parser that silently finds nothing in docs/."""
    in_docs = [e for d in documents() if d != README for e in examples(d.read_text("utf-8"))]
    assert {"norms", "clip", "diff"} <= {e.argv[0] for e in in_docs}


@pytest.mark.usefixtures("monkeypatch")
@pytest.mark.parametrize(
    "document", documents(), ids=[str(d.relative_to(ROOT)) for d in documents()]
)
def test_every_readme_example_is_the_real_output(document: Path) -> None:
    found = examples(document.read_text(encoding="utf-8"))
    outputs = run_in_copy([e.argv for e in found])
    for example, output in zip(found, outputs, strict=True):
        assert same_but_last_bits(output, example.output), (
            f"{document.name} example `clipcli {' '.join(example.argv)}`",
            output,
        )


def test_a_block_may_hold_several_commands() -> None:
    text = "```\n$ clipcli clip a b -q\n$ clipcli diff a b\nrow 1\nrow 2\n```\n"
    found = examples(text)
    assert [(e.argv, e.output) for e in found] == [
        (("clip", "a", "b", "-q"), ""),
        (("diff", "a", "b"), "row 1\nrow 2\n"),
    ]


_FULL_FLOAT = re.compile(r"-?\d+\.\d{6,}(?:e[-+]?\d+)?")


def same_but_last_bits(got: str, want: str) -> bool:
    """Equal text, except that a float printed in full (JSON, CSV) may differ from the
    README's in its last bits (1e-12 relative): the float64 sums of squares go through BLAS,
    whose summation order depends on the processor's kernel. The numerics are checked
    against exact references elsewhere; this test is about what the README shows."""
    if got == want:
        return True
    if _FULL_FLOAT.split(got) != _FULL_FLOAT.split(want):
        return False
    pairs = zip(_FULL_FLOAT.findall(got), _FULL_FLOAT.findall(want), strict=False)
    return len(_FULL_FLOAT.findall(got)) == len(_FULL_FLOAT.findall(want)) and all(
        abs(float(a) - float(b)) <= 1e-12 * max(abs(float(a)), abs(float(b))) for a, b in pairs
    )


def test_the_last_bits_rule_is_narrow() -> None:
    assert same_but_last_bits('{"n": 812.9809460934131}', '{"n": 812.980946093413}')
    assert not same_but_last_bits('{"n": 812.98094609}', '{"n": 812.98094619}')
    assert not same_but_last_bits('{"n": 812.980946093413}', '{"m": 812.980946093413}')
    assert not same_but_last_bits("0.5000000 1", "0.5000000 2")


def _output_columns_row(command: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Output columns (stable for scripts)") :]
    rows = [line for line in section.splitlines() if line.startswith(f"| `{command}` |")]
    assert rows, f"no `{command}` row under Output columns"
    return rows[0]


def test_output_columns_name_the_diff_schema(capsys: pytest.CaptureFixture[str]) -> None:
    """The diff row lists the real columns in order, the JSON summary keys and every status."""
    import json

    from clipcli.cli.entry import main
    from clipcli.jobs import diff
    from clipcli.report.builders import DIFF_COLUMNS

    row = _output_columns_row("diff")
    assert f"`{', '.join(c.key for c in DIFF_COLUMNS)}`" in row
    sample = str(README.parent / "sample_data" / "tiny_mlp.safetensors")
    capsys.readouterr()
    assert main(["diff", sample, sample, "--format", "json"]) == 0
    summary = [key for key in json.loads(capsys.readouterr().out) if key != "tensors"]
    assert f"`{', '.join(summary)}`" in row
    statuses = (diff.SAME, diff.CHANGED, diff.DTYPE_CHANGED, diff.SHAPE_CHANGED)
    for status in (*statuses, diff.ONLY_IN_A, diff.ONLY_IN_B):
        assert f"`{status}`" in row
