"""The graph table of one backend: the graph key (after vLLM's ``BatchDescriptor``) and an entry
per key holding its graph, its outputs and what its capture cost.

The dispatcher decides a step's key in one place (``dispatch.py``); capture, replay and the
counters trust it. Keys are made once per entry when the table is built, never per step. An entry
is filled from what ``capture.Capturer`` returns (``fill``), disabled by the table when the ranks'
self-check found it wrong (``disable``), and emptied on clear (``release``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fd_cudagraph_plugin.core.mode import DECODE, PREFILL, Mode
from fd_cudagraph_plugin.core.runtime import Graph

#: What a key's size was found from: the step's token count, or (speculative decoding, where
#: FastDeploy maps ``real_bsz`` to a captured size) its running requests.
TOKENS = "tokens"
RUNNING = "running"


@dataclass(frozen=True, slots=True)
class GraphKey:
    phase: str
    #: Paddle-managed graph inside the dy2st partial programs (``dy2st.py``), else a stream
    #: capture of the dygraph runnable by the plugin's runtime.
    static: bool
    #: The captured size in tokens.
    size: int

    def __str__(self) -> str:
        return f"{self.phase} size {self.size}"


#: What the backend does with a step (``Step.action``): replay its graph, check its inputs first
#: (the graph's first replay since a lifecycle call), capture it, or run it eagerly.
REPLAY, VERIFY, CAPTURE, EAGER = "replay", "verify", "capture", "eager"


@dataclass(frozen=True, slots=True)
class Step:
    """The dispatcher's decision for one step that the hot path did not serve."""

    #: The graph that serves it; None: it runs eagerly.
    key: GraphKey | None
    #: Why it runs eagerly ("" when a graph serves it).
    reason: str = ""
    #: What the step is counted under for ``fd-cudagraph tune``: its decode key (token count, or
    #: running requests under speculative decoding); None for prefill and 0-token steps.
    observed: int | None = None
    #: ``TOKENS`` or ``RUNNING``: what ``key.size`` was found from.
    by: str = TOKENS
    action: str = EAGER

    def replay(self) -> Step:
        return Step(self.key, "", self.observed, self.by, REPLAY)

    def eager(self, reason: str) -> Step:
        return Step(self.key, reason, self.observed, self.by, EAGER)


#: ``Captured.eager`` when no warm-up ran before the capture.
NOTHING = object()


@dataclass(frozen=True)
class Captured:
    """One graph, captured and registered on every rank (``capture.Capturer`` makes it)."""

    key: GraphKey
    #: The runtime's graph (None for a Paddle-managed static capture).
    graph: Graph | None
    #: The captured run's return value, structure kept: a tensor or a list with Nones.
    result: Any
    graph_bytes: int
    seconds: float
    warmups: int
    #: Input data pointers at capture (dynamic graphs).
    addresses: tuple[tuple[str, int], ...] = ()
    #: The last warm-up's result (the same inputs, run eagerly), or ``NOTHING``.
    eager: Any = NOTHING


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
        "registered",
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
        #: Input data pointers at capture (dynamic graphs): what its first replay after a
        #: lifecycle call, and the address guard, compare.
        self.addresses: tuple[tuple[str, int], ...] = ()
        #: The self-check found this graph wrong: the key is served eagerly (``GraphTable``).
        self.disabled = False
        #: Its all-reduce buffers are registered (``capture.py``): before, it never replays.
        self.registered = False

    @property
    def phase(self) -> str:
        return self.key.phase

    @property
    def captured(self) -> bool:
        return self.graph is not None or self.static_captured

    def fill(self, captured: Captured) -> None:
        """Take what ``Capturer.capture`` returned."""
        self.graph = captured.graph
        self.result = captured.result
        self.replay = captured.graph.replay if captured.graph is not None else None
        self.static_captured = captured.graph is None
        self.graph_bytes = captured.graph_bytes
        self.capture_seconds = captured.seconds
        self.addresses = captured.addresses
        self.registered = False

    def release(self) -> None:
        """Drop the graph and its outputs (they live in graph memory)."""
        graph, self.graph = self.graph, None
        self.replay = None
        self.result = None
        self.addresses = ()
        self.static_captured = False
        self.registered = False
        if graph is not None:
            graph.release()


class GraphTable:
    """Every entry of one backend, by phase and size, as its mode plans them."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.decode = {
            s: GraphEntry(GraphKey(DECODE, mode.static(DECODE), s)) for s in mode.decode_sizes
        }
        self.prefill = {
            s: GraphEntry(GraphKey(PREFILL, mode.static(PREFILL), s)) for s in mode.prefill_sizes
        }

    def entry(self, key: GraphKey) -> GraphEntry:
        return (self.decode if key.phase == DECODE else self.prefill)[key.size]

    def all(self) -> list[GraphEntry]:
        return [*self.decode.values(), *self.prefill.values()]

    def expected(self, saw_prefill_step: bool) -> list[GraphEntry]:
        """The entries this mode captures: what ``check_capture_successful`` requires."""
        phases = self.mode.expected_phases(saw_prefill_step)
        return [e for e in self.all() if e.phase in phases]

    def disable(self, entry: GraphEntry) -> None:
        """Every rank's self-check agreed this graph is wrong: its key is served eagerly."""
        entry.disabled = True
