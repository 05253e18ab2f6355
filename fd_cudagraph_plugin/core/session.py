"""Capture sessions: FastDeploy's capture loops, wrapped.

FastDeploy's ``GPUModelRunner.capture_model()`` (decode) and ``capture_model_prefill_and_mixed()``
(static split prefill) own the dummy runs that make the backends capture. The plugin keeps those
loops and runs each inside a ``CaptureSession``, which:

* freezes Python's GC for the session, so no collection of the process's live objects runs in the
  middle of capturing (vLLM measured per-size capture time falling from about 5 s to under 0.5 s
  with this), and unfreezes afterwards, also on error. It does not collect first, as vLLM does: a
  full collection with Paddle loaded took 60-100 ms, one-off time FastDeploy's own capture does
  not spend, and garbage frozen for the session is collected after it;
* before the first capture, exchanges a fingerprint of the capture plan with every tensor-parallel
  rank and raises ``RankMismatchError`` with a per-rank diff instead of hanging later inside the
  custom all-reduce registration collective (vLLM #39788, SGLang #11275, #16237);
* shows a progress bar per phase on rank 0, records each size's capture time and graph memory, and
  ends with one summary line in the log and a ``CaptureReport`` kept on every backend;
* runs the warm-only first pass of ``FD_CUDAGRAPH_WARMUP=warm_all_first``.

Graphs are captured only inside a session: after the last one has ended, a size seen for the first
time runs eagerly, because a capture on one tensor-parallel rank alone would hang the others.

The session talks to backends only through ``Member``; backends use only the session's public
surface (``active()``, ``sessions_ended()``, ``warm_only``, ``before_capture``, ``note_warmups``,
``record``, ``self_check_failed``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from fd_cudagraph_plugin.core import stats
from fd_cudagraph_plugin.core.errors import RankMismatchError
from fd_cudagraph_plugin.core.options import PluginOptions

logger = logging.getLogger("fd_cudagraph_plugin")


def human_bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


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
    """What one session captured. ``summary()`` is the log line; ``to_json()`` the memory report."""

    phase: str
    rank: int
    warmup_policy: str
    seconds: float = 0.0
    #: Of ``seconds``: the one-off start (GC freeze, the plan exchange).
    setup_seconds: float = 0.0
    records: list[CaptureRecord] = field(default_factory=list)

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def graph_bytes(self) -> int:
        return sum(r.graph_bytes for r in self.records)

    @property
    def largest_graph_bytes(self) -> int:
        return max((r.graph_bytes for r in self.records), default=0)

    def summary(self) -> str:
        if not self.records:
            return f"{self.phase} capture session: no graphs captured in {self.seconds:.1f} s"
        sizes = sorted({r.size for r in self.records})
        warmups = sorted({r.warmups for r in self.records})
        warm = f"{warmups[0]}" if len(warmups) == 1 else f"{warmups[0]}-{warmups[-1]}"
        backends = len({r.backend for r in self.records})
        return (
            f"captured {self.graphs} graphs (sizes {sizes[0]}..{sizes[-1]}"
            f"{f', {backends} backends' if backends > 1 else ''}) in {self.seconds:.1f} s, "
            f"graph memory {human_bytes(self.graph_bytes)} "
            f"(largest graph {human_bytes(self.largest_graph_bytes)}), {warm} warm-ups each"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "fd-cudagraph-memory/1",
            "phase": self.phase,
            "rank": self.rank,
            "seconds": round(self.seconds, 6),
            "setup_seconds": round(self.setup_seconds, 6),
            "graphs": self.graphs,
            "graph_bytes": self.graph_bytes,
            "largest_graph_bytes": self.largest_graph_bytes,
            "warmup_policy": self.warmup_policy,
            "captures": [asdict(r) for r in self.records],
        }


class Member(Protocol):
    """What a session asks of each live backend (``stats.live_backends()``)."""

    role: str
    capture_report: CaptureReport | None

    def plan_fingerprint(self) -> dict[str, Any]:
        """What must be equal on every tensor-parallel rank for captures to line up."""

    def graphs_expected(self, phase: str) -> int:
        """How many graphs of ``phase`` this backend captures in a full session."""

    def disable_graph(self, phase: str, size: int) -> None:
        """Serve ``size`` eagerly from now on: its self-check failed on some rank."""


class PlanExchange(Protocol):
    """Gathers one object from every tensor-parallel rank, in rank order."""

    def all_gather(self, obj: Any) -> list[Any]: ...


class PaddleExchange:
    """The TP group's ``all_gather_object``: what FastDeploy workers use."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def all_gather(self, obj: Any) -> list[Any]:
        import paddle.distributed as dist

        gathered: list[Any] = []
        dist.all_gather_object(gathered, obj, group=self._group)
        return gathered


def default_exchange(fd_config: Any) -> PlanExchange | None:
    parallel = getattr(fd_config, "parallel_config", None)
    if getattr(parallel, "tensor_parallel_size", 1) <= 1:
        return None
    return PaddleExchange(getattr(parallel, "tp_group", None))


#: Builds the exchange for a session from the runner's ``fd_config``; tests replace it.
exchange_factory: Callable[[Any], PlanExchange | None] = default_exchange


def plan_diff(fingerprints: list[dict]) -> list[str]:
    """One line per rank whose plan differs from rank 0's, naming each differing key."""
    lines = []
    reference = fingerprints[0]
    for rank, fingerprint in enumerate(fingerprints[1:], start=1):
        keys = sorted(set(reference) | set(fingerprint))
        diffs = [
            f"{key}: rank 0 {reference.get(key)!r} vs rank {rank} {fingerprint.get(key)!r}"
            for key in keys
            if reference.get(key) != fingerprint.get(key)
        ]
        if diffs:
            lines.append(f"rank {rank}: " + "; ".join(diffs))
    return lines


_active: CaptureSession | None = None
_ended = 0


def active() -> CaptureSession | None:
    return _active


def sessions_ended() -> int:
    return _ended


def reset_for_tests() -> None:
    global _active, _ended
    _active, _ended = None, 0


class CaptureSession:
    """One run of a FastDeploy capture loop. Use as a context manager."""

    def __init__(
        self,
        phase: str,
        *,
        fd_config: Any = None,
        options: PluginOptions | None = None,
        exchange: PlanExchange | None = None,
    ) -> None:
        self.options = options or PluginOptions.from_env()
        self.phase = phase
        parallel = getattr(fd_config, "parallel_config", None)
        self.rank = int(getattr(parallel, "tensor_parallel_rank", 0) or 0)
        self.exchange = exchange if exchange is not None else exchange_factory(fd_config)
        self.report = CaptureReport(phase, self.rank, self.options.warmup)
        #: True during the first pass of ``warm_all_first``: warm up, capture nothing.
        self.warm_only = False
        self._warmed: dict[tuple[int, str, int], int] = {}
        self._self_check_failures: list[tuple[Member, str, int, str]] = []
        self._plan_checked = False
        self._bars: dict[tuple[str, str], Any] = {}
        self._started = 0.0
        self._unfreeze = False

    def __enter__(self) -> CaptureSession:
        global _active
        if _active is not None:
            raise RuntimeError("capture sessions do not nest")
        self._started = time.perf_counter()
        self._unfreeze = gc.get_freeze_count() == 0
        gc.freeze()
        _active = self
        try:
            if stats.live_backends():
                self.check_plan()
        except BaseException:
            self._close()
            raise
        self.report.setup_seconds = time.perf_counter() - self._started
        return self

    def before_capture(self) -> None:
        """Called by each capture. Where the first backend was built inside the capture loop
        (no profile run), no backend existed at ``__enter__``: the plan is checked here, before
        the first capture's all-reduce registration, with the backends that exist now."""
        if not self._plan_checked:
            self.check_plan()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._agree_on_self_checks()
        finally:
            self._close()
        if exc_type is None:
            self._finish()

    def self_check_failed(self, member: Member, phase: str, size: int, message: str) -> None:
        """A new graph disagreed with eager; acted on at the end of the session, on every rank."""
        self._self_check_failures.append((member, phase, size, message))

    def _agree_on_self_checks(self) -> None:
        """Share every rank's self-check failures over the plan-check group, then act alike:
        one rank raising while the others block in their next collective would hang them."""
        if self.options.self_check == "off":
            return
        members = stats.live_backends()
        mine = [
            (members.index(member), phase, size, message)
            for member, phase, size, message in self._self_check_failures
            if member in members
        ]
        everyone = self.exchange.all_gather(mine) if self.exchange is not None else [mine]
        failures = [(rank, *failure) for rank, found in enumerate(everyone) for failure in found]
        if not failures:
            return
        summary = "; ".join(f"rank {rank}: {message}" for rank, _, _, _, message in failures)
        if self.options.self_check == "error":
            from fd_cudagraph_plugin.core.errors import SelfCheckError

            raise SelfCheckError(
                f"CUDA graph self-check failed ({len(failures)} graph(s), every rank stops): "
                f"{summary} (FD_CUDAGRAPH_SELF_CHECK=error)"
            )
        for index, phase, size in sorted({(i, p, s) for _, i, p, s, _ in failures}):
            members[index].disable_graph(phase, size)
        logger.warning(
            "CUDA graph self-check failed: %s. Every rank serves these sizes eagerly from now on.",
            summary,
        )

    def note_warmups(self, backend: Member, phase: str, size: int, count: int) -> None:
        """Warm-ups run for one size in the warm-only pass, to report with its capture."""
        self._warmed[(id(backend), phase, size)] = count

    def _close(self) -> None:
        global _active, _ended
        for bar in self._bars.values():
            bar.close()
        if self._unfreeze:
            gc.unfreeze()
        _active = None
        _ended += 1
        self.report.seconds = time.perf_counter() - self._started

    def _finish(self) -> None:
        logger.info("%s", self.report.summary())
        member: Member
        for member in stats.live_backends():
            member.capture_report = self.report
        path = self.options.memory_report
        if path:
            path = stats.output_path(path)
            try:
                directory = os.path.dirname(path)
                if directory:
                    os.makedirs(directory, exist_ok=True)
                with open(path, "w", encoding="utf-8") as handle:
                    json.dump(self.report.to_json(), handle, indent=1)
            except OSError as error:
                # The graphs are captured; a report that cannot be written must not stop the
                # worker from serving them.
                stats.output_failed("FD_CUDAGRAPH_MEMORY_REPORT", path, error)

    def check_plan(self) -> None:
        """Every TP rank must plan the same captures; compare before the first one."""
        self._plan_checked = True
        if self.exchange is None:
            return
        from fd_cudagraph_plugin import __version__

        mine = {
            "plugin_version": __version__,
            "phase": self.phase,
            "warmup_policy": self.options.warmup,
            "pool": self.options.pool,
            "self_check": self.options.self_check,
        }
        member: Member
        for index, member in enumerate(stats.live_backends()):
            for key, value in member.plan_fingerprint().items():
                mine[f"backend{index}.{key}"] = value
        everyone = self.exchange.all_gather(mine)
        diff = plan_diff(everyone)
        if diff:
            raise RankMismatchError(
                f"tensor-parallel ranks plan different CUDA-graph captures (this is rank "
                f"{self.rank}); capturing would hang in the custom all-reduce registration. "
                + " | ".join(diff)
                + ". Start every rank with the same --graph-optimization-config, "
                "--speculative-config, --max-num-seqs and FD_CUDAGRAPH_* variables."
            )

    def record(
        self, backend: Member, phase: str, size: int, seconds: float, graph_bytes: int, warmups: int
    ) -> None:
        """One graph captured: report it, with the warm-ups of the warm-only pass."""
        warmups += self._warmed.pop((id(backend), phase, size), 0)
        record = CaptureRecord(
            backend=f"{id(backend):#x}",
            role=backend.role,
            phase=phase,
            size=size,
            seconds=seconds,
            graph_bytes=graph_bytes,
            warmups=warmups,
        )
        self.report.records.append(record)
        self._progress(backend, record)

    def _progress(self, backend: Member, record: CaptureRecord) -> None:
        if self.rank != 0:
            return
        label = "draft" if record.role == "draft" else record.phase
        bar = self._bars.get((label, record.backend))
        if bar is None:
            from tqdm import tqdm

            total = backend.graphs_expected(record.phase)
            bar = tqdm(
                total=total,
                desc=f"CUDA graphs ({label})",
                unit="graph",
                # Always on rank 0: in a FastDeploy worker stderr goes to its log file, where
                # tqdm writes a line per update, as for FastDeploy's own weight-loading bars.
                file=sys.stderr,
            )
            self._bars[(label, record.backend)] = bar
        graph_bytes = sum(r.graph_bytes for r in self.report.records if r.backend == record.backend)
        bar.set_postfix_str(f"size {record.size}, graph memory {human_bytes(graph_bytes)}")
        bar.update(1)
