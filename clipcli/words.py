"""Pure: counted nouns, for messages (jobs) and reports alike."""


def count(n: int, noun: str) -> str:
    """'1 group', '2 groups'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def count_number(n: int, noun: str) -> str:
    """'1 byte', '4,481 parameters': count() with thousands separators."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
