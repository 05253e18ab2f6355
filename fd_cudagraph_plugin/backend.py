"""The drop-in replacement for FastDeploy's ``CudaGraphPiecewiseBackend``.

``GraphOptBackend`` builds one instance per decorated backbone (target model and MTP draft each
have one) on the first forward with CUDA graphs on, and calls it with the model's keyword
arguments, ``forward_meta`` among them. Dispatch:

* a decode step pads its token count through a precomputed table to a captured size and replays
  that graph (the hot path: a few attribute reads, one list index, ``replay()``);
* the first call at an exact capture size warms up eagerly, then captures inside the custom
  all-reduce capture context, then replays;
* anything without a graph (0 tokens, larger than the largest size, a padded size never captured)
  runs eagerly through ``dy_runnable``, counted and warned about once per shape.

Graph outputs are the tensors the captured run returned. They live in graph memory, the same
objects come back on every replay of that size, and the next replay overwrites them: FastDeploy's
runner slices ``[:real_token_num]`` straight away, as it does with the native backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin import allreduce, capture, stats
from fd_cudagraph_plugin.dispatch import FastDispatch, PyDispatch
from fd_cudagraph_plugin.errors import (
    CaptureError,
    CaptureIncompleteError,
    CaptureOrderError,
    ConfigError,
)
from fd_cudagraph_plugin.memory import pools_for
from fd_cudagraph_plugin.runtime import Graph, GraphRuntime, get_runtime
from fd_cudagraph_plugin.settings import Settings

logger = logging.getLogger("fd_cudagraph_plugin")

DECODE = "decode"
PREFILL = "prefill"

_OOM_ADVICE = (
    "lower --max-num-seqs or --gpu-memory-utilization, or trim cudagraph_capture_sizes in "
    "--graph-optimization-config"
)


class GraphEntry:
    """One capture size of one phase: its graph, its outputs and its counters."""

    __slots__ = (
        "size",
        "phase",
        "graph",
        "result",
        "static_captured",
        "capture_seconds",
        "graph_bytes",
        "addresses",
        "disabled",
        "published",
    )

    def __init__(self, size: int, phase: str) -> None:
        self.size = size
        self.phase = phase
        #: The runtime graph of a dynamic capture; None until captured (and for static entries).
        self.graph: Graph | None = None
        #: The captured run's return value, structure kept: a tensor or a list with Nones.
        self.result: Any = None
        #: Paddle-managed (dy2st) capture done for this size.
        self.static_captured = False
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        #: Input data pointers at capture, when the address guard is on.
        self.addresses: tuple[tuple[str, int], ...] = ()
        #: The self-check found this graph wrong: the size is served eagerly.
        self.disabled = False
        #: The fast tables serve this entry (see _publish).
        self.published = False

    @property
    def captured(self) -> bool:
        return self.graph is not None or self.static_captured


class _BackendCore:
    """Capture and replay CUDA graphs for one decorated FastDeploy backbone.

    Accepts FastDeploy 2.5+/develop ``(fd_config, dy_runnable, runnable)`` and 2.4
    ``(fd_config, runnable)``, by keyword. ``runtime`` is for tests and tools; FastDeploy never
    passes it, and the runtime then comes from ``FD_CUDAGRAPH_RUNTIME``.

    ``__call__`` comes from the dispatch base (``dispatch.py``): it serves captured decode sizes
    from tables and hands every other step to ``_dispatch``.
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
        self.pool_policy = self._pool_policy()
        #: The pool this backend captures into; taken at its first capture, given back on clear.
        self.pool: object | None = None
        self._static = None
        if settings.dy2st:
            from fd_cudagraph_plugin.static import StaticGraphDriver

            self._static = StaticGraphDriver()
        self._max_size = settings.max_size
        self._decode_table = settings.decode_table
        self._fallbacks: Counter[str] = Counter()
        # Replays and padded tokens by (phase, size), and decode steps per token count: what the
        # general path served, plus what the fast tables had served when they were last reset
        # (they count in C; see _fast_snapshot). All survive clear_graph().
        self._replays: Counter[tuple[str, int]] = Counter()
        self._padded: Counter[tuple[str, int]] = Counter()
        self._observed_tokens: Counter[int] = Counter()
        self._guard_ticks = 0
        self._saw_only_prefill_step = False
        self._warned: set[tuple[str, int]] = set()
        self.captures = 0
        self.capture_report: capture.CaptureReport | None = None
        self._guard_every = options.check_addresses
        self._stats_file = None
        if options.stats_file:
            self._stats_file = stats.StatsFile(
                options.stats_file, settings.tp_rank, settings.speculative_method
            )
        self._reset_entries()
        # The address guard checks in _dispatch; the fast path sends it every Nth call.
        self._fast_period(self._guard_every)
        stats.register_backend(self)
        capture.install_runner_hooks()
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

    def _pool_policy(self) -> str:
        options = self.settings.options
        if options.pool_set or self.settings.use_unique_memory_pool:
            return options.pool
        logger.warning(
            "use_unique_memory_pool=false: every CUDA graph gets a private memory pool, so each "
            "pays for its own scratch memory (36 sizes of a toy decoder took 912 MiB this way "
            "against 132 MiB in one shared pool). Set FD_CUDAGRAPH_POOL=device to share one."
        )
        return "graph"

    # ------------------------------------------------------------------ entries and tables

    def _reset_entries(self) -> None:
        settings = self.settings
        self.decode_entries = {size: GraphEntry(size, DECODE) for size in settings.capture_sizes}
        self.prefill_entries = {size: GraphEntry(size, PREFILL) for size in settings.prefill_sizes}
        # Index = token count, value = the entry of its padded size. Index 0 is an entry that
        # never gets a graph, so a 0-token step (PD decode nodes, FastDeploy #3888) goes eager.
        self._zero_entry = GraphEntry(0, DECODE)
        self._decode_by_tokens = [
            self.decode_entries[size] if size else self._zero_entry
            for size in settings.decode_table
        ]
        # The fast tables serve decode steps by token count, or by running requests under
        # speculative decoding; they fill as graphs are captured (see _publish).
        spec_length = len(settings.bsz_table) if settings.speculative else 0
        self._fast_init(len(self._decode_by_tokens), spec_length)
        self._prefill_by_tokens = [
            self.prefill_entries[size] if size else None for size in settings.prefill_table
        ]
        self._capture_plan = list(settings.capture_sizes)
        self._next_capture = 0
        self._captures_since_clear = 0

    @property
    def cudagraph_capture_sizes(self) -> list[int]:
        return list(self.settings.capture_sizes)

    @property
    def concrete_size_entries(self) -> dict[tuple[int, bool], GraphEntry]:
        """Entries keyed like FastDeploy's, ``(size, is_static_prefill)``, for debugging."""
        entries = {(s, False): e for s, e in self.decode_entries.items()}
        entries.update({(s, True): e for s, e in self.prefill_entries.items()})
        return entries

    def plan_fingerprint(self) -> dict[str, Any]:
        """What must be equal on every tensor-parallel rank for captures to line up."""
        s = self.settings
        return {
            "capture_sizes": list(s.capture_sizes),
            "prefill_sizes": list(s.prefill_sizes) if s.static_split else [],
            "mode": "static_full"
            if s.static_full
            else "static_split"
            if s.static_split
            else "dynamic",
            "only_prefill": s.only_prefill,
            "warmups": s.num_warmups,
            "speculative_method": s.speculative_method,
            "num_speculative_tokens": s.num_speculative_tokens,
            "bsz_table": list(s.bsz_table),
        }

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, kwargs: dict, meta: Any) -> Any:
        """Every step the fast tables did not serve: pick the entry, then ``_serve`` it."""
        settings = self.settings
        tokens = meta.ids_remove_padding.shape[0]
        if meta.exist_prefill:
            if settings.static_split:
                if not 0 < tokens < len(self._prefill_by_tokens):
                    return self._eager("oversized", tokens, kwargs)
                return self._serve(self._prefill_by_tokens[tokens], tokens, kwargs)
            if not settings.only_prefill:
                return self._eager("prefill", tokens, kwargs)
            # cudagraph_only_prefill (PD prefill nodes): prefill-only steps are keyed by token
            # count through the decode-size list, as FastDeploy's own backend does.
            self._saw_only_prefill_step = True
        elif settings.only_prefill:
            # Graphs of this mode hold prefill kernels; a decode step must not replay them.
            return self._eager("decode_in_prefill_only_mode", tokens, kwargs)
        else:
            self._observed_tokens[tokens] += 1

        entry = None
        if settings.speculative and not meta.exist_prefill:
            size = self._speculative_size(meta)
            # The running-request count names a token size; a step with more tokens than that
            # (an under-predicted real_bsz) must not replay a graph with fewer rows.
            if size and tokens <= size:
                entry = self.decode_entries[size]
        if entry is None:
            if tokens == 0:
                return self._eager("zero_tokens", tokens, kwargs)
            if tokens > self._max_size:
                return self._eager("oversized", tokens, kwargs)
            entry = self._decode_by_tokens[tokens]
        return self._serve(entry, tokens, kwargs)

    def _serve(self, entry: GraphEntry, tokens: int, kwargs: dict) -> Any:
        static = self._is_static(entry)
        if entry.disabled:
            return self._eager("self_check_failed", tokens, kwargs)
        if entry.captured:
            return self._run_graph(entry, tokens, kwargs)
        if entry.size != tokens:
            # Graphs are captured at exact sizes only: FastDeploy's capture loop supplies them.
            return self._eager("not_captured", tokens, kwargs, static)
        if not self._may_capture(entry, tokens):
            return self._eager("late_capture", tokens, kwargs, static)
        return self._capture(entry, tokens, kwargs, static)

    def _is_static(self, entry: GraphEntry) -> bool:
        """Paddle-managed (dy2st) graphs: static split prefill, and decode in static full mode."""
        return entry.phase == PREFILL or self.settings.static_full

    def _speculative_size(self, meta: Any) -> int:
        table = self.settings.bsz_table
        running = meta.real_bsz or 0
        if running <= 0:
            seq_lens = meta.seq_lens_this_time
            running = int((seq_lens.flatten() > 0).sum()) if seq_lens is not None else 0
        running = max(1, running)
        return table[running] if running < len(table) else 0

    def _run_graph(self, entry: GraphEntry, tokens: int, kwargs: dict, guard: bool = True) -> Any:
        """Replay ``entry`` for a step of ``tokens`` tokens (the general path)."""
        if guard and entry.addresses and self._address_check_due(entry):
            from fd_cudagraph_plugin import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        key = (entry.phase, entry.size)
        self._replays[key] += 1
        self._padded[key] += entry.size - tokens
        if entry.graph is None:
            return self._static.replay(self.runnable, kwargs, entry.size)
        entry.graph.replay()
        return entry.result

    def _address_check_due(self, entry: GraphEntry) -> bool:
        """``always``; or ``sampled:N``: every Nth replay. The fast path already sends only every
        Nth call of a published entry here, so those are always checked."""
        if self._guard_every == 1 or entry.published:
            return True
        self._guard_ticks += 1
        if self._guard_ticks < self._guard_every:
            return False
        self._guard_ticks = 0
        return True

    def _eager(self, reason: str, tokens: int, kwargs: dict, static: bool = False) -> Any:
        """Run the step without a graph: ``dy_runnable``, or for a static entry the static
        program with CUDA graphs disabled (the driver turns REPLAY of an uncaptured key into
        DISABLE)."""
        self._fallbacks[reason] += 1
        if reason != "prefill" and (reason, tokens) not in self._warned:
            self._warned.add((reason, tokens))
            logger.warning(
                "CUDA graph backend %#x: %d tokens ran without a graph (%s); largest captured "
                "size is %d. Further steps of this shape are counted in stats() without another "
                "warning.",
                id(self),
                tokens,
                reason.replace("_", " "),
                self._max_size,
            )
        if static:
            return self._static.replay(self.runnable, kwargs, 0)
        return self.dy_runnable(**kwargs)

    # ------------------------------------------------------------------ capture

    def _may_capture(self, entry: GraphEntry, tokens: int) -> bool:
        """``FD_CUDAGRAPH_LATE_CAPTURE``: after capture_model() ended, capturing on one rank
        alone would hang tensor parallelism in the all-reduce registration collective."""
        if capture.active() is not None or not capture.sessions_ended():
            return True
        policy = self.settings.options.late_capture
        if policy == "capture":
            return True
        if policy == "error":
            raise CaptureError(
                f"late CUDA graph capture of {entry.phase} size {entry.size} ({tokens} tokens) "
                f"after capture_model() ended (FD_CUDAGRAPH_LATE_CAPTURE=error). Add the size to "
                f"cudagraph_capture_sizes, or set FD_CUDAGRAPH_LATE_CAPTURE=eager."
            )
        return False

    def _check_order(self, size: int) -> None:
        """Every TP rank must capture the same sizes in the same order (see allreduce.py)."""
        if _is_xpu():
            return
        plan = self._capture_plan
        if self._next_capture >= len(plan):
            raise CaptureOrderError(
                f"CUDA graph capture of size {size} after all {len(plan)} planned captures "
                f"({plan}) were done. A capture outside capture_model() can hang tensor-parallel "
                f"ranks; check what calls the model with step_use_cudagraph=True after capture."
            )
        expected = plan[self._next_capture]
        if size != expected:
            raise CaptureOrderError(
                f"CUDA graph capture order: expected size {expected} (capture #{self._next_capture}"
                f" of plan {plan}), got {size}. FastDeploy's capture_model() captures largest "
                f"first; check that cudagraph_capture_sizes and the dummy-run batch sizes agree on "
                f"every rank."
            )

    def _warmup_count(self, session: capture.CaptureSession | None) -> int:
        policy = self.settings.options.warmup
        count = self.settings.num_warmups
        if session is not None and session.warm_pass:
            return max(count, 1)
        if policy == "warm_all_first" and session is not None:
            count = 0  # every size was warmed in the session's first pass
        elif policy == "largest_only" and self._captures_since_clear:
            count = 0
        if not capture.process_warmed():
            # Capturing a cold model fails: libraries initialise lazily (cuBLAS raised
            # CUBLAS_STATUS_NOT_INITIALIZED when we tried), so the first capture follows one run.
            count = max(count, 1)
        return count

    def _warm_up(self, runnable: Callable, kwargs: dict, count: int) -> Any:
        result = None
        for _ in range(count):
            result = runnable(**kwargs)
            capture.mark_warmed()
        return result

    def _capture(self, entry: GraphEntry, tokens: int, kwargs: dict, static: bool) -> Any:
        """Warm up, capture ``entry`` and return this step's outputs.

        Dynamic entries are captured by the runtime; static ones by Paddle inside the partial
        programs (``static.py``). Warm-ups run outside the custom all-reduce context, the capture
        inside it. In a warm-only pass (``warm_all_first``) nothing is captured.
        """
        session = capture.active()
        runnable = self.runnable if static else self.dy_runnable
        warmups = self._warmup_count(session)
        if session is not None and session.warm_pass:
            session.note_warmups(self, entry, warmups)
            return self._warm_up(runnable, kwargs, warmups)
        if entry.phase == DECODE:
            self._check_order(entry.size)
        if self.pool is None and not static:
            self.pool = pools_for(self.runtime).acquire(self.pool_policy, id(self))
        started = time.perf_counter()
        try:
            self._warm_up(runnable, kwargs, warmups)
            self.runtime.synchronize()
            # Measured around the capture alone: warm-ups may grow ordinary allocator memory.
            before = self.runtime.pool_bytes(self.pool)
            with self._ar_context(session):
                if static:
                    result = self._static.capture(runnable, kwargs, entry.size)
                else:
                    entry.graph, result = self.runtime.capture(
                        lambda: runnable(**kwargs), self.pool
                    )
                    entry.result = result
            entry.graph_bytes = self.runtime.pool_bytes(self.pool) - before
        except Exception as error:
            raise self._capture_error(entry, "static" if static else "dynamic", error) from error
        entry.static_captured = static
        entry.capture_seconds = time.perf_counter() - started
        if entry.phase == DECODE:
            self._next_capture += 1
        self._captures_since_clear += 1
        self.captures += 1
        if session is not None:
            session.record(self, entry, warmups)
        logger.debug(
            "captured %s graph of size %d in %.3f s", entry.phase, entry.size, entry.capture_seconds
        )
        # With one all-reduce registration per session, a graph must not run before the session
        # registers its buffers: no replay and no self-check until the session ends. The
        # outputs of a capture run are not computed on a GPU; FastDeploy's dummy runs discard
        # them.
        deferred = session is not None and session.options.ar_registration == "session"
        if not static:
            if self._guard_every:
                from fd_cudagraph_plugin import guards

                entry.addresses = guards.input_addresses(kwargs)
            if self.settings.options.dump_dot:
                self._dump_dot(entry)
            self._publish(entry)
            if self.settings.options.self_check != "off":
                if deferred:
                    session.after(functools.partial(self._self_check, entry, kwargs))
                else:
                    self._self_check(entry, kwargs)
        if deferred:
            return result
        if entry.disabled:
            return self._eager("self_check_failed", tokens, kwargs)
        # The capturing call returns real outputs too; it ran on the captured inputs.
        return self._run_graph(entry, tokens, kwargs, guard=False)

    def _ar_context(self, session: capture.CaptureSession | None):
        if session is not None and session.options.ar_registration == "session":
            return contextlib.nullcontext()  # the session holds one context for every graph
        return allreduce.capture_context()

    def _self_check(self, entry: GraphEntry, kwargs: dict) -> None:
        """Replay the new graph and run eager on the same inputs; they must agree."""
        from fd_cudagraph_plugin import guards

        entry.graph.replay()
        replayed = guards.clone(entry.result)
        problem = guards.first_mismatch(replayed, self.dy_runnable(**kwargs))
        if problem is None:
            return
        message = (
            f"CUDA graph self-check failed for {entry.phase} size {entry.size}: {problem}. An op "
            f"in the model does not replay like it runs eagerly (host-side values, dynamic "
            f"shapes, or an all-reduce outside the capture context)."
        )
        if self.settings.options.self_check == "error":
            raise guards.SelfCheckError(message + " (FD_CUDAGRAPH_SELF_CHECK=error)")
        if self.settings.tp_size > 1:
            # Serving one size eagerly on this rank while the others replay would desynchronise
            # the tensor-parallel all-reduces; stop instead.
            raise guards.SelfCheckError(
                message + " FD_CUDAGRAPH_SELF_CHECK=warn cannot serve a size eagerly on one "
                "tensor-parallel rank alone; fix the op or trim the size on every rank."
            )
        logger.warning("%s This size is served eagerly from now on.", message)
        entry.disabled = True
        self._publish(entry)

    def _dump_dot(self, entry: GraphEntry) -> None:
        directory = os.path.join(os.environ.get("FD_LOG_DIR", "log"), "GraphDotFiles")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"backend{id(self):x}_{entry.phase}{entry.size}")
        if not self.runtime.dump_dot(entry.graph, path) and ("dump_dot", 0) not in self._warned:
            self._warned.add(("dump_dot", 0))
            logger.warning(
                "FD_CUDAGRAPH_DUMP_DOT=1: the %s runtime cannot write dot files.", self.runtime.name
            )

    def _publish(self, entry: GraphEntry) -> None:
        """Let the fast path serve every key that maps to this entry (or stop, once the entry is
        disabled): token counts that pad to its size, or under speculative decoding the running
        request counts whose graph it is. Not for prefill-only graphs."""
        settings = self.settings
        if settings.only_prefill or entry.phase != DECODE:
            return
        entry.published = not entry.disabled
        replay = getattr(entry.graph, "replay_fn", entry.graph.replay) if entry.published else None
        result = entry.result if entry.published else None
        if settings.speculative:
            for running, size in enumerate(settings.bsz_table):
                if running and size == entry.size:
                    self._spec_set(running, replay, result, entry.size)
            return
        for tokens in range(1, entry.size + 1):
            if self._decode_by_tokens[tokens] is entry:
                self._fast_set(tokens, replay, result)

    def _capture_error(self, entry: GraphEntry, mode: str, error: Exception) -> CaptureError:
        return CaptureError(
            f"CUDA graph capture failed for {entry.phase} size {entry.size} ({mode} mode, "
            f"graph_opt_level={self.settings.graph_opt_level}, "
            f"full_cuda_graph={self.settings.full_cuda_graph}): {type(error).__name__}: {error}. "
            f"The size stays uncaptured and the next call retries it. If this is out of memory, "
            f"{_OOM_ADVICE}."
        )

    # ------------------------------------------------------------------ lifecycle

    def clear_graph(self) -> None:
        """Release every graph and output buffer so the next ``capture_model()`` starts afresh.

        FastDeploy calls this for an RL weight update and for ``/v1/sleep``. Clearing twice, or
        before any capture, is harmless. A pool shared with other backends stays until its last
        user clears.
        """
        stats.log_summary("clear_graph", [self])
        self.flush_stats()
        allreduce.clear_ipc_handles()
        for entry in (*self.decode_entries.values(), *self.prefill_entries.values()):
            if entry.graph is not None:
                entry.graph.release()
        if self._static is not None:
            self._static.forget()
        replays, padded, observed = self._fast_snapshot()
        self._replays.update(replays)
        self._padded.update(padded)
        self._observed_tokens.update(observed)
        self._reset_entries()
        pools_for(self.runtime).release(self.pool_policy, self.pool, id(self))
        self.pool = None
        self.runtime.empty_cache()

    def expected_entries(self) -> list[GraphEntry]:
        """The entries this mode captures: what ``check_capture_successful`` requires."""
        settings = self.settings
        if settings.only_prefill and settings.static_split:
            return list(self.prefill_entries.values())
        if settings.only_prefill and not self._saw_only_prefill_step:
            # FastDeploy develop's GraphOptBackend routes prefill steps to the backend only in
            # static split mode, so with it this mode captures nothing (2.4's did route them).
            return []
        entries = list(self.decode_entries.values())
        if settings.static_split:
            entries += self.prefill_entries.values()
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

    def _fast_snapshot(self) -> tuple[Counter, Counter, Counter[int]]:
        """Replays and padded tokens by (phase, size), and decode steps per token count, that
        the fast tables have served since they were last reset."""
        replays: Counter[tuple[str, int]] = Counter()
        padded: Counter[tuple[str, int]] = Counter()
        observed: Counter[int] = Counter()
        for tokens, hits in enumerate(self._fast_hits()):
            if hits:
                size = self._decode_table[tokens]
                replays[DECODE, size] += hits
                padded[DECODE, size] += hits * (size - tokens)
                observed[tokens] += hits
        hits, tokens, token_hits = self._spec_counts()
        for running, count in enumerate(hits):
            if count:
                size = self.settings.bsz_table[running]
                replays[DECODE, size] += count
                padded[DECODE, size] += count * size - tokens[running]
        observed.update({n: c for n, c in enumerate(token_hits) if c})
        return replays, padded, observed

    def decode_token_counts(self) -> Counter[int]:
        """Observed decode steps per token count, since construction (what ``tune`` reads)."""
        counts = self._fast_snapshot()[2]
        counts.update(self._observed_tokens)
        return counts

    def flush_stats(self) -> None:
        if self._stats_file is not None:
            self._stats_file.flush(self)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (they survive ``clear_graph``), as plain data."""
        replays, padded, _ = self._fast_snapshot()
        replays.update(self._replays)
        padded.update(self._padded)
        captured = [e for e in self.concrete_size_entries.values() if e.captured]
        graph_bytes = {e.size: e.graph_bytes for e in captured if e.phase == DECODE}

        def per_size(counter: Counter[tuple[str, int]], phase: str) -> dict[int, int]:
            return {size: n for (p, size), n in sorted(counter.items()) if p == phase and n}

        return {
            "captures": self.captures,
            "replays": per_size(replays, DECODE),
            "prefill_replays": per_size(replays, PREFILL),
            "eager_fallbacks": dict(self._fallbacks),
            "padded_tokens": sum(padded.values()),
            "padded_tokens_per_size": per_size(padded, DECODE),
            "capture_seconds": {e.size: e.capture_seconds for e in captured if e.phase == DECODE},
            "graph_bytes": graph_bytes,
            "graph_bytes_total": sum(e.graph_bytes for e in captured),
            "largest_graph_bytes": max((e.graph_bytes for e in captured), default=0),
            "pool_policy": self.pool_policy,
        }


def _is_xpu() -> bool:
    try:
        from fastdeploy.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_xpu())


class CudaGraphBackend(_BackendCore, FastDispatch):
    __doc__ = _BackendCore.__doc__


class PyCudaGraphBackend(_BackendCore, PyDispatch):
    """The same backend with the pure-Python hot path (the fallback without the C extension)."""
