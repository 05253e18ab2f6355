"""One rank of an agreement group in a process of its own, over Paddle's real ``TCPStore``, driven
line by line on stdin (or two FIFOs, forked by ``--fork-server``), for the liveness tests
(``test_liveness.py``): the tests stop it (SIGSTOP), kill it and reset its connection as a real
worker's could be.

    python tests/agreement_rank.py RANK WORLD PORT
    python tests/agreement_rank.py --fork-server   (see fork_server: the tests' way)

Rank 0 hosts the store's master, as global rank 0's process does in a Paddle job, and prints
``port N`` once it listens (PORT 0: one the kernel picks); the others connect to PORT. Each then
prints ``ready`` and reads commands:

* ``point NAME TIMEOUT``: agree once at point NAME; prints ``posted`` once its post is in the
  store, then the outcome as JSON;
* ``freeze post`` or ``freeze read``: at the next point, this rank stops itself (SIGSTOP) right
  after its post's add returned, or right after its first read of the point's counter after
  posting (its wait has begun and its deadline is set, nothing of the others' posts seen: a
  rank stopped there and woken past its timeout gives up, the path 0.6.0 split on); prints
  ``frozen`` first;
* ``hold``: prints ``holding`` and waits for a line ``go`` (the test stops it in between: a rank
  stopped before it posts);
* ``reset``: shuts its connection to the store down, as a network blip would;
* ``exit``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GLOG_minloglevel", "2")

from fd_cudagraph_plugin.core.ranks.link import StoreLink
from fd_cudagraph_plugin.core.ranks.messages import Status
from fd_cudagraph_plugin.core.ranks.store import JobStore


class Announcing:
    """The store, saying ``posted`` once this rank's post bit is in (its add returned)."""

    def __init__(self, store: JobStore, rank: int, say: Callable[[str], None]) -> None:
        self.store, self.rank, self.say = store, rank, say
        self.endpoint = store.endpoint
        #: Where this rank stops itself at its next point: "post", "read" or None.
        self.freeze: str | None = None

    def add(self, key: str, amount: int) -> int:
        value = self.store.add(key, amount)
        if key.endswith("/c") and amount & 1 << self.rank:
            self.say("posted")
            if self.freeze == "post":
                self._stop()
        elif key.endswith("/c") and amount == 0 and self.freeze == "read":
            self._stop()
        return value

    def _stop(self) -> None:
        self.freeze = None
        self.say("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)


def reset(port: int) -> int:
    """Shut down every connection of this process to the store's port (its client's): both
    processes live on, as after a network blip. Returns how many."""
    done = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
        except OSError:
            continue
    return done


def serve(rank: int, world: int, port: int, timeout: float, lines: TextIO, out: TextIO) -> int:
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    master = None
    if rank == 0:
        from paddle.base import core

        if port == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        master = core.TCPStore("127.0.0.1", port, True, 1, 60)
        say(f"port {port}")
    store = JobStore("127.0.0.1", port, timeout)
    announcing = Announcing(store, rank, say)
    link = StoreLink(announcing, "test/group", rank, world)
    say("ready")
    for line in lines:
        words = line.split()
        if not words or words[0] == "exit":
            break
        if words[0] == "hold":
            say("holding")
            lines.readline()
            continue
        if words[0] == "freeze":
            announcing.freeze = words[1]
            continue
        if words[0] == "reset":
            say(f"reset {reset(port)}")
            continue
        name, timeout = words[1], float(words[2])
        agreed = link.agree(f"p.{name}", name, Status(payload=f"rank {rank}"), timeout)
        outcome = agreed.outcome
        facts = {
            "complete": agreed.complete,
            "shared": agreed.shared(),
            "missing": list(outcome.missing),
            "gave_up": outcome.gave_up,
            "channel_failure": agreed.channel_failure,
            "reconnects": store.reconnects,
        }
        say(json.dumps(facts))
    del master
    return 0


def fork_server() -> int:
    """Paddle imported once; each line ``RANK WORLD PORT TIMEOUT IN OUT`` forks a rank that
    reads its commands from the FIFO ``IN`` and writes to the FIFO ``OUT`` (opened in that order),
    and prints ``pid N``. Forking a process that imported Paddle is what Paddle's own DataLoader
    workers do."""
    from paddle.base import core  # noqa: F401 (every rank would import it again)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped as they end
    print("ready", flush=True)
    for line in sys.stdin:
        rank, world, port, timeout, fifo_in, fifo_out = line.split()
        pid = os.fork()
        if pid == 0:
            code = 1  # the files it opens last as long as it; it ends with os._exit
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                lines = open(fifo_in)  # noqa: SIM115
                out = open(fifo_out, "w")  # noqa: SIM115
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)  # the fork server's own pipes are not this rank's
                os.dup2(null, 1)
                code = serve(int(rank), int(world), int(port), float(timeout), lines, out)
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--fork-server"]:
        return fork_server()
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    timeout = float(os.environ.get("RANK_TIMEOUT", "30"))
    return serve(rank, world, port, timeout, sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
