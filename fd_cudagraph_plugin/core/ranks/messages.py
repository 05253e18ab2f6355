"""What ranks write in Paddle's job store at a point: one ``msgspec.Struct`` each, MessagePack.

A rank's bytes are read back by one strict typed decoder whose ``Meta`` bounds say what a rank may
write; bytes that fail become that rank's failure, read alike on every rank (``link.py``). What
types cannot say is checked where it is used: that a posted failure is the poster's own, and that
a post names the point it was read at.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

#: Largest TP group: a point's counter holds three bits per rank (posted, gave up, wrote a
#: status) in one signed 64-bit value of Paddle's store (``verdict.py``). FastDeploy's TP groups
#: are one node or two (8, 16).
MAX_RANKS = 20
#: A post's cap. The largest a session writes (test_link.py): every graph's self-check failed, or
#: a failure's longest error; one over the cap is its rank's failure, never a truncated read.
MAX_POST_BYTES = 16 << 10
MAX_LABEL = 200
MAX_TEXT = 2000

Rank = Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
Label = Annotated[str, Meta(max_length=MAX_LABEL)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Short = Annotated[str, Meta(max_length=300)]
Figure = Annotated[int, Meta(ge=0, lt=1 << 60)]
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
    #: The decode sizes this rank's traffic fits (``fit.py``); empty: FastDeploy's list.
    #: Rank 0's is what every rank captures.
    fitted: Annotated[list[Annotated[int, Meta(ge=1, le=1 << 31)]], Meta(max_length=1024)] = []


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


class Posted(Message):
    """What one rank writes at a point, before it posts: the point's name (a stale or planted
    entry names another), the label it reached it under, and its status."""

    point: Label
    label: Label
    status: Status


_POSTED = msgspec.msgpack.Decoder(Posted)
encode = msgspec.msgpack.Encoder().encode
#: What reading a rank's bytes raises: msgspec before 0.19 raises ``UnicodeDecodeError`` for text
#: that is not UTF-8.
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError)


def read_posted(raw: bytes) -> Posted:
    """A rank's post as written in the store, read strictly (``UNREADABLE`` says what is
    wrong)."""
    if len(raw) > MAX_POST_BYTES:
        raise msgspec.DecodeError(f"{len(raw)} bytes, over {MAX_POST_BYTES}")
    return _POSTED.decode(raw)


def malformed(rank: int, label: str, why: str) -> Status:
    """The status of a rank whose post the agreement cannot take (too large, unencodable, or read
    back as something that rank cannot have written): its failure, which every rank reads alike."""
    return Status(
        failure=Failure(
            rank=rank,
            stage="agreement",
            where="",
            mode="its post in Paddle's job store",
            error=text(
                f"MalformedStatus: rank {rank} posted a status at '{label}' that the agreement "
                f"does not accept ({why}); every rank must run the same fd-cudagraph-plugin",
                MAX_TEXT,
            ),
            out_of_memory=False,
            explained=True,
            advice="",
        )
    )


def text(value: object, limit: int) -> str:
    """``value`` as text this rank may send: within ``limit`` characters and encodable (an
    exception's message may hold lone surrogates, from bytes decoded with ``surrogateescape``)."""
    raw = str(value)
    if len(raw) > limit:  # the start and the end of a long message say the most
        raw = raw[: limit // 2 - 3] + " ... " + raw[-(limit - limit // 2 - 2) :]
    return raw.encode("utf-8", "replace").decode("utf-8")
