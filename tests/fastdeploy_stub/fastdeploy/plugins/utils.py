"""Entry-point plugin discovery, filtered by ``FD_PLUGINS`` (entry-point names)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from fastdeploy import envs
from fastdeploy.utils import llm_logger as logger


def load_plugins_by_group(group: str) -> dict[str, Any]:
    """Load the entry points of ``group`` whose name is listed in ``FD_PLUGINS``.

    Unset ``FD_PLUGINS`` loads nothing; a failing ``load()`` is logged and skipped.
    """
    allowed = envs.FD_PLUGINS
    found = list(entry_points(group=group))
    if not found:
        logger.debug("No plugins for group %s found.", group)
        return {}
    for ep in found:
        logger.info("Available plugin for group %s: %s -> %s", group, ep.name, ep.value)
    if allowed is None:
        logger.info("FD_PLUGINS is unset: no plugin of group %s is loaded.", group)
        return {}
    loaded: dict[str, Any] = {}
    for ep in found:
        if ep.name not in allowed:
            continue
        logger.info("Loading plugin %s", ep.name)
        try:
            loaded[ep.name] = ep.load()
        except Exception:  # logged and swallowed, as upstream
            logger.exception("Failed to load plugin %s", ep.name)
    return loaded
