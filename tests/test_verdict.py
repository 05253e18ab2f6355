"""The verdict rule (``ranks/verdict.py``) over an in-memory store whose ``add`` is atomic, through
every interleaving of the ranks' store operations for 2, 3 and 4 ranks: no clock, no sleep.

Each rank runs ``verdict.point`` as the real link does. A schedule picks which rank's next
operation the store applies; where a rank waits, the schedule also picks whether its timeout has
run out (the only clock there is). A rank may also never arrive (its process stopped for ever).
In every reachable end state, every rank that returned a verdict returned the same one, a complete
point had every rank's post, and an abandoned one names the same posts and the same first give-up
on every rank.
"""

from __future__ import annotations

import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from fd_cudagraph_plugin.core.ranks import verdict
from fd_cudagraph_plugin.core.ranks.verdict import Add, Unrecorded, Verdict, Wait


class Store:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def _runs(world: int, present: tuple[int, ...], rule=verdict.point, record_expires=False):
    """Every end state of ``present`` ranks running ``rule``: a list of {rank: Verdict or
    'unrecorded'}. Depth first; a state already explored (the store's values and each rank's
    replies so far, which decide all it does next) is not explored again.

    A rank's next step depends only on the replies it has had, so each rank's generator is run
    once per distinct history of replies (``step``), never again for each path to it."""
    ends: list[dict[int, object]] = []
    visited: set = set()
    steps: dict[tuple[int, tuple], tuple] = {}

    def step(rank: int, replies: tuple) -> tuple:
        """(next operation, its local variables, None) or (None, (), what it returned)."""
        key = (rank, replies)
        if key not in steps:
            generator = rule(rank, world, "c", "v")
            try:
                op = next(generator)
                for reply in replies:
                    op = generator.send(reply)
            except StopIteration as stop:
                steps[key] = (None, (), stop.value)
            except Unrecorded:
                steps[key] = (None, (), "unrecorded")
            else:
                steps[key] = (op, _locals(generator), None)
        return steps[key]

    def moves(values, pending, seen, told):
        for rank, op in pending.items():
            if isinstance(op, Add):
                yield rank, False
                continue
            value = values.get(op.key, 0)
            # A read that tells the rank nothing leaves it where it was: only reads that can
            # decide are choices, and the moment its timeout runs out.
            telling = (
                verdict.from_counter(value, world) is not None
                if op.phase == "posts"
                else value != 0
            ) and seen.get((rank, op.phase)) != value
            if (rank, op.phase) in told:  # its timeout ran out already: the clock stays out
                if telling:
                    yield rank, True
                continue
            if telling:
                yield rank, False
            if op.phase == "posts" or record_expires:
                yield rank, True

    def walk(values: dict, histories: dict, seen: dict, told: frozenset) -> None:
        now = {r: step(r, histories[r]) for r in present}
        state = (
            tuple(sorted(values.items())),
            tuple((r, *now[r]) for r in present),
            tuple(sorted(seen.items())),
            tuple(sorted(told)),
        )
        if state in visited:
            return
        visited.add(state)
        pending = {r: op for r, (op, _, _) in now.items() if op is not None}
        options = list(moves(values, pending, seen, told))
        if not options:
            ends.append({r: found for r, (op, _, found) in now.items() if op is None})
            return
        for rank, expired in options:
            op = pending[rank]
            after, now_seen, now_told = dict(values), seen, told
            if isinstance(op, Add):
                after[op.key] = after.get(op.key, 0) + op.amount
                reply: object = after[op.key]
            else:
                value = after[op.key] = after.get(op.key, 0)
                now_seen = {**seen, (rank, op.phase): value}
                if expired:
                    now_told = told | {(rank, op.phase)}
                reply = (value, expired)
            walk(after, {**histories, rank: (*histories[rank], reply)}, now_seen, now_told)

    walk({}, {r: () for r in present}, {}, frozenset())
    return ends


def _locals(rule) -> tuple:
    """What a rank does next depends on its rule's local variables alone: the state's key."""
    frame = rule.gi_frame
    if frame is None:
        return ()
    return tuple(sorted((k, v) for k, v in frame.f_locals.items() if not callable(v)))


def _check(world: int, ends: list[dict[int, object]]) -> None:
    for done in ends:
        verdicts = [v for v in done.values() if isinstance(v, Verdict)]
        assert "unrecorded" not in done.values(), done  # a decider that is never stopped records
        assert len(set(verdicts)) <= 1, done
        if verdicts and verdicts[0].complete:
            assert verdicts[0].posts == verdict.everyone(world), done
        elif verdicts:
            assert verdicts[0].giver is not None and verdicts[0].posts is not None, done
            assert verdicts[0].posts != verdict.everyone(world), done


@pytest.mark.parametrize("world", [2, 3])
def test_every_interleaving_of_every_subset_of_ranks_reads_one_verdict(world):
    for count in range(1, world + 1):
        for present in itertools.combinations(range(world), count):
            ends = _runs(world, present)
            _check(world, ends)
            verdicts = [v for done in ends for v in done.values() if isinstance(v, Verdict)]
            assert any(not v.complete for v in verdicts)  # a timeout before the last post
            # Without a rank that never posts, no point completes.
            assert any(v.complete for v in verdicts) == (count == world)


class Spawned:
    """The four-rank walk (seconds of one core) in a process of its own, beside the in-process
    tests (conftest.py starts it once collection is done, and this module's tests go last)."""

    def __init__(self) -> None:
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.four = self.pool.submit(_runs, 4, (0, 1, 2, 3))

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def start_early(tmp_path_factory) -> Spawned:
    return Spawned()


def test_every_interleaving_of_four_ranks_reads_one_verdict(started):
    ends = started.four.result()
    _check(4, ends)
    complete = [e for e in ends if any(isinstance(v, Verdict) and v.complete for v in e.values())]
    abandoned = [
        e for e in ends if any(isinstance(v, Verdict) and not v.complete for v in e.values())
    ]
    assert complete and abandoned


def test_two_ranks_never_need_a_record_to_know_the_verdict():
    """With two ranks every rank learns complete or abandoned from its own add or a read of the
    counter; a record only names who was missing. So even a decider that never records (its
    record's wait runs out on the other rank) splits no verdict."""
    for done in _runs(2, (0, 1), record_expires=True):
        verdicts = {v.complete for v in done.values() if isinstance(v, Verdict)}
        assert "unrecorded" not in done.values(), done
        assert len(verdicts) <= 1, done


# ------------------------------------------------------------------ the defects, planted


def _decides_at_its_deadline(rank, world, counter, recorded):
    """A rank that, when its timeout runs out, decides "abandoned" on its own clock."""
    value = yield Add(counter, 1 << rank)
    found = verdict.from_counter(value, world)
    while found is None or found is verdict.NEEDS_RECORD:
        value, expired = yield Wait(counter, "posts")
        found = verdict.from_counter(value, world)
        if found is None and expired:
            yield Add(counter, 1 << (world + rank))
            return Verdict(False, value & verdict.everyone(world), rank)
    return found if found.posts is not None else Verdict(False, 0, rank)


def _give_up_ignores_the_count(rank, world, counter, recorded):
    """A give-up that does not read what its own add returned: it takes itself for the first."""
    rule = verdict.point(rank, world, counter, recorded)
    op = next(rule)
    while True:
        reply = yield op
        if isinstance(op, Add) and op.amount == 1 << (world + rank):
            reply = reply & verdict.everyone(world) & ~(1 << rank) | (1 << (world + rank))
        try:
            op = rule.send(reply)
        except StopIteration as stop:
            return stop.value


@pytest.mark.parametrize("planted", [_decides_at_its_deadline, _give_up_ignores_the_count])
def test_a_planted_defect_splits_some_interleaving(planted):
    with pytest.raises(AssertionError):
        _check(2, _runs(2, (0, 1), rule=planted))


def test_a_record_no_rank_of_the_group_wrote_is_refused():
    with pytest.raises(ValueError):
        verdict.read_record(2, 2)  # neither a completion nor an abandonment
    with pytest.raises(ValueError):
        verdict.read_record(verdict.record(Verdict(False, 0b1, 5)), 2)  # rank 5 of 2
    with pytest.raises(ValueError):
        verdict.read_record(verdict.ABANDONED << 1, 2)
    assert verdict.read_record(verdict.record(Verdict(False, 0b01, 1)), 2) == Verdict(False, 1, 1)
