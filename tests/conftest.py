"""Shared test scaffolding.

- Hypothesis profiles: `ci` (default, fast) and `long` (HYPOTHESIS_PROFILE=long, for fuzzing
  by hand: 20,000 examples per property).
- Checkpoint files built with the *official* libraries (or, for bfloat16/fp8 safetensors, by
  hand) and read back with the official libraries, so that no test trusts clipcli's own
  readers or writers: `write_checkpoint`, `read_checkpoint`, `read_metadata`.
- Ways to drive the real CLI: `cli` (typer's CliRunner), `run_main` (clipcli.cli.entry.main in
  process) and `run_subprocess` (`python -m clipcli`).

Helpers are handed out as fixtures (session-scoped where they hold no state, so hypothesis
tests can use them too) because test modules cannot safely `import conftest`: pytest
re-imports every directory's conftest.py under that same module name.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from clipcli.system import interrupts


def _restore_default_signal_dispositions() -> None:
    """A test run started with signals ignored (a background job of a script, `nohup`, some
    CI runners) hands SIG_IGN to every clipcli it starts, and clipcli keeps an ignored
    signal ignored on purpose: the signal tests need the defaults. The tests of that rule
    set SIG_IGN in the child themselves. (SIGPIPE and SIGXFSZ are Python's own, and
    subprocess restores them in children.)"""
    import signal

    for sig in interrupts.HANDLED:
        if signal.getsignal(sig) == signal.SIG_IGN:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, default)


_restore_default_signal_dispositions()

# Hypothesis profiles for the whole suite (tests/hostile/test_fuzz.py included; it used to
# re-register them in tests/hostile/conftest.py, which then applied to every test anyway):
# - `ci` (default): 40 examples per property; the fuzz file runs in well under a minute.
# - `long` (HYPOTHESIS_PROFILE=long): 20,000 examples per property, no deadline; for fuzzing
#   by hand or nightly, e.g. `HYPOTHESIS_PROFILE=long pytest tests/hostile/test_fuzz.py`.
CI_EXAMPLES = 40
LONG_EXAMPLES = 20_000
# The default ("ci") run is seeded: the same examples every time and no example database
# replayed from whatever directory pytest starts in. "long" explores at random.
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long", max_examples=LONG_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------------------ formats

FORMATS = ("safetensors", "npz", "h5")
EXTENSIONS = {"safetensors": ".safetensors", "npz": ".npz", "h5": ".h5"}

# safetensors dtype codes, from huggingface/safetensors (see /work/shared/FORMATS.md).
SAFETENSORS_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_DTYPES_BY_CODE = {code: name for name, code in SAFETENSORS_CODES.items()}
# dtypes that `safetensors.numpy` can neither save nor load: written and read by hand.
_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def _np_dtype(name: str) -> np.dtype[Any]:
    if name in _ML_DTYPES:
        import ml_dtypes

        dtype: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return dtype
    return np.dtype(name)


def _write_safetensors_by_hand(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None
) -> None:
    """8-byte little-endian header length, compact JSON padded with spaces to a multiple of
    8 (as the official writer does), then the C-order little-endian bytes in dict order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": SAFETENSORS_CODES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for array in tensors.values():
            handle.write(np.asarray(array, order="C").tobytes())  # x86/ARM: little-endian


def write_checkpoint(
    path: Path,
    tensors: dict[str, np.ndarray],
    metadata: dict[str, str] | None = None,
    *,
    compressed: bool = False,
) -> Path:
    """Write `tensors` in the format named by `path`'s extension, with official libraries.

    - .safetensors: `safetensors.numpy.save_file`; by hand when a tensor is bfloat16/fp8.
      `metadata` becomes `__metadata__`.
    - .npz: `np.savez` (`np.savez_compressed` with compressed=True); npz has no metadata.
    - .h5/.hdf5: h5py; a name with '/' becomes nested groups; `metadata` becomes root
      attributes.
    """
    path = Path(path)
    suffix = path.suffix
    ml = [n for n, a in tensors.items() if a.dtype.name in _ML_DTYPES]
    if suffix == ".safetensors":
        if ml:
            _write_safetensors_by_hand(path, tensors, metadata)
        else:
            from safetensors.numpy import save_file

            contiguous = {name: np.asarray(array, order="C") for name, array in tensors.items()}
            save_file(contiguous, str(path), metadata=dict(metadata) if metadata else None)
    elif ml:
        raise ValueError(f"{suffix} cannot hold {ml}: only safetensors stores bfloat16/fp8")
    elif suffix == ".npz":
        if metadata:
            raise ValueError("npz has no place for metadata")
        arrays: dict[str, Any] = dict(tensors)  # numpy types **kwds as bool | ArrayLike
        (np.savez_compressed if compressed else np.savez)(path, **arrays)
    elif suffix in (".h5", ".hdf5"):
        import h5py

        with h5py.File(path, "w") as handle:
            for key, value in (metadata or {}).items():
                handle.attrs[key] = value
            for name, array in tensors.items():
                handle.create_dataset(name, data=array)
    else:
        raise ValueError(f"unknown checkpoint extension {suffix!r}")
    return path


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(length))
    return header


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file, read with the official libraries, in file order.

    safetensors: `safe_open(framework="np")` (which also validates the whole header); tensors
    it cannot load (bfloat16, fp8) are sliced from the raw bytes and viewed with ml_dtypes.
    npz: `np.load(allow_pickle=False)`. HDF5: h5py, dataset paths without the leading '/'.
    """
    path = Path(path)
    suffix = path.suffix
    if suffix == ".safetensors":
        from safetensors import safe_open

        header = _safetensors_header(path)
        header.pop("__metadata__", None)
        length = struct.unpack("<Q", path.read_bytes()[:8])[0]
        result: dict[str, np.ndarray] = {}
        with safe_open(str(path), framework="np") as handle:
            assert sorted(handle.keys()) == sorted(header)
            order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
            for name in order:
                entry = header[name]
                dtype_name = _DTYPES_BY_CODE[entry["dtype"]]
                if dtype_name in _ML_DTYPES:
                    begin, end = entry["data_offsets"]
                    with open(path, "rb") as raw:
                        raw.seek(8 + length + begin)
                        data = raw.read(end - begin)
                    array = np.frombuffer(data, dtype=_np_dtype(dtype_name))
                    result[name] = array.reshape(entry["shape"]).copy()
                else:
                    result[name] = np.asarray(handle.get_tensor(name))
        return result
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as loaded:
            return {name: loaded[name] for name in loaded.files}
    if suffix in (".h5", ".hdf5"):
        import h5py

        found: dict[str, np.ndarray] = {}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                found[name] = np.asarray(obj[()])

        with h5py.File(path, "r") as handle:
            handle.visititems(visit)
        return found
    raise ValueError(f"unknown checkpoint extension {suffix!r}")


def read_metadata(path: Path) -> dict[str, str]:
    """safetensors `__metadata__` (via safe_open) or HDF5 root attributes; {} for npz."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as handle:
            return dict(handle.metadata() or {})
    if path.suffix in (".h5", ".hdf5"):
        import h5py

        with h5py.File(path, "r") as handle:
            return {
                k: v.decode() if isinstance(v, bytes) else str(v) for k, v in handle.attrs.items()
            }
    return {}


def assert_bit_identical(actual: np.ndarray, expected: np.ndarray, name: str = "") -> None:
    """Same dtype, same shape, same bytes (NaN payloads and signed zeros included)."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), (
        f"{name}: bytes differ"
    )


def norm64(array: np.ndarray) -> float:
    """The exact-enough L2 norm of the values: float64 math, power-of-two rescaled so that
    1e200 or 1e-200 elements neither overflow nor underflow."""
    wide = np.asarray(array).astype(np.float64).ravel()
    peak = float(np.max(np.abs(wide))) if wide.size else 0.0
    if peak == 0.0 or not np.isfinite(peak):
        return peak
    exponent = int(np.frexp(peak)[1])
    scaled = np.ldexp(wide, -exponent)
    with np.errstate(over="ignore"):  # a norm beyond float64's range is inf
        return float(np.ldexp(np.sqrt(np.dot(scaled, scaled)), exponent))


def assert_one_error_line(stderr: str, *fragments: str) -> str:
    """stderr is exactly one line `clipcli: error: ...` holding every fragment; no traceback."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("clipcli: error:"), line
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def listing(directory: Path) -> list[str]:
    """Every entry in the directory, hidden temp files included."""
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------ running the CLI


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def _cli_runner(*args: str | Path) -> Run:
    from typer.testing import CliRunner

    from clipcli.cli.typer_app import app

    # Rich tables are pinned to a wide terminal so that names are never folded.
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return Run(result.exit_code, result.stdout, result.stderr)


def _subprocess(*args: str | Path, cwd: Path | None = None) -> Run:
    env = dict(os.environ, COLUMNS="200")
    env.pop("CLIPCLI_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )
    return Run(done.returncode, done.stdout, done.stderr)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    """Each checkpoint format in turn: 'safetensors', 'npz', 'h5'."""
    return str(request.param)


@pytest.fixture(scope="session", name="write_checkpoint")
def _write_checkpoint_fixture() -> Callable[..., Path]:
    return write_checkpoint


@pytest.fixture(scope="session", name="read_checkpoint")
def _read_checkpoint_fixture() -> Callable[[Path], dict[str, np.ndarray]]:
    return read_checkpoint


@pytest.fixture(scope="session", name="read_metadata")
def _read_metadata_fixture() -> Callable[[Path], dict[str, str]]:
    return read_metadata


@pytest.fixture(scope="session", name="assert_bit_identical")
def _assert_bit_identical_fixture() -> Callable[..., None]:
    return assert_bit_identical


@pytest.fixture(scope="session", name="assert_one_error_line")
def _assert_one_error_line_fixture() -> Callable[..., str]:
    return assert_one_error_line


@pytest.fixture(scope="session", name="norm64")
def _norm64_fixture() -> Callable[[np.ndarray], float]:
    return norm64


@pytest.fixture(scope="session", name="listing")
def _listing_fixture() -> Callable[[Path], list[str]]:
    return listing


@pytest.fixture(scope="session")
def cli() -> Callable[..., Run]:
    """`cli("norms", path, "--format", "json")` through typer's CliRunner -> Run."""
    return _cli_runner


@pytest.fixture
def run_main(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """`run_main("clip", ...)` through `clipcli.cli.entry.main(argv)`, the console entry point."""
    from clipcli.cli.entry import main

    def run(*args: str | Path) -> Run:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@dataclass(frozen=True)
class MainRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def clipcli(capsys: pytest.CaptureFixture[str]) -> Callable[..., MainRun]:
    """clipcli's main() in this process (no interpreter start-up per command); a module
    may override it (tests/test_stream_out.py runs a real process)."""
    from clipcli.cli.entry import main

    def run(*args: str | Path) -> MainRun:
        code = main([str(arg) for arg in args])
        out, err = capsys.readouterr()
        return MainRun(code, out, err)

    return run


@pytest.fixture(scope="session")
def run_subprocess() -> Callable[..., Run]:
    """`run_subprocess("clip", ...)` as `python -m clipcli ...` in a child process."""
    return _subprocess


@pytest.fixture
def ckpt(tmp_path: Path, fmt: str) -> Callable[[str], Path]:
    """`ckpt("in")` -> tmp_path / "in.<ext>" for the current `fmt`."""
    return lambda stem: tmp_path / (stem + EXTENSIONS[fmt])


# ------------------------------------------------------------------ real file-system faults


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Any:
    """`mount_tmpfs("name", size="1m", options="ro")`: a real tmpfs mounted under tmp_path,
    for full disks, read-only directories and second file systems. Unmounted afterwards.
    Skips, saying why, where mounting is impossible (not root, no mount namespace)."""
    mounted: list[Path] = []

    def mount(name: str = "tmpfs", size: str = "64m", options: str = "") -> Path:
        target = tmp_path / name
        target.mkdir()
        opts = f"size={size}" + (f",{options}" if options else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or 'mount failed'}")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


RunCli = Callable[..., Run]
