"""The agreement channel: TP rank 0's server decides each point once, and every rank gets the same
outcome, also when a rank fails, never comes, gives up, or its process goes away.

Ranks are threads here, each with its own connection, and the job store is a dict; over real
ranks and Paddle's store, ``test_collective.py`` runs the same code.
"""

from __future__ import annotations

import threading
import time

import pytest

from fd_cudagraph_plugin.core.agreement import LocalLink, SocketLink, _Decider


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


def links(world: int, timeout: float = 5.0) -> list[SocketLink]:
    store, made = DictStore(), {}

    def connect(rank: int) -> None:
        made[rank] = SocketLink.connect(store, "test", rank, world, "127.0.0.1", timeout)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [made[r] for r in range(world)]


def agree_all(links_, plan):
    """Each rank runs ``plan(rank, link)`` in its own thread; the outcomes by rank."""
    outcomes: dict[int, list] = {}

    def run(rank, link):
        link.next_epoch()
        outcomes[rank] = plan(rank, link)

    threads = [threading.Thread(target=run, args=(r, link)) for r, link in enumerate(links_)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


def test_every_rank_gets_every_ranks_status_at_each_point():
    def plan(rank, link):
        return [link.agree(f"p{i}", {"payload": [rank, i]}, 5) for i in range(20)]

    outcomes = agree_all(links(3), plan)
    expected = [[[r, i] for r in range(3)] for i in range(20)]
    for rank in range(3):
        assert [o.shared() for o in outcomes[rank]] == expected
        assert all(o.complete for o in outcomes[rank])


def test_a_failure_on_one_rank_reaches_every_rank_in_the_same_outcome():
    def plan(rank, link):
        status = {"failure": {"why": "out of memory"}} if rank == 2 else None
        return link.agree("capture decode size 4", status, 5)

    outcomes = agree_all(links(3), plan)
    assert {r: o.failures for r, o in outcomes.items()} == {
        r: {2: {"why": "out of memory"}} for r in range(3)
    }


def test_ranks_that_waited_for_one_that_never_came_name_it_within_the_timeout():
    def plan(rank, link):
        if rank == 1:
            return None  # never posts
        started = time.monotonic()
        outcome = link.agree("plan", None, 0.5)
        return outcome, time.monotonic() - started

    outcomes = agree_all(links(3), plan)
    for rank in (0, 2):
        outcome, waited = outcomes[rank]
        assert outcome.missing == (1,) and outcome.lost == () and 0.4 < waited < 5


def test_a_rank_that_comes_after_the_others_gave_up_gets_their_outcome():
    def plan(rank, link):
        if rank == 1:
            time.sleep(1.0)
        return link.agree("plan", None, 0.3 if rank == 0 else 5)

    outcomes = agree_all(links(2), plan)
    assert outcomes[0].missing == (1,)
    assert outcomes[1].missing == (1,)  # it must not go on alone into a collective


def test_a_rank_whose_process_exits_is_named_at_once():
    group = links(3)

    def plan(rank, link):
        if rank == 2:
            time.sleep(0.2)
            link._sock.close()  # what the kernel does when the process dies
            return None
        started = time.monotonic()
        return link.agree("warm-up decode size 8", None, 30), time.monotonic() - started

    outcomes = agree_all(group, plan)
    for rank in (0, 1):
        outcome, waited = outcomes[rank]
        assert outcome.missing == (2,) and outcome.lost == (2,) and waited < 5


def kill(server) -> None:
    """What the kernel does to rank 0's server when its process dies: every socket closes. Waits
    for the hellos first, so that no connection is still on its way in."""
    deadline = time.monotonic() + 5
    while len(server.sockets) < server.decider.world and time.monotonic() < deadline:
        time.sleep(0.01)
    for key in list(server.selector.get_map().values()):
        key.fileobj.close()


def test_when_rank_zeros_server_is_gone_the_others_name_rank_zero():
    group = links(2)
    kill(group[0]._server)
    group[1].next_epoch()
    outcome = group[1].agree("end", None, 5)
    assert outcome.missing == (0,) and outcome.lost == (0,)


def test_a_give_up_after_the_point_completed_gets_the_completed_outcome():
    decider = _Decider(world=2)
    decider.post(0, (0, 0), "plan", None)
    decider.post(1, (0, 0), "plan", None)
    sent = list(decider.outbox)
    decider.outbox.clear()
    decider.give_up(0, (0, 0))  # raced with the completion: nothing more is sent
    assert [(rank, outcome["missing"]) for rank, _, outcome in sent] == [(0, []), (1, [])]
    assert decider.outbox == []


def test_a_give_up_before_completion_abandons_the_point_for_everyone():
    decider = _Decider(world=3)
    decider.post(0, (0, 0), "plan", None)
    decider.post(1, (0, 0), "plan", None)
    decider.give_up(0, (0, 0))
    assert {rank: outcome["missing"] for rank, _, outcome in decider.outbox} == {0: [2], 1: [2]}
    decider.outbox.clear()
    decider.post(2, (0, 0), "plan", None)  # the late rank learns it too
    assert [(rank, outcome["missing"]) for rank, _, outcome in decider.outbox] == [(2, [2])]


def test_a_single_rank_agrees_with_itself():
    link = LocalLink()
    outcome = link.agree("plan", {"payload": 7}, 1)
    assert outcome.complete and outcome.shared() == [7]


def test_joining_a_group_whose_rank_zero_never_starts_times_out():
    with pytest.raises(TimeoutError, match="rank 0 did not start the CUDA graph agreement server"):
        SocketLink.connect(DictStore(), "none", 1, 2, "127.0.0.1", 0.3)
