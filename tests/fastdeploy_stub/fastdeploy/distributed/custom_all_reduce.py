"""Custom all-reduce stand-ins. The real one needs CUDA IPC; ``CustomAllreduce`` here never
initialises (as upstream with one rank), ``RecordingCustomAllreduce`` behaves as an initialised
one on a single simulated rank and records what a test needs.

What is modelled from upstream (``custom_all_reduce.py``, same in 2.5, 2.6 and develop):

* ``capture()`` sets ``capturing``; on exit, in ``finally`` (so also when the body raised), it
  runs ``register_graph_buffers()``, an ``all_gather_object`` over the TP group: a collective;
* ``custom_all_reduce(x)`` while ``capturing``: a real reduce when a stream capture is running,
  else ``empty_like(x)``, i.e. garbage. Here the garbage is NaN, so a test notices it. On one rank
  the real reduce is the identity (a copy, as the op is out-of-place).

"A stream capture is running" is ``cudaStreamIsCapturing`` upstream. Here it is the plugin's
simulated runtime's ``capturing`` flag, read through ``stream_is_capturing`` (replace that hook to
couple to something else). Paddle-managed (dy2st) captures are not seen by it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _simulated_runtime_is_capturing() -> bool:
    try:
        from fd_cudagraph_plugin.core import runtime
    except ImportError:
        return False
    return bool(getattr(runtime.get_runtime("simulated"), "capturing", False))


#: Hook: True while a (simulated) CUDA stream capture is running.
stream_is_capturing = _simulated_runtime_is_capturing


class CustomAllreduce:
    def __init__(self, group: Any = None, max_size: int = 8192 * 1024) -> None:
        self.capturing = False
        self.group = group
        self.max_size = max_size
        self._initialized = False  # upstream returns early with one rank or no IPC ops

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
        """Upstream: all_gather_object of this rank's graph-buffer IPC handles over the group."""
        self._all_gather_object(["handle", "offset"])

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
        if self.capturing:
            if stream_is_capturing():
                return self.all_reduce(input, registered=True)
            # Upstream: "mimic the allocation pattern" with empty_like: uninitialised memory.
            return paddle.full_like(input, float("nan"))
        return self.all_reduce(input, registered=False)

    def clear_ipc_handles(self) -> None:
        """Drops graph IPC handles upstream; nothing to do here."""

    def close(self) -> None:
        pass


class RecordingCustomAllreduce(CustomAllreduce):
    """An initialised custom all-reduce on one simulated rank that records, in ``events``,
    ``("capture_enter",)``, ``("register_graph_buffers",)``, ``("all_gather_object", group)``
    and ``("clear_ipc_handles",)``; ``collectives`` counts the collectives and ``reduces`` the
    reduces, and ``garbage`` the reduces that returned NaN (run inside the context, outside a
    stream capture)."""

    def __init__(self, group: Any = "tp-group", max_size: int = 8192 * 1024) -> None:
        super().__init__(group, max_size)
        self._initialized = True
        self.events: list[tuple[Any, ...]] = []
        self.collectives = 0
        self.reduces = 0
        self.garbage = 0

    @contextmanager
    def capture(self) -> Iterator[None]:
        self.events.append(("capture_enter",))
        with super().capture():
            yield

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
