"""PyTorch tensors that share a storage (clipcli.logical.pytorch): a tied tensor (the same
view of one storage under a second name, `lm_head.weight` = `0.weight`) is counted once in
the global norm, reported as "tied to" its first, and given its first one's action, so a
clip writes both names with the same bytes; views that overlap in part keep their own
norms, are warned about in `norms` and refused by `clip --global` (exit 4).

References: the values torch.load returned when the fixture was made
(tests/data/pytorch/zip_v2.expected.npz), exact sums of squares in Fractions, and the
official safetensors reader for what was written."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line
from safetensors.numpy import load_file

from clipcli.cli.entry import main

DATA = REPO_ROOT / "tests" / "data" / "pytorch"
ZIP_V2 = DATA / "zip_v2.pt"
# zip_v2.pt (make_fixtures.py): `lm_head.weight` is `0.weight` again; `transposed`,
# `offset_rows` and `every_other` are three views of one 5x7 storage.
OVERLAPPING = ("transposed", "offset_rows", "every_other")
BUFFERS = ("2.running_mean", "2.running_var", "2.num_batches_tracked")
NO_NOTES = [arg for name in (*OVERLAPPING, *BUFFERS) for arg in ("--exclude", name)]


def torch_values() -> dict[str, np.ndarray]:
    with np.load(DATA / "zip_v2.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


def exact_global(values: dict[str, np.ndarray], names: list[str]) -> float:
    total = sum(Fraction(float(x)) ** 2 for n in names for x in values[n].ravel())
    return math.sqrt(total)


def counted_weights(values: dict[str, np.ndarray], leave_out: tuple[str, ...] = ()) -> list[str]:
    """The floating-point weights, each storage view once (torch's values say which)."""
    return [
        name
        for name, array in values.items()
        if array.dtype.kind == "f"
        and name not in BUFFERS
        and name != "lm_head.weight"
        and name not in leave_out
    ]


def test_a_tied_tensor_is_counted_once_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    values = torch_values()
    # torch says they are one tensor's values (the fixture tied them; this checks it did).
    np.testing.assert_array_equal(values["lm_head.weight"], values["0.weight"])
    assert main(["norms", "--format", "json", str(ZIP_V2)]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    rows = {row["name"]: row for row in document["tensors"]}
    assert rows["lm_head.weight"]["in_global"] is False
    assert rows["lm_head.weight"]["role"] == "tied to 0.weight"
    assert rows["lm_head.weight"]["norm"] == rows["0.weight"]["norm"]  # its own norm, shown
    assert rows["0.weight"]["in_global"] is True
    want = exact_global(values, counted_weights(values))
    assert document["global_norm"] == pytest.approx(want, rel=1e-12, abs=0)
    # Counting the tie twice would add 0.weight's square again: far from this.
    twice = exact_global(values, [*counted_weights(values), "lm_head.weight"])
    assert abs(document["global_norm"] - twice) > 1e-3


def test_overlapping_views_keep_their_norms_and_are_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    values = torch_values()
    assert main(["norms", "--format", "json", str(ZIP_V2)]) == 0
    captured = capsys.readouterr()
    rows = {row["name"]: row for row in json.loads(captured.out)["tensors"]}
    for name in OVERLAPPING:
        assert rows[name]["in_global"] is True
        assert rows[name]["norm"] == pytest.approx(exact_global(values, [name]), rel=1e-12)
    warning = [line for line in captured.err.splitlines() if "overlapping" in line]
    assert len(warning) == 1
    assert all(name in warning[0] for name in OVERLAPPING)
    assert "once per tensor" in warning[0]


def test_clip_global_uses_the_deduplicated_norm_and_writes_ties_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = torch_values()
    out = tmp_path / "clipped.safetensors"
    argv = ["clip", "--global", "1", "--format", "json", *NO_NOTES, str(ZIP_V2), str(out)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    want = exact_global(values, counted_weights(values, OVERLAPPING))
    assert report["used_norm"] == pytest.approx(want, rel=1e-12, abs=0)
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows["lm_head.weight"]["note"] == "tied to 0.weight"
    assert rows["lm_head.weight"]["scale"] == rows["0.weight"]["scale"]
    written = load_file(out)
    assert written["lm_head.weight"].tobytes() == written["0.weight"].tobytes()
    assert not np.array_equal(written["0.weight"], values["0.weight"])  # it was scaled
    after = exact_global(
        {k: v.astype(np.float64) for k, v in written.items()},
        counted_weights(values, OVERLAPPING),
    )
    assert after <= 1.0
    assert report["global_norm_after"] == pytest.approx(after, rel=1e-12)


@pytest.mark.parametrize("mode", [["--norm", "1"], ["--value", "0.5"], ["--average", "0.1"]])
def test_per_tensor_modes_write_ties_alike(tmp_path: Path, mode: list[str]) -> None:
    out = tmp_path / "clipped.safetensors"
    assert main(["clip", *mode, "--quiet", *NO_NOTES[6:], str(ZIP_V2), str(out)]) == 0
    written = load_file(out)
    assert written["lm_head.weight"].tobytes() == written["0.weight"].tobytes()
    assert not np.array_equal(written["0.weight"], torch_values()["0.weight"])


@pytest.mark.parametrize("left_out", ["lm_head.weight", "0.weight"])
def test_a_selection_that_splits_a_tie_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], left_out: str
) -> None:
    out = tmp_path / "clipped.safetensors"
    argv = ["clip", "--global", "1", *NO_NOTES, "--exclude", left_out, str(ZIP_V2), str(out)]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "lm_head.weight is tied to 0.weight" in line
    assert f"but not on {left_out}" in line
    assert not out.exists()


def test_a_selection_leaving_out_both_tied_tensors_is_fine(tmp_path: Path) -> None:
    out = tmp_path / "clipped.safetensors"
    ties = ["--exclude", "lm_head.weight", "--exclude", "0.weight"]
    assert main(["clip", "--global", "1", "--quiet", *NO_NOTES, *ties, str(ZIP_V2), str(out)]) == 0
    written = load_file(out)
    np.testing.assert_array_equal(written["lm_head.weight"], torch_values()["0.weight"])


def test_clip_global_over_overlapping_views_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "clipped.safetensors"
    keep_two = ["--exclude", "every_other"]  # two of the three still overlap
    argv = ["clip", "--global", "1", *NO_NOTES[6:], *keep_two, str(ZIP_V2), str(out)]
    assert main(argv) == 4
    line = one_error_line(capsys.readouterr().err)
    assert "transposed, offset_rows view overlapping parts of one storage" in line
    assert not out.exists()


def test_one_view_of_the_overlapping_ones_may_be_clipped_globally(tmp_path: Path) -> None:
    out = tmp_path / "clipped.safetensors"
    keep_one = ["--exclude", "every_other", "--exclude", "transposed"]
    argv = ["clip", "--global", "1", "--quiet", *NO_NOTES[6:], *keep_one, str(ZIP_V2), str(out)]
    assert main(argv) == 0
