"""Graph memory inside FastDeploy's KV-cache budget: the figures, the advice, the reserve.

FastDeploy sizes the KV cache before it captures: ``GpuWorker.determine_available_memory()``
answers ``total * gpu_memory_utilization - used after the profile run - the profile's peak
increase`` (2.4 through develop), the cache takes that, and ``capture_model()`` then captures out
of whatever is left. Nothing counts graph memory, so a high ``gpu_memory_utilization`` runs out of
memory in capture and a low one leaves memory idle. This module turns what the plugin measures
into: the free memory after each session and the highest ``gpu_memory_utilization`` that would
have fit (``fit_utilization``), and advice after an out-of-memory in capture. ``Reserve`` is what
``FD_CUDAGRAPH_KV_RESERVE`` did at this start, as ``reserve.py`` publishes it to sessions.

Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from fd_cudagraph_plugin.core.errors import human_bytes
from fd_cudagraph_plugin.core.ranks.messages import RankMemory


class Choice(Enum):
    """What ``FD_CUDAGRAPH_KV_RESERVE`` asks for."""

    OFF = "off"
    AUTO = "auto"
    SIZE = "a size"


@dataclass(frozen=True)
class Reserve:
    """What ``FD_CUDAGRAPH_KV_RESERVE`` did at this start, a value handed on, never parsed."""

    choice: Choice
    #: Bytes taken out of FastDeploy's KV budget; None: none was taken (off, not yet, or
    #: FastDeploy sized the cache without its memory profile).
    nbytes: int | None = None
    #: Where the figure came from, as the log line says it.
    source: str = ""
    #: The record keys whose figures it is (empty: a probe's estimate, a size, or nothing).
    recorded_keys: tuple[str, ...] = ()

    @classmethod
    def asked(cls, option: object) -> Reserve:
        """The option's value as ``options.py`` parsed it ("off", "auto" or bytes), none taken."""
        if option == "off":
            return cls(Choice.OFF)
        return cls(Choice.AUTO) if option == "auto" else cls(Choice.SIZE)

    def said(self) -> str:
        """``FD_CUDAGRAPH_KV_RESERVE=auto reserved 20.0 MiB``, for the advice."""
        asked = "auto" if self.choice is Choice.AUTO else "a size"
        if self.choice is Choice.SIZE and self.nbytes is not None:
            asked = human_bytes(self.nbytes)
        taken = human_bytes(self.nbytes) if self.nbytes is not None else "nothing"
        return f"FD_CUDAGRAPH_KV_RESERVE={asked} reserved {taken}"


def margin(total: int) -> int:
    """What stays free after capture for allocator slack and the odd late allocation: 1 GiB, or
    5% of a smaller device."""
    return min(1 << 30, total // 20)


def fit_utilization(utilization: float, free: int, total: int) -> float:
    """The highest ``gpu_memory_utilization`` that leaves ``margin`` free after this capture: the
    KV cache grows by what ``free`` holds beyond the margin. Rounded down to four decimals (14 MiB
    of a 140 GiB GPU), so the advice, applied, lands within that of the margin."""
    raw = utilization + (free - margin(total)) / total
    return max(0.0, min(0.9999, _floor4(raw)))


def _floor4(value: float) -> float:
    return math.floor(value * 10_000 + 1e-6) / 10_000


def share(value: float) -> str:
    """A utilization as an operator pastes it: up to four decimals, no trailing zeros."""
    return f"{value:.4f}".rstrip("0").rstrip(".")


def memory_line(ranks: list[RankMemory], rank: int) -> str:
    """The session's memory figures, for the summary line: the tightest rank's count."""
    mine = next(r for r in ranks if r.rank == rank)
    measured = [r for r in ranks if r.total > 0]
    if not measured:
        return f"graph memory {human_bytes(mine.graph_bytes)} (device memory unknown)"
    tight = min(measured, key=lambda r: r.free)
    where = f" (tightest: rank {tight.rank})" if len(ranks) > 1 else ""
    device = " of the simulated device" if tight.simulated else ""
    text = (
        f"{human_bytes(tight.free)} of {human_bytes(tight.total)}{device} free after capture{where}"
    )
    if mine.taken_bytes > mine.graph_bytes:  # what must fit beside the KV cache
        text = f"{human_bytes(mine.taken_bytes)} taken in all; {text}"
    if tight.utilization is None:
        return text
    fit = fit_utilization(tight.utilization, tight.free, tight.total)
    if tight.free < margin(tight.total):
        return (
            f"{text}, less than the {human_bytes(margin(tight.total))} margin: lower "
            f"gpu_memory_utilization to {share(fit)} (now {share(tight.utilization)})"
        )
    return (
        f"{text}; gpu_memory_utilization up to {share(fit)} would fit (now "
        f"{share(tight.utilization)}, keeping {human_bytes(margin(tight.total))} free)"
    )


def oom_advice(
    captured_bytes: int,
    graphs_done: int,
    graphs_planned: int,
    free: int | None,
    total: int | None,
    utilization: float | None,
    reserve: Reserve = Reserve(Choice.OFF),
) -> str:
    """What to change after an out-of-memory in capture, from what the failing rank knew, and
    what FD_CUDAGRAPH_KV_RESERVE did at this start."""
    if graphs_done:
        parts = [
            f"Out of memory after {graphs_done} of {graphs_planned} graphs, which took "
            f"{human_bytes(captured_bytes)}"
        ]
    else:
        parts = [f"Out of memory before the first of {graphs_planned} graphs"]
    if free is not None and total:
        parts.append(f"with {human_bytes(free)} of {human_bytes(total)} free")
    text = ", ".join(parts) + "."
    if free is not None and total and utilization is not None:
        # Graphs are captured largest first, so the rest cost at most what these did on average.
        per_graph = captured_bytes / graphs_done if graphs_done else 0
        needed = (graphs_planned - graphs_done) * per_graph
        short = max(needed - free, 0) + margin(total)
        lower = _floor4(utilization - short / total)
        if lower <= 0:
            text += " Lower --gpu-memory-utilization,"
        elif graphs_done:
            text += f" Lower --gpu-memory-utilization to {share(lower)} (now {share(utilization)}),"
        else:  # nothing measured yet: the largest graph alone needs more than what was free
            text += (
                f" Lower --gpu-memory-utilization below {share(lower)} (now {share(utilization)}),"
            )
    else:
        text += " Lower --gpu-memory-utilization,"
    if reserve.choice is Choice.OFF:
        change = " set FD_CUDAGRAPH_KV_RESERVE=auto so the KV cache leaves room for the graphs,"
    elif reserve.choice is Choice.AUTO:
        change = (
            f" ({reserve.said()}, which was too little: its recorded figure is dropped, so the "
            f"next start measures again)"
        )
    else:
        change = f" raise FD_CUDAGRAPH_KV_RESERVE ({reserve.said()}, which was too little),"
    return (
        text + change + " or trim --max-num-seqs or cudagraph_capture_sizes in "
        "--graph-optimization-config."
    )
