"""What one FastDeploy worker process holds for the plugin, and nothing else does.

FastDeploy builds backends one at a time and gives them no shared object, so what outlives one
backend lives here, on one object per process: the live backends, the capture session open now,
the agreement links, the options read once, and the state of the parts that span sessions (the KV
reserve, the lifecycle, the stats reporter, failed side-channel writes), each written by its own
module only. Tests start each case with a fresh ``WorkerProcess`` (``reset_for_tests``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.outputs import OutputFailures


class OpenSession(Protocol):
    """The capture session open now (``session.CaptureSession``), as a new backend meets it."""

    def join(self, member: Any) -> None: ...


class Link(Protocol):
    """A link to the group's agreement (``ranks.link.StoreLink``), as the process keeps it."""

    rank: int
    world: int


class Stoppable(Protocol):
    """The periodic stats thread (``observability.Reporter``)."""

    def stop(self) -> None: ...


class WorkerProcess:
    def __init__(self) -> None:
        self._backends: list[weakref.ref] = []
        self._lock = threading.Lock()
        self._options: PluginOptions | None = None
        #: The capture session open now, if any (sessions do not nest).
        self.session: OpenSession | None = None
        #: Sessions that have ended in this process: once one has, a size first seen later runs
        #: eagerly (a capture on one rank alone hangs tensor parallelism).
        self.sessions_ended = 0
        #: This process's links to its tensor-parallel group's agreement, by name.
        self.links: dict[str, Link] = {}
        #: Keys of the agreement in Paddle's job store start with this (tests, which run several
        #: "workers" one after another in one job, give each its own).
        self.link_prefix = "fd-cudagraph/v5"
        #: An interrupt that reached this process at an agreement point every rank completed:
        #: posted at its next point, or raised when the plugin hands control back (written by
        #: ranks/agreement.py only).
        self.held_interrupt: BaseException | None = None
        self.outputs = OutputFailures()
        #: FD_CUDAGRAPH_KV_RESERVE's state, a ``reserve.KvReserve`` (only reserve.py reads or
        #: writes it).
        self.reserve: object | None = None
        #: The periodic stats thread, once started (written by observability.py).
        self.reporter: Stoppable | None = None
        #: register() has said in the worker log what it did (it may be called again).
        self.announced = False
        #: (class, attribute) pairs the plugin added to FastDeploy's classes (seam.py).
        self.patches: list[tuple[type, str]] = []
        #: The lifecycle's state, a ``lifecycle.Lifecycle`` (only lifecycle.py writes it).
        self.lifecycle: object | None = None

    @property
    def options(self) -> PluginOptions:
        """The ``FD_CUDAGRAPH_*`` options, read from the environment once per process."""
        if self._options is None:
            self._options = PluginOptions.from_env()
        return self._options

    def forget_options(self) -> None:
        """Read the options again at the next use. For tests, which change the environment of
        one process between cases; a worker's never changes."""
        self._options = None

    def add(self, backend: Any) -> None:
        with self._lock:
            self._backends[:] = [ref for ref in self._backends if ref() is not None]
            self._backends.append(weakref.ref(backend))

    def backends(self) -> list[Any]:
        """The live backends, oldest first."""
        with self._lock:
            return [b for b in (ref() for ref in self._backends) if b is not None]


_process = WorkerProcess()


def current() -> WorkerProcess:
    return _process


def reset_for_tests() -> WorkerProcess:
    """Start afresh, as a new worker process would: no backends, no session, options unread."""
    global _process
    _process = WorkerProcess()
    return _process
