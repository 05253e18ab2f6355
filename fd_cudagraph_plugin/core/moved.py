"""Where a backend's graphs read their memory, and whether it moved since they were captured.

A CUDA graph reads fixed device addresses. FastDeploy's lifecycle (``sleep``, ``wakeup``, the RL
weight updates, deterministic mode's reset after capture) frees and re-makes some of what a decode
graph reads: the weights, the KV cache, ``rope_emb``, the MTP draft's inputs. It recaptures on some
of those paths only, so a graph could replay against freed memory.

A ``Fingerprint`` is taken when a capture session ends: the data pointer of each
parameter of the decorated layer, of each runner buffer that a graph was captured reading (a
tensor of ``share_inputs`` or the draft's ``model_inputs`` whose address a graph's inputs had:
the KV caches, ``rope_emb``, the input ids; matched by address because ``forward_meta`` is a new
object at every step), and which custom all-reduce instance the graphs registered with. It is
never taken or compared on the replay path; ``lifecycle.py`` compares it after every lifecycle
call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

#: (name, data pointer) of one tensor a graph reads; a pointer of 0 is a freed tensor. Shapes
#: are not compared: a runner may hand the model a view of another length at each step.
Place = tuple[str, int]


@dataclass(frozen=True)
class Fingerprint:
    """What one backend's graphs read, where (see the module's docstring)."""

    params: tuple[Place, ...]
    buffers: tuple[Place, ...]
    #: ``id()`` of the custom all-reduce instance at capture (None: there is none).
    allreduce: int | None = None

    def moved(self, now: Fingerprint) -> list[str]:
        """Names of what is not where it was (a different address, or gone)."""
        found = _differ(self.params, now.params) + _differ(self.buffers, now.buffers)
        if self.allreduce != now.allreduce:
            found.append("the custom all-reduce instance")
        return found


def _differ(before: tuple[Place, ...], now: tuple[Place, ...]) -> list[str]:
    current = dict(now)
    return [name for name, pointer in before if current.get(name) != pointer]


def at_capture(
    layer: Any, buffers: Iterable[tuple[str, Any]], read: Iterable[tuple[str, int]], allreduce: Any
) -> Fingerprint:
    """The fingerprint of graphs just captured: ``read`` holds the input addresses the graphs
    were captured with; the runner ``buffers`` at one of them are what the graphs read."""
    pointers = {pointer for _, pointer in read if pointer}
    return Fingerprint(
        _parameters(layer),
        tuple((name, p) for name, t in buffers if (p := _pointer(t)) in pointers),
        _identity(allreduce),
    )


def now(
    before: Fingerprint, layer: Any, buffers: Iterable[tuple[str, Any]], allreduce: Any
) -> Fingerprint:
    """Where what ``before`` names is now (a buffer that is gone is left out: it shows as
    moved)."""
    wanted = {name for name, _ in before.buffers}
    return Fingerprint(
        _parameters(layer),
        tuple((name, _pointer(t)) for name, t in buffers if name in wanted),
        _identity(allreduce),
    )


def _parameters(layer: Any) -> tuple[Place, ...]:
    named = getattr(layer, "named_parameters", None)
    if named is None:
        return ()
    return tuple((name, _pointer(p)) for name, p in named())


def _pointer(tensor: Any) -> int:
    try:
        return int(tensor.data_ptr())
    except Exception:  # a tensor whose memory was released (Paddle's _clear_data) has none
        return 0


def _identity(allreduce: Any) -> int | None:
    return id(allreduce) if allreduce is not None else None


def summary(names: list[str], most: int = 3) -> str:
    """``names`` for a log line: the first few, then how many more."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def tensors_in(prefix: str, holder: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of every tensor, and every tensor of a list or tuple, that ``holder``
    (a dict, or an object such as FastDeploy's ``InputBatch``) holds."""
    if holder is None:
        return
    items = holder.items() if isinstance(holder, dict) else vars(holder).items()
    for name, value in list(items):
        if _is_tensor(value):
            yield f"{prefix}{name}", value
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if _is_tensor(item):
                    yield f"{prefix}{name}[{index}]", item


def _is_tensor(value: Any) -> bool:
    # Asked of the type: a config object that answers any attribute is not a tensor.
    return callable(getattr(type(value), "data_ptr", None))


__all__ = ["Fingerprint", "Place", "at_capture", "now", "summary", "tensors_in"]
