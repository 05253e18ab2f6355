"""How the plugin writes figures in its log lines and errors."""

from __future__ import annotations


def human_bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def plural(count: int, noun: str) -> str:
    """``1 graph``, ``2 graphs``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def shorten(text: str, limit: int = 80) -> str:
    """A value echoed in an error: at most ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({len(text)} characters)"
