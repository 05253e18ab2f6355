"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``: FastDeploy's contract.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. This class is that contract (``__init__``, ``__call__``,
``clear_graph``, ``check_capture_successful``, ``stats()``) and composes:

* ``mode.py``: the execution mode, which answers every mode question;
* ``graphs.py``: the graph table;
* ``dispatch.py``: the one place that decides a step's graph and counts every step, and the fast
  path serving it;
* ``capture.py``: capturing one entry, with the ranks' agreement points (``ranks/``);
* ``dy2st.py``: Paddle-managed graphs, and SOT's verdict on the model (static full mode).

What a capture session asks of a backend is ``session.SessionBackend``, what the lifecycle asks
``lifecycle.LifecycleBackend``; the rest of a worker's process (the reporter, metrics, the
capture-loop and lifecycle hooks, the check of a graph's first replay after a lifecycle call) is
``hooks.adopt``'s.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fd_cudagraph_plugin.core import hooks, observability, process, seam
from fd_cudagraph_plugin.core.capture import Capturer, register, self_checks
from fd_cudagraph_plugin.core.dispatch import CAPTURE, REPLAY, VERIFY, Dispatcher
from fd_cudagraph_plugin.core.dy2st import StaticGraphDriver, static_probe
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureIncompleteError, ConfigError
from fd_cudagraph_plugin.core.graphs import DECODE, NOTHING, GraphEntry, GraphTable, Step
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.ranks.agreement import Agreement, release_held, solo
from fd_cudagraph_plugin.core.ranks.messages import text
from fd_cudagraph_plugin.core.runtime import GraphRuntime, get_runtime
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.warmups import WarmedSizes

if TYPE_CHECKING:
    from fd_cudagraph_plugin.core.session import CaptureReport, CaptureSession

logger = logging.getLogger("fd_cudagraph_plugin")


class CudaGraphBackend:
    """Capture and replay CUDA graphs for one decorated FastDeploy backbone.

    Accepts FastDeploy 2.5+/develop ``(fd_config, dy_runnable, runnable)`` and 2.4
    ``(fd_config, runnable)``, by keyword. ``runtime`` is for tests and tools; FastDeploy never
    passes it, and the runtime then comes from ``FD_CUDAGRAPH_RUNTIME``.
    """

    def __init__(
        self,
        fd_config: Any,
        dy_runnable: Callable | None = None,
        runnable: Callable | None = None,
        *,
        runtime: GraphRuntime | None = None,
    ) -> None:
        if runnable is None and dy_runnable is None:
            raise ConfigError(
                "CudaGraphBackend needs runnable= (and dy_runnable= on FastDeploy 2.5+)."
            )
        self.fd_config = fd_config
        #: The worker process this backend serves in: its options, its other backends.
        self._worker = worker = process.current()
        # FastDeploy 2.4 hands over the (possibly static) runnable alone.
        self.settings = settings = Settings.from_fd_config(
            fd_config, worker.options, fastdeploy_2_4=dy_runnable is None
        )
        self.dy_runnable = dy_runnable if dy_runnable is not None else runnable
        self.runnable = runnable if runnable is not None else dy_runnable
        #: The backbone layer this backend serves (how the session tells target from draft).
        self.layer = getattr(self.dy_runnable, "__self__", None)
        self.runtime = runtime if runtime is not None else get_runtime(settings.options.runtime)
        #: The mode as decided so far: in static full mode the ranks agree at the first decode
        #: capture who captures decode (``_decide_static_decode``).
        self.mode = settings.mode
        self._static = StaticGraphDriver() if self.mode.paddle_graphs else None
        self._outputs = worker.outputs
        self.capturer = Capturer(settings, self.runtime, self._static, self._outputs)
        self.table = GraphTable(self.mode)
        self.dispatcher = Dispatcher(
            self.mode, self.table, settings.options.check_addresses, self._general
        )
        self.warmed = WarmedSizes()
        self.role = "target"
        #: The capture session open now, if this backend takes part in one.
        self._session: CaptureSession | None = None
        #: The report of the last capture session this backend took part in.
        self.capture_report: CaptureReport | None = None
        self._warned: set[tuple[str, int]] = set()
        self._stats_file = observability.stats_file(settings, self._outputs)
        if settings.padding_disagreements:
            tokens, theirs, ours = settings.padding_disagreements[0]
            logger.warning(
                "FastDeploy's real_shape_to_captured_size disagrees with cudagraph_capture_sizes "
                "at %d token counts (e.g. %d tokens -> %d there, %d here). This is expected "
                "after filter_capture_size; the plugin pads from the size list itself.",
                len(settings.padding_disagreements),
                tokens,
                theirs,
                ours,
            )
        #: The check of each graph's first replay after a lifecycle call (``lifecycle.py``).
        self._first_replay = hooks.adopt(self)

    # ------------------------------------------------------------------ the hot path

    def __call__(self, **kwargs: Any) -> Any:
        return self.dispatcher.serve(kwargs)

    # ------------------------------------------------------------------ the general path

    def _general(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        step, entry = self.dispatcher.decide(meta, tokens)
        if step.action == CAPTURE:
            return self._capture_and_run(entry, step, tokens, kwargs)
        verifying = step.action == VERIFY
        if verifying:
            verified = self._first_replay(self, entry, kwargs)
            step = step.replay() if verified else step.eager("memory_moved")
        self.dispatcher.count(step, tokens)
        if step.action == REPLAY:
            out = self._replay(entry, kwargs)
        else:
            out = self._eager(step, tokens, kwargs)
        if verifying:
            release_held()  # held at the first replay's point: raised once this step ran
        return out

    def _replay(self, entry: GraphEntry, kwargs: dict) -> Any:
        if entry.addresses and self.settings.options.check_addresses:
            from fd_cudagraph_plugin.core import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        if entry.graph is None:
            return self._static.replay(self.runnable, kwargs, entry.size)
        entry.replay()
        return entry.result

    def _eager(self, step: Step, tokens: int, kwargs: dict) -> Any:
        """Run the step without a graph through ``dy_runnable``, as FastDeploy runs every step it
        does not graph (the dispatcher counted it), with one warning per reason and shape."""
        reason = step.reason
        quiet = reason in ("prefill", "memory_moved", "unregistered")  # said once elsewhere
        if not quiet and (reason, tokens) not in self._warned and self._session is None:
            self._warned.add((reason, tokens))
            prefill = reason == "oversized_prefill"
            sizes = self.mode.prefill_sizes if prefill else self.settings.capture_sizes
            logger.warning(
                "CUDA graph backend %#x (%s): %d tokens ran without a graph (%s); the largest "
                "captured %s size is %d. Further steps of this shape are counted in stats() "
                "without another warning.",
                id(self),
                self.role,
                tokens,
                reason.replace("_", " "),
                "prefill" if prefill else "decode",
                max(sizes, default=0),
            )
        return self.dy_runnable(**kwargs)

    # ------------------------------------------------------------------ capture

    def _capture_and_run(self, entry: GraphEntry, step: Step, tokens: int, kwargs: dict) -> Any:
        session = self._session
        if session is None:
            if self._worker.sessions_ended or self.settings.tp_size > 1:
                # A capture on this rank alone, outside FastDeploy's capture loop, would hang
                # tensor-parallel peers; after capture_model() every new size runs eagerly.
                return self._eager_now(step.eager("late_capture"), tokens, kwargs)
            points = solo(self.settings.options.rank_timeout)
            warmups, ordered = self.settings.num_warmups, True
        else:
            session.before_capture(self)
            points = session.agreement
            warmups, ordered = session.warmups_for(self, entry.key), session.ordered
        if entry.phase == DECODE and self.mode.undecided:
            self._decide_static_decode(kwargs, points)  # the decode entries are built anew
            step = self.dispatcher.route(kwargs["forward_meta"], tokens)
            entry = self.table.entry(step.key)
        runnable = self.runnable if entry.key.static else self.dy_runnable
        captured = self.capturer.capture(
            self, entry.key, runnable, kwargs, points, warmups=warmups, ordered=ordered
        )
        entry.fill(captured)
        self.warmed.add(entry.key)
        if session is not None:
            session.record(
                self, entry.key, captured.seconds, captured.graph_bytes, captured.warmups
            )
            if session.registers:
                # Its all-reduce buffers are registered with the session's others, at its end;
                # until then the step's result is the last warm-up's, run on the same inputs.
                session.unregistered(self, entry, kwargs)
                self.dispatcher.count(step.eager("unregistered"), tokens)
                if captured.eager is not NOTHING:
                    return captured.eager
                return self.dy_runnable(**kwargs)
        else:
            try:  # TP = 1, outside any session: registered at once
                register(points, self, entry.key)
            except CaptureError:
                self.discard(entry)
                raise
        self.publish(entry)
        if self.settings.options.self_check != "off" and not entry.key.static:
            error = self.settings.options.self_check == "error"
            check = (str(entry.key), self, entry.key, lambda: self.check(entry, kwargs))
            if self_checks(points, [check], error):
                self.disable(entry)
                return self._eager_now(step.eager("self_check_failed"), tokens, kwargs)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        self.dispatcher.count(step.replay(), tokens)
        return self._replay(entry, kwargs)

    def publish(self, entry: GraphEntry) -> None:
        """``entry``'s all-reduce buffers are registered: it may serve."""
        entry.registered = True
        self.dispatcher.publish(entry)

    def check(self, entry: GraphEntry, kwargs: dict) -> str | None:
        """The self-check of a registered graph: its replay against eager on the same inputs."""
        from fd_cudagraph_plugin.core import guards

        return guards.self_check(entry, lambda: self.dy_runnable(**kwargs))

    def disable(self, entry: GraphEntry) -> None:
        """Every rank's self-check agreed ``entry`` is wrong: its size runs eagerly."""
        self.table.disable(entry)
        self.dispatcher.publish(entry)

    def discard(self, entry: GraphEntry) -> None:
        """The session that captured ``entry`` failed before registering it: it never serves."""
        entry.release()
        self.dispatcher.publish(entry)

    def _eager_now(self, step: Step, tokens: int, kwargs: dict) -> Any:
        self.dispatcher.count(step, tokens)
        return self._eager(step, tokens, kwargs)

    def _decide_static_decode(self, kwargs: dict, points: Agreement) -> None:
        """Static full mode: Paddle's graphs decode where the SOT-translated program is one clean
        static graph on every rank, else the plugin captures decode from the dygraph model."""

        def probe() -> str | None:
            verdict = static_probe(self.runnable, kwargs)
            if verdict is None:
                self.runtime.mark_warm()  # it ran the model: no cold capture follows
            return None if verdict is None else text(verdict, 1000)

        verdicts = points.share("static probe", self, None, probe, (str, type(None)))
        broken = [(rank, why) for rank, why in enumerate(verdicts) if why]
        self._rebuild(self.mode.decided(static=not broken))
        if broken:
            logger.warning(
                "CUDA graph backend %#x (%s), static full mode: the static program is not one "
                "clean graph (%s), so decode graphs are captured from the dygraph model on every "
                "rank instead, as in dynamic mode.",
                id(self),
                self.role,
                "; ".join(f"rank {rank}: {why}" for rank, why in broken),
            )

    def _rebuild(self, mode: Mode) -> None:
        """A new graph table for ``mode``; the dispatcher keeps its counters."""
        self.mode = mode
        self.table = GraphTable(mode)
        self.dispatcher.rebuild(mode, self.table)

    # ------------------------------------------------------------------ sessions

    def expected(self) -> list[GraphEntry]:
        """The entries this mode captures: what ``check_capture_successful`` requires."""
        return self.table.expected(self.dispatcher.saw_prefill_step)

    def session_opened(self, session: CaptureSession, role: str | None) -> None:
        """A session opened for this backend: its steps count as capture-time."""
        self._session = session
        if role is not None:
            self.role = role
        self.dispatcher.in_session(True)

    def session_closed(self, report: CaptureReport | None) -> None:
        self._session = None
        if report is not None:
            self.capture_report = report
        else:
            # The failed session's graphs were discarded: the next session captures in the plan's
            # order from the graphs still held (an interrupted recapture left the order midway).
            held = sum(1 for e in self.table.decode.values() if e.captured)
            self.capturer.rewind(held)
        self.dispatcher.in_session(False)

    # ------------------------------------------------------------------ what the lifecycle asks

    def has_graphs(self, prefill: bool = False) -> bool:
        """A graph is captured (of the prefill phase, with ``prefill``)."""
        entries = self.table.prefill.values() if prefill else self.table.all()
        return any(e.captured for e in entries)

    def input_addresses(self) -> list[tuple[str, int]]:
        """(name, data pointer) of the inputs its graphs were captured reading."""
        return [address for entry in self.table.all() for address in entry.addresses]

    # ------------------------------------------------------------------ lifecycle

    def clear_graph(self) -> None:
        """Release every graph of the process's backends, so the next ``capture_model()``
        captures all of them again, in the same order on every rank.

        FastDeploy calls this on the target for an RL weight update and for ``/v1/sleep``.
        Clearing closes every custom all-reduce IPC handle of the process and (2.5+) rewinds the
        registration slots, and a wake-up recreates the MTP draft's input tensors; FastDeploy
        clears only the target there, so the draft's graphs would replay stale slots and old
        addresses. They are released here too. Clearing twice, or before any capture, is
        harmless.
        """
        others = [b for b in self._worker.backends() if b is not self]
        released = self.release_graphs()
        for other in others:
            count = other.release_graphs()
            if count:
                logger.info(
                    "clear_graph of CUDA graph backend %#x (%s) also released the %d graphs of "
                    "backend %#x (%s): the clear resets the process's custom all-reduce "
                    "registrations, and a wake-up recreates its inputs. The next capture_model() "
                    "captures them again.",
                    id(self),
                    self.role,
                    count,
                    id(other),
                    other.role,
                )
        self.runtime.empty_cache()
        seam.clear_ipc_handles()
        for backend in (self, *others):
            backend.flush_stats()  # after the release: a failing write must not keep graphs
        logger.debug("clear_graph released %d graphs", released)

    def release_graphs(self) -> int:
        """Drop this backend's graphs and capture state; return how many were captured."""
        observability.log_summary("clear_graph", [self])
        entries = self.table.all()
        captured = sum(1 for e in entries if e.captured)
        self._rebuild(self.settings.mode)  # static full decides again at the next capture
        for entry in entries:
            entry.release()
        if self._static is not None:
            self._static.forget()
        self.capturer.reset()
        return captured

    def check_capture_successful(self) -> None:
        """Raise if a size that this mode captures has no graph yet."""
        missing = [str(e.key) for e in self.expected() if not e.captured]
        if missing:
            raise CaptureIncompleteError(
                f"CUDA graph backend {id(self):#x}: no graph for {', '.join(missing)}. Run "
                f"capture_model() (and capture_model_prefill_and_mixed() in static split mode) "
                f"before serving."
            )

    # ------------------------------------------------------------------ stats

    @property
    def cudagraph_capture_sizes(self) -> list[int]:
        return list(self.settings.capture_sizes)

    @property
    def captures(self) -> int:
        return self.capturer.captures

    def observed_keys(self) -> dict[int, int]:
        """Served decode steps per token count, or per running requests under speculative
        decoding, since construction: what ``fd-cudagraph tune`` reads."""
        return self.dispatcher.served_counts.observed()

    def observed_above(self) -> dict[int, int]:
        """Of ``observed_keys``, the decode steps above the largest graph (run eagerly)."""
        return dict(self.dispatcher.served_counts.above)

    def flush_stats(self) -> None:
        if self._stats_file is not None:
            self._stats_file.flush(self)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (they survive ``clear_graph``), as plain data: served
        traffic, and apart from it what ran while FastDeploy captured."""
        return observability.backend_stats(
            self.dispatcher,
            self.table,
            self.mode,
            self.captures,
            self.capturer.pool_policy,
            self.capture_report,
        )
