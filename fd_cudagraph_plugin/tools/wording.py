"""How the tools word counts and echo what they were given: plurals, and values shortened.

An error echoes the bad value so the user sees what was read, but a 5000-digit number or a
megabyte of text is no help on a terminal: past ``LIMIT`` characters the echo keeps the head and
says how long the whole was.
"""

from __future__ import annotations

import re

from fd_cudagraph_plugin.core.errors import plural

__all__ = ["LIMIT", "as_integer", "plural", "shown"]

#: Longest value echoed whole.
LIMIT = 24
_NUMBER = re.compile(r"[+-]?[0-9]+")


def shown(value: object) -> str:
    """``value`` as an error echoes it: digits as a number, other text quoted, anything else as
    ``repr``; shortened past ``LIMIT`` characters (``1111111111... (5000 digits)``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        if len(value) <= LIMIT:
            return value
        return f"{value[:LIMIT]}... ({len(value.lstrip('+-'))} digits)"
    text = value if isinstance(value, str) else repr(value)
    quote = repr if isinstance(value, str) else str
    if len(text) <= LIMIT:
        return quote(text)
    return f"{quote(text[:LIMIT])}... ({len(text)} characters)"


def as_integer(text: str) -> float | None:
    """The integer ``text`` holds in ASCII digits (as an operator types one), or None; one of
    more than 18 digits, above every bound here, is read as infinite rather than handed to
    ``int()`` (which refuses 4301 digits)."""
    word = text.strip()
    if not _NUMBER.fullmatch(word):
        return None
    if len(word.lstrip("+-").lstrip("0")) > 18:
        return float("-inf") if word.startswith("-") else float("inf")
    return int(word)
