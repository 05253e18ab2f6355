"""What a capture session captured: one record per graph, the summary line, the memory report.

``summary()`` is the one log line per session; ``to_json()`` is what ``FD_CUDAGRAPH_MEMORY_REPORT``
writes. The session fills the report (``session.py``); the backends read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fd_cudagraph_plugin.core import budget, process
from fd_cudagraph_plugin.core.messages import RankMemory
from fd_cudagraph_plugin.core.text import human_bytes, plural


@dataclass(frozen=True)
class CaptureRecord:
    backend: str
    role: str
    phase: str
    size: int
    seconds: float
    graph_bytes: int
    warmups: int


@dataclass
class CaptureReport:
    """What one session captured."""

    phase: str
    rank: int
    seconds: float = 0.0
    #: Of ``seconds``: the one-off start (the plan agreement).
    setup_seconds: float = 0.0
    #: Of ``seconds``: time spent at agreement points (waiting for other ranks included).
    agreement_seconds: float = 0.0
    agreement_points: int = 0
    records: list[CaptureRecord] = field(default_factory=list)
    #: Every rank's memory after the session (shared at its end), when the device can say.
    memory: list[RankMemory] = field(default_factory=list)
    #: Why warm-ups were skipped, when some were (``warmups.py``): the summary line says it.
    warmup_note: str = ""

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def graph_bytes(self) -> int:
        return sum(r.graph_bytes for r in self.records)

    @property
    def largest_graph_bytes(self) -> int:
        return max((r.graph_bytes for r in self.records), default=0)

    @property
    def warmups(self) -> int:
        return sum(r.warmups for r in self.records)

    def mine(self) -> RankMemory | None:
        return next((m for m in self.memory if m.rank == self.rank), None)

    def summary(self) -> str:
        seconds = _seconds(self.seconds)
        if not self.records:
            return f"{self.phase} capture session: no graphs captured in {seconds}"
        sizes = sorted({r.size for r in self.records})
        backends = len({r.backend for r in self.records})
        size_text = f"size {sizes[0]}" if len(sizes) == 1 else f"sizes {sizes[0]}..{sizes[-1]}"
        text = (
            f"captured {plural(self.graphs, 'graph')} ({size_text}"
            f"{f', {backends} backends' if backends > 1 else ''}) in {seconds}, "
            f"graph memory {human_bytes(self.graph_bytes)} "
            f"(largest graph {human_bytes(self.largest_graph_bytes)}), {self._warmup_text()}"
        )
        if self.memory:
            text += "; " + budget.memory_line(self.memory, self.rank)
        return text

    def _warmup_text(self) -> str:
        per_graph = sorted({r.warmups for r in self.records})
        if self.warmup_note:
            return f"{plural(self.warmups, 'warm-up')}: {self.warmup_note}"
        if len(per_graph) == 1:
            return f"{plural(per_graph[0], 'warm-up')} each"
        return f"{per_graph[0]}-{per_graph[-1]} warm-ups each"

    def out_of_memory_advice(self, participant: Any, phase: str) -> str:
        """What to change, from what this rank knew of memory when a capture ran out of it; the
        rank posts it with its failure, so every rank prints it."""
        device = participant.runtime.device_memory()
        return budget.oom_advice(
            captured_bytes=self.graph_bytes,
            graphs_done=self.graphs,
            graphs_planned=max(participant.graphs_expected(phase), self.graphs + 1),
            free=device[0] if device else None,
            total=device[1] if device else None,
            utilization=participant.settings.gpu_memory_utilization,
            kv_reserve=_kv_reserve(),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "fd-cudagraph-memory/1",
            "phase": self.phase,
            "rank": self.rank,
            "seconds": round(self.seconds, 6),
            "setup_seconds": round(self.setup_seconds, 6),
            "agreement_seconds": round(self.agreement_seconds, 6),
            "agreement_points": self.agreement_points,
            "graphs": self.graphs,
            "graph_bytes": self.graph_bytes,
            "largest_graph_bytes": self.largest_graph_bytes,
            "warmups": self.warmups,
            "captures": [asdict(r) for r in self.records],
            "memory": [
                {
                    **asdict(m),
                    "fit_gpu_memory_utilization": None
                    if m.utilization is None or not m.total
                    else budget.fit_utilization(m.utilization, m.free, m.total),
                }
                for m in self.memory
            ],
        }


def _kv_reserve() -> str:
    """What FD_CUDAGRAPH_KV_RESERVE did at this start (``reserve.KvReserve``), or "off"."""
    owner = process.current()
    if owner.reserve is not None:
        return owner.reserve.describe()
    return (
        "off" if owner.options.kv_reserve == "off" else "FD_CUDAGRAPH_KV_RESERVE reserved nothing"
    )


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 0.1 else f"{value * 1e3:.0f} ms"
