"""How the plugin writes figures in its log lines and errors."""

from __future__ import annotations


def human_bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``1 graph``, ``2 graphs``; ``many`` for nouns that do not just take an s."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
