"""The graph-runtime seam: the only code that knows how a graph is captured and replayed.

``cuda.py`` wraps Paddle's CUDA graphs and is the one module that touches
``paddle.device.cuda.graphs``. ``simulated.py`` is a CPU runtime with the same replay semantics,
for tests and the demo on machines whose Paddle has no CUDA. A runtime is always chosen
explicitly: ``FD_CUDAGRAPH_RUNTIME`` or injection, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Graph(Protocol):
    """One captured graph. ``replay`` re-runs the captured work on the captured buffers."""

    def replay(self) -> None: ...

    def release(self) -> None:
        """Drop the graph; its pool memory returns to the pool."""


class GraphRuntime(Protocol):
    name: str
    #: True when replay really runs a device graph (timings mean something).
    real_graphs: bool
    #: True once an eager run has happened in this process: libraries that initialise lazily
    #: (cuBLAS) make a capture of a model never run before fail. Set by ``mark_warm`` only.
    warmed: bool

    def mark_warm(self) -> None:
        """An eager run of a model happened in this process (a warm-up, a probe)."""

    def new_pool(self) -> object:
        """A new memory-pool handle that several graphs may share."""

    def release_pool(self, pool: object) -> None:
        """The pool's last graph is gone; give its memory back (with ``empty_cache``)."""

    def capture(self, fn: Callable[[], object], pool: object) -> tuple[Graph, object]:
        """Run ``fn`` under capture into ``pool``; return the graph and what ``fn`` returned.

        On any error the stream capture is ended and the half-built graph dropped before
        re-raising, so the stream stays usable for eager work. Capturing again may still be
        impossible: Paddle keeps its capture state open after a failed end of capture.
        """

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def pool_bytes(self, pool: object) -> int:
        """Bytes the pool holds now, for per-size accounting (diffed around each capture)."""

    def device_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device from the driver, or None where it cannot say."""

    def device_name(self) -> str:
        """The device model (graph memory differs between models)."""

    def dump_dot(self, graph: Graph, path: str) -> bool:
        """Write the graph's dot file under ``path``; False when the runtime cannot."""


def make_runtime(name: str) -> GraphRuntime:
    """Build the runtime named by ``FD_CUDAGRAPH_RUNTIME``."""
    if name == "simulated":
        from fd_cudagraph_plugin.core.runtime.simulated import SimulatedRuntime

        return SimulatedRuntime()
    from fd_cudagraph_plugin.core.runtime.cuda import CudaRuntime

    return CudaRuntime()


_RUNTIMES: dict[str, GraphRuntime] = {}


def get_runtime(name: str) -> GraphRuntime:
    """The process-wide runtime of that name, so every backend of a process shares its pools."""
    runtime = _RUNTIMES.get(name)
    if runtime is None:
        runtime = _RUNTIMES[name] = make_runtime(name)
    return runtime


def install_runtime(runtime: GraphRuntime, name: str | None = None) -> GraphRuntime | None:
    """Make ``runtime`` the one returned for ``name`` (default: its own name) in tests and tools;
    return the one it replaced."""
    name = name or runtime.name
    previous = _RUNTIMES.get(name)
    _RUNTIMES[name] = runtime
    return previous
