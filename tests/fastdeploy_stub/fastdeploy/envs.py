"""Environment variables, read lazily on attribute access (like ``fastdeploy.envs``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _plugins() -> list[str] | None:
    raw = os.environ.get("FD_PLUGINS")
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


environment_variables: dict[str, Callable[[], Any]] = {
    "FD_PLUGINS": _plugins,
    "FD_LOG_DIR": lambda: os.getenv("FD_LOG_DIR", "log"),
    "FD_DEBUG": lambda: int(os.getenv("FD_DEBUG", "0")),
    "FD_DETERMINISTIC_MODE": lambda: bool(int(os.getenv("FD_DETERMINISTIC_MODE", "0"))),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
