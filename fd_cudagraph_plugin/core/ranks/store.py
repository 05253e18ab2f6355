"""The plugin's own client to Paddle's job store: the master every worker of the job already
reaches (``paddle.distributed`` creates it in global rank 0's process), under keys of its own.

Not the global client: Paddle's client is not safe from two threads, sets no ``TCP_NODELAY``
(an add costs about 43 ms against the master's delayed ACKs; 0.04 ms with it) and has no timeout on
its reads (a stopped master blocks it for ever). So this module opens a client of its own to the
same master and, through its socket, sets ``TCP_NODELAY`` and a receive timeout of the operator's
``FD_CUDAGRAPH_RANK_TIMEOUT``: a call the master does not answer in time raises, and the client is
replaced (a late reply would be read as the next call's). A connection that fails is made again;
what a failed call did is for the caller to find out (``link.py`` reads the counter again).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any, Protocol


class Store(Protocol):
    """What the agreement asks of a store: Paddle's ``TCPStore``, or the tests' in-memory one."""

    def add(self, key: str, amount: int) -> int: ...

    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: bytes) -> None: ...


class StoreError(RuntimeError):
    """The job store did not answer, or its connection failed. ``reconnected``: the connection
    failed at once (a reset, not a silent master) and a new one is open, so the call may be
    made again where making it twice changes nothing."""

    def __init__(self, message: str, reconnected: bool = False) -> None:
        super().__init__(message)
        self.reconnected = reconnected


#: What Paddle's client says when its receive or send timeout runs out (``EAGAIN``). Any other
#: failure (a reset, a broken pipe, a call this process's own stop interrupted, ``EINTR``) is
#: the connection's, and a new one is made.
_TIMED_OUT = "Resource temporarily unavailable"

_HOST = re.compile(r"^[A-Za-z0-9.:\[\]_-]{1,253}$")


def master_address(environ: Mapping[str, str]) -> tuple[str, int]:
    """Where the job store's master listens, as Paddle's ``init_parallel_env`` finds it:
    ``MASTER_ADDR`` and ``MASTER_PORT``, else ``PADDLE_MASTER``, else the first of
    ``PADDLE_TRAINER_ENDPOINTS``. ``StoreError`` names a value that is not a host and a port."""
    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    name = "MASTER_ADDR and MASTER_PORT"
    endpoint = f"{host}:{port}" if host and port else ""
    if not endpoint:
        name, endpoint = "PADDLE_MASTER", environ.get("PADDLE_MASTER", "")
    if not endpoint:
        name = "PADDLE_TRAINER_ENDPOINTS"
        endpoint = environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]
    host, _, port = endpoint.strip().rpartition(":")
    if not host or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreError(
            f"{name} does not name the job store's master as host:port ({endpoint[:80]!r}); "
            f"Paddle's launcher sets it in every worker of a tensor-parallel job"
        )
    return host.strip("[]"), int(port)


class JobStore:
    """A client of the plugin's own to the job store's master at ``host:port``. Every call is
    bounded by ``timeout`` seconds; one that fails raises ``StoreError`` after the client has been
    replaced (or could not be)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.endpoint = f"{host}:{port}"
        self._lock = threading.Lock()
        self._client: Any = None
        self.reconnects = 0
        self._connect()

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda client: int(client.add(key, amount)))

    def get(self, key: str) -> bytes:
        return self._call(lambda client: bytes(client.get(key)))

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda client: client.set(key, value))

    def _call(self, operation):
        with self._lock:
            if self._client is None:
                self._connect()
            try:
                return operation(self._client)
            except (ValueError, RuntimeError, OSError, SystemError) as error:
                # The reply may still come, on this connection: never read from it again.
                self._client = None
                failure = error
            if _TIMED_OUT in str(failure):  # the receive timeout: the master did not answer
                raise StoreError(
                    f"no answer within {self.timeout:g} s (FD_CUDAGRAPH_RANK_TIMEOUT)"
                ) from failure
            try:
                self._connect()
            except StoreError as again:
                raise StoreError(f"{_first_line(failure)}; {again}") from failure
            self.reconnects += 1
            raise StoreError(_first_line(failure), reconnected=True) from failure

    def _connect(self) -> None:
        """A new client, within ``timeout``: Paddle's constructor retries a refused connect every
        3 s for ever, so the master is reached first with a plain connect, and the constructor
        runs in a thread waited for until the deadline."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout):
                pass
        except OSError as error:
            why = f"the job store at {self.endpoint} cannot be reached ({error})"
            raise StoreError(why) from None
        from paddle.base import core  # here, not in the thread: its first import takes seconds

        made: list[Any] = []
        failed: list[BaseException] = []
        ours: list[int] = []

        def construct() -> None:
            before = _sockets()
            try:
                # world_size 0: a client that does not count itself among the job's workers.
                made.append(core.TCPStore(self.host, self.port, False, 0, 900))
            except BaseException as error:
                failed.append(error)
            ours.extend(_sockets() - before)

        thread = threading.Thread(target=construct, name="fd-cudagraph-store", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not made:
            why = _first_line(failed[0]) if failed else f"no answer within {self.timeout:g} s"
            raise StoreError(f"the job store at {self.endpoint} did not accept a client ({why})")
        self._client = made[0]
        for fd in ours:
            _tune(fd, self.port, self.timeout)


def _sockets() -> set[int]:
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    found.add(int(name))
    return found


def _tune(fd: int, port: int, timeout: float) -> None:
    """Set ``TCP_NODELAY`` and the timeouts on the socket at ``fd`` if it is a connection to the
    master's port (the client's own, opened while it was made). Through a duplicate: closing it
    leaves the client's socket open."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with sock, contextlib.suppress(OSError):
        if sock.type != socket.SOCK_STREAM or sock.getpeername()[1] != port:
            return
        whole = max(int(timeout), 0)
        bound = struct.pack("ll", whole, int((timeout - whole) * 1e6))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
