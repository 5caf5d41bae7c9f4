"""The way in: argument parsing (quick and Typer), the command bodies, the one error boundary."""
