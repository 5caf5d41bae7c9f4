"""A TorchScript archive (torch.jit.save) holds a program: its data.pkl names the module's
own classes (`__torch__.*`). It is refused as what it is, exit 3 in one line, before its
pickle is read, not as "a global off the allow-list". The real file this was found on
(silero-vad's silero_vad.jit) is checked in tests/test_real_files.py."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from expect import REPO_ROOT, one_error_line

from clipcli.cli.entry import main

# Protocol 2: GLOBAL '__torch__.m M', STOP; a class only TorchScript has.
TORCHSCRIPT_GLOBAL = b"\x80\x02c__torch__.m\nM\n."


def torchscript_like(path: Path, records: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m/data.pkl", TORCHSCRIPT_GLOBAL)
        for record in records:
            archive.writestr(f"m/{record}", b"")
        archive.writestr("m/version", "3\n")
    return path


@pytest.mark.parametrize(
    "records",
    [["code/__torch__/m.py", "constants.pkl"], ["code/__torch__/m.py"], ["constants.pkl"]],
)
@pytest.mark.parametrize("command", ["ls", "norms", "convert"])
def test_torchscript_is_named_for_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], records: list[str], command: str
) -> None:
    path = torchscript_like(tmp_path / "model.pt", records)
    argv = [command, str(path)] + (
        [str(tmp_path / "o.safetensors")] if command == "convert" else []
    )
    assert main(argv) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "is a TorchScript module" in line
    assert "allow-list" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_without_code_or_constants_the_global_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the two TorchScript records decide: a plain zip checkpoint naming the same
    global is refused by the allow-list, naming it."""
    path = torchscript_like(tmp_path / "model.pt", ["codes", "constants.pkl.txt"])
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "__torch__.m.M, which is not on the allow-list" in line


def test_an_ordinary_zip_checkpoint_still_reads() -> None:
    assert main(["ls", str(REPO_ROOT / "tests" / "data" / "pytorch" / "zip_v2.pt")]) == 0
