"""Issue 20, many tensors: a plain checkpoint pays nothing per tensor for the quantized
view it does not need."""

from __future__ import annotations

import numpy as np

from clipcli.formats.base import TensorInfo
from clipcli.logical.quantized import rules
from clipcli.logical.quantized.view import QuantizedView


def _plain(count: int) -> list[TensorInfo]:
    return [TensorInfo(f"t{i}.weight", np.dtype(np.float32), (1,), 4) for i in range(count)]


def test_a_plain_checkpoint_lays_out_no_logical_tensors() -> None:
    view = QuantizedView(_plain(1000), None)
    assert view.identity
    assert view._layout is None  # nothing per tensor built for a view that goes unused
    tensors = view.tensors()  # still there when asked, in order, one part each
    assert [t.info.name for t in tensors] == [f"t{i}.weight" for i in range(1000)]
    assert all(len(t.parts) == 1 and t.parts[0].role == "values" for t in tensors)
    assert view.side_tensors() == []


def test_scheme_dtype_names_are_the_cached_ones() -> None:
    info = _plain(1)[0]
    assert rules.dtype_name(info) == "float32"
    import ml_dtypes

    bf16 = TensorInfo("b", np.dtype(ml_dtypes.bfloat16), (1,), 2)
    assert rules.dtype_name(bf16) == "bfloat16"
