"""Per-size graph entries of one backend, and the tables the hot path reads.

``served[key]`` is the entry the hot path replays for a decode key (token count, or running
requests under speculative decoding), or None. An entry appears there once it is captured and
disappears when it is disabled, so the hot path never checks an entry's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core.key import DECODE, PREFILL, GraphKey
from fd_cudagraph_plugin.core.runtime import Graph
from fd_cudagraph_plugin.core.settings import Settings


class GraphEntry:
    """One key's graph, its outputs and what its capture cost."""

    __slots__ = (
        "key",
        "graph",
        "replay",
        "result",
        "static_captured",
        "capture_seconds",
        "graph_bytes",
        "addresses",
        "disabled",
    )

    def __init__(self, key: GraphKey) -> None:
        self.key = key
        #: The runtime graph of a dynamic capture; None until captured (and for static entries).
        self.graph: Graph | None = None
        #: ``graph.replay``, bound once for the hot path.
        self.replay: Callable[[], None] | None = None
        #: The captured run's return value, structure kept: a tensor or a list with Nones.
        self.result: Any = None
        #: Paddle-managed (dy2st) capture done for this key.
        self.static_captured = False
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        #: Input data pointers at capture, when the address guard is on.
        self.addresses: tuple[tuple[str, int], ...] = ()
        #: The self-check found this graph wrong: the key is served eagerly.
        self.disabled = False

    @property
    def size(self) -> int:
        return self.key.size

    @property
    def phase(self) -> str:
        return self.key.phase

    @property
    def captured(self) -> bool:
        return self.graph is not None or self.static_captured

    def release(self) -> None:
        """Drop the graph and its outputs (they live in graph memory)."""
        graph, self.graph = self.graph, None
        self.replay = None
        self.result = None
        self.addresses = ()
        if graph is not None:
            graph.release()


class Entries:
    """Every entry of one backend and the ``served`` table over them."""

    def __init__(self, settings: Settings, static_decode: bool, static_prefill: bool) -> None:
        self.settings = settings
        self.decode = {
            s: GraphEntry(GraphKey(DECODE, static_decode, s)) for s in settings.decode_sizes
        }
        self.prefill = {
            s: GraphEntry(GraphKey(PREFILL, static_prefill, s))
            for s in settings.prefill_graph_sizes
        }
        self.served: list[GraphEntry | None] = [None] * len(settings.key_table)
        #: For each decode size, the hot path's keys that pad to it.
        self._keys_of: dict[int, list[int]] = {}
        for key, size in enumerate(settings.key_table):
            if key and size:
                self._keys_of.setdefault(size, []).append(key)

    def entry(self, key: GraphKey) -> GraphEntry:
        return (self.decode if key.phase == DECODE else self.prefill)[key.size]

    def publish(self, entry: GraphEntry) -> None:
        """Let the hot path serve every decode key whose graph ``entry`` is (or stop, once
        disabled). Prefill graphs and Paddle-managed (static) graphs, which replay through
        Paddle's partial programs, are served by the general path only."""
        if entry.phase != DECODE or entry.key.static or self.settings.only_prefill:
            return
        served = None if entry.disabled or not entry.captured else entry
        for key in self._keys_of.get(entry.size, ()):
            self.served[key] = served

    def all(self) -> list[GraphEntry]:
        return [*self.decode.values(), *self.prefill.values()]
