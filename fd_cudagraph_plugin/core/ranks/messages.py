"""Every message of the ranks' agreement: one ``msgspec.Struct`` each, encoded as MessagePack.

A peer's bytes are read by one strict typed decoder per direction (``TO_SERVER``, ``TO_RANK``)
whose ``Meta`` bounds say what a peer may send; one that fails costs only the peer that sent it.
What types cannot say is checked where it is used: that a posted failure is the poster's own
(``server.py``), that an outcome names only ranks of the group (``Outcome.fits``), that a message
has at most ``MAX_PARTS`` parts.

A rank sends ``Hello``, ``Post`` and ``GiveUp``; the server ``Welcome``, ``Refused``, ``Outcome``
(the same bytes for every rank), ``Ping`` and ``ServerFailed``; ranks share a ``Payload`` at
points.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Raw, Struct

#: What the peers speak; a rank of another plugin version is refused at its hello.
PROTOCOL = 4
#: Largest TP group: FastDeploy sets no bound; none larger than a few nodes exists.
MAX_RANKS = 1024
#: The largest post, the plan point's (``tests/test_channel.py`` measures it).
MAX_POST_BYTES = 16 << 10
MAX_LABEL = 200
MAX_TEXT = 2000
#: Parts of one message: a rank's DEALER sends one, which the server's ROUTER reads after the
#: sender's routing id. libzmq bounds each part's bytes (``MAXMSGSIZE``), never their number.
MAX_PARTS = 2

Rank = Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
Label = Annotated[str, Meta(max_length=MAX_LABEL)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Short = Annotated[str, Meta(max_length=300)]
Index = Annotated[int, Meta(ge=0, lt=1 << 31)]
#: A point: (session epoch, point number in it).
Key = tuple[Index, Index]
Figure = Annotated[int, Meta(ge=0, lt=1 << 60)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]
Ranks = Annotated[tuple[Rank, ...], Meta(max_length=MAX_RANKS)]
Sizes = Annotated[list[Annotated[int, Meta(ge=1, lt=1 << 20)]], Meta(max_length=4096)]
Scalar = None | bool | int | float | Label


class Message(Struct, frozen=True, forbid_unknown_fields=True):
    """A message's fields are exactly those declared; a field a peer adds is refused."""


# ------------------------------------------------------------------------- what ranks share


class Failure(Message):
    """What failed on one rank, worded on that rank: the error, and the advice for it."""

    rank: Rank
    stage: Annotated[str, Meta(max_length=100)]
    where: Annotated[str, Meta(max_length=100)]
    mode: Short
    error: Text
    out_of_memory: bool
    #: The plugin's own error (capture order, configuration): it already says what to do.
    explained: bool
    #: What the operator should change, as the failing rank saw it ("" when the error says it).
    advice: Text


class Unwarmed(Message):
    """The sizes, by phase, one backend has not warmed in this process."""

    decode: Sizes
    prefill: Sizes


class PlanPayload(Message, tag=True):
    """What each rank shares at a session's ``plan`` point: what must be equal on every rank
    (``session.plan_of``) and what it has not warmed."""

    plan: Annotated[
        dict[Label, Scalar | Annotated[list[Scalar], Meta(max_length=4096)]],
        Meta(max_length=512),
    ]
    unwarmed: Annotated[list[Unwarmed], Meta(max_length=16)]


class RankMemory(Message, tag=True):
    """One rank's memory after a capture session, as every rank shares it at the session end."""

    rank: Rank
    #: What this session's graphs took (the plugin's own count, per capture).
    graph_bytes: Figure
    #: What the session took of the device as the driver counts it, from before its first
    #: warm-up to its end: the graphs, and what the warm-ups and captures leave outside them
    #: (cached allocator blocks, library workspaces, the graphs' own driver allocations). This,
    #: not ``graph_bytes``, must fit beside the KV cache. ``graph_bytes`` where the driver
    #: cannot say.
    taken_bytes: Figure
    #: The driver's free and total memory after the session.
    free: Figure
    total: Figure
    utilization: Annotated[float, Meta(gt=0.0, le=1.0)] | None
    #: The figures are of the simulated runtime's device (tests, the demo), not a GPU.
    simulated: bool = False


class Moved(Message, tag=True):
    """What one rank found after a lifecycle call (``lifecycle.py``): what its graphs read that
    moved, and whether its model can serve (and so capture) now."""

    names: Annotated[list[Short], Meta(max_length=64)]
    can_serve: bool


class SelfChecks(Message, tag=True):
    """One rank's self-check of the graphs a session registered: the failed ones, by graph."""

    failed: Annotated[dict[Label, Text], Meta(max_length=4096)]


#: What a rank may share at a point; each point reads the one type it expects.
Payload = PlanPayload | RankMemory | Moved | SelfChecks | Text | bool | None


class Status(Message):
    """One rank's post at a point: ok (both None), a payload, or a failure."""

    payload: Payload = None
    failure: Failure | None = None


# ------------------------------------------------------------------------------ the protocol


class Hello(Message, tag=True):
    protocol: Annotated[int, Meta(ge=0, lt=1 << 16)]
    rank: Rank
    #: Which launch of which group this rank belongs to (``join.group_id``): a server of another
    #: one (an older group's, still alive) refuses it.
    group: Label = ""


class Welcome(Message, tag=True):
    pass


class Refused(Message, tag=True):
    why: Label


class Post(Message, tag=True):
    key: Key
    label: Label
    status: Status


class GiveUp(Message, tag=True):
    key: Key


class Outcome(Message, tag=True):
    """What every rank learns at one point, decided once by the server."""

    key: Key
    #: Each rank's status, by rank; ranks whose post does not count are absent.
    statuses: Annotated[dict[Rank, Status], Meta(max_length=MAX_RANKS)]
    #: The label each rank posted with at this point, or, for a rank waiting at another point
    #: at the decision, the label it waits under.
    labels: Annotated[dict[Rank, Label], Meta(max_length=MAX_RANKS)] = {}
    #: Ranks whose post does not count: not made, or made by a rank lost since. Empty when the
    #: point completed.
    missing: Ranks = ()
    #: Of ``missing``: ranks whose connection closed (the process exited), or dropped.
    lost: Ranks = ()
    #: Ranks whose ``FD_CUDAGRAPH_RANK_TIMEOUT`` ran out at this point before it was decided.
    gave_up: Ranks = ()
    #: Of ``missing``: ranks waiting at another point, or already past this one: the ranks have
    #: lost step (``labels`` says where each is).
    elsewhere: Ranks = ()
    #: Of ``lost``: ranks the server dropped for what they sent, with why.
    dropped: Annotated[dict[Rank, Label], Meta(max_length=MAX_RANKS)] = {}
    #: Seconds from the first post at this point to its decision.
    waited: Seconds = 0.0
    #: The highest session epoch any rank had reached at the decision: after a point the ranks
    #: met at different epochs, every rank's next session starts after it (``link.next_epoch``).
    top: Annotated[int, Meta(ge=-1, lt=1 << 31)] = -1

    def fits(self, world: int) -> bool:
        """Every rank it names is one of ``world``."""
        named = [*self.statuses, *self.labels, *self.missing, *self.lost, *self.gave_up]
        return all(r < world for r in [*named, *self.elsewhere, *self.dropped])


class Ping(Message, tag=True):
    """The server's probe of a connection (``server.py``); a rank reads and ignores it."""


class ServerFailed(Message, tag=True):
    why: Text


class _PostIn(Message, tag="Post"):
    """A post as the server reads it: its status is read apart (``read_status``), so that one a
    rank cannot have meant becomes that rank's failure rather than a dropped connection."""

    key: Key
    label: Label
    status: Raw


#: What the server reads, and what a rank reads.
TO_SERVER = msgspec.msgpack.Decoder(Hello | _PostIn | GiveUp)
TO_RANK = msgspec.msgpack.Decoder(Welcome | Refused | Outcome | Ping | ServerFailed)
_STATUS = msgspec.msgpack.Decoder(Status)
encode = msgspec.msgpack.Encoder().encode
BadMessage = msgspec.DecodeError
#: What reading a peer's bytes raises: msgspec before 0.19 raises ``UnicodeDecodeError`` for
#: text that is not UTF-8 (it killed this server's thread in a test with msgspec 0.18).
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError)


def read_status(raw: Raw) -> Status:
    """A posted status, read strictly; ``BadMessage`` says what is wrong."""
    return _STATUS.decode(raw)


def malformed(rank: int, label: str, why: str) -> Status:
    """The status of a rank whose own post the channel would not carry (too large, or not a
    status): its failure, which every rank reads alike."""
    return Status(
        failure=Failure(
            rank=rank,
            stage="agreement",
            where="",
            mode="the agreement channel",
            error=text(
                f"MalformedStatus: rank {rank} posted a status at '{label}' that the channel "
                f"does not accept ({why}); every rank must run the same fd-cudagraph-plugin",
                MAX_TEXT,
            ),
            out_of_memory=False,
            explained=True,
            advice="",
        )
    )


def max_message_bytes(world: int) -> int:
    """The largest message a rank may receive: an outcome holds every rank's post."""
    return world * (MAX_POST_BYTES + 2 * MAX_LABEL) + 4096


def text(value: object, limit: int) -> str:
    """``value`` as text this rank may send: within ``limit`` characters and encodable (an
    exception's message may hold lone surrogates, from bytes decoded with ``surrogateescape``)."""
    raw = str(value)
    if len(raw) > limit:  # the start and the end of a long message say the most
        raw = raw[: limit // 2 - 3] + " ... " + raw[-(limit - limit // 2 - 2) :]
    return raw.encode("utf-8", "replace").decode("utf-8")
