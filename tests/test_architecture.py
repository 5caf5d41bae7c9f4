"""The import rules of docs/ARCHITECTURE.md, checked on the source itself.

Every module of the package is parsed (ast, so imports inside functions and under
TYPE_CHECKING count too) and the graph of clipcli-internal imports is checked: no cycles;
numerics and dtypes lean on nothing above them; formats import no job and no output
module; the report does no math.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "clipcli"

# The layers, as packages (docs/ARCHITECTURE.md): what each may never import. From the
# bottom: numerics and dtypes; system (the process and the OS); formats (one package per
# format); logical (views over stored tensors); jobs; output; report; api; cli.
FORBIDDEN = {
    "clipcli.system": (
        "clipcli.formats",
        "clipcli.logical",
        "clipcli.jobs",
        "clipcli.output",
        "clipcli.report",
        "clipcli.api",
        "clipcli.cli",
    ),
    "clipcli.formats": (
        "clipcli.logical",
        "clipcli.jobs",
        "clipcli.output",
        "clipcli.report",
        "clipcli.api",
        "clipcli.cli",
    ),
    "clipcli.logical": (
        "clipcli.jobs",
        "clipcli.output",
        "clipcli.report",
        "clipcli.api",
        "clipcli.cli",
    ),
    "clipcli.jobs": ("clipcli.report", "clipcli.api", "clipcli.cli"),
    "clipcli.output": ("clipcli.jobs", "clipcli.report", "clipcli.api", "clipcli.cli"),
    "clipcli.report": ("clipcli.numerics", "clipcli.cli"),
    "clipcli.api": ("clipcli.cli",),
}
# What the bottom layer may import of clipcli's own.
BOTTOM = frozenset({"clipcli.dtypes", "clipcli.errors"})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, modules: Iterable[str]) -> set[str]:
    """The clipcli modules `path` imports, anywhere in it (a name imported from a package
    counts as the submodule when there is one)."""
    known = set(modules)
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def broken(edges: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a layering rule, as 'importer -> imported (rule)'."""
    problems = []
    for name, targets in sorted(edges.items()):
        for target in sorted(targets):
            bottom = name.startswith("clipcli.numerics") or name == "clipcli.dtypes"
            if bottom and not (target.startswith("clipcli.numerics") or target in BOTTOM):
                problems.append(f"{name} -> {target} (numerics and dtypes are the bottom)")
            for layer, banned in FORBIDDEN.items():
                if _under(name, layer) and any(_under(target, b) for b in banned):
                    problems.append(f"{name} -> {target} ({layer} is below it)")
    return problems


# Typer is for what the quick parser declines (clipcli/cli/quick_args.py): only the app
# generated from the declarations imports it, and only main() reaches it (__main__.py
# preloads it by name, for the same command lines).
TYPER_APP = frozenset({"clipcli.cli.typer_app"})
REACHES_TYPER = frozenset({"clipcli.cli.entry"})


def imports_typer(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name == "typer" or name.startswith("typer.") for name in names):
            return True
    return False


def test_only_the_typer_app_imports_typer() -> None:
    assert {name for name, path in all_modules().items() if imports_typer(path)} == TYPER_APP
    reaching = {name for name, targets in graph().items() if targets & TYPER_APP}
    assert reaching - TYPER_APP == REACHES_TYPER


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_package_keeps_the_layering_rules() -> None:
    assert broken(graph()) == []


def test_the_graph_sees_imports_inside_functions() -> None:
    edges = graph()
    assert "clipcli.formats.sharded" in edges["clipcli.formats.opening"]  # inside open_reader
    assert "clipcli.api" in edges["clipcli.cli.commands.write"]  # imported inside the commands
    assert "clipcli.api" in edges["clipcli.report.builders"]  # under TYPE_CHECKING


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"clipcli.a": {"clipcli.b"}, "clipcli.b": {"clipcli.a"}}, [["clipcli.a", "clipcli.b"]]),
        ({"clipcli.a": {"clipcli.b"}, "clipcli.b": set()}, []),
    ],
    ids=["cycle", "none"],
)
def test_cycles_are_found(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(edges) == expected


@pytest.mark.parametrize(
    ("importer", "target"),
    [
        ("clipcli.numerics.norms", "clipcli.formats.base"),
        ("clipcli.dtypes", "clipcli.jobs.plan"),
        ("clipcli.formats.npz", "clipcli.jobs.pipeline"),
        ("clipcli.formats.sharded.writer", "clipcli.output.target"),
        ("clipcli.report", "clipcli.numerics.scaling"),
        ("clipcli.jobs.scope", "clipcli.report.model"),
        ("clipcli.system.scratch", "clipcli.output.fsops"),
        ("clipcli.logical.reader", "clipcli.jobs.plan"),
        ("clipcli.formats.base", "clipcli.logical.view"),
        ("clipcli.jobs.plan", "clipcli.cli.entry"),
        ("clipcli.api", "clipcli.cli.boundary"),
    ],
)
def test_each_rule_fails_when_broken(importer: str, target: str) -> None:
    assert len(broken({importer: {target}})) == 1


def test_allowed_imports_pass() -> None:
    allowed = {
        "clipcli.numerics.norms": {"clipcli.dtypes", "clipcli.numerics.lookup"},
        "clipcli.formats.npz": {"clipcli.formats.base", "clipcli.errors"},
        "clipcli.report": {"clipcli.jobs.groups", "clipcli.errors"},
        "clipcli.logical.reader": {"clipcli.formats.base", "clipcli.numerics.norms"},
        "clipcli.jobs.lowering": {"clipcli.logical.reader", "clipcli.jobs.plan"},
        "clipcli.cli.entry": {"clipcli.api", "clipcli.report.table"},
    }
    assert broken(allowed) == []
