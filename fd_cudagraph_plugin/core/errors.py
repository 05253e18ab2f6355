"""The package's exceptions. Each one carries what an operator needs to act on it."""

from __future__ import annotations


class CudaGraphPluginError(Exception):
    """Base class of every error fd-cudagraph-plugin raises on purpose."""


class ConfigError(CudaGraphPluginError, ValueError):
    """A setting (FastDeploy config field or ``FD_CUDAGRAPH_*`` variable) has a bad value."""


class CaptureError(CudaGraphPluginError, RuntimeError):
    """Warm-up or capture of one graph failed; no graph of that size is served. After a failure
    inside the capture itself, Paddle cannot capture again in this process."""


class CaptureIncompleteError(CudaGraphPluginError, ValueError):
    """``check_capture_successful()`` found sizes that should have a graph and have none.

    It is a ``ValueError`` because FastDeploy's own backend raises ``ValueError`` there.
    """


class CaptureOrderError(CudaGraphPluginError, RuntimeError):
    """Graphs were captured in an order that differs from the plan every rank follows."""


class RankMismatchError(CudaGraphPluginError, RuntimeError):
    """Tensor-parallel ranks disagree about the capture plan; capturing would hang."""


class TraceError(CudaGraphPluginError, ValueError):
    """A trace or stats file given to ``fd-cudagraph tune`` is unreadable; names file and line."""


class AddressGuardError(CudaGraphPluginError, RuntimeError):
    """A graph input now lives at another address than at capture."""


class SelfCheckError(CudaGraphPluginError, RuntimeError):
    """A replay disagreed with eager on the same inputs (``FD_CUDAGRAPH_SELF_CHECK``)."""
