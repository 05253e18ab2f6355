"""Logging helpers, with upstream's two kinds of logger.

* ``get_logger(name)``: the unified logger ``fastdeploy.<name>`` (develop: ``fastdeploy.main.
  <name>``). Its parent is configured once with a handler and ``propagate = False``, so these
  records never reach the root logger.
* ``get_logger(name, file_name)``: the legacy logger ``legacy.<name>``. Every call replaces its
  handlers with a file handler under ``FD_LOG_DIR``; it is left propagating, so its records also
  reach the root logger (and any console handler there).

``llm_logger`` is ``legacy.fastdeploy`` up to 2.6 and the channel root ``fastdeploy.main`` on
develop.
"""

from __future__ import annotations

import logging
import os
import sys

from fastdeploy import _stub_version, envs

_configured: set[str] = set()


class _ConsoleHandler(logging.StreamHandler):
    """stderr as it is at emit time (pytest swaps and closes its captured streams)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _unified_root() -> logging.Logger:
    name = "fastdeploy.main" if _stub_version.current() == "develop" else "fastdeploy"
    root = logging.getLogger(name)
    if name not in _configured:
        _configured.add(name)
        root.addHandler(_ConsoleHandler())
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(
    name: str,
    file_name: str | None = None,
    without_formater: bool = False,
    print_to_console: bool = False,
) -> logging.Logger:
    del without_formater
    if file_name is None:
        root = _unified_root()
        if name == "fastdeploy" or name.startswith("fastdeploy."):
            return root if name == "fastdeploy" else logging.getLogger(name)
        return logging.getLogger(f"{root.name}.{name}")
    logger = logging.getLogger(f"legacy.{name}")
    logger.setLevel(logging.DEBUG if envs.FD_DEBUG else logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    log_dir = envs.FD_LOG_DIR
    os.makedirs(log_dir, exist_ok=True)
    logger.addHandler(logging.FileHandler(os.path.join(log_dir, file_name), delay=True))
    if print_to_console:
        logger.addHandler(_ConsoleHandler())
    return logger  # propagate stays True, as upstream (its `propagate = False` is commented out)


class _LlmLogger:
    """``llm_logger``, resolved per call so a version switch reaches it."""

    def __getattr__(self, attr: str):
        if _stub_version.current() == "develop":
            target = get_logger("fastdeploy")
        else:
            target = get_logger("fastdeploy", "fastdeploy.log")
        return getattr(target, attr)


llm_logger = _LlmLogger()
