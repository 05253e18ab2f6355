"""The channel tensor-parallel ranks agree over, before any of them enters a collective that a
failed rank would not join.

A capture session has fixed agreement points (``session.py`` says where). At each, every rank
posts its status (ok, or what failed) and gets back one outcome, the same on every rank:

* ``complete``: every rank posted; the outcome carries each rank's status;
* ``abandoned``: a rank gave up waiting (``FD_CUDAGRAPH_RANK_TIMEOUT``) or a rank's connection
  dropped (its process exited); the outcome names the ranks that never posted.

Why not FastDeploy's TP group: on GPUs it is NCCL, so a collective over it allocates GPU memory
(``all_gather_object`` pickles into a device tensor and syncs on it), runs on the failed rank's
stream, and waits without a timeout. After an out-of-memory or a capture that Paddle left open,
none of that can be trusted. Why not Paddle's global TCP store alone: it is CPU-only and shared by
every rank of the job (``fleet.init`` creates it in every FastDeploy worker), but each ``add`` or
``get`` waits about 44 ms for its reply on loopback (measured with Paddle 3.3.1), and ``get`` has
no timeout. So TP rank 0 runs a small TCP server in a daemon thread (``TCP_NODELAY``), found by the
other ranks through the store once per process, and each point costs one request and one reply.
The server alone decides each point's outcome, so no two ranks can see different ones.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("fd_cudagraph_plugin")

_HEADER = struct.Struct("!I")
#: Seconds between reads of the store while waiting for TP rank 0 to publish its address; each
#: read is one store round trip (about 44 ms).
_STORE_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Outcome:
    """What every rank learns at one agreement point."""

    label: str
    #: Each rank's posted status (None for "ok"), by rank; ranks that never posted are absent.
    statuses: dict[int, dict[str, Any] | None]
    #: Ranks that did not post: empty when the point completed.
    missing: tuple[int, ...] = ()
    #: Of ``missing``: ranks whose connection dropped (their process exited).
    lost: tuple[int, ...] = ()
    #: Seconds this rank waited, when it gave up; 0 otherwise.
    waited: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def failures(self) -> dict[int, dict[str, Any]]:
        """The failures posted, by rank (a status ``{"failure": {...}}``)."""
        return {
            rank: status["failure"]
            for rank, status in sorted(self.statuses.items())
            if status and "failure" in status
        }

    def shared(self) -> list[Any]:
        """Each rank's payload (a status ``{"payload": ...}``), in rank order."""
        return [(self.statuses.get(r) or {}).get("payload") for r in sorted(self.statuses)]


class Link(Protocol):
    """One rank's end of the agreement channel of its tensor-parallel group."""

    rank: int
    world: int

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        """Post ``status`` (None: ok) at the next point and wait at most ``timeout`` seconds."""

    def next_epoch(self) -> int:
        """A new capture session: points are numbered from 0 again."""


class LocalLink:
    """A single rank: every point completes at once with this rank's status."""

    rank = 0
    world = 1

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        return Outcome(label, {0: status})

    def next_epoch(self) -> int:
        return 0


# ----------------------------------------------------------------------------------- wire


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None when the peer closed the connection."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(sock, _HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


def _read_exactly(sock: socket.socket, count: int) -> bytes | None:
    chunks = []
    while count:
        chunk = sock.recv(count)
        if not chunk:
            return None
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------------- server


@dataclass
class _Point:
    label: str = ""
    posts: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    outcome: dict[str, Any] | None = None
    waiting: set[int] = field(default_factory=set)
    delivered: set[int] = field(default_factory=set)


class _Decider:
    """The rules of the server, apart from sockets: posts, give-ups and lost ranks in, the
    outcome of each point out. Not thread-safe; the server calls it from one thread."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.points: dict[tuple[int, int], _Point] = {}
        self.lost: set[int] = set()
        #: (rank, point key, outcome) messages to send, filled by the calls below.
        self.outbox: list[tuple[int, tuple[int, int], dict[str, Any]]] = []

    def post(self, rank: int, key: tuple[int, int], label: str, status: Any) -> None:
        point = self.points.setdefault(key, _Point())
        point.labels[rank] = label
        point.waiting.add(rank)
        if point.outcome is None:
            point.posts[rank] = status
            if self.lost - set(point.posts) or len(point.posts) == self.world:
                self._decide(key, point)
        self._deliver(key, point)

    def give_up(self, rank: int, key: tuple[int, int]) -> None:
        point = self.points.get(key)
        if point is None or rank in point.delivered:
            return  # the outcome is already on its way to that rank
        if point.outcome is None:
            self._decide(key, point)
        self._deliver(key, point)

    def lose(self, rank: int) -> None:
        self.lost.add(rank)
        for key, point in list(self.points.items()):
            if point.outcome is None and rank not in point.posts:
                self._decide(key, point)
                self._deliver(key, point)

    def _decide(self, key: tuple[int, int], point: _Point) -> None:
        missing = sorted(set(range(self.world)) - set(point.posts))
        point.outcome = {
            "key": list(key),
            "statuses": {str(r): s for r, s in point.posts.items()},
            "labels": {str(r): s for r, s in point.labels.items()},
            "missing": missing,
            "lost": sorted(self.lost.intersection(missing)),
        }

    def _deliver(self, key: tuple[int, int], point: _Point) -> None:
        if point.outcome is None:
            return
        for rank in sorted(point.waiting - point.delivered):
            self.outbox.append((rank, key, point.outcome))
            point.delivered.add(rank)
        if point.delivered | self.lost >= set(range(self.world)):
            del self.points[key]


class _Server(threading.Thread):
    """TP rank 0's agreement server: one connection per rank, one decider."""

    def __init__(self, world: int, host: str, token: str) -> None:
        super().__init__(name="fd-cudagraph-agreement", daemon=True)
        self.token = token
        self.decider = _Decider(world)
        self.listener = socket.create_server((host, 0))
        self.address = self.listener.getsockname()[:2]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.ranks: dict[socket.socket, int] = {}
        self.sockets: dict[int, socket.socket] = {}

    def run(self) -> None:
        while True:
            for event, _ in self.selector.select():
                sock = event.fileobj
                if sock is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:  # closed under us: the ranks already connected still count
                        self.selector.unregister(sock)
                        continue
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.setblocking(True)
                    self.selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    message = _receive(sock)
                except (OSError, ValueError):
                    message = None
                if message is None:
                    self._drop(sock)
                else:
                    self._handle(sock, message)
            for rank, _key, outcome in self.decider.outbox:
                target = self.sockets.get(rank)
                if target is not None:
                    try:
                        _send(target, outcome)
                    except OSError:
                        self._drop(target)
            self.decider.outbox.clear()

    def _handle(self, sock: socket.socket, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "hello":
            if message.get("token") != self.token:
                self._drop(sock)
                return
            rank = int(message["rank"])
            self.ranks[sock] = rank
            self.sockets[rank] = sock
            return
        rank = self.ranks.get(sock)
        if rank is None:
            self._drop(sock)
            return
        key = (int(message["key"][0]), int(message["key"][1]))
        if op == "post":
            self.decider.post(rank, key, str(message["label"]), message.get("status"))
        elif op == "give_up":
            self.decider.give_up(rank, key)

    def _drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        sock.close()
        rank = self.ranks.pop(sock, None)
        if rank is not None and self.sockets.get(rank) is sock:
            del self.sockets[rank]
            self.decider.lose(rank)


# --------------------------------------------------------------------------------- client


class Store(Protocol):
    """What the agreement needs of Paddle's ``TCPStore``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


class SocketLink:
    """A rank's connection to its group's agreement server (hosted by the group's rank 0)."""

    def __init__(self, sock: socket.socket, rank: int, world: int, server: _Server | None) -> None:
        self._sock = sock
        self.rank = rank
        self.world = world
        self._server = server  # kept alive with the link on rank 0
        self._epoch = -1
        self._point = 0
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls, store: Store, prefix: str, rank: int, world: int, host: str, timeout: float
    ) -> SocketLink:
        """Rank 0 starts the server and publishes its address in ``store`` under ``prefix``;
        every rank waits for it (at most ``timeout`` seconds) and connects."""
        server = None
        if rank == 0:
            server = _Server(world, host, secrets.token_hex(16))
            server.start()
            address = {"host": server.address[0], "port": server.address[1]}
            store.set(f"{prefix}/server", json.dumps({**address, "token": server.token}))
            store.add(f"{prefix}/ready", 1)
        deadline = time.monotonic() + timeout
        while store.add(f"{prefix}/ready", 0) < 1:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"tensor-parallel rank 0 did not start the CUDA graph agreement server within "
                    f"{timeout:.0f} s"
                )
            time.sleep(_STORE_POLL_SECONDS)
        published = json.loads(store.get(f"{prefix}/server"))
        sock = socket.create_connection(
            (published["host"], published["port"]), timeout=max(deadline - time.monotonic(), 1)
        )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        _send(sock, {"op": "hello", "rank": rank, "token": published["token"]})
        return cls(sock, rank, world, server)

    def next_epoch(self) -> int:
        with self._lock:
            self._epoch += 1
            self._point = 0
            return self._epoch

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        with self._lock:
            key = [self._epoch, self._point]
            self._point += 1
            started = time.monotonic()
            try:
                _send(self._sock, {"op": "post", "key": key, "label": label, "status": status})
                reply = self._await(timeout)
                if reply is _TIMED_OUT:
                    _send(self._sock, {"op": "give_up", "key": key})
                    # The server answers a give-up at once: the outcome it decided, or one it
                    # decides now (abandoned, naming the ranks that did not post).
                    reply = self._await(max(timeout, 30.0))
            except OSError:
                reply = None
            if reply is _TIMED_OUT:
                reply = None
            waited = time.monotonic() - started
            if reply is None:  # the server is gone: TP rank 0's process exited
                return Outcome(label, {self.rank: status}, (0,), (0,), waited)
            return _outcome(label, reply, waited if reply["missing"] else 0.0)

    def _await(self, timeout: float) -> Any:
        """The server's reply; None when it closed the connection; ``_TIMED_OUT``."""
        self._sock.settimeout(max(timeout, 0.001))
        try:
            return _receive(self._sock)
        except TimeoutError:
            return _TIMED_OUT
        finally:
            self._sock.settimeout(None)


_TIMED_OUT = object()


def _outcome(label: str, reply: dict[str, Any], waited: float) -> Outcome:
    return Outcome(
        label=label,
        statuses={int(r): s for r, s in reply["statuses"].items()},
        missing=tuple(reply["missing"]),
        lost=tuple(reply["lost"]),
        waited=waited,
    )


def bind_host() -> str:
    """The address TP rank 0's server listens on: this worker's own endpoint's host (Paddle's
    launcher sets ``PADDLE_CURRENT_ENDPOINT`` in every worker), else loopback."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rpartition(":")[0]
    return host or "127.0.0.1"
