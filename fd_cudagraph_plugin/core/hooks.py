"""FastDeploy's capture loops, each run inside a ``CaptureSession``.

``GPUModelRunner.capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture; the wrappers keep those loops and
open a session around each (``fastdeploy.py`` knows which runners and loops there are).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import fastdeploy, worker
from fd_cudagraph_plugin.core.session import CaptureSession


def _wrap(method: Callable, phase: str) -> Callable:
    @functools.wraps(method)
    def run_in_session(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if worker.current().session is not None:
            return method(runner, *args, **kwargs)
        with CaptureSession(phase, fd_config=getattr(runner, "fd_config", None), runner=runner):
            return method(runner, *args, **kwargs)

    run_in_session._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return run_in_session


def install() -> bool:
    """Wrap FastDeploy's capture loops in sessions. Idempotent; False if no runner is loaded.

    Called as soon as a runner module has finished importing (``watch()``), and by each
    backend's constructor, for runners imported some other way.
    """
    runners = fastdeploy.loaded_runners()
    for runner in runners:
        for name, phase in fastdeploy.CAPTURE_LOOPS:
            method = runner.__dict__.get(name)
            if method is not None and not hasattr(method, "_fd_cudagraph_original"):
                setattr(runner, name, _wrap(method, phase))
    return bool(runners)


def watch() -> None:
    """Install the wrappers now, and again whenever a runner module finishes importing."""
    fastdeploy.on_runner_import(install)


def uninstall() -> None:
    for runner in fastdeploy.loaded_runners():
        for name, _ in fastdeploy.CAPTURE_LOOPS:
            original = getattr(runner.__dict__.get(name), "_fd_cudagraph_original", None)
            if original is not None:
                setattr(runner, name, original)
