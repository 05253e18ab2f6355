"""Logging helpers."""

from __future__ import annotations

import logging


def get_logger(name: str, file_name: str | None = None) -> logging.Logger:
    """Return the standard logger ``fastdeploy.<name>``; ``file_name`` is accepted and ignored."""
    del file_name
    return logging.getLogger(f"fastdeploy.{name}")


llm_logger = get_logger("llm")
