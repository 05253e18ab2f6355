"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``: FastDeploy's contract.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. This class is that contract (``__init__``, ``__call__``,
``clear_graph``, ``check_capture_successful``) and the part a capture session asks of it; it
composes:

* ``entries.py``: the graph entries;
* ``dispatch.py``: the one place that decides a step's graph, and the fast path serving it;
* ``capture.py``: capturing one entry, with the ranks' agreement points of ``agreement.py``;
* ``counts.py``: served traffic and capture-time runs, counted apart, and ``stats()``;
* ``warmups.py``: which sizes this backend has warmed.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import agreement, hooks, process, seam, stats
from fd_cudagraph_plugin.core.capture import Capturer
from fd_cudagraph_plugin.core.counts import BackendStats, Counts
from fd_cudagraph_plugin.core.dispatch import Dispatcher
from fd_cudagraph_plugin.core.entries import Entries, GraphEntry
from fd_cudagraph_plugin.core.errors import CaptureIncompleteError, ConfigError
from fd_cudagraph_plugin.core.key import DECODE, PREFILL, RUNNING, Step
from fd_cudagraph_plugin.core.memory import pool_policy
from fd_cudagraph_plugin.core.messages import VERDICT, Unwarmed, text
from fd_cudagraph_plugin.core.report import CaptureReport
from fd_cudagraph_plugin.core.runtime import GraphRuntime, get_runtime
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.warmups import WarmedSizes

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
        self.process = process.current()
        options = settings.options
        self.runtime = runtime if runtime is not None else get_runtime(options.runtime)
        self._static = None
        if settings.dy2st:
            from fd_cudagraph_plugin.core.dy2st import StaticGraphDriver

            self._static = StaticGraphDriver()
        self.capturer = Capturer(
            settings, self.runtime, pool_policy(settings), self._static, self.process.outputs
        )
        #: Who captures decode graphs: Paddle inside its static program (True) or the plugin from
        #: the dygraph model (False). Known from the mode except in static full mode, where every
        #: rank agrees it at the first decode capture (``_decide_static_decode``): None until then.
        self.static_decode: bool | None = (
            True if settings.static_2_4 else None if settings.static_full else False
        )
        self.tally = BackendStats(settings)
        self.warmed = WarmedSizes()
        self.role = "target"
        self._session: Any = None
        self._warned: set[tuple[str, int]] = set()
        self._saw_only_prefill_step = False
        self._build_entries()
        self._stats_file = None
        if options.stats_file:
            self._stats_file = stats.StatsFile(options.stats_file, settings, self.process.outputs)
        self.process.add(self)
        stats.start_reporter(options)
        if options.metrics:
            from fd_cudagraph_plugin.core import metrics

            metrics.enable()
        hooks.install()
        if self.process.session is not None:
            self.process.session.join(self)
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

    # ------------------------------------------------------------------ the hot path

    def __call__(self, **kwargs: Any) -> Any:
        return self._serve(kwargs)

    def _build_entries(self) -> None:
        self.entries = Entries(self.settings, bool(self.static_decode), self.settings.dy2st)
        self.dispatcher = Dispatcher(self.settings, self.entries)
        self._rewire()

    def _counting(self) -> Counts:
        """The counters of this moment: a session's steps are not served traffic."""
        return self.tally.during_capture if self._session is not None else self.tally.served

    def _rewire(self) -> None:
        """Point the hot path at the dispatcher's table and this moment's counters. The one
        place ``_serve`` is set: after the entries are rebuilt and when a session opens or
        closes."""
        counts = self._counting()
        self._serve = self.dispatcher.fast_path(
            counts.steps, counts.tokens, self.settings.options.check_addresses, self._general
        )

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
        if entry.addresses and self.settings.options.check_addresses:
            from fd_cudagraph_plugin.core import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        counts = self._counting()
        if entry.phase == PREFILL:
            counts.prefill_steps[tokens] += 1
        elif step.by == RUNNING:
            counts.steps[step.observed] += 1
            counts.tokens[step.observed] += tokens
        elif self.settings.keyed_by_running:
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
        counts = self._counting()
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
            if self.process.sessions_ended or self.settings.tp_size > 1:
                # A capture on this rank alone, outside FastDeploy's capture loop, would hang
                # tensor-parallel peers; after capture_model() every new size runs eagerly.
                return self._eager("late_capture", tokens, kwargs, step.observed)
            points = agreement.solo(self.settings.options.rank_timeout)
            warmups, ordered = self.settings.num_warmups, True
        else:
            session.before_capture(self)
            points = session.agreement
            warmups, ordered = session.warmups_for(self, entry.key), session.ordered
        if entry.phase == DECODE and self.settings.static_full and self.static_decode is None:
            self._decide_static_decode(kwargs, points)  # the decode entries are built anew
            step = self.dispatcher.route(kwargs["forward_meta"], tokens)
            entry = self.entries.entry(step.key)
        runnable = self.runnable if entry.key.static else self.dy_runnable
        captured = self.capturer.capture(
            self, entry.key, runnable, kwargs, points, warmups=warmups, ordered=ordered
        )
        entry.fill(captured)
        self.dispatcher.publish(entry)
        self.warmed.add(entry.key)
        if session is not None:
            session.record(
                self, entry.key, captured.seconds, captured.graph_bytes, captured.warmups
            )
        if self.settings.options.self_check != "off" and not entry.key.static:
            from fd_cudagraph_plugin.core import guards

            disagreements = self.capturer.self_check(
                self,
                entry.key,
                lambda: guards.self_check(entry, lambda: self.dy_runnable(**kwargs)),
                points,
            )
            if disagreements:
                logger.warning(
                    "CUDA graph self-check failed: %s. Every rank serves %s eagerly from now on.",
                    "; ".join(disagreements),
                    entry.key,
                )
                entry.disabled = True
                self.dispatcher.publish(entry)
                return self._eager("self_check_failed", tokens, kwargs, step.observed)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        return self._replay(entry, step, tokens, kwargs)

    def _decide_static_decode(self, kwargs: dict, points: agreement.Agreement) -> None:
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
                    return text(f"{type(error).__name__}: {error}", 1000)
                raise
            self.runtime.warmed = True  # it ran the model: no cold capture follows
            return None

        verdicts = points.share("static probe", self, None, probe, VERDICT)
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

    def join_session(self, session: Any, role: str | None) -> None:
        """A session opened for this backend: its steps count as capture-time."""
        self._session = session
        if role is not None:
            self.role = role
        self._rewire()

    def leave_session(self, report: CaptureReport | None) -> None:
        self._session = None
        if report is not None:
            self.tally.last_report = report
        self._rewire()

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

    def unwarmed(self) -> Unwarmed:
        return self.warmed.missing(e.key for e in self.expected_entries())

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
        others = [b for b in self.process.backends() if b is not self]
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
    def capture_report(self) -> CaptureReport | None:
        """The report of the last capture session this backend took part in."""
        return self.tally.last_report

    @property
    def cudagraph_capture_sizes(self) -> list[int]:
        return list(self.settings.capture_sizes)

    @property
    def captures(self) -> int:
        return self.capturer.captures

    def observed_keys(self) -> dict[int, int]:
        """Served decode steps per token count, or per running requests under speculative
        decoding, since construction: what ``fd-cudagraph tune`` reads."""
        return self.tally.served.observed()

    def flush_stats(self) -> None:
        if self._stats_file is not None:
            self._stats_file.flush(self)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (they survive ``clear_graph``), as plain data: served
        traffic, and apart from it what ran while FastDeploy captured."""
        reserve = self.process.reserve
        applied = reserve.applied if reserve is not None else None
        static = None
        if self.settings.static_full and self.static_decode is not None:
            static = "static" if self.static_decode else "dynamic"
        return self.tally.summary(
            self.entries.all(),
            self.captures,
            self.capturer.pool_policy,
            static,
            applied.nbytes if applied is not None else None,
        )
