"""The channel tensor-parallel ranks agree over: TP rank 0's server, and each rank's link to it.
What travels on it, and what a valid message is, is ``wire.py``.

A capture session has fixed agreement points (``agreement.py`` says where and what they mean). At
each, every rank posts its status (ok, a payload, or what failed) and gets back one outcome, the
same on every rank, decided by the server alone:

* complete: every rank posted; the outcome carries each rank's status and label;
* abandoned: a rank gave up waiting (``FD_CUDAGRAPH_RANK_TIMEOUT``) or a rank's connection dropped
  (its process exited); the outcome names the ranks that never posted.

Why a server of our own, and not a ``paddle.distributed`` gloo group (measured side by side,
``benchmarks/channel.py``, docs/design.md): Paddle 3.3.1 builds a gloo group without a timeout of
ours (``new_group``'s is not passed to gloo), so a wait there is bounded by gloo's own and cannot
name the rank that did not come, and a group that timed out is not usable again. NCCL and the
custom all-reduce are the collectives a failed rank will not join. The server is found through
Paddle's job TCP store once per process; each point then costs one request and one reply.

What the server guarantees, against any peer that can reach its port (docs/design.md):

* nothing a connection sends can block or kill it: sockets are non-blocking with a buffer per
  connection, frames are capped, a connection must say hello (with the job's token) within
  ``HELLO_SECONDS``, unauthenticated connections are capped, every message is validated and a bad
  one drops only its connection, and an ``accept()`` error only pauses accepting;
* only the group's ranks count: each rank ``0..world-1`` is claimed once, by the first hello;
* one verdict per point: the server decides, a give-up is decided at the end of the batch of
  messages it arrived in (so a stalled server that wakes up never completes a point that a rank
  already gave up on), and a reply names its point, so a late reply is never taken for the next;
* if the server thread ever stops, it tells every rank before it closes, and every rank says the
  agreement server failed, not that rank 0 exited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from fd_cudagraph_plugin.core.wire import (
    INCOMPLETE,
    MAX_HELLO_BYTES,
    MAX_LABEL,
    MAX_POST_BYTES,
    MAX_TEXT,
    PROTOCOL,
    BadMessage,
    Outcome,
    check_outcome,
    check_status,
    frame,
    malformed_status,
    max_reply_bytes,
    parse_key,
    post_frame,
    take_frame,
    text_field,
)

logger = logging.getLogger("fd_cudagraph_plugin")

#: Seconds a new connection has to say hello. Ranks send it right after connecting.
HELLO_SECONDS = 1.0
#: Connections that have not said hello yet, at most; the oldest is dropped for a new one, so a
#: flood of idle connections can neither exhaust the worker's descriptors nor keep a rank out.
MAX_PENDING = 32
#: What a rank's unread replies may hold before the server gives up on it.
MAX_OUTBOX_BYTES = 1 << 20
#: Seconds between reads of the store while waiting for TP rank 0 to publish its address; each
#: read is one store round trip (about 44 ms with Paddle 3.3.1).
_STORE_POLL_SECONDS = 0.05


def give_up_margin(timeout: float) -> float:
    """How long before its deadline a rank asks the server to abandon a point: the time the
    server has to answer, so that the whole wait stays within ``timeout``."""
    return min(2.0, timeout / 4)


class Link(Protocol):
    """One rank's end of the agreement channel of its tensor-parallel group."""

    rank: int
    world: int

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        """Post ``status`` (None: ok) at the next point; return within ``timeout`` seconds."""

    def next_epoch(self) -> int:
        """A new capture session: points are numbered from 0 again."""


class LocalLink:
    """A single rank: every point completes at once with this rank's status."""

    rank = 0
    world = 1

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        return Outcome(label, {0: status}, labels={0: label})

    def next_epoch(self) -> int:
        return 0


# ---------------------------------------------------------------------------------- server


@dataclass
class _Point:
    creator: int
    opened: float
    posts: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    gave_up: set[int] = field(default_factory=set)
    outcome: dict[str, Any] | None = None
    delivered: set[int] = field(default_factory=set)


#: Points one rank may hold open (posted first, not yet delivered to every rank). An honest rank
#: holds one, two across a session's end; more is a rank running ahead of its group.
MAX_OPEN_POINTS = 2


class Decider:
    """The rules of the server, apart from sockets: posts, give-ups and lost ranks in, one outcome
    per point out. Decisions are taken in ``settle()``, at the end of each batch of messages, so a
    give-up wins over a completion that arrived with it; and a point is never completed for a rank
    whose wait is about to end (its deadline, from the timeout it posted with), so that no rank
    returns "complete" where another gives up. Not thread-safe: one thread calls it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.points: dict[tuple[int, int], _Point] = {}
        self.lost: set[int] = set()
        #: Of ``lost``: ranks dropped for what they sent, with why (the rest closed themselves).
        self.dropped: dict[int, str] = {}
        #: Each rank's point awaiting its outcome: a rank waits at one point at a time.
        self.waiting: dict[int, tuple[int, int]] = {}
        #: When each waiting rank will give up, by the server's clock.
        self.deadlines: dict[int, float] = {}
        #: Each rank's last key: keys only grow.
        self.latest: dict[int, tuple[int, int]] = {}
        self._touched: set[tuple[int, int]] = set()

    def post(
        self,
        rank: int,
        key: tuple[int, int],
        label: str,
        status: Any,
        now: float = 0.0,
        timeout: float = float("inf"),
    ) -> None:
        if rank in self.waiting:
            raise BadMessage(f"rank {rank} posted at {key} while waiting at {self.waiting[rank]}")
        if key <= self.latest.get(rank, (-1, -1)):
            raise BadMessage(f"rank {rank} posted at {key} after {self.latest[rank]}")
        point = self.points.get(key)
        if point is None:
            held = sum(1 for p in self.points.values() if p.creator == rank)
            if held >= MAX_OPEN_POINTS:
                raise BadMessage(f"rank {rank} opened more points than its group reached")
            point = self.points[key] = _Point(creator=rank, opened=now)
        point.labels[rank] = label
        if point.outcome is None:
            point.posts[rank] = status
        self.latest[rank] = key
        self.waiting[rank] = key
        # The rank sends its give-up ``give_up_margin`` before its deadline; the server stops
        # completing for it half a margin before that, so a completion reaches it in time.
        self.deadlines[rank] = now + timeout - 1.5 * give_up_margin(timeout)
        self._touched.add(key)

    def give_up(self, rank: int, key: tuple[int, int]) -> None:
        if self.waiting.get(rank) != key:
            return  # its outcome is already on its way
        self.points[key].gave_up.add(rank)
        self._touched.add(key)

    def lose(self, rank: int, why: str = "") -> None:
        self.lost.add(rank)
        if why:
            self.dropped[rank] = why[:MAX_LABEL]
        self.waiting.pop(rank, None)
        self._touched.update(self.points)

    def settle(self, now: float = 0.0) -> list[tuple[int, dict[str, Any]]]:
        """Decide the points this batch touched; return (rank, outcome) messages to send."""
        out = []
        everyone = set(range(self.world))
        for key in sorted(self._touched):
            point = self.points.get(key)
            if point is None:
                continue
            if point.outcome is None:
                missing = everyone - set(point.posts)
                if not missing and not point.gave_up:
                    # Every rank posted; one whose wait ends about now may already be giving up.
                    point.gave_up = {
                        r for r, k in self.waiting.items() if k == key and self.deadlines[r] <= now
                    }
                if point.gave_up or not missing:
                    point.outcome = self._decide(key, point, missing, now)
                elif missing & self.lost:
                    # Decided now, for the ranks that did post: only the lost ones are at fault,
                    # not those still on their way.
                    point.outcome = self._decide(key, point, missing & self.lost, now)
            if point.outcome is not None:
                for rank in sorted(r for r, k in self.waiting.items() if k == key):
                    out.append((rank, point.outcome))
                    point.delivered.add(rank)
                    del self.waiting[rank]
                if point.delivered | self.lost >= everyone:
                    del self.points[key]
        self._touched.clear()
        return out

    def recheck(self, sent: list[tuple[int, dict[str, Any]]], now: float) -> None:
        """Turn a completion not yet sent into an abandonment for every rank when one of its
        recipients is past its deadline: that rank may be giving up now. The outcome is the
        point's own, so a rank that comes later reads the same."""
        late: dict[int, list[int]] = {}
        for rank, outcome in sent:
            if self.deadlines.get(rank, now) <= now:
                late.setdefault(id(outcome), []).append(rank)
        for _, outcome in sent:
            if id(outcome) in late and not outcome["missing"] and not outcome["gave_up"]:
                outcome["gave_up"] = sorted(late[id(outcome)])

    def _decide(
        self, key: tuple[int, int], point: _Point, missing: set[int], now: float
    ) -> dict[str, Any]:
        return {
            "op": "outcome",
            "key": list(key),
            "statuses": {str(r): s for r, s in sorted(point.posts.items())},
            "labels": {str(r): s for r, s in sorted(point.labels.items())},
            "missing": sorted(missing),
            "lost": sorted(self.lost & missing),
            "gave_up": sorted(point.gave_up),
            "dropped": {str(r): self.dropped[r] for r in sorted(missing) if r in self.dropped},
            "waited": round(max(now - point.opened, 0.0), 3),
        }


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    opened: float
    rank: int | None = None
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)


class Server(threading.Thread):
    """TP rank 0's agreement server: one selector loop, one decider, nothing that blocks."""

    def __init__(self, world: int, host: str, token: str) -> None:
        super().__init__(name="fd-cudagraph-agreement", daemon=True)
        self.world = world
        self.token = token
        self.decider = Decider(world)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = self.listener.getsockname()[:2]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.connections: dict[socket.socket, _Connection] = {}
        self.ranks: dict[int, _Connection] = {}
        #: Why the loop stopped, if it ever does: every rank is told, rank 0's link reads it.
        self.failure: str | None = None
        self._accept_paused_until = 0.0
        self._warned: set[str] = set()
        self._stopping = False

    # -- the loop

    def run(self) -> None:
        try:
            while not self._stopping:
                self._turn()
        except BaseException as error:
            self.failure = f"{type(error).__name__}: {error}"
            logger.error("fd-cudagraph agreement server failed: %s", self.failure, exc_info=True)
            self._tell_everyone_and_close()

    def stop(self) -> None:
        """End the loop and close every socket (tests, and rank 0's link when it closes)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            socket.create_connection(self.address, timeout=1).close()  # wake the selector

    def _turn(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.selector.register(self.listener, selectors.EVENT_READ)
        events = self.selector.select(self._wait(now))
        batch: list[tuple[_Connection, Any]] = []
        for key, mask in events:
            if key.fileobj is self.listener:
                self._accept()
                continue
            connection = key.data
            if connection.sock not in self.connections:
                continue  # dropped earlier in this turn
            if mask & selectors.EVENT_READ:
                self._read(connection, batch)
            if mask & selectors.EVENT_WRITE and connection.sock in self.connections:
                self._flush(connection)
        for connection, message in batch:
            if connection.sock in self.connections:
                try:
                    self._handle(connection, message)
                except BadMessage as error:
                    self._drop(connection, str(error))
                except Exception as error:
                    if connection.rank is not None:
                        raise  # the server's own fault: every rank is told (run)
                    self._drop(connection, f"{type(error).__name__}")
        self._expire_hellos(time.monotonic())
        # A rank dropped while its outcome is queued (it read none of its replies) is lost, and
        # the points it held are decided again at once.
        while sent := self.decider.settle(time.monotonic()):
            # Checked again right before sending: a stall since the decision (this process
            # starved) may have run a rank past its deadline.
            self.decider.recheck(sent, time.monotonic())
            for rank, outcome in sent:
                target = self.ranks.get(rank)
                if target is not None:
                    self._queue(target, frame(outcome))
        if self._stopping:
            self._close_all()

    def _wait(self, now: float) -> float | None:
        deadlines = [c.opened + HELLO_SECONDS for c in self.connections.values() if c.rank is None]
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        return max(min(deadlines) - now, 0.0) if deadlines else None

    # -- connections

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as error:
            # Out of descriptors (EMFILE) or the like: make room by dropping the oldest
            # connection without a hello, and stop watching the listener for a moment instead of
            # spinning on it; never for good.
            self._warn_once("accept", "cannot accept a connection (%s); retrying", error)
            pending = [c for c in self.connections.values() if c.rank is None]
            if pending:
                self._drop(min(pending, key=lambda c: c.opened), "out of descriptors")
            self._accept_paused_until = time.monotonic() + 0.05
            self.selector.unregister(self.listener)
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = [c for c in self.connections.values() if c.rank is None]
        if len(pending) >= MAX_PENDING:
            self._drop(min(pending, key=lambda c: c.opened), "too many connections without hello")
        connection = _Connection(sock, f"{peer[0]}:{peer[1]}", time.monotonic())
        self.connections[sock] = connection
        self.selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection, batch: list) -> None:
        try:
            chunk = connection.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._drop(connection, f"read failed ({error})")
            return
        if not chunk:
            self._drop(connection, "closed")
            return
        connection.inbox += chunk
        # A rank sends nothing after its hello before the welcome: what follows a hello in the
        # same read is held to the hello's cap too.
        cap = MAX_POST_BYTES if connection.rank is not None else MAX_HELLO_BYTES
        try:
            while (message := take_frame(connection.inbox, cap)) is not INCOMPLETE:
                batch.append((connection, message))
        except BadMessage as error:
            self._drop(connection, str(error))

    def _handle(self, connection: _Connection, message: Any) -> None:
        if type(message) is not dict:
            raise BadMessage("a message must be a JSON object")
        op = message.get("op")
        if connection.rank is None:
            if op != "hello":
                raise BadMessage("the first message must be a hello")
            self._hello(connection, message)
            return
        key = parse_key(message.get("key"))
        if op == "post":
            label = text_field(message.get("label"), "label", MAX_LABEL)
            timeout = message.get("timeout")
            if type(timeout) not in (int, float) or not 0 < timeout <= 86400:
                raise BadMessage("a post needs its timeout, in seconds")
            if "status" not in message:
                raise BadMessage("a post needs a status")
            try:
                status = check_status(message["status"], self.world)
            except (ValueError, TypeError, OverflowError, RecursionError) as error:
                # From a rank of the group (it had the token): a failure of that rank, which
                # every rank reads in the same outcome, never a KeyError on one of them.
                status = malformed_status(connection.rank, label, str(error)[:MAX_LABEL])
            self.decider.post(connection.rank, key, label, status, time.monotonic(), timeout)
        elif op == "give_up":
            self.decider.give_up(connection.rank, key)
        else:
            raise BadMessage(f"unknown op {op!r}"[:80])

    def _hello(self, connection: _Connection, message: dict[str, Any]) -> None:
        token = message.get("token")
        if type(token) is not str or not secrets.compare_digest(token, self.token):
            raise BadMessage("wrong token")
        if message.get("protocol") != PROTOCOL:
            self._refuse(connection, f"protocol {message.get('protocol')!r}, server {PROTOCOL}")
            return
        rank = message.get("rank")
        if type(rank) is not int or not 0 <= rank < self.world:
            self._refuse(connection, f"rank {rank!r} is not in 0..{self.world - 1}")
            return
        if rank in self.ranks or rank in self.decider.lost:
            first = self.ranks[rank].peer if rank in self.ranks else "a connection now closed"
            self._warn_once(
                f"claim{rank}",
                "a connection from %s claimed tensor-parallel rank %d, which %s holding the "
                "job's token claimed first; the first keeps it",
                connection.peer,
                rank,
                first,
            )
            self._refuse(
                connection,
                f"rank {rank} was claimed first by {first} (a process holding the job's token)",
            )
            return
        connection.rank = rank
        self.ranks[rank] = connection
        self._queue(connection, frame({"op": "welcome"}))

    def _refuse(self, connection: _Connection, why: str) -> None:
        with contextlib.suppress(OSError):
            connection.sock.send(frame({"op": "refused", "why": why}))
        self._drop(connection, f"refused: {why}")

    def _expire_hellos(self, now: float) -> None:
        for connection in list(self.connections.values()):
            if connection.rank is None and now - connection.opened > HELLO_SECONDS:
                self._drop(connection, f"no hello within {HELLO_SECONDS:.0f} s")

    def _queue(self, connection: _Connection, data: bytes) -> None:
        connection.outbox += data
        if len(connection.outbox) > MAX_OUTBOX_BYTES:
            self._drop(connection, "does not read its replies")
            return
        self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.outbox) if connection.outbox else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._drop(connection, f"write failed ({error})")
            return
        del connection.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.outbox else 0)
        self.selector.modify(connection.sock, events, connection)

    def _drop(self, connection: _Connection, why: str) -> None:
        if self.connections.pop(connection.sock, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection.sock)
        connection.sock.close()
        if connection.rank is not None and self.ranks.get(connection.rank) is connection:
            del self.ranks[connection.rank]
            self.decider.lose(connection.rank, "" if why == "closed" else why)
            if why != "closed":
                logger.warning(
                    "fd-cudagraph agreement server dropped tensor-parallel rank %d: %s",
                    connection.rank,
                    why,
                )
        elif connection.rank is None:
            self._warn_once(
                "stranger",
                "fd-cudagraph agreement server dropped a connection from %s that is not a rank "
                "of its group (%s); further ones are dropped without a log line. Only the "
                "tensor-parallel ranks of this worker group should reach this port.",
                connection.peer,
                why,
            )

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def _close_all(self) -> None:
        for connection in list(self.connections.values()):
            with contextlib.suppress(OSError):
                connection.sock.close()
        self.connections.clear()
        self.ranks.clear()
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(Exception):
            self.selector.close()

    def _tell_everyone_and_close(self) -> None:
        notice = frame({"op": "failed", "why": (self.failure or "")[:MAX_TEXT]})
        for connection in list(self.ranks.values()):
            # Best effort, without blocking: a rank that reads nothing must not delay the others.
            with contextlib.suppress(OSError):
                connection.sock.send(bytes(connection.outbox) + notice)
        self._close_all()


# ---------------------------------------------------------------------------------- client


class Store(Protocol):
    """What the agreement needs of Paddle's ``TCPStore``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


class JoinError(RuntimeError):
    """This rank could not join its group's agreement channel."""


_TIMED_OUT = object()
_CLOSED = object()


class SocketLink:
    """A rank's connection to its group's agreement server (hosted by the group's rank 0)."""

    def __init__(self, sock: socket.socket, rank: int, world: int, server: Server | None) -> None:
        self._sock = sock
        self.rank = rank
        self.world = world
        self._server = server  # kept alive with the link on rank 0
        self._epoch = -1
        self._point = 0
        self._lock = threading.Lock()
        self._inbox = bytearray()
        #: Set once the channel failed for good: every later point fails at once with it.
        self._broken = ""

    @classmethod
    def connect(
        cls, store: Store, prefix: str, rank: int, world: int, host: str, timeout: float
    ) -> SocketLink:
        """Rank 0 starts the server and publishes its address in ``store`` under ``prefix``;
        every rank waits for it (at most ``timeout`` seconds), connects and is welcomed."""
        server = None
        if rank == 0:
            server = Server(world, host, secrets.token_hex(16))
            server.start()
            address = {"host": server.address[0], "port": server.address[1]}
            store.set(f"{prefix}/server", json.dumps({**address, "token": server.token}))
            store.add(f"{prefix}/ready", 1)
            logger.info(
                "fd-cudagraph agreement: tensor-parallel rank 0 of %d listens on %s:%d",
                world,
                *server.address,
            )
        deadline = time.monotonic() + timeout
        while store.add(f"{prefix}/ready", 0) < 1:
            if time.monotonic() >= deadline:
                raise JoinError(
                    f"tensor-parallel rank 0 did not start the CUDA graph agreement server within "
                    f"{timeout:.0f} s"
                )
            time.sleep(_STORE_POLL_SECONDS)
        published = _published(store.get(f"{prefix}/server"))
        while True:
            try:
                sock = _join(published, rank, max(deadline - time.monotonic(), 0.5))
                break
            except _Retry as error:
                # Dropped before the welcome (a flood of connections evicted it): once more.
                if time.monotonic() >= deadline:
                    raise JoinError(f"the agreement server dropped this rank: {error}") from None
                time.sleep(_STORE_POLL_SECONDS)
        return cls(sock, rank, world, server)

    def next_epoch(self) -> int:
        with self._lock:
            self._epoch += 1
            self._point = 0
            return self._epoch

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._server is not None:
            self._server.stop()

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        with self._lock:
            key = [self._epoch, self._point]
            self._point += 1
            started = time.monotonic()
            reply = self._exchange(key, label, status, timeout, started)
            if isinstance(reply, str):
                return Outcome(label, {self.rank: status}, channel_failure=reply)
            if reply is _CLOSED:  # the server is gone: TP rank 0's process exited
                return Outcome(label, {self.rank: status}, (0,), (0,))
            return dataclasses.replace(reply, label=label)

    def _exchange(self, key, label, status, timeout, started) -> Any:
        """The outcome of point ``key``; ``_CLOSED``; or why the channel failed (a str)."""
        if self._broken:
            return self._broken
        end = started + timeout
        give_up_at = end - give_up_margin(timeout)
        try:
            self._sock.sendall(post_frame(key, label, status, self.rank, timeout))
        except OSError:
            return self._gone()
        gave_up = False
        while True:
            now = time.monotonic()
            if not gave_up and now >= give_up_at:
                gave_up = True
                try:
                    self._sock.sendall(frame({"op": "give_up", "key": key}))
                except OSError:
                    return self._gone()
                continue
            if gave_up and now >= end:
                # The server answers a give-up at once; it did not: it is stalled (rank 0's
                # process stopped or starved). No rank can complete this point now: the give-up
                # is decided first by a server that wakes up.
                return self._fail_for_good(
                    f"the agreement server on tensor-parallel rank 0 did not answer within "
                    f"{timeout:.0f} s (FD_CUDAGRAPH_RANK_TIMEOUT)"
                )
            message = self._receive((give_up_at if not gave_up else end) - now)
            if message is _TIMED_OUT:
                continue
            if message is _CLOSED:
                return self._gone()
            if isinstance(message, str):
                return self._fail_for_good(message)
            op = message.get("op")
            if op == "failed":
                why = message.get("why") if type(message.get("why")) is str else ""
                return self._fail_for_good(
                    f"the agreement server on tensor-parallel rank 0 failed ({why[:MAX_TEXT]})"
                )
            if op != "outcome" or message.get("key") != key:
                continue  # a late reply to an earlier point: never taken for this one
            try:
                return check_outcome(message, self.world)
            except BadMessage as error:
                return self._fail_for_good(
                    f"the agreement server sent a malformed outcome ({error})"
                )

    def _receive(self, seconds: float) -> Any:
        """The next message; ``_TIMED_OUT``; ``_CLOSED``; or a str saying what was wrong."""
        cap = max_reply_bytes(self.world)
        while True:
            try:
                message = take_frame(self._inbox, cap)
            except BadMessage as error:
                return f"the agreement server sent a malformed reply ({error})"
            if message is not INCOMPLETE:
                return message if type(message) is dict else "the agreement server sent garbage"
            self._sock.settimeout(max(seconds, 0.001))
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                return _TIMED_OUT
            except OSError:
                return _CLOSED
            finally:
                with contextlib.suppress(OSError):
                    self._sock.settimeout(None)
            if not chunk:
                return _CLOSED
            self._inbox += chunk

    def _gone(self) -> Any:
        """The connection closed: a server that failed said why first; else rank 0 exited."""
        server_failure = self._server.failure if self._server is not None else None
        if server_failure:
            return self._fail_for_good(
                f"the agreement server on tensor-parallel rank 0 failed ({server_failure})"
            )
        return _CLOSED

    def _fail_for_good(self, why: str) -> str:
        self._broken = why
        with contextlib.suppress(OSError):
            self._sock.close()
        return why


class _Retry(Exception):
    pass


def _published(raw: bytes) -> dict[str, Any]:
    """Rank 0's address and token, as read back from the job store."""
    try:
        published = json.loads(raw)
        host, port, token = published["host"], published["port"], published["token"]
    except (ValueError, KeyError, TypeError):
        raise JoinError("the agreement server's address in the job store is malformed") from None
    if type(host) is not str or type(port) is not int or type(token) is not str:
        raise JoinError("the agreement server's address in the job store is malformed")
    return {"host": host, "port": port, "token": token}


def _join(published: dict[str, Any], rank: int, seconds: float) -> socket.socket:
    sock = socket.create_connection((published["host"], published["port"]), timeout=seconds)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"op": "hello", "protocol": PROTOCOL, "rank": rank, "token": published["token"]}
        sock.sendall(frame(hello))
        inbox = bytearray()
        while (reply := take_frame(inbox, 4096)) is INCOMPLETE:
            chunk = sock.recv(4096)
            if not chunk:
                raise _Retry("closed before the welcome")
            inbox += chunk
        if type(reply) is not dict or reply.get("op") != "welcome":
            why = reply.get("why") if type(reply) is dict else None
            raise JoinError(f"the agreement server refused rank {rank}: {why}")
        sock.settimeout(None)
        return sock
    except (OSError, BadMessage) as error:
        sock.close()
        if isinstance(error, TimeoutError):
            raise JoinError("the agreement server did not welcome this rank in time") from None
        raise _Retry(str(error)) from None
    except BaseException:
        sock.close()
        raise


def listen_host(ranks: list[int]) -> str:
    """Where TP rank 0's server listens: loopback when every rank of the group runs on this host,
    else this worker's own endpoint's host. Paddle's launcher sets ``PADDLE_CURRENT_ENDPOINT`` and
    ``PADDLE_TRAINER_ENDPOINTS`` (every rank's, by global rank) in every worker."""
    host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0]
    if not host:
        return "127.0.0.1"
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    if not endpoints or any(r >= len(endpoints) for r in ranks):
        return host  # where the ranks are is unknown: reachable from other hosts
    if all(endpoints[r].rpartition(":")[0] == host for r in ranks):
        return "127.0.0.1"
    return host


__all__ = [
    "Decider",
    "JoinError",
    "Link",
    "LocalLink",
    "Outcome",
    "Server",
    "SocketLink",
    "listen_host",
]
