"""The commands' bodies: a request in (declared in clipcli/cli/declarations.py), a call to
the library, a report out.

clipcli/cli/entry.py runs them inside the one error boundary; nothing here turns an
exception into an exit code.
"""
