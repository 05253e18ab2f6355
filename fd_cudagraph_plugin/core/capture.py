"""Capturing one step: the order check, warm-ups, the pool, the custom all-reduce, accounting, the
registration and the self-check, each followed by an agreement point (``ranks.agreement``).

``Capturer.capture_step`` captures a step the dispatcher chose, alone or in a capture session,
counts it and returns its result; what it asks of the backend is ``StepOwner``.

Dynamic entries are captured by the runtime (``runtime/``); static ones by Paddle inside its
partial programs (``dy2st.py``). Warm-ups run outside FastDeploy's custom all-reduce capture state
and the capture inside it: there, every all-reduce that is not being captured returns an
uninitialised buffer. FastDeploy's custom all-reduce keeps the buffers of every capture until its
next ``register_graph_buffers`` (``graph_unreg_buffers_``, ``all_reduce.cuh``), a collective over
the TP group; a session registers them once, at its end, after every rank agreed every capture
(``session.py``), and no graph replays before (its kernels read peer pointers the registration
fills): until then the capturing step returns the last warm-up's result.

Which memory pool a backend's graphs capture into (``FD_CUDAGRAPH_POOL``, ``pool_policy``):

* ``instance`` (default): one pool per backend, FastDeploy's ``use_unique_memory_pool=true``.
  Graphs of one backend share it, captured largest first, so smaller graphs reuse the memory the
  larger ones reserved. A graph's outputs stay valid until the next replay of any graph of that
  backend, which FastDeploy's runner respects: it slices each output before the next step. The
  target and the draft each get their own, so a draft replay never overwrites target outputs.
* ``graph``: Paddle's private pool per graph; every graph pays for its own scratch memory. This
  is what FastDeploy's ``use_unique_memory_pool=false`` does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from fd_cudagraph_plugin.core import outputs, seam
from fd_cudagraph_plugin.core.dispatch import Dispatcher
from fd_cudagraph_plugin.core.dy2st import StaticGraphDriver, static_probe
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureOrderError, SelfCheckError
from fd_cudagraph_plugin.core.graphs import DECODE, NOTHING, Captured, GraphEntry, GraphKey, Step
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.process import WorkerProcess
from fd_cudagraph_plugin.core.ranks.agreement import Agreement, Participant, solo
from fd_cudagraph_plugin.core.ranks.messages import MAX_TEXT, SelfChecks, text
from fd_cudagraph_plugin.core.runtime import GraphRuntime
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.warmups import WarmedSizes

logger = logging.getLogger("fd_cudagraph_plugin")


def pool_policy(settings: Settings) -> str:
    """The policy for one backend: ``FD_CUDAGRAPH_POOL``, else FastDeploy's setting."""
    options = settings.options
    if options.pool_set or settings.use_unique_memory_pool:
        return options.pool
    logger.warning(
        "use_unique_memory_pool=false: every CUDA graph gets a private memory pool, so each "
        "pays for its own scratch memory, several times what one shared pool holds (see "
        "docs/design.md on graph memory). Unset it, or set FD_CUDAGRAPH_POOL=instance, to share "
        "one pool per backend."
    )
    return "graph"


class Registered(Participant, Protocol):
    """What the registration and the self-check do to a backend's graphs: ``publish`` one whose
    all-reduce buffers are registered (it may serve), ``check`` it (None, or what differs from
    eager), ``disable`` one any rank's self-check found wrong, ``discard`` one never registered."""

    def publish(self, entry: GraphEntry) -> None: ...

    def check(self, entry: GraphEntry, kwargs: dict) -> str | None: ...

    def disable(self, entry: GraphEntry) -> None: ...

    def discard(self, entry: GraphEntry) -> None: ...


class StepOwner(Registered, Protocol):
    """What capturing a step asks of its backend (``backend.CudaGraphBackend``): ``eager`` counts
    a step and runs it without a graph; ``rebuild`` makes a new graph table for a mode."""

    dispatcher: Dispatcher
    warmed: WarmedSizes
    runnable: Callable
    dy_runnable: Callable

    def replay(self, entry: GraphEntry, kwargs: dict) -> Any: ...

    def eager(self, step: Step, tokens: int, kwargs: dict) -> Any: ...

    def rebuild(self, mode: Mode) -> None: ...


class OpenSession(Protocol):
    """The capture session a step is captured in (``session.CaptureSession``): its points, its
    order rule, the warm-ups of a capture that begins, and the record of one made (True while
    the graph waits for the session's registration)."""

    agreement: Agreement
    ordered: bool

    def before_capture(self, member: StepOwner, key: GraphKey) -> int: ...

    def record(
        self, member: StepOwner, entry: GraphEntry, captured: Captured, kwargs: dict
    ) -> bool: ...


class Capturer:
    """Captures the entries of one backend, in the order every tensor-parallel rank follows."""

    def __init__(self, settings: Settings, runtime: GraphRuntime, worker: WorkerProcess) -> None:
        self.settings = settings
        self.runtime = runtime
        self.pool_policy = pool_policy(settings)
        #: Captures and replays Paddle-managed graphs, in modes that have them.
        self.static = StaticGraphDriver() if settings.mode.paddle_graphs else None
        #: Its process: the sessions that ended there, and where a failed dot file is counted.
        self._worker = worker
        #: The pool this backend captures into; taken at its first capture, given back on clear.
        self.pool: object | None = None
        self.captures = 0
        self._next = 0
        self._dot_unsupported_logged = False

    def rewind(self, held: int) -> None:
        """The next ordered decode capture is the plan's ``held``-th: the graphs after it were
        discarded."""
        self._next = min(self._next, held)

    def reset(self) -> None:
        """Forget the captures since the last clear (the caller released the graphs)."""
        if self.static is not None:
            self.static.forget()
        self._next = 0
        if self.pool is not None:
            self.runtime.release_pool(self.pool)
            self.pool = None

    def capture_step(
        self,
        owner: StepOwner,
        session: OpenSession | None,
        step: Step,
        entry: GraphEntry,
        tokens: int,
        kwargs: dict,
    ) -> Any:
        """Capture the graph that serves ``step`` on ``kwargs``, counted, and return the step's
        result. In ``session`` the graph serves once the session registered it; alone (TP = 1)
        it is registered and self-checked at once. Raises the agreed ``CaptureError``."""
        settings = self.settings
        if session is None:
            if self._worker.sessions_ended or settings.tp_size > 1:
                # A capture on this rank alone, outside FastDeploy's capture loop, would hang
                # tensor-parallel peers; after capture_model() every new size runs eagerly.
                return owner.eager(step.eager("late_capture"), tokens, kwargs)
            points = solo(self._worker)
            warmups, ordered = settings.num_warmups, True
        else:
            warmups = session.before_capture(owner, entry.key)
            points, ordered = session.agreement, session.ordered
        if entry.phase == DECODE and owner.mode.undecided:
            self._decide_static_decode(owner, kwargs, points)  # the decode entries are built anew
            step = owner.dispatcher.route(kwargs["forward_meta"], tokens)
            entry = owner.dispatcher.table.entry(step.key)
        captured = self._capture(owner, entry.key, kwargs, points, warmups, ordered)
        entry.fill(captured)
        owner.warmed.add(entry.key)
        if session is not None and session.record(owner, entry, captured, kwargs):
            # Its all-reduce buffers are registered with the session's others, at its end;
            # until then the step's result is the last warm-up's, run on the same inputs.
            owner.dispatcher.count(step.eager("unregistered"), tokens)
            if captured.eager is not NOTHING:
                return captured.eager
            return owner.dy_runnable(**kwargs)
        if session is None:
            try:  # TP = 1, outside any session: registered at once
                register(points, owner, entry.key)
            except CaptureError:
                owner.discard(entry)
                raise
        owner.publish(entry)
        if settings.options.self_check != "off" and not entry.key.static:
            error = settings.options.self_check == "error"
            check = (str(entry.key), owner, entry.key, lambda: owner.check(entry, kwargs))
            if self_checks(points, [check], error):
                owner.disable(entry)
                return owner.eager(step.eager("self_check_failed"), tokens, kwargs)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        owner.dispatcher.count(step.replay(), tokens)
        return owner.replay(entry, kwargs)

    def _decide_static_decode(self, owner: StepOwner, kwargs: dict, points: Agreement) -> None:
        """Static full mode: Paddle's graphs decode where the SOT-translated program is one clean
        static graph on every rank, else the plugin captures decode from the dygraph model."""

        def probe() -> str | None:
            verdict = static_probe(owner.runnable, kwargs)
            if verdict is None:
                self.runtime.mark_warm()  # it ran the model: no cold capture follows
            return None if verdict is None else text(verdict, 1000)

        verdicts = points.share("static probe", owner, None, probe, (str, type(None)))
        broken = [(rank, why) for rank, why in enumerate(verdicts) if why]
        owner.rebuild(owner.mode.decided(static=not broken))
        if broken:
            logger.warning(
                "CUDA graph backend %#x (%s), static full mode: the static program is not one "
                "clean graph (%s), so decode graphs are captured from the dygraph model on every "
                "rank instead, as in dynamic mode.",
                id(owner),
                owner.role,
                "; ".join(f"rank {rank}: {why}" for rank, why in broken),
            )

    def _capture(
        self,
        owner: StepOwner,
        key: GraphKey,
        kwargs: dict,
        agreement: Agreement,
        warmups: int,
        ordered: bool,
    ) -> Captured:
        """Warm up (``warmups`` eager runs) and capture ``key``. Raises the agreed
        ``CaptureError`` when this or any other rank failed; then nothing was captured.
        ``ordered``: hold decode captures to the plan's order (every capture but a probe's).
        The graph's all-reduce buffers are not registered yet (``seam.register_graph_buffers``)."""
        from fd_cudagraph_plugin.core import guards  # imports Paddle

        runnable = owner.runnable if key.static else owner.dy_runnable

        # Before the model runs: from 2.6 the attention backend may rebind forward_meta.rotary_embs
        # during the forward; a step is compared at its entry. Paddle-managed graphs read fixed
        # addresses too.
        addresses = guards.input_addresses(kwargs)
        if not self.runtime.warmed:
            # Capturing a cold model fails: libraries initialise lazily (cuBLAS raised
            # CUBLAS_STATUS_NOT_INITIALIZED when we tried), so the first capture follows one run.
            warmups = max(warmups, 1)

        done: dict[str, Any] = {}

        def warm_up() -> None:
            if key.phase == DECODE and ordered:
                self._check_order(owner.mode.decode_sizes, key.size)
            if self.pool is None and not key.static and self.pool_policy == "instance":
                self.pool = self.runtime.new_pool()
            for _ in range(warmups):
                done["eager"] = runnable(**kwargs)
                self.runtime.mark_warm()

        started = time.perf_counter()
        agreement.run("warm-up", owner, key, warm_up)
        allreduce = seam.custom_allreduce()

        def capture() -> None:
            # Measured around the capture alone: warm-ups may grow ordinary allocator memory. The
            # runtime synchronises before it begins the capture (after the warm-up point).
            before = self.runtime.pool_bytes(self.pool)
            with seam.allreduce_capturing(allreduce):
                if key.static:
                    self.static.capture(runnable, kwargs, key.size)
                    done["static"] = True
                else:
                    done["graph"], done["result"] = self.runtime.capture(
                        lambda: runnable(**kwargs), self.pool
                    )
            done["bytes"] = self.runtime.pool_bytes(self.pool) - before

        try:
            agreement.run("capture", owner, key, capture)
        except CaptureError:
            # Nothing of a failed capture survives, on any rank.
            graph = done.pop("graph", None)
            if graph is not None:
                graph.release()
            if done.pop("static", False):
                self.static.discard(key.size)
            done.clear()
            raise
        if key.phase == DECODE and ordered:
            self._next += 1
        self.captures += 1
        captured = Captured(
            key=key,
            graph=done.get("graph"),
            result=done.get("result"),
            graph_bytes=done["bytes"],
            seconds=time.perf_counter() - started,
            warmups=warmups,
            addresses=addresses,
            eager=done.get("eager", NOTHING),
        )
        logger.debug("captured %s graph in %.3f s", key, captured.seconds)
        if captured.graph is not None and self.settings.options.dump_dot:
            self._dump_dot(owner, captured)
        return captured

    def _check_order(self, plan: tuple[int, ...], size: int) -> None:
        """Every TP rank must capture the same sizes in the same order: each graph's buffer
        registration is a collective whose lists the ranks match by position."""
        if seam.is_xpu():
            return  # FastDeploy does not check it there either
        if self._next >= len(plan):
            raise CaptureOrderError(
                f"CUDA graph capture of size {size} after all {len(plan)} planned captures "
                f"({list(plan)}) were done. A capture outside capture_model() can hang "
                f"tensor-parallel ranks; check what calls the model with step_use_cudagraph=True "
                f"after capture."
            )
        expected = plan[self._next]
        if size != expected:
            raise CaptureOrderError(
                f"CUDA graph capture order: expected size {expected} (capture #{self._next} of "
                f"plan {list(plan)}), got {size}. FastDeploy's capture_model() captures largest "
                f"first; check that cudagraph_capture_sizes and the dummy-run batch sizes agree on "
                f"every rank."
            )

    def _dump_dot(self, owner: object, captured: Captured) -> None:
        written = False
        if self.runtime.real_graphs:  # else nothing to write: no directory either
            directory = os.path.join(outputs.log_dir(), "GraphDotFiles")
            key = captured.key
            path = os.path.join(directory, f"backend{id(owner):x}_{key.phase}{key.size}")
            try:
                os.makedirs(directory, exist_ok=True)
                written = self.runtime.dump_dot(captured.graph, path)
            except OSError as error:
                self._worker.outputs.failed("FD_CUDAGRAPH_DUMP_DOT", path, error)
                return
        if not written and not self._dot_unsupported_logged:
            self._dot_unsupported_logged = True
            logger.warning(
                "FD_CUDAGRAPH_DUMP_DOT=1: the %s runtime cannot write dot files.", self.runtime.name
            )


def register(agreement: Agreement, participant: Participant | None, key: GraphKey | None) -> None:
    """Register the all-reduce buffers of every graph captured since the last registration:
    FastDeploy's ``register_graph_buffers``, an ``all_gather_object`` over the TP group, entered
    only once every rank agreed each of those captures. Nothing to do without a custom
    all-reduce."""
    allreduce = seam.custom_allreduce()
    if allreduce is not None:
        register = seam.register_graph_buffers
        agreement.run("registration", participant, key, lambda: register(allreduce))


#: One self-check: the graph's label, its backend and key, and the check (None, or what differs).
Check = tuple[str, Participant, GraphKey, Callable[[], str | None]]


def self_checks(agreement: Agreement, checks: list[Check], error: bool) -> set[str]:
    """Every rank runs its ``checks`` (a replay of a new graph against eager on the same inputs)
    and acts on every rank's verdicts alike: raise (``error``) or return the labels of the
    graphs any rank found wrong, which every rank then serves eagerly. A check that raises is
    that rank's failure, posted as the graph's."""
    failed: dict[str, str] = {}
    raised: tuple[Participant, GraphKey, Exception] | None = None
    for label, participant, key, check in checks:
        try:
            verdict = check()
        except Exception as exception:
            raised = (participant, key, exception)
            break
        if verdict:
            failed[label] = text(verdict, MAX_TEXT)

    def run() -> SelfChecks:
        if raised is not None:
            raise raised[2]
        return SelfChecks(failed=failed)

    if raised is not None:
        participant, key = raised[:2]
    else:
        participant, key = checks[0][1:3] if len(checks) == 1 else (None, None)
    everyone = agreement.share("self-check", participant, key, run, SelfChecks)
    found = [
        (r, label, why) for r, mine in enumerate(everyone) for label, why in mine.failed.items()
    ]
    if not found:
        return set()
    world = len(everyone)
    said = "; ".join(
        f"{'' if world == 1 else f'rank {r}: '}CUDA graph self-check failed for {why}"
        for r, _, why in found
    )
    said += (  # said once, however many graphs failed: one post carries every graph's verdict
        ". An op in the model does not replay like it runs eagerly (host-side values, dynamic "
        "shapes, or an all-reduce outside the capture context)."
    )
    if error:
        message = said + " (FD_CUDAGRAPH_SELF_CHECK=error)"
        if world > 1:
            message += " Every tensor-parallel rank stops here."
        ranks = tuple(sorted({r for r, _, _ in found}))
        raise agreement.stop(SelfCheckError(message, stage="self-check", failed_ranks=ranks))
    labels = ", ".join(sorted({label for _, label, _ in found}))
    logger.warning("%s Every rank serves %s eagerly from now on.", said, labels)
    return {label for _, label, _ in found}
