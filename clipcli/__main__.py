"""`python -m clipcli`: guard start-up against signals, then run the CLI.

Importing the CLI (typer, rich, click) takes tens of milliseconds, before main() has set up
its error boundary. A Ctrl-C there would print a KeyboardInterrupt traceback, so until
main() takes over, SIGINT and SIGTERM print the one documented line and exit 130/143:
nothing has been opened yet, so there is nothing to clean up. main() puts the usual
handlers back as the first thing inside its error boundary.
"""

import os
import signal


def _exit_during_start_up(signum: int, frame: object) -> None:
    os.write(2, b"clipcli: error: interrupted\n")
    os._exit(128 + signum)


for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _exit_during_start_up)

from clipcli.cli import main  # noqa: E402 - after the guard, on purpose

try:
    _code = main()
except KeyboardInterrupt:  # landed between main()'s boundary and here
    os.write(2, b"clipcli: error: interrupted\n")
    _code = 130
# The outcome is decided and reported: a late signal must not add a traceback to it.
for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, signal.SIG_IGN)
raise SystemExit(_code)
