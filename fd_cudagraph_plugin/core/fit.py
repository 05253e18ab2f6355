"""Capture sizes fitted to the steps served: which of FastDeploy's sizes a recapture makes.

``FD_CUDAGRAPH_FIT`` (off by default): at a recapture after a lifecycle call, capture the subset
of FastDeploy's own list that pads the decode steps served since the last capture least, within
the operator's budget: ``graphs:N`` (at most N graphs) or ``padding:P`` (the fewest graphs whose
padding on that traffic is at most P percent above what FastDeploy's whole list pads). Only
FastDeploy's sizes are candidates, so every size chosen already passed its filtering (TP and EP
divisibility, the speculative scaling), and its largest is always kept: no step that had a graph
runs eagerly, it pads to the next size kept. With too little traffic, FastDeploy's list.

The fit is exact: a dynamic program over the candidates, O(candidates^2 x graphs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Fewer decode steps than this since the last capture say too little of the traffic to fit to.
MIN_STEPS = 256
#: Most sizes fitted among (FastDeploy's automatic lists hold at most 36); above, its list.
MAX_CANDIDATES = 128


@dataclass(frozen=True)
class Budget:
    """``graphs``: at most this many sizes; else ``padding``: at most this many percent more
    padded tokens than FastDeploy's list on the same steps, with as few sizes as that allows."""

    graphs: int = 0
    padding: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Budget | None:
        """``off``, ``graphs:N`` (N in 1..512) or ``padding:P`` (P in 0..1000); ValueError else."""
        if text == "off":
            return None
        kind, _, amount = text.partition(":")
        if kind == "graphs" and amount.isascii() and amount.isdigit() and 1 <= int(amount) <= 512:
            return cls(graphs=int(amount))
        if kind == "padding" and _percent(amount) is not None:
            return cls(padding=_percent(amount))
        raise ValueError(
            "must be off, graphs:N (at most N graphs, 1..512) or padding:P (at most P percent "
            "more padded tokens than FastDeploy's list, 0..1000), such as graphs:8 or padding:10"
        )

    def __str__(self) -> str:
        return f"graphs:{self.graphs}" if self.graphs else f"padding:{self.padding:g}"


def _percent(text: str) -> float | None:
    whole, _, tenths = text.partition(".")
    digits = whole + tenths
    if not (digits.isascii() and digits.isdigit()) or len(whole) > 4 or len(tenths) > 2:
        return None
    value = float(text)
    return value if 0 <= value <= 1000 else None


@dataclass(frozen=True)
class Fitted:
    """What a fit chose, and why, for the session's summary line and the stats."""

    #: The sizes to capture, descending, FastDeploy's largest first; its whole list when ``why``.
    sizes: tuple[int, ...]
    #: The steps fitted to and the padded tokens of the chosen list and of FastDeploy's on them.
    steps: int
    padded: int
    padded_default: int
    #: Why FastDeploy's list is kept ("" when the fit chose).
    why: str = ""

    def describe(self, default: Sequence[int]) -> str:
        if self.why:
            return f"FastDeploy's {len(default)} sizes ({self.why})"
        return (
            f"{len(self.sizes)} of FastDeploy's {len(default)} fitted to the {self.steps} decode "
            f"steps before, {self.padded} padded tokens on them against {self.padded_default} "
            f"with all {len(default)}"
        )


def padded(sizes: Sequence[int], histogram: Mapping[int, int], unit: int = 1) -> int:
    """Padded tokens of ``histogram`` (steps per key) served by ``sizes`` (key capacities):
    each step pads up to the smallest size that holds it; ``unit`` tokens a key."""
    ascending = sorted(sizes)
    total = 0
    for key, steps in histogram.items():
        size = next((s for s in ascending if s >= key), None)
        if size is not None and steps > 0 and key > 0:
            total += (size - key) * steps * unit
    return total


def fit(
    histogram: Mapping[int, int], candidates: Sequence[int], budget: Budget, unit: int = 1
) -> Fitted:
    """The subset of ``candidates`` (key capacities: tokens, or running requests under
    speculative decoding, ``unit`` tokens each) that pads ``histogram`` least within ``budget``;
    the largest candidate always among them. Steps above the largest are not counted: they run
    eagerly whatever the list."""
    sizes = sorted(set(candidates))
    top = sizes[-1]
    steps = {k: n for k, n in histogram.items() if 0 < k <= top and n > 0}
    total = sum(steps.values())
    everything = padded(sizes, steps, unit)
    whole = tuple(reversed(sizes))
    if total < MIN_STEPS:
        return Fitted(
            whole, total, everything, everything, f"{total} steps, fewer than {MIN_STEPS}"
        )
    if len(sizes) > MAX_CANDIDATES:
        return Fitted(whole, total, everything, everything, f"more than {MAX_CANDIDATES} sizes")
    best = _best_by_count(steps, sizes, unit)
    if budget.graphs:
        count = min(budget.graphs, len(sizes))
        count = min(range(1, count + 1), key=lambda c: (best[c][0], c))
    else:
        allowed = everything * (1 + budget.padding / 100)
        count = next(c for c in range(1, len(sizes) + 1) if best[c][0] <= allowed)
    cost, chosen = best[count]
    return Fitted(tuple(sorted(chosen, reverse=True)), total, cost, everything)


def _best_by_count(
    steps: Mapping[int, int], sizes: list[int], unit: int
) -> dict[int, tuple[int, tuple[int, ...]]]:
    """For each count c of sizes, the least padding with c sizes ending at the largest."""
    m = len(sizes)
    # Steps and tokens of the keys up to each size: padding keys (sizes[i-1], sizes[j]] up to
    # sizes[j] is sizes[j] x their steps - their tokens.
    held, tokens = [0] * (m + 1), [0] * (m + 1)
    for j, size in enumerate(sizes):
        low = sizes[j - 1] if j else 0
        inside = [(k, n) for k, n in steps.items() if low < k <= size]
        held[j + 1] = held[j] + sum(n for _, n in inside)
        tokens[j + 1] = tokens[j] + sum(k * n for k, n in inside)

    def cost(i: int, j: int) -> int:
        return (sizes[j] * (held[j + 1] - held[i]) - (tokens[j + 1] - tokens[i])) * unit

    inf = float("inf")
    # table[c][j]: least padding of the keys up to sizes[j] with c sizes, the last sizes[j].
    table = [[inf] * m for _ in range(m + 1)]
    back = [[-1] * m for _ in range(m + 1)]
    for j in range(m):
        table[1][j] = cost(0, j)
    for c in range(2, m + 1):
        for j in range(c - 1, m):
            for i in range(c - 2, j):
                value = table[c - 1][i] + cost(i + 1, j)
                if value < table[c][j]:
                    table[c][j], back[c][j] = value, i
    result: dict[int, tuple[int, tuple[int, ...]]] = {}
    for c in range(1, m + 1):
        chosen, j, layer = [], m - 1, c
        while layer >= 1 and j >= 0:
            chosen.append(sizes[j])
            j, layer = back[layer][j], layer - 1
        result[c] = (int(table[c][m - 1]), tuple(chosen))
    return result
