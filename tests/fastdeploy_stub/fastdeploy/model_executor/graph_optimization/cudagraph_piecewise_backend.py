"""Stand-in for the native ``CudaGraphPiecewiseBackend``: no graphs, just eager calls.

It exists so tests can tell whether the native class or a plugin's class was instantiated.
Like upstream (2.5+), the constructor reads ``fd_config.speculative_config.method``, so a None
``speculative_config`` fails here as it does there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastdeploy.distributed.communication import custom_ar_clear_ipc_handles


class CudaGraphPiecewiseBackend:
    """2.5 / 2.6 / develop signature: ``(fd_config, dy_runnable, runnable)``."""

    _fd_stub_native = True  # lets _stub_version tell its own classes from a plugin's

    def __init__(self, fd_config: Any, dy_runnable: Callable, runnable: Callable) -> None:
        self.fd_config = fd_config
        self.dy_runnable = dy_runnable
        self.runnable = runnable
        self.cudagraph_capture_sizes = fd_config.graph_opt_config.cudagraph_capture_sizes
        self.speculative_decoding = fd_config.speculative_config.method is not None
        self.calls = 0
        self.clear_count = 0

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        return self.dy_runnable(**kwargs)

    def clear_graph(self) -> None:
        custom_ar_clear_ipc_handles()
        self.clear_count += 1

    def check_capture_successful(self) -> None:
        """Nothing is captured here, so there is nothing to report."""


class LegacyCudaGraphPiecewiseBackend(CudaGraphPiecewiseBackend):
    """Release 2.4 signature: ``(fd_config, runnable)``; 2.4 runs ``runnable`` for every entry."""

    def __init__(self, fd_config: Any, runnable: Callable) -> None:
        self.fd_config = fd_config
        self.dy_runnable = self.runnable = runnable
        self.cudagraph_capture_sizes = fd_config.graph_opt_config.cudagraph_capture_sizes
        self.calls = 0
        self.clear_count = 0


def native_class(version: str) -> type:
    return LegacyCudaGraphPiecewiseBackend if version == "2.4" else CudaGraphPiecewiseBackend
