"""The plugin's simulated runtime with what tests inject and watch.

``SimulatedRuntime`` (``fd_cudagraph_plugin/core/runtime/simulated.py``) has CUDA-graph replay
semantics; this subclass adds, for tests only:

* injection: ``fail_next_capture`` (the next capture raises after its work ran, as an
  out-of-memory would), ``graph_overhead`` (bytes each graph takes beyond its outputs: a real
  graph's scratch memory), ``first_capture_keeps`` (what the first capture of a process takes
  outside every pool and keeps: on a GPU, the capture stream's library workspaces and the
  allocator's blocks cached from the warm-ups, which the allocator's reserved counter shows and no
  graph pool holds), ``allocate``/``free`` (memory outside graph pools: weights, the KV cache);
* what a test or a stand-in watches: ``capturing`` and ``replaying`` (a test model can behave like
  an op whose captured form differs from its eager one), ``in_flight`` (the graph being captured or
  replayed: the stand-in custom all-reduce tells graphs apart by it), ``live_graphs``,
  ``live_pools``, ``captures``, ``empty_cache_calls``.
"""

from __future__ import annotations

from collections.abc import Callable

from fd_cudagraph_plugin.core.runtime.simulated import SimulatedRuntime


class TestRuntime(SimulatedRuntime):
    __test__ = False  # not a test class, for pytest

    def __init__(self) -> None:
        super().__init__()
        self._failures: list[BaseException] = []
        self.capturing = False
        self.replaying = False
        self.in_flight: int | None = None
        self.live_graphs = 0
        self.captures = 0
        self.empty_cache_calls = 0
        self.other_used = 0
        self.graph_overhead = 0
        self.first_capture_keeps = 0
        self._kept = 0

    def fail_next_capture(self, error: BaseException) -> None:
        """Make the next capture raise ``error`` after the captured work has run."""
        self._failures.append(error)

    def allocate(self, nbytes: int) -> None:
        """Device memory outside graph pools (weights, KV cache); MemoryError past the device."""
        free, _ = self.device_memory()
        if nbytes > free:
            raise MemoryError(
                f"CUDA error(2): out of memory (simulated: {nbytes} bytes asked, {free} free)"
            )
        self.other_used += nbytes

    def free(self, nbytes: int) -> None:
        self.other_used -= nbytes

    @property
    def live_pools(self) -> int:
        return len(self._pool_bytes)

    def capture(self, fn, pool):
        graph, outputs = super().capture(fn, pool)
        if not self.captures:
            self._kept += self.first_capture_keeps
        self.live_graphs += 1
        self.captures += 1
        return graph, outputs

    def _run_captured(self, fn: Callable[[], object], graph_id: int) -> object:
        self.capturing, self.in_flight = True, graph_id
        try:
            outputs = fn()
            if self._failures:
                raise self._failures.pop(0)
            return outputs
        finally:
            self.capturing, self.in_flight = False, None

    def _run_replayed(self, fn: Callable[[], object], graph_id: int) -> object:
        self.replaying, self.in_flight = True, graph_id
        try:
            return fn()
        finally:
            self.replaying, self.in_flight = False, None

    def graph_bytes(self, outputs: int) -> int:
        return outputs + self.graph_overhead

    def kept_by_capture(self) -> int:
        return 0 if self.captures else self.first_capture_keeps

    def _release(self, pool: object, nbytes: int) -> None:
        super()._release(pool, nbytes)
        self.live_graphs -= 1

    def used_outside_pools(self) -> int:
        return self.other_used + self._kept

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1

    def pool_bytes(self, pool: object) -> int:
        if pool is None:
            return self._kept + super().pool_bytes(None)
        return super().pool_bytes(pool)
