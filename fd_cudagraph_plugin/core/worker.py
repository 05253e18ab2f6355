"""What one worker process holds for the plugin: its live backends and its capture sessions.

A FastDeploy worker builds one backend per decorated backbone (the target model's, an MTP
draft's) and runs its capture loops in sessions. Backends join the session that is open when they
are built or when it opens, and remember on themselves whether a session has closed for them; the
worker only says which session is open and whether any has run. Each backend holds the worker it
was built in, so a test builds a fresh one (``reset_for_tests``) as a fresh process would have.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class Worker:
    def __init__(self) -> None:
        self._backends: list[weakref.ref] = []
        self._lock = threading.Lock()
        #: The ``session.CaptureSession`` open now, if any (sessions do not nest; sessions
        #: import this module, not the other way round).
        self.session: Any = None
        #: Sessions that have ended in this process: once one has, a backend that never joined
        #: one runs every step eagerly (a capture on one rank alone hangs tensor parallelism).
        self.sessions_ended = 0
        #: This process's links to its tensor-parallel group's agreement server, by name.
        self.links: dict[str, Any] = {}
        #: Names of agreement channels in Paddle's job store start with this (tests, which run
        #: several "workers" one after another in one job, give each its own).
        self.link_prefix = "fd-cudagraph/v1"
        #: The reserve FD_CUDAGRAPH_KV_RESERVE took out of FastDeploy's KV budget (a
        #: ``budget.Reserve``), and what capture sessions took since, to warn when it was short.
        self.kv_reserve: Any = None
        self.taken_since_reserve = 0
        #: What the probe of FD_CUDAGRAPH_KV_RESERVE=auto left taken on the device after its
        #: graphs were released, added once to the next record (see ``hooks.probe``).
        self.probe_kept = 0
        self.reserve_warned = False

    def add(self, backend: Any) -> None:
        with self._lock:
            self._backends[:] = [ref for ref in self._backends if ref() is not None]
            self._backends.append(weakref.ref(backend))

    def backends(self) -> list[Any]:
        """The live backends, oldest first."""
        with self._lock:
            return [b for b in (ref() for ref in self._backends) if b is not None]


_worker = Worker()


def current() -> Worker:
    return _worker


def reset_for_tests() -> Worker:
    """Start afresh, as a new worker process would: no backends, no session."""
    global _worker
    _worker = Worker()
    return _worker
