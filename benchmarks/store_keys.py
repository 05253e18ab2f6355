"""What the agreement leaves in Paddle's job store, and what one point costs without a launch.

A master ``TCPStore`` in a process of its own (as global rank 0's process holds it), two
``StoreLink``s in two threads of this process, each with its own client; N points of plain
statuses (most points: nothing but the counter is written). Prints the master's growth in
resident memory a point and rank 0's time a point.

    python benchmarks/store_keys.py [--points 20000]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GLOG_minloglevel", "2")

MASTER = """
import os, sys, time
from paddle.base import core
master = core.TCPStore("127.0.0.1", int(sys.argv[1]), True, 1, 60)
print("up", flush=True)
sys.stdin.read()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20000)
    args = parser.parse_args()
    from fd_cudagraph_plugin.core.ranks.link import StoreLink
    from fd_cudagraph_plugin.core.ranks.messages import Status
    from fd_cudagraph_plugin.core.ranks.store import JobStore

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    master = subprocess.Popen(
        [sys.executable, "-c", MASTER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        master.stdout.readline()
        links = [StoreLink(JobStore("127.0.0.1", port, 60), "bench/0-1", r, 2) for r in (0, 1)]
        took: dict[int, float] = {}

        def run(rank: int, first: int, count: int) -> None:
            started = time.perf_counter()
            for i in range(first, first + count):
                links[rank].agree(f"c{i // 100}.s1.{i % 100}", "capture", Status(), 60)
            took[rank] = time.perf_counter() - started

        def both(first: int, count: int) -> None:
            threads = [threading.Thread(target=run, args=(r, first, count)) for r in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        both(0, 200)  # the master's first allocations
        before = _rss(master.pid)
        both(1000, args.points)
        grown = _rss(master.pid) - before
    finally:
        master.kill()
    print(
        f"{args.points} points of 2 ranks (threads of one process): the master grew "
        f"{grown / 1e6:.2f} MB, {grown / args.points:.0f} B a point; rank 0 took "
        f"{took[0] / args.points * 1e3:.3f} ms a point"
    )
    return 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


if __name__ == "__main__":
    sys.exit(main())
