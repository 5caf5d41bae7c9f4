"""`clip --dry-run` with an existing OUT (issue 23, item 13): a dry run writes nothing, so
an existing OUT is no reason to refuse it. It is judged as the real run with --force
would judge it (OUT that is IN, or a directory --force cannot replace, is still refused),
and a note on stderr says the real run needs --force. OUT is left byte for byte, and no
work directory or temp is left beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from expect import listing, one_error_line
from handmade import small_model, write_safetensors

from clipcli.cli.entry import main


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_safetensors(tmp_path / "m.safetensors", {"w": np.full(4, 3.0, np.float32)})


def run(argv: list[str | Path], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_over_an_existing_out_reports_and_leaves_it(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    os.utime(out, ns=(1_000_000_000, 1_000_000_000))
    before = listing(tmp_path)
    code, report, err = run(
        ["clip", "--global", "1", "--dry-run", "--format", "json", model, out], capsys
    )
    assert code == 0
    document = json.loads(report)
    assert document["dry_run"] is True
    # 6 is the norm of [3, 3, 3, 3]: the plan is the one a real run would make.
    assert document["global_norm_before"] == 6.0
    assert err == f"clipcli: note: {out} exists: the run without --dry-run needs --force\n"
    assert out.read_bytes() == b"precious"
    assert out.stat().st_mtime_ns == 1_000_000_000
    assert listing(tmp_path) == before


def test_with_force_there_is_no_note(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    code, _, err = run(["clip", "--global", "1", "--dry-run", "--force", model, out], capsys)
    assert (code, err) == (0, "")
    assert out.read_bytes() == b"precious"


def test_a_new_out_gets_no_note(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.safetensors"
    code, _, err = run(["clip", "--global", "1", "--dry-run", model, out], capsys)
    assert (code, err) == (0, "")
    assert not out.exists()


def test_what_force_would_not_allow_is_still_refused(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # OUT is IN
    code, _, err = run(["clip", "--global", "1", "--dry-run", model, model], capsys)
    assert code == 2
    assert "output is the input" in one_error_line(err)
    # OUT is a directory holding a stranger: --force replaces files, not directories
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    for extra in ([], ["--force"]):
        code, _, err = run(["clip", "--global", "1", "--dry-run", *extra, model, folder], capsys)
        assert code == 2
        one_error_line(err)
    assert (folder / "keep.txt").read_text() == "mine"


def test_the_real_run_still_refuses_an_existing_out(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    code, _, err = run(["clip", "--global", "1", model, out], capsys)
    assert code == 2
    assert one_error_line(err).endswith("already exists; pass --force to replace it")
    assert out.read_bytes() == b"precious"


def test_dry_run_refuses_what_the_real_run_refuses(tmp_path: Path) -> None:
    src = small_model(tmp_path)
    taken = small_model(tmp_path, "taken.safetensors")
    for out in (src, tmp_path / "missing" / "o.safetensors"):
        real = main(["clip", "--global", "1", str(src), str(out)])
        dry = main(["clip", "--dry-run", "--global", "1", str(src), str(out)])
        assert real != 0
        assert dry == real, out
    # An existing OUT (issue 23, item 13): a dry run writes nothing, so it is judged as the
    # real run with --force judges it, and a note says that run needs --force.
    before = taken.read_bytes()
    assert main(["clip", "--global", "1", str(src), str(taken)]) == 2
    assert main(["clip", "--dry-run", "--global", "1", str(src), str(taken)]) == 0
    assert taken.read_bytes() == before
    free = tmp_path / "free.safetensors"
    assert main(["clip", "--dry-run", "--global", "1", str(src), str(free)]) == 0
    assert not free.exists()
