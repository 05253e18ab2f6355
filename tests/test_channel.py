"""The agreement channel on ZeroMQ, honest and attacked: TP rank 0's server decides each point
once, every rank gets the same outcome, and nothing a stranger or a broken rank sends can stall,
fool or kill it (docs/design.md, "The agreement channel").

Ranks are threads here, each with its own DEALER to a real server, over a Unix socket (one host)
or TCP (the job store is a dict); ``test_collective.py`` runs the same code over real ranks and
Paddle's store, and ``test_liveness.py`` stops real rank processes. Every attack is followed by a
point of the honest ranks, which must complete with every status in under 2 s.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from fd_cudagraph_plugin.core.ranks import join as joining
from fd_cudagraph_plugin.core.ranks import messages, server, sockets
from fd_cudagraph_plugin.core.ranks.agreement import agreed_error
from fd_cudagraph_plugin.core.ranks.decider import Decider
from fd_cudagraph_plugin.core.ranks.join import Address, JoinError
from fd_cudagraph_plugin.core.ranks.link import LocalLink, ZmqLink
from fd_cudagraph_plugin.core.ranks.messages import MAX_POST_BYTES, Failure, Status

QUICK = 2.0  # what an honest point may take after any attack
ROOT = Path(__file__).resolve().parent.parent
IPC, TCP = Address(), Address("127.0.0.1")


class DictStore:
    """Paddle's TCPStore, as far as the agreement uses it (set, get, add)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + amount
            return self.data[key]


def encode(message: dict | list) -> bytes:
    """What a peer of our own making sends: MessagePack of plain data."""
    return msgspec.msgpack.encode(message)


class Group:
    """``world`` ranks joined to one real server; the joined ones take part in points."""

    def __init__(
        self,
        address: Address = TCP,
        world: int = 2,
        joined: int | None = None,
        timeout: float = 5.0,
        store: DictStore | None = None,
        group: str = "g",
    ) -> None:
        self.store, made, self.address = store or DictStore(), {}, address

        def connect(rank: int) -> None:
            made[rank] = joining.join(lambda: self.store, "t", address, rank, world, timeout, group)

        threads = [threading.Thread(target=connect, args=(r,)) for r in range(joined or world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        self.links = [made[r] for r in sorted(made)]
        self.server = self.links[0].server
        self.world = world
        for link in self.links:
            link.next_epoch(timeout)

    @property
    def token(self) -> str:
        return self.server.token

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    def point(self, label: str = "p", timeouts=None, statuses=None) -> tuple[list, float]:
        """Every joined rank agrees once, concurrently; their outcomes and the longest wait."""
        outcomes: dict[int, object] = {}
        took: dict[int, float] = {}

        def run(rank: int, link: ZmqLink) -> None:
            started = time.monotonic()
            status = (statuses or {}).get(rank, Status(payload=f"rank {rank}"))
            timeout = (timeouts or {}).get(rank, 5.0)
            outcomes[rank] = link.agree(label, status, timeout)
            took[rank] = time.monotonic() - started

        threads = [threading.Thread(target=run, args=(lk.rank, lk)) for lk in self.links]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return [outcomes[r] for r in sorted(outcomes)], max(took.values())

    def next_epoch(self) -> None:
        for link in self.links:
            link.next_epoch(5)

    def close(self) -> None:
        for link in self.links:
            link.close()


@pytest.fixture
def group():
    made = Group()
    yield made
    made.close()


def healthy(group: Group, label: str = "after") -> None:
    """The honest ranks' next point completes quickly with every rank's status."""
    outcomes, took = group.point(label)
    assert took < QUICK, f"an honest point took {took:.1f} s"
    for outcome in outcomes:
        assert outcome.complete, outcome
        assert outcome.shared() == [f"rank {r}" for r in range(group.world)]
    assert group.server.is_alive() and group.server.failure is None


class Peer:
    """A raw ZeroMQ DEALER: a peer that speaks ZMTP and sends whatever a test wants."""

    def __init__(self, group: Group, token: str | None = "", username: bytes = b"fd-cudagraph"):
        self.context = sockets.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            self.sock.setsockopt(zmq.PLAIN_USERNAME, username)
            self.sock.setsockopt(zmq.PLAIN_PASSWORD, (token or group.token).encode())
        self.sock.connect(group.endpoint)

    def send(self, message) -> None:
        self.sock.send(message if isinstance(message, bytes) else encode(message))

    def reply(self, within: float = QUICK) -> dict | None:
        while self.sock.poll(int(within * 1000)):
            message = msgspec.msgpack.decode(self.sock.recv())
            if message.get("type") != "Ping":
                return message
        return None

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def rogue_third_rank() -> tuple[Group, Peer]:
    """A group of 3 where ranks 0 and 1 are honest and rank 2, welcomed, is a raw peer."""
    group = Group(world=3, joined=2)
    rogue = Peer(group)
    rogue.send({"type": "Hello", "rank": 2, "protocol": messages.PROTOCOL, "group": "g"})
    assert rogue.reply() == {"type": "Welcome"}
    return group, rogue


def post(key, label="plan", status=None) -> dict:
    status = {"payload": None, "failure": None} if status is None else status
    return {"type": "Post", "key": key, "label": label, "status": status}


def closed_by_server(sock: socket.socket, within: float = QUICK) -> bool:
    """True once the server has closed ``sock`` (reads EOF or a reset)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


# ----------------------------------------------------------------------------- the honest case


@pytest.mark.parametrize("address", [IPC, TCP], ids=["unix socket", "tcp"])
def test_every_rank_gets_every_ranks_status_at_each_point(address):
    group = Group(address, world=3)
    for i in range(20):
        statuses = {r: Status(payload=f"{r} at {i}") for r in range(3)}
        outcomes, _ = group.point(f"p{i}", statuses=statuses)
        assert all(o.complete and o.shared() == [f"{r} at {i}" for r in range(3)] for o in outcomes)
    group.close()


def test_a_failure_on_one_rank_reaches_every_rank_in_the_same_outcome(group):
    failure = Failure(
        rank=1,
        stage="capture",
        where="decode size 4",
        mode="dynamic",
        error="RuntimeError: out of memory",
        out_of_memory=True,
        explained=False,
        advice="Lower --gpu-memory-utilization to 0.85.",
    )
    outcomes, _ = group.point("capture decode size 4", statuses={1: Status(failure=failure)})
    assert [o.failures for o in outcomes] == [{1: failure}, {1: failure}]
    texts = {str(agreed_error(o, 2, 5.0)) for o in outcomes}
    assert len(texts) == 1 and "Lower --gpu-memory-utilization to 0.85." in texts.pop()


def test_ranks_that_waited_for_one_that_never_came_name_it_at_the_timeout():
    group = Group(world=3, joined=3)
    late = group.links.pop(1)  # joined, never posts
    outcomes, took = group.point("plan", timeouts={0: 1.0, 2: 1.0})
    for outcome in outcomes:
        assert outcome.outcome.missing == (1,) and outcome.outcome.lost == ()
        assert outcome.outcome.gave_up
    assert 1.0 <= took <= 1.0 + 0.3  # the timeout, not a clock of the channel's own
    text = str(agreed_error(outcomes[0], 3, 1.0))
    assert "rank 1 had not reached the agreement point 'plan'" in text
    late.close()
    group.close()


def test_a_rank_that_comes_after_the_others_gave_up_gets_their_outcome(group):
    results = {}

    def slow() -> None:
        time.sleep(1.0)
        results[1] = group.links[1].agree("plan", Status(), 5)

    thread = threading.Thread(target=slow)
    thread.start()
    results[0] = group.links[0].agree("plan", Status(), 0.4)
    thread.join(10)
    assert results[0].outcome.missing == (1,)
    assert results[1].outcome.missing == (1,)  # it must not go on alone into a collective
    group.next_epoch()
    healthy(group)  # and the next session meets again


def test_a_rank_whose_link_closes_is_named_at_once():
    group = Group(world=3)
    gone = group.links.pop(2)
    threading.Timer(0.2, gone.close).start()
    outcomes, took = group.point("warm-up decode size 8", timeouts={0: 30, 1: 30})
    assert all(o.outcome.missing == (2,) and o.outcome.lost == (2,) for o in outcomes)
    assert took < 1.5
    group.close()


_RANK_PROCESS = """
import sys, time
sys.path.insert(0, {root!r})
from fd_cudagraph_plugin.core.ranks.link import ZmqLink
from fd_cudagraph_plugin.core.ranks.messages import Status
link = ZmqLink({rank}, {world}, {endpoint!r}, {token!r}, group={group!r})
link.hello(time.monotonic() + 10)
link.next_epoch(10)
{then}
print("ready", flush=True)
time.sleep(60)
"""


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait for ``condition`` (read from the server's thread's state: a test's glimpse)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.001)


def rank_process(group: Group, rank: int, then: str = "") -> subprocess.Popen:
    """A rank in a process of its own, joined and waiting; ``then`` runs after the join."""
    script = _RANK_PROCESS.format(
        root=str(ROOT),
        endpoint=group.endpoint,
        token=group.token,
        rank=rank,
        world=group.world,
        then=then,
        group=group.server.group,
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("address", [IPC, TCP], ids=["unix socket", "tcp"])
def test_a_rank_whose_process_is_killed_while_the_others_wait_is_named_within_a_second(address):
    group = Group(address, world=3, joined=2)
    rank = rank_process(group, 2)
    assert rank.stdout.readline().strip() == "ready"
    threading.Timer(0.3, rank.kill).start()
    outcomes, took = group.point("plan", timeouts={0: 30, 1: 30})
    assert took < 0.3 + 1.0
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and outcome.outcome.lost == (2,)
    assert "rank 2 closed its connection" in str(agreed_error(outcomes[0], 3, 30))
    rank.wait()
    group.close()


def test_a_rank_killed_right_after_posting_is_never_counted_as_arrived():
    """The others arrive at a point the dead rank posted at: completing it would send them into
    a collective it will never join."""
    group = Group(IPC, world=3, joined=2)
    then = 'link._sock.send(link_post((0, 0), "plan", Status(), 2))'
    then = "from fd_cudagraph_plugin.core.ranks.link import _post as link_post\n" + then
    rank = rank_process(group, 2, then)
    assert rank.stdout.readline().strip() == "ready"
    _until(lambda: 2 in group.server.decider.latest)  # its post has reached the server
    rank.kill()
    rank.wait()
    # The others post once libzmq has told the server that a connection closed (milliseconds
    # after the exit; whose, the server learns only by probing). Posts that beat that news
    # count the dead rank as arrived, as they would had it died just after the point: no
    # process can tell the two apart (docs/design.md, "What it does not guarantee").
    _until(lambda: group.server.decider.hold_until > 0)
    outcomes, took = group.point("plan", timeouts={0: 30, 1: 30})
    assert took < 1.0
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and outcome.outcome.lost == (2,)
        assert 2 not in outcome.outcome.statuses
    group.close()


def _group_hosted_elsewhere() -> tuple[subprocess.Popen, list[ZmqLink]]:
    """Rank 0 (and its server) in a process of its own; ranks 1 and 2 here."""
    script = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from fd_cudagraph_plugin.core.ranks.link import ZmqLink
from fd_cudagraph_plugin.core.ranks.server import Server
server = Server(3, "tcp://127.0.0.1")
server.start()
link = ZmqLink(0, 3, "", server.token, server)
link.hello(time.monotonic() + 10)
print(server.endpoint, server.token, flush=True)
time.sleep(60)
"""
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    endpoint, token = rank0.stdout.readline().split()
    links = []
    for rank in (1, 2):
        link = ZmqLink(rank, 3, endpoint, token)
        link.hello(time.monotonic() + 10)
        link.next_epoch(10)
        links.append(link)
    return rank0, links


def _wait_at_a_point(links: list[ZmqLink], timeout: float) -> tuple[list, float]:
    outcomes: dict[int, object] = {}
    started = time.monotonic()

    def run(link: ZmqLink) -> None:
        outcomes[link.rank] = link.agree("plan", Status(), timeout)

    threads = [threading.Thread(target=run, args=(link,)) for link in links]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [outcomes[r] for r in sorted(outcomes)], time.monotonic() - started


def test_when_rank_zeros_process_is_killed_the_others_name_rank_zero_within_a_second():
    rank0, links = _group_hosted_elsewhere()
    threading.Timer(0.3, rank0.kill).start()
    outcomes, took = _wait_at_a_point(links, 30)
    assert took < 0.3 + 1.0
    for agreed in outcomes:
        assert agreed.outcome.missing == (0,) and agreed.outcome.lost == (0,)
        assert "rank 0 closed its connection" in str(agreed_error(agreed, 3, 30))
    rank0.wait()
    for link in links:
        link.close()


def test_when_rank_zeros_process_stops_the_others_give_up_at_the_timeout_and_say_so_at_twice():
    """Rank 0's whole process stopped (its server too): the others ask at the timeout, and
    decide alone only after a second one without an answer."""
    rank0, links = _group_hosted_elsewhere()
    rank0.send_signal(signal.SIGSTOP)
    try:
        outcomes, took = _wait_at_a_point(links, 1.0)
    finally:
        rank0.kill()
        rank0.wait()
    assert 2.0 <= took < 2.0 + 0.5
    for agreed in outcomes:
        assert "on tensor-parallel rank 0 did not answer within 2 s" in agreed.channel_failure
    for link in links:
        link.close()


def test_when_rank_zeros_server_stops_the_others_name_rank_zero(group):
    group.server.stop()  # every socket of rank 0's process closes
    agreed = group.links[1].agree("end", Status(), 5)
    assert agreed.outcome.missing == (0,) and agreed.outcome.lost == (0,)


def test_a_single_rank_agrees_with_itself():
    agreed = LocalLink().agree("plan", Status(payload="seven"), 1)
    assert agreed.complete and agreed.shared() == ["seven"]


# ----------------------------------------------------------------------- one verdict per point


def test_a_rank_lost_after_it_posted_makes_the_point_abandoned():
    decider = Decider(world=3)
    for rank in range(3):
        decider.arrive(rank)
    decider.post(2, (0, 0), "plan", Status(), 0.0)
    assert decider.settle(0.0) == []
    decider.leave(2)
    decider.post(0, (0, 0), "plan", Status(), 0.0)
    decider.post(1, (0, 0), "plan", Status(), 0.0)
    sent = decider.settle(0.0)
    outcome = sent[0][1].outcome
    assert [rank for rank, _ in sent] == [0, 1] and sent[0][1] is sent[1][1]
    assert outcome.missing == (2,) and outcome.lost == (2,) and 2 not in outcome.statuses


def test_a_give_up_after_the_point_completed_changes_nothing():
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", Status(), 0.0)
    decider.post(1, (0, 0), "plan", Status(), 0.0)
    sent = decider.settle(0.0)
    decider.give_up(0, (0, 0))  # raced with the completion: nothing more is sent
    assert [(rank, point.outcome.missing) for rank, point in sent] == [(0, ()), (1, ())]
    assert decider.settle(0.0) == []


def test_a_give_up_before_completion_abandons_the_point_for_everyone():
    decider = Decider(world=3)
    decider.post(0, (0, 0), "plan", Status(), 0.0)
    decider.post(1, (0, 0), "plan", Status(), 0.0)
    decider.settle(0.0)
    decider.give_up(0, (0, 0))
    assert {rank: p.outcome.missing for rank, p in decider.settle(0.0)} == {0: (2,), 1: (2,)}
    decider.post(2, (0, 0), "plan", Status(), 0.0)  # the late rank learns it too
    assert [(rank, p.outcome.missing) for rank, p in decider.settle(0.0)] == [(2, (2,))]


def test_a_give_up_that_arrives_with_the_last_post_wins():
    # A server that was stalled reads a rank's post, its give-up and the last rank's post in one
    # batch. The rank that gave up may be deciding alone: completing the point would let the
    # last rank go on alone.
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", Status(), 0.0)
    decider.give_up(0, (0, 0))
    decider.post(1, (0, 0), "plan", Status(), 0.0)
    sent = dict(decider.settle(0.0))
    assert sent[0] is sent[1] and sent[1].outcome.gave_up == (0,)


def test_a_post_made_again_after_a_reconnection_is_answered_again():
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", Status(), 0.0)
    decider.post(1, (0, 0), "plan", Status(), 0.0)
    first = dict(decider.settle(0.0))
    decider.post(1, (0, 0), "plan", Status(), 0.0)  # its outcome was lost with the connection
    again = decider.settle(0.0)
    assert again == [(1, first[1])]


def test_ranks_waiting_at_different_sessions_are_told_at_once_and_meet_at_the_next():
    """A rank that skipped a session (it was interrupted before its point, say) waits one
    session behind: both points are abandoned at once, and every rank's next session starts
    after the highest epoch reached."""
    decider = Decider(world=2)
    decider.post(0, (7, 0), "after wakeup", Status(), 0.0)
    decider.post(1, (6, 0), "after update_weights", Status(), 0.0)
    sent = dict(decider.settle(0.0))
    for outcome in (sent[0].outcome, sent[1].outcome):
        assert outcome.elsewhere and outcome.top == 7
    assert sent[0].outcome.labels == {0: "after wakeup", 1: "after update_weights"}
    agreed = agreed_error_of(sent[0].outcome, "after wakeup")
    assert "rank 0 at 'after wakeup'; rank 1 at 'after update_weights'" in agreed


def agreed_error_of(outcome, label: str) -> str:
    from fd_cudagraph_plugin.core.ranks.link import Agreed

    return str(agreed_error(Agreed(label, outcome), 2, 5.0))


def test_a_rank_behind_a_point_the_others_passed_is_told_at_once():
    decider = Decider(world=2)
    decider.post(0, (3, 0), "plan", Status(), 0.0)
    decider.give_up(0, (3, 0))
    decider.settle(0.0)
    decider.post(0, (4, 0), "plan", Status(), 0.0)  # rank 0 went on to its next session
    decider.points.clear()  # (3, 0) forgotten, as after many points
    decider.post(1, (3, 0), "plan", Status(), 0.0)
    sent = dict(decider.settle(0.0))
    assert sent[1].outcome.key == (3, 0) and sent[1].outcome.elsewhere == (0,)


def test_a_server_stalled_between_a_decision_and_its_sending_does_not_split_the_verdict(
    group, monkeypatch
):
    """Rank 0's process starves right after deciding a completion, for longer than rank 1's
    timeout: rank 1 asks to abandon at its timeout but waits for the server's verdict, and
    reads the same completion rank 0 read, instead of failing while rank 0 goes on alone."""
    settle = Decider.settle
    stalled = []

    def slow_settle(self, now=0.0):
        sent = settle(self, now)
        if sent and not stalled:
            stalled.append(True)
            time.sleep(1.5)  # this process starved right after deciding
        return sent

    monkeypatch.setattr(Decider, "settle", slow_settle)
    outcomes, took = group.point("capture decode size 8", timeouts={0: 10.0, 1: 1.0})
    assert [o.complete for o in outcomes] == [True, True]
    assert 1.5 <= took < 2.0


def test_ranks_at_different_points_stop_naming_both(group):
    outcomes = {}

    def run(rank: int, label: str) -> None:
        outcomes[rank] = group.links[rank].agree(label, Status(), 5)

    threads = [
        threading.Thread(target=run, args=(0, "warm-up decode size 8 (target)")),
        threading.Thread(target=run, args=(1, "capture decode size 8 (target)")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    texts = {str(agreed_error(outcomes[r], 2, 5.0)) for r in (0, 1)}
    assert len(texts) == 1
    (text,) = texts
    assert "rank 0 at 'warm-up decode size 8 (target)'" in text
    assert "rank 1 at 'capture decode size 8 (target)'" in text


def test_when_the_server_thread_fails_every_rank_says_so_at_its_next_point(group, monkeypatch):
    def broken(self, now=0.0):
        raise RuntimeError("planted")

    monkeypatch.setattr(Decider, "settle", broken)
    outcomes, took = group.point("capture decode size 4")
    assert took < QUICK
    for outcome in outcomes:
        assert "the agreement server on tensor-parallel rank 0 failed" in outcome.channel_failure
        assert "planted" in outcome.channel_failure
    error = agreed_error(outcomes[1], 2, 5.0)
    assert "agreement of the tensor-parallel ranks failed" in str(error)
    assert "closed its connection" not in str(error)


def test_a_rank_the_server_dropped_is_told_why_and_counted_again_at_its_next_session(
    group, monkeypatch
):
    post_ = Decider.post
    refusals = []

    def refuse_rank_one_once(self, rank, *args, **kwargs):
        if rank == 1 and not refusals:
            refusals.append(rank)
            raise messages.BadMessage("planted refusal")
        return post_(self, rank, *args, **kwargs)

    monkeypatch.setattr(Decider, "post", refuse_rank_one_once)
    outcomes, took = group.point("plan")
    assert took < QUICK
    assert "no longer counts this rank (planted refusal)" in outcomes[1].channel_failure
    assert outcomes[0].outcome.dropped == {1: "planted refusal"}
    group.next_epoch()  # rank 1 says hello again: the group forms again
    healthy(group)


# --------------------------------------------------------------------------------- strangers


ATTACKS = {
    "one stray byte": b"x",
    "a bare header": struct.pack("!I", 10),
    "an HTTP health probe": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "a 4 GiB header": struct.pack("!I", 0xFFFFFFFF),
    "2 KiB of garbage": bytes(random.Random(7).randrange(256) for _ in range(2048)),
    "a ZMTP greeting, then nothing": b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f",
    "a silent socket": b"",
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_bytes_from_a_stranger_cost_only_its_connection(group, attack):
    stranger = socket.create_connection(("127.0.0.1", group.port()))
    stranger.sendall(ATTACKS[attack])
    healthy(group)
    # at once, or when its handshake is overdue
    assert closed_by_server(stranger, within=sockets.HANDSHAKE_SECONDS + QUICK)


@pytest.mark.parametrize(
    ("token", "username"),
    [("0" * 32, b"fd-cudagraph"), (None, b""), ("", b"someone")],
    ids=["a wrong token", "no authentication", "a wrong user"],
)
@pytest.mark.parametrize("address", [IPC, TCP], ids=["unix socket", "tcp"])
def test_a_zmq_peer_without_the_groups_token_never_becomes_a_peer(token, username, address):
    group = Group(address, world=2, joined=1)
    stranger = Peer(group, token=token, username=username)
    stranger.send({"type": "Hello", "rank": 1, "protocol": messages.PROTOCOL, "group": "g"})
    assert stranger.reply(within=0.5) is None  # refused in the handshake: never welcomed
    late = joining.join(lambda: group.store, "t", address, 1, 2, 5, "g")  # the real rank 1
    late.next_epoch(5)
    group.links.append(late)
    healthy(group)
    stranger.close()
    group.close()


def test_a_zmq_peer_with_the_token_that_floods_valid_frames_delays_no_honest_point(group):
    stranger = Peer(group)
    stop = threading.Event()

    def flood() -> None:
        body = encode(post([0, 0]))
        while not stop.is_set():
            try:
                stranger.sock.send(body, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        for i in range(5):
            healthy(group, f"under a flood {i}")
    finally:
        stop.set()
        thread.join(5)
        stranger.close()


def test_a_zmq_peer_that_never_reads_its_replies_costs_only_itself(group):
    stranger = Peer(group)
    stranger.sock.setsockopt(zmq.RCVHWM, 1)
    for _ in range(5000):  # each is answered (refused: no hello), none is read
        stranger.send(post([0, 0]))
    healthy(group)
    stranger.close()


@pytest.mark.parametrize("rank", [99, -1, "abc", None, 1.0, True])
def test_a_hello_claiming_a_rank_outside_the_group_is_refused(group, rank):
    stranger = Peer(group)
    stranger.send({"type": "Hello", "rank": rank, "protocol": messages.PROTOCOL, "group": "g"})
    reply = stranger.reply()
    assert reply is not None and reply["type"] == "Refused"
    healthy(group)
    stranger.close()
    healthy(group, "after it left")  # its leaving costs nothing either


def test_a_hello_of_another_protocol_is_refused_saying_both(group):
    stranger = Peer(group)
    stranger.send({"type": "Hello", "rank": 1, "protocol": 1})
    reply = stranger.reply()
    assert reply == {"type": "Refused", "why": f"protocol 1, server {messages.PROTOCOL}"}
    stranger.close()
    healthy(group)


def test_a_second_claim_of_a_connected_rank_is_refused_and_the_first_keeps_it(group):
    impostor = Peer(group)
    impostor.send({"type": "Hello", "rank": 1, "protocol": messages.PROTOCOL, "group": "g"})
    reply = impostor.reply()
    assert reply["type"] == "Refused" and reply["why"] == "rank 1 is held by another connection"
    impostor.close()
    healthy(group)  # rank 1 was neither re-pointed nor lost
    healthy(group, "again")


def test_many_idle_connections_neither_exhaust_the_server_nor_keep_a_rank_out():
    group = Group(world=2, joined=1)
    flood = [socket.create_connection(("127.0.0.1", group.port())) for _ in range(200)]
    late = joining.join(lambda: group.store, "t", TCP, 1, 2, 5, "g")  # joins through the flood
    late.next_epoch(5)
    group.links.append(late)
    healthy(group)
    for sock in flood:
        sock.close()
    group.close()


# ------------------------------------------------------------------ a rank that sends garbage


@pytest.mark.parametrize(
    "message",
    [
        {"type": "Post", "key": "x", "label": "p", "status": None},
        {"type": "Post", "key": [], "label": "p", "status": None},
        {"type": "Post", "key": [0, "a"], "label": "p", "status": None},
        {"type": "Post", "key": [0, 0], "status": None},
        {"type": "Post", "key": [0, 0], "label": "p"},
        {"type": "Post", "key": [0, 0], "label": "p", "status": None, "extra": 1},
        {"type": "Post", "key": [0, 2**40], "label": "p", "status": None},
        {"type": "Post", "key": [0, 0], "label": "x" * 300, "status": None},
        {"type": "GiveUp", "key": None},
        {"type": "Nonsense", "key": [0, 0]},
        ["a", "list"],
    ],
    ids=[
        "key x",
        "empty key",
        "key with text",
        "no label",
        "no status",
        "an extra field",
        "a key out of range",
        "a label too long",
        "give-up without key",
        "unknown type",
        "a list",
    ],
)
def test_a_rank_that_sends_a_malformed_message_is_dropped_and_named(message):
    group, rogue = rogue_third_rank()
    rogue.send(message)
    outcomes, took = group.point("plan")
    assert took < QUICK and group.server.is_alive() and group.server.failure is None
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and 2 in outcome.outcome.dropped
    text = str(agreed_error(outcomes[0], 3, 5.0))
    assert "dropped tensor-parallel rank 2 for what it sent" in text
    assert rogue.reply()["type"] == "Refused"  # and it is told so
    group.close()


def test_a_label_that_is_not_utf8_drops_only_its_rank():
    """MessagePack text must be UTF-8: a lone surrogate (once fatal to 0.4.0's server) cannot
    even be encoded as one; raw invalid bytes are refused by the decoder."""
    group, rogue = rogue_third_rank()
    body = encode(post([0, 0], label="LABEL"))
    rogue.send(body.replace(b"\xa5LABEL", b"\xa5\xed\xa0\x80LA"))
    outcomes, took = group.point("plan")
    assert took < QUICK and all(2 in o.outcome.dropped for o in outcomes)
    assert "a malformed message" in outcomes[0].outcome.dropped[2]
    group.close()


_MEMORY = {
    "type": "RankMemory",
    "rank": 2,
    "graph_bytes": 1,
    "taken_bytes": 1,
    "free": 1,
    "total": 2,
    "utilization": 0.9,
}


def test_the_memory_payload_a_forged_status_bends_is_otherwise_valid():
    assert msgspec.convert(_MEMORY, messages.RankMemory).graph_bytes == 1


@pytest.mark.parametrize(
    "status",
    [
        {"failure": {"rank": 2}},
        {"payload": None, "failure": "out of memory"},
        {"payload": 1, "failure": None},
        {"payload": None, "failure": {"rank": "x", "stage": 1, "where": None}},
        {"payload": float("nan"), "failure": None},
        {"payload": {**_MEMORY, "graph_bytes": 2**62}, "failure": None},
        {"payload": [[[]]], "failure": None},
        [],
    ],
    ids=[
        "partial failure",
        "failure text",
        "an integer payload",
        "wrong types",
        "NaN",
        "a figure out of range",
        "nested lists",
        "list",
    ],
)
def test_a_forged_status_becomes_the_same_clear_error_on_every_rank(status):
    group, rogue = rogue_third_rank()
    rogue.send(post([0, 0], status=status))
    outcomes, took = group.point("plan")
    assert took < QUICK
    texts = {str(agreed_error(o, 3, 5.0)) for o in outcomes}
    assert len(texts) == 1
    assert "rank 2 posted a status at 'plan' that the channel does not accept" in texts.pop()
    rogue.close()
    group.close()


def test_a_rank_cannot_post_another_ranks_failure():
    group, rogue = rogue_third_rank()
    failure = Failure(
        rank=1,
        stage="capture",
        where="",
        mode="",
        error="RuntimeError: forged",
        out_of_memory=False,
        explained=False,
        advice="",
    )
    rogue.send(post([0, 0], status=msgspec.to_builtins(Status(failure=failure))))
    outcomes, _ = group.point("plan")
    text = str(agreed_error(outcomes[0], 3, 5.0))
    assert "failure.rank is 1, not 2" in text and "forged" not in text
    group.close()


def test_a_rank_announcing_a_message_above_the_cap_is_cut_off_by_zeromq_and_named():
    """libzmq drops the connection at the announced size (MAXMSGSIZE), before the server reads
    a byte of it: the rank is lost, not dropped for a message the server read."""
    group, rogue = rogue_third_rank()
    rogue.send(b"x" * (64 << 20))
    outcomes, took = group.point("plan")
    assert took < QUICK
    assert all(o.outcome.lost == (2,) and not o.outcome.dropped for o in outcomes)
    group.close()


_MANY_PARTS = """
import sys, time, zmq, msgspec
context = zmq.Context()
rank = context.socket(zmq.DEALER)
rank.setsockopt(zmq.PLAIN_USERNAME, b"fd-cudagraph")
rank.setsockopt(zmq.PLAIN_PASSWORD, {token!r}.encode())
rank.connect({endpoint!r})
hello = {{"type": "Hello", "rank": 2, "protocol": {protocol}, "group": "g"}}
rank.send(msgspec.msgpack.encode(hello))
rank.recv()
rank.send_multipart([b""] * 4_000_000)
print("sent", flush=True)
time.sleep(60)
"""


def test_a_message_of_millions_of_parts_is_never_held_and_costs_only_its_rank():
    """libzmq bounds each part's bytes, never their number: 4 million empty parts (8 MB) from a
    welcomed rank once grew rank 0 by 580 MiB (the parts in libzmq, and again as a list of
    frames) and stalled a point 11.5 s. The server reads a message part by part and keeps at
    most two; libzmq itself still queues the parts it received (64 bytes each, 244 MiB here)."""
    group = Group(world=3, joined=2)
    script = _MANY_PARTS.format(
        token=group.token, endpoint=group.endpoint, protocol=messages.PROTOCOL
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rogue = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert rogue.stdout.readline().strip() == "sent"
        outcomes, took = group.point("plan", timeouts={0: 60, 1: 60})
    finally:
        rogue.kill()
        rogue.wait()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert all(2 in o.outcome.dropped for o in outcomes)
    assert "a message of 4000000 parts" in outcomes[0].outcome.dropped[2]
    assert grown < 350, f"rank 0's process grew {grown:.0f} MiB"
    group.next_epoch()  # and the server answers at once, naming the rank it dropped
    again, took = group.point("next", timeouts={0: 60, 1: 60})
    assert took < QUICK and all(o.outcome.lost == (2,) for o in again)
    group.close()


def test_seeded_random_messages_from_strangers_and_a_rank_cost_only_their_senders():
    rng = random.Random(20261204)
    group = Group(world=2)
    values = [None, True, 0, -1, 2**40, 1.5, "", "x" * 300, [], {}, [0, 0], [0, "a"], {"a": 1}]
    for _ in range(200):
        peer = Peer(group)
        kind = rng.random()
        if kind < 0.3:
            peer.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        else:
            message = {
                k: rng.choice(values)
                for k in rng.sample(["type", "key", "label", "status", "rank"], 3)
            }
            message["type"] = rng.choice(["Hello", "Post", "GiveUp", "x", None])
            if kind < 0.6:
                message.update(
                    type="Hello",
                    protocol=messages.PROTOCOL,
                    rank=rng.choice([0, 1, 2, 9]),
                    group="g",
                )
            peer.send(message)
        peer.close()
    healthy(group)
    group.close()


def test_text_is_sent_on_at_the_size_it_came_in():
    group = Group(world=2)
    text = "\U0001f600" * 400
    outcomes, took = group.point("plan", statuses={1: Status(payload=text)})
    assert took < QUICK and all(o.complete and o.shared() == ["rank 0", text] for o in outcomes)
    group.close()


def test_a_rank_that_opens_points_ahead_of_its_group_is_dropped():
    # Posting at a new key over and over without giving up held every point: 20k points and
    # 360 MB of rank 0's memory from one connection in 0.5.0's first version.
    group, rogue = rogue_third_rank()
    for point in range(1, 10):
        rogue.send(post([0, point], label="x"))
    time.sleep(0.3)
    assert len(group.server.decider.points) <= 2
    outcomes, took = group.point("plan")
    assert took < QUICK and all(2 in o.outcome.dropped for o in outcomes)
    group.close()


def test_a_point_a_rank_gave_up_ahead_of_time_names_it_not_the_ranks_that_came():
    group, rogue = rogue_third_rank()
    rogue.send(post([0, 0]))
    rogue.send({"type": "GiveUp", "key": [0, 0]})
    time.sleep(0.2)
    outcomes, _ = group.point("plan")
    text = str(agreed_error(outcomes[0], 3, 300.0))
    assert "when rank 2 stopped waiting for them" in text
    assert "within 300 s" not in text
    group.close()


def test_a_rank_that_reads_none_of_its_replies_costs_only_itself():
    """Its outcomes wait for it, as a stopped rank's would: honest points go on."""
    group, rogue = rogue_third_rank()
    rogue.sock.setsockopt(zmq.RCVHWM, 1)
    for point in range(200):
        rogue.send(post([0, point], label="p"))
        outcomes, took = group.point("p", timeouts={0: 30, 1: 30})
        assert took < QUICK and all(o.complete for o in outcomes)
    assert group.server.is_alive()
    group.close()


# ------------------------------------------------------------------------------ the post cap


@pytest.mark.parametrize(
    ("graph_args", "most"),
    [
        ({"cudagraph_capture_sizes": [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)][:36]}, 2),
        (
            {  # FastDeploy's limits: 512 sizes in both phases (static split)
                "cudagraph_capture_sizes": list(range(1, 513)),
                "cudagraph_capture_sizes_prefill": list(range(1, 513)),
                "graph_opt_level": 1,
                "full_cuda_graph": False,
            },
            10,
        ),
    ],
    ids=["36 sizes", "512 sizes in both phases"],
)
def test_the_largest_real_post_fits_the_cap(sim, graph_args, most):
    """The plan point of a worker with a target and an MTP draft, every size unwarmed, as the
    session posts it (8 ranks)."""
    from conftest import PeerLink, TinyBackbone, make_config

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend
    from fd_cudagraph_plugin.core.ranks.link import _post
    from fd_cudagraph_plugin.core.session import CaptureSession

    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    config = make_config(512, speculative=mtp, **graph_args)
    models = [TinyBackbone(), TinyBackbone()]  # the target and the draft
    backends = [CudaGraphBackend(config, m.forward, m.forward) for m in models]
    link = PeerLink(rank=7, world=8)
    with CaptureSession("decode", link=link):
        pass
    label, status = link.posted[0]
    assert label == "plan" and status["payload"]["plan"]["backends"] == len(backends)
    body = _post((0, 0), "plan", msgspec.convert(status, Status), 7)
    assert len(body) < (most << 10) <= MAX_POST_BYTES, len(body)
    assert msgspec.msgpack.decode(body)["status"]["failure"] is None
    assert 8 * len(body) < messages.max_message_bytes(8)  # an outcome of 8 ranks of it


def test_a_status_too_large_for_the_channel_becomes_this_ranks_failure(group):
    huge = Status(payload="x" * (MAX_POST_BYTES + 1))
    outcomes, took = group.point("plan", statuses={1: huge})
    assert took < QUICK
    text = str(agreed_error(outcomes[0], 2, 5.0))
    assert "rank 1 posted a status at 'plan' that the channel does not accept" in text
    assert f"over the channel's {MAX_POST_BYTES}" in text


# -------------------------------------------------------------------------- where it listens


@pytest.mark.parametrize(
    ("endpoints", "group_ranks", "host"),
    [
        ("10.0.0.5:6170,10.0.0.5:6171", [0, 1], None),  # all on this host
        ("10.0.0.5:6170,10.0.0.6:6171", [0, 1], "10.0.0.5"),  # the group spans hosts
        ("10.0.0.5:6170,10.0.0.5:6171,10.0.0.6:6172,10.0.0.6:6173", [0, 1], None),
        ("", [0, 1], "10.0.0.5"),  # unknown: reachable from other hosts
    ],
)
def test_a_group_on_one_host_agrees_over_a_unix_socket_else_over_tcp_on_the_node_address(
    monkeypatch, endpoints, group_ranks, host
):
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "10.0.0.5:6170")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", endpoints)
    assert joining.address_for(group_ranks, "auto", None) == Address(host)


def test_without_paddles_launcher_the_ranks_are_taken_to_share_a_host(monkeypatch):
    monkeypatch.delenv("PADDLE_CURRENT_ENDPOINT", raising=False)
    assert joining.address_for([0, 1], "auto", None) == Address()


@pytest.mark.parametrize(
    ("interface", "ports", "address"),
    [
        ("10.0.0.7", None, Address("10.0.0.7")),
        ("eth0", None, Address("eth0")),
        ("auto", (29500, 29509), Address("127.0.0.1", (29500, 29509))),
    ],
)
def test_the_operator_can_choose_the_interface_and_ports(monkeypatch, interface, ports, address):
    monkeypatch.delenv("PADDLE_CURRENT_ENDPOINT", raising=False)
    assert joining.address_for([0, 1], interface, ports) == address


def test_a_port_range_is_used_in_order_and_a_full_one_is_refused_naming_the_option():
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    store = DictStore()
    address = Address("127.0.0.1", (port, port + 1))
    first = joining.join(lambda: store, "a", address, 0, 2, 5)
    assert first.server.endpoint == f"tcp://127.0.0.1:{port + 1}"
    with pytest.raises(JoinError, match=f"FD_CUDAGRAPH_AGREEMENT_PORTS={port}-{port + 1}"):
        joining.join(lambda: store, "b", address, 0, 2, 5)
    first.close()
    taken.close()


def test_every_server_gets_a_fresh_private_socket_directory_nobody_could_make_first(
    tmp_path, monkeypatch
):
    """0.5.0 used /tmp/fd-cudagraph-<uid>, which another local user could make first (every
    TP start of the service user then failed), and a path derived from the job, which an older
    group still alive held."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    squatted = tmp_path / f"fd-cudagraph-{os.geteuid()}"
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)
    one, two = Group(IPC), Group(IPC)
    paths = [g.endpoint[len("ipc://") :] for g in (one, two)]
    assert paths[0] != paths[1]
    for path in paths:
        directory = Path(path).parent
        assert directory.parent == tmp_path and directory != squatted
        assert os.stat(directory).st_mode & 0o777 == 0o700
    healthy(one)
    healthy(two)
    one.close()
    two.close()
    assert not any(Path(p).parent.exists() for p in paths)  # removed with their servers


def test_a_base_directory_too_long_for_a_socket_path_is_passed_over(tmp_path, monkeypatch):
    """A Unix socket's path is at most 107 bytes: a long XDG_RUNTIME_DIR made every TP start
    fail in 0.5.0."""
    long = tmp_path / ("d" * 90)
    long.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(long))
    group = Group(IPC)
    assert len(group.endpoint) - len("ipc://") <= joining.MAX_SOCKET_PATH
    assert not group.endpoint.startswith(f"ipc://{long}")
    healthy(group)
    group.close()


def test_a_store_entry_naming_a_socket_outside_a_private_directory_is_refused(tmp_path):
    """Whoever can write Paddle's job store (it answers anyone) cannot point a rank at a
    socket of theirs: a rank connects only to one in a directory that is this user's alone."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    store = DictStore()
    planted = joining.Published(endpoint=f"ipc://{open_dir}/s", token="0" * 32)
    store.set("t/server", msgspec.json.encode(planted).decode())
    store.add("t/ready", 1)
    with pytest.raises(JoinError, match="not a directory private to this user"):
        joining.join(lambda: store, "t", IPC, 1, 2, 2)


@pytest.mark.parametrize("alive", [True, False], ids=["alive", "gone"])
def test_a_stale_entry_of_an_older_group_never_takes_a_new_groups_rank(alive):
    """An older launch's server of the same name in the store, still alive (rank 1 never came
    to it) or gone: the new rank 1 meets its entry first, is refused by it (another launch) or
    finds it gone, reads the store again, and joins the new server once rank 0 published."""
    old = Group(IPC, world=2, joined=1, group="old launch")
    if not alive:
        old.close()
    store = DictStore()
    store.data = dict(old.store.data)  # the entry is still there when the new launch starts
    made = {}

    def rank_one() -> None:
        made[1] = joining.join(lambda: store, "t", IPC, 1, 2, 10, "new launch")

    thread = threading.Thread(target=rank_one)
    thread.start()
    time.sleep(1.0)  # rank 1 meets the old entry first
    made[0] = joining.join(lambda: store, "t", IPC, 0, 2, 10, "new launch")
    thread.join(15)
    assert made[1].endpoint != old.endpoint
    new = Group.__new__(Group)
    new.links, new.server, new.world = [made[0], made[1]], made[0].server, 2
    new.next_epoch()
    healthy(new)
    assert 1 not in old.server.decider.present  # the old server never counted the new rank
    new.close()
    if alive:
        old.close()


def test_joining_a_group_whose_rank_zero_never_starts_times_out_saying_how_long():
    started = time.monotonic()
    with pytest.raises(JoinError, match=r"rank 0 did not start .* within 0.5 s .*waited 0.5"):
        joining.join(DictStore, "t", IPC, 1, 2, 0.5)
    assert time.monotonic() - started < 0.5 + 1.0


def test_a_job_store_that_does_not_answer_bounds_the_join_and_says_how_long():
    """Global rank 0 hosts Paddle's store; frozen, every store call blocks: the join ends."""

    class FrozenStore(DictStore):
        def add(self, key: str, amount: int) -> int:
            time.sleep(30)
            return 0

    started = time.monotonic()
    with pytest.raises(JoinError, match=r"job store .* did not answer .* after 0\.[5-9]\d* s"):
        joining.join(FrozenStore, "t", TCP, 1, 2, 0.5)
    assert time.monotonic() - started < 0.5 + 1.0  # bounded by the timeout, not the store's 30 s


def test_a_job_store_error_is_the_plugins_error_naming_the_store():
    class BrokenStore(DictStore):
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("store connection reset")

    with pytest.raises(JoinError, match=r"job store .* failed .* store connection reset"):
        joining.join(BrokenStore, "t", TCP, 1, 2, 1.0)


# ------------------------------------------------------------------------------ descriptors


_DESCRIPTORS = """
import os, sys, threading
sys.path.insert(0, {root!r})
os.close(2)
from fd_cudagraph_plugin.core.ranks import sockets
from fd_cudagraph_plugin.core.ranks.server import Server
from fd_cudagraph_plugin.core.ranks.link import ZmqLink
from fd_cudagraph_plugin.core.ranks.messages import Status
import time
# Contexts made from several threads at once: none may open its eventfd on fd 2.
made = []
threads = [threading.Thread(target=lambda: made.append(sockets.Context())) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
server = Server(2, "tcp://127.0.0.1"); server.start()
links = [ZmqLink(0, 2, "", server.token, server), ZmqLink(1, 2, server.endpoint, server.token)]
for link in links:
    link.hello(time.monotonic() + 5); link.next_epoch(5)
target = os.readlink("/proc/self/fd/2")
results = {{}}
def point(link):
    results[link.rank] = link.agree("p", Status(payload="x"), 5)
threads = [threading.Thread(target=point, args=(lk,)) for lk in links]
[t.start() for t in threads]; [t.join() for t in threads]
print(target, all(r.complete for r in results.values()), flush=True)
os._exit(0)
"""


def test_no_socket_of_the_channel_takes_a_closed_standard_descriptor():
    """With fd 2 closed under a live logger, a socket that took it would receive every line
    written to stderr (FastDeploy's console log once went into the channel this way). Contexts
    made from several threads at once used to race the guard (2 of 12 runs)."""
    script = _DESCRIPTORS.format(root=str(ROOT))
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.split() == ["/dev/null", "True"], done.stdout + done.stderr


def test_a_link_nobody_closed_never_blocks_the_garbage_collector():
    """pyzmq terminates a collected context, which blocks for ever while its sockets live; the
    sockets' weak references are already gone when the collector finalizes a cycle."""
    import gc

    group = Group(IPC)
    group.self = group  # a cycle: only the collector frees it
    group.server.stop()
    del group
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(10)
    assert not collector.is_alive(), "the garbage collector is stuck in zmq_ctx_term"


def test_the_server_module_reads_no_deprecated_libzmq_field():
    """Liveness from what libzmq gives on stable APIs: disconnect events and sends to a routing
    id without a connection; no ``ZMQ_SRCFD`` (deprecated) to map a connection to a rank."""
    for module in (server, sockets):
        assert "SRCFD" not in Path(module.__file__).read_text()


def test_a_rank_zero_that_cannot_listen_says_why_on_every_rank_at_once():
    """An address no interface of rank 0's host has (across hosts, only rank 0 can tell): rank
    0 publishes why, and the others stop at once saying it, instead of after their timeout and
    blaming FD_PLUGINS."""
    store, raised = DictStore(), {}

    def connect(rank: int) -> None:
        started = time.monotonic()
        try:
            joining.join(lambda: store, "t", Address("10.250.250.250"), rank, 2, 30, "g")
        except JoinError as error:
            raised[rank] = (error, time.monotonic() - started)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (1, 0)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # rank 1 waits for rank 0 first
    for thread in threads:
        thread.join(40)
    for rank in (0, 1):
        error, took = raised[rank]
        assert isinstance(error, joining.ServerNotStarted) and took < QUICK
        assert "cannot listen on tcp://10.250.250.250" in str(error)
        assert "FD_CUDAGRAPH_AGREEMENT_INTERFACE" in str(error)
