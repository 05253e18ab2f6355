"""Paddle CUDA graphs. The only module that touches Paddle's CUDA-graph API.

What it relies on, from Paddle 3.x (``paddle/device/cuda/graphs.py`` and
``paddle/phi/backends/gpu/cuda/cuda_graph.cc``):

* ``CUDAGraph(place, mode, pool_id)``: ``capture_begin()`` starts the process's one capture (a
  second one fails: "CUDA Graph can only captured one by one"), ``capture_end()`` ends it and keeps
  the graph; graphs given the same pool id share one reference-counted pool, freed when the last
  of them is ``reset()``; ``replay()`` after ``reset()`` raises PermissionDenied.
* ``mode="thread_local"`` (Paddle's default, said here on purpose): only this thread's unsafe
  CUDA calls invalidate the capture, so the plugin's reporter and agreement threads cannot.
* If ``cudaStreamEndCapture`` fails (an invalidated capture), ``capture_end()`` raises before
  Paddle clears its capturing state, and no capture works in that process again.

Tests run this module against a fake of that API built from the same source
(``tests/fake_paddle_cuda.py``); a real GPU run is through the torch stand-in
(``benchmarks/gpu``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from fd_cudagraph_plugin.core.errors import ConfigError


def paddle_cuda() -> Any:
    """The Paddle calls this runtime makes, in one place (tests pass a fake instead)."""
    import paddle

    namespace = SimpleNamespace(
        compiled_with_cuda=paddle.is_compiled_with_cuda,
        synchronize=paddle.device.synchronize,
        memory_reserved=lambda: paddle.device.cuda.memory_reserved(),
        empty_cache=paddle.device.cuda.empty_cache,
        device_memory=_driver_memory,
        device_name=lambda: paddle.device.cuda.get_device_name(),
        CUDAGraph=None,
        new_pool_id=None,
        is_cuda_graph_supported=None,
    )
    if paddle.is_compiled_with_cuda():
        from paddle.device.cuda import graphs

        namespace.CUDAGraph = graphs.CUDAGraph
        namespace.new_pool_id = paddle.base.core.CUDAGraph.gen_new_memory_pool_id
        namespace.is_cuda_graph_supported = graphs.is_cuda_graph_supported
    return namespace


_nvml: list[Any] = []  # (pynvml, handle) once NVML is initialised; [None] where it cannot be


def _driver_memory() -> tuple[int, int] | None:
    """(free, total) bytes of this worker's GPU from the driver, as FastDeploy's memory profile
    reads them (pynvml, which FastDeploy depends on); None where NVML cannot say. NVML is
    initialised once per process: nvmlInit costs milliseconds, and counts its callers."""
    try:
        if not _nvml:
            import pynvml

            pynvml.nvmlInit()
            _nvml.append((pynvml, pynvml.nvmlDeviceGetHandleByIndex(_nvml_index())))
        if _nvml[0] is None:
            return None
        pynvml, handle = _nvml[0]
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # no pynvml, no driver, no such device: the figures are left out
        if not _nvml:
            _nvml.append(None)
        return None
    return int(info.free), int(info.total)


def _nvml_index() -> int:
    """NVML counts physical GPUs; Paddle's device id counts those CUDA_VISIBLE_DEVICES shows.
    Paddle's launcher gives every worker its device in FLAGS_selected_gpus."""
    logical = int((os.environ.get("FLAGS_selected_gpus") or "0").split(",")[0])  # noqa: SIM112
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if logical < len(visible) and visible[logical].isdigit():
        return int(visible[logical])
    return logical


def cuda_graph_support() -> bool | None:
    """Paddle's own verdict on CUDA graphs for this build; None when this Paddle cannot say."""
    from paddle.device.cuda import graphs

    probe = getattr(graphs, "is_cuda_graph_supported", None)
    return None if probe is None else bool(probe())


class CudaGraph:
    """One captured Paddle graph. ``replay`` is Paddle's own bound method: no wrapper frame on
    the hot path. After ``release()`` the backend holds no reference to it (its entry drops
    ``replay``); a replay of Paddle's object after ``reset()`` raises Paddle's PermissionDenied."""

    __slots__ = ("_graph", "replay")

    def __init__(self, graph: Any) -> None:
        self._graph = graph
        self.replay = graph.replay

    def release(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.reset()


class CudaRuntime:
    name = "cuda"
    real_graphs = True

    def __init__(self, api: Any = None) -> None:
        api = api if api is not None else paddle_cuda()
        if not api.compiled_with_cuda() or api.CUDAGraph is None:
            raise ConfigError(
                "FD_CUDAGRAPH_RUNTIME=cuda but this Paddle is not compiled with CUDA. Install "
                "paddlepaddle-gpu, turn CUDA graphs off with --graph-optimization-config "
                "'{\"use_cudagraph\": false}', or set FD_CUDAGRAPH_RUNTIME=simulated for a CPU "
                "test."
            )
        self._api = api
        #: True once an eager run has happened in this process (a cold capture fails).
        self.warmed = False

    def mark_warm(self) -> None:
        self.warmed = True

    def new_pool(self) -> object:
        return self._api.new_pool_id()

    def capture(self, fn: Callable[[], object], pool: object) -> tuple[CudaGraph, object]:
        graph = self._api.CUDAGraph(pool_id=pool, mode="thread_local")
        self._api.synchronize()
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
        # On an invalidated capture this raises, Paddle's capture state stays open and no graph
        # exists: nothing to release, and nothing to retry in this process.
        graph.capture_end()
        self._api.synchronize()
        return CudaGraph(graph), outputs

    def release_pool(self, pool: object) -> None:
        # Paddle counts the graphs of each pool id and frees the pool with its last graph's
        # reset(); empty_cache() then returns the memory to the driver.
        return None

    def dump_dot(self, graph: CudaGraph, path: str) -> bool:
        graph._graph.print_to_dot_files(path, 1 << 0)
        return True

    def synchronize(self) -> None:
        self._api.synchronize()

    def empty_cache(self) -> None:
        self._api.empty_cache()

    def device_memory(self) -> tuple[int, int] | None:
        return self._api.device_memory()

    def device_name(self) -> str:
        try:
            return str(self._api.device_name())
        except Exception:  # the record key only loses the device model
            return "unknown CUDA device"

    def pool_bytes(self, pool: object) -> int:
        # Paddle exposes no per-pool statistic. Graph pools are reserved memory, and only the
        # capture runs while the caller diffs this, so the growth is what the capture reserved.
        return int(self._api.memory_reserved())
