"""`diff` compares file metadata by meaning across formats (issue 23, item 2).

A lossless convert between safetensors and HDF5 keeps `format=pt`: safetensors holds it in
`__metadata__`, HDF5 as a root string attribute. diff used to compare the attribute a
second time as structure (`/ @format`, with its HDF5 string type) against a side that has
no structure, and reported `(absent) -> vlen str ... = "pt"`: a change that is not there.
The rule now: a root attribute whose name is a metadata key of its file is that key,
compared once by its text as h5py reads it; its string type is not compared.

The expected texts come from the official readers (safetensors' `safe_open(...).metadata()`
and h5py's `attrs`), never from clipcli. The --fail-above line is one sentence for every
combination of a value change and 0, 1 or N other differences.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from clipcli.cli.commands.compare import fail_above_message

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "tiny_mlp.safetensors"


def _minilm_like(path: Path) -> dict[str, np.ndarray]:
    """The layout of sentence-transformers' all-MiniLM-L6-v2 model.safetensors (names, an
    int64 position_ids buffer, `{"format": "pt"}` only), small, by the official writer."""
    rng = np.random.default_rng(23)
    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": rng.standard_normal((30, 8)).astype(np.float32),
        "embeddings.position_embeddings.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "embeddings.position_ids": np.arange(16, dtype=np.int64)[None],
        "embeddings.LayerNorm.weight": np.ones(8, np.float32),
        "encoder.layer.0.attention.self.query.weight": rng.standard_normal((8, 8)).astype(
            np.float32
        ),
        "encoder.layer.0.attention.self.query.bias": np.zeros(8, np.float32),
        "pooler.dense.weight": rng.standard_normal((8, 8)).astype(np.float32),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _diff_json(run_main: Any, a: Path, b: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    result = run_main("diff", a, b, "--format", "json", *extra)
    return result.code, json.loads(result.stdout), result.stderr


def _official_metadata(path: Path) -> dict[str, str]:
    """A file's metadata as the format's own reader gives it (no clipcli code)."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), "np") as handle:
            return dict(handle.metadata() or {})
    with h5py.File(path, "r") as f:
        values = {k: f.attrs[k] for k in f.attrs}
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in values.items()}


@pytest.mark.parametrize("source", ["sample", "minilm"])
@pytest.mark.parametrize("suffix", [".h5", ".hdf5"])
def test_lossless_convert_to_hdf5_and_back_diffs_clean_both_ways(
    run_main: Any, tmp_path: Path, source: str, suffix: str
) -> None:
    src = tmp_path / "m.safetensors"
    if source == "sample":
        shutil.copy(SAMPLE, src)
    else:
        _minilm_like(src)
    h5 = tmp_path / f"m{suffix}"
    back = tmp_path / "back.safetensors"
    assert run_main("convert", src, h5).code == 0
    assert run_main("convert", h5, back).code == 0
    # The official readers agree that both files hold the same metadata.
    assert _official_metadata(h5) == _official_metadata(src)
    for a, b in [(src, h5), (h5, src), (h5, back), (back, h5), (src, back), (back, src)]:
        result = run_main("diff", a, b, "--fail-above", "0")
        assert result.code == 0, (a.name, b.name, result.stdout[-400:], result.stderr)
        assert result.stderr == ""
        code, document, _ = _diff_json(run_main, a, b)
        assert code == 0
        assert document["metadata_changes"] == []
        assert document["identical"] is True


def _string_attribute(
    f: Any, name: str, text: bytes, size: int | None, cset: int, pad: int
) -> None:
    """A scalar root attribute holding `text` in one of HDF5's string types, made with
    h5py's low-level API (the type is exactly the one asked for)."""
    if size is None:
        dtype = h5py.string_dtype("utf-8" if cset == h5py.h5t.CSET_UTF8 else "ascii")
        f.attrs.create(name, text.decode(), dtype=dtype)
        return
    string_type = h5py.h5t.C_S1.copy()
    string_type.set_size(size)
    string_type.set_strpad(pad)
    string_type.set_cset(cset)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    attribute = h5py.h5a.create(f.id, name.encode(), string_type, space)
    padding = b" " if pad == h5py.h5t.STR_SPACEPAD else b"\0"
    attribute.write(np.array(text.ljust(size, padding), dtype=f"S{size}"), mtype=string_type)


STRING_TYPES = [
    pytest.param(None, h5py.h5t.CSET_UTF8, 0, id="vlen-utf8"),
    pytest.param(None, h5py.h5t.CSET_ASCII, 0, id="vlen-ascii"),
    *(
        pytest.param(6, cset, pad, id=f"fixed-{cname}-{pname}")
        for cset, cname in [(h5py.h5t.CSET_ASCII, "ascii"), (h5py.h5t.CSET_UTF8, "utf8")]
        for pad, pname in [
            (h5py.h5t.STR_NULLTERM, "nullterm"),
            (h5py.h5t.STR_NULLPAD, "nullpad"),
            (h5py.h5t.STR_SPACEPAD, "spacepad"),
        ]
    ),
]


@pytest.mark.parametrize(("size", "cset", "pad"), STRING_TYPES)
def test_same_text_in_any_hdf5_string_type_is_the_same_metadata(
    run_main: Any, tmp_path: Path, size: int | None, cset: int, pad: int
) -> None:
    weights = {"w": np.arange(6, dtype=np.float32)}
    st = tmp_path / "a.safetensors"
    save_file(weights, str(st), metadata={"format": "pt"})
    h5 = tmp_path / "b.h5"
    with h5py.File(h5, "w") as f:
        f["w"] = weights["w"]
        _string_attribute(f, "format", b"pt", size, cset, pad)
    assert _official_metadata(h5) == {"format": "pt"}  # h5py strips the declared padding
    for a, b in [(st, h5), (h5, st)]:
        code, document, err = _diff_json(run_main, a, b, "--fail-above", "0")
        assert (code, document["metadata_changes"], err) == (0, [], "")


def test_an_edited_value_is_one_change_and_other_attributes_stay_structure(
    run_main: Any, tmp_path: Path
) -> None:
    """The same key with other text is reported once (by key, not again as `/ @format`);
    a root attribute that is not text (an integer) is structure, compared exactly."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, text in [(a, b"pt"), (b, b"tf")]:
        with h5py.File(path, "w") as f:
            f["w"] = np.ones(3, np.float32)
            _string_attribute(f, "format", text, 4, h5py.h5t.CSET_ASCII, h5py.h5t.STR_NULLPAD)
    with h5py.File(b, "r+") as f:
        f.attrs["epoch"] = np.int64(3)
    code, document, err = _diff_json(run_main, a, b, "--fail-above", "0")
    assert code == 1
    assert document["metadata_changes"] == [
        {"key": "format", "a": "pt", "b": "tf"},
        {"key": "/ @epoch", "a": None, "b": "<i8 scalar = 3"},
    ]
    assert err == "clipcli: 2 structure or metadata differences fail --fail-above 0\n"
    st = tmp_path / "c.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(st), metadata={"format": "tf"})
    code, document, err = _diff_json(run_main, a, st, "--fail-above", "0")
    assert document["metadata_changes"] == [{"key": "format", "a": "pt", "b": "tf"}]
    assert err == "clipcli: 1 structure or metadata difference fails --fail-above 0\n"


def test_padding_that_is_text_is_a_difference(run_main: Any, tmp_path: Path) -> None:
    """Null-padded `pt  ` holds two spaces as text (h5py returns them): not `pt`."""
    st = tmp_path / "a.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(st), metadata={"format": "pt"})
    h5 = tmp_path / "b.h5"
    with h5py.File(h5, "w") as f:
        f["w"] = np.ones(3, np.float32)
        _string_attribute(f, "format", b"pt  ", 4, h5py.h5t.CSET_ASCII, h5py.h5t.STR_NULLPAD)
    assert _official_metadata(h5) == {"format": "pt  "}
    _, document, _ = _diff_json(run_main, st, h5)
    assert document["metadata_changes"] == [{"key": "format", "a": "pt", "b": "pt  "}]


# ------------------------------------------------------------------ the --fail-above line


@pytest.mark.parametrize(
    ("over", "other", "line"),
    [
        (None, 1, "clipcli: 1 structure or metadata difference fails --fail-above 0"),
        (None, 2, "clipcli: 2 structure or metadata differences fail --fail-above 0"),
        (("w", 0.5), 0, "clipcli: largest relative change 0.5 (w) exceeds --fail-above 0"),
        (
            ("w", 0.5),
            1,
            "clipcli: largest relative change 0.5 (w) exceeds --fail-above 0, and 1 structure "
            "or metadata difference fails it",
        ),
        (
            ("w", 0.5),
            3,
            "clipcli: largest relative change 0.5 (w) exceeds --fail-above 0, and 3 structure "
            "or metadata differences fail it",
        ),
        (("w", float("nan")), 0, "clipcli: relative change nan (w) fails --fail-above 0"),
        (("w", float("inf")), 0, "clipcli: largest relative change inf (w) exceeds --fail-above 0"),
        (("a\nb", 1.0), 0, "clipcli: largest relative change 1 (a\\nb) exceeds --fail-above 0"),
    ],
)
def test_fail_above_line_for_every_combination(
    over: tuple[str, float] | None, other: int, line: str
) -> None:
    assert fail_above_message(over, other, 0.0) == line


def _pair(tmp_path: Path, b_values: list[float], b_metadata: dict[str, str]) -> tuple[Path, Path]:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.array([1.0, 0.0], np.float64)}, str(a), metadata={"format": "pt"})
    save_file({"w": np.array(b_values, np.float64)}, str(b), metadata=b_metadata)
    return a, b


def test_relative_change_at_the_limit_passes_and_past_it_fails(
    run_main: Any, tmp_path: Path
) -> None:
    """‖A−B‖/‖A‖ = 0.5 exactly (A = [1, 0], B = [1.5, 0]): --fail-above 0.5 holds,
    the next float64 below it fails."""
    a, b = _pair(tmp_path, [1.5, 0.0], {"format": "pt"})
    at = run_main("diff", a, b, "--fail-above", "0.5")
    assert (at.code, at.stderr) == (0, "")
    below = repr(float(np.nextafter(0.5, 0.0)))
    past = run_main("diff", a, b, "--fail-above", below)
    assert past.code == 1
    # The limit is shown with every digit it needs, never rounded onto the change.
    assert past.stderr == (
        "clipcli: largest relative change 0.5 (w) exceeds --fail-above 0.49999999999999994\n"
    )


def test_a_change_just_over_the_limit_is_shown_over_it() -> None:
    change = float(np.nextafter(0.5, 1.0))
    assert fail_above_message(("w", change), 0, 0.5) == (
        "clipcli: largest relative change 0.5000000000000001 (w) exceeds --fail-above 0.5"
    )


def test_value_and_metadata_together_are_one_sentence(run_main: Any, tmp_path: Path) -> None:
    a, b = _pair(tmp_path, [1.5, 0.0], {"format": "tf"})
    result = run_main("diff", a, b, "--fail-above", "0.1")
    assert result.code == 1
    assert result.stderr == (
        "clipcli: largest relative change 0.5 (w) exceeds --fail-above 0.1, and 1 structure "
        "or metadata difference fails it\n"
    )
