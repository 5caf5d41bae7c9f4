"""The commands' bodies: parse results in, a call to the library, a report out.

cli.py registers them on the Typer app and holds the one error boundary; nothing here
turns an exception into an exit code.
"""
