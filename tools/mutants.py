"""Planted faults: does the test suite notice when a budget, limit, verdict or exit code
is wrong by one? (Issue 19: at least 95% of these must be killed by the default suite.)

    python tools/mutants.py list                  # the faults, numbered
    python tools/mutants.py check                 # each fault's text is found exactly once
    python tools/mutants.py run [--only 3,17] [--full] [--timeout S]

`run` copies the working tree (git's tracked and untracked, not ignored files, uncommitted
edits included) into a temporary folder and plants one fault at a time *there*: the
working tree is never written, so no mutant can be left in it, whatever stops the run
(Ctrl-C, a kill). The copy is imported instead of the installed checkout by putting it
first on PYTHONPATH (a check at the start proves it); each text written is compiled at
once (a mutant of the same size written in the same second would otherwise run as the
previous text's .pyc).

For each fault, the targeted test files (declared per fault: the files most likely to
catch it) run with -x; with --full, a fault that survives them meets the whole default
suite (`pytest -q -x -p no:cacheprovider`). A kill counts only if the killing test passes
again without the fault (else it is BROKEN: the test fails on its own).

Faults are matched by their exact text, not by line numbers, so the list survives code
moving; a fault whose text is not found exactly once is refused (`check` lists them).
"""

from __future__ import annotations

import argparse
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Fault:
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in `file`
    replacement: str
    breaks: str  # what a user would suffer
    tests: tuple[str, ...]  # targeted pytest arguments: files or node ids


F = Fault
H = "tests/hostile/"
# fmt: off
FAULTS: tuple[Fault, ...] = (
    # ---- the review's six survivors (issue 19)
    F("clipcli/numerics/scaling.py", "if zeroless and floor * (1 + Fraction(1, 2**20)) >= Fraction(limit) ** 2:", "if zeroless and floor > Fraction(limit) ** 2:", "a limit at (or a hair above) the floor of a zeroless dtype is searched instead of refused: NaN or over the limit", ("tests/test_budget_edges.py", "tests/test_reference_numerics.py", "tests/test_at_the_limit.py")),
    F("clipcli/formats/hdf5/limits.py", "return expansion.budget(file_size, MAX_EXPANSION, SPARSE_CHECK_BYTES)", "return expansion.budget(file_size, 2 * MAX_EXPANSION, SPARSE_CHECK_BYTES)", "the HDF5 expansion budget doubles: twice the bomb gets read", ("tests/test_budget_edges.py", "tests/test_hdf5_record_budgets.py", H + "test_resource_budgets.py", H + "test_hdf5_hostile.py")),
    F("clipcli/formats/zipsafe.py", "        if begin < end:\n            raise InputError(\n                path,\n                f\"members {first!r}", "        if begin < end - 1:\n            raise InputError(\n                path,\n                f\"members {first!r}", "zip members sharing one byte are accepted (an overlapping zip claims more data than it holds)", ("tests/test_budget_edges.py", H + "test_resource_budgets.py", H + "test_npz_hostile.py", "tests/test_zip_members.py")),
    F("clipcli/formats/hdf5/reader.py", "if len(stack) >= limits.MAX_DEPTH:", "if len(stack) > limits.MAX_DEPTH:", "the HDF5 reader reads one level deeper than the writer and the record check allow", ("tests/test_budget_edges.py", "tests/test_hdf5_record_budgets.py", H + "test_hdf5_hostile.py")),
    F("clipcli/formats/safetensors/header.py", "MAX_HEADER_BYTES = 100_000_000", "MAX_HEADER_BYTES = 200_000_000", "safetensors headers the official reader refuses are read and written", ("tests/test_budget_edges.py", "tests/test_output_names.py", H + "test_safetensors_hostile.py")),
    F("clipcli/formats/hdf5/limits.py", "MAX_DECLARED_BYTES = 1 << 40", "MAX_DECLARED_BYTES = 2 << 40", "an HDF5 dataset declaring 2 TiB is accepted", ("tests/test_budget_edges.py", H + "test_hdf5_hostile.py", "tests/test_hdf5_unallocated.py")),
    # ---- budgets and limits: formats
    F("clipcli/formats/zipsafe.py", "    if total > budget:", "    if total > 2 * budget:", "the npz zip-bomb budget doubles", (H + "test_npz_hostile.py", "tests/test_zip_members.py")),
    F("clipcli/formats/zipsafe.py", 'if name.startswith(("/", "\\\\")) or ".." in parts:', 'if name.startswith("/") or ".." in parts:', "a zip member named \\\\x (absolute on Windows) is accepted", ("tests/test_limit_edges.py", "tests/test_zip_members.py", H + "test_npz_hostile.py")),
    F("clipcli/formats/zipsafe.py", 'if name.startswith(("/", "\\\\")) or ".." in parts:', 'if name.startswith(("/", "\\\\")) or parts[:1] == [".."]:', "a zip member a/../../x (escaping the archive) is accepted", ("tests/test_zip_members.py", H + "test_npz_hostile.py")),
    F("clipcli/formats/npz/npyheader.py", "if header_len > MAX_HEADER_BYTES:", "if header_len > 2 * MAX_HEADER_BYTES:", "an .npy header over numpy's 10,000-byte cap is parsed", ("tests/test_limit_edges.py", "tests/test_npz_reader.py", H + "test_npz_hostile.py")),
    F("clipcli/formats/npz/writer.py", 'len(f"{name}.npy".encode()) > ZIP_NAME_BYTES:', 'len(f"{name}.npy".encode()) > ZIP_NAME_BYTES + 1:', "an npz member name of 65,536 bytes is written (zip cannot hold it)", ("tests/test_limit_edges.py", "tests/test_output_names.py",)),
    F("clipcli/formats/safetensors/header.py", "if len(infos) > MAX_TENSORS:", "if len(infos) >= MAX_TENSORS:", "a safetensors file of exactly 200,000 tensors cannot be written", ("tests/test_output_names.py",)),
    F("clipcli/formats/safetensors/header.py", "if length > MAX_HEADER_BYTES:", "if length >= MAX_HEADER_BYTES:", "a safetensors header of exactly the official 100 MB limit cannot be written", ("tests/test_output_names.py",)),
    F("clipcli/formats/safetensors/reader.py", "if len(header) > MAX_TENSORS:", "if len(header) > MAX_TENSORS + 1:", "a safetensors header of 200,001 tensors is read", ("tests/test_limit_edges.py", H + "test_safetensors_hostile.py", "tests/test_many_tensors.py")),
    F("clipcli/formats/structure_record.py", "if len(text) > MAX_STRUCTURE_BYTES:", "if len(text) > 2 * MAX_STRUCTURE_BYTES:", "a structure record of twice the 50 MB budget is parsed", ("tests/test_structure.py", "tests/test_hdf5_record_budgets.py")),
    F("clipcli/formats/structure_record.py", "not 1 <= len(nodes) <= MAX_NODES:", "not 1 <= len(nodes) <= MAX_NODES + 1:", "a structure record of 1,000,001 nodes is rebuilt", ("tests/test_limit_edges.py", "tests/test_structure.py", "tests/test_hdf5_record_budgets.py")),
    F("clipcli/formats/hdf5/safety.py", "if chunk_bytes > limits.MAX_CHUNK_BYTES:", "if chunk_bytes >= limits.MAX_CHUNK_BYTES:", "an HDF5 chunk of exactly 256 MiB is refused", ("tests/test_limit_edges.py", "tests/test_hdf5_chunk_budget.py",)),
    F("clipcli/formats/hdf5/limits.py", "return file_size // BYTES_PER_CHUNK + FREE_CHUNKS", "return file_size // BYTES_PER_CHUNK + 2 * FREE_CHUNKS", "the HDF5 chunk-count budget doubles (7 KiB of library state per chunk)", ("tests/test_hdf5_chunk_budget.py",)),
    F("clipcli/formats/hdf5/safety.py", "declared > limits.MAX_EXPANSION * stored", "declared > 2 * limits.MAX_EXPANSION * stored", "an HDF5 dataset may inflate 400-fold instead of 200-fold", ("tests/test_limit_edges.py", H + "test_hdf5_hostile.py", H + "test_resource_budgets.py")),
    F("clipcli/formats/hdf5/safety.py", "if worst <= limits.MAX_ATTRIBUTE_BYTES:", "if worst < limits.MAX_ATTRIBUTE_BYTES:", "HDF5 attributes of exactly the 64 MiB budget are refused", ("tests/test_hdf5_record_budgets.py",)),
    F("clipcli/formats/hdf5/writer.py", "if len(parts) > limits.MAX_DEPTH:", "if len(parts) > limits.MAX_DEPTH + 1:", "the HDF5 writer writes a path one level deeper than its reader reads back", ("tests/test_output_names.py",)),
    F("clipcli/formats/hdf5/writer.py", "if index >= HDF5_MAX_ATTRIBUTES:", "if index > HDF5_MAX_ATTRIBUTES:", "the HDF5 writer tries a 65,536th attribute (the library fails mid-write)", ("tests/test_limit_edges.py", "tests/test_output_names.py",)),
    F("clipcli/formats/hdf5/record_check.py", 'if path.count("/") >= limits.MAX_DEPTH:', 'if path.count("/") > limits.MAX_DEPTH:', "a structure record may nest one group deeper than the reader reads", ("tests/test_hdf5_record_budgets.py",)),
    F("clipcli/formats/hdf5/portable.py", "    if depth > MAX_TYPE_DEPTH:\n        raise Malformed(", "    if depth > MAX_TYPE_DEPTH + 1:\n        raise Malformed(", "a recorded HDF5 type may nest one level deeper than any type clipcli describes", ("tests/test_structure.py",)),
    F("clipcli/formats/base.py", "NUMPY_MAX_RANK = 64", "NUMPY_MAX_RANK = 65", "a tensor of 65 dimensions (numpy cannot make it) is accepted", ("tests/test_tensor_rank.py",)),
    F("clipcli/formats/sharded/layout.py", 'if not any(real.is_relative_to(root) for root in roots):\n        raise InputError(entry, f"links to {real}, outside', 'if not any(real.is_relative_to(root.parent) for root in roots):\n        raise InputError(entry, f"links to {real}, outside', "a model directory's link to a sibling folder is followed", (H + "test_confinement.py", "tests/test_format_sharded.py")),
    # ---- inputs and the process (system)
    F("clipcli/system/inputs.py", "if not stat.S_ISREG(info.st_mode):", "if stat.S_ISSOCK(info.st_mode):", "a FIFO or a device is opened and read as a checkpoint", ("tests/test_limit_edges.py", H + "test_input_opening.py",)),
    F("clipcli/system/inputs.py", "if info.st_size > limit:", "if info.st_size > 2 * limit:", "a side file (config, index) twice its size limit is read whole", ("tests/test_limit_edges.py", "tests/test_side_file_links_and_budget.py", "tests/test_format_sharded.py", "tests/test_checkpoint_scope.py")),
    F("clipcli/system/identity.py", "            if now != before:", "            if now is None:", "an input rewritten during the run (same name) is not noticed: OUT mixes two files", ("tests/test_opening_races.py",)),
    F("clipcli/system/interrupts.py", "128 + signum)", "130)", "SIGTERM and SIGHUP exit 130 instead of 143 and 129", ("tests/test_signal_dispositions.py",)),
    F("clipcli/jobs/quantized.py", "CONFIG_LIMIT = 16 << 20", "CONFIG_LIMIT = 32 << 20", "a config.json twice the 16 MiB limit is read", ("tests/test_limit_edges.py", "tests/test_checkpoint_scope.py",)),
    # ---- exit codes (errors, cli)
    F("clipcli/errors.py", "    exit_code = ExitCode.BAD_INPUT", "    exit_code = ExitCode.USAGE", "an unreadable or unsafe input exits 2 (usage) instead of 3", ("tests/test_cli_errors.py",)),
    F("clipcli/errors.py", "    exit_code = ExitCode.REFUSED_DATA", "    exit_code = ExitCode.BAD_INPUT", "refused data (NaN, axes) exits 3 instead of 4", ("tests/test_cli_errors.py",)),
    F("clipcli/errors.py", "    exit_code = ExitCode.WRITE_FAILED", "    exit_code = ExitCode.INTERNAL", "a failed write exits 70 (a bug) instead of 5", ("tests/test_write_faults.py",)),
    F("clipcli/errors.py", "    CONDITION = 1", "    CONDITION = 3", "--fail-above exceeded exits 3, like an unreadable input", ("tests/test_cli_norms.py",)),
    F("clipcli/cli/boundary.py", 'return fail(f"out of memory{detail}", ExitCode.WRITE_FAILED)', 'return fail(f"out of memory{detail}", ExitCode.INTERNAL)', "a refused allocation (ulimit -v) exits 70 instead of 5", ("tests/test_process_environment.py",)),
    F("clipcli/errors.py", "    if text.isprintable():\n        return text", '    if "\\n" not in text:\n        return text', "a name with an ANSI escape reaches the terminal raw", ("tests/test_display.py", "tests/test_cli_errors.py")),
    F("clipcli/cli/commands/inspect.py", "if math.isnan(g) or g > request.fail_above:", "if g > request.fail_above:", "norms --fail-above passes (exit 0) when the global norm is NaN", ("tests/test_cli_norms.py", "tests/test_at_the_limit.py")),
    F("clipcli/cli/commands/inspect.py", "if math.isnan(g) or g > request.fail_above:", "if math.isnan(g) or g >= request.fail_above:", "norms --fail-above X fails when the global norm equals X", ("tests/test_at_the_limit.py", "tests/test_cli_norms.py")),
    F("clipcli/cli/commands/compare.py", "not change <= limit:", "change > limit:", "diff --fail-above passes when a relative change is NaN", ("tests/test_diff.py", "tests/test_diff_exact.py")),
    # ---- verdicts: options and plans (jobs)
    F("clipcli/jobs/spec.py", "if math.isnan(value) or value <= 0:", "if value <= 0:", "--norm nan is accepted instead of a usage error", ("tests/test_limit_edges.py", "tests/test_cli_options.py", "tests/test_core_cli.py")),
    F("clipcli/jobs/spec.py", "if math.isnan(value) or value <= 0:", "if math.isnan(value) or value < 0:", "--norm 0 is accepted (zeroes every tensor) instead of a usage error", ("tests/test_cli_options.py", "tests/test_core_cli.py")),
    F("clipcli/jobs/spec.py", "if lo > hi:", "if lo > hi + 1:", "--min 1 --max 0.5 is accepted", ("tests/test_limit_edges.py", "tests/test_cli_options.py", "tests/test_core_cli.py")),
    F("clipcli/jobs/spec.py", "if not -rank <= axis < rank:", "if not -rank <= axis <= rank:", "--axes equal to a tensor's rank is not refused with exit 4", ("tests/test_limit_edges.py", "tests/test_plan.py", "tests/test_cli_clip.py")),
    F("clipcli/jobs/spec.py", "if math.isinf(use_norm):", "if math.isnan(use_norm):", "--use-norm inf is accepted and zeroes every tensor", ("tests/test_limit_edges.py", "tests/test_cli_options.py", "tests/test_core_cli.py")),
    F("clipcli/jobs/spec.py", "return math.nextafter(value, 0.0) if Fraction(value) > exact else value", "return value", "--average's C * n rounded up: a float64 tensor clipped 1 ulp over its limit", ("tests/test_at_the_limit.py", "tests/test_reference_numerics.py")),
    F("clipcli/jobs/plan.py", "if t.stats.min_value < float(low) or t.stats.max_value > float(high):", "if t.stats.min_value <= float(low) or t.stats.max_value > float(high):", "a tensor whose minimum equals --min is reported as clamped (changed)", ("tests/test_plan.py", "tests/test_at_the_limit.py")),
    F("clipcli/jobs/plan.py", "    if not spec.skip_nonfinite:\n", "    if spec.skip_nonfinite:\n", "NaN/Inf where a norm is needed is not refused (exit 4) without --skip-nonfinite", ("tests/test_cli_clip.py",)),
    F("clipcli/jobs/plan.py", "bad = [(index, t) for index, t in counted if t.stats.nonfinite]", "bad = [(index, t) for index, t in counted if t.stats.nan_count]", "a tensor with +-Inf but no NaN is not refused in a norm mode", ("tests/test_limit_edges.py", "tests/test_cli_clip.py", "tests/test_plan.py")),
    F("clipcli/jobs/plan.py", "made = [_scaled(t, factor if t.stats.ssq > 0 else None) for t in members]", "made = [_scaled(t, factor if t.stats.ssq >= 0 else None) for t in members]", "a zero tensor is reported as scaled (changed) in global mode instead of kept", ("tests/test_limit_edges.py", "tests/test_plan.py", "tests/test_cli_clip.py")),
    F("clipcli/numerics/scaling.py", "if norm <= limit or norm == 0.0", "if norm < limit or norm == 0.0", "--use-norm equal to the limit scales by 1 and reports every tensor changed", ("tests/test_at_the_limit.py", "tests/test_plan.py")),
    # ---- numerics
    F("clipcli/numerics/rounding.py", "bits -= (np.abs(back) > np.abs(wide)) & finite", "bits -= (np.abs(back) >= np.abs(wide)) & finite", "exact values are truncated one ulp toward zero when narrowed", ("tests/test_numerics.py",)),
    F("clipcli/numerics/rounding.py", "where=wide > float(hi))", "where=~(wide <= float(hi)))", "--value turns NaN into the upper bound (NaN must stay NaN)", ("tests/test_numerics.py", "tests/test_cli_clip.py")),
    F("clipcli/numerics/norms.py", "self.nonfinite += int(chunk.size - np.count_nonzero(finite))", "self.nonfinite += int(np.count_nonzero(np.isnan(chunk)))", "+-Inf values are not counted as non-finite", ("tests/test_numerics.py", "tests/test_cli_norms.py")),
    # ---- the logical layer
    # (Was: CLAMP let through here. Equivalent since api._refuse_unlowerable refuses --value on
    # a composite weight before any data is read; AXES reaches this check alone.)
    F("clipcli/jobs/lowering.py", "p.action in (Action.KEEP, Action.SCALE):", "p.action in (Action.KEEP, Action.SCALE, Action.AXES):", "--norm --axes on a quantized weight is not refused: its codes and scales are copied, nothing is clipped", ("tests/test_quantized_axes.py", "tests/test_logical_view.py")),
    F("clipcli/jobs/lowering.py", "            if part.name in scaled:", "            if part.name not in scaled:", "a scaled composite weight scales its kept parts (codes) and keeps its scales", ("tests/test_logical_view.py",)),
    F("clipcli/jobs/lowering.py", "lifted.append(Outcome(accumulate(chunks), changed=changed))", "lifted.append(Outcome(accumulate(chunks), changed=False))", "a clipped composite weight is reported unchanged", ("tests/test_logical_view.py",)),
    F("clipcli/logical/reader.py", "return min(position[p.name] for p in t.parts)", "return max(position[p.name] for p in t.parts)", "logical tensors are listed where their last part is stored, not their first", ("tests/test_logical_order.py", "tests/test_logical_view.py",)),
    # ---- output: budgets, commit and cleanup rules
    F("clipcli/output/policy.py", "if len(side_files) > SIDE_FILES_MAX_COUNT:", "if len(side_files) > SIDE_FILES_MAX_COUNT + 1:", "one side file more than the count budget is copied", ("tests/test_side_file_links_and_budget.py",)),
    F("clipcli/output/policy.py", "if size > SIDE_FILE_LIMIT:", "if size > 2 * SIDE_FILE_LIMIT:", "a 2 GiB side file is copied without --allow-large-side-files", ("tests/test_limit_edges.py", "tests/test_side_file_links_and_budget.py", "tests/test_side_weight_files.py")),
    F("clipcli/output/policy.py", "if total > SIDE_FILES_MAX_BYTES:", "if total >= SIDE_FILES_MAX_BYTES:", "side files of exactly the total budget are refused", ("tests/test_side_file_links_and_budget.py",)),
    F("clipcli/output/target.py", "        out = self.out\n        if not self.force:", "        out = self.out\n        if self.force:", "without --force an OUT that appeared during the run is overwritten", ("tests/test_commit_safety.py", "tests/test_cleanup_safety.py")),
    F("clipcli/output/target.py", "                    if name not in expected:", '                    if name not in expected and "/" not in name:', "--force over a directory does not notice strangers inside its subfolders", ("tests/test_output_safety.py", "tests/test_commit_safety.py")),
    F("clipcli/report/serialize.py", "if text and text[0] in CSV_FORMULA_STARTS:", 'if text and text[0] in "=+@":', "a CSV cell starting with '-' or a tab runs as a spreadsheet formula", ("tests/test_display.py",)),
)
# fmt: on


# ---------------------------------------------------------------- planting


class Refused(Exception):
    """A fault whose text is not found exactly once."""


def planted(fault: Fault, text: str) -> str:
    """`text` with the fault planted; Refused unless its original occurs exactly once."""
    count = text.count(fault.original)
    if count != 1:
        raise Refused(f"{fault.file}: text found {count} times (needs exactly 1)")
    if fault.replacement == fault.original:
        raise Refused(f"{fault.file}: the replacement is the original")
    return text.replace(fault.original, fault.replacement)


def check(faults: tuple[Fault, ...], root: Path) -> list[str]:
    """One problem line per fault that cannot be planted in the tree at `root`."""
    problems = []
    for number, fault in enumerate(faults, 1):
        path = root / fault.file
        try:
            planted(fault, path.read_text(encoding="utf-8"))
        except (Refused, OSError) as exc:
            problems.append(f"{number}: {exc}")
        for target in fault.tests:
            if not (root / target.split("::")[0]).is_file():
                problems.append(f"{number}: no test file {target}")
    return problems


def copy_tree(destination: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored), edits included."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class Result:
    verdict: str  # "killed", "SURVIVED", "BROKEN", "REFUSED"
    by: str  # the killing test id, or why


def _environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _pytest(copy: Path, args: list[str], timeout: float) -> tuple[int | None, str]:
    """pytest in the copy: (exit status or None on timeout, output)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    process = subprocess.Popen(
        argv,
        cwd=copy,
        env=_environment(copy),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # so that a timeout ends the tests' own children too
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output
    except BaseException:  # Ctrl-C: end the tests before the copy goes
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return process.returncode, output


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def _killer(output: str) -> str:
    found = _FAILED.search(output)
    return found.group(1) if found else "(collection or start-up failed)"


def run_fault(fault: Fault, copy: Path, full: bool, timeout: float) -> tuple[Result, float]:
    path = copy / fault.file
    original = path.read_text(encoding="utf-8")
    started = time.monotonic()
    try:
        mutant = planted(fault, original)
    except Refused as exc:
        return Result("REFUSED", str(exc)), 0.0
    _write_source(path, mutant)
    try:
        runs = [list(fault.tests)] + ([[]] if full else [])
        for args in runs:
            status, output = _pytest(copy, args, timeout)
            if status is None:
                return Result("killed", f"(timed out after {timeout:g} s)"), elapsed(started)
            if status != 0:
                killer = _killer(output)
                break
        else:
            return Result("SURVIVED", ""), elapsed(started)
    finally:
        _write_source(path, original)
    # The killing test must pass without the fault, or the kill proves nothing. All its
    # parameters are run: an id like [65] may come from the planted constant itself.
    if "::" in killer:
        status, output = _pytest(copy, [killer.split("[")[0]], timeout)
        if status != 0:
            return Result("BROKEN", f"{killer} fails without the fault too"), elapsed(started)
    return Result("killed", killer), elapsed(started)


def _write_source(path: Path, text: str) -> None:
    """Write a module and compile it at once: a .pyc is trusted by the source's mtime and
    size, and a mutant of the same size written within the same second would otherwise
    run as the previous text (or the original as the mutant)."""
    for stale in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        stale.unlink()
    path.write_text(text, encoding="utf-8")
    py_compile.compile(str(path), doraise=True)


def elapsed(started: float) -> float:
    return time.monotonic() - started


def _proof_of_copy(copy: Path) -> None:
    """The tests must import clipcli from the copy, not from the installed checkout."""
    shown = subprocess.run(
        [sys.executable, "-c", "import clipcli; print(clipcli.__file__)"],
        cwd=copy,
        env=_environment(copy),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(shown).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutants: clipcli imports from {shown}, not from the copy; stopping")


def run(numbers: list[int], full: bool, timeout: float) -> int:
    work = Path(tempfile.mkdtemp(prefix="clipcli-mutants-"))
    killed = counted = 0
    try:
        copy = work / "tree"
        copy_tree(copy)
        # Compiled up front, as an installed checkout is: a test that runs clipcli under a
        # tight address-space limit (ulimit -v) must not spend it compiling the package.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "clipcli"], cwd=copy, check=True)
        _proof_of_copy(copy)
        print(f"{'#':>3}  {'verdict':8}  {'secs':>5}  file: what it breaks / killed by", flush=True)
        for number in numbers:
            fault = FAULTS[number - 1]
            result, seconds = run_fault(fault, copy, full, timeout)
            if result.verdict != "REFUSED":
                counted += 1
                killed += result.verdict == "killed"
            print(
                f"{number:>3}  {result.verdict:8}  {seconds:5.0f}  {fault.file}: {fault.breaks}"
                + (f"\n{'':21}{result.by}" if result.by else ""),
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    share = killed / counted if counted else 0.0
    print(f"score: {killed}/{counted} killed ({share:.1%})")
    return 0 if counted and share >= 0.95 and counted == len(numbers) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/mutants.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print the faults, numbered")
    commands.add_parser("check", help="check that every fault can be planted")
    running = commands.add_parser("run", help="plant each fault and run its tests")
    running.add_argument("--only", help="comma-separated fault numbers (1-based)")
    running.add_argument("--full", action="store_true", help="survivors meet the whole suite")
    running.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    args = parser.parse_args(argv)
    if args.command == "list":
        for number, fault in enumerate(FAULTS, 1):
            print(f"{number:>3}  {fault.file}: {fault.original!r} -> {fault.replacement!r}")
            print(f"     breaks: {fault.breaks}; targeted: {' '.join(fault.tests)}")
        return 0
    problems = check(FAULTS, ROOT)
    for problem in problems:
        print(f"refused: {problem}", file=sys.stderr)
    if args.command == "check":
        print(f"{len(FAULTS)} faults, {len(problems)} problems")
        return 1 if problems else 0
    numbers = list(range(1, len(FAULTS) + 1))
    if args.only:
        numbers = [int(n) for n in args.only.split(",")]
        if not all(1 <= n <= len(FAULTS) for n in numbers):
            parser.error(f"--only: numbers run from 1 to {len(FAULTS)}")
    return run(numbers, args.full, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
