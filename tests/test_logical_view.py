"""The logical layer (clipcli.logical): a non-identity view goes through measure, plan,
clip and diff. The toy view stores each tensor `w` as two halves `w.half0`, `w.half1`;
jobs see one logical `w`, and a clip is lowered to the halves."""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clipcli import api
from clipcli.errors import DataRefusedError
from clipcli.formats.base import Reader, TensorInfo
from clipcli.jobs.spec import ClipSpec, Mode
from clipcli.logical import views
from clipcli.logical.view import LogicalTensor, Part, View


class Halves(View):
    """`X.half0` + `X.half1` (1-D, same dtype) are one logical tensor `X`; a stored
    `X.note` beside them is a side tensor (listed, never in a norm)."""

    def __init__(self, reader: Reader) -> None:
        self.stored = {i.name: i for i in reader.infos}

    def tensors(self) -> list[LogicalTensor]:
        out = []
        for name, info in self.stored.items():
            if name.endswith(".half1") or name.endswith(".note"):
                continue
            if name.endswith(".half0"):
                base = name[: -len(".half0")]
                other = self.stored[base + ".half1"]
                shape = (info.shape[0] + other.shape[0],)
                logical = TensorInfo(base, info.dtype, shape, info.nbytes + other.nbytes)
                parts = (Part(name, "half"), Part(other.name, "half"))
                out.append(LogicalTensor(logical, parts, "halves"))
            else:
                out.append(LogicalTensor(info, (Part(name, "values"),)))
        return out

    def side_tensors(self) -> list[tuple[TensorInfo, str]]:
        return [(i, "note") for n, i in self.stored.items() if n.endswith(".note")]

    def chunks(
        self, reader: Reader, tensor: LogicalTensor, chunk_elems: int | None = None
    ) -> Iterator[np.ndarray]:
        for part in tensor.parts:
            yield from reader.chunks(self.stored[part.name], chunk_elems)


Halved = tuple[Path, dict[str, np.ndarray]]


@pytest.fixture(autouse=True)
def halves_view(monkeypatch: pytest.MonkeyPatch) -> None:
    def factory(reader: Reader) -> View | None:
        if any(i.name.endswith(".half0") for i in reader.infos):
            return Halves(reader)
        return None

    monkeypatch.setattr(views, "VIEW_FACTORIES", [factory])


def exact_norm(*arrays: np.ndarray) -> float:
    total = sum(Fraction(float(x)) ** 2 for a in arrays for x in a.ravel())
    return math.sqrt(total)


@pytest.fixture
def halves_file(tmp_path: Path) -> Halved:
    rng = np.random.default_rng(7)
    tensors = {
        "w.half0": rng.standard_normal(5).astype(np.float32),
        "w.half1": rng.standard_normal(3).astype(np.float32),
        "w.note": np.array([1000.0], dtype=np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
    }
    path = tmp_path / "halves.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_identity_view_is_the_stored_reader(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"a": np.ones(3, np.float32)}, str(path))
    from clipcli.formats.opening import open_reader

    with open_reader(path) as reader:
        assert views.logical(reader) is reader  # plain checkpoints: the code they always ran


def test_measure_sees_logical_tensors(halves_file: Halved) -> None:
    path, t = halves_file
    m = api.measure(path)
    rows = {s.info.name: s for s in m.tensors}
    assert list(rows) == ["b", "w", "w.note"]  # the file's order (safetensors sorts names)
    assert rows["w"].info.shape == (8,)
    assert rows["w"].stats.norm == pytest.approx(exact_norm(t["w.half0"], t["w.half1"]), rel=1e-15)
    assert rows["w.note"].role.value == "quantization"
    assert not rows["w.note"].in_global
    assert m.global_norm == pytest.approx(exact_norm(t["w.half0"], t["w.half1"], t["b"]), rel=1e-15)
    stored = api.measure(path, stored=True)
    assert [s.info.name for s in stored.tensors] == ["b", "w.half0", "w.half1", "w.note"]


def test_global_clip_is_lowered_to_the_halves(halves_file: Halved, tmp_path: Path) -> None:
    path, t = halves_file
    limit = 1.0
    out = tmp_path / "out.safetensors"
    result = api.clip(path, out, ClipSpec(Mode.GLOBAL, limit=limit), durable=False)
    written = load_file(str(out))
    assert sorted(written) == sorted(t)  # every stored tensor, none invented
    assert np.array_equal(written["w.note"], t["w.note"])  # a side tensor kept byte for byte
    after = exact_norm(written["w.half0"], written["w.half1"], written["b"])
    assert after <= limit
    assert after > limit * (1 - 1e-6)
    ratio = written["w.half0"].astype(np.float64) / t["w.half0"]
    assert np.allclose(ratio, ratio[0], rtol=1e-6)  # one factor for both halves
    rows = {r.info.name: r for r in result.rows}
    assert rows["w"].changed
    assert rows["w"].after.norm == pytest.approx(
        exact_norm(written["w.half0"], written["w.half1"]), rel=1e-15
    )


def test_clip_within_limit_keeps_every_byte(halves_file: Halved, tmp_path: Path) -> None:
    path, t = halves_file
    out = tmp_path / "out.safetensors"
    api.clip(path, out, ClipSpec(Mode.GLOBAL, limit=1e6), durable=False)
    assert path.read_bytes() == out.read_bytes() or all(
        np.array_equal(v, t[k]) for k, v in load_file(str(out)).items()
    )


def test_value_clip_of_a_composite_tensor_is_refused(halves_file: Halved, tmp_path: Path) -> None:
    path, _ = halves_file
    out = tmp_path / "out.safetensors"
    with pytest.raises(DataRefusedError, match="halves weight cannot be clipped by clamp"):
        api.clip(path, out, ClipSpec(Mode.VALUE, low=-0.1, high=0.1), durable=False)
    assert not out.exists()


def test_diff_pairs_logical_tensors(halves_file: Halved, tmp_path: Path) -> None:
    path, t = halves_file
    plain = tmp_path / "plain.safetensors"
    whole = np.concatenate([t["w.half0"], t["w.half1"]])
    save_file({"w": whole, "w.note": t["w.note"], "b": t["b"]}, str(plain))
    result = api.diff(plain, path)
    pairs = {d.name: d for d in result.tensors}
    assert set(pairs) == {"w", "w.note", "b"}
    assert pairs["w"].max_abs_diff == 0.0
