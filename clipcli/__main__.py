"""`python -m clipcli`: guard start-up against signals, then run the CLI.

Importing the CLI (typer, rich, click) takes tens of milliseconds, before main() has set up
its error boundary. A Ctrl-C there would print a KeyboardInterrupt traceback, so until
main() takes over, SIGINT and SIGTERM print the one documented line and exit 130/143:
nothing has been opened yet, so there is nothing to clean up. main() puts the usual
handlers back as the first thing inside its error boundary.

What runs before this file (the interpreter's start-up, site and .pth files, runpy finding
the package) is not clipcli's code: a signal there gets Python's own behaviour.
"""

# _signal, not signal: the signal module imports enum, which alone takes milliseconds.
# os and sys are loaded by the interpreter's own start-up.
import _signal  # type: ignore[import-not-found]  # no stub; same API as signal
import os
import sys


def _exit_during_start_up(signum: int, frame: object) -> None:
    os.write(2, b"clipcli: error: interrupted\n")
    os._exit(128 + signum)


for _signum in (_signal.SIGINT, _signal.SIGTERM):
    _signal.signal(_signum, _exit_during_start_up)

from clipcli.cli import main  # noqa: E402 - after the guard, on purpose

try:
    _code = main()
except KeyboardInterrupt:  # landed between main()'s boundary and here
    os.write(2, b"clipcli: error: interrupted\n")
    _code = 130
# The outcome is decided and reported: a late signal must not add a traceback to it.
for _signum in (_signal.SIGINT, _signal.SIGTERM):
    _signal.signal(_signum, _signal.SIG_IGN)
if _code in (130, 143):
    # CPython 3.11 marks a KeyboardInterrupt "unhandled" when it passes through exec() of a
    # string (dataclasses and namedtuple do that while importing), even though main()
    # handled it; the interpreter would then kill itself with SIGINT at exit instead of
    # returning 130. Cleanup already ran inside main(); flush and leave with our code.
    for _stream in (sys.stdout, sys.stderr):
        try:
            _stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_code)
raise SystemExit(_code)
