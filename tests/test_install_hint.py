"""The missing-matplotlib hint fits how clipcli was installed (issue 23, item 14).

`pip install -e '.[plot]'` is right only in an editable checkout. Checked on two real
layouts, each in a fresh interpreter started outside any checkout: this test run's own
install (editable, as the README's set-up makes it; the expected command comes from pip's
own record, direct_url.json), and a copy of the package laid out as `pip install .` lays it
out (package and dist-info in a site folder; the expected requirement comes from
pyproject.toml, read with tomllib).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from expect import REPO_ROOT

import clipcli

PIP = f"{shlex.quote(sys.executable)} -m pip install"
PROBE = (
    "import sys\n"
    "sys.modules['matplotlib'] = None  # not installed\n"
    "from clipcli.cli.entry import main\n"
    "raise SystemExit(main(['norms', 'm.safetensors', '--plot', 'p.png']))\n"
)


def hint_in(cwd: Path, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    prefix = "clipcli: error: --plot needs matplotlib, which is not installed; install it with: "
    assert lines[0].startswith(prefix)
    return lines[0].removeprefix(prefix)


def editable_checkout() -> Path | None:
    """The checkout this interpreter's clipcli is installed from in editable mode, as pip
    recorded it, or None."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    for record in site.glob("clipcli-*.dist-info/direct_url.json"):
        data = json.loads(record.read_text())
        if data.get("dir_info", {}).get("editable"):
            return Path(unquote(urlparse(data["url"]).path))
    return None


def test_an_editable_install_is_told_to_reinstall_its_checkout_with_the_extra(
    tmp_path: Path,
) -> None:
    checkout = editable_checkout()
    if checkout is None or Path(clipcli.__file__).resolve().parent.parent != checkout.resolve():
        pytest.skip("clipcli is not installed in editable mode from this checkout")
    (tmp_path / "clipcli.egg-info").mkdir()  # a stale record in the current folder
    assert hint_in(tmp_path) == f"{PIP} -e {shlex.quote(f'{checkout.resolve()}[plot]')}"


def test_an_installed_copy_is_told_to_install_the_extras_requirements(tmp_path: Path) -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    plot = project["optional-dependencies"]["plot"]
    assert plot  # matplotlib>=3.7
    site = tmp_path / "site"
    shutil.copytree(
        REPO_ROOT / "clipcli", site / "clipcli", ignore=shutil.ignore_patterns("__pycache__")
    )
    info = site / f"clipcli-{project['version']}.dist-info"
    info.mkdir()
    requires = [f'Requires-Dist: {r}; extra == "plot"' for r in plot]
    requires += ['Requires-Dist: pytest>=8; extra == "test"']
    (info / "METADATA").write_text(
        "\n".join(["Metadata-Version: 2.1", "Name: clipcli", f"Version: {project['version']}"])
        + "\n"
        + "\n".join(["Provides-Extra: plot", "Provides-Extra: test", *requires])
        + "\n"
    )
    (info / "direct_url.json").write_text(json.dumps({"url": "file:///gone", "dir_info": {}}))
    work = tmp_path / "work"
    work.mkdir()
    stale = work / "clipcli.egg-info"  # must not be what decides
    stale.mkdir()
    (stale / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: clipcli\nVersion: 0.0.1\n"
        'Requires-Dist: wrong-package; extra == "plot"\n'
    )
    hint = hint_in(work, str(site))
    assert hint == f"{PIP} {' '.join(shlex.quote(r) for r in plot)}"
    assert "-e" not in shlex.split(hint)


def test_without_metadata_the_hint_still_names_matplotlib(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(
        REPO_ROOT / "clipcli", site / "clipcli", ignore=shutil.ignore_patterns("__pycache__")
    )
    assert hint_in(tmp_path, str(site)) == f"{PIP} matplotlib"
