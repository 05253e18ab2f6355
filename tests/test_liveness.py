"""The operator's timeout is the only clock that loses a rank: real rank processes, frozen with
SIGSTOP for 3, 7 and 60 s while idle, right after posting at a point and right before, at
``FD_CUDAGRAPH_RANK_TIMEOUT`` 30 and 300, on rank 0 (whose process hosts the server) and on
rank 1 (docs/design.md, "The agreement channel").

A stall shorter than the timeout costs only time: the point it falls in completes on every rank.
A longer one may fail that point, and then fails it on every rank alike. Either way the next
point completes: no stall breaks the group. 0.5.0 dropped a rank after 5 s of heartbeat silence
whatever the timeout said, so a 7 s stall broke every later point of the job.

Every case is a group of its own, and all run at once (the 60 s stalls set the pace).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

RANK = Path(__file__).resolve().parent / "agreement_rank.py"


class RankProcess:
    def __init__(self, rank: int, world: int, *args: str) -> None:
        command = [sys.executable, str(RANK), str(rank), str(world), *args]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def line(self, within: float) -> str:
        return self.lines.get(timeout=within)

    def say(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def end(self) -> None:
        self.process.kill()
        self.process.wait()


def group(world: int = 2) -> list[RankProcess]:
    zero = RankProcess(0, world)
    endpoint, token = zero.line(60).split()
    ranks = [zero, *(RankProcess(r, world, endpoint, token) for r in range(1, world))]
    for rank in ranks:
        assert rank.line(60) == "ready"
    return ranks


def everyone(ranks: list[RankProcess], label: str, timeout: float, within: float) -> list[dict]:
    for rank in ranks:
        rank.say(f"point {label} {timeout}")
    return [json.loads(rank.line(within)) for rank in ranks]


@dataclass(frozen=True)
class Stall:
    who: int
    #: "idle" (between two points), "after posting" (waiting at a point), "before posting"
    #: (about to post at a point the others wait at)
    where: str
    seconds: float
    timeout: float

    @property
    def survives(self) -> bool:
        if self.where == "idle" or self.seconds < self.timeout:
            return True
        # Rank 1 stopped after posting: every rank posted, and the server decided at once.
        return self.where == "after posting" and self.who != 0

    def __str__(self) -> str:
        return f"rank {self.who} stopped {self.seconds:g} s {self.where}, timeout {self.timeout:g}"


STALLS = [
    Stall(who, where, seconds, timeout)
    for timeout in (30, 300)
    for seconds in (3, 7, 60)
    for where in ("idle", "after posting", "before posting")
    for who in (0, 1)
]


def run_stall(stall: Stall) -> dict:
    ranks = group()
    try:
        stalled, other = ranks[stall.who], ranks[1 - stall.who]
        for rank in ranks:
            rank.say(f"epoch {stall.timeout}")
        before = everyone(ranks, "before", stall.timeout, 30)
        if stall.where == "idle":
            stalled.signal(signal.SIGSTOP)
            time.sleep(stall.seconds)
            stalled.signal(signal.SIGCONT)
            during = everyone(ranks, "during", stall.timeout, 30)
        else:
            if stall.where == "after posting":
                stalled.say(f"point during {stall.timeout}")
                time.sleep(0.5)  # it has posted and waits
                stalled.signal(signal.SIGSTOP)
            else:
                stalled.signal(signal.SIGSTOP)
                stalled.say(f"point during {stall.timeout}")
            other.say(f"point during {stall.timeout}")
            time.sleep(stall.seconds)
            stalled.signal(signal.SIGCONT)
            within = 2 * stall.timeout + 30
            said = {stall.who: stalled.line(within), 1 - stall.who: other.line(within)}
            during = [json.loads(said[r]) for r in (0, 1)]
        for rank in ranks:
            rank.say(f"epoch {stall.timeout}")
        after = everyone(ranks, "after", stall.timeout, 30)
        return {"before": before, "during": during, "after": after}
    finally:
        for rank in ranks:
            rank.end()


@pytest.fixture(scope="module")
def stalls() -> dict[Stall, dict]:
    results: dict[Stall, dict] = {}

    def run(stall: Stall) -> None:
        try:
            results[stall] = run_stall(stall)
        except Exception as error:  # asserted per case below
            results[stall] = {"error": f"{type(error).__name__}: {error}"}

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in STALLS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(400)
    return results


@pytest.mark.parametrize("stall", STALLS, ids=str)
def test_a_stall_shorter_than_the_timeout_costs_time_and_none_breaks_the_group(stalls, stall):
    facts = stalls[stall]
    assert "error" not in facts, facts
    assert all(o["complete"] for o in facts["before"]), facts
    during = facts["during"]
    if stall.survives:
        assert all(o["complete"] for o in during), (str(stall), during)
        assert [o["shared"] for o in during] == [["rank 0", "rank 1"]] * 2
    else:
        # Both ranks read the point as failed: none went on alone into a collective.
        assert not any(o["complete"] for o in during), (str(stall), during)
        assert max(o["took"] for o in during) <= 2 * stall.timeout + 5
    assert all(o["complete"] for o in facts["after"]), (str(stall), facts["after"])


def test_a_rank_late_by_more_than_the_timeout_fails_the_point_alike_and_the_next_one_works():
    """A lifecycle call that hangs 6 s on one rank, timeout 3 s (0.5.0: the group never worked
    again)."""
    ranks = group()
    try:
        for rank in ranks:
            rank.say("epoch 3")
        ranks[0].say("point hang 3")
        ranks[1].say("point hang 3 6")
        during = [json.loads(rank.line(30)) for rank in ranks]
        assert not any(o["complete"] for o in during)
        assert during[0]["missing"] == [1] and during[1]["missing"] == [1]
        assert 2.5 < during[0]["took"] < 4.0  # rank 0 waited its timeout, not longer
        for rank in ranks:
            rank.say("epoch 3")
        assert all(o["complete"] for o in everyone(ranks, "after", 3, 30))
    finally:
        for rank in ranks:
            rank.end()


def test_a_rank_whose_process_exits_while_idle_is_named_within_a_second_at_the_next_point():
    ranks = group(3)
    try:
        for rank in ranks:
            rank.say("epoch 300")
        assert all(o["complete"] for o in everyone(ranks, "before", 300, 30))
        ranks[2].end()
        time.sleep(0.5)
        for rank in ranks[:2]:
            rank.say("epoch 300")
        said = everyone(ranks[:2], "after", 300, 30)
        assert all(o["lost"] == [2] and not o["complete"] for o in said), said
        assert max(o["took"] for o in said) < 1.0
    finally:
        for rank in ranks:
            rank.end()
