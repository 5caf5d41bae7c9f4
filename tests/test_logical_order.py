"""A logical tensor made of several stored ones is listed where its first part is
stored, also when another stored tensor lies between its parts (the toy Halves view of
test_logical_view: `X.half0` + `X.half1` are one logical `X`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_logical_view import Halves

from clipcli import api
from clipcli.formats.base import Reader
from clipcli.logical import views
from clipcli.logical.view import View


def test_a_composite_tensor_is_listed_at_its_first_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def factory(reader: Reader) -> View | None:
        return Halves(reader) if any(i.name.endswith(".half0") for i in reader.infos) else None

    monkeypatch.setattr(views, "VIEW_FACTORIES", [factory])
    path = tmp_path / "m.safetensors"
    one = np.ones(2, np.float32)
    save_file({"w.half0": one, "w.half0x": one, "w.half1": one, "b": one}, str(path))
    stored = [t.info.name for t in api.measure(path, stored=True).tensors]
    assert stored == ["b", "w.half0", "w.half0x", "w.half1"]  # safetensors sorts names
    assert [t.info.name for t in api.measure(path).tensors] == ["b", "w", "w.half0x"]
