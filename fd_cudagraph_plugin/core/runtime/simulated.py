"""A CPU runtime with CUDA-graph replay semantics, for tests and the demo.

What it reproduces of a real CUDA graph, because the backend's correctness depends on it:

* Replay re-executes the captured work on the tensors that were the inputs *at capture*. A new
  tensor passed on a later call is never read, just as a real graph keeps reading the old address.
  Persistent input buffers updated in place are therefore seen; swapped-in tensors are not.
* Replay writes its results in place into the tensors captured as outputs; it allocates no new
  output objects, so callers holding an output see it change on the next replay of that graph.
* Memory: each capture charges its output bytes to its pool (a private pool per graph when none
  is given); a pool's bytes return only when its last graph is released, and releasing a pool
  that still holds graphs is an error. Tests read ``live_graphs``, ``pool_bytes`` and
  ``live_pools`` to prove nothing leaks. Scratch memory is not modelled: simulated figures count
  output buffers only, unless a test sets ``graph_overhead`` (per graph) or ``first_capture_keeps``
  (what the first capture of a process takes outside every pool and keeps: on a GPU, the capture
  stream's library workspaces and the allocator's blocks cached from the warm-ups, which the
  allocator's reserved counter shows and no graph pool holds).

* A failed capture leaves it unable to capture again, as Paddle is: ``cudaStreamEndCapture`` on an
  invalidated capture throws inside ``EndSegmentCapture`` before the graph is moved out, so
  ``IsCapturing()`` stays true and every later ``capture_begin`` fails with "CUDA Graph can only
  captured one by one". Replays of graphs captured earlier still work.

It also lets tests inject a failure into the next capture, as an out-of-memory error would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import paddle


def output_tensors(outputs: object) -> list[paddle.Tensor]:
    """The tensors in a runnable's result: a tensor, or a list/tuple that may hold None."""
    if isinstance(outputs, paddle.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for t in outputs if isinstance(t, paddle.Tensor)]
    return []


def _nbytes(tensor: paddle.Tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


class SimulatedGraph:
    __slots__ = (
        "__weakref__",
        "_bytes",
        "_fn",
        "_outputs",
        "_pool",
        "_runtime",
        "replays",
        "graph_id",
    )

    def __init__(self, runtime: SimulatedRuntime, fn, outputs, pool, nbytes: int, graph_id) -> None:
        self.graph_id = graph_id
        self._runtime = runtime
        self._fn = fn
        self._outputs = outputs
        self._pool = pool
        self._bytes = nbytes
        self.replays = 0

    @property
    def released(self) -> bool:
        return self._fn is None

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay of a released graph")
        self._runtime.replaying = True
        self._runtime.in_flight = self.graph_id
        try:
            fresh = output_tensors(self._fn())
        finally:
            self._runtime.replaying = False
            self._runtime.in_flight = None
        for target, value in zip(self._outputs, fresh, strict=True):
            paddle.assign(value, output=target)
        self.replays += 1

    def release(self) -> None:
        if self._fn is None:
            return
        self._fn = None
        self._outputs = None
        self._runtime._release(self._pool, self._bytes)


class SimulatedRuntime:
    name = "simulated"
    real_graphs = False

    def __init__(self) -> None:
        self._pool_ids = itertools.count(1)
        self._pool_bytes: dict[object, int] = {}
        self._failures: list[BaseException] = []
        self.live_graphs = 0
        self.captures = 0
        self.capturing = False
        #: True while a replay re-executes captured work: lets a test model behave like an op
        #: whose captured form differs from its eager one (a host value frozen at capture).
        self.replaying = False
        self.empty_cache_calls = 0
        #: Set by a failed capture: no capture works in this process any more (see above).
        self.stuck = False
        self.warmed = False
        #: A device for the memory figures: its size, and what is in use outside graph pools
        #: (weights, the KV cache: ``allocate``/``free``). ``device_memory()`` is the driver's view.
        self.device_total = 16 << 30
        self.other_used = 0
        #: Bytes each graph takes beyond its outputs (a real graph's scratch memory): 0 unless a
        #: test wants graphs that cost more than their outputs.
        self.graph_overhead = 0
        #: Bytes the first capture of this process takes outside every graph pool and keeps
        #: (see above): 0 unless a test sets it.
        self.first_capture_keeps = 0
        self._kept = 0
        #: The id of the graph being captured or replayed, else None: lets a stand-in custom
        #: all-reduce tell which graph a captured all-reduce belongs to.
        self.in_flight: int | None = None

    def fail_next_capture(self, error: BaseException) -> None:
        """Make the next capture raise ``error`` after the captured work has run."""
        self._failures.append(error)

    def mark_warm(self) -> None:
        self.warmed = True

    def new_pool(self) -> object:
        pool = ("simulated-pool", next(self._pool_ids))
        self._pool_bytes[pool] = 0
        return pool

    @property
    def live_pools(self) -> int:
        return len(self._pool_bytes)

    def release_pool(self, pool: object) -> None:
        held = self._pool_bytes.pop(pool, 0)
        if held:
            raise RuntimeError(f"pool {pool} released while its graphs still hold {held} bytes")

    def dump_dot(self, graph: SimulatedGraph, path: str) -> bool:
        return False

    def capture(self, fn: Callable[[], object], pool: object) -> tuple[SimulatedGraph, object]:
        if self.stuck:
            raise RuntimeError(
                "(PreconditionNotMet) CUDA Graph can only captured one by one. (simulated: a "
                "previous capture failed and its capture state never ended)"
            )
        self.capturing = True
        graph_id = self.in_flight = next(self._pool_ids)
        try:
            outputs = fn()
            if self._failures:
                raise self._failures.pop(0)
            tensors = output_tensors(outputs)
            nbytes = sum(_nbytes(t) for t in tensors) + self.graph_overhead
            keeps = 0 if self.captures else self.first_capture_keeps
            free, _ = self.device_memory()
            if nbytes + keeps > free:
                raise MemoryError(
                    f"CUDA error(2): out of memory (simulated: the graph needs {nbytes} bytes, "
                    f"{free} free)"
                )
        except BaseException:
            self.stuck = True
            raise
        finally:
            self.capturing = False
            self.in_flight = None
        if pool is None:
            pool = ("private-pool", next(self._pool_ids))
        self._pool_bytes[pool] = self._pool_bytes.get(pool, 0) + nbytes
        self._kept += keeps
        self.live_graphs += 1
        self.captures += 1
        return SimulatedGraph(self, fn, tensors, pool, nbytes, graph_id), outputs

    def _release(self, pool: object, nbytes: int) -> None:
        self.live_graphs -= 1
        self._pool_bytes[pool] -= nbytes
        if pool[0] == "private-pool":
            del self._pool_bytes[pool]

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1

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

    def device_memory(self) -> tuple[int, int]:
        used = self.other_used + self._kept + sum(self._pool_bytes.values())
        return self.device_total - used, self.device_total

    def device_name(self) -> str:
        return "simulated"

    def pool_bytes(self, pool: object) -> int:
        """Bytes held by ``pool``; with None, the allocator's reserved counter: every pool and
        what the first capture kept."""
        if pool is None:
            return self._kept + sum(self._pool_bytes.values())
        return self._pool_bytes.get(pool, 0)
