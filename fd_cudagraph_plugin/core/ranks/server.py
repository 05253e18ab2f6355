"""TP rank 0's agreement server: one ROUTER, one ``Decider``, one thread, nothing that blocks.

Each rank's DEALER keeps one routing id for its life, so a connection made again is the same rank
(``ROUTER_HANDOVER``); peers without the group's token are refused in ZeroMQ's PLAIN handshake
(pyzmq's ``ThreadAuthenticator``). Who is gone comes from libzmq alone: the monitor says that a
connection closed (not whose), and a send to a routing id without a connection fails
(``ROUTER_MANDATORY``), so after a close every rank is probed, and no point completes before the
first probe (libzmq ends the pipe a moment after it reports the close). Nothing else loses a rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from typing import Any

import zmq
from msgspec import Raw
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from fd_cudagraph_plugin.core.ranks import sockets
from fd_cudagraph_plugin.core.ranks.decider import HOLD, Decider, Point
from fd_cudagraph_plugin.core.ranks.messages import (
    MAX_LABEL,
    MAX_PARTS,
    MAX_POST_BYTES,
    MAX_TEXT,
    PROTOCOL,
    TO_SERVER,
    UNREADABLE,
    BadMessage,
    GiveUp,
    Hello,
    Ping,
    Refused,
    ServerFailed,
    Welcome,
    encode,
    malformed,
    read_status,
    text,
)

logger = logging.getLogger("fd_cudagraph_plugin")

#: The user name of the PLAIN handshake; the token is its password.
USER = DOMAIN = "fd-cudagraph"
#: After a connection closed: when to probe (seconds after it). No point completes before the
#: first: libzmq ends a closed connection's pipe microseconds after it reports the close.
PROBES = (0.005, 0.05, 0.3, 1.0)
#: What a server says to a rank of another group, or launch, than its own.
OTHER_GROUP = "a rank of another group"
#: Messages read per turn, at most: a flood from one peer delays the others by one turn only.
BATCH = 256
_PING, _WELCOME = encode(Ping()), encode(Welcome())


class Server(threading.Thread):
    """Each turn: the monitor's news, a batch of messages, due probes, then decisions, each sent
    to the other ranks first and to rank 0 last (rank 0's own link reads it in the process: it
    must never go on before the others have been sent theirs)."""

    def __init__(
        self, world: int, endpoint: str, ports: tuple[int, int] | None = None, group: str = ""
    ) -> None:
        super().__init__(name="fd-cudagraph-agreement", daemon=True)
        self.world = world
        self.group = group
        self.token = secrets.token_hex(16)
        self.decider = Decider(world)
        self.context = sockets.Context()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("zmq.auth.fd"))
        self.router = sockets.bounded(self.context.socket(zmq.ROUTER), MAX_POST_BYTES)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.PLAIN_SERVER, 1)
        self.router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
        self.monitor = self.router.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._wake = self.context.socket(zmq.PAIR)
        self._waker = self.context.socket(zmq.PAIR)
        self._wake_lock = threading.Lock()
        wake = f"inproc://fd-cudagraph-wake-{id(self)}"
        #: Where rank 0's own link connects: in the process (ZeroMQ's inproc, in this context).
        self.inproc = f"inproc://fd-cudagraph-agreement-{id(self)}"
        self.endpoint = endpoint
        try:
            self.auth.start()
            self.auth.configure_plain(domain=DOMAIN, passwords={USER: self.token})
            self._wake.bind(wake)
            self._waker.connect(wake)
            self.router.bind(self.inproc)
            self.endpoint = _bind(self.router, endpoint, ports)
        except BaseException:
            self._close_all()
            raise
        #: Routing id -> rank, for welcomed ranks, and back.
        self.ranks: dict[bytes, int] = {}
        self.identity_of: dict[int, bytes] = {}
        #: Outcomes a rank's full queue could not take yet, sent again each turn.
        self.outbox: list[tuple[int, bytes]] = []
        #: Why the loop stopped, if it ever does: every rank is told, rank 0's link reads it.
        self.failure: str | None = None
        self._probes: list[float] = []
        self._warned: set[str] = set()
        self._stopping = False

    # -- the loop

    def run(self) -> None:
        try:
            poller = zmq.Poller()
            for sock in (self.router, self.monitor, self._wake):
                poller.register(sock, zmq.POLLIN)
            while not self._stopping:
                self._turn(dict(poller.poll(self._wait())))
        except BaseException as error:
            self.failure = text(f"{type(error).__name__}: {error}", MAX_TEXT)
            logger.error("fd-cudagraph agreement server failed: %s", self.failure, exc_info=True)
            self._tell_everyone()
        finally:
            self._close_all()

    def _wait(self) -> int | None:
        """Milliseconds until the loop has something to do without a message: a probe, an
        outcome a full queue could not take, a completion held back."""
        now = time.monotonic()
        due = [*self._probes[:1]]
        if self.outbox:
            due.append(now + 0.01)
        if self.decider.hold_until > now:
            due.append(min(self.decider.hold_until, now + HOLD))
        if not due:
            return None
        return max(int((min(due) - now) * 1000) + 1, 0)

    def stop(self) -> None:
        """End the loop, which closes the server's sockets. The waking socket is the stopping
        thread's (ZeroMQ sockets are never shared between threads); the context is ended by rank
        0's link, its last user, so that the link can read the notice of a server that failed."""
        self._stopping = True
        with self._wake_lock:
            if not self._waker.closed:
                with contextlib.suppress(zmq.ZMQError):
                    self._waker.send(b"", sockets.NOBLOCK)
                self._waker.close()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(5)

    def _turn(self, ready: dict) -> None:
        now = time.monotonic()
        if self._wake in ready:
            with contextlib.suppress(zmq.Again):
                self._wake.recv(sockets.NOBLOCK)
        if self.monitor in ready:
            self._news(now)
        if self.router in ready:
            for identity, body in self._read():
                self._handle(identity, body, now)
        if self._probes and self._probes[0] <= now:
            while self._probes and self._probes[0] <= now:
                self._probes.pop(0)
            self._probe()
        self._send_outbox()
        self._settle()

    def _news(self, now: float) -> None:
        while sockets.readable(self.monitor):
            event = parse_monitor_message(self.monitor.recv_multipart(sockets.NOBLOCK))
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._probes = [now + after for after in PROBES]
                self.decider.hold_until = now + PROBES[0]
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._warn_once(
                    "token",
                    "fd-cudagraph agreement server refused a connection without the group's "
                    "token; further ones are refused without a log line. Only the tensor-parallel "
                    "ranks of this worker group should reach it.",
                )

    def _read(self) -> list[tuple[bytes, bytes]]:
        """Up to ``BATCH`` messages, each read part by part: a message of more parts than a
        rank sends is drained and never held."""
        batch = []
        recv = self.router.recv
        for _ in range(BATCH):
            if not sockets.readable(self.router):
                break
            frames = [recv(sockets.NOBLOCK, copy=False)]
            while frames[-1].more and len(frames) < MAX_PARTS:
                frames.append(recv(sockets.NOBLOCK, copy=False))
            parts, frame = len(frames), frames[-1]
            while frame.more:  # drained one by one, none kept
                frame = recv(sockets.NOBLOCK, copy=False)
                parts += 1
            identity = frames[0].bytes
            if parts == MAX_PARTS:
                batch.append((identity, frames[1].bytes))
            else:
                why = f"a message of {parts - 1} parts (a rank sends 1)"
                self._refuse(identity, self.ranks.get(identity), why)
        return batch

    def _handle(self, identity: bytes, body: bytes, now: float) -> None:
        rank = self.ranks.get(identity)
        try:
            message = TO_SERVER.decode(body)
        except UNREADABLE as error:
            self._refuse(identity, rank, f"a malformed message ({error})")
            return
        if isinstance(message, Hello):
            self._hello(identity, message)
            return
        if rank is None:
            self._refuse(identity, None, "not a rank of this group: it must say hello first")
            return
        if rank in self.decider.gone:
            self.decider.arrive(rank)  # its connection was made again
        try:
            if isinstance(message, GiveUp):
                self.decider.give_up(rank, message.key)
            else:
                status: Any = message.status
                try:
                    read = read_status(status)
                    if read.failure is not None and read.failure.rank != rank:
                        raise BadMessage(f"failure.rank is {read.failure.rank}, not {rank}")
                except UNREADABLE as error:
                    # From a rank of the group: its failure, which every rank reads in the same
                    # outcome, never a dropped connection on one of them.
                    status = Raw(encode(malformed(rank, message.label, text(error, MAX_LABEL))))
                self.decider.post(rank, message.key, message.label, status, now)
        except BadMessage as error:
            self._refuse(identity, rank, str(error))

    def _hello(self, identity: bytes, hello: Hello) -> None:
        rank = hello.rank
        if hello.protocol != PROTOCOL:
            self._refuse(identity, None, f"protocol {hello.protocol}, server {PROTOCOL}")
            return
        if rank >= self.world:
            self._refuse(identity, None, f"rank {rank} is not in 0..{self.world - 1}")
            return
        if hello.group != self.group:
            self._refuse(identity, None, f"{OTHER_GROUP} ({hello.group!r}, here {self.group!r})")
            return
        holder = self.identity_of.get(rank)
        if holder is not None and holder != identity and rank not in self.decider.gone:
            self._warn_once(
                f"claim{rank}",
                "a connection claimed tensor-parallel rank %d, which another connection holds; "
                "the first keeps it",
                rank,
            )
            self._refuse(identity, None, f"rank {rank} is held by another connection")
            return
        if holder is not None:
            self.ranks.pop(holder, None)
        previous = self.ranks.pop(identity, None)
        if previous is not None and previous != rank:
            self.identity_of.pop(previous, None)
        self.ranks[identity] = rank
        self.identity_of[rank] = identity
        self.decider.arrive(rank)
        self._send(rank, _WELCOME)

    def _refuse(self, identity: bytes, rank: int | None, why: str) -> None:
        """A message the protocol does not allow: from a stranger, answered and forgotten; from
        a rank, it drops that rank (every rank names it, and it is told why; its next hello,
        at its next session, counts it again)."""
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart(
                [identity, encode(Refused(why=text(why, MAX_LABEL)))], sockets.NOBLOCK
            )
        if rank is None:
            self._warn_once(
                "stranger",
                "fd-cudagraph agreement server refused a message from a connection that is not "
                "a rank of its group (%s); further ones are refused without a log line.",
                text(why, MAX_LABEL),
            )
            return
        self.ranks.pop(identity, None)
        self.identity_of.pop(rank, None)
        self.decider.leave(rank, why)
        logger.warning(
            "fd-cudagraph agreement server dropped tensor-parallel rank %d: %s", rank, why
        )

    def _probe(self) -> None:
        """Which ranks' connections are gone: a send to a routing id without one fails."""
        for rank, identity in list(self.identity_of.items()):
            if rank == 0 or rank in self.decider.gone:
                continue
            try:
                self.router.send_multipart([identity, _PING], sockets.NOBLOCK)
            except zmq.Again:
                pass  # connected, its queue full: it is not reading now, which is no fault
            except zmq.ZMQError:
                self.decider.leave(rank)

    def _settle(self) -> None:
        sent = self.decider.settle(time.monotonic())
        # Rank 0 last: its link is in this process and goes on the moment it reads its outcome.
        for rank, point in sorted(sent, key=lambda item: item[0] == 0):
            self._send(rank, _body(point))

    def _send(self, rank: int, body: bytes) -> None:
        identity = self.identity_of.get(rank)
        if identity is None:
            return
        try:
            self.router.send_multipart([identity, body], sockets.NOBLOCK)
        except zmq.Again:  # its queue is full: it is stopped or slow; sent when it reads
            self.outbox.append((rank, body))
        except zmq.ZMQError:  # no connection: the next probe finds it gone
            self._probes = self._probes or [time.monotonic()]

    def _send_outbox(self) -> None:
        waiting, self.outbox = self.outbox, []
        for rank, body in waiting:
            self._send(rank, body)

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def _tell_everyone(self) -> None:
        notice = encode(ServerFailed(why=self.failure or ""))
        for identity in list(self.identity_of.values()):
            with contextlib.suppress(Exception):  # best effort: nothing may block here
                self.router.send_multipart([identity, notice], sockets.NOBLOCK)

    def _close_all(self) -> None:
        with contextlib.suppress(Exception):
            self.auth.stop()
        for sock in (self.router, self.monitor, self._wake):
            with contextlib.suppress(Exception):
                sock.close(linger=0)
        if self.endpoint.startswith("ipc://"):  # libzmq leaves the socket file; join.py made
            path = self.endpoint[len("ipc://") :]  # its directory for this server alone
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))


def _body(point: Point) -> bytes:
    if point.body is None:
        point.body = encode(point.outcome)
    return point.body


def _bind(sock: zmq.Socket, endpoint: str, ports: tuple[int, int] | None) -> str:
    """Bind ``sock`` to ``endpoint`` (``ipc://PATH`` or ``tcp://HOST``, on a port of ``ports``
    tried in order, else one the kernel picks); return the endpoint peers connect to."""
    if endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return endpoint
    if ports is None:
        sock.bind(f"{endpoint}:0")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    low, high = ports
    for port in range(low, high + 1):
        try:
            sock.bind(f"{endpoint}:{port}")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            if error.errno != zmq.EADDRINUSE:
                raise
    raise BindError(
        f"every port of FD_CUDAGRAPH_AGREEMENT_PORTS={low}-{high} is in use on "
        f"{endpoint[len('tcp://') :]}; widen the range"
    )


class BindError(RuntimeError):
    """The server could not listen where the options say."""
