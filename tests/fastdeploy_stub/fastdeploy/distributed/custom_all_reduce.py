"""Custom all-reduce stand-ins. The real one needs CUDA IPC; this one never initialises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CustomAllreduce:
    def __init__(self, group: Any = None, max_size: int = 8 * 1024 * 1024) -> None:
        self.group = group
        self.max_size = max_size
        self.capturing = False
        self._initialized = False

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
        """A TP collective upstream; nothing to do here."""

    def clear_ipc_handles(self) -> None:
        """Drops graph IPC handles upstream; nothing to do here."""

    def should_custom_ar(self, inp: Any) -> bool:
        return False

    def close(self) -> None:
        pass


class RecordingCustomAllreduce(CustomAllreduce):
    """Records capture / registration / clearing events in ``self.events`` (for tests)."""

    def __init__(self, group: Any = None, max_size: int = 8 * 1024 * 1024) -> None:
        super().__init__(group, max_size)
        self.events: list[tuple[str, ...]] = []

    @contextmanager
    def capture(self) -> Iterator[None]:
        self.events.append(("capture_enter",))
        with super().capture():
            yield

    def register_graph_buffers(self) -> None:
        self.events.append(("register_graph_buffers",))

    def clear_ipc_handles(self) -> None:
        self.events.append(("clear_ipc_handles",))
