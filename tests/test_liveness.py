"""The operator's timeout is the only clock that loses a rank: real rank processes over Paddle's
real ``TCPStore`` (``agreement_rank.py``), stopped with SIGSTOP while idle, right after posting at a
point and right before it, on rank 0 (whose process hosts the store, as global rank 0's does in a
Paddle job) and on rank 1, for a stall shorter than the timeout and one past it; killed before and
after posting; cut off from the store by a connection reset; three ranks (docs/design.md, "The
agreement").

Each behaviour is shown once, with the smallest stall that shows it. The timeouts are small (what
is shown is an order, not a clock): a stall past the timeout lasts until the other rank has printed
what its own timeout made it do (or, for a rank stopped while waiting, at least its timeout), and
the one stall of fixed length, ``STALL``, is past ``PAST`` and well short of ``LONG``: the same
stall loses the rank or costs only time by the operator's timeout alone. Events are ordered by what
the ranks print (``posted``, ``frozen``, ``holding``, an outcome) and by the kernel's word that a
process is stopped, never by sleeping; the only sleeps are the stalls. Nothing asserts how long a
point took.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

RANK = Path(__file__).resolve().parent / "agreement_rank.py"
#: Seconds to wait for a line a rank must print (a bound for a rank that broke, never reached).
LINE = 120
#: A timeout a stall runs past.
PAST = 2.0
#: A stall: past ``PAST``, and well short of ``LONG``.
STALL = 3.0
#: A timeout ``STALL`` is well short of.
LONG = 10.0


class Forks:
    """``agreement_rank.py --fork-server``: Paddle imported once, each rank a process forked from
    it (a start costs a fork, not seconds of Paddle's import on 2 cores), talking over two FIFOs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.process = subprocess.Popen(
            [sys.executable, str(RANK), "--fork-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env={**os.environ, "GLOG_minloglevel": "2"},
        )
        self.lock = threading.Lock()
        self.count = 0
        assert self.process.stdout.readline().strip() == "ready"

    def fork(self, rank: int, world: int, port: int, timeout: float) -> tuple[int, Path, Path]:
        with self.lock:
            self.count += 1
            fifo_in, fifo_out = (self.folder / f"{self.count}.{end}" for end in ("in", "out"))
            os.mkfifo(fifo_in)
            os.mkfifo(fifo_out)
            self.process.stdin.write(f"{rank} {world} {port} {timeout} {fifo_in} {fifo_out}\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline().split()
        assert line[0] == "pid", line
        return int(line[1]), fifo_in, fifo_out

    def end(self) -> None:
        self.process.kill()
        self.process.wait()


class RankProcess:
    def __init__(self, forks: Forks, rank: int, world: int, port: int, timeout: float) -> None:
        self.pid, fifo_in, fifo_out = forks.fork(rank, world, port, timeout)
        self.commands = open(fifo_in, "w", buffering=1)  # noqa: SIM115 (closed by end())
        self.output = open(fifo_out)  # noqa: SIM115
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.output:
            self.lines.put(line.strip())

    def line(self, within: float = LINE) -> str:
        return self.lines.get(timeout=within)

    def outcome(self, within: float = LINE) -> dict:
        line = self.line(within)
        while line in ("posted", "frozen"):
            line = self.line(within)
        return json.loads(line)

    def expect(self, word: str) -> str:
        line = self.line()
        assert line.startswith(word), line
        return line

    def say(self, command: str) -> None:
        self.commands.write(command + "\n")
        self.commands.flush()

    def stop(self) -> None:
        """SIGSTOP, returning once the kernel says the process is stopped: the signal takes
        effect a moment after it is sent, and a peer could do a whole point meanwhile."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped()

    def stopped(self) -> None:
        """Returns once the kernel says the process is stopped."""
        status = Path(f"/proc/{self.pid}/status")
        while "T (stopped)" not in status.read_text():
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def end(self) -> None:
        """SIGKILL, returning once the process is gone (the fork server reaps it)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        while Path(f"/proc/{self.pid}").exists():
            time.sleep(0.001)
        with contextlib.suppress(OSError):
            self.commands.close()


class Group(list):
    def __init__(self, forks: Forks, world: int = 2, timeout: float = PAST) -> None:
        self.timeout = timeout
        zero = RankProcess(forks, 0, world, 0, timeout)
        self.append(zero)
        port = int(zero.expect("port").split()[1])
        self.extend(RankProcess(forks, r, world, port, timeout) for r in range(1, world))
        for rank in self:
            rank.expect("ready")

    def command(self, name: str) -> str:
        return f"point {name} {self.timeout:g}"

    def point(self, name: str, ranks=None) -> list[dict]:
        ranks = self if ranks is None else ranks
        for rank in ranks:
            rank.say(self.command(name))
        return [rank.outcome() for rank in ranks]

    def end(self) -> None:
        for rank in self:
            rank.end()


# ------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Stall:
    who: int
    #: "idle" (between two points), "after posting" (waiting at a point), "before posting"
    #: (about to post at a point the others wait at)
    where: str
    #: Past the timeout (``PAST``), or ``STALL`` at ``LONG``.
    past: bool

    @property
    def expected(self) -> str:
        if self.where == "idle" or not self.past:
            return "complete"
        if self.who == 0:
            # The store's host stopped past the timeout: rank 1's store call runs out and it
            # stops; the store applies that call when it runs again, and rank 0 completes. The one
            # window docs/design.md names.
            return "store stopped"
        # Rank 1 stopped after posting: every rank had posted, rank 0 completed, and rank 1,
        # giving up when it runs again, learns from its own add that every post came first.
        return "complete" if self.where == "after posting" else "abandoned"

    @property
    def timeout(self) -> float:
        return PAST if self.past else LONG

    def __str__(self) -> str:
        length = "past the timeout" if self.past else "short of the timeout"
        return f"rank {self.who} stopped {self.where}, {length}"


@dataclass(frozen=True)
class Kill:
    who: int
    #: "before posting" or "after posting"
    when: str

    @property
    def timeout(self) -> float:
        """Before posting, the other rank waits it out."""
        return PAST if self.when == "before posting" else LONG

    def __str__(self) -> str:
        return f"rank {self.who} killed {self.when}"


WHERE = ("idle", "after posting", "before posting")
RESET = "a reset connection on each rank, four times"
THREE = "three ranks, one late past the timeout"


def stall_once(ranks: Group, stall: Stall, name: str = "during") -> list[dict]:
    """One stall of ``stall.who`` around the point ``name``: both ranks' outcomes there."""
    stalled, other = ranks[stall.who], ranks[1 - stall.who]
    command = ranks.command(name)
    if stall.where == "idle":
        stalled.stop()
        time.sleep(STALL)  # past the timeout, with no call in flight
        stalled.resume()
        return ranks.point(name)
    if stall.where == "after posting":
        # Rank 1 stops itself right after its first read of the point's counter, before it
        # judges its deadline (where a rank that decided on its own clock would decide); rank 0
        # right after its post, so that its store applies rank 1's waiting call before any of its
        # own.
        stalled.say("freeze read" if stall.who == 1 else "freeze post")
        stalled.say(command)
        stalled.expect("posted")
        stalled.expect("frozen")
        stalled.stopped()
    else:
        stalled.say("hold")
        stalled.expect("holding")
        stalled.stop()
        stalled.say("go")
        stalled.say(command)
    other.say(command)
    seen = None
    if not stall.past:
        if stall.who == 1:
            other.expect("posted")  # the other is at the point while rank 1 stays stopped
        time.sleep(STALL)  # well short of the timeout
    else:
        # Rank 0 completed (rank 1 had posted) or gave up at its timeout; rank 1's store call
        # to the stopped store ran out.
        seen = other.outcome()
        if stall.where == "after posting" and stall.who == 1:
            # Its wait began before it stopped: past this, its timeout has run out.
            time.sleep(ranks.timeout)
    stalled.resume()
    said = {stall.who: stalled.outcome(), 1 - stall.who: seen or other.outcome()}
    return [said[0], said[1]]


def kill_once(ranks: Group, kill: Kill, name: str = "during") -> dict:
    killed, other = ranks[kill.who], ranks[1 - kill.who]
    if kill.when == "after posting":
        killed.say(ranks.command(name))
        killed.expect("posted")
    killed.end()
    other.say(ranks.command(name))
    return other.outcome()


def reset_four_times(ranks: Group, name: str = "during") -> dict:
    points = []
    for trial in range(4):
        ranks[1].say("reset")
        one = ranks[1].expect("reset")
        points.append(ranks.point(f"{name}.p{trial}"))
        ranks[0].say("reset")
        ranks[0].expect("reset")
        points.append(ranks.point(f"{name}.q{trial}"))
        assert one != "reset 0", one
    return {"points": points}


def run_case(ranks: Group, case) -> dict:
    """``case`` between two points every rank must complete (a kill: after one)."""
    before = ranks.point("before")
    if isinstance(case, Stall):
        return {"before": before, "during": stall_once(ranks, case), "after": ranks.point("after")}
    if isinstance(case, Kill):
        return {"before": before, "other": kill_once(ranks, case)}
    return {"before": before, **reset_four_times(ranks)}


def three_ranks(ranks: Group) -> dict:
    """Ranks 0 and 1 reach the point; rank 2 only once both gave up."""
    first = ranks.point("late", ranks[:2])
    last = ranks.point("late", ranks[2:])
    return {"during": [*first, *last], "after": ranks.point("after")}


#: Every case, each in a group of two ranks of its own, all at once (a rank's start is a fork).
CASES = [
    *(Stall(who, where, True) for who in (0, 1) for where in WHERE),
    *(Stall(who, where, False) for who in (0, 1) for where in WHERE[1:]),
    *(Kill(who, when) for who in (0, 1) for when in ("before posting", "after posting")),
    RESET,
    THREE,
]
STALLS = [case for case in CASES if isinstance(case, Stall)]
KILLS = [case for case in CASES if isinstance(case, Kill)]


def run_alone(forks: Forks, case) -> dict:
    """``case`` in a group of its own; an error is asserted by the case's test."""
    try:
        if case == THREE:
            ranks = Group(forks, world=3, timeout=PAST)
        else:
            ranks = Group(forks, timeout=LONG if case == RESET else case.timeout)
        try:
            return three_ranks(ranks) if case == THREE else run_case(ranks, case)
        finally:
            ranks.end()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def run_all(folder: Path) -> dict:
    """Every case at once: what they do is mostly stalls and timeouts, not work."""
    forks = Forks(folder)
    try:
        with ThreadPoolExecutor(len(CASES)) as pool:
            futures = {case: pool.submit(run_alone, forks, case) for case in CASES}
            return {case: future.result() for case, future in futures.items()}
    finally:
        forks.end()


class Running:
    """``run_all`` in a thread of its own, beside the in-process tests (conftest.py starts it
    once collection is done, and this module's tests go last)."""

    def __init__(self, folder: Path) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="liveness")
        self.future = self.pool.submit(run_all, folder)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def start_early(tmp_path_factory) -> Running:
    return Running(tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def facts(started) -> dict:
    return started.future.result()


def _completes(point: list[dict]) -> bool:
    return all(o["complete"] for o in point)


@pytest.mark.parametrize("stall", STALLS, ids=str)
def test_a_stall_costs_time_or_fails_the_point_alike_and_never_breaks_the_group(facts, stall):
    """Rank 1 stopped right after its first read at a point and woken past its timeout is where
    0.6.0's link decided alone (at twice the timeout; 3 of 20 points split in issue 41's runs):
    here it gives up, and its own add says every post came first."""
    found = facts[stall]
    assert "error" not in found, found
    assert _completes(found["before"]), found
    during = found["during"]
    expected = stall.expected
    if expected == "complete":
        assert _completes(during), (str(stall), during)
        assert [o["shared"] for o in during] == [["rank 0", "rank 1"]] * 2
    elif expected == "abandoned":
        # Both ranks read the point as abandoned, naming the same rank: none went on alone.
        assert not any(o["complete"] for o in during), (str(stall), during)
        assert [(o["missing"], o["gave_up"]) for o in during] == [([1], 0)] * 2, during
    else:
        zero, one = during
        assert zero["complete"], (str(stall), during)
        assert "job store" in one["channel_failure"] and "restart the job" in one["channel_failure"]
    assert _completes(found["after"]), (str(stall), found["after"])


@pytest.mark.parametrize("kill", KILLS, ids=str)
def test_a_killed_rank_is_never_waited_for_by_a_rank_that_went_on(facts, kill):
    """Killed before its post: the others fail the point after their timeout, naming it. Killed
    after: its post counts (as if it had died just after the point; the others then go on, and
    FastDeploy's engine, which watches its workers, ends the job). Rank 0 killed: its process
    held the store, and the others fail, naming it."""
    found = facts[kill]
    assert "error" not in found, found
    assert _completes(found["before"]), found
    other = found["other"]
    if kill.who == 0:
        assert not other["complete"] and "job store" in other["channel_failure"], other
    elif kill.when == "after posting":
        assert other["complete"], other
    else:
        assert not other["complete"] and other["missing"] == [1] and other["gave_up"] == 0, other


def test_a_reset_connection_costs_a_reconnect_and_no_point(facts):
    """0.6.0: one reset of a live rank's connection broke every later point of the group."""
    found = facts[RESET]
    assert "error" not in found, found
    points = found["points"]
    assert all(_completes(point) for point in points), points
    assert points[-1][1]["reconnects"] == 4 and points[-1][0]["reconnects"] == 4, points[-1]


def test_three_ranks_one_late_past_the_timeout_fail_alike_and_the_next_point_completes(facts):
    found = facts[THREE]
    assert "error" not in found, found
    during = found["during"]
    assert not any(o["complete"] for o in during), during
    assert len({(tuple(o["missing"]), o["gave_up"]) for o in during}) == 1, during
    assert during[0]["missing"] == [2]
    assert _completes(found["after"]), found["after"]
