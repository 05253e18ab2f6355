"""fd-cudagraph-plugin: a replacement CUDA-graph backend for PaddlePaddle FastDeploy 2.x.

What has been verified where (CPU stand-ins, a torch stand-in on one GPU; not yet Paddle on a
GPU) is in the README and docs/design.md.

Install with pip and set ``FD_PLUGINS=fd_cudagraph_plugin``. Importing this package is cheap and
does no CUDA work; Paddle is imported only when the backend is first used.
"""

from __future__ import annotations

__version__ = "0.8.0"
__all__ = ["CudaGraphBackend", "register", "__version__"]


def __getattr__(name: str):
    if name == "CudaGraphBackend":
        from fd_cudagraph_plugin.core.backend import CudaGraphBackend

        return CudaGraphBackend
    if name == "register":
        from fd_cudagraph_plugin.plugin import register

        return register
    raise AttributeError(name)
