"""Refusals: every bad input or request is ONE stderr line `clipcli: error: ...`, the
documented exit code (DESIGN.md §1), no traceback, and nothing left in the output directory
(no OUT, no temp file): its listing is compared before and after.

Exit codes: 2 usage / refused request, 3 unreadable or unsafe input, 4 refused data.
Most runs go through `clipcli.cli.entry.main(argv)` (the console entry point); a few through a
real `python -m clipcli` child process.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest

EXT = {"safetensors": ".safetensors", "npz": ".npz", "h5": ".h5"}
W = np.array([[-2, -1, 0], [1, 2, 3]], dtype=np.float32)


@pytest.fixture
def refused(
    run_main: Callable[..., Any],
    listing: Callable[[Path], list[str]],
    assert_one_error_line: Callable[..., str],
) -> Callable[..., str]:
    """Run argv, assert the exit code, one error line holding `fragments`, and an unchanged
    listing of `directory`. Returns the error line."""

    def check(directory: Path, code: int, argv: list[object], *fragments: str) -> str:
        before = listing(directory)
        result = run_main(*argv)
        assert result.code == code, (result.code, result.stderr)
        assert result.stdout == ""
        line = assert_one_error_line(result.stderr, *fragments)
        assert listing(directory) == before, "something was left in the output directory"
        return line

    return check


@pytest.fixture
def src(ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path]) -> Path:
    """A valid input of the current format."""
    return write_checkpoint(ckpt("in"), {"w": W, "b": np.array([0.5, -0.5], np.float32)})


# ------------------------------------------------------------------ exit 3: bad input


def test_truncated_safetensors(
    tmp_path: Path, write_checkpoint: Callable[..., Path], refused: Any
) -> None:
    good = write_checkpoint(tmp_path / "good.safetensors", {"w": W})
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(good.read_bytes()[:-5])
    refused(tmp_path, 3, ["clip", "--global", "1", bad, tmp_path / "o.safetensors"], "truncated")


def test_truncated_safetensors_header(
    tmp_path: Path, write_checkpoint: Callable[..., Path], refused: Any
) -> None:
    good = write_checkpoint(tmp_path / "good.safetensors", {"w": W})
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(good.read_bytes()[:20])
    refused(tmp_path, 3, ["norms", bad], "cut.safetensors")


@pytest.mark.parametrize("ext", [".safetensors", ".npz", ".h5", ".hdf5", ".bin"])
def test_garbage_bytes(tmp_path: Path, ext: Any, refused: Any) -> None:
    bad = tmp_path / f"garbage{ext}"
    bad.write_bytes(b"\x00\x01not a checkpoint, just some garbage bytes\xff\xfe" * 4)
    refused(tmp_path, 3, ["clip", "--norm", "1", bad, tmp_path / "o.safetensors"], bad.name)
    refused(tmp_path, 3, ["norms", bad], bad.name)
    refused(tmp_path, 3, ["ls", bad], bad.name)


@pytest.mark.parametrize("ext", [".safetensors", ".npz", ".h5"])
def test_empty_file(tmp_path: Path, ext: Any, refused: Any) -> None:
    bad = tmp_path / f"empty{ext}"
    bad.write_bytes(b"")
    refused(tmp_path, 3, ["clip", "--norm", "1", bad, tmp_path / f"o{ext}"], bad.name)


def test_object_dtype_npz(tmp_path: Path, refused: Any) -> None:
    bad = tmp_path / "pickle.npz"
    np.savez(bad, evil=np.array([1, "x", None], dtype=object), w=W)  # savez pickles objects
    refused(tmp_path, 3, ["clip", "--global", "1", bad, tmp_path / "o.npz"], "pickle.npz", "evil")
    refused(tmp_path, 3, ["norms", bad], "pickle.npz")


def test_hdf5_external_link(tmp_path: Path, refused: Any) -> None:
    secret = tmp_path / "secret.h5"
    with h5py.File(secret, "w") as f:
        f["data"] = np.arange(4.0)
    bad = tmp_path / "leaky.h5"
    with h5py.File(bad, "w") as f:
        f["w"] = W
        f["group/leak"] = h5py.ExternalLink(secret.name, "/data")
    refused(tmp_path, 3, ["clip", "--global", "1", bad, tmp_path / "o.h5"], "leaky.h5", "leak")
    refused(tmp_path, 3, ["norms", bad], "leaky.h5")
    refused(tmp_path, 3, ["ls", bad], "leaky.h5")


@pytest.mark.parametrize(
    ("content", "claimed"),
    [
        ("npz", ".safetensors"),
        ("h5", ".safetensors"),
        ("safetensors", ".npz"),
        ("h5", ".npz"),
        ("safetensors", ".h5"),
        ("npz", ".hdf5"),
    ],
)
def test_extension_disagrees_with_content(
    tmp_path: Path, content: Any, claimed: Any, write_checkpoint: Callable[..., Path], refused: Any
) -> None:
    real = write_checkpoint(tmp_path / f"real{EXT[content]}", {"w": W})
    liar = tmp_path / f"liar{claimed}"
    liar.write_bytes(real.read_bytes())
    refused(tmp_path, 3, ["clip", "--norm", "1", liar, tmp_path / "o.safetensors"], liar.name)
    refused(tmp_path, 3, ["norms", liar], liar.name)


def test_missing_input(tmp_path: Path, fmt: str, refused: Any) -> None:
    missing = tmp_path / f"missing{EXT[fmt]}"
    refused(tmp_path, 3, ["clip", "--norm", "1", missing, tmp_path / "o.npz"], missing.name)
    refused(tmp_path, 3, ["norms", missing], missing.name)
    refused(tmp_path, 3, ["ls", missing], missing.name)


# ------------------------------------------------------------------ exit 4: refused data


@pytest.mark.parametrize("mode", [["--global", "1"], ["--norm", "1"], ["--average", "1"]])
def test_nonfinite_values_where_a_norm_is_needed(
    tmp_path: Path,
    ckpt: Callable[[str], Path],
    mode: Any,
    write_checkpoint: Callable[..., Path],
    refused: Any,
) -> None:
    tensors = {
        "grad.w": np.array([1.0, np.nan, np.inf, np.nan, 2.0], np.float32),
        "grad.b": np.array([np.nan, 0.5], np.float64),
        "fine": W,
    }
    bad = write_checkpoint(ckpt("in"), tensors)
    line = refused(tmp_path, 4, ["clip", *mode, bad, ckpt("out")], "grad.w", "grad.b")
    # each tensor is named with its own count of non-finite values
    assert re.search(r"grad\.w\W+\(?3\b", line), line
    assert re.search(r"grad\.b\W+\(?1\b", line), line
    assert "fine" not in line


@pytest.mark.parametrize("mode", [["--global", "1"], ["--norm", "1"]])
def test_skip_nonfinite_keeps_the_tensor_and_exits_0(
    ckpt: Callable[[str], Path],
    mode: Any,
    write_checkpoint: Callable[..., Path],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    run_main: Callable[..., Any],
    assert_bit_identical: Callable[..., None],
) -> None:
    bad = np.array([1.0, np.nan, 5.0, -np.inf], np.float32)
    src = write_checkpoint(ckpt("in"), {"bad": bad, "w": W})
    result = run_main("clip", *mode, "--skip-nonfinite", src, ckpt("out"), "--quiet")
    assert (result.code, result.stdout, result.stderr) == (0, "", "")
    out = read_checkpoint(ckpt("out"))
    assert_bit_identical(out["bad"], bad, "bad")
    assert np.linalg.norm(out["w"].astype(np.float64)) == pytest.approx(1.0, rel=1e-6)


def test_axis_out_of_range_names_each_tensor(
    tmp_path: Path, ckpt: Callable[[str], Path], write_checkpoint: Callable[..., Path], refused: Any
) -> None:
    # Both tensors lack the axis; DESIGN.md: exit 4, "the message names each tensor".
    src = write_checkpoint(ckpt("in"), {"vec": np.ones(4, np.float32), "mat": W})
    argv = ["clip", "--norm", "1", "--axes", "2", src, ckpt("out")]
    refused(tmp_path, 4, argv, "'vec'", "'mat'")


@pytest.mark.parametrize("axes", ["2", "-3"])
def test_axis_out_of_range_names_tensor_and_shape(
    tmp_path: Path,
    ckpt: Callable[[str], Path],
    axes: Any,
    write_checkpoint: Callable[..., Path],
    refused: Any,
) -> None:
    src = write_checkpoint(ckpt("in"), {"kernel": np.ones((2, 3), np.float32)})
    line = refused(tmp_path, 4, ["clip", "--norm", "3", "--axes", axes, src, ckpt("out")], "kernel")
    assert re.search(r"[\[(]2, ?3[\])]|2x3", line), f"shape not named: {line}"


# ------------------------------------------------------------------ exit 2: refused requests


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--norm", "-1"], "--norm"),
        (["--norm", "0"], "--norm"),
        (["--norm", "nan"], "--norm"),
        (["--average", "0"], "--average"),
        (["--average", "-2.5"], "--average"),
        (["--global", "0"], "--global"),
        (["--global", "-1"], "--global"),
        (["--global", "1", "--use-norm", "0"], "--use-norm"),
        (["--global", "1", "--use-norm", "-3"], "--use-norm"),
        (["--value", "-1"], "--value"),
        (["--min", "2", "--max", "1"], "--min"),
        (["--norm", "1", "--global", "1"], "--global"),
        (["--norm", "1", "--average", "1"], "--average"),
        (["--value", "1", "--norm", "1"], "--norm"),
        (["--min", "0", "--global", "1"], "--global"),
        (["--axes", "0"], "--norm"),  # no mode at all: either complaint will do
        (["--global", "1", "--axes", "0"], "--axes"),
        (["--average", "1", "--axes", "0"], "--axes"),
        (["--norm", "1", "--axes", "0,0"], "0"),
        (["--norm", "1", "--axes", "x"], "--axes"),
        (["--norm", "1", "--use-norm", "2"], "--use-norm"),
        ([], "mode"),
        (["--norm", "abc"], "--norm"),
        (["--norm", "1", "--no-such-option"], "--no-such-option"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_options(
    tmp_path: Path, src: Path, args: Any, fragment: Any, ckpt: Callable[[str], Path], refused: Any
) -> None:
    refused(tmp_path, 2, ["clip", *args, src, ckpt("out")], fragment)


def test_out_is_in(tmp_path: Path, src: Path, refused: Any) -> None:
    original = src.read_bytes()
    refused(tmp_path, 2, ["clip", "--norm", "1", src, src])
    refused(tmp_path, 2, ["clip", "--norm", "1", "--force", src, src])
    # the same file under another spelling
    other = tmp_path / "sub"
    other.mkdir()
    refused(tmp_path, 2, ["clip", "--norm", "1", "--force", src, other / ".." / src.name])
    assert src.read_bytes() == original


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_out_is_a_link_to_in(
    tmp_path: Path, fmt: str, src: Path, link: Any, force: Any, refused: Any
) -> None:
    original = src.read_bytes()
    out = tmp_path / f"alias{EXT[fmt]}"
    if link == "symlink":
        out.symlink_to(src)
    else:
        os.link(src, out)
    refused(tmp_path, 2, ["clip", "--norm", "1", *force, src, out])
    assert src.read_bytes() == original
    assert out.is_symlink() == (link == "symlink")


def test_out_exists_without_force(
    tmp_path: Path, src: Path, ckpt: Callable[[str], Path], refused: Any
) -> None:
    out = ckpt("out")
    out.write_bytes(b"precious, not a checkpoint")
    refused(tmp_path, 2, ["clip", "--norm", "1", src, out], "--force")
    assert out.read_bytes() == b"precious, not a checkpoint"


def test_out_exists_with_force_is_replaced(
    tmp_path: Path,
    src: Path,
    ckpt: Callable[[str], Path],
    run_main: Callable[..., Any],
    read_checkpoint: Callable[[Path], dict[str, np.ndarray]],
    listing: Callable[[Path], list[str]],
) -> None:
    out = ckpt("out")
    out.write_bytes(b"old contents")
    before = listing(tmp_path)
    result = run_main("clip", "--norm", "1", "--force", src, out, "--quiet")
    assert (result.code, result.stderr) == (0, "")
    assert listing(tmp_path) == before  # replaced in place, no temp file left
    got = read_checkpoint(out)
    assert set(got) == {"w", "b"}
    assert np.linalg.norm(got["w"].astype(np.float64)) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("out_ext", [".npz", ".h5", ".hdf5"])
def test_bfloat16_into_npz_or_hdf5(
    tmp_path: Path, out_ext: Any, write_checkpoint: Callable[..., Path], refused: Any
) -> None:
    bf16 = np.array([1.0, 2.0, 3.0], dtype=ml_dtypes.bfloat16)
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": W, "half_brain": bf16})
    refused(tmp_path, 2, ["clip", "--norm", "1", src, tmp_path / f"o{out_ext}"], "half_brain")
    refused(tmp_path, 2, ["clip", "--norm", "1", "--dry-run", src, tmp_path / f"o{out_ext}"])


def test_unknown_output_extension(tmp_path: Path, src: Path, refused: Any) -> None:
    refused(tmp_path, 2, ["clip", "--norm", "1", src, tmp_path / "out.txt"], "out.txt")


# ------------------------------------------------------------------ as a real process


def test_errors_from_a_real_process(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_subprocess: Callable[..., Any],
    listing: Callable[[Path], list[str]],
) -> None:
    good = write_checkpoint(tmp_path / "in.safetensors", {"w": W})
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-3])
    nan = write_checkpoint(tmp_path / "nan.npz", {"w": np.array([np.nan, 1.0])})
    exists = tmp_path / "exists.h5"
    exists.write_bytes(b"x")
    cases = [
        (3, ["clip", "--global", "1", truncated, tmp_path / "o.safetensors"]),
        (4, ["clip", "--global", "1", nan, tmp_path / "o.npz"]),
        (2, ["clip", "--global", "1", good, exists]),
        (2, ["clip", "--norm", "-1", good, tmp_path / "o.h5"]),
        (2, ["clip", "--norm", "xyz", good, tmp_path / "o.h5"]),
        (3, ["norms", tmp_path / "absent.safetensors"]),
    ]
    before = listing(tmp_path)
    for code, argv in cases:
        result = run_subprocess(*argv)
        assert result.code == code, (argv, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (argv, lines)
        assert lines[0].startswith("clipcli: error: "), (argv, lines)
        assert "Traceback" not in result.stderr
        assert result.stdout == ""
    assert listing(tmp_path) == before


def test_errors_through_the_cli_runner(
    tmp_path: Path,
    src: Path,
    ckpt: Callable[[str], Path],
    cli: Callable[..., Any],
    listing: Callable[[Path], list[str]],
) -> None:
    before = listing(tmp_path)
    result = cli("clip", "--norm", "0", src, ckpt("out"))
    assert result.code == 2
    assert result.stderr.startswith("clipcli: error: ")
    assert result.stderr.count("\n") == 1
    assert listing(tmp_path) == before


def test_header_claiming_more_data_than_the_file_holds(tmp_path: Path, refused: Any) -> None:
    header = b'{"w":{"dtype":"F32","shape":[1000000],"data_offsets":[0,4000000]}}'
    header += b" " * (-len(header) % 8)
    bad = tmp_path / "liar.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    refused(tmp_path, 3, ["clip", "--norm", "1", bad, tmp_path / "o.safetensors"], "liar")


# ------------------------------------------------------------------ exit 5: writing failed


def test_output_directory_missing(tmp_path: Path, fmt: str, src: Path, refused: Any) -> None:
    refused(tmp_path, 5, ["clip", "--norm", "1", src, tmp_path / "no" / "such" / f"o{EXT[fmt]}"])
    assert not (tmp_path / "no").exists()


def test_value_bounds_no_float16_can_hold_refused_in_one_line(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_subprocess: Callable[..., Any],
    listing: Callable[[Path], list[str]],
) -> None:
    # No float16 lies in [65520, 196560] (65504 is the largest): clamping is impossible.
    # Exit 4, one line naming the tensor; no numpy RuntimeWarning lines on stderr.
    src = write_checkpoint(tmp_path / "in.npz", {"half": np.array([1.0, 2.0], np.float16)})
    before = listing(tmp_path)
    result = run_subprocess("clip", "--min", "65520", "--max", "196560", src, tmp_path / "o.npz")
    assert result.code == 4, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("clipcli: error: "), lines
    assert "half" in lines[0], lines
    assert listing(tmp_path) == before
