"""Every message of the ranks' agreement, each one typed class, and the one checker of them all.

What travels between tensor-parallel ranks (``channel.py`` carries it over ZeroMQ) is one of the
classes below, encoded as one JSON object per ZeroMQ message. Anything a peer sends is read with
``decode`` or ``Kind.check`` before anyone uses it: exact fields, exact types (a ``bool`` is no
``int``), integers and numbers in their range and finite, text within its length and encodable as
UTF-8 (a lone surrogate is not), lists and maps within their length, JSON within its depth. A value
that fails is a ``BadMessage`` and costs only the peer that sent it. What this rank sends is built
from its own values and bounded here too (``text``), so that a peer never refuses an honest one.

The classes, by who sends them:

* a rank to TP rank 0's server: ``Hello`` (once, with its rank), ``Post`` (its ``Status`` at a
  point: ok, a payload, or its ``Failure``), ``GiveUp`` (its wait is ending);
* the server to a rank: ``Welcome``, ``Refused``, ``Outcome`` (one per point, the same for every
  rank), ``Dropped`` (the server stopped counting this rank, and why), ``ServerFailed``;
* the payloads ranks share at points: ``PlanPayload`` (with ``Unwarmed``), ``RankMemory`` (the
  memory figures at a session's end), ``Moved`` (after a lifecycle call), a verdict text
  (``VERDICT``) and a flag (``FLAG``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

#: What the peers speak; a rank of another plugin version is refused at its hello.
PROTOCOL = 3
#: Largest TP group: FastDeploy sets no bound; none larger than a few nodes exists.
MAX_RANKS = 1024
#: The largest post: the plan point's status. 1.3 KiB for a target and an MTP draft with 36 sizes;
#: 8.5 KiB at FastDeploy's limits (512 sizes in both phases of two backends, every size
#: unwarmed). Lists over 64 entries travel as a digest (``session.backends_plan``);
#: ``tests/test_channel.py`` measures both.
MAX_POST_BYTES = 16 << 10
MAX_LABEL = 200
MAX_TEXT = 2000
#: Deepest nesting of a payload: ours nest 4 deep. Python's JSON parser shares the interpreter's
#: recursion limit, so a deeper one would parse on one rank and not on another.
MAX_DEPTH = 16
#: Keys of a point: (session epoch, point number), each below this.
MAX_KEY = 1 << 31
#: Longest integer literal read: a byte count up to 2**60 has 19 digits. Python's ``int()`` takes
#: quadratic time on long digit strings; a 400-digit one once killed the server.
_MAX_DIGITS = 20
#: Figures (bytes, seconds) are non-negative and below this.
MAX_FIGURE = 1 << 60


class BadMessage(ValueError):
    """A message that is not what the protocol allows: it costs only the peer that sent it."""


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


# -------------------------------------------------------------------------------- the checker


class Kind:
    """What one field may hold: ``check`` returns the value read, or raises ``BadMessage``
    saying what is wrong (a container adds where); ``dump`` turns this rank's value into JSON.
    Nothing is formatted on the way when the value is good: a point reads a few of these."""

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return value


def _within(where: str, error: BadMessage) -> BadMessage:
    text = str(error)
    return BadMessage(f"{where}{'' if text.startswith(('.', '[')) else ' '}{text}")


class Int(Kind):
    def __init__(self, low: int = 0, high: int = MAX_FIGURE) -> None:
        self.low, self.high = low, high

    def check(self, value: Any) -> int:
        if type(value) is not int or not self.low <= value < self.high:
            raise BadMessage(f"must be an integer in [{self.low}, {self.high})")
        return value


class Number(Kind):
    """A finite number in ``[low, high]`` (an int is one)."""

    def __init__(self, low: float = 0.0, high: float = float(MAX_FIGURE)) -> None:
        self.low, self.high = low, high

    def check(self, value: Any) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise BadMessage("must be a finite number")
        if not self.low <= value <= self.high:
            raise BadMessage(f"must lie in [{self.low:g}, {self.high:g}]")
        return value


class Bool(Kind):
    def check(self, value: Any) -> bool:
        if type(value) is not bool:
            raise BadMessage("must be true or false")
        return value


class Text(Kind):
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def check(self, value: Any) -> str:
        if type(value) is not str or len(value) > self.limit or not _encodable(value):
            raise BadMessage(f"must be UTF-8 text of at most {self.limit} characters")
        return value


class Maybe(Kind):
    """``kind``, or null."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind

    def check(self, value: Any) -> Any:
        return None if value is None else self.kind.check(value)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.kind.dump(value)


class ListOf(Kind):
    def __init__(self, kind: Kind, most: int) -> None:
        self.kind, self.most = kind, most

    def check(self, value: Any) -> list:
        if type(value) is not list or len(value) > self.most:
            raise BadMessage(f"must be a list of at most {self.most} entries")
        kind, read = self.kind, []
        for index, item in enumerate(value):
            try:
                read.append(kind.check(item))
            except BadMessage as error:
                raise _within(f"[{index}]", error) from None
        return read

    def dump(self, value: Any) -> Any:
        return [self.kind.dump(item) for item in value]


class Ranks(Kind):
    """A list of distinct ranks, ascending."""

    def check(self, value: Any) -> tuple[int, ...]:
        if type(value) is not list or len(value) > MAX_RANKS:
            raise BadMessage("must be a list of ranks")
        if any(type(r) is not int or not 0 <= r < MAX_RANKS for r in value):
            raise BadMessage("must be a list of ranks")
        if value != sorted(set(value)):
            raise BadMessage("must list distinct ranks in order")
        return tuple(value)

    def dump(self, value: Any) -> Any:
        return sorted(value)


class ByRank(Kind):
    """A map from rank (a decimal string on the wire) to ``kind``."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind

    def check(self, value: Any) -> dict[int, Any]:
        if type(value) is not dict or len(value) > MAX_RANKS:
            raise BadMessage(f"must map at most {MAX_RANKS} ranks")
        kind, found = self.kind, {}
        for raw, item in value.items():
            if not (len(raw) <= 4 and raw.isascii() and raw.isdigit()):
                raise BadMessage("must be keyed by rank")
            try:
                found[int(raw)] = kind.check(item)
            except BadMessage as error:
                raise _within(f".{raw}", error) from None
        return found

    def dump(self, value: Any) -> Any:
        return {str(rank): self.kind.dump(item) for rank, item in sorted(value.items())}


class Json(Kind):
    """Any JSON value at most ``MAX_DEPTH`` deep: what a point means is checked by the point."""

    def check(self, value: Any) -> Any:
        _check_json(value)
        return value


class Of(Kind):
    """A message class nested in another."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls

    def check(self, value: Any) -> Any:
        return self.cls.read(value)

    def dump(self, value: Any) -> Any:
        return value.to_json()


def checks(kind: Kind) -> dict[str, Kind]:
    """A message field's metadata: what it may hold (``field(metadata=checks(...))``)."""
    return {"kind": kind}


M = TypeVar("M", bound="Message")


class Message:
    """A typed message: its fields are dataclass fields declared with ``checks``."""

    #: The ``op`` a top-level message travels under; None for a nested one.
    OP: ClassVar[str | None] = None

    @classmethod
    def check(cls: type[M], raw: Any) -> M:
        """Read ``raw`` (parsed JSON from a peer) as this class: exactly its fields, each
        checked; ``op`` as well for a top-level message. ``BadMessage`` names the field."""
        try:
            return cls.read(raw)
        except BadMessage as error:
            raise _within(cls.__name__, error) from None

    @classmethod
    def read(cls: type[M], raw: Any) -> M:
        spec, expected = _spec(cls)
        if type(raw) is not dict or raw.keys() != expected:
            raise BadMessage(f"must have exactly the fields {', '.join(sorted(expected))}")
        if cls.OP and raw["op"] != cls.OP:
            raise BadMessage(f"must be a {cls.OP}")
        values = {}
        for name, kind in spec:
            try:
                values[name] = kind.check(raw[name])
            except BadMessage as error:
                raise _within(f".{name}", error) from None
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        body = {name: kind.dump(getattr(self, name)) for name, kind in _spec(type(self))[0]}
        return {"op": self.OP, **body} if self.OP else body


_SPECS: dict[type, tuple[tuple[tuple[str, Kind], ...], set[str]]] = {}


def _spec(cls: type[Message]) -> tuple[tuple[tuple[str, Kind], ...], set[str]]:
    """Each field's name and kind, and the keys a message of ``cls`` has (read once)."""
    found = _SPECS.get(cls)
    if found is None:
        spec = tuple((f.name, f.metadata["kind"]) for f in fields(cls))  # type: ignore[arg-type]
        found = _SPECS[cls] = (spec, {name for name, _ in spec} | ({"op"} if cls.OP else set()))
    return found


# ------------------------------------------------------------------------- what ranks share


@dataclass(frozen=True)
class Failure(Message):
    """What failed on one rank, worded on that rank: the error, and the advice for it."""

    rank: int = field(metadata=checks(Int(0, MAX_RANKS)))
    stage: str = field(metadata=checks(Text(100)))
    where: str = field(metadata=checks(Text(100)))
    mode: str = field(metadata=checks(Text(300)))
    error: str = field(metadata=checks(Text(MAX_TEXT)))
    out_of_memory: bool = field(metadata=checks(Bool()))
    #: The plugin's own error (capture order, configuration): it already says what to do.
    explained: bool = field(metadata=checks(Bool()))
    #: What the operator should change, as the failing rank saw it ("" when the error says it).
    advice: str = field(metadata=checks(Text(MAX_TEXT)))


@dataclass(frozen=True)
class Status(Message):
    """One rank's post at a point: ok (both None), a payload, or a failure."""

    payload: Any = field(metadata=checks(Json()), default=None)
    failure: Failure | None = field(metadata=checks(Maybe(Of(Failure))), default=None)


@dataclass(frozen=True)
class Unwarmed(Message):
    """The sizes, by phase, one backend has not warmed in this process."""

    decode: list[int] = field(metadata=checks(ListOf(Int(1, 1 << 20), 4096)))
    prefill: list[int] = field(metadata=checks(ListOf(Int(1, 1 << 20), 4096)))


@dataclass(frozen=True)
class Moved(Message):
    """What one rank found after a lifecycle call (``lifecycle.py``): what its graphs read that
    moved, and whether its model can serve (and so capture) now."""

    names: list[str] = field(metadata=checks(ListOf(Text(300), 64)))
    can_serve: bool = field(metadata=checks(Bool()))


_SCALAR = (type(None), bool, int, float, str)


class FlatPlan(Kind):
    """A plan as ranks compare it: names to scalars or lists of scalars (``session.plan_of``)."""

    def check(self, value: Any) -> dict[str, Any]:
        _check_json(value)
        if type(value) is not dict or len(value) > 512:
            raise BadMessage("must be an object of at most 512 entries")
        for name, item in value.items():
            items = item if type(item) is list else [item]
            if len(name) > MAX_LABEL or len(items) > 4096:
                raise BadMessage(f".{name[:40]} is too long")
            if any(
                type(i) not in _SCALAR or (type(i) is str and len(i) > MAX_LABEL) for i in items
            ):
                raise BadMessage(f".{name[:40]} must be a scalar or a list of scalars")
        return value


@dataclass(frozen=True)
class PlanPayload(Message):
    """What each rank shares at a session's ``plan`` point."""

    plan: dict[str, Any] = field(metadata=checks(FlatPlan()))
    unwarmed: list[Unwarmed] = field(metadata=checks(ListOf(Of(Unwarmed), 16)))


@dataclass(frozen=True)
class RankMemory(Message):
    """One rank's memory after a capture session, as every rank shares it at the session end."""

    rank: int = field(metadata=checks(Int(0, MAX_RANKS)))
    #: What this session's graphs took (the plugin's own count, per capture).
    graph_bytes: int = field(metadata=checks(Int()))
    #: What the session took of the device as the driver counts it, from before its first
    #: warm-up to its end: the graphs, and what the warm-ups and captures leave behind outside
    #: them (allocator blocks cached from the warm-ups, the capture stream's library
    #: workspaces, the graphs' own driver allocations). This, not ``graph_bytes``, is what must
    #: fit beside the KV cache: 262 MiB where the graphs took 108 MiB (the harness's toy on an
    #: H200, benchmarks/gpu). ``graph_bytes`` where the driver cannot say.
    taken_bytes: int = field(metadata=checks(Int()))
    #: The driver's free and total memory after the session.
    free: int = field(metadata=checks(Int()))
    total: int = field(metadata=checks(Int()))
    utilization: float | None = field(metadata=checks(Maybe(Number(1e-9, 1.0))))
    #: The figures are of the simulated runtime's device (tests, the demo), not a GPU.
    simulated: bool = field(metadata=checks(Bool()), default=False)


#: A point's verdict: None (fine), or why not (the static probe, the self-check).
VERDICT: Kind = Maybe(Text(MAX_TEXT))
#: A yes or no every rank shares (whether any rank lacks its graph-memory record).
FLAG: Kind = Bool()


# ---------------------------------------------------------------------------- the protocol


@dataclass(frozen=True)
class Hello(Message):
    OP = "hello"
    protocol: int = field(metadata=checks(Int(0, 1 << 16)))
    rank: int = field(metadata=checks(Int(0, MAX_RANKS)))


@dataclass(frozen=True)
class Welcome(Message):
    OP = "welcome"


@dataclass(frozen=True)
class Refused(Message):
    OP = "refused"
    why: str = field(metadata=checks(Text(MAX_LABEL)))


class Key(Kind):
    """A point's key: (session epoch, point number)."""

    def check(self, value: Any) -> tuple[int, int]:
        if (
            type(value) is not list
            or len(value) != 2
            or not all(type(v) is int and 0 <= v < MAX_KEY for v in value)
        ):
            raise BadMessage("must be [epoch, point], each an integer in [0, 2**31)")
        return value[0], value[1]

    def dump(self, value: Any) -> Any:
        return list(value)


@dataclass(frozen=True)
class Post(Message):
    OP = "post"
    key: tuple[int, int] = field(metadata=checks(Key()))
    label: str = field(metadata=checks(Text(MAX_LABEL)))
    #: Seconds this rank waits for the outcome: the server decides for it before then.
    timeout: float = field(metadata=checks(Number(1e-3, 86400.0)))
    status: Status = field(metadata=checks(Of(Status)))


@dataclass(frozen=True)
class GiveUp(Message):
    OP = "give_up"
    key: tuple[int, int] = field(metadata=checks(Key()))


@dataclass(frozen=True)
class Outcome(Message):
    """What every rank learns at one point, decided once by the server."""

    OP = "outcome"
    key: tuple[int, int] = field(metadata=checks(Key()))
    #: Each rank's status, by rank; ranks that never posted are absent.
    statuses: dict[int, Status] = field(metadata=checks(ByRank(Of(Status))))
    #: The label each rank posted with, by rank.
    labels: dict[int, str] = field(metadata=checks(ByRank(Text(MAX_LABEL))), default_factory=dict)
    #: Ranks that did not post, or whose connection dropped before the point was decided:
    #: empty when the point completed.
    missing: tuple[int, ...] = field(metadata=checks(Ranks()), default=())
    #: Of ``missing``: ranks whose connection dropped (their process exited).
    lost: tuple[int, ...] = field(metadata=checks(Ranks()), default=())
    #: Ranks whose give-up (their FD_CUDAGRAPH_RANK_TIMEOUT ran out) abandoned the point.
    gave_up: tuple[int, ...] = field(metadata=checks(Ranks()), default=())
    #: Of ``lost``: ranks the server dropped for what they sent, with why.
    dropped: dict[int, str] = field(metadata=checks(ByRank(Text(MAX_LABEL))), default_factory=dict)
    #: Seconds the point was open on the server before it was decided (the first post to the
    #: decision): how long the ranks that posted waited for the missing ones.
    waited: float = field(metadata=checks(Number()), default=0.0)

    def fits(self, world: int) -> bool:
        """Every rank it names is one of ``world``."""
        named = [*self.statuses, *self.labels, *self.missing, *self.lost, *self.gave_up]
        return all(r < world for r in [*named, *self.dropped])


@dataclass(frozen=True)
class Dropped(Message):
    """The server stopped counting this rank: its connection dropped, or it sent what the
    protocol does not allow. Every later point of this rank fails with ``why``."""

    OP = "dropped"
    why: str = field(metadata=checks(Text(MAX_LABEL)))


@dataclass(frozen=True)
class ServerFailed(Message):
    OP = "failed"
    why: str = field(metadata=checks(Text(MAX_TEXT)))


TO_SERVER: tuple[type[Message], ...] = (Hello, Post, GiveUp)
TO_RANK: tuple[type[Message], ...] = (Welcome, Refused, Outcome, Dropped, ServerFailed)


# ------------------------------------------------------------------------------ encoding


def encode(message: Message) -> bytes:
    """Compact UTF-8 JSON (not ASCII escapes, which can grow a text six times). Raises
    ``ValueError`` for what no peer would accept (NaN, unencodable text)."""
    try:
        return json.dumps(
            message.to_json(), separators=(",", ":"), allow_nan=False, ensure_ascii=False
        ).encode("utf-8")
    except (UnicodeEncodeError, RecursionError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from None


def decode(data: bytes, allowed: tuple[type[Message], ...], most: int) -> Message:
    """A peer's message, checked whole, as one of ``allowed``."""
    if len(data) > most:
        raise BadMessage(f"a message of {len(data)} bytes (at most {most})")
    raw = parse(data)
    if type(raw) is not dict or type(raw.get("op")) is not str:
        raise BadMessage("a message must be a JSON object with its op")
    for cls in allowed:
        if raw["op"] == cls.OP:
            return cls.check(raw)
    raise BadMessage(f"unknown op {raw['op'][:40]!r}")


def parse(data: bytes) -> Any:
    """JSON as a peer sent it: UTF-8, no NaN or infinity, no over-long integer literal. What it
    holds is for a ``Kind`` to check: a number that overflowed to infinity (``1e999``), a lone
    surrogate escaped in a text, a payload too deep are that field's fault, not the message's."""
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
        )
    except (ValueError, RecursionError) as error:
        raise BadMessage(f"not JSON ({type(error).__name__})") from None
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded_int(literal: str) -> int:
    if len(literal) > _MAX_DIGITS:
        raise ValueError("an integer literal too long")
    return int(literal)


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_json(value: Any) -> None:
    """At most ``MAX_DEPTH`` deep, every text encodable, every number finite; walked without
    recursion (a value may be arbitrarily deep)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is dict or kind is list:
            if depth > MAX_DEPTH:
                raise BadMessage(f"nests more than {MAX_DEPTH} deep")
            if kind is dict:
                if not all(_encodable(k) for k in item):
                    raise BadMessage("holds a key that is not UTF-8 text")
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif kind is str:
            if not _encodable(item):
                raise BadMessage("holds text that is not UTF-8")
        elif kind is float:
            if not math.isfinite(item):
                raise BadMessage("holds a number that is not finite")
        elif kind is int:
            if abs(item) >= 1 << 64:
                raise BadMessage("holds an integer out of range")
        elif kind not in (bool, type(None)):
            raise BadMessage(f"holds a {kind.__name__}, which JSON has not")
