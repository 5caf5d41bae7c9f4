"""Every `$ clipcli ...` block of README.md is the real output (issue 12, item 8).

The commands run in order on a fresh copy of sample_data/ (seeded demo files), from a
directory that holds it, so the relative paths in titles are the README's. Nothing is
normalised: the examples print no timings, no absolute paths and no versions. stderr is
not part of the examples (the README shows what a pipe receives). After an intended change
of the output: `python tests/readme_blocks.py --update`, then read the diff."""

from __future__ import annotations

import pytest
from readme_blocks import README, examples, run_in_copy


def test_readme_has_the_examples() -> None:
    commands = [e.argv[0] for e in examples(README.read_text(encoding="utf-8"))]
    assert {"ls", "norms", "clip", "diff"} <= set(commands)


@pytest.mark.usefixtures("monkeypatch")
def test_every_readme_example_is_the_real_output() -> None:
    found = examples(README.read_text(encoding="utf-8"))
    outputs = run_in_copy([e.argv for e in found])
    for example, output in zip(found, outputs, strict=True):
        assert output == example.output, f"README example `clipcli {' '.join(example.argv)}`"
