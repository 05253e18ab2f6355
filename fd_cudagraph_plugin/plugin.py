"""The entry point: FastDeploy's plugin loader calls ``register()``.

FastDeploy calls it through the ``fastdeploy.model_register_plugins`` entry point when
``FD_PLUGINS`` names ``fd_cudagraph_plugin``, in every process that imports its models package
(each worker included), before any model or backend exists. What it changes in FastDeploy goes
through ``core/seam.py``.
"""

from __future__ import annotations

import logging
import os

from fd_cudagraph_plugin.core import process, seam
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.options import BY_ENV, OPTIONS, unknown_options, unused_options

logger = logging.getLogger("fd_cudagraph_plugin")

ENTRY_POINT_GROUP = "fastdeploy.model_register_plugins"
ENTRY_POINT_NAME = "fd_cudagraph_plugin"


def register() -> None:
    """Install the plugin's backend in FastDeploy. Idempotent; no CUDA work."""
    import importlib

    from fd_cudagraph_plugin import __version__

    # Every option is checked here, once per process, so a typo stops FastDeploy at start-up
    # with the fix, not at the first forward.
    unknown = unknown_options(os.environ)
    if unknown:
        raise ConfigError(
            f"fd-cudagraph-plugin does not know {', '.join(unknown)}: a misspelt option would "
            "be ignored without a word. Rename or unset it."
        )
    state = process.current()
    options = state.options
    for note in unused_options(os.environ) if not state.announced else ():
        logger.warning("%s", note)
    importlib.import_module(seam.BACKEND_MODULE)
    seam.log_to_worker_log()
    if options.backend == "native":
        _log_once(
            state,
            "fd-cudagraph-plugin installed but FD_CUDAGRAPH_BACKEND=native: FastDeploy %s keeps "
            "its own CUDA-graph backend.",
            seam.version(),
        )
        return
    blocker = seam.cuda_runtime_blocker() if options.runtime == "cuda" else None
    if blocker is not None:
        _log_once(
            state,
            "fd-cudagraph-plugin %s stands aside: %s, and its CUDA runtime drives NVIDIA CUDA "
            "graphs only. FastDeploy %s keeps its own CUDA-graph backend and runners.",
            __version__,
            blocker,
            seam.version(),
        )
        return

    from fd_cudagraph_plugin.core import hooks
    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    seam.backfill_forward_meta(state.patches)
    native = seam.bind_backend(CudaGraphBackend)
    # Every capture loop must run in a session, also when no profile run builds a backend first.
    hooks.watch()
    if not state.announced:
        state.announced = True
        logger.info(
            "fd-cudagraph-plugin %s active: CUDA-graph backend replaced for FastDeploy %s "
            "(constructor %s); options: %s.",
            __version__,
            seam.version(),
            seam.constructor_shape(native),
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


def _log_once(state: process.WorkerProcess, message: str, *args: object) -> None:
    if not state.announced:
        state.announced = True
        logger.info(message, *args)


def reset_for_tests() -> None:
    """Undo what register() did to process-wide state: log forwarding and ForwardMeta fields."""
    seam.stop_logging_to_worker_log()
    seam.undo_patches(process.current().patches)


__all__ = ["BY_ENV", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME", "register", "reset_for_tests"]
