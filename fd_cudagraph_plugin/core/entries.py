"""Per-size graph entries, the tables that pick one for a step, and the replay counters.

A decode step is keyed by its token count, or under speculative decoding by its running-request
count (``forward_meta.real_bsz``, which FastDeploy maps to a token size). Everything a step needs
is precomputed at construction, so picking a graph is one list index:

* ``decode_for_tokens[n]``: the entry of the smallest decode size >= n (padding);
* ``prefill_for_tokens[n]``: the same over the static-split prefill sizes;
* ``served[key]``: the entry the hot path replays for that key, or None. An entry appears there
  once it is captured and disappears when it is disabled, so the hot path never checks state.

Counters are kept per key (``Counts``) and turned into per-size figures only when read, so the
hot path bumps two list items and nothing else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core.runtime import Graph
from fd_cudagraph_plugin.core.settings import Settings

DECODE = "decode"
PREFILL = "prefill"


class GraphEntry:
    """One capture size of one phase: its graph, its outputs and what its capture cost."""

    __slots__ = (
        "size",
        "phase",
        "graph",
        "replay",
        "result",
        "static_captured",
        "capture_seconds",
        "graph_bytes",
        "addresses",
        "disabled",
    )

    def __init__(self, size: int, phase: str) -> None:
        self.size = size
        self.phase = phase
        #: The runtime graph of a dynamic capture; None until captured (and for static entries).
        self.graph: Graph | None = None
        #: ``graph.replay``, bound once for the hot path.
        self.replay: Callable[[], None] | None = None
        #: The captured run's return value, structure kept: a tensor or a list with Nones.
        self.result: Any = None
        #: Paddle-managed (dy2st) capture done for this size.
        self.static_captured = False
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        #: Input data pointers at capture, when the address guard is on.
        self.addresses: tuple[tuple[str, int], ...] = ()
        #: The self-check found this graph wrong: the size is served eagerly.
        self.disabled = False

    @property
    def captured(self) -> bool:
        return self.graph is not None or self.static_captured


class Tables:
    """The entries of one backend and the tables over them. Rebuilt by ``clear_graph()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.decode = {size: GraphEntry(size, DECODE) for size in settings.capture_sizes}
        self.prefill = {size: GraphEntry(size, PREFILL) for size in settings.prefill_sizes}
        # Index 0 is an entry that never gets a graph, so a 0-token step (PD decode nodes,
        # FastDeploy #3888) runs eagerly wherever it is looked up.
        zero = GraphEntry(0, DECODE)
        self.decode_for_tokens = [self.decode[s] if s else zero for s in settings.decode_table]
        self.prefill_for_tokens = [self.prefill[s] if s else None for s in settings.prefill_table]
        self.served: list[GraphEntry | None] = [None] * len(settings.key_table)

    def publish(self, entry: GraphEntry) -> None:
        """Let the hot path serve every key whose graph ``entry`` is (or stop, once disabled).

        Prefill graphs, and every graph of ``cudagraph_only_prefill`` (prefill kernels keyed by
        token count), are served by the general path only."""
        settings = self.settings
        if settings.only_prefill or entry.phase != DECODE:
            return
        served = None if entry.disabled else entry
        for key, size in enumerate(settings.key_table):
            if key and size == entry.size:
                self.served[key] = served

    def graphs(self) -> list[GraphEntry]:
        return [*self.decode.values(), *self.prefill.values()]


class Counts:
    """Steps served, for the life of a backend (they survive ``clear_graph()``).

    ``steps[key]`` counts decode replays by the key the hot path uses (token count, or running
    requests under speculative decoding), and under speculative decoding ``tokens[key]`` their
    tokens (elsewhere a key's tokens are the key). ``other_keys`` counts the decode steps
    of a key that its graph did not serve: run eagerly, or (speculative) replayed by token count,
    which ``by_tokens`` counts. ``prefill_steps`` counts static-split prefill replays by token
    count. Lists never change size, so another thread may read them while serving goes on; the
    Counters are read through ``dict()`` copies, which CPython makes in one C call under the GIL,
    so no insertion can interleave with the copy.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.steps = [0] * len(settings.key_table)
        self.tokens = [0] * len(settings.key_table)
        self.by_tokens = [0] * len(settings.decode_table)
        self.prefill_steps = [0] * len(settings.prefill_table)
        self.fallbacks: Counter[str] = Counter()
        self.other_keys: Counter[int] = Counter()

    def observed(self) -> dict[int, int]:
        """Decode steps per key, however they were served: what ``fd-cudagraph tune`` reads."""
        seen = Counter(dict(self.other_keys))
        seen.update({key: n for key, n in enumerate(list(self.steps)) if n})
        return dict(seen)

    def per_size(self) -> tuple[Counter[int], Counter[int], Counter[int], Counter[int]]:
        """Decode replays and padded tokens per size, then the same for prefill."""
        settings = self.settings
        replays: Counter[int] = Counter()
        padded: Counter[int] = Counter()
        tokens = list(self.tokens) if settings.keyed_by_running else None
        for key, n in enumerate(list(self.steps)):
            if n:
                size = settings.key_table[key]
                replays[size] += n
                padded[size] += n * size - (tokens[key] if tokens else n * key)
        _add_by_tokens(self.by_tokens, settings.decode_table, replays, padded)
        prefill: Counter[int] = Counter()
        prefill_padded: Counter[int] = Counter()
        _add_by_tokens(self.prefill_steps, settings.prefill_table, prefill, prefill_padded)
        return replays, padded, prefill, prefill_padded


def _add_by_tokens(steps: list[int], table: tuple[int, ...], replays: Counter, padded: Counter):
    for tokens, n in enumerate(list(steps)):
        if n:
            replays[table[tokens]] += n
            padded[table[tokens]] += n * (table[tokens] - tokens)
