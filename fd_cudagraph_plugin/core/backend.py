"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``: FastDeploy's contract.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. This class is that contract (``__init__``, ``__call__``,
``clear_graph``, ``check_capture_successful``, ``stats()``), composed of small parts: the mode,
the graph table, the dispatcher (which decides and counts every step, and serves the fast path),
the capture of a step (``capture.py``), and the process's ``lifecycle.Lifecycle``, handed to it
at construction, which checks a graph's first replay after a lifecycle call and releases every
graph of the process. What a session and the lifecycle ask of a backend are
``session.SessionBackend`` and ``lifecycle.LifecycleBackend``.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fd_cudagraph_plugin.core import hooks, lifecycle, observability, process
from fd_cudagraph_plugin.core.capture import Capturer
from fd_cudagraph_plugin.core.dispatch import CAPTURE, REPLAY, VERIFY, Dispatcher
from fd_cudagraph_plugin.core.errors import CaptureIncompleteError, ConfigError
from fd_cudagraph_plugin.core.graphs import GraphEntry, GraphTable, Step
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.ranks.agreement import release_held
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
        #: capture who captures decode (``capture.py``).
        self.mode = settings.mode
        self.capturer = Capturer(settings, self.runtime, worker)
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
        #: Served decode steps per key when its last capture session ended.
        self._observed_at_capture: dict[int, int] = {}
        path = settings.options.stats_file
        self._stats_file = observability.StatsFile(path, settings, worker.outputs) if path else None
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
        #: The process's lifecycle: it checks each graph's first replay after a lifecycle call,
        #: and releases every graph of the process at ``clear_graph``.
        self._lifecycle = lifecycle.state(worker)
        hooks.adopt(worker, self)

    # ------------------------------------------------------------------ the hot path

    def __call__(self, **kwargs: Any) -> Any:
        return self.dispatcher.serve(kwargs)

    # ------------------------------------------------------------------ the general path

    def _general(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        step, entry = self.dispatcher.decide(meta, tokens)
        if step.action == CAPTURE:
            return self.capturer.capture_step(self, self._session, step, entry, tokens, kwargs)
        verifying = step.action == VERIFY
        if verifying:
            verified = self._lifecycle.first_replay(self, entry, kwargs)
            step = step.replay() if verified else step.eager("memory_moved")
        if step.action == REPLAY:
            self.dispatcher.count(step, tokens)
            out = self.replay(entry, kwargs)
        else:
            out = self.eager(step, tokens, kwargs)
        if verifying:
            release_held(self._worker)  # held at the first replay's point: raised now
        return out

    def replay(self, entry: GraphEntry, kwargs: dict) -> Any:
        if entry.addresses and self.settings.options.check_addresses:
            from fd_cudagraph_plugin.core import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        if entry.graph is None:
            return self.capturer.static.replay(self.runnable, kwargs, entry.size)
        entry.replay()
        return entry.result

    def eager(self, step: Step, tokens: int, kwargs: dict) -> Any:
        """Count the step and run it without a graph through ``dy_runnable``, as FastDeploy runs
        every step it does not graph, with one warning per reason and shape."""
        self.dispatcher.count(step, tokens)
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

    # ------------------------------------------------------------------ what a capture asks

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

    def rebuild(self, mode: Mode) -> None:
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
            self._observed_at_capture = self.observed_keys()
        else:
            # The failed session's graphs were discarded: the next session captures in the plan's
            # order from the graphs still held (an interrupted recapture left the order midway).
            held = sum(1 for e in self.table.decode.values() if e.captured)
            self.capturer.rewind(held)
        self.dispatcher.in_session(False)

    def traffic_since_capture(self) -> dict[int, int]:
        """Decode steps served per key since its last capture session ended."""
        before = self._observed_at_capture
        now = self.observed_keys()
        return {key: n - before.get(key, 0) for key, n in now.items() if n > before.get(key, 0)}

    def recorded_traffic(self) -> dict[int, int]:
        """What ``FD_CUDAGRAPH_STATS_FILE`` recorded of this plan's traffic at earlier starts."""
        if self._stats_file is None:
            return {}
        return observability.recorded_traffic(self._stats_file.path, self.settings, self.role)

    def adopt_sizes(self, sizes: tuple[int, ...] | None) -> None:
        """Capture and serve only ``sizes`` of its decode sizes (a fit to traffic) until its
        graphs are released: a step pads to the next size kept. None: all of them."""
        mode = self.settings.mode.fitted(sizes) if sizes else self.settings.mode
        if mode != self.mode:
            self.rebuild(mode)

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
        captures all of them again, in the same order on every rank (``Lifecycle`` says why all).
        FastDeploy calls this on the target for an RL weight update and for ``/v1/sleep``."""
        self._lifecycle.release_every_graph(self)

    def release_graphs(self) -> int:
        """Drop this backend's graphs and capture state; return how many were captured."""
        observability.log_summary("clear_graph", [self], self._worker.outputs)
        entries = self.table.all()
        captured = sum(1 for e in entries if e.captured)
        self.rebuild(self.settings.mode)  # static full decides again at the next capture
        for entry in entries:
            entry.release()
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
