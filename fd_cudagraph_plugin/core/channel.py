"""The channel tensor-parallel ranks agree over, on ZeroMQ: TP rank 0's ROUTER and each rank's
DEALER. What travels on it, and what a valid message is, is ``messages.py``.

A capture session has fixed agreement points (``agreement.py`` says where and what they mean). At
each, every rank posts its status (ok, a payload, or what failed) and gets back one outcome, the
same on every rank, decided by the ``Decider`` on TP rank 0:

* complete: every rank posted; the outcome carries each rank's status and label;
* abandoned: a rank gave up waiting (``FD_CUDAGRAPH_RANK_TIMEOUT``) or a rank's connection dropped
  (its process exited) before the point was decided; the outcome names the ranks at fault.

ZeroMQ is FastDeploy's own control-plane library (``fastdeploy/inter_communicator/``; ``zmq`` is
in its requirements on every release), and libzmq does what a server of our own did before: the
framing, a buffer and a queue per peer, non-blocking I/O, the message cap (``MAXMSGSIZE``: a peer
announcing more is disconnected), the handshake deadline (``HANDSHAKE_IVL``), fair queuing between
peers (a flood from one delays no other), heartbeats, and peer isolation (a peer that does not
speak ZMTP, or that fails authentication, costs only its own connection). What is ours: the
Decider, the link and the schema.

Where it listens (``Address``): on one host, a Unix socket in a directory only this user can
enter, at a path every rank derives from the job alone, so nothing is published and nothing that
can write Paddle's job store can pose as the server; across hosts (or with
``FD_CUDAGRAPH_AGREEMENT_INTERFACE`` / ``_PORTS`` set), TCP on TP rank 0's node address, published
with a token in the job store. A TCP peer must present the token in ZeroMQ's PLAIN handshake,
checked by the server's own ZAP handler: a wrong one is refused before it is a peer. Whoever can
read or write the job store can pass that check and pose as a rank or as the server: a multi-host
job's network must be trusted (docs/design.md says what that allows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from fd_cudagraph_plugin.core.messages import (
    MAX_LABEL,
    MAX_POST_BYTES,
    MAX_TEXT,
    PROTOCOL,
    TO_RANK,
    BadMessage,
    Dropped,
    Failure,
    GiveUp,
    Hello,
    Outcome,
    Post,
    Refused,
    ServerFailed,
    Status,
    Welcome,
    decode,
    encode,
    max_message_bytes,
    parse,
    text,
)

logger = logging.getLogger("fd_cudagraph_plugin")

#: Seconds a new connection has to finish ZeroMQ's handshake (PLAIN included).
HANDSHAKE_SECONDS = 1.0
#: Heartbeats on every connection: a peer that stops answering for this long (its host went
#: away, its process froze) is disconnected, and named, instead of at the rank timeout.
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT_SECONDS = 5.0
#: Messages queued per peer, each way. An honest rank has at most two in flight.
QUEUE = 64
#: The largest message TP rank 0's server reads: a post (its status within ``MAX_POST_BYTES``).
MAX_TO_SERVER = MAX_POST_BYTES
#: Points one rank may hold open (posted first, not yet delivered to every rank). An honest rank
#: holds one, two across a session's end; more is a rank running ahead of its group.
MAX_OPEN_POINTS = 2
#: Seconds between reads of the store while waiting for TP rank 0 to publish its address; each
#: read is one store round trip (about 44 ms with Paddle 3.3.1).
_STORE_POLL_SECONDS = 0.05
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"fd-cudagraph"
_ZAP_USER = b"fd-cudagraph"


def give_up_margin(timeout: float) -> float:
    """How long before its deadline a rank asks the server to abandon a point: the time the
    server has to answer, so that the whole wait stays within ``timeout``."""
    return min(2.0, timeout / 4)


class Link(Protocol):
    """One rank's end of the agreement channel of its tensor-parallel group."""

    rank: int
    world: int

    def agree(self, label: str, status: Status, timeout: float) -> Outcome:
        """Post ``status`` at the next point; return within ``timeout`` seconds. The outcome's
        ``channel_failure`` (see ``Agreed``) says when the channel itself failed."""

    def next_epoch(self) -> int:
        """A new capture session: points are numbered from 0 again."""


@dataclass(frozen=True)
class Agreed:
    """A point's outcome as this rank read it, with its own label, or why the channel failed."""

    label: str
    outcome: Outcome
    #: Set when the channel itself failed: the server stopped, did not answer, or sent garbage.
    channel_failure: str = ""

    @property
    def complete(self) -> bool:
        o = self.outcome
        return not o.missing and not o.gave_up and not self.channel_failure

    @property
    def failures(self) -> dict[int, Failure]:
        """The failures posted, by rank."""
        return {
            rank: status.failure
            for rank, status in sorted(self.outcome.statuses.items())
            if status.failure is not None
        }

    def shared(self) -> list[Any]:
        """Each rank's payload, in rank order."""
        statuses = self.outcome.statuses
        return [statuses[rank].payload for rank in sorted(statuses)]


def alone(label: str, rank: int, status: Status, failure: str = "", **outcome: Any) -> Agreed:
    """An outcome this rank decides without the server: its own status only."""
    return Agreed(label, Outcome(key=(0, 0), statuses={rank: status}, **outcome), failure)


class LocalLink:
    """A single rank: every point completes at once with this rank's status."""

    rank = 0
    world = 1

    def agree(self, label: str, status: Status, timeout: float) -> Agreed:
        return Agreed(label, Outcome(key=(0, 0), statuses={0: status}, labels={0: label}))

    def next_epoch(self) -> int:
        return 0


# ---------------------------------------------------------------------------------- decider


@dataclass
class _Point:
    creator: int
    opened: float
    posts: dict[int, Status] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    gave_up: set[int] = field(default_factory=set)
    outcome: Outcome | None = None
    delivered: set[int] = field(default_factory=set)


class Decider:
    """The rules of the server, apart from the transport: posts, give-ups and lost ranks in, one
    outcome per point out. Decisions are taken in ``settle()``, at the end of each batch of
    messages, so a give-up wins over a completion that arrived with it; a rank lost before the
    decision is never counted as arrived; and a point is never completed for a rank whose wait is
    about to end (its deadline, from the timeout it posted with), so that no rank returns
    "complete" where another gives up. Not thread-safe: one thread calls it."""

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
        status: Status,
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
        """``rank`` is gone (its connection dropped, or it was dropped for what it sent): no
        point decided from now on counts it, also where it posted already."""
        self.lost.add(rank)
        if why:
            self.dropped[rank] = text(why, MAX_LABEL)
        self.waiting.pop(rank, None)
        self._touched.update(self.points)

    def settle(self, now: float = 0.0) -> list[tuple[int, Outcome]]:
        """Decide the points this batch touched; return (rank, outcome) messages to send."""
        out = []
        everyone = set(range(self.world))
        for key in sorted(self._touched):
            point = self.points.get(key)
            if point is None:
                continue
            if point.outcome is None:
                absent = everyone - set(point.posts)
                gone = everyone & self.lost
                if not absent and not gone and not point.gave_up:
                    # Every rank posted; one whose wait ends about now may already be giving up.
                    point.gave_up = {
                        r for r, k in self.waiting.items() if k == key and self.deadlines[r] <= now
                    }
                if point.gave_up or not (absent or gone):
                    point.outcome = self._decide(key, point, absent | gone, now)
                elif gone:
                    # Decided now, for the ranks that did post: only the lost ones are at fault,
                    # not those still on their way.
                    point.outcome = self._decide(key, point, gone, now)
            if point.outcome is not None:
                for rank in sorted(r for r, k in self.waiting.items() if k == key):
                    out.append((rank, point.outcome))
                    point.delivered.add(rank)
                    del self.waiting[rank]
                if point.delivered | self.lost >= everyone:
                    del self.points[key]
        self._touched.clear()
        return out

    def recheck(self, sent: list[tuple[int, Outcome]], now: float) -> list[tuple[int, Outcome]]:
        """Turn a completion not yet sent into an abandonment for every rank when one of its
        recipients is past its deadline: that rank may be giving up now. The point keeps the
        changed outcome, so a rank that comes later reads the same."""
        late: dict[tuple[int, int], list[int]] = {}
        for rank, outcome in sent:
            if self.deadlines.get(rank, now) <= now:
                late.setdefault(outcome.key, []).append(rank)
        changed: dict[tuple[int, int], Outcome] = {}
        for _, outcome in sent:
            if outcome.key in late and not outcome.missing and not outcome.gave_up:
                changed[outcome.key] = dataclasses.replace(
                    outcome, gave_up=tuple(sorted(late[outcome.key]))
                )
                point = self.points.get(outcome.key)
                if point is not None:
                    point.outcome = changed[outcome.key]
        return [(rank, changed.get(outcome.key, outcome)) for rank, outcome in sent]

    def _decide(
        self, key: tuple[int, int], point: _Point, missing: set[int], now: float
    ) -> Outcome:
        counted = {r: s for r, s in point.posts.items() if r not in missing}
        return Outcome(
            key=key,
            statuses=dict(sorted(counted.items())),
            labels=dict(sorted(point.labels.items())),
            missing=tuple(sorted(missing)),
            lost=tuple(sorted(self.lost & missing)),
            gave_up=tuple(sorted(point.gave_up)),
            dropped={r: self.dropped[r] for r in sorted(missing) if r in self.dropped},
            waited=round(max(now - point.opened, 0.0), 3),
        )


def malformed(rank: int, label: str, why: str) -> Status:
    """The status of a rank whose own post the channel would not carry: its failure, which every
    rank reads alike."""
    return Status(
        failure=Failure(
            rank=rank,
            stage="agreement",
            where="",
            mode="the agreement channel",
            error=text(
                f"MalformedStatus: rank {rank} posted a status at '{label}' that the channel "
                f"does not accept ({why}); every rank must run the same fd-cudagraph-plugin",
                MAX_TEXT,
            ),
            out_of_memory=False,
            explained=True,
            advice="",
        )
    )


# ---------------------------------------------------------------------------------- address


@dataclass(frozen=True)
class Address:
    """Where TP rank 0's server listens. ``endpoint`` is a ZeroMQ endpoint: ``ipc://PATH``
    (derived by every rank alike: nothing to publish) or ``tcp://HOST`` (bound by rank 0 on a
    port of ``ports`` or the kernel's choice, then published in the job store with a token)."""

    endpoint: str
    ports: tuple[int, int] | None = None

    @property
    def published(self) -> bool:
        return self.endpoint.startswith("tcp://")


class JoinError(RuntimeError):
    """This rank could not join its group's agreement channel."""


def address_for(
    job: str, name: str, group: list[int], interface: str, ports: tuple[int, int] | None
) -> Address:
    """Where the group of ``group`` (global ranks) agrees. ``interface`` is
    ``FD_CUDAGRAPH_AGREEMENT_INTERFACE`` ("auto", an address or an interface name), ``ports``
    ``FD_CUDAGRAPH_AGREEMENT_PORTS``; either set means TCP."""
    if interface != "auto":
        return Address(f"tcp://{interface}", ports)
    host = node_host(group)
    if host is not None or ports is not None:
        return Address(f"tcp://{host or '127.0.0.1'}", ports)
    digest = hashlib.sha256(f"{job}\0{name}\0{group}".encode()).hexdigest()[:24]
    return Address(f"ipc://{private_directory()}/{digest}.sock")


def node_host(group: list[int]) -> str | None:
    """This worker's host when the group spans hosts, else None (every rank is on this host).
    Paddle's launcher sets ``PADDLE_CURRENT_ENDPOINT`` and ``PADDLE_TRAINER_ENDPOINTS`` (every
    rank's, by global rank) in every worker; without them the ranks are taken to share a host,
    as FastDeploy's single-node launch does."""
    host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0]
    if not host:
        return None
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    if not endpoints or any(r >= len(endpoints) for r in group):
        return host  # where the ranks are is unknown: reachable from other hosts
    if all(endpoints[r].rpartition(":")[0] == host for r in group):
        return None
    return host


def private_directory() -> str:
    """A directory only this user can enter, for the group's Unix socket: made with mode 0700,
    and refused if it exists as anything else (another user's, a link, open to others)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"fd-cudagraph-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.geteuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise JoinError(
            f"{path} exists but is not a directory private to this user (mode "
            f"{stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}); the ranks' Unix socket goes "
            f"there. Remove it, or set XDG_RUNTIME_DIR to a private directory"
        )
    return path


# ---------------------------------------------------------------------------------- sockets


_descriptors_checked = False


def keep_standard_descriptors() -> None:
    """Fill a closed descriptor 0, 1 or 2 with ``/dev/null`` before the first socket opens: a
    socket that took fd 2 would receive every line written to stderr (it happened: FastDeploy's
    console log went into the old channel, every rank stopped)."""
    global _descriptors_checked
    if _descriptors_checked:
        return
    _descriptors_checked = True
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            spare = os.open(os.devnull, os.O_RDWR)
            if spare != fd:
                os.dup2(spare, fd)
                os.close(spare)


class Context(zmq.Context):
    """A ZeroMQ context of the plugin's own (FastDeploy's sockets live in others), which the
    garbage collector never terminates: pyzmq's ``__del__`` does, and a context collected with
    its sockets (a link nobody closed) blocks the collecting thread in ``zmq_ctx_term`` for ever,
    since the sockets' weak references are gone by then. Its sockets close themselves when they
    are collected; closing a link or a server terminates its context."""

    def __init__(self) -> None:
        keep_standard_descriptors()
        super().__init__(io_threads=1)
        self.setsockopt(zmq.LINGER, 0)

    def __del__(self) -> None:
        pass


def _context() -> Context:
    return Context()


def _tune(sock: zmq.Socket, most: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, most)
    sock.setsockopt(zmq.SNDHWM, QUEUE)
    sock.setsockopt(zmq.RCVHWM, QUEUE)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_SECONDS * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_SECONDS * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_SECONDS * 1000))


def _bind(sock: zmq.Socket, address: Address) -> str:
    """Bind ``sock`` as ``address`` says; return the endpoint peers connect to."""
    if not address.published:
        sock.bind(address.endpoint)
        return address.endpoint
    if address.ports is None:
        sock.bind(f"{address.endpoint}:0")
    else:
        low, high = address.ports
        for port in range(low, high + 1):
            try:
                sock.bind(f"{address.endpoint}:{port}")
                break
            except zmq.ZMQError as error:
                if error.errno != zmq.EADDRINUSE:
                    raise
        else:
            raise JoinError(
                f"every port of FD_CUDAGRAPH_AGREEMENT_PORTS={low}-{high} is in use on "
                f"{address.endpoint[6:]}; widen the range"
            )
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# ---------------------------------------------------------------------------------- server


class Server(threading.Thread):
    """TP rank 0's agreement server: one ROUTER, one Decider, one thread, nothing that blocks.

    Each turn it reads a batch of messages, then the disconnections libzmq reported (a rank's
    connection is known by its file descriptor, which ZeroMQ attaches to each message), applies
    the disconnections first (a rank known lost is never counted as arrived), then the batch,
    then decides and sends."""

    def __init__(self, world: int, address: Address, token: str | None) -> None:
        super().__init__(name="fd-cudagraph-agreement", daemon=True)
        self.world = world
        self.token = token
        self.decider = Decider(world)
        self.context = _context()
        self.router = self.context.socket(zmq.ROUTER)
        _tune(self.router, MAX_TO_SERVER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.zap: zmq.Socket | None = None
        if token is not None:
            # ZeroMQ's own authentication: libzmq asks this handler (ZAP, RFC 27) at each
            # handshake, and a peer without the token is refused before it is a peer.
            self.zap = self.context.socket(zmq.REP)
            self.zap.bind(_ZAP_ENDPOINT)
            self.router.setsockopt(zmq.PLAIN_SERVER, 1)
            self.router.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.control = self.context.socket(zmq.PAIR)
        self.control.bind(f"inproc://fd-cudagraph-control-{id(self)}")
        self._wake = self.context.socket(zmq.PAIR)
        self._wake_lock = threading.Lock()
        self._wake.connect(f"inproc://fd-cudagraph-control-{id(self)}")
        #: The Unix socket's file and inode, removed at the end (libzmq leaves it), unless a
        #: later server of the same job has bound it again since.
        self._socket_file: tuple[str, int] | None = None
        #: Where rank 0's own link connects: in the process, through no I/O thread and no
        #: socket (ZeroMQ's inproc transport, in this server's context).
        self.inproc = f"inproc://fd-cudagraph-agreement-{id(self)}"
        try:
            self.router.bind(self.inproc)
            self.endpoint = _bind(self.router, address)
            if not address.published:
                path = address.endpoint[len("ipc://") :]
                self._socket_file = (path, os.stat(path).st_ino)
        except BaseException:
            self._wake.close(linger=0)
            self._close_all()
            self.context.term()
            raise
        #: Routing identity -> rank, for welcomed ranks; and each rank's descriptor.
        self.ranks: dict[bytes, int] = {}
        self.identity_of: dict[int, bytes] = {}
        self.rank_of_fd: dict[int, int] = {}
        #: Why the loop stopped, if it ever does: every rank is told, rank 0's link reads it.
        self.failure: str | None = None
        self._warned: set[str] = set()
        self._stopping = False

    # -- the loop

    def run(self) -> None:
        try:
            poller = zmq.Poller()
            for sock in (self.router, self.monitor, self.control, self.zap):
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
            while not self._stopping:
                self._turn(dict(poller.poll(1000)))
        except BaseException as error:
            self.failure = text(f"{type(error).__name__}: {error}", MAX_TEXT)
            logger.error("fd-cudagraph agreement server failed: %s", self.failure, exc_info=True)
            self._tell_everyone()
        finally:
            self._close_all()

    def stop(self) -> None:
        """End the loop and close the server's sockets (tests, and rank 0's link when it
        closes). The waking socket is the stopping thread's: ZeroMQ sockets are never shared
        between threads. The context is ended by rank 0's link, its last user, never in the
        loop's thread: that link must not be cut off (ETERM) before it has read the notice of a
        server that failed."""
        self._stopping = True
        with self._wake_lock:
            if not self._wake.closed:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake.send(b"", _NOBLOCK)
                self._wake.close(linger=0)
        if self.is_alive() and threading.current_thread() is not self:
            self.join(5)

    def _turn(self, ready: dict) -> None:
        if self.control in ready:
            with contextlib.suppress(zmq.Again):
                self.control.recv(_NOBLOCK)
        if self.zap is not None and self.zap in ready:
            self._authenticate()
        batch = self._read() if self.router in ready else []
        for fd in self._disconnections():
            rank = self.rank_of_fd.pop(fd, None)
            if rank is not None and self.identity_of.get(rank) is not None:
                self._forget(rank)
                self.decider.lose(rank)
        for identity, fd, body in batch:
            rank = self.ranks.get(identity)
            try:
                self._handle(identity, rank, fd, body)
            except BadMessage as error:
                if rank is None:
                    self._warn_once(
                        "stranger",
                        "fd-cudagraph agreement server refused a message from a connection that "
                        "is not a rank of its group (%s); further ones are refused without a log "
                        "line. Only the tensor-parallel ranks of this worker group should reach "
                        "it.",
                        error,
                    )
                    self._send(identity, Dropped(why=text(error, MAX_LABEL)))
                else:
                    self._drop(rank, str(error))
        sent = self.decider.settle(time.monotonic())
        while sent:
            encoded: dict[int, bytes] = {}  # an outcome is the same bytes for every rank
            # Checked again right before sending: a stall since the decision (this process
            # starved) may have run a rank past its deadline.
            for rank, outcome in self.decider.recheck(sent, time.monotonic()):
                identity = self.identity_of.get(rank)
                if identity is None:
                    continue
                body = encoded.get(id(outcome)) or encoded.setdefault(id(outcome), encode(outcome))
                if not self._send(identity, body):
                    self._drop(rank, "does not read its replies or is gone")
            # A rank lost while sending is lost for the points it held: decided again now.
            sent = self.decider.settle(time.monotonic())

    def _read(self) -> list[tuple[bytes, int, bytes]]:
        batch = []
        for _ in range(QUEUE * 4):
            if not _readable(self.router):
                break
            frames = self.router.recv_multipart(_NOBLOCK, copy=False)
            if len(frames) != 2:
                continue  # a DEALER sends one frame; anything else is not a rank of ours
            identity, body = frames
            batch.append((identity.bytes, _descriptor(body), body.bytes))
        return batch

    def _disconnections(self) -> list[int]:
        found = []
        while _readable(self.monitor):
            event = parse_monitor_message(self.monitor.recv_multipart(_NOBLOCK))
            if event["event"] == zmq.EVENT_DISCONNECTED:
                found.append(int(event["value"]))
        return found

    def _authenticate(self) -> None:
        """Answer libzmq's ZAP requests (RFC 27): PLAIN, with the job's token as password."""
        while True:
            try:
                request = self.zap.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            version, request_id = [*request, b"", b""][:2]
            mechanism = request[5] if len(request) > 5 else b""
            credentials = request[6:]
            good = (
                version == b"1.0"
                and mechanism == b"PLAIN"
                and len(credentials) == 2
                and credentials[0] == _ZAP_USER
                and hmac.compare_digest(credentials[1], (self.token or "").encode())
            )
            code, why = (b"200", b"OK") if good else (b"400", b"wrong token")
            self.zap.send_multipart(
                [b"1.0", request_id, code, why, _ZAP_USER if good else b"", b""]
            )
            if not good:
                self._warn_once(
                    "token",
                    "fd-cudagraph agreement server refused a connection without the job's token; "
                    "further ones are refused without a log line. Only the tensor-parallel ranks "
                    "of this worker group should reach it.",
                )

    def _handle(self, identity: bytes, rank: int | None, fd: int, body: bytes) -> None:
        if rank is None:
            message = decode(body, (Hello,), MAX_TO_SERVER)
            self._hello(identity, fd, message)  # type: ignore[arg-type]
            return
        raw = parse(body)
        op = raw.get("op") if type(raw) is dict else None
        if op == "post":
            if "status" not in raw:
                raise BadMessage("a post needs a status")
            post = Post.check({**raw, "status": _OK})
            try:
                status = Status.check(raw["status"])
                if status.failure is not None and status.failure.rank != rank:
                    raise BadMessage(f"failure.rank is {status.failure.rank}, not {rank}")
            except BadMessage as error:
                # From a rank of the group: a failure of that rank, which every rank reads in
                # the same outcome, never a KeyError on one of them.
                status = malformed(rank, post.label, text(error, MAX_LABEL))
            self.decider.post(rank, post.key, post.label, status, time.monotonic(), post.timeout)
        elif op == "give_up":
            self.decider.give_up(rank, GiveUp.check(raw).key)
        else:
            raise BadMessage(f"unknown op {str(op)[:40]!r}")

    def _hello(self, identity: bytes, fd: int, hello: Hello) -> None:
        if hello.protocol != PROTOCOL:
            self._refuse(identity, f"protocol {hello.protocol}, server {PROTOCOL}")
            return
        rank = hello.rank
        if rank >= self.world:
            self._refuse(identity, f"rank {rank} is not in 0..{self.world - 1}")
            return
        if rank in self.identity_of or rank in self.decider.lost:
            self._warn_once(
                f"claim{rank}",
                "a connection claimed tensor-parallel rank %d, which another connection claimed "
                "first; the first keeps it",
                rank,
            )
            first = "a connection now closed" if rank in self.decider.lost else "another peer"
            self._refuse(identity, f"rank {rank} was claimed first by {first}")
            return
        self.ranks[identity] = rank
        self.identity_of[rank] = identity
        if fd >= 0:
            self.rank_of_fd[fd] = rank
        if not self._send(identity, Welcome()):
            self._drop(rank, "gone before its welcome")

    def _refuse(self, identity: bytes, why: str) -> None:
        self._send(identity, Refused(why=text(why, MAX_LABEL)))

    def _send(self, identity: bytes, message: Any) -> bool:
        """Queue ``message`` for a peer without blocking; False if it cannot take it (gone, or
        its queue is full: it does not read)."""
        body = message if isinstance(message, bytes) else encode(message)
        try:
            self.router.send_multipart([identity, body], _NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _drop(self, rank: int, why: str) -> None:
        identity = self.identity_of.get(rank)
        if identity is not None:
            self._send(identity, Dropped(why=text(why, MAX_LABEL)))
        self._forget(rank)
        self.decider.lose(rank, why)
        logger.warning(
            "fd-cudagraph agreement server dropped tensor-parallel rank %d: %s", rank, why
        )

    def _forget(self, rank: int) -> None:
        identity = self.identity_of.pop(rank, None)
        self.ranks.pop(identity, None)
        for fd in [fd for fd, r in self.rank_of_fd.items() if r == rank]:
            del self.rank_of_fd[fd]

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def _tell_everyone(self) -> None:
        notice = ServerFailed(why=self.failure or "")
        for identity in list(self.identity_of.values()):
            with contextlib.suppress(Exception):  # best effort: nothing may block here
                self._send(identity, notice)

    def _close_all(self) -> None:
        for sock in (self.router, self.monitor, self.control, self.zap):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
        if self._socket_file is not None:
            path, inode = self._socket_file
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)


# pyzmq's constants are enums, whose operators cost microseconds a call on the agreement's path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_OK = Status().to_json()


def _readable(sock: zmq.Socket) -> bool:
    """A message waits on ``sock`` (asked without raising ``zmq.Again`` for every turn)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def _descriptor(frame: zmq.Frame) -> int:
    """The file descriptor of the connection ``frame`` came on (libzmq's ``ZMQ_SRCFD``), which
    its disconnection event names; -1 where libzmq does not say (then a dead rank is found when
    a reply to it fails, or at its peers' timeout)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return -1


# ---------------------------------------------------------------------------------- client


class Store(Protocol):
    """What the agreement needs of Paddle's ``TCPStore``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


_TIMED_OUT = object()
_CLOSED = object()


class ZmqLink:
    """A rank's DEALER to its group's agreement server (hosted by the group's rank 0)."""

    def __init__(
        self,
        rank: int,
        world: int,
        endpoint: str,
        token: str | None,
        server: Server | None = None,
    ) -> None:
        self.rank = rank
        self.world = world
        #: The server this rank hosts (rank 0), kept alive with the link; its link connects in
        #: the process (``Server.inproc``), in the server's context.
        self.server = server
        self.endpoint = server.inproc if server is not None else endpoint
        self._context = server.context if server is not None else _context()
        self._sock = self._context.socket(zmq.DEALER)
        _tune(self._sock, max_message_bytes(world))
        if token is not None:
            self._sock.setsockopt(zmq.PLAIN_USERNAME, _ZAP_USER)
            self._sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        self._sock.connect(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        #: What the connection's monitor said: the handshake succeeded; the connection dropped
        #: after that (TP rank 0's process is gone); the server refused the handshake.
        self._connected = self._closed = self._refused = False
        self._epoch = -1
        self._point = 0
        self._lock = threading.Lock()
        #: Set once the channel failed for good: every later point fails at once with it.
        self._broken = ""

    # -- joining

    def hello(self, deadline: float) -> None:
        """Say which rank this is and wait for the welcome, until ``deadline``."""
        self._sock.send(encode(Hello(protocol=PROTOCOL, rank=self.rank)))
        while True:
            message = self._receive(deadline - time.monotonic())
            if message is _TIMED_OUT:
                raise _NoAnswer()
            if message is _CLOSED:
                raise JoinError("the connection to the agreement server dropped before its welcome")
            if isinstance(message, str):
                raise JoinError(message)
            if isinstance(message, Welcome):
                return
            if isinstance(message, (Refused, Dropped)):
                raise JoinError(f"the agreement server refused rank {self.rank}: {message.why}")

    def next_epoch(self) -> int:
        with self._lock:
            self._epoch += 1
            self._point = 0
            return self._epoch

    def close(self) -> None:
        for sock in (self._sock, self._monitor):
            with contextlib.suppress(Exception):
                sock.close(linger=0)
        if self.server is not None:
            self.server.stop()  # its sockets are in this link's context: closed first
            if self.server.is_alive():
                return  # a loop that did not end holds its sockets: leave the context be
        with contextlib.suppress(Exception):
            self._context.term()

    # -- points

    def agree(self, label: str, status: Status, timeout: float) -> Agreed:
        with self._lock:
            key = (self._epoch, self._point)
            self._point += 1
            reply = self._exchange(key, label, status, timeout)
            if isinstance(reply, str):
                return alone(label, self.rank, status, reply)
            if reply is _CLOSED:  # the server is gone: TP rank 0's process exited
                return alone(label, self.rank, status, missing=(0,), lost=(0,))
            return Agreed(label, reply)

    def _exchange(self, key: tuple[int, int], label: str, status: Status, timeout: float) -> Any:
        """The outcome of point ``key``; ``_CLOSED``; or why the channel failed (a str)."""
        if self._broken:
            return self._broken
        started = time.monotonic()
        end = started + timeout
        give_up_at = end - give_up_margin(timeout)
        self._sock.send(_post(key, label, status, self.rank, timeout))
        gave_up = False
        while True:
            now = time.monotonic()
            if not gave_up and now >= give_up_at:
                gave_up = True
                self._sock.send(encode(GiveUp(key=key)))
                continue
            if gave_up and now >= end:
                # The server answers a give-up at once; it did not: it is stalled (rank 0's
                # process stopped or starved). No rank can complete this point now: the give-up
                # is decided first by a server that wakes up.
                return self._fail_for_good(
                    f"the agreement server on tensor-parallel rank 0 did not answer within "
                    f"{now - started:.3g} s (FD_CUDAGRAPH_RANK_TIMEOUT, {timeout:g} s)"
                )
            message = self._receive((give_up_at if not gave_up else end) - now)
            if message is _TIMED_OUT:
                continue
            if message is _CLOSED:
                return self._gone()
            if isinstance(message, str):
                return self._fail_for_good(message)
            if isinstance(message, ServerFailed):
                return self._fail_for_good(
                    f"the agreement server on tensor-parallel rank 0 failed ({message.why})"
                )
            if isinstance(message, Dropped):
                return self._fail_for_good(
                    f"the agreement server dropped tensor-parallel rank {self.rank}: {message.why}"
                )
            if not isinstance(message, Outcome) or message.key != key:
                continue  # a late reply to an earlier point: never taken for this one
            if not message.fits(self.world):
                return self._fail_for_good("the agreement server sent an outcome of other ranks")
            return message

    def _receive(self, seconds: float) -> Any:
        """The next message; ``_TIMED_OUT``; ``_CLOSED``; or a str saying what was wrong. What
        arrived before the connection dropped is read first."""
        deadline = time.monotonic() + max(seconds, 0.0)
        while True:
            if _readable(self._sock):
                try:
                    return decode(self._sock.recv(), TO_RANK, max_message_bytes(self.world))
                except BadMessage as error:
                    return f"the agreement server sent a malformed reply ({error})"
            if self._closed:
                return _CLOSED
            if self._refused:
                return "the agreement server refused this rank's handshake (the job's token)"
            left = deadline - time.monotonic()
            if left <= 0:
                return _TIMED_OUT
            if self._monitor in dict(self._poller.poll(max(int(left * 1000), 1))):
                event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self._closed = self._connected
                else:  # a failed handshake: the server refused this rank's token
                    self._refused = True

    def _gone(self) -> Any:
        """The connection closed: a server that failed said why first; else rank 0 exited."""
        failure = self.server.failure if self.server is not None else None
        if failure:
            return self._fail_for_good(
                f"the agreement server on tensor-parallel rank 0 failed ({failure})"
            )
        return _CLOSED

    def _fail_for_good(self, why: str) -> str:
        self._broken = text(why, MAX_TEXT)
        return self._broken


class _NoAnswer(Exception):
    pass


def _post(key: tuple[int, int], label: str, status: Status, rank: int, timeout: float) -> bytes:
    """A post's bytes. A status the channel would refuse (too large, not JSON) becomes this
    rank's failure, so that every rank stops on it with the reason."""
    label = text(label, MAX_LABEL)
    post = Post(key=key, label=label, timeout=timeout, status=status)
    try:
        body = encode(post)
    except (TypeError, ValueError) as error:
        why = f"it is not JSON ({type(error).__name__}: {error})"
    else:
        if len(body) <= MAX_TO_SERVER:
            return body
        why = f"it is {len(body)} bytes, over the channel's {MAX_TO_SERVER}"
    return encode(dataclasses.replace(post, status=malformed(rank, label, text(why, MAX_LABEL))))


# ---------------------------------------------------------------------------------- joining


def join(
    store: Callable[[], Store] | None,
    prefix: str,
    address: Address,
    rank: int,
    world: int,
    timeout: float,
) -> ZmqLink:
    """This rank's link to its group's channel, within ``timeout`` seconds in all. Rank 0 starts
    the server first. A Unix socket needs nothing more; a TCP server's endpoint and token travel
    through the job store (``store`` makes the client), each call of it bounded too."""
    started = time.monotonic()
    deadline = started + timeout
    server = None
    token = secrets.token_hex(16) if address.published else None
    try:
        if rank == 0:
            server = Server(world, address, token)
            server.start()
            logger.info(
                "fd-cudagraph agreement: tensor-parallel rank 0 of %d listens on %s",
                world,
                server.endpoint,
            )
            endpoint = server.endpoint
            if address.published:
                _bounded(lambda: _publish(store(), prefix, endpoint, token), deadline, "publish to")
        elif address.published:
            # Polled until a moment before the deadline: running out of time there means rank 0
            # never published, which the error then says, not that the store hung.
            endpoint, token = _bounded(
                lambda: _read_published(store(), prefix, deadline - _STORE_POLL_SECONDS),
                deadline,
                "read from",
            )
        else:
            endpoint = address.endpoint
        link = ZmqLink(rank, world, endpoint, token, server)
        try:
            link.hello(deadline)
        except BaseException:
            link.close()
            raise
        return link
    except _NoAnswer:
        raise JoinError(
            f"tensor-parallel rank 0 did not start the CUDA graph agreement server within "
            f"{timeout:g} s (FD_CUDAGRAPH_RANK_TIMEOUT; waited {time.monotonic() - started:.3g} s)"
        ) from None
    except BaseException:
        if server is not None:
            server.stop()
        raise


def _bounded(call: Callable[[], Any], deadline: float, what: str) -> Any:
    """``call()`` in a daemon thread, waited for until ``deadline``: a call of Paddle's store
    blocks for as long as the store's host does not answer (rank 0's process frozen) and cannot
    be interrupted."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:
            box["error"] = error

    started = time.monotonic()
    thread = threading.Thread(target=run, name="fd-cudagraph-store", daemon=True)
    thread.start()
    thread.join(max(deadline - started, 0.0))
    if thread.is_alive():
        raise JoinError(
            f"the job store (Paddle's TCP store, hosted by global rank 0) did not answer when "
            f"this rank tried to {what} it, after {time.monotonic() - started:.3g} s"
        )
    error = box.get("error")
    if isinstance(error, (JoinError, _NoAnswer)):
        raise error
    if error is not None:
        raise JoinError(
            f"the job store (Paddle's TCP store) failed when this rank tried to {what} it: "
            f"{type(error).__name__}: {text(error, MAX_LABEL)}"
        ) from error
    return box["value"]


def _publish(store: Store, prefix: str, endpoint: str, token: str | None) -> None:
    store.set(f"{prefix}/server", json.dumps({"endpoint": endpoint, "token": token}))
    store.add(f"{prefix}/ready", 1)


_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.:\[\]_-]{1,200}")


def _read_published(store: Store, prefix: str, deadline: float) -> tuple[str, str]:
    while store.add(f"{prefix}/ready", 0) < 1:
        if time.monotonic() >= deadline:
            raise _NoAnswer()
        time.sleep(_STORE_POLL_SECONDS)
    raw = store.get(f"{prefix}/server")
    try:
        published = parse(raw if isinstance(raw, bytes) else bytes(raw))
        endpoint, token = published["endpoint"], published["token"]
    except (BadMessage, KeyError, TypeError):
        raise JoinError("the agreement server's address in the job store is malformed") from None
    if type(endpoint) is not str or not _ENDPOINT.fullmatch(endpoint):
        raise JoinError("the agreement server's address in the job store is malformed")
    if type(token) is not str or not re.fullmatch(r"[0-9a-f]{32}", token):
        raise JoinError("the agreement server's token in the job store is malformed")
    return endpoint, token


__all__ = [
    "Address",
    "Agreed",
    "Decider",
    "JoinError",
    "Link",
    "LocalLink",
    "Server",
    "ZmqLink",
    "address_for",
    "join",
]
