"""The agreement channel, honest and attacked: TP rank 0's server decides each point once, every
rank gets the same outcome, and nothing a stranger or a broken rank sends can stall, fool or kill
it (docs/design.md, "The agreement channel").

Ranks are threads here, each with its own connection to a real server, and the job store is a
dict; over real ranks and Paddle's store, ``test_collective.py`` runs the same code. Every attack
is followed by a point of the honest ranks, which must complete with every status in under 2 s.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time

import pytest

from fd_cudagraph_plugin.core import channel, wire
from fd_cudagraph_plugin.core.agreement import agreed_error
from fd_cudagraph_plugin.core.channel import Decider, LocalLink, SocketLink

QUICK = 2.0  # what an honest point may take after any attack


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


class Group:
    """``world`` ranks joined to one real server; ``honest`` of them take part in points."""

    def __init__(self, world: int = 2, joined: int | None = None, timeout: float = 5.0) -> None:
        self.store, made = DictStore(), {}

        def connect(rank: int) -> None:
            made[rank] = SocketLink.connect(self.store, "t", rank, world, "127.0.0.1", timeout)

        threads = [threading.Thread(target=connect, args=(r,)) for r in range(joined or world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        self.links = [made[r] for r in sorted(made)]
        self.server = self.links[0]._server
        self.world = world
        for link in self.links:
            link.next_epoch()

    @property
    def published(self) -> dict:
        return json.loads(self.store.get("t/server"))

    def address(self) -> tuple[str, int]:
        return self.server.address

    def point(self, label: str = "p", timeouts=None, statuses=None) -> tuple[list, float]:
        """Every joined rank agrees once, concurrently; their outcomes and the longest wait."""
        outcomes: dict[int, object] = {}
        took: dict[int, float] = {}

        def run(rank: int, link: SocketLink) -> None:
            started = time.monotonic()
            status = (statuses or {}).get(rank, {"payload": rank})
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


def rogue_third_rank() -> tuple[Group, socket.socket]:
    """A group of 3 where ranks 0 and 1 are honest and rank 2, welcomed, is a raw socket."""
    group = Group(3, joined=2)
    rogue = socket.create_connection(group.address())
    token = group.published["token"]
    rogue.sendall(frame({"op": "hello", "rank": 2, "protocol": 2, "token": token}))
    assert read_reply(rogue) == {"op": "welcome"}
    return group, rogue


def frame(message) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("!I", len(body)) + body


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


def read_reply(sock: socket.socket) -> dict | None:
    sock.settimeout(QUICK)
    try:
        header = sock.recv(4)
        if len(header) < 4:
            return None
        (size,) = struct.unpack("!I", header)
        body = b""
        while len(body) < size:
            body += sock.recv(size - len(body))
        return json.loads(body)
    except OSError:
        return None


# ----------------------------------------------------------------------------- the honest case


def test_every_rank_gets_every_ranks_status_at_each_point():
    group = Group(3)
    for i in range(20):
        outcomes, _ = group.point(f"p{i}", statuses={r: {"payload": [r, i]} for r in range(3)})
        assert all(o.complete and o.shared() == [[r, i] for r in range(3)] for o in outcomes)
    group.close()


def test_a_failure_on_one_rank_reaches_every_rank_in_the_same_outcome(group):
    failure = {
        "rank": 1,
        "stage": "capture",
        "where": "decode size 4",
        "mode": "dynamic",
        "error": "RuntimeError: out of memory",
        "out_of_memory": True,
        "explained": False,
    }
    outcomes, _ = group.point("capture decode size 4", statuses={1: {"failure": failure}})
    assert [o.failures for o in outcomes] == [{1: failure}, {1: failure}]


def test_ranks_that_waited_for_one_that_never_came_name_it_within_the_timeout():
    group = Group(3, joined=3)
    late = group.links.pop(1)  # joined, never posts
    outcomes, took = group.point("plan", timeouts={0: 1.0, 2: 1.0})
    for outcome in outcomes:
        assert outcome.missing == (1,) and outcome.lost == () and outcome.gave_up
    assert 1.0 - channel.give_up_margin(1.0) <= took <= 1.0 + 0.1  # the whole wait, bounded
    late.close()
    group.close()


def test_a_rank_that_comes_after_the_others_gave_up_gets_their_outcome(group):
    results = {}

    def slow() -> None:
        time.sleep(1.0)
        results[1] = group.links[1].agree("plan", None, 5)

    thread = threading.Thread(target=slow)
    thread.start()
    results[0] = group.links[0].agree("plan", None, 0.4)
    thread.join(10)
    assert results[0].missing == (1,)
    assert results[1].missing == (1,)  # it must not go on alone into a collective


def test_a_rank_whose_process_exits_is_named_at_once():
    group = Group(3)
    gone = group.links.pop(2)
    threading.Timer(0.2, gone._sock.close).start()  # what the kernel does when the process dies
    outcomes, took = group.point("warm-up decode size 8", timeouts={0: 30, 1: 30})
    assert all(o.missing == (2,) and o.lost == (2,) for o in outcomes) and took < QUICK
    group.close()


def test_when_rank_zeros_process_exits_the_others_name_rank_zero(group):
    group.server.stop()  # every socket of rank 0's process closes
    group.server.join(5)
    outcome = group.links[1].agree("end", None, 5)
    assert outcome.missing == (0,) and outcome.lost == (0,)


def test_a_single_rank_agrees_with_itself():
    outcome = LocalLink().agree("plan", {"payload": 7}, 1)
    assert outcome.complete and outcome.shared() == [7]


def test_joining_a_group_whose_rank_zero_never_starts_times_out():
    with pytest.raises(channel.JoinError, match="rank 0 did not start the CUDA graph agreement"):
        SocketLink.connect(DictStore(), "none", 1, 2, "127.0.0.1", 0.3)


# ----------------------------------------------------------------------- one verdict per point


def test_a_give_up_after_the_point_completed_gets_the_completed_outcome():
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", None)
    decider.post(1, (0, 0), "plan", None)
    sent = decider.settle()
    decider.give_up(0, (0, 0))  # raced with the completion: nothing more is sent
    assert [(rank, outcome["missing"]) for rank, outcome in sent] == [(0, []), (1, [])]
    assert decider.settle() == []


def test_a_give_up_before_completion_abandons_the_point_for_everyone():
    decider = Decider(world=3)
    decider.post(0, (0, 0), "plan", None)
    decider.post(1, (0, 0), "plan", None)
    decider.settle()
    decider.give_up(0, (0, 0))
    assert {rank: o["missing"] for rank, o in decider.settle()} == {0: [2], 1: [2]}
    decider.post(2, (0, 0), "plan", None)  # the late rank learns it too
    assert [(rank, o["missing"]) for rank, o in decider.settle()] == [(2, [2])]


def test_a_give_up_that_arrives_with_the_last_post_wins():
    # A server that was stalled reads a rank's post, its give-up and the last rank's post in one
    # batch. The rank that gave up may already have stopped waiting: completing the point would
    # let the last rank go on alone.
    decider = Decider(world=2)
    decider.post(0, (0, 0), "plan", None)
    decider.give_up(0, (0, 0))
    decider.post(1, (0, 0), "plan", None)
    outcomes = dict(decider.settle())
    assert outcomes[0] is outcomes[1] and outcomes[1]["gave_up"] == [0]


def test_a_stall_that_ends_between_two_ranks_deadlines_does_not_split_the_verdict(group):
    """Rank 0 (timeout 1 s) stops waiting while the server is stalled; the server wakes after
    rank 1's post arrived. Rank 1 (timeout 5 s) must not be told the point completed."""
    turn = group.server._turn
    stalled = threading.Event()

    def stalling_turn() -> None:
        if not stalled.is_set():
            stalled.set()
            time.sleep(1.5)
        turn()

    group.server._turn = stalling_turn
    # Wake the selector so that the stall starts now, before the posts.
    socket.create_connection(group.address()).close()
    outcomes, _ = group.point("capture decode size 8", timeouts={0: 1.0, 1: 5.0})
    assert not outcomes[0].complete and not outcomes[1].complete
    error = agreed_error(outcomes[1], 2, 5.0)
    assert error is not None and "stopped waiting" in str(error)


def test_a_late_reply_is_never_taken_for_the_next_point():
    """A fake server that answers each post first with the outcome of the point before it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        inbox = bytearray()
        replies = 0
        while replies < 2:
            inbox += conn.recv(65536)
            message = wire.take_frame(inbox, 1 << 20)
            while message is not wire.INCOMPLETE:
                if message["op"] == "hello":
                    conn.sendall(frame({"op": "welcome"}))
                elif message["op"] == "post":
                    epoch, point = message["key"]
                    for key in ([epoch, point - 1], message["key"]):
                        statuses = {"0": {"payload": key}, "1": {"payload": key}}
                        outcome = {
                            "op": "outcome",
                            "key": key,
                            "statuses": statuses,
                            "labels": {"0": "p", "1": "p"},
                            "missing": [],
                            "lost": [],
                            "gave_up": [],
                            "dropped": {},
                            "waited": 0.0,
                        }
                        conn.sendall(frame(outcome))
                    replies += 1
                message = wire.take_frame(inbox, 1 << 20)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    store = DictStore()
    store.set("f/server", json.dumps({"host": "127.0.0.1", "port": port, "token": "x"}))
    store.add("f/ready", 1)
    link = SocketLink.connect(store, "f", 1, 2, "127.0.0.1", 5)
    link.next_epoch()
    assert link.agree("p", None, 5).shared() == [[0, 0], [0, 0]]
    assert link.agree("p", None, 5).shared() == [[0, 1], [0, 1]]
    link.close()
    listener.close()


def test_ranks_at_different_points_stop_naming_both(group):
    outcomes = {}

    def run(rank: int, label: str) -> None:
        outcomes[rank] = group.links[rank].agree(label, None, 5)

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


# --------------------------------------------------------------------------------- strangers


ATTACKS = {
    "one stray byte": b"x",
    "a bare header": struct.pack("!I", 10),
    "an HTTP health probe": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "a 4 GiB header": struct.pack("!I", 0xFFFFFFFF),
    "a JSON list": frame([1, 2]),
    "a JSON number": frame(7),
    "a JSON string": frame("hello"),
    "a deeply nested list": struct.pack("!I", 200) + b"[" * 200,
    "a post before any hello": frame({"op": "post", "key": [0, 0], "label": "p", "status": None}),
    "a hello without a token": frame({"op": "hello", "rank": 1, "protocol": 2}),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_bytes_from_a_stranger_cost_only_its_connection(group, attack):
    stranger = socket.create_connection(group.address())
    stranger.sendall(ATTACKS[attack])
    healthy(group)
    assert closed_by_server(stranger)  # at once, or when its hello is overdue


def test_a_slow_sender_never_blocks_the_server(group):
    stranger = socket.create_connection(group.address())
    stranger.sendall(struct.pack("!I", 50)[:3])  # a header, one byte short, and nothing more
    healthy(group)
    assert closed_by_server(stranger, within=channel.HELLO_SECONDS + QUICK)


@pytest.mark.parametrize("field", ["token", "protocol"])
def test_a_hello_with_a_wrong_token_or_protocol_is_refused(group, field):
    hello = {"op": "hello", "rank": 1, "protocol": 2, "token": group.published["token"]}
    hello[field] = "0" * 32 if field == "token" else 1
    stranger = socket.create_connection(group.address())
    stranger.sendall(frame(hello))
    assert closed_by_server(stranger)
    healthy(group)


def test_a_hello_with_a_wrong_token_never_takes_a_free_rank():
    group = Group(2, joined=1)
    hello = {"op": "hello", "rank": 1, "protocol": 2, "token": "0" * 32}
    stranger = socket.create_connection(group.address())
    stranger.sendall(frame(hello))
    assert read_reply(stranger) is None  # dropped without a word, never welcomed
    late = SocketLink.connect(group.store, "t", 1, 2, "127.0.0.1", 5)  # the real rank 1
    late.next_epoch()
    group.links.append(late)
    healthy(group)
    group.close()


def test_an_oversized_frame_is_dropped_at_its_header_not_when_its_hello_is_due(group):
    stranger = socket.create_connection(group.address())
    stranger.sendall(struct.pack("!I", 1 << 30))  # announces 1 GiB
    assert closed_by_server(stranger, within=channel.HELLO_SECONDS / 2)
    healthy(group)


def test_a_rank_announcing_an_oversized_frame_is_dropped_at_once_and_named():
    group, rogue = rogue_third_rank()
    rogue.sendall(struct.pack("!I", 1 << 30))  # then nothing: the server must not wait for it
    outcomes, took = group.point("plan")
    assert took < QUICK
    assert all(o.missing == (2,) and "a frame of" in o.dropped[2] for o in outcomes)
    group.close()


@pytest.mark.parametrize("rank", [99, -1, "abc", None, 1.0, True])
def test_a_hello_claiming_a_rank_outside_the_group_is_refused(group, rank):
    stranger = socket.create_connection(group.address())
    token = group.published["token"]
    stranger.sendall(frame({"op": "hello", "rank": rank, "protocol": 2, "token": token}))
    reply = read_reply(stranger)
    assert reply is not None and reply["op"] == "refused"
    healthy(group)
    stranger.close()
    healthy(group, "after it left")  # its leaving costs nothing either


def test_a_second_claim_of_a_connected_rank_is_refused_and_the_first_keeps_it(group, caplog):
    impostor = socket.create_connection(group.address())
    token = group.published["token"]
    impostor.sendall(frame({"op": "hello", "rank": 1, "protocol": 2, "token": token}))
    reply = read_reply(impostor)
    assert reply["op"] == "refused"
    assert reply["why"].startswith("rank 1 was claimed first by 127.0.0.1:")
    impostor.close()
    healthy(group)  # rank 1 was neither re-pointed nor lost
    healthy(group, "again")


def test_many_idle_connections_neither_exhaust_the_server_nor_keep_a_rank_out():
    group = Group(2, joined=1)
    flood = [socket.create_connection(group.address()) for _ in range(200)]
    assert len(group.server.connections) <= channel.MAX_PENDING + 1
    # The second rank joins through the flood: the oldest stranger makes room for it.
    late = SocketLink.connect(group.store, "t", 1, 2, "127.0.0.1", 5)
    late.next_epoch()
    group.links.append(late)
    healthy(group)
    for sock in flood:
        sock.close()
    group.close()


def test_an_accept_error_never_stops_the_server_accepting(group, monkeypatch):
    import errno

    listener = group.server.listener
    real_accept = socket.socket.accept
    errors = [OSError(errno.EMFILE, "Too many open files")] * 3

    def accept(sock):
        if sock is listener and errors:
            raise errors.pop()  # what an exhausted descriptor table does
        return real_accept(sock)

    monkeypatch.setattr(socket.socket, "accept", accept)
    stranger = socket.create_connection(group.address())
    stranger.sendall(b"x")
    assert closed_by_server(stranger)  # accepted once the errors passed, then dropped
    assert errors == []
    healthy(group)


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
        {"op": "give_up", "key": None},
        {"op": "nonsense", "key": [0, 0]},
        ["a", "list"],
    ],
)
def test_a_rank_that_sends_a_malformed_message_is_dropped_and_named(message):
    group, rogue = rogue_third_rank()
    rogue.sendall(frame(message))
    outcomes, took = group.point("plan")
    assert took < QUICK and group.server.is_alive()
    for outcome in outcomes:
        assert outcome.missing == (2,) and 2 in outcome.dropped
    text = str(agreed_error(outcomes[0], 3, 5.0))
    assert "dropped tensor-parallel rank 2 for what it sent" in text
    group.close()


@pytest.mark.parametrize(
    "status",
    [
        {"failure": {"rank": 1}},
        {"failure": "out of memory"},
        {"payload": 1, "failure": {}},
        {"failure": {"rank": "x", "stage": 1, "where": None}},
        [],
    ],
)
def test_a_forged_status_becomes_the_same_clear_error_on_every_rank(status):
    group, rogue = rogue_third_rank()
    post = {"op": "post", "key": [0, 0], "label": "plan", "timeout": 5, "status": status}
    rogue.sendall(frame(post))
    outcomes, took = group.point("plan")
    assert took < QUICK
    texts = {str(agreed_error(o, 3, 5.0)) for o in outcomes}
    assert len(texts) == 1
    assert "rank 2 posted a status at 'plan' that the channel does not accept" in texts.pop()
    rogue.close()
    group.close()


def test_seeded_random_frames_from_strangers_and_a_rank_cost_only_their_connections():
    rng = random.Random(20261201)
    group = Group(2)
    token = group.published["token"]
    values = [None, True, 0, -1, 2**40, 1.5, "", "x" * 300, [], {}, [0, 0], [0, "a"], {"a": 1}]
    for _ in range(300):
        kind = rng.random()
        if kind < 0.3:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            message = {
                k: rng.choice(values)
                for k in rng.sample(["op", "key", "label", "status", "rank", "token"], 3)
            }
            message["op"] = rng.choice(["hello", "post", "give_up", "x", None])
            if kind < 0.6:
                message.update(op="hello", token=token, protocol=2, rank=rng.choice([0, 1, 2, 9]))
            data = frame(message)
        sock = socket.create_connection(group.address())
        sock.sendall(data)
        sock.close()
    healthy(group)
    assert len(group.server.connections) <= channel.MAX_PENDING + 2
    group.close()


# ------------------------------------------------------------------------------ the frame cap


@pytest.mark.parametrize(
    ("sizes", "prefill", "most"),
    [
        ([1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)][:36], [], 2 << 10),
        (list(range(1, 513)), list(range(1, 513)), 10 << 10),  # FastDeploy's limits
    ],
    ids=["36 sizes", "512 sizes in both phases"],
)
def test_the_largest_real_post_fits_the_frame_cap(sizes, prefill, most):
    """The plan point of a worker with a target and an MTP draft, FastDeploy's largest
    real_bsz map and every size unwarmed, as 8 ranks post it."""
    from fd_cudagraph_plugin.core import fingerprint

    backend = {
        "capture_sizes": sorted(sizes, reverse=True),
        "prefill_sizes": sorted(prefill, reverse=True),
        "mode": "static_split" if prefill else "dynamic",
        "only_prefill": False,
        "warmups": 2,
        "speculative_method": "mtp",
        "num_speculative_tokens": 1,
        "bsz_table": list(range(513)),
    }
    plan = {
        "plugin_version": "0.3.0",
        "phase": "decode",
        "pool": "instance",
        "self_check": "off",
        "custom_allreduce": True,
        "backends": 2,
        **fingerprint.backends_plan([backend, backend]),
    }
    unwarmed = [{"decode": sizes, "prefill": prefill}] * 2
    status = {"payload": {"plan": plan, "unwarmed": unwarmed}}
    post = wire.post_frame([0, 0], "plan", status, 7, 300.0)
    size = len(post) - 4
    assert size < most <= wire.MAX_POST_BYTES, size
    assert "failure" not in json.loads(post[4:])["status"]
    assert 8 * size < wire.max_reply_bytes(8)  # an outcome of 8 ranks of it


def test_a_status_too_large_for_the_channel_becomes_this_ranks_failure(group):
    huge = {"payload": "x" * (wire.MAX_POST_BYTES + 1)}
    outcomes, took = group.point("plan", statuses={1: huge})
    assert took < QUICK
    text = str(agreed_error(outcomes[0], 2, 5.0))
    assert "rank 1 posted a status at 'plan' that the channel does not accept" in text
    assert f"over the channel's {wire.MAX_POST_BYTES}" in text


# -------------------------------------------------------------------------- where it listens


@pytest.mark.parametrize(
    ("endpoints", "ranks", "host"),
    [
        ("10.0.0.5:6170,10.0.0.5:6171", [0, 1], "127.0.0.1"),  # all on this host
        ("10.0.0.5:6170,10.0.0.6:6171", [0, 1], "10.0.0.5"),  # the group spans hosts
        ("10.0.0.5:6170,10.0.0.5:6171,10.0.0.6:6172,10.0.0.6:6173", [0, 1], "127.0.0.1"),
        ("", [0, 1], "10.0.0.5"),  # unknown: reachable from other hosts
    ],
)
def test_the_server_listens_on_loopback_unless_the_group_spans_hosts(
    monkeypatch, endpoints, ranks, host
):
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "10.0.0.5:6170")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", endpoints)
    assert channel.listen_host(ranks) == host


def test_without_paddles_launcher_the_server_listens_on_loopback(monkeypatch):
    monkeypatch.delenv("PADDLE_CURRENT_ENDPOINT", raising=False)
    assert channel.listen_host([0, 1]) == "127.0.0.1"


# ------------------------------------------- what a rank holding the token can send (2nd review)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"payload": NaN}',
        b'{"payload": Infinity}',
        b'{"payload": 1e999}',
        b'{"failure": {"rank": 2, "stage": "s", "where": "", "mode": "", "error": "e", '
        b'"out_of_memory": true, "explained": false, "memory": {"captured_bytes": '
        + b"1"
        * 400
        + b', "graphs_done": 0, "graphs_planned": 1, "free": null, "total": null, '
        b'"utilization": null, "kv_reserve": "off"}}}',
        b'{"payload": ' + b"[" * 100 + b"]" * 100 + b"}",
    ],
    ids=["NaN", "Infinity", "1e999", "an int of 400 digits", "100 deep"],
)
def test_a_status_that_cannot_be_sent_on_becomes_that_ranks_failure_and_the_server_lives(raw):
    # Each of these killed the server for good (a NaN or infinity re-encoded in the outcome, an
    # OverflowError in the range check), or parsed on one rank and not another (deep nesting).
    group, rogue = rogue_third_rank()
    body = b'{"op": "post", "key": [0, 0], "label": "plan", "timeout": 5, "status": ' + raw + b"}"
    rogue.sendall(struct.pack("!I", len(body)) + body)
    outcomes, took = group.point("plan")
    assert took < QUICK and group.server.is_alive() and group.server.failure is None
    texts = {str(agreed_error(o, 3, 5.0)) for o in outcomes}
    assert len(texts) == 1
    text = texts.pop()  # NaN and infinities are no JSON: the frame is refused, its rank dropped
    assert (
        "rank 2 posted a status at 'plan' that the channel does not accept" in text
        or "dropped tensor-parallel rank 2 for what it sent (not JSON" in text
    )
    group.close()


def test_text_is_sent_on_at_the_size_it_came_in():
    # An outcome re-encoded with ASCII escapes grew a 16 KiB post of emoji to 49 KB, past the
    # client's cap: the honest rank's link broke, blaming the server.
    group = Group(2)
    text = "\U0001f600" * ((wire.MAX_POST_BYTES - 200) // 4)
    outcomes, took = group.point("plan", statuses={1: {"payload": text}})
    assert took < QUICK and all(o.complete and o.shared() == [0, text] for o in outcomes)
    group.close()


def test_a_rank_that_opens_points_ahead_of_its_group_is_dropped():
    # Posting at a new key and giving up, over and over, held every point: 20k points and
    # 360 MB of rank 0's memory from one connection.
    group, rogue = rogue_third_rank()
    for point in range(1, 10):
        post = {"op": "post", "key": [0, point], "label": "x", "timeout": 5, "status": None}
        rogue.sendall(frame(post) + frame({"op": "give_up", "key": [0, point]}))
    assert closed_by_server(rogue)
    assert len(group.server.decider.points) <= channel.MAX_OPEN_POINTS
    outcomes, took = group.point("plan")
    assert took < QUICK and all(2 in o.dropped for o in outcomes)
    group.close()


def test_a_point_a_stranger_abandoned_ahead_of_time_names_it_not_the_ranks_that_came():
    group, rogue = rogue_third_rank()
    post = {"op": "post", "key": [0, 0], "label": "plan", "timeout": 5, "status": None}
    rogue.sendall(frame(post) + frame({"op": "give_up", "key": [0, 0]}))
    time.sleep(0.2)
    outcomes, _ = group.point("plan")
    text = str(agreed_error(outcomes[0], 3, 300.0))
    assert "when rank 2 stopped waiting for them" in text
    assert "within 300 s" not in text
    group.close()


def test_a_rank_that_reads_none_of_its_replies_is_named_at_once_not_at_the_timeout():
    group, rogue = rogue_third_rank()
    rogue.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # Posts that each complete at once with a large status, never read by the rogue: its outbox
    # passes the cap and it is dropped while an outcome is being sent.
    honest = group.links
    big = {"payload": "y" * (wire.MAX_POST_BYTES - 300)}
    started = time.monotonic()
    for point in range(200):
        post = {"op": "post", "key": [0, point], "label": "p", "timeout": 30, "status": big}
        rogue.sendall(frame(post))
        outcomes, _ = group.point("p", timeouts={0: 30, 1: 30}, statuses={0: big, 1: big})
        if not outcomes[0].complete:
            break
    assert not outcomes[0].complete and 2 in outcomes[0].dropped
    assert time.monotonic() - started < 20  # named at once, not after the 30 s timeout
    assert honest and group.server.is_alive()
    group.close()


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
