"""One rank of an agreement group in a process of its own, over Paddle's real ``TCPStore``, driven
line by line on stdin, for the liveness tests (``test_liveness.py``): the tests stop it (SIGSTOP),
kill it and reset its connection as a real worker's could be.

    python tests/agreement_rank.py RANK WORLD PORT

Rank 0 hosts the store's master, as global rank 0's process does in a Paddle job, and prints
``port N`` once it listens (PORT 0: one the kernel picks); the others connect to PORT. Each then
prints ``ready`` and reads commands:

* ``point NAME TIMEOUT``: agree once at point NAME; prints ``posted`` once its post is in the
  store, then the outcome as JSON;
* ``hold``: prints ``holding`` and waits for a line ``go`` (the test stops it in between: a rank
  stopped before it posts);
* ``reset``: shuts its connection to the store down, as a network blip would;
* ``exit``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GLOG_minloglevel", "2")

from fd_cudagraph_plugin.core.ranks.link import StoreLink
from fd_cudagraph_plugin.core.ranks.messages import Status
from fd_cudagraph_plugin.core.ranks.store import JobStore


class Announcing:
    """The store, saying ``posted`` once this rank's post bit is in (its add returned)."""

    def __init__(self, store: JobStore, rank: int) -> None:
        self.store, self.rank = store, rank
        self.endpoint = store.endpoint

    def add(self, key: str, amount: int) -> int:
        value = self.store.add(key, amount)
        if key.endswith("/c") and amount & 1 << self.rank:
            print("posted", flush=True)
        return value

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


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    master = None
    if rank == 0:
        from paddle.base import core

        if port == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        master = core.TCPStore("127.0.0.1", port, True, 1, 60)
        print(f"port {port}", flush=True)
    timeout = float(os.environ.get("RANK_TIMEOUT", "30"))
    store = JobStore("127.0.0.1", port, timeout)
    link = StoreLink(Announcing(store, rank), "test/group", rank, world)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "exit":
            break
        if words[0] == "hold":
            print("holding", flush=True)
            sys.stdin.readline()
            continue
        if words[0] == "reset":
            print(f"reset {reset(port)}", flush=True)
            continue
        name, timeout = words[1], float(words[2])
        started = time.monotonic()
        agreed = link.agree(f"p.{name}", name, Status(payload=f"rank {rank}"), timeout)
        outcome = agreed.outcome
        facts = {
            "complete": agreed.complete,
            "shared": agreed.shared(),
            "missing": list(outcome.missing),
            "gave_up": outcome.gave_up,
            "channel_failure": agreed.channel_failure,
            "took": time.monotonic() - started,
            "reconnects": store.reconnects,
        }
        print(json.dumps(facts), flush=True)
    del master
    return 0


if __name__ == "__main__":
    sys.exit(main())
