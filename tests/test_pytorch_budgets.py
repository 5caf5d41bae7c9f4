"""Issue 22: budgets of the PyTorch reader that a readers' attack found missing.

1. Views that present more bytes than their storage holds (stride 0 from torch's `expand`,
   overlapping strides) are charged to the expansion budget (200 × the file + 64 MiB),
   refused with exit 3 naming the tensor before anything is read or OUT is made; real
   `torch.save` files with `expand`ed tensors still read, with torch's values.
2. The pickle interpreter charges what it builds by its memory cost, proportional to the
   pickle's size: millions of empty sets or dicts are refused within 300 MiB, and an
   allocation that fails under `prlimit --as` is exit 5 "out of memory", never 70.
3. Zip members with a symbolic-link (or device) mode, and a zip whose end record hides a
   second one in its comment, are refused with a precise line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from expect import REPO_ROOT, one_error_line
from test_pytorch_hostile import STOP, legacy, state, tensor, torch_zip

from clipcli.cli.entry import main
from clipcli.formats.opening import open_reader
from clipcli.formats.pytorch import reader as pytorch_reader

VIEWS = REPO_ROOT / "tests" / "data" / "pytorch_views"
RSS_BUDGET = 300 << 20  # bytes of peak resident memory (docs/UNTRUSTED_INPUT.md)


def _expected() -> dict[str, np.ndarray]:
    with np.load(VIEWS / "expanded.expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


# ------------------------------------------------------------------ 1. views


def _fixture_charge() -> int:
    """What the fixture's views present beyond their one storage, from torch's own shapes
    (the expected arrays) and the storage torch saved: 8 float32, 32 bytes."""
    return sum(a.size * 4 for a in _expected().values()) - 8 * 4


@pytest.mark.parametrize("name", ["expanded.pt", "expanded_legacy.pt"])
def test_torch_saved_expand_views_read_with_torchs_values(name: str) -> None:
    want = _expected()
    with open_reader(VIEWS / name) as reader:
        assert sorted(i.name for i in reader.infos) == sorted(want)
        for info in reader.infos:
            np.testing.assert_array_equal(reader.read(info).astype(np.float64), want[info.name])


@pytest.mark.parametrize("name", ["expanded.pt", "expanded_legacy.pt"])
@pytest.mark.parametrize(("slack", "refused"), [(0, False), (-1, True)])
def test_view_charge_exactly_at_the_budget_and_one_past(
    name: str,
    slack: int,
    refused: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A budget of exactly what the views generate reads; one byte less is refused, naming
    the tensor whose view crossed it (the last one, in pickle order)."""
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 0)
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", _fixture_charge() + slack)
    assert main(["ls", str(VIEWS / name)]) == (3 if refused else 0)
    err = capsys.readouterr().err
    if refused:
        line = one_error_line(err)
        assert "tensor 'windows'" in line, line
        assert f"present {_fixture_charge()} bytes more than their storages hold" in line


@pytest.mark.parametrize("ratio_part", [0, 1])
def test_the_budget_grows_with_the_files_size(
    ratio_part: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 bytes per byte of file: the free bytes set so that the file's share brings the
    budget exactly to the charge (accepted), or one byte short of it (refused)."""
    path = VIEWS / "expanded.pt"
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 2)
    free = _fixture_charge() - 2 * path.stat().st_size - ratio_part
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", free)
    assert main(["ls", "-q", str(path)]) == (3 if ratio_part else 0)


def _stride0(path: Path, elements: int) -> Path:
    """One float32 storage element viewed as [elements] with stride [0] (the attack)."""
    pickled = state(w=tensor(size=(elements,), stride=(0,), numel=1))
    return torch_zip(path, pickled, {"0": np.float32(-5).tobytes()})


def _stride0_legacy(path: Path, elements: int) -> Path:
    obj = state(w=tensor(size=(elements,), stride=(0,), numel=1, legacy=True))[:-1] + STOP
    return legacy(path, obj, ["0"], (1).to_bytes(8, "little") + np.float32(-5).tobytes())


@pytest.mark.parametrize("make", [_stride0, _stride0_legacy])
@pytest.mark.parametrize("command", ["ls", "norms", "convert"])
def test_a_tiny_file_expanding_to_a_gibibyte_is_refused_before_out_exists(
    make: object, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make(tmp_path / "m.pt", 1 << 28)  # type: ignore[operator]
    assert path.stat().st_size < 1024
    out = tmp_path / "out.safetensors"
    argv = [command, str(path), *([str(out)] if command == "convert" else [])]
    assert main(argv) == 3
    line = one_error_line(capsys.readouterr().err)
    assert "tensor 'w'" in line, line
    assert "expansion bomb" in line, line
    assert f"present {(1 << 30) - 4} bytes" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_a_hankel_window_claiming_a_thousand_times_its_storage_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 MiB of storage viewed as [2^20 - 1024, 1024] with strides [1, 1]: 4 GiB."""
    n = 1 << 20
    pickled = state(w=tensor(size=(n - 1024, 1024), stride=(1, 1), numel=n))
    path = torch_zip(tmp_path / "m.pt", pickled, {"0": bytes(4 * n)})
    assert main(["ls", str(path)]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert f"present {(n - 1024) * 1024 * 4 - 4 * n} bytes" in line, line


def test_a_storage_split_among_its_tensors_is_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused storage viewed by three disjoint tensors generates nothing: no budget at all
    still reads it."""
    monkeypatch.setattr(pytorch_reader, "VIEW_RATIO", 0)
    monkeypatch.setattr(pytorch_reader, "VIEW_FREE_BYTES", 0)
    parts = {f"p{i}": tensor(offset=4 * i, size=(4,), numel=12) for i in range(3)}
    path = torch_zip(tmp_path / "m.pt", state(**parts), {"0": bytes(48)})
    assert main(["norms", "-q", str(path)]) == 0
