"""One verdict per point, ordered by one atomic counter in Paddle's job store.

Each point has a counter. Rank ``r`` posts by adding bit ``r`` (after writing its status, and
with bit ``2 * world + r`` when it wrote one: a plain "ok" is not written); when its
``FD_CUDAGRAPH_RANK_TIMEOUT`` runs out it gives up by adding bit ``world + r``. The store
applies adds one at a time, so they have one order, the same for every rank, and whatever a rank
reads of the counter, or gets back from its own add, is the state after some prefix of that
order. The verdict is:

* **complete** if every rank's post comes before the first give-up;
* **abandoned** if a give-up comes first.

A prefix with every post and no give-up is complete whatever follows; one with a give-up and not
every post is abandoned. One with every post and a give-up is decided, but only the first give-up
knows which came first (its own add returned the posts before it), so it always records what it
learned in the point's record, a second counter written once. Which posts count when a point is
abandoned (the posts before the first give-up) is known to that rank alone too, and recorded with
it. A rank that cannot tell waits for the record, bounded by the timeout: an atomic add cannot
give three or more ranks a verdict without waiting for the rank that decided (fetch-and-add has
consensus number 2), and two ranks never wait for a record to know the verdict.

``point()`` is the rule as a generator of store operations, so that the real link
(``link.py``) drives it against Paddle's store and the tests drive it against an in-memory store
through every interleaving.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

#: The record's bits: a completion adds ``COMPLETE``; an abandonment adds ``ABANDONED`` with the
#: rank that gave up first and the posts that came before its give-up (only that rank writes it).
COMPLETE = 1
_MASK_SHIFT = 5
_GIVER_SHIFT = 36
ABANDONED = 1 << 41


@dataclass(frozen=True)
class Verdict:
    complete: bool
    #: The ranks whose posts count (bit per rank); None until the record says.
    posts: int | None = None
    #: The rank whose give-up came first (abandoned points), when known.
    giver: int | None = None


#: The store's reply was lost (the connection failed after the request went out): the rule reads
#: the counter instead of learning from its own add.
LOST = None


@dataclass(frozen=True)
class Add:
    key: str
    amount: int


@dataclass(frozen=True)
class Wait:
    """Read ``key`` (an add of 0). The driver answers ``(value, expired)``: ``expired`` is True
    once this wait has lasted the timeout (the operator's clock, judged by the driver)."""

    key: str
    #: "posts" (from this rank's post) or "record" (from when it began to wait for the record).
    phase: str


class Unrecorded(Exception):
    """Every rank posted and one gave up, and the rank that gave up first, which alone knows
    which came first, did not record it within the timeout."""


def written_bit(rank: int, world: int) -> int:
    """The bit a post carries when its rank wrote a status to read (the third region of the
    counter; the rule reads only the first two)."""
    return 1 << (2 * world + rank)


def everyone(world: int) -> int:
    return (1 << world) - 1


def split(value: int, world: int) -> tuple[int, int]:
    """A counter's value as (posts, give-ups), each a bit per rank."""
    return value & everyone(world), (value >> world) & everyone(world)


def from_counter(value: int, world: int) -> Verdict | None:
    """What any value of the counter tells: a verdict (abandoned: which posts count is in the
    record), ``NEEDS_RECORD``, or None (undecided)."""
    posts, gave = split(value, world)
    if posts == everyone(world) and not gave:
        return Verdict(True, posts)
    if gave:
        return NEEDS_RECORD if posts == everyone(world) else Verdict(False)
    return None


#: Decided, but which way only the record says.
NEEDS_RECORD = Verdict(False, posts=-1)


def record(verdict: Verdict) -> int:
    if verdict.complete:
        return COMPLETE
    return ABANDONED | (verdict.giver << _GIVER_SHIFT) | (verdict.posts << _MASK_SHIFT)


def read_record(value: int, world: int) -> Verdict | None:
    """A record's value as the verdict it holds; None when nothing is recorded. ``ValueError``
    when it is not one any rank of ``world`` can have written (the store is shared with the whole
    job)."""
    if value == 0:
        return None
    if value == COMPLETE:
        return Verdict(True, everyone(world))
    posts = (value >> _MASK_SHIFT) & ((1 << (_GIVER_SHIFT - _MASK_SHIFT)) - 1)
    giver = (value >> _GIVER_SHIFT) & 0x1F
    if value >> _GIVER_SHIFT >> 5 != 1 or value & ((1 << _MASK_SHIFT) - 1):
        raise ValueError(f"record {value} is not one this rule writes")
    if giver >= world or posts & ~everyone(world) or posts == everyone(world):
        raise ValueError(f"record {value} names ranks outside a group of {world}")
    return Verdict(False, posts, giver)


def point(
    rank: int, world: int, counter: str, recorded: str, written: bool = False
) -> Generator[Add | Wait, object, Verdict]:
    """One rank's part of one point, after it wrote its status (``written``; a plain "ok" is not
    written): post, wait, give up at the timeout, and return the verdict every rank returns.
    Raises ``Unrecorded`` when the verdict needs a record that did not come within the
    timeout."""
    mine, give_up = 1 << rank, 1 << (world + rank)
    value = yield Add(counter, mine | (written_bit(rank, world) if written else 0))
    # What this post's own add returned: a give-up before it means the posts did not all come
    # first; read like any other value of the counter (a lost reply: read it again).
    verdict = None if value is LOST else from_counter(value, world)
    if verdict is NEEDS_RECORD:
        verdict = Verdict(False)  # this post came after a give-up, so not every post came first
    while verdict is None:
        value, expired = yield Wait(counter, "posts")
        verdict = from_counter(value, world)
        if verdict is not None or not expired:
            continue
        value = yield Add(counter, give_up)
        if value is LOST:
            continue  # read again: the give-up is in, or the read finds the verdict without it
        posts, gave = split(value, world)
        if gave == mine:  # the first give-up: it alone knows, and records what it knows
            complete = posts == everyone(world)
            verdict = Verdict(complete, posts, None if complete else rank)
            yield Add(recorded, record(verdict))
        else:
            verdict = NEEDS_RECORD if posts == everyone(world) else Verdict(False)
    if verdict.posts is not None and verdict.posts >= 0:
        return verdict
    while True:
        value, expired = yield Wait(recorded, "record")
        found = read_record(value, world)
        if found is not None:
            return found
        if expired and verdict is NEEDS_RECORD:
            raise Unrecorded
        if expired:  # abandoned all the same; only who was missing is not known
            return verdict
