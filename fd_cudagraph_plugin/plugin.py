"""The entry point: FastDeploy's plugin loader calls ``register()``.

FastDeploy calls it through the ``fastdeploy.model_register_plugins`` entry point when
``FD_PLUGINS`` names ``fd_cudagraph_plugin``, in every process that imports its models package
(each worker included), before any model or backend exists. What it changes in FastDeploy goes
through ``core/fastdeploy.py``.
"""

from __future__ import annotations

import logging
import os

from fd_cudagraph_plugin.core import fastdeploy
from fd_cudagraph_plugin.core.options import BY_ENV, OPTIONS, PluginOptions, unknown_options

logger = logging.getLogger("fd_cudagraph_plugin")

ENTRY_POINT_GROUP = "fastdeploy.model_register_plugins"
ENTRY_POINT_NAME = "fd_cudagraph_plugin"

_logged = False
_unknown_logged = False


def register() -> None:
    """Install the plugin's backend in FastDeploy. Idempotent; no CUDA work."""
    global _logged
    import importlib

    from fd_cudagraph_plugin import __version__

    # Every option is checked here, so a typo stops FastDeploy at start-up with the fix, not at
    # the first forward.
    options = PluginOptions.from_env()
    importlib.import_module(fastdeploy.BACKEND_MODULE)
    fastdeploy.log_to_worker_log()
    _log_unknown_options()
    if options.backend == "native":
        _log_once(
            "fd-cudagraph-plugin installed but FD_CUDAGRAPH_BACKEND=native: FastDeploy %s keeps "
            "its own CUDA-graph backend.",
            fastdeploy.version(),
        )
        return
    blocker = fastdeploy.cuda_runtime_blocker() if options.runtime == "cuda" else None
    if blocker is not None:
        _log_once(
            "fd-cudagraph-plugin %s stands aside: %s, and its CUDA runtime drives NVIDIA CUDA "
            "graphs only. FastDeploy %s keeps its own CUDA-graph backend and runners.",
            __version__,
            blocker,
            fastdeploy.version(),
        )
        return

    from fd_cudagraph_plugin.core import hooks
    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    fastdeploy.backfill_forward_meta()
    native = fastdeploy.bind_backend(CudaGraphBackend)
    # Every capture loop must run in a session, also when no profile run builds a backend first.
    hooks.watch()
    if not _logged:
        _logged = True
        logger.info(
            "fd-cudagraph-plugin %s active: CUDA-graph backend replaced for FastDeploy %s "
            "(constructor %s); options: %s.",
            __version__,
            fastdeploy.version(),
            fastdeploy.constructor_shape(native),
            non_default_options(os.environ),
        )


def non_default_options(environ) -> str:
    """The ``FD_CUDAGRAPH_*`` options set to something other than their default, for the
    "active" line: a leftover test runtime or an expensive check is visible in the worker log."""
    changed = []
    for option in OPTIONS:
        raw = (environ.get(option.env) or "").strip()
        if raw and raw.lower() != option.default:
            note = ""
            if option.env == "FD_CUDAGRAPH_RUNTIME" and raw.lower() == "simulated":
                note = " (the CPU test runtime: no CUDA graph runs; unset it to serve)"
            changed.append(f"{option.env}={raw}{note}")
    return ", ".join(changed) if changed else "all defaults"


def _log_once(message: str, *args: object) -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(message, *args)


def _log_unknown_options() -> None:
    # A misspelt option would otherwise be ignored without a word; register() runs once per
    # process, and a repeated call must not repeat the warning.
    global _unknown_logged
    if _unknown_logged:
        return
    hints = unknown_options(os.environ)
    if hints:
        _unknown_logged = True
        logger.warning(
            "fd-cudagraph-plugin ignores %s: set but not options of this plugin; rename or "
            "unset them.",
            ", ".join(hints),
        )


def reset_for_tests() -> None:
    """Undo what register() did to process-wide state: log forwarding and ForwardMeta fields."""
    global _logged, _unknown_logged
    _logged = _unknown_logged = False
    fastdeploy.stop_logging_to_worker_log()
    fastdeploy.undo_backfill()


__all__ = ["BY_ENV", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME", "register", "reset_for_tests"]
