"""``GraphOptBackend``: picks eager, static (SOT) or the piecewise CUDA-graph backend per call.

The module global ``CudaGraphPiecewiseBackend`` is looked up when the first call builds the
backend, so rebinding it here (what a model-register plugin does) swaps the implementation.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from fastdeploy.model_executor.graph_optimization import cudagraph_piecewise_backend as _native
from fastdeploy.model_executor.graph_optimization.cudagraph_piecewise_backend import (
    CudaGraphPiecewiseBackend,
)

# True: build the backend like release 2.4, with only ``fd_config=`` and ``runnable=``.
LEGACY_TWO_ARG = False


def emulate_release_2_4(enabled: bool = True) -> None:
    """Test helper: switch this module (flag and native class) to the 2.4 two-argument form."""
    global LEGACY_TWO_ARG, CudaGraphPiecewiseBackend
    LEGACY_TWO_ARG = enabled
    if enabled:
        CudaGraphPiecewiseBackend = _native.LegacyCudaGraphPiecewiseBackend
    else:
        CudaGraphPiecewiseBackend = _native.CudaGraphPiecewiseBackend


def _to_static(runnable: Callable) -> Callable:
    import paddle.jit.sot

    static_fn = paddle.jit.sot.symbolic_translate(runnable.__func__, training=False)
    return types.MethodType(static_fn, runnable.__self__)


class GraphOptBackend:
    cudagraph_piecewise_backend: Any = None

    def __init__(self, runnable: Callable, fd_config: Any) -> None:
        goc = fd_config.graph_opt_config
        self.fd_config = fd_config
        self.runnable = runnable
        self.dy_runnable = runnable
        self.max_captre_size = goc.cudagraph_capture_sizes[0]
        self.max_captre_size_prefill = goc.max_capture_shape_prefill
        self._debug_count_total_step = 0
        self._debug_count_cudagraph_replay = 0
        if goc.graph_opt_level > 0:
            self.runnable = _to_static(runnable)

    def _create_piecewise_backend(self) -> Any:
        if LEGACY_TWO_ARG:
            return CudaGraphPiecewiseBackend(fd_config=self.fd_config, runnable=self.runnable)
        return CudaGraphPiecewiseBackend(
            fd_config=self.fd_config, dy_runnable=self.dy_runnable, runnable=self.runnable
        )

    def _skip_graph(self, forward_meta: Any, real_shape: int) -> bool:
        if not forward_meta.step_use_cudagraph:
            return True
        goc = self.fd_config.graph_opt_config
        if forward_meta.exist_prefill:
            static_split = goc.graph_opt_level > 0 and not goc.full_cuda_graph
            return not (static_split and real_shape <= self.max_captre_size_prefill)
        return real_shape > self.max_captre_size

    def __call__(self, **kwargs: Any) -> Any:
        self._debug_count_total_step += 1
        if not self.fd_config.graph_opt_config.use_cudagraph:
            return self.runnable(**kwargs)
        if self.cudagraph_piecewise_backend is None:
            self.cudagraph_piecewise_backend = self._create_piecewise_backend()
        forward_meta = kwargs["forward_meta"]
        assert forward_meta.ids_remove_padding is not None
        real_shape = forward_meta.ids_remove_padding.shape[0]
        if self._skip_graph(forward_meta, real_shape):
            return self.dy_runnable(**kwargs)
        self._debug_count_cudagraph_replay += 1
        return self.cudagraph_piecewise_backend.__call__(**kwargs)

    def clear_cudagraph_piecewise_backend(self) -> None:
        # AttributeError when no backend was built yet, as upstream.
        self.cudagraph_piecewise_backend.clear_graph()
