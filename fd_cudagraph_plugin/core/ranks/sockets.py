"""The one place that configures libzmq for the agreement: the context, and each socket's bounds.

Liveness comes from libzmq and from nothing else: a connection closes when its process exits (on
one host at once; over TCP when the peer's kernel resets it), which the socket monitor reports.
There are no ZMTP heartbeats: they would be a second clock beside ``FD_CUDAGRAPH_RANK_TIMEOUT``
that drops a live rank for a stall shorter than the operator's timeout. A rank that is alive but
slow is waited for until its peers' timeout.
"""

from __future__ import annotations

import os
import threading

import zmq

#: Seconds a new connection has to finish ZeroMQ's handshake (PLAIN included): a stranger that
#: does not speak ZMTP costs its own connection for this long, and nothing else.
HANDSHAKE_SECONDS = 1.0
#: Messages queued per peer, each way. An honest rank has at most two in flight.
QUEUE = 64
#: How soon a rank's DEALER connects again after its connection closed: at once (100 ms) and
#: never slower than a second, so that a rank whose network blinked is back within a point.
RECONNECT_MS, RECONNECT_MAX_MS = 100, 1000

_guard = threading.Lock()
_guarded = False


def keep_standard_descriptors() -> None:
    """Fill a closed descriptor 0, 1 or 2 with ``/dev/null`` before the first socket opens: a
    socket that took fd 2 would receive every line written to stderr, FastDeploy's console log
    among them. Done under a lock, and marked done only after, so that no thread opens a context
    while another still fills them."""
    global _guarded
    with _guard:
        if _guarded:
            return
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
            except OSError:
                spare = os.open(os.devnull, os.O_RDWR)
                if spare != fd:
                    os.dup2(spare, fd)
                    os.close(spare)
        _guarded = True


class Context(zmq.Context):
    """A ZeroMQ context of the plugin's own (FastDeploy's sockets live in others), which the
    garbage collector never terminates: pyzmq's ``__del__`` does, and a context collected with
    its sockets (a link nobody closed) blocks the collecting thread in ``zmq_ctx_term`` for ever,
    since the sockets' weak references are gone by then. Closing a link or a server terminates
    its context."""

    def __init__(self) -> None:
        keep_standard_descriptors()
        super().__init__(io_threads=1)
        self.setsockopt(zmq.LINGER, 0)

    def __del__(self) -> None:
        pass


def bounded(sock: zmq.Socket, most: int) -> zmq.Socket:
    """``sock`` with the agreement's bounds: each part at most ``most`` bytes (libzmq drops a
    connection announcing more, before reading it), ``QUEUE`` messages each way, the handshake
    deadline, and quick reconnection."""
    sock.setsockopt(zmq.MAXMSGSIZE, most)
    sock.setsockopt(zmq.SNDHWM, QUEUE)
    sock.setsockopt(zmq.RCVHWM, QUEUE)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


#: pyzmq's constants are enums, whose operators cost microseconds a call on the agreement's path.
EVENTS, POLLIN, NOBLOCK = (
    int(zmq.EVENTS),
    int(zmq.POLLIN),
    int(zmq.NOBLOCK),
)


def readable(sock: zmq.Socket) -> bool:
    """A message waits on ``sock`` (asked without raising ``zmq.Again`` for every turn)."""
    return bool(sock.getsockopt(EVENTS) & POLLIN)
