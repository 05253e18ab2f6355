"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. This class is that contract; it composes:

* ``entries.py``: the per-size entries, the tables that pick one for a step, the counters;
* ``dispatch.py``: the replay hot path and the general path (inherited: ``__call__``);
* ``capture.py``: capturing one entry;
* ``session.py``: the capture sessions around FastDeploy's capture loops.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import allreduce, hooks, session, stats
from fd_cudagraph_plugin.core.capture import Capturer, mark_warmed
from fd_cudagraph_plugin.core.dispatch import Dispatch
from fd_cudagraph_plugin.core.entries import DECODE, PREFILL, Counts, GraphEntry, Tables
from fd_cudagraph_plugin.core.errors import CaptureIncompleteError, ConfigError, SelfCheckError
from fd_cudagraph_plugin.core.memory import pool_policy
from fd_cudagraph_plugin.core.runtime import GraphRuntime, get_runtime
from fd_cudagraph_plugin.core.settings import Settings

logger = logging.getLogger("fd_cudagraph_plugin")


class CudaGraphBackend(Dispatch):
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
        self.dy_runnable = dy_runnable if dy_runnable is not None else runnable
        self.runnable = runnable if runnable is not None else dy_runnable
        self.settings = settings = Settings.from_fd_config(fd_config)
        options = settings.options
        self.runtime = runtime if runtime is not None else get_runtime(options.runtime)
        self._static = None
        if settings.dy2st:
            from fd_cudagraph_plugin.core.static import StaticGraphDriver

            self._static = StaticGraphDriver()
        self.capturer = Capturer(settings, self.runtime, pool_policy(settings), self._static)
        self._by_running = settings.keyed_by_running
        self._set_tables(Tables(settings), Counts(settings))
        self._guard_every = options.check_addresses
        self._warned: set[tuple[str, int]] = set()
        self._saw_only_prefill_step = False
        #: Static full mode: "static" (Paddle graphs decode) or "dynamic" (the plugin does),
        #: decided at the first decode capture (see _static_decode); None until then.
        self._static_full_decode: str | None = None
        self.capture_report: session.CaptureReport | None = None
        self._stats_file = None
        if options.stats_file:
            self._stats_file = stats.StatsFile(options.stats_file, settings)
        stats.register_backend(self)
        if options.metrics:
            from fd_cudagraph_plugin.core import metrics

            metrics.enable()
        hooks.install_runner_hooks()
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

    # ------------------------------------------------------------------ what FastDeploy reads

    @property
    def cudagraph_capture_sizes(self) -> list[int]:
        return list(self.settings.capture_sizes)

    @property
    def concrete_size_entries(self) -> dict[tuple[int, bool], GraphEntry]:
        """Entries keyed like FastDeploy's, ``(size, is_static_prefill)``, for debugging."""
        entries = {(s, False): e for s, e in self.tables.decode.items()}
        entries.update({(s, True): e for s, e in self.tables.prefill.items()})
        return entries

    @property
    def decode_entries(self) -> dict[int, GraphEntry]:
        return self.tables.decode

    @property
    def prefill_entries(self) -> dict[int, GraphEntry]:
        return self.tables.prefill

    @property
    def pool(self) -> object | None:
        return self.capturer.pool

    @property
    def pool_policy(self) -> str:
        return self.capturer.pool_policy

    # ------------------------------------------------------------------ session.Member

    def plan_fingerprint(self) -> dict[str, Any]:
        s = self.settings
        mode = "static_full" if s.static_full else "static_split" if s.static_split else "dynamic"
        return {
            "capture_sizes": list(s.capture_sizes),
            "prefill_sizes": list(s.prefill_sizes) if s.static_split else [],
            "mode": mode,
            "only_prefill": s.only_prefill,
            "warmups": s.num_warmups,
            "speculative_method": s.speculative_method,
            "num_speculative_tokens": s.num_speculative_tokens,
            "bsz_table": list(s.bsz_table),
        }

    def graphs_expected(self, phase: str) -> int:
        return sum(1 for e in self.expected_entries() if e.phase == phase)

    # ------------------------------------------------------------------ capture

    def _capture_and_run(
        self, entry: GraphEntry, key: int | None, tokens: int, kwargs: dict
    ) -> Any:
        current = session.active()
        if current is None and session.sessions_ended():
            # After capture_model(): a capture on this rank alone would hang tensor parallelism.
            return self._eager("late_capture", tokens, kwargs, key)
        static = entry.phase == PREFILL or (
            self.settings.static_full and self._static_decode(kwargs)
        )
        runnable = self.runnable if static else self.dy_runnable
        if current is not None and current.warm_only:
            return self.capturer.warm_only(self, entry, runnable, kwargs, current)
        self.capturer.capture(self, entry, runnable, kwargs, static, current)
        if not static:
            self.tables.publish(entry)
            if self.settings.options.self_check != "off":
                self._self_check(entry, kwargs)
        if entry.disabled:
            return self._eager("self_check_failed", tokens, kwargs, key)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        return self._run_graph(entry, key, tokens, kwargs)

    def _static_decode(self, kwargs: dict) -> bool:
        """Static full mode: does Paddle graph decode inside the SOT-translated program, or
        (where that program fails) the plugin from dy_runnable? Decided once (see static.py)."""
        if self._static_full_decode is None:
            failure = self._static.probe(self.runnable, kwargs)
            self._static_full_decode = "static" if failure is None else "dynamic"
            if failure is None:
                mark_warmed()  # it ran the model: no cold capture follows
            else:
                logger.warning(
                    "CUDA graph backend %#x (%s), static full mode: the static program failed "
                    "(%s), so decode graphs are captured from the dygraph model instead, as in "
                    "dynamic mode.",
                    id(self),
                    self.role,
                    failure,
                )
        return self._static_full_decode == "static"

    def _self_check(self, entry: GraphEntry, kwargs: dict) -> None:
        from fd_cudagraph_plugin.core import guards

        message = guards.self_check(entry, lambda: self.dy_runnable(**kwargs))
        if message is None:
            return
        current = session.active()
        if current is not None:
            # Every tensor-parallel rank must act alike: the session shares the verdicts at its
            # end and then raises, or disables the failing sizes, on every rank.
            current.self_check_failed(self, entry.phase, entry.size, message)
            return
        if self.settings.options.self_check == "error":
            raise SelfCheckError(message + " (FD_CUDAGRAPH_SELF_CHECK=error)")
        if self.settings.tp_size > 1:
            # Outside a session there is no exchange: serving one size eagerly on this rank
            # while the others replay would desynchronise the tensor-parallel all-reduces.
            raise SelfCheckError(
                message + " FD_CUDAGRAPH_SELF_CHECK=warn cannot serve a size eagerly on one "
                "tensor-parallel rank alone; fix the op or trim the size on every rank."
            )
        logger.warning("%s This size is served eagerly from now on.", message)
        self.disable_graph(entry.phase, entry.size)

    def disable_graph(self, phase: str, size: int) -> None:
        """Serve ``size`` eagerly from now on (a failed self-check, here or on another rank)."""
        entry = (self.tables.decode if phase == DECODE else self.tables.prefill)[size]
        entry.disabled = True
        self.tables.publish(entry)

    # ------------------------------------------------------------------ lifecycle

    def clear_graph(self) -> None:
        """Release every graph and output buffer so the next ``capture_model()`` starts afresh.

        FastDeploy calls this for an RL weight update and for ``/v1/sleep``. Clearing twice, or
        before any capture, is harmless.
        """
        stats.log_summary("clear_graph", [self])
        graphs = self.tables.graphs()
        self._set_tables(Tables(self.settings), self.counts)
        for entry in graphs:
            if entry.graph is not None:
                entry.graph.release()
        if self._static is not None:
            self._static.forget()
        self.capturer.reset()
        self.capturer.release_pool(self)
        self.runtime.empty_cache()
        allreduce.clear_ipc_handles()
        self.flush_stats()  # after the release: a failing write must not keep the graphs

    def expected_entries(self) -> list[GraphEntry]:
        """The entries this mode captures: what ``check_capture_successful`` requires."""
        settings = self.settings
        if settings.only_prefill and settings.static_split:
            return list(self.tables.prefill.values())
        if settings.only_prefill and not self._saw_only_prefill_step:
            # FastDeploy develop's GraphOptBackend routes prefill steps to the backend only in
            # static split mode, so with it this mode captures nothing (2.4's did route them).
            return []
        entries = list(self.tables.decode.values())
        if settings.static_split:
            entries += self.tables.prefill.values()
        return entries

    def check_capture_successful(self) -> None:
        """Raise if a size that this mode captures has no graph yet."""
        missing = [(e.phase, e.size) for e in self.expected_entries() if not e.captured]
        if missing:
            names = ", ".join(f"{phase} {size}" for phase, size in missing)
            raise CaptureIncompleteError(
                f"CUDA graph backend {id(self):#x}: no graph for {names}. Run capture_model() "
                f"(and capture_model_prefill_and_mixed() in static split mode) before serving."
            )

    # ------------------------------------------------------------------ stats

    @property
    def captures(self) -> int:
        return self.capturer.captures

    def observed_keys(self) -> dict[int, int]:
        """Decode steps per token count, or per running requests under speculative decoding,
        since construction: what ``fd-cudagraph tune`` reads."""
        return self.counts.observed()

    def flush_stats(self) -> None:
        if self._stats_file is not None:
            self._stats_file.flush(self)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (they survive ``clear_graph``), as plain data."""
        replays, padded, prefill, _ = self.counts.per_size()
        captured = [e for e in self.tables.graphs() if e.captured]
        decode = [e for e in captured if e.phase == DECODE]
        return {
            "captures": self.captures,
            "replays": dict(sorted(replays.items())),
            "prefill_replays": dict(sorted(prefill.items())),
            "eager_fallbacks": dict(self.counts.fallbacks),
            "padded_tokens": sum(padded.values()),
            "padded_tokens_per_size": {s: n for s, n in sorted(padded.items()) if n},
            "capture_seconds": {e.size: e.capture_seconds for e in decode},
            "graph_bytes": {e.size: e.graph_bytes for e in decode},
            "graph_bytes_total": sum(e.graph_bytes for e in captured),
            "largest_graph_bytes": max((e.graph_bytes for e in captured), default=0),
            "pool_policy": self.pool_policy,
            "static_full_decode": self._static_full_decode,
        }
