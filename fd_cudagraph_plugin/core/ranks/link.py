"""One rank's end of its tensor-parallel group's agreement: post a status at a point, get back the
outcome TP rank 0's server decided for every rank.

A rank never decides a point alone while the server can still answer: when its
``FD_CUDAGRAPH_RANK_TIMEOUT`` runs out it asks the server to abandon the point and waits for the
server's verdict, that abandonment or the completion decided first. It decides alone only when
the server is gone, or silent for a second timeout (rank 0's whole process stopped or starved).
A rank's next session starts after the highest epoch any rank reached (``Outcome.top``), so
ranks that lost step meet again there.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from fd_cudagraph_plugin.core.ranks import sockets
from fd_cudagraph_plugin.core.ranks.messages import (
    MAX_LABEL,
    MAX_POST_BYTES,
    MAX_TEXT,
    PROTOCOL,
    TO_RANK,
    UNREADABLE,
    Failure,
    GiveUp,
    Hello,
    Outcome,
    Post,
    Refused,
    ServerFailed,
    Status,
    Welcome,
    encode,
    malformed,
    max_message_bytes,
    text,
)
from fd_cudagraph_plugin.core.ranks.server import OTHER_GROUP, USER, Server


class Link(Protocol):
    """One rank's end of the agreement channel of its tensor-parallel group."""

    rank: int
    world: int

    def agree(self, label: str, status: Status, timeout: float) -> Agreed:
        """Post ``status`` at the next point; return the outcome every rank reads."""

    def next_epoch(self, timeout: float) -> int:
        """A new session: points are numbered from 0 again."""


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

    def next_epoch(self, timeout: float) -> int:
        return 0


class JoinError(RuntimeError):
    """This rank could not join its group's agreement channel."""


class Stale(JoinError):
    """The endpoint read is not this group's server (gone, or another group's): read it again."""


_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


@dataclass
class _State:
    """What this rank knows of its connection to the server."""

    #: The handshake succeeded at least once (the server was there).
    met: bool = False
    #: The connection closed and has not been made again.
    down: bool = False
    #: Why the server is gone for good (its process exited), or "".
    gone: str = ""
    #: Why the server no longer counts this rank (it must say hello again), or "".
    refused: str = ""
    #: The highest epoch the server has said any rank reached.
    top: int = -1


class ZmqLink:
    """A rank's DEALER to its group's agreement server (hosted by the group's rank 0: its own
    link connects in the process, ``Server.inproc``)."""

    def __init__(
        self,
        rank: int,
        world: int,
        endpoint: str,
        token: str,
        server: Server | None = None,
        group: str = "",
    ) -> None:
        self.rank = rank
        self.world = world
        self.group = server.group if server is not None else group
        self.server = server
        self.endpoint = server.inproc if server is not None else endpoint
        self._context = server.context if server is not None else sockets.Context()
        self._sock = sockets.bounded(self._context.socket(zmq.DEALER), max_message_bytes(world))
        # The same routing id for as long as this link lives: a connection made again is still
        # this rank (libzmq reserves ids that start with a zero byte).
        self._sock.setsockopt(zmq.ROUTING_ID, b"r" + secrets.token_bytes(15))
        self._sock.setsockopt(zmq.PLAIN_USERNAME, USER.encode())
        self._sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
        self._monitor = None if server is not None else self._sock.get_monitor_socket(_EVENTS)
        self._sock.connect(self.endpoint)
        self._poller = zmq.Poller()
        for sock in (self._sock, self._monitor):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        self._state = _State()
        self._epoch = -1
        self._point = 0
        self._lock = threading.Lock()

    # -- joining

    def hello(self, deadline: float) -> None:
        """Say which rank this is and wait for the welcome, until ``deadline``. ``Stale`` when
        the endpoint is not this group's server; ``TimeoutError`` when nothing answered."""
        state = self._state
        state.refused = ""
        self._sock.send(encode(Hello(protocol=PROTOCOL, rank=self.rank, group=self.group)))
        while True:
            for message in self._take(deadline - time.monotonic()):
                if isinstance(message, Welcome):
                    return
                if isinstance(message, Refused):
                    if message.why.startswith(OTHER_GROUP):
                        raise Stale(message.why)  # an older group's server: read again
                    raise JoinError(f"the agreement server refused rank {self.rank}: {message.why}")
                if isinstance(message, ServerFailed):
                    raise JoinError(f"the agreement server failed ({message.why})")
            if state.gone:
                raise Stale(state.gone)
            if time.monotonic() >= deadline:
                raise TimeoutError

    def next_epoch(self, timeout: float) -> int:
        """A new session, after the highest epoch any rank reached. A rank the server stopped
        counting says hello again first: the group forms again here."""
        with self._lock:
            if self._state.refused and not self._state.gone:
                with contextlib.suppress(JoinError, TimeoutError):
                    self.hello(time.monotonic() + timeout)
            self._epoch = max(self._epoch + 1, self._state.top + 1)
            self._point = 0
            return self._epoch

    def close(self) -> None:
        for sock in (self._sock, self._monitor):
            if sock is not None:
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
            state = self._state
            if state.gone:
                return alone(label, self.rank, status, missing=(0,), lost=(0,))
            if state.refused:
                return alone(label, self.rank, status, _refused(state.refused))
            body = _post(key, label, status, self.rank)
            self._sock.send(body)
            posted = time.monotonic()
            gave_up = False
            while True:
                deadline = posted + (2 * timeout if gave_up else timeout)
                for message in self._take(deadline - time.monotonic(), resend=body):
                    if isinstance(message, Outcome):
                        if message.key != key:
                            continue  # a late reply to an earlier point
                        if not message.fits(self.world):
                            failure = "the agreement server sent an outcome of other ranks"
                            return alone(label, self.rank, status, failure)
                        state.top = max(state.top, message.top)
                        return Agreed(label, message)
                    if isinstance(message, Refused):
                        state.refused = text(message.why, MAX_LABEL)
                        return alone(label, self.rank, status, _refused(state.refused))
                    if isinstance(message, ServerFailed):
                        return alone(label, self.rank, status, _failed(message.why))
                    if isinstance(message, str):
                        return alone(label, self.rank, status, message)
                if state.gone:
                    return alone(label, self.rank, status, missing=(0,), lost=(0,))
                server = self.server
                if server is not None and (server.failure or not server.is_alive()):
                    why = server.failure or "its thread has stopped"
                    return alone(label, self.rank, status, _failed(why))
                now = time.monotonic()
                if not gave_up and now >= posted + timeout:
                    gave_up = True
                    self._sock.send(encode(GiveUp(key=key)))
                elif gave_up and now >= posted + 2 * timeout and self.server is None:
                    # Rank 0's process stopped answering for a whole timeout after this rank's
                    # own ran out: stopped, starved or its host gone. (Rank 0's own server runs
                    # in this process: it answers whenever this rank does.)
                    return alone(
                        label,
                        self.rank,
                        status,
                        f"the agreement server on tensor-parallel rank 0 did not answer within "
                        f"{now - posted:.3g} s (twice FD_CUDAGRAPH_RANK_TIMEOUT, {timeout:g} s): "
                        f"rank 0's process is stopped, starved or gone",
                    )

    def _take(self, seconds: float, resend: bytes | None = None) -> list[Any]:
        """What has arrived, after waiting up to ``seconds`` for something: messages from the
        server (read as ``TO_RANK``), or a str saying why one could not be read. What already
        waits is read before any deadline is judged, so a rank that was stopped itself reads
        the outcome that reached it meanwhile. ``resend`` goes again when the connection is
        made again (what was queued on the closed one may be lost)."""
        if not sockets.readable(self._sock):
            events = dict(self._poller.poll(max(int(seconds * 1000), 0)))
            if self._monitor is not None and self._monitor in events:
                self._news(resend)
        taken: list[Any] = []
        while sockets.readable(self._sock):
            try:
                taken.append(TO_RANK.decode(self._sock.recv(sockets.NOBLOCK)))
            except UNREADABLE as error:
                taken.append(f"the agreement server sent a malformed message ({error})")
        return taken

    def _news(self, resend: bytes | None) -> None:
        state = self._state
        while sockets.readable(self._monitor):
            event = parse_monitor_message(self._monitor.recv_multipart(sockets.NOBLOCK))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if state.down and resend is not None:
                    self._sock.send(resend)  # the same post: the server answers it again
                state.met, state.down = True, False
            elif event == zmq.EVENT_DISCONNECTED:
                state.down = state.met
            elif state.down or not state.met:
                # A connection closed, then a new one was refused (nothing listens there now)
                # or failed its handshake (another server listens there now): the server this
                # rank joined is gone.
                state.gone = (
                    "the agreement server's endpoint no longer answers"
                    if event == zmq.EVENT_CONNECT_RETRIED
                    else "the agreement server's endpoint refused this group's token"
                )


def _post(key: tuple[int, int], label: str, status: Status, rank: int) -> bytes:
    """A post's bytes. A status the channel would refuse (too large, unencodable) becomes this
    rank's failure, so that every rank stops on it with the reason."""
    label = text(label, MAX_LABEL)
    try:
        body = encode(Post(key=key, label=label, status=status))
    except (TypeError, ValueError) as error:
        why = f"it cannot be encoded ({type(error).__name__}: {error})"
    else:
        if len(body) <= MAX_POST_BYTES:
            return body
        why = f"it is {len(body)} bytes, over the channel's {MAX_POST_BYTES}"
    return encode(Post(key=key, label=label, status=malformed(rank, label, text(why, MAX_LABEL))))


def _failed(why: str) -> str:
    return text(f"the agreement server on tensor-parallel rank 0 failed ({why})", MAX_TEXT)


def _refused(why: str) -> str:
    return text(
        f"the agreement server no longer counts this rank ({why}); it says hello again at its "
        f"next capture session or lifecycle call",
        MAX_TEXT,
    )
