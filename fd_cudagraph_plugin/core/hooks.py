"""FastDeploy's capture loops run inside a ``CaptureSession``, and its memory profile and the end
of each capture loop call the KV reserve (``reserve.py``); its lifecycle calls end in
the process's ``Lifecycle`` (memory that moved); a backend FastDeploy builds joins its process
(``adopt``).

``GPUModelRunner.capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture; the wrappers keep those loops and
open a session around each. ``GpuWorker.determine_available_memory()`` answers how much memory the
KV cache may take; with a reserve its answer is that much less. ``seam.py`` knows which classes
and methods there are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import lifecycle, observability, process, reserve, seam
from fd_cudagraph_plugin.core.errors import CaptureError
from fd_cudagraph_plugin.core.session import CaptureSession, SessionBackend


def adopt(worker: process.WorkerProcess, backend: SessionBackend) -> None:
    """``backend`` was built in ``worker``: the process keeps it (clears, stats and sessions reach
    every live one), the periodic reporter and metrics start with the first, the capture loops are
    wrapped for runners imported some other way, and an open session takes it in."""
    worker.add(backend)
    observability.start(worker, backend.settings.options)
    install()
    seam.count_steps_run_without(backend.layer, backend.dispatcher.skipped)
    if worker.session is not None:
        worker.session.join(backend)


def _in_session(method: Callable, phase: str) -> Callable:
    @functools.wraps(method)
    def run_in_session(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if process.current().session is not None:
            return method(runner, *args, **kwargs)
        session = CaptureSession(
            phase,
            fd_config=getattr(runner, "fd_config", None),
            runner=runner,
            reserve=reserve.state().current,
        )
        try:
            with session, seam.loop_visits(runner, session.fitted_sizes):
                result = method(runner, *args, **kwargs)
        except CaptureError as error:
            reserve.state().after_failed_capture(error, session.members)
            raise
        reserve.state().after_capture(session.report, session.members)
        return result

    run_in_session._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return run_in_session


def _reserving(method: Callable) -> Callable:
    @functools.wraps(method)
    def determine_available_memory(gpu_worker: Any, *args: Any, **kwargs: Any) -> Any:
        return reserve.state().on_memory_profile(
            gpu_worker.model_runner, lambda: method(gpu_worker, *args, **kwargs)
        )

    determine_available_memory._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return determine_available_memory


def install() -> bool:
    """Wrap FastDeploy's capture loops and memory profile. Idempotent; False if no runner is
    loaded. Called as soon as a runner or worker module has finished importing (``watch()``),
    and by each backend's constructor, for runners imported some other way."""
    runners = seam.loaded_runners()
    for runner in runners:
        for name, phase in seam.CAPTURE_LOOPS:
            method = runner.__dict__.get(name)
            if method is not None and not hasattr(method, "_fd_cudagraph_original"):
                setattr(runner, name, _in_session(method, phase))
        for call in seam.LIFECYCLE:
            method = runner.__dict__.get(call.name)
            if method is not None and not hasattr(method, "_fd_cudagraph_original"):
                setattr(runner, call.name, lifecycle.wrap(method, call.name, call.servable))
    for gpu_worker in seam.loaded_workers():
        method = gpu_worker.__dict__.get("determine_available_memory")
        if method is not None and not hasattr(method, "_fd_cudagraph_original"):
            gpu_worker.determine_available_memory = _reserving(method)
        method = gpu_worker.__dict__.get(seam.START_UP)
        if method is not None and not hasattr(method, "_fd_cudagraph_original"):
            setattr(gpu_worker, seam.START_UP, lifecycle.wrap(method, seam.START_UP, True))
    return bool(runners)


def watch() -> None:
    """Install the wrappers now, and again whenever a runner module finishes importing."""
    seam.on_runner_import(install)


def uninstall() -> None:
    wrapped = [(r, n) for r in seam.loaded_runners() for n, _ in seam.CAPTURE_LOOPS]
    wrapped += [(r, c.name) for r in seam.loaded_runners() for c in seam.LIFECYCLE]
    wrapped += [(w, "determine_available_memory") for w in seam.loaded_workers()]
    wrapped += [(w, seam.START_UP) for w in seam.loaded_workers()]
    for owner, name in wrapped:
        original = getattr(owner.__dict__.get(name), "_fd_cudagraph_original", None)
        if original is not None:
            setattr(owner, name, original)
