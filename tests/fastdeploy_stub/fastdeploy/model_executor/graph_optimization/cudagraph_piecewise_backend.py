"""Stand-in for the native ``CudaGraphPiecewiseBackend``: no graphs, just eager calls.

It exists so tests can tell whether the native class or a plugin's class was instantiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastdeploy.distributed.communication import custom_ar_clear_ipc_handles


class CudaGraphPiecewiseBackend:
    """Develop / 2.5 / 2.6 signature: ``(fd_config, dy_runnable, runnable)``."""

    def __init__(self, fd_config: Any, dy_runnable: Callable, runnable: Callable) -> None:
        self.fd_config = fd_config
        self.dy_runnable = dy_runnable
        self.runnable = runnable
        self.cudagraph_capture_sizes = fd_config.graph_opt_config.cudagraph_capture_sizes
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
    """Release 2.4 signature: ``(fd_config, runnable)``."""

    def __init__(self, fd_config: Any, runnable: Callable) -> None:
        super().__init__(fd_config=fd_config, dy_runnable=runnable, runnable=runnable)
