"""How to add an optional extra (matplotlib for --plot) to the clipcli that is running.

The hint used to be `pip install -e '.[plot]'`, right only in an editable checkout: after
`pip install .` or a wheel there is no '.' to install from (issue 23, item 14). The command
given here fits how this clipcli runs:

- from a source checkout (an editable install, or the checkout on PYTHONPATH): reinstall
  the checkout with the extra, `pip install -e '/path/to/checkout[plot]'`;
- installed (`pip install .`, a wheel): the extra's own requirements, as the installed
  metadata lists them (`pip install 'matplotlib>=3.7'`).

Either way through the interpreter that runs clipcli (`/venv/bin/python -m pip`), so that an
unactivated venv or a pipx environment gets the package, not whatever `pip` is first on
PATH. The running package's location decides, not a metadata lookup by name: that would
find a stale `clipcli.egg-info` in the current directory first.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import clipcli

DISTRIBUTION = "clipcli"


def install_command(extra: str, fallback: str) -> str:
    """The shell command that adds `extra` to the running clipcli; `fallback` is what to
    install when the metadata cannot say (its dist-info is gone)."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    package = Path(clipcli.__file__).resolve().parent
    checkout = package.parent
    if _is_checkout(checkout):
        return f"{pip} -e {shlex.quote(f'{checkout}[{extra}]')}"
    requirements = _extra_requirements(package.parent, extra) or [fallback]
    return f"{pip} {' '.join(shlex.quote(r) for r in requirements)}"


def _is_checkout(folder: Path) -> bool:
    """clipcli's source tree: the pyproject.toml that builds it sits beside the package."""
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return f'name = "{DISTRIBUTION}"' in text


def _extra_requirements(site: Path, extra: str) -> list[str]:
    """The requirements the installed metadata lists for `extra` (beside the package)."""
    from importlib.metadata import distributions

    marker = f'extra == "{extra}"'
    for dist in distributions(name=DISTRIBUTION, path=[str(site)]):
        found = [r.partition(";")[0].strip() for r in dist.requires or () if marker in r]
        if found:
            return found
    return []
