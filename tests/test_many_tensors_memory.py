"""Issue 20, many tensors: what is held per tensor for the whole run, and that holding less
changes nothing a user sees (200,000 tensors: every record kept twice is megabytes)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np

from clipcli.api import measure
from clipcli.formats.base import Listed
from clipcli.formats.opening import open_reader
from clipcli.formats.safetensors.header import DTYPE_NAMES, ITEMSIZES
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.formats.sharded.reader import ShardedReader
from clipcli.report.builders import norms_report
from clipcli.report.model import Column, Report
from clipcli.report.serialize import write_csv, write_json
from clipcli.report.table import render_table


def write_every_code(path: Path, prefix: str = "") -> Path:
    """One tensor of each dtype code safetensors files hold, shapes of rank 0 to 2."""
    header: dict[str, object] = {}
    offset = 0
    for k, code in enumerate(DTYPE_NAMES):
        shape = [[], [3], [2, 2]][k % 3]
        nbytes = int(np.prod(shape)) * ITEMSIZES[code]
        header[f"{prefix}t{k}"] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))
    return path


def test_a_listing_is_the_same_before_and_after_the_infos(tmp_path: Path) -> None:
    """The listing is the header's own, for every dtype code, before and after the numpy
    infos are built, and the infos carry the same records."""
    with SafetensorsReader(write_every_code(tmp_path / "m.safetensors")) as reader:
        before = list(reader.listing)
        assert all(type(t) is Listed for t in before)
        assert [t.dtype_name for t in before] == list(DTYPE_NAMES.values())
        infos = reader.infos
        assert reader.listing == before
        assert [(i.name, i.dtype_name, i.shape, i.nbytes) for i in infos] == before
        assert reader.infos is infos  # built once


def test_a_sharded_listing_is_the_same_before_and_after_the_infos(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_every_code(model / "model-00001-of-00002.safetensors", "a.")
    write_every_code(model / "model-00002-of-00002.safetensors", "b.")
    weight_map = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with SafetensorsReader(model / shard) as one:
            weight_map.update({t.name: shard for t in one.listing})
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_reader(model) as reader:
        assert isinstance(reader, ShardedReader)
        before = list(reader.listing)
        assert [t.name for t in before] == list(weight_map)
        infos = reader.infos
        assert reader.listing == before
        assert [(i.name, i.dtype_name, i.shape, i.nbytes) for i in infos] == before


def test_a_norms_row_holds_the_tensors_own_shape(tmp_path: Path) -> None:
    """Not a list made per row; and every format shows it as it showed the list."""
    path = write_every_code(tmp_path / "m.safetensors")
    m = measure(path)
    report = norms_report(m)
    for row, t in zip(report.rows, m.tensors, strict=True):
        assert row[2] is t.info.shape
    as_lists = report._replace(
        rows=tuple(
            (*r[:2], list(m.tensors[k].info.shape), *r[3:]) for k, r in enumerate(report.rows)
        )
    )
    for write in (write_json, write_csv, lambda r, s: render_table(r, s, 200)):
        shown, listed = io.StringIO(), io.StringIO()
        write(report, shown)
        write(as_lists, listed)
        assert shown.getvalue() == listed.getvalue()
    assert json.loads(_json(report))["tensors"][2]["shape"] == [2, 2]


def _json(report: Report) -> str:
    stream = io.StringIO()
    write_json(report, stream)
    return stream.getvalue()


def test_repeated_shapes_and_counts_share_their_texts() -> None:
    """A table of 100,000 experts of a few shapes holds a few texts, not one per row."""
    rows = tuple(
        (f"t{i}", (4096, 128) if i % 2 else (7,), 4096 * 128 if i % 2 else 7) for i in range(1000)
    )
    report = Report(
        "t",
        (Column("name", "name"), Column("shape", "shape"), Column("numel", "numel", True)),
        rows,
    )
    from clipcli.report import table

    texts = table._column_texts([r[1] for r in rows])
    assert texts[:2] == ["[7]", "[4096,128]"]
    assert len({id(t) for t in texts}) == 2
    counts = table._column_texts([r[2] for r in rows])
    assert counts[:2] == ["7", "524288"]
    assert len({id(t) for t in counts}) == 2
    shown = io.StringIO()
    render_table(report, shown, 200)
    assert "[4096,128]" in shown.getvalue()
    assert "524288" in shown.getvalue()
