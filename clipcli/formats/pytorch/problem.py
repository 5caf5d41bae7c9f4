"""The one exception of the pickle interpreter and its inert constructors."""

from __future__ import annotations


class PickleProblem(Exception):
    """The pickle is malformed, exceeds a budget, or asks for something not allowed."""
