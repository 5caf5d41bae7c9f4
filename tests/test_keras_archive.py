"""Keras 3 `.keras` archives (issue 11 item 7): the weights inside are read for ls, norms and
diff; `clip` writes a `.keras` whose other members are unchanged; hostile zips are refused.

Outputs are read back with zipfile and h5py only."""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MainRun as Run
from layouts import keras_archive
from test_format_hdf5 import assert_same_file

Cli = Callable[..., Run]


def exact_global_norm(arrays: list[np.ndarray]) -> float:
    from fractions import Fraction

    total = sum(
        (Fraction(float(x)) ** 2 for a in arrays for x in a.ravel().astype(np.float64)),
        Fraction(0),
    )
    return math.sqrt(total)


def test_ls_and_norms_read_the_weights_inside(clipcli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "m.keras"
    weights = keras_archive(path)
    listing = json.loads(clipcli("ls", "--format", "json", path).stdout)
    assert listing["format"] == "keras"
    assert [t["name"] for t in listing["tensors"]] == list(weights)
    norms = json.loads(clipcli("norms", "--format", "json", path).stdout)
    model = [a for name, a in weights.items() if not name.startswith("optimizer/")]
    assert norms["global_norm"] == pytest.approx(exact_global_norm(model), rel=1e-12)


def test_clip_writes_a_keras_with_the_other_members_unchanged(clipcli: Cli, tmp_path: Path) -> None:
    src, out = tmp_path / "m.keras", tmp_path / "c.keras"
    weights = keras_archive(src)
    run = clipcli("clip", "--global", "1", "-q", src, out)
    assert run.returncode == 0, run.stderr
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(out) as b:
        assert [
            (i.filename, i.compress_type, i.date_time, i.external_attr) for i in b.infolist()
        ] == [(i.filename, i.compress_type, i.date_time, i.external_attr) for i in a.infolist()]
        for entry in a.infolist():
            if entry.filename != "model.weights.h5":
                assert b.read(entry.filename) == a.read(entry)
        with h5py.File(io.BytesIO(b.read("model.weights.h5")), "r") as f:
            model = [f[name][()] for name in weights if not name.startswith("optimizer/")]
            assert exact_global_norm(model) <= 1.0
            np.testing.assert_array_equal(f["optimizer/vars/1"][()], weights["optimizer/vars/1"])
            assert f["layers"].attrs["class_name"] == "Functional"


def test_unchanged_clip_keeps_the_weights_file_structure(clipcli: Cli, tmp_path: Path) -> None:
    src, out = tmp_path / "m.keras", tmp_path / "c.keras"
    keras_archive(src)
    assert clipcli("clip", "--global", "1e9", "-q", src, out).returncode == 0
    for name, archive in (("a.h5", src), ("b.h5", out)):
        with zipfile.ZipFile(archive) as z:
            (tmp_path / name).write_bytes(z.read("model.weights.h5"))
    assert_same_file(tmp_path / "a.h5", tmp_path / "b.h5")
    diff = json.loads(clipcli("diff", "--format", "json", src, out).stdout)
    assert diff["identical"] is True


def test_keras_converts_to_h5_and_safetensors_but_not_back_from_them(
    clipcli: Cli, tmp_path: Path
) -> None:
    src = tmp_path / "m.keras"
    keras_archive(src)
    assert clipcli("convert", "--allow-lossy", src, tmp_path / "w.h5").returncode == 0
    assert clipcli("convert", "--allow-lossy", src, tmp_path / "w.safetensors").returncode == 0
    refused = clipcli("convert", tmp_path / "w.h5", tmp_path / "x.keras")
    assert refused.returncode == 2
    assert ".keras IN only" in refused.stderr
    assert not (tmp_path / "x.keras").exists()


def _archive(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data, method in members:
            archive.writestr(name, data, method)
    return path


def _weights_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.ones(3, np.float32)
    return path.read_bytes()


@pytest.mark.parametrize("bad_name", ["../evil.txt", "/etc/evil", "assets\\..\\evil"])
def test_member_names_that_escape_are_refused(clipcli: Cli, tmp_path: Path, bad_name: str) -> None:
    path = _archive(
        tmp_path / "m.keras",
        [
            ("config.json", b"{}", zipfile.ZIP_STORED),
            ("model.weights.h5", _weights_bytes(tmp_path), zipfile.ZIP_STORED),
            (bad_name, b"x", zipfile.ZIP_STORED),
        ],
    )
    run = clipcli("norms", path)
    assert run.returncode == 3
    assert "escapes" in run.stderr


@pytest.mark.slow  # ~1.3 s: deflating 150 MiB to build the bomb
def test_a_weights_bomb_is_refused_before_unpacking(clipcli: Cli, tmp_path: Path) -> None:
    """150 MiB of zeros deflate to ~150 KB: over 200 x the archive + 64 MiB."""
    path = tmp_path / "bomb.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", b"{}")
        member = zipfile.ZipInfo("model.weights.h5")
        member.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(member, "w", force_zip64=True) as sink:
            block = bytes(1 << 20)
            for _ in range(150):
                sink.write(block)
    assert path.stat().st_size < 2 << 20
    run = clipcli("ls", path)
    assert run.returncode == 3
    assert "zip bomb" in run.stderr


def test_a_central_directory_that_lies_about_sizes_is_refused(clipcli: Cli, tmp_path: Path) -> None:
    path = _archive(
        tmp_path / "m.keras",
        [
            ("config.json", b"{}", zipfile.ZIP_STORED),
            ("model.weights.h5", _weights_bytes(tmp_path), zipfile.ZIP_STORED),
        ],
    )
    data = bytearray(path.read_bytes())
    central = data.rindex(b"PK\x01\x02")  # the last central entry: model.weights.h5
    data[central + 24 : central + 28] = (10**9).to_bytes(4, "little")  # uncompressed size
    path.write_bytes(bytes(data))
    run = clipcli("ls", path)
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1


def test_weights_member_that_is_not_hdf5_is_named(clipcli: Cli, tmp_path: Path) -> None:
    path = _archive(
        tmp_path / "m.keras",
        [
            ("config.json", b"{}", zipfile.ZIP_STORED),
            ("model.weights.h5", b"not hdf5 at all" * 10, zipfile.ZIP_DEFLATED),
        ],
    )
    run = clipcli("norms", path)
    assert run.returncode == 3
    assert "m.keras[model.weights.h5]" in run.stderr


def test_member_count_exactly_at_the_limit(
    clipcli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clipcli.formats import keras_archive as module

    path = tmp_path / "m.keras"
    keras_archive(path)  # four members
    monkeypatch.setattr(module, "MAX_MEMBERS", 4)
    assert clipcli("ls", path).returncode == 0
    monkeypatch.setattr(module, "MAX_MEMBERS", 3)
    run = clipcli("ls", path)
    assert run.returncode == 3
    assert "over 3" in run.stderr


@pytest.mark.parametrize("suffix", [".h5", ".safetensors", ".npz"])
def test_keras_to_another_format_names_the_members_it_drops(
    clipcli: Cli, tmp_path: Path, suffix: str
) -> None:
    """F5: config.json, metadata.json and assets/ live only in the archive: another format
    drops them, so that is a loss (exit 2, naming them) unless --allow-lossy (then one
    warning line naming them); `diff` reports them as a difference."""
    src = tmp_path / "m.keras"
    keras_archive(src)
    out = tmp_path / f"w{suffix}"
    refused = clipcli("convert", src, out)
    assert refused.returncode == 2, refused.stderr
    for name in ("config.json", "metadata.json", "assets/vocab.txt"):
        assert repr(name) in refused.stderr
    assert "--allow-lossy" in refused.stderr
    assert not out.exists()
    clipped = clipcli("clip", "--global", "1", src, tmp_path / f"c{suffix}")
    assert clipped.returncode == 2, clipped.stderr
    lossy = clipcli("convert", "--allow-lossy", src, out)
    assert lossy.returncode == 0, lossy.stderr
    warnings = [line for line in lossy.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, lossy.stderr
    assert "'config.json'" in warnings[0]
    diff = json.loads(clipcli("diff", "--format", "json", src, out).stdout)
    assert diff["identical"] is False
    assert "archive member config.json" in json.dumps(diff)


@pytest.mark.parametrize(
    ("mode", "kind"),
    [(0o120777, "symbolic link"), (0o010644, "FIFO"), (0o020644, "character device")],
)
def test_a_member_that_is_a_link_or_device_is_refused(
    clipcli: Cli, tmp_path: Path, mode: int, kind: str
) -> None:
    """F12: a member whose Unix mode makes it a symbolic link (or a device, a FIFO) is an
    unsafe member like one whose name escapes: exit 3, before anything is read or copied."""
    path = tmp_path / "m.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", b"{}")
        archive.writestr("model.weights.h5", _weights_bytes(tmp_path))
        link = zipfile.ZipInfo("assets/evil")
        link.create_system = 3
        link.external_attr = mode << 16
        archive.writestr(link, b"/etc/passwd")
    for args in (["norms", path], ["clip", "--global", "1", path, tmp_path / "o.keras"]):
        run = clipcli(*args)
        assert run.returncode == 3, run.stderr
        assert f"'assets/evil' is a {kind}" in run.stderr
    assert not (tmp_path / "o.keras").exists()
