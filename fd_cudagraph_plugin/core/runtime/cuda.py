"""Paddle CUDA graphs. The only module that touches ``paddle.device.cuda.graphs``.

Not exercised on the CPU-only machines this project is tested on: everything above this seam is
tested against ``simulated.py``; see docs/modes.md for what was verified where.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import paddle

from fd_cudagraph_plugin.core.errors import ConfigError


def cuda_graph_support() -> bool | None:
    """Paddle's own verdict on CUDA graphs for this build; None when this Paddle cannot say."""
    from paddle.device.cuda import graphs

    probe = getattr(graphs, "is_cuda_graph_supported", None)
    return None if probe is None else bool(probe())


class CudaGraph:
    __slots__ = ("_graph", "replay")

    def __init__(self, graph: object) -> None:
        self._graph = graph
        #: Paddle's own public ``CUDAGraph.replay``, bound once: no wrapper frame on the hot path.
        self.replay = graph.replay

    def release(self) -> None:
        graph, self._graph = self._graph, None
        self.replay = _released
        if graph is not None:
            graph.reset()


def _released() -> None:
    raise RuntimeError("replay of a released CUDA graph")


class CudaRuntime:
    name = "cuda"
    real_graphs = True

    def __init__(self) -> None:
        if not paddle.is_compiled_with_cuda():
            raise ConfigError(
                "FD_CUDAGRAPH_RUNTIME=cuda but this Paddle is not compiled with CUDA. Install "
                "paddlepaddle-gpu, turn CUDA graphs off with --graph-optimization-config "
                "'{\"use_cudagraph\": false}', or set FD_CUDAGRAPH_RUNTIME=simulated for a CPU "
                "test."
            )
        from paddle.device.cuda import graphs

        self._graphs = graphs

    def new_pool(self) -> object:
        return paddle.base.core.CUDAGraph.gen_new_memory_pool_id()

    def capture(self, fn: Callable[[], object], pool: object) -> tuple[CudaGraph, object]:
        graph = self._graphs.CUDAGraph(pool_id=pool)
        paddle.device.synchronize()
        graph.capture_begin()
        try:
            outputs = fn()
        except BaseException:
            # End the stream capture before anything else runs on the stream, then drop the
            # half-built graph. Either step may fail on an invalidated capture; the error that
            # matters to the operator is the original one, re-raised below.
            with contextlib.suppress(Exception):
                graph.capture_end()
            if getattr(graph, "_graph", None) is not None:
                with contextlib.suppress(Exception):
                    graph.reset()
            raise
        graph.capture_end()
        paddle.device.synchronize()
        return CudaGraph(graph), outputs

    def release_pool(self, pool: object) -> None:
        # Paddle counts the graphs of each pool id and frees the pool with its last graph's
        # reset(); empty_cache() then returns the memory to the driver.
        return None

    def dump_dot(self, graph: CudaGraph, path: str) -> bool:
        graph._graph.print_to_dot_files(path, 1 << 0)
        return True

    def synchronize(self) -> None:
        paddle.device.synchronize()

    def empty_cache(self) -> None:
        paddle.device.cuda.empty_cache()

    def pool_bytes(self, pool: object) -> int:
        # Paddle exposes no per-pool statistic. Graph pools are reserved memory, and only the
        # capture runs while the caller diffs this, so the growth is what the capture reserved.
        return int(paddle.device.cuda.memory_reserved())
