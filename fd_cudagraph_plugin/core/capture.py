"""Capturing one entry: the order check, warm-ups, the pool, the all-reduce context, accounting.

Dynamic entries are captured by the runtime (``runtime/``); static ones by Paddle inside its
partial programs (``static.py``). Warm-ups run outside FastDeploy's custom all-reduce capture
context and the capture inside it: inside the context, every all-reduce that is not being captured
returns an uninitialised buffer, and leaving it registers the new graph's buffers on every rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import allreduce, stats
from fd_cudagraph_plugin.core.entries import DECODE, GraphEntry
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureOrderError
from fd_cudagraph_plugin.core.memory import pools_for
from fd_cudagraph_plugin.core.runtime import GraphRuntime
from fd_cudagraph_plugin.core.session import CaptureSession, Member
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.static import StaticGraphDriver

logger = logging.getLogger("fd_cudagraph_plugin")

_OOM_ADVICE = (
    "Out of memory: lower --max-num-seqs or --gpu-memory-utilization, or trim "
    "cudagraph_capture_sizes in --graph-optimization-config."
)
_OP_ADVICE = (
    "An op in the model cannot be captured or run at this size: fix it, or serve without CUDA "
    "graphs (--graph-optimization-config '{\"use_cudagraph\": false}')."
)
_RESTART = (
    " The failure happened inside the capture, after which Paddle cannot capture again in this "
    "process: restart the worker once the cause is fixed."
)

_process_warmed = False
_dot_unsupported_logged = False


def process_warmed() -> bool:
    """True once any eager warm-up has run in this process (a cold capture fails, e.g. cuBLAS)."""
    return _process_warmed


def mark_warmed() -> None:
    global _process_warmed
    _process_warmed = True


def reset_for_tests() -> None:
    global _process_warmed
    _process_warmed = False


class Capturer:
    """Captures the entries of one backend, in the order every tensor-parallel rank follows."""

    def __init__(
        self,
        settings: Settings,
        runtime: GraphRuntime,
        pool_policy: str,
        static: StaticGraphDriver | None,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.pool_policy = pool_policy
        self.static = static
        #: The pool this backend captures into; taken at its first capture, given back on clear.
        self.pool: object | None = None
        self.captures = 0
        self.reset()

    def reset(self) -> None:
        """Forget the captures since the last clear (the graphs are released by the caller)."""
        self._next = 0
        self._since_clear = 0

    def release_pool(self, owner: object) -> None:
        pools_for(self.runtime).release(self.pool_policy, self.pool, id(owner))
        self.pool = None

    def warm_only(
        self,
        owner: Member,
        entry: GraphEntry,
        runnable: Callable,
        kwargs: dict,
        session: CaptureSession,
    ) -> Any:
        """The warm-only pass of ``warm_all_first``: warm up, capture nothing."""
        count = max(self.settings.num_warmups, 1)
        session.note_warmups(owner, entry.phase, entry.size, count)
        return self._warm_up(runnable, kwargs, count)

    def capture(
        self,
        owner: Member,
        entry: GraphEntry,
        runnable: Callable,
        kwargs: dict,
        static: bool,
        session: CaptureSession | None,
    ) -> None:
        """Warm up and capture ``entry``; raise ``CaptureError`` naming the size and the cause."""
        if session is not None:
            session.before_capture()
        if entry.phase == DECODE:
            self._check_order(entry.size)
        if self.pool is None and not static:
            self.pool = pools_for(self.runtime).acquire(self.pool_policy, id(owner))
        warmups = self._warmup_count(session)
        started = time.perf_counter()
        stage = "warm-up"
        graph = result = None
        try:
            self._warm_up(runnable, kwargs, warmups)
            self.runtime.synchronize()
            # Measured around the capture alone: warm-ups may grow ordinary allocator memory.
            before = self.runtime.pool_bytes(self.pool)
            stage = "capture"
            with allreduce.capture_context():  # its exit registers the buffers on every rank
                if static:
                    self.static.capture(runnable, kwargs, entry.size)
                else:
                    graph, result = self.runtime.capture(lambda: runnable(**kwargs), self.pool)
            graph_bytes = self.runtime.pool_bytes(self.pool) - before
        except Exception as error:
            # Nothing of a failed capture is published: a graph whose all-reduce buffers were
            # not registered must never replay.
            if graph is not None:
                graph.release()
            raise self._error(entry, static, stage, error) from error
        if graph is not None:
            entry.graph, entry.result, entry.replay = graph, result, graph.replay
        entry.graph_bytes = graph_bytes
        entry.static_captured = static
        entry.capture_seconds = time.perf_counter() - started
        if entry.phase == DECODE:
            self._next += 1
        self._since_clear += 1
        self.captures += 1
        if session is not None:
            session.record(
                owner, entry.phase, entry.size, entry.capture_seconds, entry.graph_bytes, warmups
            )
        logger.debug(
            "captured %s graph of size %d in %.3f s", entry.phase, entry.size, entry.capture_seconds
        )
        if not static:
            options = self.settings.options
            if options.check_addresses:
                from fd_cudagraph_plugin.core import guards

                entry.addresses = guards.input_addresses(kwargs)
            if options.dump_dot:
                self._dump_dot(owner, entry)

    def _check_order(self, size: int) -> None:
        """Every TP rank must capture the same sizes in the same order (see allreduce.py)."""
        if _is_xpu():
            return
        plan = self.settings.capture_sizes
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

    def _warmup_count(self, session: CaptureSession | None) -> int:
        policy = self.settings.options.warmup
        count = self.settings.num_warmups
        if policy == "warm_all_first" and session is not None:
            count = 0  # every size was warmed in the session's first pass
        elif policy == "largest_only" and self._since_clear:
            count = 0
        if not process_warmed():
            # Capturing a cold model fails: libraries initialise lazily (cuBLAS raised
            # CUBLAS_STATUS_NOT_INITIALIZED when we tried), so the first capture follows one run.
            count = max(count, 1)
        return count

    @staticmethod
    def _warm_up(runnable: Callable, kwargs: dict, count: int) -> Any:
        result = None
        for _ in range(count):
            result = runnable(**kwargs)
            mark_warmed()
        return result

    def _dump_dot(self, owner: object, entry: GraphEntry) -> None:
        directory = os.path.join(os.environ.get("FD_LOG_DIR", "log"), "GraphDotFiles")
        path = os.path.join(directory, f"backend{id(owner):x}_{entry.phase}{entry.size}")
        try:
            os.makedirs(directory, exist_ok=True)
            written = self.runtime.dump_dot(entry.graph, path)
        except OSError as error:
            stats.output_failed("FD_CUDAGRAPH_DUMP_DOT", path, error)
            return
        global _dot_unsupported_logged
        if not written and not _dot_unsupported_logged:
            _dot_unsupported_logged = True
            logger.warning(
                "FD_CUDAGRAPH_DUMP_DOT=1: the %s runtime cannot write dot files.", self.runtime.name
            )

    def _error(self, entry: GraphEntry, static: bool, stage: str, error: Exception) -> CaptureError:
        """Name the size, the mode, the stage and the cause. Only an out-of-memory cause gets
        memory advice: FastDeploy's capture_model() rewraps any error whose text says "out of
        memory" as a CUDA OOM, which would hide a graph break or an uncapturable op."""
        settings = self.settings
        out_of_memory = "out of memory" in str(error).lower() or isinstance(error, MemoryError)
        return CaptureError(
            f"CUDA graph {stage} failed for {entry.phase} size {entry.size} "
            f"({'static' if static else 'dynamic'} mode, "
            f"graph_opt_level={settings.graph_opt_level}, "
            f"full_cuda_graph={settings.full_cuda_graph}): {type(error).__name__}: "
            f"{str(error).rstrip('. ')}. "
            f"{_OOM_ADVICE if out_of_memory else _OP_ADVICE}"
            f"{_RESTART if stage == 'capture' else ''}"
        )


def _is_xpu() -> bool:
    try:
        from fastdeploy.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_xpu())
