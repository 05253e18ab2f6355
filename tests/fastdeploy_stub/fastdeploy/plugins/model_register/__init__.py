"""The ``fastdeploy.model_register_plugins`` group: every loaded function is called once."""

from __future__ import annotations

from fastdeploy.plugins.utils import load_plugins_by_group

PLUGINS_GROUP = "fastdeploy.model_register_plugins"
plugins_loaded = False  # once per process


def load_model_register_plugins() -> None:
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(group=PLUGINS_GROUP).values():
        func()  # exceptions propagate, as upstream


def reset_for_tests() -> None:
    """Forget that plugins were loaded, so the next call loads them again."""
    global plugins_loaded
    plugins_loaded = False
