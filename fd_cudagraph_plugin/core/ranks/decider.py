"""The rules of TP rank 0's server, apart from the transport: posts, give-ups, arrivals and
departures in, one outcome per point out, the same for every rank.

A point **completes** when every rank of the group posted at it and is still connected. It is
**abandoned** when a rank gave up at it (its ``FD_CUDAGRAPH_RANK_TIMEOUT``: the operator's clock),
a rank that had joined is gone (also where it posted: it will never join the collective after the
point), or a rank that did not post waits at another point or posted past this one (the ranks
lost step). A late rank is waited for. Decisions are taken in ``settle()``, after each batch of
messages, so a give-up read with the last post wins; a decision never changes, and a rank that
posts at a decided point gets the same outcome. Not thread-safe: one thread calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fd_cudagraph_plugin.core.ranks.messages import MAX_LABEL, BadMessage, Key, Outcome, text

#: Decided points kept for ranks that may still post at them; older ones are forgotten (a rank
#: posting at one then is past by every other, and reads the same abandonment).
KEPT = 16
#: The longest a completion waits for the server to learn whose connection closed: what
#: connections that come and go (a port scanner's, say) can add to a point, at most.
HOLD = 0.05


@dataclass
class Point:
    key: Key
    opened: float
    #: Each rank's status as posted (``Status``, or its bytes as read: the server forwards them).
    posts: dict[int, Any] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    gave_up: set[int] = field(default_factory=set)
    #: Ranks that posted and have not been given the outcome yet.
    waiting: set[int] = field(default_factory=set)
    #: When every rank had posted, while completions were held (``Decider.hold_until``).
    completable: float | None = None
    outcome: Outcome | None = None
    #: The outcome as sent: the same bytes for every rank, encoded once (``server.py``).
    body: bytes | None = None


class Decider:
    def __init__(self, world: int) -> None:
        self.world = world
        self.points: dict[Key, Point] = {}
        #: Ranks connected now.
        self.present: set[int] = set()
        #: Ranks that had joined and are gone: their connection closed, or they were dropped for
        #: what they sent (``dropped`` says why). A rank that comes back is counted again.
        self.gone: set[int] = set()
        self.dropped: dict[int, str] = {}
        #: Each rank's last post: its key and label.
        self.latest: dict[int, tuple[Key, str]] = {}
        #: The highest session epoch any rank has posted in.
        self.top = -1
        #: Until then no point completes: a connection closed, and which rank's it was is not
        #: known yet (the server probes). A point is held at most ``HOLD`` seconds.
        self.hold_until = 0.0
        self._again: list[tuple[int, Point]] = []

    # -- what happens

    def arrive(self, rank: int) -> None:
        self.present.add(rank)
        self.gone.discard(rank)
        self.dropped.pop(rank, None)

    def leave(self, rank: int, why: str = "") -> None:
        """``rank``'s connection is gone, or (``why``) it was dropped for what it sent."""
        self.present.discard(rank)
        self.gone.add(rank)
        if why:
            self.dropped[rank] = text(why, MAX_LABEL)

    def post(self, rank: int, key: Key, label: str, status: Any, now: float) -> None:
        prior = self.latest.get(rank)
        if prior is not None:
            if key < prior[0]:
                raise BadMessage(f"posted at {key} after {prior[0]}")
            before = self.points.get(prior[0])
            if key == prior[0]:  # the same post again: its connection was made again
                if before is not None and before.outcome is not None:
                    self._again.append((rank, before))
                return
            if before is not None and rank in before.waiting:
                if rank not in before.gave_up:
                    raise BadMessage(f"posted at {key} while waiting at {prior[0]}")
                before.waiting.discard(rank)  # it stopped waiting there (server was stalled)
        self.latest[rank] = (key, label)
        self.top = max(self.top, key[0])
        point = self.points.get(key)
        if point is None:
            point = self.points[key] = Point(key, now)
        point.labels[rank] = label
        if point.outcome is None:
            point.posts[rank] = status
            point.waiting.add(rank)
        else:  # late: the decision stands
            self._again.append((rank, point))

    def give_up(self, rank: int, key: Key) -> None:
        point = self.points.get(key)
        if point is not None and point.outcome is None and rank in point.waiting:
            point.gave_up.add(rank)

    # -- decisions

    def settle(self, now: float) -> list[tuple[int, Point]]:
        """Decide what can be decided; return (rank, point) for each outcome to send."""
        out, self._again = self._again, []
        undecided = [p for p in self.points.values() if p.outcome is None]
        waits_at = {rank: p.key for p in undecided for rank in p.waiting}
        everyone = set(range(self.world))
        for point in undecided:
            posted = set(point.posts)
            lost = self.gone & everyone
            elsewhere = {
                r
                for r in everyone - posted
                if (r in waits_at and waits_at[r] != point.key)
                or (r in self.latest and self.latest[r][0] > point.key)
            }
            if point.gave_up:
                point.outcome = self._decide(point, (everyone - posted) | lost, elsewhere, now)
            elif lost or elsewhere:
                # Decided now, for the ranks that posted: only the lost ones and those elsewhere
                # are at fault, not those still on their way.
                point.outcome = self._decide(point, lost | elsewhere, elsewhere, now)
            elif posted == everyone and self._released(point, now):
                point.outcome = self._decide(point, set(), set(), now)
            else:
                continue
            out += [(rank, point) for rank in sorted(point.waiting - self.gone)]
            point.waiting.clear()
        decided = [key for key, p in self.points.items() if p.outcome is not None]
        for key in decided[: max(len(decided) - KEPT, 0)]:
            del self.points[key]
        return out

    def _released(self, point: Point, now: float) -> bool:
        if now >= self.hold_until:
            return True
        if point.completable is None:
            point.completable = now
        return now >= point.completable + HOLD

    def _decide(self, point: Point, missing: set[int], elsewhere: set[int], now: float) -> Outcome:
        labels = dict(point.labels)
        for rank in elsewhere:
            labels.setdefault(rank, self.latest[rank][1])
        lost = self.gone & missing
        return Outcome(
            key=point.key,
            statuses={r: s for r, s in sorted(point.posts.items()) if r not in missing},
            labels=dict(sorted(labels.items())),
            missing=tuple(sorted(missing)),
            lost=tuple(sorted(lost)),
            gave_up=tuple(sorted(point.gave_up)),
            elsewhere=tuple(sorted(elsewhere)),
            dropped={r: self.dropped[r] for r in sorted(lost) if r in self.dropped},
            waited=round(max(now - point.opened, 0.0), 3),
            top=self.top,
        )
