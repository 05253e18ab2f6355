"""Custom all-reduce stand-ins. The real one needs CUDA IPC; ``CustomAllreduce`` here is
uninitialised unless a test says otherwise (as upstream with one rank or no IPC ops), and
``RecordingCustomAllreduce`` is an initialised one on a single simulated rank that records what a
test needs.

What is modelled from upstream (``custom_all_reduce.py``, the same on 2.4 through develop):

* ``start_capture()`` sets ``capturing``; ``stop_capture()`` clears it and registers; the
  ``capture()`` context does both, registering in ``finally``, so also when the body raised;
* ``register_graph_buffers()`` is an ``all_gather_object`` over the TP group (a real collective
  when the group is a ``paddle.distributed`` group), then registers every all-reduce captured
  since the last registration in the next registration slots, in order (``all_reduce.cuh``);
* ``clear_ipc_handles()`` closes every graph buffer IPC handle of the process and rewinds the
  slots (2.5 on), so the next registrations overwrite the old ones: every graph registered before
  is stale, whichever backend captured it;
* ``custom_all_reduce(x)`` while ``capturing``: a real reduce when a stream capture is running,
  else ``empty_like(x)``, i.e. garbage. Here the garbage is NaN, so a test notices it, and so is the
  result of a replayed all-reduce whose registration is gone (upstream: stale peer buffers or an
  illegal memory access); ``stale_replays`` counts those. On one rank the real reduce is the
  identity (a copy, as the op is out-of-place).

"A stream capture is running" is ``cudaStreamIsCapturing`` upstream; here it is the plugin's
simulated runtime's ``capturing`` flag, and the graph a replay belongs to is its ``in_flight``
id (replace ``stream_is_capturing`` / ``graph_in_flight`` to couple to something else).
Paddle-managed (dy2st) captures are not seen by them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _simulated_runtime() -> Any:
    try:
        from fd_cudagraph_plugin.core import runtime
    except ImportError:
        return None
    return runtime.get_runtime("simulated")


def _simulated_runtime_is_capturing() -> bool:
    return bool(getattr(_simulated_runtime(), "capturing", False))


def _simulated_graph_in_flight() -> int | None:
    return getattr(_simulated_runtime(), "in_flight", None)


#: Hooks: True while a (simulated) CUDA stream capture runs; the id of the graph being captured
#: or replayed, else None.
stream_is_capturing = _simulated_runtime_is_capturing
graph_in_flight = _simulated_graph_in_flight


class CustomAllreduce:
    def __init__(
        self, group: Any = None, max_size: int = 8192 * 1024, *, initialized: bool = False
    ) -> None:
        self.capturing = False
        self.group = group
        self.max_size = max_size
        self._initialized = initialized
        self._next_slot = 0
        #: slot -> (graph id, index of the all-reduce in that graph)
        self._slots: dict[int, tuple[int, int]] = {}
        #: graph id -> its slots, in call order
        self._graph_slots: dict[int, list[int]] = {}
        #: graph id -> all-reduces captured in it
        self._captured_calls: dict[int, int] = {}
        #: graph id -> all-reduces seen in its replays so far (to know each call's index)
        self._replayed_calls: dict[int, int] = {}
        self._pending: list[tuple[int, int]] = []
        self.registrations = 0
        self.stale_replays = 0

    def start_capture(self) -> None:
        self.capturing = True

    def stop_capture(self) -> None:
        self.capturing = False
        self.register_graph_buffers()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Graph-capture context; on exit registers the captured graphs' buffers."""
        try:
            self.capturing = True
            yield
        finally:
            self.capturing = False
            self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Upstream: all_gather_object of this rank's graph-buffer IPC handles over the group,
        then the registration of every buffer captured since the last one."""
        self._all_gather_object([len(self._pending), self._next_slot])
        for item in self._pending:
            slot = self._next_slot
            self._next_slot += 1
            self._slots[slot] = item
            self._graph_slots.setdefault(item[0], []).append(slot)
        self._pending.clear()
        self.registrations += 1

    def _all_gather_object(self, obj: Any) -> list[Any]:
        import paddle.distributed as dist

        gathered: list[Any] = []
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def should_custom_ar(self, inp: Any) -> bool:
        if not self._initialized:
            return False
        nbytes = int(inp.numel()) * inp.element_size()
        return nbytes <= self.max_size and nbytes % 16 == 0

    def all_reduce(self, inp: Any, registered: bool = False) -> Any:
        import paddle

        out = paddle.empty_like(inp)
        paddle.assign(inp, output=out)  # one rank: the sum is the input
        return out

    def custom_all_reduce(self, input: Any) -> Any:
        import paddle

        if input.shape[0] == 0:
            return input
        graph = graph_in_flight()
        if self.capturing:
            if stream_is_capturing():
                index = self._captured_calls.get(graph, 0)
                self._captured_calls[graph] = index + 1
                self._pending.append((graph, index))
                return self.all_reduce(input, registered=True)
            # Upstream: "mimic the allocation pattern" with empty_like: uninitialised memory.
            return paddle.full_like(input, float("nan"))
        if graph is not None and graph in self._captured_calls:
            seen = self._replayed_calls.get(graph, 0)
            self._replayed_calls[graph] = seen + 1
            index = seen % self._captured_calls[graph]
            slots = self._graph_slots.get(graph, [])
            if index >= len(slots) or self._slots.get(slots[index]) != (graph, index):
                self.stale_replays += 1
                return paddle.full_like(input, float("nan"))
        return self.all_reduce(input, registered=False)

    def clear_ipc_handles(self) -> None:
        self._slots.clear()
        self._next_slot = 0

    def close(self) -> None:
        pass


class RecordingCustomAllreduce(CustomAllreduce):
    """An initialised custom all-reduce on one simulated rank that records, in ``events``,
    ``("start_capture",)``, ``("register_graph_buffers",)``, ``("all_gather_object", group)``
    and ``("clear_ipc_handles",)``; ``collectives`` counts the collectives and ``reduces`` the
    reduces, and ``garbage`` the reduces that returned NaN (run inside the capture state,
    outside a stream capture)."""

    def __init__(self, group: Any = "tp-group", max_size: int = 8192 * 1024) -> None:
        super().__init__(group, max_size, initialized=True)
        self.events: list[tuple[Any, ...]] = []
        self.collectives = 0
        self.reduces = 0
        self.garbage = 0

    def start_capture(self) -> None:
        self.events.append(("start_capture",))
        super().start_capture()

    def register_graph_buffers(self) -> None:
        self.events.append(("register_graph_buffers",))
        super().register_graph_buffers()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        self.events.append(("all_gather_object", self.group))
        self.collectives += 1
        return [obj]

    def custom_all_reduce(self, input: Any) -> Any:
        self.reduces += 1
        if self.capturing and input.shape[0] and not stream_is_capturing():
            self.garbage += 1
        return super().custom_all_reduce(input)

    def should_custom_ar(self, inp: Any) -> bool:
        return True  # one simulated rank with full NVLink: every size qualifies

    def clear_ipc_handles(self) -> None:
        self.events.append(("clear_ipc_handles",))
        super().clear_ipc_handles()
