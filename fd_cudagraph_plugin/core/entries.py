"""Per-size graph entries of one backend: the graph, its outputs and what its capture cost.

An entry is filled from what ``capture.Capturer`` returns (``fill``) and emptied on clear
(``release``); the dispatcher (``dispatch.py``) decides which entry serves a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core.key import DECODE, PREFILL, GraphKey
from fd_cudagraph_plugin.core.runtime import Graph
from fd_cudagraph_plugin.core.settings import Settings


class GraphEntry:
    """One key's graph. The hot path reads ``size``, ``result`` and ``replay`` only."""

    __slots__ = (
        "key",
        "size",
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
        self.size = key.size
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
    def phase(self) -> str:
        return self.key.phase

    @property
    def captured(self) -> bool:
        return self.graph is not None or self.static_captured

    def fill(self, captured: Any) -> None:
        """Take what ``Capturer.capture`` returned (a ``capture.Captured``)."""
        self.graph = captured.graph
        self.result = captured.result
        self.replay = captured.graph.replay if captured.graph is not None else None
        self.static_captured = captured.graph is None
        self.graph_bytes = captured.graph_bytes
        self.capture_seconds = captured.seconds
        self.addresses = captured.addresses

    def release(self) -> None:
        """Drop the graph and its outputs (they live in graph memory)."""
        graph, self.graph = self.graph, None
        self.replay = None
        self.result = None
        self.addresses = ()
        self.static_captured = False
        if graph is not None:
            graph.release()


class Entries:
    """Every entry of one backend, by phase and size."""

    def __init__(self, settings: Settings, static_decode: bool, static_prefill: bool) -> None:
        self.decode = {
            s: GraphEntry(GraphKey(DECODE, static_decode, s)) for s in settings.decode_sizes
        }
        self.prefill = {
            s: GraphEntry(GraphKey(PREFILL, static_prefill, s))
            for s in settings.prefill_graph_sizes
        }

    def entry(self, key: GraphKey) -> GraphEntry:
        return (self.decode if key.phase == DECODE else self.prefill)[key.size]

    def all(self) -> list[GraphEntry]:
        return [*self.decode.values(), *self.prefill.values()]
