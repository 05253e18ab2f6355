"""After each of FastDeploy's lifecycle calls, no graph is left to replay against memory that moved.

``hooks.py`` wraps the runner's calls of ``seam.LIFECYCLE`` (``sleep``, ``wakeup``,
``clear_parameters``, ``update_parameters``, ``update_weights``) and the worker's start-up
(``seam.START_UP``). When the outermost of them returns, every rank compares each backend's
``moved.Fingerprint`` (taken when its graphs were captured) with where the same tensors are now,
and the ranks agree on the union:

* nothing moved on any rank: the graphs are kept (``update_weights`` over rsync writes the weights
  in place; a call that recaptured took a new fingerprint at its capture);
* something moved and every rank can serve now: the graphs are released and the runner's capture
  loops run again, a capture session like any other; this is the ``wakeup("kv_cache")``
  FastDeploy leaves stale;
* something moved and some rank cannot serve (``sleep``, ``clear_parameters``): the graphs are
  released, decode steps run eagerly until the next call that can serve, which captures again.

Each graph's first replay after a call then checks that step's inputs, agreed too
(``first_replay``), so that what the fingerprint cannot name still never replays stale.

The ``Lifecycle`` of a process owns all of this state and is its one writer: the calls open now,
what was released and why, and each backend's fingerprint. A new call that behaves like the
others is one row of ``seam.LIFECYCLE``; a call with other semantics is a change here alone.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from fd_cudagraph_plugin.core import moved, process, seam
from fd_cudagraph_plugin.core.ranks.agreement import outside_session, release_held
from fd_cudagraph_plugin.core.ranks.messages import Moved, text
from fd_cudagraph_plugin.core.runtime import GraphRuntime

logger = logging.getLogger("fd_cudagraph_plugin")


class LifecycleDispatcher(Protocol):
    """What the lifecycle tells a backend's dispatcher (``dispatch.Dispatcher``)."""

    def suspect(self) -> None: ...

    def verified(self, entry: Any) -> None: ...

    def mark_stale(self) -> None: ...


class LifecycleBackend(Protocol):
    """What the lifecycle asks of a backend (``backend.CudaGraphBackend``); ``release_graphs``
    drops its graphs and capture state, and says how many were captured."""

    role: str
    layer: object
    fd_config: Any
    dispatcher: LifecycleDispatcher
    runtime: GraphRuntime

    def has_graphs(self, prefill: bool = False) -> bool: ...

    def input_addresses(self) -> Iterable[tuple[str, int]]: ...

    def release_graphs(self) -> int: ...

    def flush_stats(self) -> None: ...


class Lifecycle:
    """The lifecycle state of one worker process (``state()``)."""

    def __init__(self, worker: process.WorkerProcess) -> None:
        self._worker = worker
        #: Lifecycle calls running now (a wake-up may call another): only the outermost one's
        #: end is checked.
        self.depth = 0
        #: Outermost calls begun in this process, counted as each begins: with the sessions begun
        #: since (``sessions``), what names the agreement points every rank derives alike. An
        #: interrupt cannot shift it: it is counted before anything that can fail.
        self.calls = 0
        self.sessions = 0
        #: The call after which the graphs were released for memory that moved, until they are
        #: captured again; and whether prefill graphs were among them.
        self.released_after: str | None = None
        self.released_prefill = False
        #: Why the plugin runs the capture loops itself, while it does: the summary line says it.
        self.cause = ""
        self._fingerprints: weakref.WeakKeyDictionary[Any, moved.Fingerprint] = (
            weakref.WeakKeyDictionary()
        )

    # -------------------------------------------------------------------- the calls

    def call(self, method: Callable, event: str, servable: bool, owner: Any, *args, **kwargs):
        """``method`` (a runner's lifecycle call, or the worker's start-up), then ``after`` when
        the outermost such call ends; a call that raised, an interrupt too, is posted like any
        failure, so that every rank meets its point."""
        if self.depth == 0:
            self.calls, self.sessions = self.calls + 1, 0
        self.depth += 1
        try:
            result = method(owner, *args, **kwargs)
        except BaseException as error:
            self.depth -= 1
            if self.depth == 0:
                self.after(event, _runner_of(owner), servable, failed=error)
            raise
        self.depth -= 1
        if self.depth == 0:
            self.after(event, _runner_of(owner), servable)
            release_held(self._worker)
        return result

    def scope(self, name: str) -> str:
        """The name of a point outside sessions, since the last call began (``name`` says which:
        the check after it, or a graph's first replay)."""
        return f"c{self.calls}.{name}"

    def session_scope(self) -> str:
        """The name of the next capture session's points."""
        self.sessions += 1
        return f"c{self.calls}.s{self.sessions}"

    def after(
        self, event: str, runner: Any, servable: bool, failed: BaseException | None = None
    ) -> None:
        """The lifecycle call ``event`` of ``runner`` returned (or raised ``failed``).

        Every rank with backends meets here after every call, whatever its own state: a rank that
        skipped the point would leave the others waiting, or meet their next one. The exception is
        a call that raised an error every rank already agreed on (a capture session inside it
        failed): each rank raised it at the same point."""
        backends: list[LifecycleBackend] = self._worker.backends()
        if not backends:
            return
        for backend in backends:
            backend.dispatcher.suspect()
        if failed is not None and _agreed(failed):
            self._release(backends, event, f"{event} failed on a rank")
            return
        captured = [b for b in backends if b in self._fingerprints and b.has_graphs()]

        def local() -> Moved:
            if failed is not None:
                raise failed
            found = [f"{b.role} {name}" for b in captured for name in self.moved(b, runner)]
            names = [text(name, 300) for name in found[:64]]
            return Moved(names=names, can_serve=servable and seam.can_serve(runner))

        try:
            config = getattr(runner, "fd_config", None) or backends[0].fd_config
            points = outside_session(self._worker, config, self.scope("after"))
            said = points.share(f"after {event}", None, None, local, Moved)
        except BaseException:
            # What the call moved before it failed is unknown: no graph stays to replay it.
            self._release(backends, event, f"{event} failed on a rank")
            if failed is not None:
                raise failed from None  # this rank's own error; the others raise the agreed one
            raise
        where = {rank: found.names for rank, found in enumerate(said) if found.names}
        if not where and self.released_after is None:
            return
        what = "; ".join(f"rank {rank}: {moved.summary(names)}" for rank, names in where.items())
        # Whether to capture is decided on every rank alike: a capture session is a collective.
        if not all(found.can_serve for found in said):
            self._release(backends, event, f"memory that CUDA graphs read has moved ({what})")
            return
        self._recapture(backends, runner, event, what)

    # -------------------------------------------------------------------- capture sessions

    def captured(
        self, phase: str, members: Sequence[LifecycleBackend], runner: Any
    ) -> list[str] | None:
        """A capture session of ``phase`` ended with graphs: note where they read memory, and
        return what moved since the capture before (None: there was none)."""
        self.released_after = None
        if phase == "prefill":
            self.released_prefill = False
        if runner is None:
            return None
        found = None
        for member in members:
            before = self._fingerprints.get(member)
            self._fingerprints[member] = moved.at_capture(
                member.layer,
                seam.input_buffers(runner),
                member.input_addresses(),
                seam.custom_allreduce(),
            )
            if before is not None:
                names = before.moved(self._fingerprints[member])
                found = (found or []) + [f"{member.role} {name}" for name in names]
        return found

    # -------------------------------------------------------------------- first replays

    def first_replay(self, backend: LifecycleBackend, entry: Any, kwargs: dict) -> bool:
        """The first replay of ``entry`` since a lifecycle call: its inputs are where its capture
        saw them on every rank (agreed: ranks must not mix replays and eager steps), or every
        graph of the process is released. Never raises: a step that cannot agree runs eagerly
        on every rank, and is counted."""
        from fd_cudagraph_plugin.core import guards
        from fd_cudagraph_plugin.core.errors import CaptureError

        local = guards.moved_inputs(entry.addresses, kwargs)
        # Named by the backend's part in FastDeploy's model, not by its place among the live
        # backends: an old model's backend may be collected on one rank and not yet on another.
        role, backends = backend.role, self._worker.backends()
        if role not in ("target", "draft") or [b.role for b in backends].count(role) > 1:
            role += str(backends.index(backend) if backend in backends else len(backends))
        try:
            key = entry.key
            name = f"{role}.{key.phase}{key.size}{'.static' if key.static else ''}"
            points = outside_session(self._worker, backend.fd_config, self.scope(name))
            said = points.share("inputs in place", backend, entry.key, lambda: not local, bool)
        except CaptureError as error:
            why = f"the ranks could not agree on its inputs ({error})"
        else:
            if all(said):
                backend.dispatcher.verified(entry)
                return True
            ranks = ", ".join(str(rank) for rank, fine in enumerate(said) if not fine)
            here = f"; here: {moved.summary(local)}" if local else ""
            why = f"inputs of its graph are not where the capture saw them (rank {ranks}{here})"
        logger.warning(
            "CUDA graph backend %#x (%s): at the first %s step since a lifecycle call, %s.",
            id(backend),
            backend.role,
            entry.key,
            why,
        )
        self._release(self._worker.backends(), "a lifecycle call", "an input moved")
        return False

    # -------------------------------------------------------------------- what it does

    def moved(self, backend: LifecycleBackend, runner: Any) -> list[str]:
        """What ``backend``'s graphs read that is no longer where it was at their capture."""
        before = self._fingerprints[backend]
        now = moved.now(before, backend.layer, seam.input_buffers(runner), seam.custom_allreduce())
        return before.moved(now)

    def release_every_graph(self, asked_by: LifecycleBackend | None = None) -> None:
        """Release every graph of the process, ``asked_by``'s first, so that the next capture
        session captures all of them again, in the same order on every rank: a clear closes every
        custom all-reduce IPC handle of the process and (2.5+) rewinds the registration slots, and
        a wake-up recreates the MTP draft's inputs, where FastDeploy clears only the target's
        graphs. Releasing twice, or before any capture, is harmless."""
        backends = self._worker.backends()
        first = asked_by if asked_by is not None else next(iter(backends), None)
        if first is None:
            return
        released = first.release_graphs()
        others = [(b, b.release_graphs()) for b in backends if b is not first]
        also = "; ".join(f"{n} of backend {id(b):#x} ({b.role})" for b, n in others if n)
        if also:
            logger.info(
                "clear_graph of CUDA graph backend %#x (%s) also released the graphs of the "
                "process's other backends (%s): the clear resets the process's custom all-reduce "
                "registrations, and a wake-up recreates their inputs. The next capture_model() "
                "captures them again.",
                id(first),
                first.role,
                also,
            )
        first.runtime.empty_cache()
        seam.clear_ipc_handles()
        for backend in (first, *(b for b, _ in others)):
            backend.flush_stats()  # after the release: a failing write must not keep graphs
        logger.debug("clear_graph released %d graphs", released)

    def _release(self, backends: list[LifecycleBackend], event: str, why: str) -> None:
        """Release every graph of the process (every rank does, at the same point): decode steps
        run eagerly as ``memory_moved`` until a capture session, which the next call that can
        serve runs, prefill graphs included when there were some."""
        if any(b.has_graphs() for b in backends):
            self.released_prefill = self.released_prefill or any(
                b.has_graphs(prefill=True) for b in backends
            )
            logger.warning(
                "After %s, %s. The plugin released every graph: steps run without graphs until a "
                "call that can serve again (wakeup, update_parameters) or capture_model() "
                "captures them.",
                event,
                why,
            )
            self.release_every_graph()
        for backend in backends:
            backend.dispatcher.mark_stale()
        self.released_after = self.released_after or event

    def _recapture(
        self, backends: list[LifecycleBackend], runner: Any, event: str, what: str
    ) -> None:
        prefill = self.released_prefill or any(b.has_graphs(prefill=True) for b in backends)
        if what:
            logger.info(
                "After %s, memory that CUDA graphs read has moved (%s), and FastDeploy did not "
                "capture again: the plugin releases the graphs and captures them on the memory "
                "as it is now.",
                event,
                what,
            )
        else:
            what = f"graphs released after {self.released_after}"
            logger.info("After %s, the plugin captures the %s again.", event, what)
        if any(b.has_graphs() for b in backends):
            self.release_every_graph()
        self.released_after = self.released_after or event
        self.cause = f"after {event} ({what})"
        # At start-up (deterministic mode) FastDeploy reset the inputs after its capture on purpose.
        kept = seam.inputs_kept(runner) if event == seam.START_UP else contextlib.nullcontext()
        try:
            with kept:
                for loop in seam.capture_loops(runner, prefill):
                    loop()
        finally:
            self.cause = ""
        self.released_after = None
        self.released_prefill = False


def wrap(method: Callable, event: str, servable: bool) -> Callable:
    """``method`` as a lifecycle call of the process it runs in (``Lifecycle.call``)."""

    def lifecycle_call(owner: Any, *args: Any, **kwargs: Any) -> Any:
        return state(process.current()).call(method, event, servable, owner, *args, **kwargs)

    lifecycle_call.__name__ = method.__name__
    lifecycle_call.__doc__ = method.__doc__
    lifecycle_call._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return lifecycle_call


def state(worker: process.WorkerProcess) -> Lifecycle:
    """``worker``'s ``Lifecycle`` (a new worker, or a test's fresh process, gets a new one)."""
    if worker.lifecycle is None:
        worker.lifecycle = Lifecycle(worker)
    return worker.lifecycle  # type: ignore[return-value]


def _agreed(error: BaseException) -> bool:
    """``error``, or one it was raised from (FastDeploy rewraps some), came from an agreement."""
    for _ in range(8):
        if getattr(error, "agreed", False):
            return True
        error = error.__cause__ or error.__context__
        if error is None:
            return False
    return False


def _runner_of(owner: Any) -> Any:
    """The runner itself, or the worker's ``model_runner``."""
    return getattr(owner, "model_runner", owner)


__all__ = ["Lifecycle", "LifecycleBackend", "LifecycleDispatcher", "state", "wrap"]
