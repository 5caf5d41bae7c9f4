"""HDF5 filter plugins stay disabled whatever HDF5_PLUGIN_PRELOAD the environment brings.

A conda environment with hdf5plugin activated (or any user) may have the variable set; a
plugin is code that HDF5 dlopen()s when a stranger's file names its filter. The library's
own answer is asked for, through H5PLget_loading_state in the very libhdf5 that h5py
loaded (ctypes, no clipcli code): 0 means every plugin type is disabled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run in a fresh interpreter: HDF5 reads the variable once, when h5py first loads it.
PROBE = """
import ctypes, os, sys
import clipcli.formats.hdf5 as hdf5
assert "h5py" not in sys.modules
hdf5.load_h5py()
libraries = {
    line.split()[-1]
    for line in open("/proc/self/maps")
    if "libhdf5" in line and ".so" in line and "libhdf5_hl" not in line
}
states = set()
for library in libraries:
    state = ctypes.c_uint()
    assert ctypes.CDLL(library).H5PLget_loading_state(ctypes.byref(state)) >= 0
    states.add(state.value)
print(os.environ["HDF5_PLUGIN_PRELOAD"], sorted(states))
"""


def _loading_state(preload: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PRELOAD"}
    if preload is not None:
        env["HDF5_PLUGIN_PRELOAD"] = preload
    env["HDF5_PLUGIN_PATH"] = "/nonexistent/plugins"
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to find libhdf5")
@pytest.mark.parametrize("preload", [None, "", "*", "::", "libh5blosc.so"])
def test_plugins_are_disabled_whatever_the_environment_preset(preload: str | None) -> None:
    """Unset, empty, "*" (HDF5's load-everything) or a plugin name: all end as "::" with
    the library's loading state 0. With setdefault, a preset value was kept (0xffff)."""
    assert _loading_state(preload) == ":: [0]"
