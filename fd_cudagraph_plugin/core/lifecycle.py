"""After each of FastDeploy's lifecycle calls, no graph is left to replay against memory that moved.

``hooks.py`` wraps the runner's ``sleep``, ``wakeup``, ``clear_parameters``, ``update_parameters``
and ``update_weights``, and the worker's start-up (``seam.LIFECYCLE``, ``seam.START_UP``). When the
outermost of them returns, every rank compares each backend's ``moved.Fingerprint`` (taken when
its graphs were captured) with where the same tensors are now, and the ranks agree on the union:

* nothing moved on any rank: the graphs are kept (``update_weights`` over rsync writes the weights
  in place; a call that recaptured took a new fingerprint at its capture);
* something moved and the model can serve now (``wakeup``, ``update_*``, the start-up): the graphs
  are released and the runner's capture loops run again, a capture session like any other, so
  the ranks agree at every capture; this is the ``wakeup("kv_cache")`` FastDeploy leaves stale;
* something moved and the model cannot serve (``sleep``, ``clear_parameters``): the graphs are
  released, decode steps run eagerly (one warning, naming the call) until the next call that
  can serve, which captures them again.

Each rank then checks each graph's first replay against that step's inputs (``backend.py``,
``verify``), agreed too, so that what the fingerprint cannot name still never replays stale.
Every TP rank runs the same lifecycle calls (FastDeploy sends them to every worker), so each
meets the same points; a rank whose call raised posts its failure there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import moved, process, seam
from fd_cudagraph_plugin.core.ranks.agreement import outside_session
from fd_cudagraph_plugin.core.ranks.messages import Moved, text

logger = logging.getLogger("fd_cudagraph_plugin")


def after(event: str, runner: Any, servable: bool, failed: BaseException | None = None) -> None:
    """The lifecycle call ``event`` of ``runner`` returned (or raised ``failed``).

    Every rank with backends meets here after every call, whatever its own state: a rank that
    skipped the point would leave the others waiting, or meet their next one. The exception is a
    call that raised an error every rank already agreed on (a capture session inside it failed):
    each rank raised it at the same point, and meeting again would put this one a point ahead."""
    worker = process.current()
    backends = worker.backends()
    if not backends:
        return
    for backend in backends:
        backend.suspect()
    if failed is not None and _agreed(failed):
        release(worker, backends, event, f"{event} failed on a rank")
        return
    captured = [b for b in backends if b.fingerprint is not None and b.has_graphs()]

    def local() -> Moved:
        if failed is not None:
            raise failed
        found = []
        for backend in captured:
            found += [f"{backend.role} {name}" for name in backend.moved_since_capture(runner)]
        names = [text(name, 300) for name in found[:64]]
        return Moved(names=names, can_serve=servable and seam.can_serve(runner))

    try:
        points = outside_session(getattr(runner, "fd_config", None) or backends[0].fd_config)
        said = points.share(f"after {event}", None, None, local, Moved)
    except BaseException:
        # What the call moved before it failed is unknown: no graph stays to replay it.
        release(worker, backends, event, f"{event} failed on a rank")
        if failed is not None:
            raise failed from None  # this rank's own error; the others raise the agreed one
        raise
    where = {rank: found.names for rank, found in enumerate(said) if found.names}
    if not where and worker.stale_after is None:
        return
    what = "; ".join(f"rank {rank}: {moved.summary(names)}" for rank, names in where.items())
    # Whether to capture is decided on every rank alike: a capture session is a collective.
    if not all(found.can_serve for found in said):
        release(worker, backends, event, f"memory that CUDA graphs read has moved ({what})")
        return
    _recapture(worker, backends, runner, event, what)


def _agreed(error: BaseException) -> bool:
    """``error``, or one it was raised from (FastDeploy rewraps some), came from an agreement."""
    for _ in range(8):
        if getattr(error, "agreed", False):
            return True
        error = error.__cause__ or error.__context__
        if error is None:
            return False
    return False


def release(worker: process.WorkerProcess, backends: list[Any], event: str, why: str) -> None:
    """Release every graph of the process (every rank does, at the same point): decode steps
    run eagerly as ``memory_moved`` until a capture session, which the next call that can serve
    runs (``_recapture``), prefill graphs included when there were some."""
    if any(b.has_graphs() for b in backends):
        worker.stale_prefill = worker.stale_prefill or any(
            b.has_graphs(prefill=True) for b in backends
        )
        logger.warning(
            "After %s, %s. The plugin released every graph: steps run without graphs until a "
            "call that can serve again (wakeup, update_parameters) or capture_model() captures "
            "them.",
            event,
            why,
        )
        backends[0].clear_graph()
    for backend in backends:
        backend.dispatcher.stale = True
    worker.stale_after = worker.stale_after or event


def _recapture(
    worker: process.WorkerProcess, backends: list[Any], runner: Any, event: str, what: str
) -> None:
    prefill = worker.stale_prefill or any(b.has_graphs(prefill=True) for b in backends)
    if what:
        logger.info(
            "After %s, memory that CUDA graphs read has moved (%s), and FastDeploy did not "
            "capture again: the plugin releases the graphs and captures them on the memory as "
            "it is now.",
            event,
            what,
        )
    else:
        what = f"graphs released after {worker.stale_after}"
        logger.info("After %s, the plugin captures the %s again.", event, what)
    if any(b.has_graphs() for b in backends):
        backends[0].clear_graph()
    worker.stale_after = worker.stale_after or event
    worker.recapture_cause = f"after {event} ({what})"
    # At start-up (deterministic mode) FastDeploy reset the inputs after its capture on purpose.
    kept = seam.inputs_kept(runner) if event == seam.START_UP else contextlib.nullcontext()
    try:
        with kept:
            for loop in seam.capture_loops(runner, prefill):
                loop()
    finally:
        worker.recapture_cause = ""
    worker.stale_after = None
    worker.stale_prefill = False


def wrap(method: Callable, event: str, servable: bool) -> Callable:
    """``method`` (a runner's lifecycle call, or the worker's start-up), then ``after`` when the
    outermost such call ends."""

    def lifecycle_call(owner: Any, *args: Any, **kwargs: Any) -> Any:
        worker = process.current()
        worker.lifecycle_depth += 1
        try:
            result = method(owner, *args, **kwargs)
        except BaseException as error:
            # An interrupt too: posted like any failure, so that the others meet it at this
            # call's point rather than pair this rank's next call with it.
            worker.lifecycle_depth -= 1
            if worker.lifecycle_depth == 0:
                after(event, _runner_of(owner), servable, failed=error)
            raise
        worker.lifecycle_depth -= 1
        if worker.lifecycle_depth == 0:
            after(event, _runner_of(owner), servable)
        return result

    lifecycle_call.__name__ = method.__name__
    lifecycle_call.__doc__ = method.__doc__
    lifecycle_call._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return lifecycle_call


def _runner_of(owner: Any) -> Any:
    """The runner itself, or the worker's ``model_runner``."""
    return getattr(owner, "model_runner", owner)


__all__ = ["after", "wrap"]
