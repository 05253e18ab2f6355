"""One rank's end of its tensor-parallel group's agreement: write its status at a point, post,
and read the verdict every rank reads (``verdict.py``), over Paddle's job store (``store.py``).

A point is named by what it is (``agreement.py`` derives the name alike on every rank), and its
keys live under the group's prefix: ``<point>/s<rank>`` each rank's ``messages.Posted``, written
before it posts; ``<point>/c`` the counter; ``<point>/v`` the record. Whatever is read back is
bytes from outside: a post that does not decode, names another point or claims another rank's
failure becomes that rank's failure, read alike on every rank.

``SIGINT`` is held while a rank writes and reads a point: an interrupt between the store's reply
and the code that reads it would lose a post the others count. The interrupt is handed to the
caller with the outcome (``Agreed.interrupted``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fd_cudagraph_plugin.core.ranks import verdict
from fd_cudagraph_plugin.core.ranks.messages import (
    MAX_LABEL,
    MAX_POST_BYTES,
    UNREADABLE,
    Failure,
    Posted,
    Status,
    encode,
    malformed,
    read_posted,
    text,
)
from fd_cudagraph_plugin.core.ranks.store import Store, StoreError


@dataclass(frozen=True)
class Outcome:
    """A point's verdict as every rank reads it."""

    point: str
    #: The status of each rank whose post counts, by rank.
    statuses: dict[int, Status]
    #: The label each of those ranks reached the point under.
    labels: dict[int, str]
    complete: bool = True
    #: Ranks whose post does not count (not made before the first give-up); empty when complete,
    #: and where the rank that gave up first did not record it.
    missing: tuple[int, ...] = ()
    #: The rank whose timeout ran out first, when the point was abandoned.
    gave_up: int | None = None
    #: Ranks that had left the point's call (their step failed at another of its points), with
    #: the status they left with: why they never came.
    stopped: dict[int, Status] = field(default_factory=dict)


@dataclass(frozen=True)
class Agreed:
    """A point's outcome as this rank read it, with its own label, or why it could not be read."""

    label: str
    outcome: Outcome
    #: Set when the store did not answer, or the verdict could not be learned.
    channel_failure: str = ""
    #: An interrupt reached this rank while it was at the point.
    interrupted: bool = False

    @property
    def complete(self) -> bool:
        return (
            not self.outcome.missing and self.outcome.gave_up is None and not self.channel_failure
        )

    @property
    def failures(self) -> dict[int, Failure]:
        """The failures posted, and those of ranks that left the call, by rank."""
        statuses = {**self.outcome.stopped, **self.outcome.statuses}
        return {
            rank: status.failure
            for rank, status in sorted(statuses.items())
            if status.failure is not None
        }

    def shared(self) -> list[Any]:
        """Each rank's payload, in rank order."""
        statuses = self.outcome.statuses
        return [statuses[rank].payload for rank in sorted(statuses)]


class Link(Protocol):
    """One rank's end of the agreement of its tensor-parallel group."""

    rank: int
    world: int

    def agree(self, point: str, label: str, status: Status, timeout: float) -> Agreed:
        """Post ``status`` at ``point``; return the outcome every rank reads."""

    def stop(self, point: str, label: str, status: Status) -> None:
        """This rank leaves the rest of ``point``'s call (see ``StoreLink.stop``)."""


class LocalLink:
    """A single rank: every point completes at once with this rank's status."""

    rank = 0
    world = 1

    def agree(self, point: str, label: str, status: Status, timeout: float) -> Agreed:
        return Agreed(label, Outcome(point, {0: status}, {0: label}))

    def stop(self, point: str, label: str, status: Status) -> None:
        pass


#: Longest pause between two reads of a counter: what a point may add to a rank's wait.
_MAX_PAUSE = 0.00025
#: How long a wait runs before it also watches for ranks that left the call: a failure there is
#: worth seeing at once only against a timeout of seconds.
_WATCH_AFTER = 0.02
_PLAIN = Status()


class StoreLink:
    """A rank of ``world`` agreeing through ``store`` under ``prefix`` (its group's)."""

    def __init__(self, store: Store, prefix: str, rank: int, world: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.endpoint = getattr(store, "endpoint", "in memory")
        #: Calls this rank has left (``stop``).
        self._left: set[str] = set()

    def stop(self, point: str, label: str, status: Status) -> None:
        """This rank leaves the rest of ``point``'s call: its step failed at ``point``, or the
        point did. The call's name is the first part of every point of it (``agreement.py``); a
        rank waiting at any point of that call gives up there at once, without waiting out its
        timeout, and reads ``status`` as why this rank never came. Best effort: a store that does
        not answer leaves the others to their timeout."""
        call = point.split(".", 1)[0]
        if call in self._left:
            return
        self._left.add(call)
        key = f"{self.prefix}/{call}/left"
        body = self._body(point, label, status)
        with contextlib.suppress(StoreError):
            self._retry(lambda: self.store.set(f"{key}/s{self.rank}", body))
            self.store.add(key, 1 << self.rank)  # not made again: a lost reply may have landed

    def agree(self, point: str, label: str, status: Status, timeout: float) -> Agreed:
        key = f"{self.prefix}/{point}"
        label = text(label, MAX_LABEL)
        with _interrupts_held() as interrupts:
            try:
                # A plain "ok" is not written: the post says so (most points are one).
                written = status != _PLAIN
                if written:
                    body = self._body(point, label, status)
                    self._retry(lambda: self.store.set(f"{key}/s{self.rank}", body))
                rule = verdict.point(self.rank, self.world, f"{key}/c", f"{key}/v", written)
                left = f"{self.prefix}/{point.split('.', 1)[0]}/left"
                found, counter = self._drive(rule, timeout, left, f"{key}/c")
                outcome = self._outcome(key, point, found, left, counter, label, status)
            except StoreError as error:
                failure = (
                    f"Paddle's job store at {self.endpoint} did not answer ({error}); the job "
                    f"store lives in global rank 0's process: restart the job"
                )
                return self._alone(point, label, status, failure, interrupts)
            except verdict.Unrecorded:
                failure = (
                    f"every rank posted and a rank's FD_CUDAGRAPH_RANK_TIMEOUT ran out at once, "
                    f"and the rank that gave up first did not record which came first within "
                    f"{timeout:g} s (its process stopped or lost the job store)"
                )
                return self._alone(point, label, status, failure, interrupts)
        return Agreed(label, outcome, interrupted=bool(interrupts))

    def _alone(self, point, label, status, failure, interrupts) -> Agreed:
        outcome = Outcome(point, {self.rank: status}, {self.rank: label}, complete=False)
        return Agreed(label, outcome, text(failure, 1000), bool(interrupts))

    def _body(self, point: str, label: str, status: Status) -> bytes:
        """This rank's post. One the store must not carry (too large, unencodable) becomes this
        rank's failure, so that every rank stops on it with the reason."""
        try:
            body = encode(Posted(point=point, label=label, status=status))
        except (TypeError, ValueError) as error:
            why = f"it cannot be encoded ({type(error).__name__}: {error})"
        else:
            if len(body) <= MAX_POST_BYTES:
                return body
            why = f"it is {len(body)} bytes, over {MAX_POST_BYTES}"
        failed = malformed(self.rank, label, text(why, MAX_LABEL))
        return encode(Posted(point=point, label=label, status=failed))

    def _drive(
        self, rule, timeout: float, left: str, counter: str
    ) -> tuple[verdict.Verdict, int | None]:
        """Run ``rule`` against the store; the clock here is the operator's timeout alone, and a
        rank that left the call (``left``, a bit per rank) ends a wait for posts as it would.
        Returns the verdict and the last value of ``counter`` read (None: none was)."""
        began: dict[str, float] = {}
        #: What the rule last learned of each key: a wait answers once the store holds more.
        known: dict[str, Any] = {}
        op = next(rule)
        while True:
            if isinstance(op, verdict.Add):
                try:
                    reply: Any = self.store.add(op.key, op.amount)
                except StoreError as error:
                    if not error.reconnected:
                        raise
                    reply = verdict.LOST
                known[op.key] = reply
            else:
                began.setdefault(op.phase, time.monotonic())
                watch = left if op.phase == "posts" else None
                reply = self._wait(op.key, known.get(op.key), began[op.phase], timeout, watch)
                known[op.key] = reply[0]
            try:
                op = rule.send(reply)
            except StopIteration as stop:
                return stop.value, known.get(counter)

    def _wait(
        self, key: str, known: Any, began: float, timeout: float, left: str | None
    ) -> tuple[int, bool]:
        """The value at ``key`` once it is not ``known`` (what the rule last learned of it), or
        when the timeout since ``began`` ran out, or another rank left the call (``left``); and
        whether the wait is over. What the store holds is read before the deadline is judged, so
        a rank that was stopped itself reads what happened meanwhile."""
        pause = 0.00001
        others = verdict.everyone(self.world) & ~(1 << self.rank)
        while True:
            value = self._retry(lambda: self.store.add(key, 0))
            now = time.monotonic()
            expired = now >= began + timeout
            if left is not None and not expired and now >= began + _WATCH_AFTER:
                expired = bool(self._retry(lambda: self.store.add(left, 0)) & others)
            if value != known or expired:
                return value, expired
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)

    def _retry(self, call):
        """A call that changes nothing when made twice: made again once after a reset."""
        try:
            return call()
        except StoreError as error:
            if not error.reconnected:
                raise
            return call()

    def _outcome(
        self,
        key: str,
        point: str,
        found: verdict.Verdict,
        left: str,
        counter: int | None,
        label: str,
        status: Status,
    ) -> Outcome:
        """Read the posts that count (a plain "ok" was not written), and why ranks that left the
        call never came."""
        ranks = range(self.world)
        counted = [r for r in ranks if found.posts is not None and found.posts >> r & 1]
        if counter is None or any(not counter >> r & 1 for r in counted):
            counter = self._retry(lambda: self.store.add(f"{key}/c", 0))  # a record said who
        statuses: dict[int, Status] = {}
        labels: dict[int, str] = {}
        for rank in counted:
            # This rank's own too: every rank must read the same bytes, whoever wrote them.
            if counter & verdict.written_bit(rank, self.world):
                statuses[rank], labels[rank] = self._read(f"{key}/s{rank}", point, rank)
            else:
                statuses[rank], labels[rank] = _PLAIN, label
        stopped: dict[int, Status] = {}
        if not found.complete:
            gone = self._retry(lambda: self.store.add(left, 0))
            call = point.split(".", 1)[0] + "."
            for rank in ranks:
                if rank not in counted and gone >> rank & 1:
                    stopped[rank] = self._read(f"{left}/s{rank}", call, rank)[0]
        known = not found.complete and found.posts is not None
        missing = tuple(r for r in ranks if r not in counted) if known else ()
        return Outcome(point, statuses, labels, found.complete, missing, found.giver, stopped)

    def _read(self, key: str, point: str, rank: int) -> tuple[Status, str]:
        """A post of ``rank`` and its label. One that is not what that rank may have written
        becomes its failure: every rank reads the same bytes, so the same failure. ``point``
        ending in "." names a call: a post at any point of it."""
        raw = self._retry(lambda: self.store.get(key))
        try:
            posted = read_posted(raw)
            why = _not_its(posted, point, rank)
        except UNREADABLE as error:
            posted, why = None, f"it does not decode ({error})"
        if posted is None or why:
            return malformed(rank, point, text(why, MAX_LABEL)), point
        return posted.status, posted.label


def _not_its(posted: Posted, point: str, rank: int) -> str:
    if posted.point != point and not (point.endswith(".") and posted.point.startswith(point)):
        return f"it names the point '{posted.point}'"
    failure = posted.status.failure
    if failure is not None and failure.rank != rank:
        return f"it claims a failure of rank {failure.rank}"
    return ""


@contextlib.contextmanager
def _interrupts_held() -> Iterator[list[int]]:
    """Hold ``SIGINT`` for the block when Python's default handler has it (a handler of
    FastDeploy's or the operator's is left alone); yield the signals that came meanwhile."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield held
        return
    signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
