"""The README opens with what a user does, stays short, and links into docs/ (issue 23, "The
README"): the tour comes first, the set-up commands are the ones CI runs, every link between
the README and docs/*.md leads to a file and a heading that exist, and every README section
that the code or the docs name by title is there."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from readme_blocks import README, ROOT, documents, examples

README_LIMIT = 400  # lines: the brief's "well under 400"; internals live in docs/
FIRST_SCREEN = 40  # lines: what it does, how to install it, and the tour's first command

DEVELOP_COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
    ".venv/bin/clipcli norms sample_data/tiny_mlp.safetensors",
    ".venv/bin/python -m pytest",
]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _sections(text: str) -> dict[str, str]:
    """Each `##` section's title and its text up to the next `##` heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _is_under(count: int, limit: int) -> bool:
    return count < limit


def test_the_limit_rule_is_strict() -> None:
    assert _is_under(README_LIMIT - 1, README_LIMIT)
    assert not _is_under(README_LIMIT, README_LIMIT)


def test_readme_is_short() -> None:
    assert _is_under(len(_text(README).splitlines()), README_LIMIT)


def test_readme_opens_with_what_it_does_install_and_the_tour() -> None:
    text = _text(README)
    lines = text.splitlines()
    titles = [line[3:] for line in lines if line.startswith("## ")]
    assert titles[:2] == ["Install", "A three-command tour"], titles
    tour = [e.argv for e in examples(text)[:4]]
    assert [argv[0] for argv in tour] == ["ls", "norms", "clip", "diff"], tour
    assert {"--sort", "norm", "--top"} <= set(tour[1]), tour[1]
    assert "--global" in tour[2], tour[2]
    first = examples(text)[0].start  # the line after `$ clipcli ls ...`
    assert _is_under(first, FIRST_SCREEN), f"the tour starts at line {first}"
    assert "pip install ." in "\n".join(lines[:first])


def test_develop_commands_are_the_ones_ci_runs() -> None:
    develop = _sections(_text(README))["Develop"]
    blocks = re.findall(r"^```bash\n(.*?)^```$", develop, flags=re.MULTILINE | re.DOTALL)
    assert DEVELOP_COMMANDS in [block.splitlines() for block in blocks]
    ci = _text(ROOT / ".ci" / "run")
    assert ".venv/bin/clipcli norms sample_data/tiny_mlp.safetensors\n" in ci
    assert ".venv/bin/python -m pip install --quiet -e '.[test]'\n" in ci
    assert ".venv/bin/python -m pytest\n" in ci


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in _text(path).splitlines():
        if match := re.match(r"#{1,6} (.+)$", line):
            base = _anchor(match[1].strip())
            count = seen.get(base, 0)
            seen[base] = count + 1
            seen.setdefault(f"{base}-{count}" if count else base, 1)
    return set(seen)


def test_anchors_are_githubs() -> None:
    assert _anchor("`clipcli clip IN OUT MODE`") == "clipcli-clip-in-out-mode"
    assert _anchor("Output columns (stable for scripts)") == "output-columns-stable-for-scripts"
    assert _anchor("Not read yet: PyTorch `.bin`/`.pt`") == "not-read-yet-pytorch-binpt"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize(
    "document", documents(), ids=[str(d.relative_to(ROOT)) for d in documents()]
)
def test_every_link_leads_somewhere(document: Path) -> None:
    text = re.sub(r"^```.*?^```$", "", _text(document), flags=re.MULTILINE | re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not ours to check here
        name, _, anchor = target.partition("#")
        path = (document.parent / name).resolve() if name else document
        assert path.exists(), f"{document.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(path), f"{document.name}: link to {target}: no heading"


def test_readme_links_every_docs_file() -> None:
    text = _text(README)
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in text, f"README never links docs/{doc.name}"


def _named_readme_sections() -> list[tuple[str, str]]:
    """(file, title) for every README section that the code or the docs name by title:
    `README, "Title"`, `README's "Title"` and `README "Title"`."""
    named = []
    sources = [*sorted((ROOT / "clipcli").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md"))]
    for source in sources:
        flat = re.sub(r"\s+", " ", _text(source))
        for match in re.finditer(r"README(?:'s|,)? ((?:\"[^\"]+\"(?:,| and)? ?)+)", flat):
            for title in re.findall(r"\"([^\"]+)\"", match[1]):
                named.append((str(source.relative_to(ROOT)), title))
    return named


def test_readme_sections_named_elsewhere_exist() -> None:
    named = _named_readme_sections()
    assert ("clipcli/jobs/roles.py", "Model weights and training state") in named
    text = _text(README)
    titles = {t.strip() for t in re.findall(r"^#{2,3} (.+)$", text, re.MULTILINE)}
    for source, title in named:
        assert title in titles or f"**{title}" in text, f"{source} names README {title!r}"
