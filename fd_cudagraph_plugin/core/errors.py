"""The package's exceptions, each carrying what an operator needs to act on it, and how the plugin
writes figures in them and in its log lines."""

from __future__ import annotations


class CudaGraphPluginError(Exception):
    """Base class of every error fd-cudagraph-plugin raises on purpose."""


class ConfigError(CudaGraphPluginError, ValueError):
    """A setting (FastDeploy config field or ``FD_CUDAGRAPH_*`` variable) has a bad value."""


class CaptureError(CudaGraphPluginError, RuntimeError):
    """A capture session stopped: a warm-up, capture, registration, self-check or probe failed on
    some rank, or a rank never came. Under tensor parallelism every rank raises the same one, at
    the same agreement point. After a failure inside the capture itself, Paddle cannot capture
    again in that process.

    ``failed_ranks`` names the ranks whose own step failed, ``missing_ranks`` those that never
    reached the point; ``stage`` is where (``warm-up``, ``capture``, ``registration``, ...)."""

    def __init__(
        self,
        message: str,
        *,
        stage: str = "",
        failed_ranks: tuple[int, ...] = (),
        missing_ranks: tuple[int, ...] = (),
        out_of_memory: bool = False,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.failed_ranks = failed_ranks
        self.missing_ranks = missing_ranks
        #: A rank ran out of device memory.
        self.out_of_memory = out_of_memory
        #: Every rank raised it at one agreement point (``agreement.py`` sets it).
        self.agreed = False


class RankMismatchError(CaptureError):
    """Tensor-parallel ranks disagree about the capture plan; capturing would hang."""


class RankTimeoutError(CaptureError):
    """A tensor-parallel rank never reached an agreement point (it exited, hangs, or does not run
    the plugin); the ranks that waited stop instead of entering a collective it will not join."""


class SelfCheckError(CaptureError):
    """A replay disagreed with eager on the same inputs (``FD_CUDAGRAPH_SELF_CHECK=error``)."""


class CaptureIncompleteError(CudaGraphPluginError, ValueError):
    """``check_capture_successful()`` found sizes that should have a graph and have none.

    It is a ``ValueError`` because FastDeploy's own backend raises ``ValueError`` there.
    """


class CaptureOrderError(CudaGraphPluginError, RuntimeError):
    """Graphs were captured in an order that differs from the plan every rank follows."""


class AddressGuardError(CudaGraphPluginError, RuntimeError):
    """A graph input now lives at another address than at capture."""


def human_bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``1 graph``, ``2 graphs``; ``many`` for nouns that do not just take an s."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
