"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. This class is that contract (``__init__``, ``__call__``,
``clear_graph``, ``check_capture_successful``); it composes:

* ``entries.py``: the graph entries, and ``served``, the table the hot path reads;
* ``dispatch.py``: the one place that decides a step's graph key;
* ``capture.py``: capturing one entry, with the ranks' agreement points of ``session.py``;
* ``counts.py``: served traffic and capture-time runs, counted apart.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import fastdeploy, hooks, stats, worker
from fd_cudagraph_plugin.core.capture import Capturer
from fd_cudagraph_plugin.core.counts import Counts
from fd_cudagraph_plugin.core.dispatch import Dispatcher
from fd_cudagraph_plugin.core.entries import Entries, GraphEntry
from fd_cudagraph_plugin.core.errors import CaptureIncompleteError, ConfigError
from fd_cudagraph_plugin.core.key import DECODE, PREFILL, RUNNING, Step
from fd_cudagraph_plugin.core.memory import pool_policy
from fd_cudagraph_plugin.core.runtime import GraphRuntime, get_runtime
from fd_cudagraph_plugin.core.session import CaptureReport, CaptureSession, Points, solo_points
from fd_cudagraph_plugin.core.settings import Settings

logger = logging.getLogger("fd_cudagraph_plugin")

#: SOT's verdicts that a model is not one clean static graph (FastDeploy's
#: ``apply_to_static_optimization`` raises them in its warm-up mode); nothing else means that.
_NOT_ONE_STATIC_GRAPH = ("Model has breakgraph", "Model has multiple generated code")


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
        # FastDeploy 2.4 hands over the (possibly static) runnable alone.
        self.settings = settings = Settings.from_fd_config(
            fd_config, fastdeploy_2_4=dy_runnable is None
        )
        self.dy_runnable = dy_runnable if dy_runnable is not None else runnable
        self.runnable = runnable if runnable is not None else dy_runnable
        #: The backbone layer this backend serves (how the session tells target from draft).
        self.layer = getattr(self.dy_runnable, "__self__", None)
        options = settings.options
        self.runtime = runtime if runtime is not None else get_runtime(options.runtime)
        self._static = None
        if settings.dy2st:
            from fd_cudagraph_plugin.core.static import StaticGraphDriver

            self._static = StaticGraphDriver()
        self.capturer = Capturer(settings, self.runtime, pool_policy(settings), self._static)
        #: Static full mode: do Paddle's graphs decode (True) or the plugin's (False)? Agreed by
        #: every rank at the first decode capture (``_decide_static_decode``); None until then.
        self.static_decode: bool | None = (
            True if settings.static_2_4 else None if settings.static_full else False
        )
        self.counts = Counts(settings)
        #: Steps run while a capture session is open: not served traffic.
        self.capture_counts = Counts(settings)
        self._by_running = settings.keyed_by_running
        self._guard_every = options.check_addresses
        self._guard_ticks = 0
        self._warned: set[tuple[str, int]] = set()
        self._saw_only_prefill_step = False
        self._build_entries()
        self._use_counts(self.counts)
        self.role = "target"
        self.capture_report: CaptureReport | None = None
        self._session: CaptureSession | None = None
        self._stats_file = None
        if options.stats_file:
            self._stats_file = stats.StatsFile(options.stats_file, settings)
        self.worker = worker.current()
        self.worker.add(self)
        stats.start_reporter(options)
        if options.metrics:
            from fd_cudagraph_plugin.core import metrics

            metrics.enable()
        hooks.install()
        if self.worker.session is not None:
            self.worker.session.join(self)
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

    def _build_entries(self) -> None:
        self.entries = Entries(self.settings, bool(self.static_decode), self.settings.dy2st)
        self.dispatcher = Dispatcher(self.settings, self.entries)
        self._served = self.entries.served
        self._keys = len(self._served)

    def _use_counts(self, counts: Counts) -> None:
        """Point the hot path's counters at ``counts`` (served, or capture-time)."""
        self._active = counts
        self._steps, self._tokens = counts.steps, counts.tokens

    # ------------------------------------------------------------------ the hot path

    def __call__(self, **kwargs: Any) -> Any:
        meta = kwargs["forward_meta"]
        tokens = meta.ids_remove_padding.shape[0]
        if self._by_running:
            return self._call_by_running(kwargs, meta, tokens)
        if tokens < self._keys:
            entry = self._served[tokens]
            if (
                entry is not None
                and not meta.exist_prefill
                and not (self._guard_every and self._guard_due())
            ):
                result = entry.result
                entry.replay()
                self._steps[tokens] += 1
                return result
        return self._general(kwargs, meta, tokens)

    def _call_by_running(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        """The hot path under speculative decoding: keyed by running requests; a step with more
        tokens than its graph's size goes to the general path."""
        running = meta.real_bsz
        if 0 < running < self._keys:
            entry = self._served[running]
            if (
                entry is not None
                and 0 < tokens <= entry.key.size  # real_bsz can be stale (overlap scheduling)
                and not meta.exist_prefill
                and not (self._guard_every and self._guard_due())
            ):
                result = entry.result
                entry.replay()
                self._steps[running] += 1
                self._tokens[running] += tokens
                return result
        return self._general(kwargs, meta, tokens)

    def _guard_due(self) -> bool:
        """True on every Nth servable call: it goes to the general path for the address check."""
        self._guard_ticks += 1
        if self._guard_ticks < self._guard_every:
            return False
        self._guard_ticks = 0
        return True

    # ------------------------------------------------------------------ the general path

    def _general(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        step = self.dispatcher.route(meta, tokens)
        if step.key is None:
            return self._eager(step.reason, tokens, kwargs, step.observed)
        if step.key.phase == PREFILL and self.settings.only_prefill:
            self._saw_only_prefill_step = True
        entry = self.entries.entry(step.key)
        if entry.disabled:
            return self._eager("self_check_failed", tokens, kwargs, step.observed)
        if entry.captured:
            return self._replay(entry, step, tokens, kwargs)
        if entry.size != tokens:
            # Graphs are captured at exact sizes only: FastDeploy's capture loop supplies them.
            return self._eager("not_captured", tokens, kwargs, step.observed)
        return self._capture_and_run(entry, step, tokens, kwargs)

    def _replay(self, entry: GraphEntry, step: Step, tokens: int, kwargs: dict) -> Any:
        if entry.addresses and self._guard_every:
            from fd_cudagraph_plugin.core import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        counts = self._active
        if entry.phase == PREFILL:
            counts.prefill_steps[tokens] += 1
        elif step.by == RUNNING:
            counts.steps[step.observed] += 1
            counts.tokens[step.observed] += tokens
        elif self._by_running:
            # Speculative decoding, served by token count: counted apart, under its requests.
            counts.by_tokens[tokens] += 1
            counts.other_keys[step.observed] += 1
        else:
            counts.steps[tokens] += 1
        if entry.graph is None:
            return self._static.replay(self.runnable, kwargs, entry.size)
        entry.replay()
        return entry.result

    def _eager(self, reason: str, tokens: int, kwargs: dict, observed: int | None = None) -> Any:
        """Run the step without a graph through ``dy_runnable``, as FastDeploy runs every step it
        does not graph. ``observed``: a decode step's key, counted as observed."""
        counts = self._active
        counts.fallbacks[reason] += 1
        if observed is not None:
            counts.other_keys[observed] += 1
        if reason != "prefill" and (reason, tokens) not in self._warned and self._session is None:
            self._warned.add((reason, tokens))
            prefill = reason == "oversized_prefill"
            sizes = self.settings.prefill_graph_sizes if prefill else self.settings.capture_sizes
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
            if self.worker.sessions_ended or self.settings.tp_size > 1:
                # A capture on this rank alone, outside FastDeploy's capture loop, would hang
                # tensor-parallel peers; after capture_model() every new size runs eagerly.
                return self._eager("late_capture", tokens, kwargs, step.observed)
            points = solo_points(self.settings.options)
        else:
            points = session.points
        if entry.phase == DECODE and self.settings.static_full and self.static_decode is None:
            self._decide_static_decode(kwargs, points)
            return self._general(kwargs, kwargs["forward_meta"], tokens)
        runnable = self.runnable if entry.key.static else self.dy_runnable
        self.capturer.capture(self, entry, runnable, kwargs, points, session)
        self.entries.publish(entry)
        if self.settings.options.self_check != "off" and not entry.key.static:
            disagreements = self.capturer.self_check(
                self, entry, lambda: self.dy_runnable(**kwargs), points
            )
            if disagreements:
                logger.warning(
                    "CUDA graph self-check failed: %s. Every rank serves %s eagerly from now on.",
                    "; ".join(disagreements),
                    entry.key,
                )
                entry.disabled = True
                self.entries.publish(entry)
                return self._eager("self_check_failed", tokens, kwargs, step.observed)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        return self._replay(entry, step, tokens, kwargs)

    def _decide_static_decode(self, kwargs: dict, points: Points) -> None:
        """Static full mode: Paddle's graphs decode where the SOT-translated program is one clean
        static graph on every rank, else the plugin captures decode from the dygraph model.

        FastDeploy hands its own backend dy_runnable for decode here, so it never runs this
        program; its ``apply_to_static_optimization`` raises "Model has breakgraph" or "Model has
        multiple generated code" for models SOT cannot translate whole, which serve fine eagerly.
        Only those two fall back; any other error (an out-of-memory) stops every rank."""

        def probe() -> str | None:
            try:
                self.runnable(**kwargs)
            except Exception as error:
                if any(text in str(error) for text in _NOT_ONE_STATIC_GRAPH):
                    return f"{type(error).__name__}: {error}"
                raise
            self.runtime.warmed = True  # it ran the model: no cold capture follows
            return None

        verdicts = points.share("static probe", self, None, probe)
        broken = [(rank, why) for rank, why in enumerate(verdicts) if why]
        self.static_decode = not broken
        self._build_entries()
        if broken:
            logger.warning(
                "CUDA graph backend %#x (%s), static full mode: the static program is not one "
                "clean graph (%s), so decode graphs are captured from the dygraph model on every "
                "rank instead, as in dynamic mode.",
                id(self),
                self.role,
                "; ".join(f"rank {rank}: {why}" for rank, why in broken),
            )

    # ------------------------------------------------------------------ sessions

    def join_session(self, session: CaptureSession | None) -> None:
        """A session opened for this backend (its steps count as capture-time), or closed."""
        self._session = session
        self._use_counts(self.capture_counts if session is not None else self.counts)

    def plan_fingerprint(self) -> dict[str, Any]:
        s = self.settings
        return {
            "capture_sizes": list(s.capture_sizes),
            "prefill_sizes": list(s.prefill_graph_sizes),
            "mode": s.mode,
            "only_prefill": s.only_prefill,
            "warmups": s.num_warmups,
            "speculative_method": s.speculative_method,
            "num_speculative_tokens": s.num_speculative_tokens,
            "bsz_table": list(s.bsz_table),
        }

    def graphs_expected(self, phase: str) -> int:
        return sum(1 for e in self.expected_entries() if e.phase == phase)

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
        others = [b for b in self.worker.backends() if b is not self]
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
        fastdeploy.clear_ipc_handles()
        for backend in (self, *others):
            backend.flush_stats()  # after the release: a failing write must not keep graphs
        logger.debug("clear_graph released %d graphs", released)

    def release_graphs(self) -> int:
        """Drop this backend's graphs and capture state; return how many were captured."""
        stats.log_summary("clear_graph", [self])
        entries = self.entries.all()
        captured = sum(1 for e in entries if e.captured)
        if self.settings.static_full:
            self.static_decode = None
        self._build_entries()
        for entry in entries:
            entry.release()
        if self._static is not None:
            self._static.forget()
        self.capturer.reset()
        return captured

    def expected_entries(self) -> list[GraphEntry]:
        """The entries this mode captures: what ``check_capture_successful`` requires."""
        settings = self.settings
        if settings.only_prefill and not (settings.static_split or settings.fastdeploy_2_4):
            # From 2.5 GraphOptBackend routes prefill steps to the backend only in static split
            # mode, so without it this mode captures nothing (2.4 routes them).
            return list(self.entries.prefill.values()) if self._saw_only_prefill_step else []
        return self.entries.all()

    def check_capture_successful(self) -> None:
        """Raise if a size that this mode captures has no graph yet."""
        missing = [str(e.key) for e in self.expected_entries() if not e.captured]
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
        return self.counts.observed()

    def flush_stats(self) -> None:
        if self._stats_file is not None:
            self._stats_file.flush(self)

    def _memory_figures(self) -> dict[str, Any]:
        """This rank's device memory after the last capture session, and the reserve taken."""
        from fd_cudagraph_plugin.core import budget

        reserve = self.worker.kv_reserve
        figures: dict[str, Any] = {"kv_reserve_bytes": reserve.nbytes if reserve else None}
        report = self.capture_report
        mine = [m for m in (report.memory if report else []) if m.rank == report.rank]
        if mine and mine[0].total:
            m = mine[0]
            figures["free_after_capture_bytes"] = m.free
            if m.utilization is not None:
                figures["fit_gpu_memory_utilization"] = budget.fit_utilization(
                    m.utilization, m.free, m.total
                )
        return figures

    def stats(self) -> dict[str, Any]:
        """Counters since construction (they survive ``clear_graph``), as plain data: served
        traffic, and apart from it what ran while FastDeploy captured."""
        captured = [e for e in self.entries.all() if e.captured]
        decode = [e for e in captured if e.phase == DECODE]
        capture_time = self.capture_counts.summary()
        return {
            "captures": self.captures,
            **self.counts.summary(),
            "capture_time": {
                "replays": capture_time["replays"],
                "prefill_replays": capture_time["prefill_replays"],
                "eager_steps": capture_time["eager_fallbacks"],
            },
            "capture_seconds": {e.size: e.capture_seconds for e in decode},
            "graph_bytes": {e.size: e.graph_bytes for e in decode},
            "graph_bytes_total": sum(e.graph_bytes for e in captured),
            "largest_graph_bytes": max((e.graph_bytes for e in captured), default=0),
            "pool_policy": self.capturer.pool_policy,
            "memory": self._memory_figures(),
            "static_full_decode": (
                None
                if self.static_decode is None
                else "static"
                if self.static_decode
                else "dynamic"
            )
            if self.settings.static_full
            else None,
        }
