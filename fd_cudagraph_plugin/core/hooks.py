"""FastDeploy's capture loops, wrapped so that each runs inside a ``CaptureSession``.

``GPUModelRunner.capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture; the wrappers keep those loops and
open a session around each.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import session
from fd_cudagraph_plugin.core.session import CaptureSession

_HOOKS = (("capture_model", "decode"), ("capture_model_prefill_and_mixed", "prefill"))
# The runners with their own CUDA-graph capture loops: GPU (and its DCU and Iluvatar subclasses)
# and MetaX MACA. The MTP proposer has none; its draft captures inside the target's loop.
_RUNNERS = (
    ("fastdeploy.worker.gpu_model_runner", "GPUModelRunner"),
    ("fastdeploy.worker.metax_model_runner", "MetaxModelRunner"),
)


def _loaded_runners() -> list[type]:
    found = []
    for module_name, class_name in _RUNNERS:
        runner = getattr(sys.modules.get(module_name), class_name, None)
        if runner is not None:
            found.append(runner)
    return found


def _wrap(method: Callable, phase: str) -> Callable:
    @functools.wraps(method)
    def run_in_session(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if session.active() is not None:
            return method(runner, *args, **kwargs)
        with CaptureSession(phase, fd_config=getattr(runner, "fd_config", None)) as running:
            if running.options.warmup == "warm_all_first":
                # Warm every size before capturing any, so a workspace that grows at a smaller
                # size cannot invalidate a graph captured earlier (TensorRT-LLM #16319).
                running.warm_only = True
                method(runner, *args, **kwargs)
                running.warm_only = False
            return method(runner, *args, **kwargs)

    run_in_session._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return run_in_session


def install_runner_hooks() -> bool:
    """Wrap FastDeploy's capture loops in sessions. Idempotent; False if no runner is loaded.

    ``watch_runner_imports()`` calls this as soon as a runner module has finished importing; each
    backend's constructor calls it too, for runners imported some other way.
    """
    runners = _loaded_runners()
    for runner in runners:
        for name, phase in _HOOKS:
            method = runner.__dict__.get(name)
            if method is not None and not hasattr(method, "_fd_cudagraph_original"):
                setattr(runner, name, _wrap(method, phase))
    return bool(runners)


_RUNNER_PACKAGE = "fastdeploy.worker"
_RUNNER_MODULES = frozenset(module.rpartition(".")[2] for module, _ in _RUNNERS)


class _RunnerPackage(types.ModuleType):
    """``fastdeploy.worker``, told when one of its runner modules has finished executing.

    ``register()`` runs while ``gpu_model_runner`` is still executing (its import of the models
    package loads the plugins), before ``GPUModelRunner`` exists, so nothing can be wrapped then.
    The import system binds a submodule on its parent package right after the submodule has
    executed (the documented "submodules" rule), with ``setattr``, so this is the first moment
    the class exists, whatever the import order: runner importing the models, or the models
    imported first and the runner later. A ``sys.meta_path`` finder would see only imports that
    have not started yet and so miss the in-progress one, the case FastDeploy actually has; the
    first backend's constructor is too late when that backend is built inside ``capture_model()``.
    Replacing a module's ``__class__`` by a ``ModuleType`` subclass is the documented way to
    customise a module; nothing else of the package changes.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _RUNNER_MODULES:
            install_runner_hooks()


def watch_runner_imports() -> None:
    """Install the runner hooks now, and again whenever a runner module finishes importing."""
    import importlib

    install_runner_hooks()
    try:
        package = importlib.import_module(_RUNNER_PACKAGE)
    except ImportError:  # a FastDeploy without it: the backends' constructors install the hooks
        return
    if type(package) is types.ModuleType:
        package.__class__ = _RunnerPackage


def uninstall_runner_hooks() -> None:
    for runner in _loaded_runners():
        for name, _ in _HOOKS:
            original = getattr(runner.__dict__.get(name), "_fd_cudagraph_original", None)
            if original is not None:
                setattr(runner, name, original)
