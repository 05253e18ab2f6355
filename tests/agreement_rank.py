"""One rank of an agreement group in a process of its own, driven line by line on stdin, for the
liveness tests (``test_liveness.py``): the tests stop it (SIGSTOP), kill it and time it as a real
worker would be.

    python tests/agreement_rank.py RANK WORLD [ENDPOINT TOKEN]

Rank 0 starts the server and prints ``endpoint token``; the others connect to the endpoint given.
Each then prints ``ready`` and reads commands:

* ``epoch TIMEOUT``: a new session (``Link.next_epoch``);
* ``point LABEL TIMEOUT [DELAY]``: after DELAY seconds, agree once; prints the outcome as JSON;
* ``exit``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd_cudagraph_plugin.core.ranks.link import ZmqLink
from fd_cudagraph_plugin.core.ranks.messages import Status
from fd_cudagraph_plugin.core.ranks.server import Server


def main() -> int:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    if rank == 0:
        server = Server(world, "tcp://127.0.0.1")
        server.start()
        link = ZmqLink(0, world, "", server.token, server)
        print(server.endpoint, server.token, flush=True)
    else:
        link = ZmqLink(rank, world, sys.argv[3], sys.argv[4])
    link.hello(time.monotonic() + 30)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "exit":
            break
        if words[0] == "epoch":
            link.next_epoch(float(words[1]))
            continue
        label, timeout = words[1], float(words[2])
        time.sleep(float(words[3]) if len(words) > 3 else 0.0)
        started = time.monotonic()
        agreed = link.agree(label, Status(payload=f"rank {rank}"), timeout)
        outcome = agreed.outcome
        facts = {
            "complete": agreed.complete,
            "shared": agreed.shared(),
            "missing": list(outcome.missing),
            "lost": list(outcome.lost),
            "gave_up": list(outcome.gave_up),
            "channel_failure": agreed.channel_failure,
            "took": time.monotonic() - started,
        }
        print(json.dumps(facts), flush=True)
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
