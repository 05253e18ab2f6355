"""The agreement channel's wire: frames, their limits, and what a valid message is.

A message is a JSON object in a frame (a 4-byte big-endian length, then the body). Every field a
peer sends is checked here before anyone reads it (``check_status``, ``check_outcome``): a message
that is not what the protocol allows is a ``BadMessage``, and costs only the connection it came on
(``channel.py``). A rank's own status that the channel would refuse (too large, not JSON) becomes
that rank's failure (``post_frame``), so every rank stops on it with the reason.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

PROTOCOL = 2
_HEADER = struct.Struct("!I")
#: A hello is small; anything longer is not one of ours.
MAX_HELLO_BYTES = 256
#: The largest post: the plan point's status. 1.3 KiB for a target and an MTP draft with 36 sizes;
#: 8.5 KiB at FastDeploy's limits (512 sizes in both phases of two backends, every size unwarmed).
#: Lists over 64 entries travel as a digest (``fingerprint.compact``); ``tests/test_channel.py``
#: measures both.
MAX_POST_BYTES = 16 << 10
MAX_LABEL = 200
MAX_TEXT = 2000
#: Deepest nesting of a status: ours nest 4 deep. Python's JSON parser shares the interpreter's
#: recursion limit, so a deeper one would parse on one rank and not on another.
MAX_DEPTH = 16
#: Keys of a point: (session epoch, point number), each below this.
MAX_KEY = 1 << 31


def max_reply_bytes(world: int) -> int:
    """An outcome holds every rank's post."""
    return world * (MAX_POST_BYTES + 2 * MAX_LABEL) + 4096


@dataclass(frozen=True)
class Outcome:
    """What every rank learns at one agreement point."""

    label: str
    #: Each rank's posted status (None for "ok"), by rank; ranks that never posted are absent.
    statuses: dict[int, dict[str, Any] | None]
    #: Ranks that did not post: empty when the point completed.
    missing: tuple[int, ...] = ()
    #: Of ``missing``: ranks whose connection dropped (their process exited).
    lost: tuple[int, ...] = ()
    #: The label each rank posted with, by rank.
    labels: dict[int, str] = field(default_factory=dict)
    #: Ranks whose give-up (their FD_CUDAGRAPH_RANK_TIMEOUT ran out) abandoned the point.
    gave_up: tuple[int, ...] = ()
    #: Set when the channel itself failed: the server stopped, did not answer, or sent garbage.
    channel_failure: str = ""
    #: Of ``lost``: ranks the server dropped for what they sent, with why.
    dropped: dict[int, str] = field(default_factory=dict)
    #: Seconds the point was open on the server before it was decided (the first post to the
    #: decision): how long the ranks that posted waited for the missing ones.
    open_seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.missing and not self.gave_up and not self.channel_failure

    @property
    def failures(self) -> dict[int, dict[str, Any]]:
        """The failures posted, by rank (a status ``{"failure": {...}}``)."""
        return {
            rank: status["failure"]
            for rank, status in sorted(self.statuses.items())
            if status and "failure" in status
        }

    def shared(self) -> list[Any]:
        """Each rank's payload (a status ``{"payload": ...}``), in rank order."""
        return [(self.statuses.get(r) or {}).get("payload") for r in sorted(self.statuses)]


class BadMessage(ValueError):
    """A message that is not what the protocol allows: its connection is dropped."""


def _int(value: Any, name: str, low: int = 0, high: int = MAX_KEY) -> int:
    if type(value) is not int or not low <= value < high:
        raise BadMessage(f"{name} must be an integer in [{low}, {high})")
    return value


def text_field(value: Any, name: str, limit: int = MAX_TEXT) -> str:
    if type(value) is not str or len(value) > limit:
        raise BadMessage(f"{name} must be a string of at most {limit} characters")
    return value


def parse_key(value: Any) -> tuple[int, int]:
    if type(value) is not list or len(value) != 2:
        raise BadMessage("key must be [epoch, point]")
    return _int(value[0], "key[0]"), _int(value[1], "key[1]")


_FAILURE_FIELDS = {
    "rank": int,
    "stage": str,
    "where": str,
    "mode": str,
    "error": str,
    "out_of_memory": bool,
    "explained": bool,
}
_MEMORY_FIELDS = {
    "captured_bytes": (int,),
    "graphs_done": (int,),
    "graphs_planned": (int,),
    "free": (int, type(None)),
    "total": (int, type(None)),
    "utilization": (float, int, type(None)),
    "kv_reserve": (str,),
}


def check_status(status: Any, world: int) -> dict[str, Any] | None:
    """A posted status: None, ``{"payload": <JSON>}`` or ``{"failure": {...}}`` with exactly
    the fields ``agreement.py`` writes, at most ``MAX_DEPTH`` deep and re-encoded within
    ``MAX_POST_BYTES``. What a payload means is checked by the point that reads it."""
    if status is None:
        return None
    if _depth(status) > MAX_DEPTH:
        raise BadMessage(f"nested more than {MAX_DEPTH} deep")
    if len(encode(status)) > MAX_POST_BYTES:
        raise BadMessage(f"more than {MAX_POST_BYTES} bytes")
    if type(status) is not dict or len(status) != 1:
        raise BadMessage("status must be null, {payload} or {failure}")
    if "payload" in status:
        return status
    failure = status.get("failure")
    if type(failure) is not dict or not set(_FAILURE_FIELDS) <= set(failure) <= {
        *_FAILURE_FIELDS,
        "memory",
    }:
        raise BadMessage("failure must have exactly the fields " + ", ".join(_FAILURE_FIELDS))
    for name, kind in _FAILURE_FIELDS.items():
        if type(failure[name]) is not kind:
            raise BadMessage(f"failure.{name} must be {kind.__name__}")
        if kind is str:
            text_field(failure[name], f"failure.{name}")
    _int(failure["rank"], "failure.rank", 0, world)
    memory = failure.get("memory")
    if memory is not None:
        if type(memory) is not dict or set(memory) != set(_MEMORY_FIELDS):
            raise BadMessage("failure.memory has the wrong fields")
        for name, kinds in _MEMORY_FIELDS.items():
            value = memory[name]
            if type(value) not in kinds or (type(value) in (int, float) and not _sane(value)):
                raise BadMessage(f"failure.memory.{name} is out of range")
            if type(value) is str:
                text_field(value, f"failure.memory.{name}", MAX_LABEL)
    return status


def malformed_status(rank: int, label: str, why: str) -> dict[str, Any]:
    return {
        "failure": {
            "rank": rank,
            "stage": "agreement",
            "where": "",
            "mode": "the agreement channel",
            "error": f"MalformedStatus: rank {rank} posted a status at '{label}' that the "
            f"channel does not accept ({why}); every rank must run the same fd-cudagraph-plugin",
            "out_of_memory": False,
            "explained": True,
        }
    }


def _sane(value: float) -> bool:
    if type(value) is int:  # math.isfinite overflows on an int past a float's range
        return 0 <= value < 1 << 60
    return math.isfinite(value) and 0 <= value < 1 << 60


def _depth(value: Any) -> int:
    """How deep ``value`` nests, counted without recursion (it may be arbitrarily deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def check_outcome(message: dict[str, Any], world: int) -> Outcome:
    """A reply of the server, checked as strictly as the server checks posts."""
    ranks = range(world)

    def rank_list(name: str) -> tuple[int, ...]:
        value = message.get(name)
        if type(value) is not list or any(type(r) is not int or r not in ranks for r in value):
            raise BadMessage(f"outcome.{name} must be a list of ranks")
        return tuple(value)

    statuses, labels, dropped = (
        message.get("statuses"),
        message.get("labels"),
        message.get("dropped"),
    )
    if type(statuses) is not dict or type(labels) is not dict or type(dropped) is not dict:
        raise BadMessage("outcome.statuses, labels and dropped must be objects")
    by_rank: dict[int, Any] = {}
    for raw, status in statuses.items():
        if not raw.isdigit() or int(raw) not in ranks:
            raise BadMessage("outcome.statuses must be keyed by rank")
        by_rank[int(raw)] = check_status(status, world)
    label_of = {}
    for raw, label in labels.items():
        if not raw.isdigit() or int(raw) not in ranks:
            raise BadMessage("outcome.labels must be keyed by rank")
        label_of[int(raw)] = text_field(label, "label", MAX_LABEL)
    why_dropped = {}
    for raw, why in dropped.items():
        if not raw.isdigit() or int(raw) not in ranks:
            raise BadMessage("outcome.dropped must be keyed by rank")
        why_dropped[int(raw)] = text_field(why, "dropped", MAX_LABEL)
    waited = message.get("waited")
    if type(waited) not in (int, float) or not _sane(waited):
        raise BadMessage("outcome.waited must be a number of seconds")
    return Outcome(
        label="",
        statuses=by_rank,
        missing=rank_list("missing"),
        lost=rank_list("lost"),
        labels=label_of,
        gave_up=rank_list("gave_up"),
        dropped=why_dropped,
        open_seconds=float(waited),
    )


def encode(message: Any) -> bytes:
    """The body of a frame: compact UTF-8 JSON (not ASCII escapes, which can grow a text six
    times), no NaN or infinity."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def frame(message: dict[str, Any]) -> bytes:
    body = encode(message)
    return _HEADER.pack(len(body)) + body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def take_frame(buffer: bytearray, cap: int) -> Any:
    """The message at the front of ``buffer`` (consumed), or ``INCOMPLETE``; BadMessage for a
    frame longer than ``cap`` or a body that is not JSON."""
    if len(buffer) < _HEADER.size:
        return INCOMPLETE
    (size,) = _HEADER.unpack_from(buffer)
    if size > cap:
        raise BadMessage(f"a frame of {size} bytes (at most {cap})")
    if len(buffer) < _HEADER.size + size:
        return INCOMPLETE
    body = bytes(buffer[_HEADER.size : _HEADER.size + size])
    del buffer[: _HEADER.size + size]
    try:
        return json.loads(body, parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, RecursionError) as error:
        raise BadMessage(f"not JSON ({type(error).__name__})") from None


INCOMPLETE = object()


def post_frame(key: list[int], label: str, status: Any, rank: int, timeout: float) -> bytes:
    """A post's frame, with the seconds this rank waits for the outcome. A status the channel
    would refuse (too large, not JSON) becomes this rank's failure, so that every rank stops on
    it with the reason."""
    label = label[:MAX_LABEL]
    post = {"op": "post", "key": key, "label": label, "timeout": timeout}
    try:
        framed = frame({**post, "status": status})
    except (TypeError, ValueError) as error:
        why = f"it is not JSON ({type(error).__name__}: {error})"
    else:
        if len(framed) - _HEADER.size <= MAX_POST_BYTES:
            return framed
        why = f"it is {len(framed) - _HEADER.size} bytes, over the channel's {MAX_POST_BYTES}"
    return frame({**post, "status": malformed_status(rank, label, why[:MAX_LABEL])})
