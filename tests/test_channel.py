"""The agreement channel on ZeroMQ, honest and attacked: TP rank 0's server decides each point
once, every rank gets the same outcome, and nothing a stranger or a broken rank sends can stall,
fool or kill it (docs/design.md, "The agreement channel").

Ranks are threads here, each with its own DEALER to a real server, over a Unix socket (one host)
or TCP with the job's token (the job store is a dict); ``test_collective.py`` runs the same code
over real ranks and Paddle's store. Every attack is followed by a point of the honest ranks,
which must complete with every status in under 2 s.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from fd_cudagraph_plugin.core import channel, messages
from fd_cudagraph_plugin.core.agreement import agreed_error
from fd_cudagraph_plugin.core.channel import Address, Decider, JoinError, LocalLink, ZmqLink
from fd_cudagraph_plugin.core.messages import MAX_POST_BYTES, Failure, Outcome, Status

QUICK = 2.0  # what an honest point may take after any attack
ROOT = Path(__file__).resolve().parent.parent


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


def ipc_address(tmp_path: Path) -> Address:
    return Address(f"ipc://{tmp_path}/agreement.sock")


TCP = Address("tcp://127.0.0.1")


class Group:
    """``world`` ranks joined to one real server; the joined ones take part in points."""

    def __init__(
        self,
        address: Address = TCP,
        world: int = 2,
        joined: int | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.store, made, self.address = DictStore(), {}, address

        def connect(rank: int) -> None:
            made[rank] = channel.join(lambda: self.store, "t", address, rank, world, timeout)

        threads = [threading.Thread(target=connect, args=(r,)) for r in range(joined or world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        self.links = [made[r] for r in sorted(made)]
        self.server = self.links[0].server
        self.world = world
        for link in self.links:
            link.next_epoch()

    @property
    def token(self) -> str:
        return json.loads(self.store.get("t/server"))["token"]

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
            status = (statuses or {}).get(rank, Status(payload=rank))
            timeout = (timeouts or {}).get(rank, 5.0)
            outcomes[rank] = link.agree(label, status, timeout)
            took[rank] = time.monotonic() - started

        threads = [threading.Thread(target=run, args=(lk.rank, lk)) for lk in self.links]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return [outcomes[r] for r in sorted(outcomes)], max(took.values())

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
        assert outcome.shared() == list(range(group.world))
    assert group.server.is_alive() and group.server.failure is None


class Peer:
    """A raw ZeroMQ DEALER: a peer that speaks ZMTP and sends whatever a test wants."""

    def __init__(self, group: Group, token: str | None = "", username: bytes = b"fd-cudagraph"):
        self.context = channel.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            self.sock.setsockopt(zmq.PLAIN_USERNAME, username)
            self.sock.setsockopt(zmq.PLAIN_PASSWORD, (token or group.token).encode())
        self.sock.connect(group.endpoint)

    def send(self, message) -> None:
        self.sock.send(message if isinstance(message, bytes) else json.dumps(message).encode())

    def reply(self, within: float = QUICK) -> dict | None:
        if not self.sock.poll(int(within * 1000)):
            return None
        return json.loads(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def rogue_third_rank() -> tuple[Group, Peer]:
    """A group of 3 where ranks 0 and 1 are honest and rank 2, welcomed, is a raw peer."""
    group = Group(world=3, joined=2)
    rogue = Peer(group)
    rogue.send({"op": "hello", "rank": 2, "protocol": messages.PROTOCOL})
    assert rogue.reply() == {"op": "welcome"}
    return group, rogue


def post(key, label="plan", status=None, timeout=5) -> dict:
    status = {"payload": None, "failure": None} if status is None else status
    return {"op": "post", "key": key, "label": label, "timeout": timeout, "status": status}


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


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_every_rank_gets_every_ranks_status_at_each_point(tmp_path, transport):
    group = Group(ipc_address(tmp_path) if transport == "ipc" else TCP, world=3)
    for i in range(20):
        outcomes, _ = group.point(f"p{i}", statuses={r: Status(payload=[r, i]) for r in range(3)})
        assert all(o.complete and o.shared() == [[r, i] for r in range(3)] for o in outcomes)
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


def test_ranks_that_waited_for_one_that_never_came_name_it_within_the_timeout():
    group = Group(world=3, joined=3)
    late = group.links.pop(1)  # joined, never posts
    outcomes, took = group.point("plan", timeouts={0: 1.0, 2: 1.0})
    for outcome in outcomes:
        assert outcome.outcome.missing == (1,) and outcome.outcome.lost == ()
        assert outcome.outcome.gave_up
    assert 1.0 - channel.give_up_margin(1.0) <= took <= 1.0 + 0.1  # the whole wait, bounded
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


def test_a_rank_whose_link_closes_is_named_at_once():
    group = Group(world=3)
    gone = group.links.pop(2)
    threading.Timer(0.2, gone.close).start()
    outcomes, took = group.point("warm-up decode size 8", timeouts={0: 30, 1: 30})
    assert all(o.outcome.missing == (2,) and o.outcome.lost == (2,) for o in outcomes)
    assert took < 1.0
    group.close()


_RANK_PROCESS = """
import sys, time
sys.path.insert(0, {root!r})
from fd_cudagraph_plugin.core import channel
from fd_cudagraph_plugin.core.messages import Status
link = channel.join(None, "t", channel.Address({endpoint!r}), {rank}, {world}, 10)
link.next_epoch()
{then}
print("ready", flush=True)
time.sleep(60)
"""


def rank_process(endpoint: str, rank: int, world: int, then: str = "") -> subprocess.Popen:
    """A rank in a process of its own, joined and waiting; ``then`` runs after the join."""
    script = _RANK_PROCESS.format(
        root=str(ROOT), endpoint=endpoint, rank=rank, world=world, then=then
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_a_rank_whose_process_is_killed_while_the_others_wait_is_named_within_a_second(tmp_path):
    group = Group(ipc_address(tmp_path), world=3, joined=2)
    rank = rank_process(group.endpoint, 2, 3)
    assert rank.stdout.readline().strip() == "ready"
    threading.Timer(0.3, rank.kill).start()
    outcomes, took = group.point("plan", timeouts={0: 30, 1: 30})
    assert took < 0.3 + 1.0
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and outcome.outcome.lost == (2,)
    assert "closed its connection or stopped answering" in str(agreed_error(outcomes[0], 3, 30))
    rank.wait()
    group.close()


def test_a_rank_killed_right_after_posting_is_never_counted_as_arrived(tmp_path):
    """The others arrive at a point the dead rank posted at: completing it would send them into
    a collective it will never join."""
    group = Group(ipc_address(tmp_path), world=3, joined=2)
    then = 'link._sock.send(channel._post((0, 0), "plan", Status(), 2, 30))'
    rank = rank_process(group.endpoint, 2, 3, then)
    assert rank.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # its post has reached the server
    rank.kill()
    rank.wait()
    outcomes, took = group.point("plan", timeouts={0: 30, 1: 30})
    assert took < 1.0
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and outcome.outcome.lost == (2,)
        assert 2 not in outcome.outcome.statuses
    group.close()


def _group_hosted_elsewhere(tmp_path) -> tuple[subprocess.Popen, list[ZmqLink]]:
    """Rank 0 (and its server) in a process of its own; ranks 1 and 2 here."""
    address = ipc_address(tmp_path)
    rank0 = rank_process(address.endpoint, 0, 3)
    links = {}

    def connect(rank: int) -> None:
        links[rank] = channel.join(None, "t", address, rank, 3, 10)
        links[rank].next_epoch()

    threads = [threading.Thread(target=connect, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert rank0.stdout.readline().strip() == "ready"
    return rank0, [links[1], links[2]]


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


def test_when_rank_zeros_process_is_killed_the_others_name_rank_zero_within_a_second(tmp_path):
    rank0, links = _group_hosted_elsewhere(tmp_path)
    threading.Timer(0.3, rank0.kill).start()
    outcomes, took = _wait_at_a_point(links, 30)
    assert took < 0.3 + 1.0
    for agreed in outcomes:
        assert agreed.outcome.missing == (0,) and agreed.outcome.lost == (0,)
        assert "rank 0 closed its connection" in str(agreed_error(agreed, 3, 30))
    rank0.wait()
    for link in links:
        link.close()


def test_when_rank_zero_freezes_the_others_say_its_server_did_not_answer_within_the_timeout(
    tmp_path,
):
    rank0, links = _group_hosted_elsewhere(tmp_path)
    rank0.send_signal(signal.SIGSTOP)
    try:
        outcomes, took = _wait_at_a_point(links, 2.0)
    finally:
        rank0.kill()
        rank0.wait()
    assert 2.0 <= took < 2.0 + 0.3
    for agreed in outcomes:
        assert "on tensor-parallel rank 0 did not answer within 2 s" in agreed.channel_failure
    for link in links:
        link.close()


def test_a_rank_lost_after_it_posted_makes_the_point_abandoned():
    decider = Decider(world=3)
    decider.post(2, (0, 0), "plan", Status())
    assert decider.settle() == []
    decider.lose(2)
    decider.post(0, (0, 0), "plan", Status())
    decider.post(1, (0, 0), "plan", Status())
    outcomes = dict(decider.settle())
    assert outcomes[0] is outcomes[1]
    assert outcomes[0].missing == (2,) and outcomes[0].lost == (2,)


def test_when_rank_zeros_process_exits_the_others_name_rank_zero(group):
    group.server.stop()  # every socket of rank 0's process closes
    agreed = group.links[1].agree("end", Status(), 5)
    assert agreed.outcome.missing == (0,) and agreed.outcome.lost == (0,)


def test_a_single_rank_agrees_with_itself():
    agreed = LocalLink().agree("plan", Status(payload=7), 1)
    assert agreed.complete and agreed.shared() == [7]


def test_joining_a_group_whose_rank_zero_never_starts_times_out_saying_how_long(tmp_path):
    started = time.monotonic()
    with pytest.raises(JoinError, match=r"rank 0 did not start .* within 0.3 s .*waited 0.3"):
        channel.join(None, "t", ipc_address(tmp_path), 1, 2, 0.3)
    assert time.monotonic() - started < 0.3 + 0.2


def test_a_job_store_that_does_not_answer_bounds_the_join_and_says_how_long():
    """Rank 0 hosts Paddle's store; frozen, every store call blocks: the join still ends."""

    class FrozenStore(DictStore):
        def add(self, key: str, amount: int) -> int:
            time.sleep(30)
            return 0

    started = time.monotonic()
    with pytest.raises(JoinError, match=r"job store .* did not answer .* after 0.5"):
        channel.join(FrozenStore, "t", TCP, 1, 2, 0.5)
    assert time.monotonic() - started < 0.5 + 0.2


def test_a_job_store_error_is_the_plugins_error_naming_the_store():
    class BrokenStore(DictStore):
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("store connection reset")

    with pytest.raises(JoinError, match=r"job store .* failed .* store connection reset"):
        channel.join(BrokenStore, "t", TCP, 1, 2, 1.0)


def test_on_one_host_the_job_store_is_never_read_so_a_planted_address_is_ignored(tmp_path):
    """Whoever can write Paddle's job store (it answers anyone) cannot redirect a Unix-socket
    group: its address is derived, not read."""

    class PlantedStore(DictStore):
        def get(self, key: str) -> bytes:
            raise AssertionError("the store was read")

    address = ipc_address(tmp_path)
    made = {}

    def connect(rank: int) -> None:
        made[rank] = channel.join(PlantedStore, "t", address, rank, 2, 5)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(made) == [0, 1]
    for link in made.values():
        link.close()


def test_a_rank_the_server_drops_is_told_why(group, monkeypatch):
    post_ = Decider.post

    def refuse_rank_one(self, rank, *args, **kwargs):
        if rank == 1:
            raise messages.BadMessage("planted refusal")
        return post_(self, rank, *args, **kwargs)

    monkeypatch.setattr(Decider, "post", refuse_rank_one)
    outcomes, took = group.point("plan")
    assert took < QUICK
    assert "the agreement server dropped tensor-parallel rank 1: planted refusal" in (
        outcomes[1].channel_failure
    )
    assert outcomes[0].outcome.dropped == {1: "planted refusal"}


# ----------------------------------------------------------------------- one verdict per point


def test_a_give_up_after_the_point_completed_gets_the_completed_outcome():
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", Status())
    decider.post(1, (0, 0), "plan", Status())
    sent = decider.settle()
    decider.give_up(0, (0, 0))  # raced with the completion: nothing more is sent
    assert [(rank, outcome.missing) for rank, outcome in sent] == [(0, ()), (1, ())]
    assert decider.settle() == []


def test_a_give_up_before_completion_abandons_the_point_for_everyone():
    decider = Decider(world=3)
    decider.post(0, (0, 0), "plan", Status())
    decider.post(1, (0, 0), "plan", Status())
    decider.settle()
    decider.give_up(0, (0, 0))
    assert {rank: o.missing for rank, o in decider.settle()} == {0: (2,), 1: (2,)}
    decider.post(2, (0, 0), "plan", Status())  # the late rank learns it too
    assert [(rank, o.missing) for rank, o in decider.settle()] == [(2, (2,))]


def test_a_give_up_that_arrives_with_the_last_post_wins():
    # A server that was stalled reads a rank's post, its give-up and the last rank's post in one
    # batch. The rank that gave up may already have stopped waiting: completing the point would
    # let the last rank go on alone.
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", Status())
    decider.give_up(0, (0, 0))
    decider.post(1, (0, 0), "plan", Status())
    outcomes = dict(decider.settle())
    assert outcomes[0] is outcomes[1] and outcomes[1].gave_up == (0,)


def test_a_stall_that_ends_between_two_ranks_deadlines_does_not_split_the_verdict(group):
    """Rank 0 (timeout 1 s) stops waiting while the server is stalled; the server wakes after
    rank 1's post arrived. Rank 1 (timeout 5 s) must not be told the point completed."""
    turn = group.server._turn
    stalled = threading.Event()

    def stalling_turn(ready) -> None:
        if ready and not stalled.is_set():
            stalled.set()
            time.sleep(1.5)
        turn(ready)

    group.server._turn = stalling_turn
    wake_the_loop(group)  # its current turn, taken before the patch, ends now
    outcomes, _ = group.point("capture decode size 8", timeouts={0: 1.0, 1: 5.0})
    assert not outcomes[0].complete and not outcomes[1].complete
    error = agreed_error(outcomes[1], 2, 5.0)
    assert error is not None and "stopped waiting" in str(error)


def wake_the_loop(group: Group) -> None:
    """End the server loop's current wait, so that its next turn is a patched one."""
    group.server._wake.send(b"")
    time.sleep(0.1)


def _fake_server(endpoint: str, answer) -> threading.Thread:
    """A ROUTER that welcomes, then answers each post with ``answer(post)`` (raw messages)."""

    def serve() -> None:
        context = channel.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 2000)  # its last replies are sent before it closes
        router.bind(endpoint)
        replies = 0
        while replies < 2 and router.poll(5000):
            identity, body = router.recv_multipart()
            message = json.loads(body)
            if message["op"] == "hello":
                router.send_multipart([identity, b'{"op":"welcome"}'])
            elif message["op"] == "post":
                for reply in answer(message):
                    router.send_multipart([identity, json.dumps(reply).encode()])
                replies += 1
        router.close()
        context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _outcome(key, payload) -> dict:
    status = {"payload": payload, "failure": None}
    return Outcome(
        key=tuple(key), statuses={0: Status.check(status), 1: Status.check(status)}
    ).to_json()


def test_a_late_reply_is_never_taken_for_the_next_point(tmp_path):
    """A fake server that answers each post first with the outcome of the point before it."""
    address = ipc_address(tmp_path)

    def answer(message):
        epoch, point = message["key"]
        late = [_outcome([epoch, point - 1], "late")] if point else []
        return [*late, _outcome([epoch, point], point)]

    _fake_server(address.endpoint, answer)
    link = channel.join(None, "f", address, 1, 2, 5)
    link.next_epoch()
    assert link.agree("p", Status(), 5).shared() == [0, 0]
    assert link.agree("p", Status(), 5).shared() == [1, 1]
    link.close()


def test_an_outcome_naming_ranks_outside_the_group_breaks_the_link(tmp_path):
    address = ipc_address(tmp_path)

    def answer(message):
        status = Status.check({"payload": 1, "failure": None})
        return [Outcome(key=tuple(message["key"]), statuses={0: status, 5: status}).to_json()]

    _fake_server(address.endpoint, answer)
    link = channel.join(None, "f", address, 1, 2, 5)
    link.next_epoch()
    assert "outcome of other ranks" in link.agree("p", Status(), 5).channel_failure
    link.close()


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
    monkeypatch.undo()
    again, took = group.point("end")  # and at once at every later point
    assert took < 0.5 and all(o.channel_failure for o in again)
    error = agreed_error(again[1], 2, 5.0)
    assert "agreement of the tensor-parallel ranks failed" in str(error)
    assert "closed its connection" not in str(error)


def test_a_stall_between_the_decision_and_the_send_does_not_split_the_verdict(group, monkeypatch):
    settle = Decider.settle
    stalled = []

    def slow_settle(self, now=0.0):
        sent = settle(self, now)
        if sent and not stalled:
            stalled.append(True)
            time.sleep(1.5)  # this process starved right after deciding
        return sent

    monkeypatch.setattr(Decider, "settle", slow_settle)
    outcomes, _ = group.point("capture decode size 8", timeouts={0: 10.0, 1: 1.0})
    assert not outcomes[0].complete and not outcomes[1].complete


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
    assert closed_by_server(stranger, within=channel.HANDSHAKE_SECONDS + QUICK)


@pytest.mark.parametrize(
    ("token", "username"),
    [("0" * 32, b"fd-cudagraph"), (None, b""), ("", b"someone")],
    ids=["a wrong token", "no authentication", "a wrong user"],
)
def test_a_zmq_peer_without_the_jobs_token_never_becomes_a_peer(token, username):
    group = Group(world=2, joined=1)
    stranger = Peer(group, token=token, username=username)
    stranger.send({"op": "hello", "rank": 1, "protocol": messages.PROTOCOL})
    assert stranger.reply(within=0.5) is None  # refused in the handshake: never welcomed
    late = channel.join(lambda: group.store, "t", TCP, 1, 2, 5)  # the real rank 1
    late.next_epoch()
    group.links.append(late)
    healthy(group)
    stranger.close()
    group.close()


def test_a_zmq_peer_with_the_token_that_floods_valid_frames_delays_no_honest_point(group):
    stranger = Peer(group)
    stop = threading.Event()

    def flood() -> None:
        body = json.dumps(post([0, 0])).encode()
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
    for _ in range(5000):  # each is answered (dropped: no hello), none is read
        stranger.send(post([0, 0]))
    healthy(group)
    stranger.close()


@pytest.mark.parametrize("rank", [99, -1, "abc", None, 1.0, True])
def test_a_hello_claiming_a_rank_outside_the_group_is_refused(group, rank):
    stranger = Peer(group)
    stranger.send({"op": "hello", "rank": rank, "protocol": messages.PROTOCOL})
    reply = stranger.reply()
    assert reply is not None and reply["op"] in ("refused", "dropped")
    healthy(group)
    stranger.close()
    healthy(group, "after it left")  # its leaving costs nothing either


def test_a_hello_of_another_protocol_is_refused_saying_both(group):
    stranger = Peer(group)
    stranger.send({"op": "hello", "rank": 1, "protocol": 1})
    reply = stranger.reply()
    assert reply == {"op": "refused", "why": f"protocol 1, server {messages.PROTOCOL}"}
    stranger.close()
    healthy(group)


def test_a_second_claim_of_a_connected_rank_is_refused_and_the_first_keeps_it(group):
    impostor = Peer(group)
    impostor.send({"op": "hello", "rank": 1, "protocol": messages.PROTOCOL})
    reply = impostor.reply()
    assert reply["op"] == "refused" and reply["why"].startswith("rank 1 was claimed first")
    impostor.close()
    healthy(group)  # rank 1 was neither re-pointed nor lost
    healthy(group, "again")


def test_a_rank_once_lost_cannot_be_claimed_again(group):
    gone = group.links.pop(1)
    gone.close()
    group.point("plan", timeouts={0: 1.0})  # rank 0 learns rank 1 is lost
    impostor = Peer(group)
    impostor.send({"op": "hello", "rank": 1, "protocol": messages.PROTOCOL})
    reply = impostor.reply()
    assert reply["op"] == "refused" and "a connection now closed" in reply["why"]
    impostor.close()
    group.close()


def test_many_idle_connections_neither_exhaust_the_server_nor_keep_a_rank_out():
    group = Group(world=2, joined=1)
    flood = [socket.create_connection(("127.0.0.1", group.port())) for _ in range(200)]
    # The second rank joins through the flood.
    late = channel.join(lambda: group.store, "t", TCP, 1, 2, 5)
    late.next_epoch()
    group.links.append(late)
    healthy(group)
    for sock in flood:
        sock.close()
    group.close()


# ------------------------------------------------------------------ a rank that sends garbage


@pytest.mark.parametrize(
    "message",
    [
        {"op": "post", "key": "x", "label": "p", "timeout": 5, "status": None},
        {"op": "post", "key": [], "label": "p", "timeout": 5, "status": None},
        {"op": "post", "key": [0, "a"], "label": "p", "timeout": 5, "status": None},
        {"op": "post", "key": [0, 0], "timeout": 5, "status": None},
        {"op": "post", "key": [0, 0], "label": "p", "timeout": 5},
        {"op": "post", "key": [0, 0], "label": "p", "status": None},
        {"op": "post", "key": [0, 0], "label": "p", "timeout": "x", "status": None},
        {"op": "post", "key": [0, 0], "label": "\ud800", "timeout": 5, "status": None},
        {"op": "give_up", "key": None},
        {"op": "nonsense", "key": [0, 0]},
        ["a", "list"],
    ],
    ids=[
        "key x",
        "empty key",
        "key with text",
        "no label",
        "no status",
        "no timeout",
        "timeout text",
        "a lone surrogate label",
        "give-up without key",
        "unknown op",
        "a list",
    ],
)
def test_a_rank_that_sends_a_malformed_message_is_dropped_and_named(message):
    group, rogue = rogue_third_rank()
    rogue.send(json.dumps(message).encode())  # json.dumps escapes a lone surrogate as \ud800
    outcomes, took = group.point("plan")
    assert took < QUICK and group.server.is_alive() and group.server.failure is None
    for outcome in outcomes:
        assert outcome.outcome.missing == (2,) and 2 in outcome.outcome.dropped
    text = str(agreed_error(outcomes[0], 3, 5.0))
    assert "dropped tensor-parallel rank 2 for what it sent" in text
    assert rogue.reply()["op"] == "dropped"  # and it is told so
    group.close()


@pytest.mark.parametrize(
    "status",
    [
        {"failure": {"rank": 2}},
        {"payload": None, "failure": "out of memory"},
        {"payload": 1, "failure": {}},
        {"payload": None, "failure": {"rank": "x", "stage": 1, "where": None}},
        {"payload": "\ud800", "failure": None},
        [],
    ],
    ids=["partial failure", "failure text", "empty failure", "wrong types", "surrogate", "list"],
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
    rogue.send(post([0, 0], status=Status(failure=failure).to_json()))
    outcomes, _ = group.point("plan")
    text = str(agreed_error(outcomes[0], 3, 5.0))
    assert "failure.rank is 1, not 2" in text and "forged" not in text
    group.close()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"payload": NaN, "failure": null}',
        b'{"payload": Infinity, "failure": null}',
        b'{"payload": 1e999, "failure": null}',
        b'{"payload": ' + b"1" * 400 + b', "failure": null}',
        b'{"payload": ' + b"[" * 100 + b"]" * 100 + b', "failure": null}',
    ],
    ids=["NaN", "Infinity", "1e999", "an int of 400 digits", "100 deep"],
)
def test_a_status_that_cannot_be_read_drops_only_its_rank_and_the_server_lives(raw):
    group, rogue = rogue_third_rank()
    body = b'{"op": "post", "key": [0, 0], "label": "plan", "timeout": 5, "status": ' + raw + b"}"
    rogue.send(body)
    outcomes, took = group.point("plan")
    assert took < QUICK and group.server.is_alive() and group.server.failure is None
    texts = {str(agreed_error(o, 3, 5.0)) for o in outcomes}
    assert len(texts) == 1
    text = texts.pop()
    assert (
        "rank 2 posted a status at 'plan' that the channel does not accept" in text
        or "dropped tensor-parallel rank 2 for what it sent (not JSON" in text
        or "dropped tensor-parallel rank 2 for what it sent (the message nests" in text
    )
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


def test_seeded_random_messages_from_strangers_and_a_rank_cost_only_their_senders():
    rng = random.Random(20261202)
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
                for k in rng.sample(["op", "key", "label", "status", "rank"], 3)
            }
            message["op"] = rng.choice(["hello", "post", "give_up", "x", None])
            if kind < 0.6:
                message.update(
                    op="hello", protocol=messages.PROTOCOL, rank=rng.choice([0, 1, 2, 9])
                )
            peer.send(message)
        peer.close()
    healthy(group)
    group.close()


def test_text_is_sent_on_at_the_size_it_came_in():
    # An outcome re-encoded with ASCII escapes grew a 16 KiB post of emoji to 49 KB, past the
    # client's cap: the honest rank's link broke, blaming the server.
    group = Group(world=2)
    text = "\U0001f600" * ((MAX_POST_BYTES - 300) // 4)
    outcomes, took = group.point("plan", statuses={1: Status(payload=text)})
    assert took < QUICK and all(o.complete and o.shared() == [0, text] for o in outcomes)
    group.close()


def test_a_rank_that_opens_points_ahead_of_its_group_is_dropped():
    # Posting at a new key and giving up, over and over, held every point: 20k points and
    # 360 MB of rank 0's memory from one connection.
    group, rogue = rogue_third_rank()
    for point in range(1, 10):
        rogue.send(post([0, point], label="x"))
        rogue.send({"op": "give_up", "key": [0, point]})
    time.sleep(0.3)
    assert len(group.server.decider.points) <= channel.MAX_OPEN_POINTS
    outcomes, took = group.point("plan")
    assert took < QUICK and all(2 in o.outcome.dropped for o in outcomes)
    group.close()


def test_a_point_a_stranger_abandoned_ahead_of_time_names_it_not_the_ranks_that_came():
    group, rogue = rogue_third_rank()
    rogue.send(post([0, 0]))
    rogue.send({"op": "give_up", "key": [0, 0]})
    time.sleep(0.2)
    outcomes, _ = group.point("plan")
    text = str(agreed_error(outcomes[0], 3, 300.0))
    assert "when rank 2 stopped waiting for them" in text
    assert "within 300 s" not in text
    group.close()


def test_a_rank_that_reads_none_of_its_replies_is_named_at_once_not_at_the_timeout():
    group, rogue = rogue_third_rank()
    rogue.sock.setsockopt(zmq.RCVHWM, 1)
    big = Status(payload="y" * (MAX_POST_BYTES - 400))
    started = time.monotonic()
    for point in range(400):
        rogue.send(post([0, point], label="p", status=big.to_json(), timeout=30))
        outcomes, _ = group.point("p", timeouts={0: 30, 1: 30}, statuses={0: big, 1: big})
        if not outcomes[0].complete:
            break
    assert not outcomes[0].complete and 2 in outcomes[0].outcome.dropped
    assert time.monotonic() - started < 20  # named at once, not after the 30 s timeout
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
    body = channel._post((0, 0), "plan", Status.check(status), 7, 300.0)
    assert len(body) < (most << 10) <= channel.MAX_TO_SERVER, len(body)
    assert json.loads(body)["status"]["failure"] is None
    assert 8 * len(body) < messages.max_message_bytes(8)  # an outcome of 8 ranks of it


def test_a_status_too_large_for_the_channel_becomes_this_ranks_failure(group):
    huge = Status(payload="x" * (MAX_POST_BYTES + 1))
    outcomes, took = group.point("plan", statuses={1: huge})
    assert took < QUICK
    text = str(agreed_error(outcomes[0], 2, 5.0))
    assert "rank 1 posted a status at 'plan' that the channel does not accept" in text
    assert f"over the channel's {channel.MAX_TO_SERVER}" in text


# -------------------------------------------------------------------------- where it listens


@pytest.mark.parametrize(
    ("endpoints", "group_ranks", "kind"),
    [
        ("10.0.0.5:6170,10.0.0.5:6171", [0, 1], "ipc"),  # all on this host
        ("10.0.0.5:6170,10.0.0.6:6171", [0, 1], "tcp://10.0.0.5"),  # the group spans hosts
        ("10.0.0.5:6170,10.0.0.5:6171,10.0.0.6:6172,10.0.0.6:6173", [0, 1], "ipc"),
        ("", [0, 1], "tcp://10.0.0.5"),  # unknown: reachable from other hosts
    ],
)
def test_a_group_on_one_host_agrees_over_a_unix_socket_else_over_tcp_on_the_node_address(
    monkeypatch, endpoints, group_ranks, kind
):
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "10.0.0.5:6170")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", endpoints)
    address = channel.address_for("10.0.0.5:6170", "g", group_ranks, "auto", None)
    assert address.endpoint.startswith("ipc://") if kind == "ipc" else address.endpoint == kind


def test_without_paddles_launcher_the_ranks_are_taken_to_share_a_host(monkeypatch):
    monkeypatch.delenv("PADDLE_CURRENT_ENDPOINT", raising=False)
    assert channel.address_for("", "g", [0, 1], "auto", None).endpoint.startswith("ipc://")


def test_the_unix_socket_path_differs_per_job_and_group_and_is_the_same_on_every_rank():
    one = channel.address_for("10.0.0.5:6170", "fd-cudagraph/v3/0-1", [0, 1], "auto", None)
    assert one == channel.address_for("10.0.0.5:6170", "fd-cudagraph/v3/0-1", [0, 1], "auto", None)
    assert one != channel.address_for("10.0.0.5:6171", "fd-cudagraph/v3/0-1", [0, 1], "auto", None)
    assert one != channel.address_for("10.0.0.5:6170", "fd-cudagraph/v3/2-3", [2, 3], "auto", None)


@pytest.mark.parametrize(
    ("interface", "ports", "endpoint"),
    [
        ("10.0.0.7", None, "tcp://10.0.0.7"),
        ("eth0", None, "tcp://eth0"),
        ("auto", (29500, 29509), "tcp://127.0.0.1"),
    ],
)
def test_the_operator_can_choose_the_interface_and_ports(monkeypatch, interface, ports, endpoint):
    monkeypatch.delenv("PADDLE_CURRENT_ENDPOINT", raising=False)
    address = channel.address_for("j", "g", [0, 1], interface, ports)
    assert address.endpoint == endpoint and address.ports == ports


def test_a_port_range_is_used_in_order_and_a_full_one_is_refused_naming_the_option():
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    store = DictStore()
    address = Address("tcp://127.0.0.1", (port, port + 1))
    first = channel.join(lambda: store, "a", address, 0, 2, 5)
    assert first.server.endpoint == f"tcp://127.0.0.1:{port + 1}"
    with pytest.raises(JoinError, match=f"FD_CUDAGRAPH_AGREEMENT_PORTS={port}-{port + 1}"):
        channel.join(lambda: store, "b", address, 0, 2, 5)
    first.close()
    taken.close()


def test_a_socket_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    private = channel.private_directory()
    assert oct(os.stat(private).st_mode & 0o777) == oct(0o700)
    os.chmod(private, 0o777)
    with pytest.raises(JoinError, match="not a directory private to this user"):
        channel.private_directory()


def test_no_socket_of_the_channel_takes_a_closed_standard_descriptor(tmp_path):
    """With fd 2 closed under a live logger, a socket that took it would receive every line
    written to stderr (FastDeploy's console log once went into the channel this way)."""
    script = f"""
import os, sys, logging
sys.path.insert(0, {str(ROOT)!r})
os.close(2)
from fd_cudagraph_plugin.core import channel
from fd_cudagraph_plugin.core.messages import Status
import threading
made = {{}}
address = channel.Address("ipc://{tmp_path}/s.sock")
def connect(rank):
    made[rank] = channel.join(None, "t", address, rank, 2, 5)
threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
[t.start() for t in threads]; [t.join() for t in threads]
target = os.readlink("/proc/self/fd/2")
for link in made.values():
    link.next_epoch()
results = {{}}
def point(rank):
    results[rank] = made[rank].agree("p", Status(payload=rank), 5)
threads = [threading.Thread(target=point, args=(r,)) for r in (0, 1)]
[t.start() for t in threads]; [t.join() for t in threads]
print(target, all(r.complete for r in results.values()), flush=True)
os._exit(0)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["/dev/null", "True"], done.stdout + done.stderr


def test_a_link_nobody_closed_never_blocks_the_garbage_collector(tmp_path):
    """pyzmq terminates a collected context, which blocks for ever while its sockets live; the
    sockets' weak references are already gone when the collector finalizes a cycle."""
    import gc

    group = Group(ipc_address(tmp_path))
    group.self = group  # a cycle: only the collector frees it
    server = group.server
    server.stop()
    del group
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(10)
    assert not collector.is_alive(), "the garbage collector is stuck in zmq_ctx_term"
