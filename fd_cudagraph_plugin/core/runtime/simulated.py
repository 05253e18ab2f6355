"""A CPU runtime with CUDA-graph replay semantics, for tests and the demo.

What it reproduces of a real CUDA graph, because the backend's correctness depends on it:

* Replay re-executes the captured work on the tensors that were the inputs *at capture*. A new
  tensor passed on a later call is never read, just as a real graph keeps reading the old address.
  Persistent input buffers updated in place are therefore seen; swapped-in tensors are not.
* Replay writes its results in place into the tensors captured as outputs; it allocates no new
  output objects, so callers holding an output see it change on the next replay of that graph.
* Memory: each capture charges its output bytes to its pool (a private pool per graph when none
  is given); a pool's bytes return only when its last graph is released, and releasing a pool
  that still holds graphs is an error. Scratch memory is not modelled: the figures count output
  buffers only (``graph_bytes`` is where a subclass adds more), on a device of 16 GiB.
* A failed capture leaves it unable to capture again, as Paddle is: ``cudaStreamEndCapture`` on an
  invalidated capture throws inside ``EndSegmentCapture`` before the graph is moved out, so
  ``IsCapturing()`` stays true and every later ``capture_begin`` fails with "CUDA Graph can only
  captured one by one". Replays of graphs captured earlier still work.

What tests inject or watch (a failing capture, memory outside the pools, whether a capture or a
replay runs now) is a subclass of theirs (``tests/simulated.py``), through the hooks
``_run_captured``, ``_run_replayed``, ``graph_bytes``, ``kept_by_capture`` and
``used_outside_pools``.
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
    __slots__ = ("__weakref__", "_bytes", "_fn", "_outputs", "_pool", "_runtime", "graph_id")

    def __init__(self, runtime: SimulatedRuntime, fn, outputs, pool, nbytes: int, graph_id) -> None:
        self.graph_id = graph_id
        self._runtime = runtime
        self._fn = fn
        self._outputs = outputs
        self._pool = pool
        self._bytes = nbytes

    @property
    def released(self) -> bool:
        return self._fn is None

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay of a released graph")
        fresh = output_tensors(self._runtime._run_replayed(self._fn, self.graph_id))
        for target, value in zip(self._outputs, fresh, strict=True):
            paddle.assign(value, output=target)

    def release(self) -> None:
        if self._fn is None:
            return
        self._fn = None
        self._outputs = None
        self._runtime._release(self._pool, self._bytes)


class SimulatedRuntime:
    name = "simulated"
    real_graphs = False
    #: The device the memory figures are of.
    device_total = 16 << 30

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pool_bytes: dict[object, int] = {}
        #: Set by a failed capture: no capture works in this process any more (see above).
        self.stuck = False
        self.warmed = False

    def mark_warm(self) -> None:
        self.warmed = True

    def new_pool(self) -> object:
        pool = ("simulated-pool", next(self._ids))
        self._pool_bytes[pool] = 0
        return pool

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
        graph_id = next(self._ids)
        try:
            outputs = self._run_captured(fn, graph_id)
            tensors = output_tensors(outputs)
            nbytes = self.graph_bytes(sum(_nbytes(t) for t in tensors))
            free, _ = self.device_memory()
            if nbytes + self.kept_by_capture() > free:
                raise MemoryError(
                    f"CUDA error(2): out of memory (simulated: the graph needs {nbytes} bytes, "
                    f"{free} free)"
                )
        except BaseException:
            self.stuck = True
            raise
        if pool is None:
            pool = ("private-pool", next(self._ids))
        self._pool_bytes[pool] = self._pool_bytes.get(pool, 0) + nbytes
        return SimulatedGraph(self, fn, tensors, pool, nbytes, graph_id), outputs

    # -- hooks a test's subclass extends

    def _run_captured(self, fn: Callable[[], object], graph_id: int) -> object:
        """Run the work being captured."""
        return fn()

    def _run_replayed(self, fn: Callable[[], object], graph_id: int) -> object:
        """Re-run the captured work for a replay."""
        return fn()

    def graph_bytes(self, outputs: int) -> int:
        """What one new graph takes of its pool: its outputs."""
        return outputs

    def kept_by_capture(self) -> int:
        """What this capture takes outside every pool and keeps: nothing here."""
        return 0

    def used_outside_pools(self) -> int:
        """Device memory in use outside every graph pool (weights, the KV cache): none here."""
        return 0

    # -- memory

    def _release(self, pool: object, nbytes: int) -> None:
        self._pool_bytes[pool] -= nbytes
        if pool[0] == "private-pool":
            del self._pool_bytes[pool]

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def device_memory(self) -> tuple[int, int]:
        used = self.used_outside_pools() + sum(self._pool_bytes.values())
        return self.device_total - used, self.device_total

    def device_name(self) -> str:
        return "simulated"

    def pool_bytes(self, pool: object) -> int:
        """Bytes held by ``pool``; with None, the allocator's reserved counter: every pool and
        what is held outside them for graphs (``used_outside_pools``)."""
        if pool is None:
            return sum(self._pool_bytes.values())
        return self._pool_bytes.get(pool, 0)
