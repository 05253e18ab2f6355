"""A fake of Paddle 3.x's CUDA-graph API, to test ``core/runtime/cuda.py`` on a CPU machine.

Modelled on Paddle 3.3.1's own source:

* the Python class is ``paddle/device/cuda/graphs.py``: ``CUDAGraph(place, mode, pool_id)``
  asserts ``mode`` is one of ``ALL_MODES`` and keeps ``_graph`` None until ``capture_end()``
  stores the core graph; ``replay``, ``reset`` and ``print_to_dot_files`` call into it;
* the core is ``paddle/phi/backends/gpu/cuda/cuda_graph.cc`` and
  ``cuda_graph_with_memory_pool.cc``: one capture at a time in a process (a second
  ``begin_capture_with_pool_id`` fails with "CUDA Graph can only captured one by one."), a pool id
  of None gets a fresh pool, graphs of one pool id share its memory, counted by reference and
  freed with the last graph's ``reset()``; ``replay()`` after ``reset()`` raises PermissionDenied;
* a capture invalidated by an unsafe call (here ``synchronize()`` in a non-relaxed capture, which
  is ``cudaErrorStreamCaptureUnsupported``) makes ``end_capture`` raise ``OSError`` (Paddle's
  ``External`` error) before the capturing state is cleared: no capture works in that process
  again, while graphs captured before still replay;
* memory: what kernels allocate while a capture runs goes to that capture's pool;
  ``memory_reserved()`` counts it until the pool is freed and ``empty_cache()`` returns it.

It models what the plugin relies on, not CUDA: a replay runs nothing (the simulated runtime
models replay semantics), and allocations are made explicitly with ``malloc``.
"""

from __future__ import annotations

import os
from typing import Any

ALL_MODES = ["global", "thread_local", "relaxed"]


class _Pool:
    def __init__(self, pool_id: int) -> None:
        self.id = pool_id
        self.bytes = 0
        self.graphs = 0


class _Capture:
    def __init__(self, pool: _Pool, mode: int) -> None:
        self.pool = pool
        self.mode = mode
        self.invalidated = False


class _CoreGraph:
    """What ``CoreCUDAGraph.end_capture()`` returns."""

    def __init__(self, api: FakePaddleCuda, pool: _Pool, mode: int) -> None:
        self._api = api
        self.pool = pool
        self.mode = mode
        self.replays = 0
        self.is_reset = False

    def replay(self) -> None:
        if self.is_reset:
            raise RuntimeError(
                "(PermissionDenied) Cannot replay the CUDA Graph after reset is called."
            )
        self.replays += 1

    def reset(self) -> None:
        if self.is_reset:
            return
        self.is_reset = True
        self._api._drop(self.pool)

    def print_to_dot_files(self, dirname: str, flags: int) -> None:
        with open(os.path.join(dirname, f"graph_{id(self):x}.dot"), "w") as handle:
            handle.write(f"digraph {{}} // flags {flags}\n")


class FakePaddleCuda:
    """The Paddle calls ``CudaRuntime`` makes (``runtime.cuda.paddle_cuda()``), faked."""

    def __init__(self, compiled_with_cuda: bool = True) -> None:
        self._compiled = compiled_with_cuda
        self._next_pool = 1
        self.pools: dict[int, _Pool] = {}
        self.capturing: _Capture | None = None
        #: Paddle's capturing state, stuck after an invalidated capture (see the module text).
        self.stuck = False
        self.reserved = 0
        self._cached = 0
        self.calls: list[str] = []
        self.graphs: list[_CoreGraph] = []
        api = self

        class CUDAGraph:
            def __init__(self, place: Any = None, mode: str = "thread_local", pool_id=None):
                self._graph = None
                self._place = place if place is not None else "Place(gpu:0)"
                assert mode in ALL_MODES
                self._mode = ALL_MODES.index(mode)
                self._pool_id = pool_id

            def capture_begin(self) -> None:
                api._begin(self._place, self._mode, self._pool_id)

            def capture_end(self) -> None:
                self._graph = api._end()

            def replay(self) -> None:
                self._graph.replay()

            def reset(self) -> None:
                self._graph.reset()

            def print_to_dot_files(self, dirname: str, flags: int | None = None) -> None:
                os.makedirs(name=dirname, exist_ok=True)
                self._graph.print_to_dot_files(dirname, 2047 if flags is None else flags)

        self.CUDAGraph = CUDAGraph
        self.is_cuda_graph_supported = lambda: compiled_with_cuda

    # -- what CudaRuntime calls ------------------------------------------------------------
    def compiled_with_cuda(self) -> bool:
        return self._compiled

    def new_pool_id(self) -> int:
        self.calls.append("gen_new_memory_pool_id")
        pool_id = self._next_pool
        self._next_pool += 1
        return pool_id

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        if self.capturing is not None and self.capturing.mode != ALL_MODES.index("relaxed"):
            self.capturing.invalidated = True
            raise OSError(
                "(External) CUDA error(900), operation not permitted when stream is capturing"
            )

    def memory_reserved(self) -> int:
        return self.reserved

    def device_name(self) -> str:
        return "Fake GPU (tests/fake_paddle_cuda.py)"

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved -= self._cached
        self._cached = 0

    # -- what a kernel does: allocate ------------------------------------------------------
    def malloc(self, nbytes: int) -> None:
        """A tensor allocation: into the pool of the capture in progress, if any."""
        self.reserved += nbytes
        if self.capturing is not None:
            self.capturing.pool.bytes += nbytes
        else:
            self._cached += nbytes  # eager memory, freed to the cache when the step ends

    def invalidate(self) -> None:
        """An op that is illegal inside a capture (a host sync, a cudaFree) just ran."""
        if self.capturing is not None:
            self.capturing.invalidated = True

    @property
    def live_graphs(self) -> int:
        return sum(pool.graphs for pool in self.pools.values())

    # -- the core (cuda_graph.cc) ----------------------------------------------------------
    def _begin(self, place: Any, mode: int, pool_id: int | None) -> None:
        self.calls.append(f"begin_capture_with_pool_id(mode={ALL_MODES[mode]}, pool={pool_id})")
        if self.capturing is not None or self.stuck:
            raise RuntimeError("(PreconditionNotMet) CUDA Graph can only captured one by one.")
        if pool_id is None:
            pool_id = self.new_pool_id()
        pool = self.pools.setdefault(pool_id, _Pool(pool_id))
        self.capturing = _Capture(pool, mode)

    def _end(self) -> _CoreGraph:
        self.calls.append("end_capture")
        capture = self.capturing
        if capture is None:
            raise RuntimeError("(PreconditionNotMet) No CUDA Graph is capturing.")
        if capture.invalidated:
            # cudaStreamEndCapture did end the stream's capture, but EndSegmentCapture throws
            # before Paddle clears its own capturing state.
            self.capturing = None
            self.stuck = True
            raise OSError(
                "(External) CUDA error(901), operation failed due to a previous error during "
                "capture (cudaErrorStreamCaptureInvalidated)"
            )
        self.capturing = None
        capture.pool.graphs += 1
        graph = _CoreGraph(self, capture.pool, capture.mode)
        self.graphs.append(graph)
        return graph

    def _drop(self, pool: _Pool) -> None:
        pool.graphs -= 1
        if pool.graphs == 0:
            self._cached += pool.bytes
            pool.bytes = 0
            del self.pools[pool.id]
