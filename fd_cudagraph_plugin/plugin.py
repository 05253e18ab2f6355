"""The one place that knows FastDeploy's internals: the entry point and the rebinding.

FastDeploy calls ``register()`` through the ``fastdeploy.model_register_plugins`` entry point when
``FD_PLUGINS`` names ``fd_cudagraph_plugin``, in every process that imports its models package
(each worker included), before any model or backend exists. ``GraphOptBackend`` looks the backend
class up as a global of ``graph_optimization_backend`` at its first call, so rebinding that global
is enough; rebinding the class's home module alone would change nothing, because
``graph_optimization_backend`` imported the name before plugins load.
"""

from __future__ import annotations

import inspect
import logging
import os

from fd_cudagraph_plugin.core.options import PluginOptions, unknown_options

logger = logging.getLogger("fd_cudagraph_plugin")

ENTRY_POINT_GROUP = "fastdeploy.model_register_plugins"
ENTRY_POINT_NAME = "fd_cudagraph_plugin"
_BACKEND_MODULE = "fastdeploy.model_executor.graph_optimization.graph_optimization_backend"
_NATIVE_MODULE = "fastdeploy.model_executor.graph_optimization.cudagraph_piecewise_backend"
_NAME = "CudaGraphPiecewiseBackend"
_FORWARD_META_MODULE = "fastdeploy.model_executor.forward_meta"
#: ForwardMeta fields the backend reads that older releases lack (2.4: both; 2.5: real_bsz), with
#: the value that means the same there: 2.4 routes only decode steps to the backend, and 0
#: running requests makes the backend count them from seq_lens_this_time, as 2.5's own does.
FORWARD_META_DEFAULTS = {"exist_prefill": False, "real_bsz": 0}

_logged = False
#: (class, name) pairs backfill_forward_meta added, so tests can take them away again.
_backfilled: list[tuple[type, str]] = []
_unknown_logged = False


class _ToFastDeploy(logging.Handler):
    """Hands the plugin's records to a FastDeploy logger's own handlers (its log files).

    Only to its handlers: FastDeploy's file loggers (``legacy.<name>``) propagate to the root
    logger, and so does ours, so passing records through the FastDeploy logger itself would print
    every line twice wherever root has a handler. Its handlers are read at each record, because
    FastDeploy replaces them whenever ``get_logger`` is called for that name.
    """

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if not self.target.isEnabledFor(record.levelno):
            return
        for handler in self.target.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _log_to_fastdeploy() -> None:
    """Send the package logger's records to FastDeploy's worker log (``worker_process.log``)."""
    if any(isinstance(h, _ToFastDeploy) for h in logger.handlers):
        return
    try:
        from fastdeploy.utils import get_logger

        target = get_logger("fd_cudagraph_plugin", "worker_process.log")
    except Exception:  # an older or newer FastDeploy without this helper: keep Python's logging
        return
    if target is logger or not target.handlers:
        return
    logger.addHandler(_ToFastDeploy(target))
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def register() -> None:
    """Install the plugin's backend in FastDeploy. Idempotent; no CUDA work."""
    global _logged
    import importlib

    # Every option is checked here, so a typo stops FastDeploy at start-up with the fix, not at
    # the first forward.
    choice = PluginOptions.from_env().backend
    backend_module = importlib.import_module(_BACKEND_MODULE)
    _log_to_fastdeploy()
    _log_unknown_options()
    if choice == "native":
        if not _logged:
            _logged = True
            logger.info(
                "fd-cudagraph-plugin installed but FD_CUDAGRAPH_BACKEND=native: FastDeploy %s "
                "keeps its own CUDA-graph backend.",
                fastdeploy_version(),
            )
        return

    from fd_cudagraph_plugin.core import hooks
    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    forward_meta = getattr(_import_or_none(_FORWARD_META_MODULE), "ForwardMeta", None)
    if forward_meta is not None:  # every release has it; a layout we do not know keeps its own
        backfill_forward_meta(forward_meta)
    native = getattr(backend_module, _NAME, None)
    if native is not CudaGraphBackend:
        backend_module._fd_cudagraph_native_backend = native
        setattr(backend_module, _NAME, CudaGraphBackend)
        native_module = importlib.import_module(_NATIVE_MODULE)
        setattr(native_module, _NAME, CudaGraphBackend)
    # Every capture loop must run in a session, also when no profile run builds a backend first.
    hooks.watch_runner_imports()
    if not _logged:
        _logged = True
        from fd_cudagraph_plugin import __version__

        logger.info(
            "fd-cudagraph-plugin %s active: CUDA-graph backend replaced for FastDeploy %s "
            "(constructor %s).",
            __version__,
            fastdeploy_version(),
            constructor_shape(native),
        )


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


def _import_or_none(name: str) -> object | None:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def backfill_forward_meta(cls: type) -> list[str]:
    """Give ``ForwardMeta`` class-level defaults for the fields its release lacks, so the replay
    path reads plain attributes on every release; return the names added. Fields the class has
    (as dataclass defaults, on 2.5+) are left alone."""
    added = [name for name in FORWARD_META_DEFAULTS if not hasattr(cls, name)]
    for name in added:
        setattr(cls, name, FORWARD_META_DEFAULTS[name])
        _backfilled.append((cls, name))
    return added


def reset_for_tests() -> None:
    """Undo what register() did to process-wide state: log forwarding and ForwardMeta fields."""
    global _logged, _unknown_logged
    _logged = _unknown_logged = False
    for handler in [h for h in logger.handlers if isinstance(h, _ToFastDeploy)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    while _backfilled:
        cls, name = _backfilled.pop()
        delattr(cls, name)


def fastdeploy_version() -> str:
    try:
        import fastdeploy
    except ImportError:
        return "(not installed)"
    return str(getattr(fastdeploy, "__version__", "unknown"))


def constructor_shape(cls: object) -> str:
    """``(fd_config, dy_runnable, runnable)`` on 2.5+, ``(fd_config, runnable)`` on 2.4."""
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    except (TypeError, ValueError):
        return "unknown"
    return "(" + ", ".join(params) + ")"
