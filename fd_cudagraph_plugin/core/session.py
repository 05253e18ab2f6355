"""Capture sessions: FastDeploy's capture loops, wrapped, from the plan to the summary line.

FastDeploy's ``capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture. Each runs inside a ``CaptureSession``
(``hooks.py`` opens it), which:

* holds off Python's automatic garbage collection for the session, so no collection of the
  process's live objects pauses a capture, and turns it back on afterwards, also on error (no
  full collection first, and no ``gc.freeze()``: docs/design.md says what each cost);
* agrees the plan of every tensor-parallel rank before the first capture (``plan_of``: what must
  be equal on every rank for captures to line up) and the warm-ups each graph gets
  (``warmups.py``); its ``Agreement`` holds the later points (``agreement.py``);
* shows a progress bar per phase on rank 0, records each graph in a ``CaptureReport``, and ends
  with one summary line and the report on every backend that took part.

Nothing the session writes beside the captures (the bar, the log, the report file) can stop it:
a write that fails is counted and logged once (``outputs.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import msgspec

from fd_cudagraph_plugin.core import budget, fit, lifecycle, outputs, process, seam, warmups
from fd_cudagraph_plugin.core.budget import Reserve
from fd_cudagraph_plugin.core.capture import Registered, register, self_checks
from fd_cudagraph_plugin.core.errors import CaptureError, RankMismatchError, human_bytes, plural
from fd_cudagraph_plugin.core.graphs import DECODE, Captured, GraphEntry, GraphKey
from fd_cudagraph_plugin.core.moved import summary as moved_summary
from fd_cudagraph_plugin.core.ranks.agreement import (
    Agreement,
    for_session,
    forget_locals,
    link_for,
    release_held,
)
from fd_cudagraph_plugin.core.ranks.link import Link
from fd_cudagraph_plugin.core.ranks.messages import PlanPayload, RankMemory
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.warmups import WarmedSizes

logger = logging.getLogger("fd_cudagraph_plugin")


class SessionBackend(Registered, lifecycle.LifecycleBackend, Protocol):
    """What a session asks of each backend taking part in it."""

    settings: Settings
    warmed: WarmedSizes
    role: str
    capture_report: CaptureReport | None

    def expected(self) -> list[GraphEntry]:
        """The graphs this backend captures in a full session."""

    def session_opened(self, session: CaptureSession, role: str | None) -> None:
        """The session opened for this backend; ``role`` is its part in FastDeploy's model."""

    def session_closed(self, report: CaptureReport | None) -> None:
        """The session closed; ``report`` is what it captured (None when it failed)."""

    def traffic_since_capture(self) -> dict[int, int]:
        """Decode steps served per key since its last capture session ended."""

    def recorded_traffic(self) -> dict[int, int]:
        """The decode steps its stats file recorded for this plan at earlier starts."""

    def adopt_sizes(self, sizes: tuple[int, ...] | None) -> None:
        """Capture and serve only ``sizes`` of its decode sizes until its graphs are released
        (None: all of them)."""


# ---------------------------------------------------------------------------------- the plan

#: Lists up to this long are compared (and shown in a mismatch) in full; longer ones travel as
#: their length and a digest, so that a post stays small whatever the sizes.
FULL_LIST = 64


def plan_of(member: SessionBackend) -> dict[str, Any]:
    """What must be equal on every tensor-parallel rank for one backend's captures to line up."""
    s = member.settings
    return {
        "capture_sizes": list(s.capture_sizes),
        "prefill_sizes": list(s.mode.prefill_sizes),
        "mode": s.mode.name,
        "only_prefill": s.only_prefill,
        "warmups": s.num_warmups,
        "speculative_method": s.speculative_method,
        "num_speculative_tokens": s.num_speculative_tokens,
        "bsz_table": list(s.bsz_table),
    }


def backends_plan(members: Sequence[SessionBackend]) -> dict[str, Any]:
    """Each backend's plan, its keys prefixed with the backend's place; long lists compacted."""
    return {
        f"backend{index}.{key}": _compact(value)
        for index, member in enumerate(members)
        for key, value in plan_of(member).items()
    }


def _compact(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) > FULL_LIST:
        text = json.dumps(list(value), separators=(",", ":"), default=str)
        return f"{len(value)} entries, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


def plan_diff(plans: list[dict[str, Any]]) -> list[str]:
    """One line per rank whose plan differs from rank 0's, naming each differing key."""
    lines = []
    reference = plans[0]
    for rank, plan in enumerate(plans[1:], start=1):
        keys = sorted(set(reference) | set(plan))
        diffs = [
            f"{key}: rank 0 {_short(reference.get(key))} vs rank {rank} {_short(plan.get(key))}"
            for key in keys
            if reference.get(key) != plan.get(key)
        ]
        if diffs:
            lines.append(f"rank {rank}: " + "; ".join(diffs[:8]) + ("; ..." if diffs[8:] else ""))
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# -------------------------------------------------------------------------------- the report


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
    """What one session captured: ``summary()`` is its one log line, ``to_json()`` what
    ``FD_CUDAGRAPH_MEMORY_REPORT`` writes."""

    phase: str
    rank: int
    #: What FD_CUDAGRAPH_KV_RESERVE did at this start (``reserve.py`` hands it on).
    reserve: Reserve = field(default_factory=lambda: Reserve(budget.Choice.OFF))
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
    #: Why the plugin ran this capture itself (``lifecycle.py``), or "".
    cause: str = ""
    #: What a graph reads that moved since the capture before (None: there was none before).
    moved: list[str] | None = None
    #: Which decode sizes a fit to traffic captured, and from what (``FD_CUDAGRAPH_FIT``).
    fit: str = ""
    fit_sizes: tuple[int, ...] = ()

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
        if self.fit:
            text += f"; {self.fit}"
        if self.cause:
            text = f"recaptured by the plugin {self.cause}: {text}"
        elif self.moved is not None:
            # A capture FastDeploy asked for again: say whether it had to.
            text += "; since the last capture " + (
                f"moved: {moved_summary(self.moved)}"
                if self.moved
                else "nothing a graph reads moved (graphs were re-made all the same)"
            )
        return text

    def _warmup_text(self) -> str:
        per_graph = sorted({r.warmups for r in self.records})
        if self.warmup_note:
            return f"{plural(self.warmups, 'warm-up')}: {self.warmup_note}"
        if len(per_graph) == 1:
            return f"{plural(per_graph[0], 'warm-up')} each"
        return f"{per_graph[0]}-{per_graph[-1]} warm-ups each"

    def out_of_memory_advice(self, participant: SessionBackend, phase: str) -> str:
        """What to change, from what this rank knew of memory when a capture ran out of it; the
        rank posts it with its failure, so every rank prints it."""
        device = participant.runtime.device_memory()
        expected = sum(1 for e in participant.expected() if e.phase == phase)
        return budget.oom_advice(
            captured_bytes=self.graph_bytes,
            graphs_done=self.graphs,
            graphs_planned=max(expected, self.graphs + 1),
            free=device[0] if device else None,
            total=device[1] if device else None,
            utilization=participant.settings.gpu_memory_utilization,
            reserve=self.reserve,
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
            "fitted_sizes": list(self.fit_sizes) or None,
            "captures": [asdict(r) for r in self.records],
            "memory": [
                {
                    **msgspec.structs.asdict(m),
                    "fit_gpu_memory_utilization": None
                    if m.utilization is None or not m.total
                    else budget.fit_utilization(m.utilization, m.free, m.total),
                }
                for m in self.memory
            ],
        }


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 0.1 else f"{value * 1e3:.0f} ms"


# ------------------------------------------------------------------------------- the session


class Progress:
    """tqdm bars on rank 0, one per phase and backend. In a FastDeploy worker stderr goes to its
    log file, where tqdm writes a line per update, as for FastDeploy's own weight-loading bars. A
    bar that cannot be drawn (stderr closed, full, or gone) is counted once and never again."""

    def __init__(self, enabled: bool, failures: outputs.OutputFailures) -> None:
        self._enabled = enabled and sys.stderr is not None
        self._failures = failures
        self._bars: dict[tuple[str, str], Any] = {}

    def step(self, label: str, backend: str, total: int, postfix: str) -> None:
        if not self._enabled:
            return
        try:
            bar = self._bars.get((label, backend))
            if bar is None:
                from tqdm import tqdm

                bar = tqdm(
                    total=total, desc=f"CUDA graphs ({label})", unit="graph", file=sys.stderr
                )
                self._bars[(label, backend)] = bar
            # Drawn at tqdm's own pace (update's mininterval), not at every graph.
            bar.set_postfix_str(postfix, refresh=False)
            bar.update(1)
        except Exception as error:
            self._enabled = False
            self._failures.failed("progress bar", "stderr", error)

    def close(self) -> None:
        for bar in self._bars.values():
            try:
                bar.close()
            except Exception as error:
                self._failures.failed("progress bar", "stderr", error)
        self._bars.clear()


class CaptureSession:
    """One run of a FastDeploy capture loop. Use as a context manager.

    ``ordered=False`` lets decode sizes come in any order (the KV reserve's probe captures three
    out of order, the same three on every rank); ``purpose`` names such a session in its line."""

    def __init__(
        self,
        phase: str,
        *,
        fd_config: Any = None,
        runner: Any = None,
        link: Link | None = None,
        ordered: bool = True,
        purpose: str = "",
        reserve: Reserve | None = None,
    ) -> None:
        self.process = process.current()
        self.options = self.process.options
        self.phase = phase
        self.fd_config = fd_config
        self.runner = runner
        self.ordered = ordered
        self.purpose = purpose
        self._link = link
        #: What FD_CUDAGRAPH_KV_RESERVE did at this start, for the report and the advice.
        self.reserve = reserve or Reserve.asked(self.options.kv_reserve)
        self.agreement: Agreement | None = None
        self.report: CaptureReport | None = None
        self.members: list[SessionBackend] = []
        self._plan_checked = False
        #: Sizes each member warms in this session, agreed at the plan point.
        self._to_warm: dict[int, dict[str, set[int]]] = {}
        #: The driver's (free, total) before the first capture's warm-ups.
        self._device_before: tuple[int, int] | None = None
        self._progress: Progress | None = None
        self._started = 0.0
        self._collect_again = False
        #: A custom all-reduce exists: graphs wait for the session's one registration.
        self.registers = False
        #: The graphs captured so far whose all-reduce buffers are not registered yet, with
        #: the inputs each was captured on (its self-check replays against eager on them).
        self._unregistered: list[tuple[SessionBackend, GraphEntry, dict]] = []
        #: The decode sizes every rank captures in this session where a fit to traffic chose
        #: fewer than FastDeploy's list (``FD_CUDAGRAPH_FIT``): what its capture loop visits.
        self.fitted_sizes: tuple[int, ...] | None = None

    @property
    def rank(self) -> int:
        return self.agreement.rank if self.agreement is not None else 0

    def __enter__(self) -> CaptureSession:
        if self.process.session is not None:
            raise RuntimeError("capture sessions do not nest")
        self._started = time.perf_counter()
        self._collect_again = gc.isenabled()
        gc.disable()
        try:
            link = self._link or link_for(self.fd_config, self.process)
            self.report = CaptureReport(self.phase, link.rank, self.reserve)
            scope = lifecycle.state(self.process).session_scope()
            self.agreement = for_session(link, self.process, self.report, scope)
            self.registers = seam.custom_allreduce() is not None
            self._progress = Progress(link.rank == 0, self.process.outputs)
            self.process.session = self
            for backend in self.process.backends():
                self.join(backend)
            self.check_plan(fitting=True)
        except BaseException:
            self._close(failed=True)
            raise
        self.report.setup_seconds = time.perf_counter() - self._started
        return self

    def join(self, member: SessionBackend) -> None:
        """``member`` takes part in this session (it existed at the start, or was built in it)."""
        if member in self.members:
            return
        role = None
        if self.runner is not None:
            # From FastDeploy's structure, not from the order backends were built: a worker that
            # rebuilt its model may still hold the old model's backend.
            role = seam.role_of(getattr(member, "layer", None), self.runner) or "other"
        self.members.append(member)
        member.session_opened(self, role)

    def before_capture(self, member: SessionBackend, key: GraphKey) -> int:
        """``member`` begins a capture of ``key``: its warm-ups, FastDeploy's configured count
        where any rank has not warmed it in this process, else one (``warmups.py`` says why).
        Where the backends were built inside the capture loop (no profile run), none existed at
        ``__enter__``: the plan is agreed again, with them."""
        if not self._plan_checked:
            self.check_plan()
        if self._device_before is None:  # before the first warm-up: it counts too
            self._device_before = member.runtime.device_memory()
        configured = member.settings.num_warmups
        index = self.members.index(member) if member in self.members else -1
        to_warm = self._to_warm.get(index)
        if to_warm is None or key.static or key.size in to_warm.get(key.phase, ()):
            return configured
        return min(configured, warmups.AFTER_FIRST_CAPTURE)

    def check_plan(self, fitting: bool = False) -> None:
        """Every TP rank must plan the same captures; compared before the first one. Each also
        says what it has not warmed; every rank warms what any rank has not. With ``fitting``
        (the check at the session's start, before FastDeploy's loop walks its list), each also
        proposes its fit to traffic, and every rank adopts rank 0's."""
        from fd_cudagraph_plugin import __version__

        self._plan_checked = bool(self.members)
        plan: dict[str, Any] = {
            "plugin_version": __version__,
            "phase": self.phase,
            "pool": self.options.pool,
            "self_check": self.options.self_check,
            "fit": str(self.options.fit or "off"),
            "custom_allreduce": seam.custom_allreduce() is not None,
            "backends": len(self.members),
            **backends_plan(self.members),
        }
        fittable = self._fittable() if fitting else []
        proposal: list[fit.Fitted | None] = [None]

        def mine() -> PlanPayload:
            # In the point's step: a fit that fails is this rank's failure, posted to the others.
            proposal[0] = self._fit(fittable)
            unwarmed = [m.warmed.missing(e.key for e in m.expected()) for m in self.members]
            sizes = list(proposal[0].sizes) if proposal[0] else []
            return PlanPayload(plan=plan, unwarmed=unwarmed, fitted=sizes)

        everyone = self.agreement.share("plan", None, None, mine, PlanPayload)
        diff = plan_diff([e.plan for e in everyone])
        if diff:
            raise self.agreement.stop(
                RankMismatchError(
                    "tensor-parallel ranks plan different CUDA-graph captures; capturing would "
                    "hang in the custom all-reduce registration. "
                    + " | ".join(diff)
                    + ". Start every rank with the same --graph-optimization-config, "
                    "--speculative-config, --max-num-seqs and FD_CUDAGRAPH_* variables.",
                    stage="plan",
                )
            )
        self._to_warm = warmups.agreed([e.unwarmed for e in everyone], len(self.members))
        if fitting:
            self._adopt(fittable, tuple(sorted(set(everyone[0].fitted), reverse=True)), proposal[0])

    def _fittable(self) -> list[SessionBackend]:
        """The members a fit to traffic applies to: plain decode graphs, none held (a fit
        changes which sizes exist), all with one largest size."""
        if self.options.fit is None or self.phase != DECODE or not self.ordered or self.purpose:
            return []
        members = [m for m in self.members if m.settings.mode.fittable]
        if not members or any(m.has_graphs() for m in members):
            return []
        if len({max(m.settings.capture_sizes) for m in members}) > 1:
            return []
        return members

    def _fit(self, members: list[SessionBackend]) -> fit.Fitted | None:
        """This rank's proposal: the target's traffic since its last capture (at a start, what
        its stats file recorded of the same plan), fitted over the sizes every member has."""
        if not members:
            return None
        target = next((m for m in members if m.role == "target"), members[0])
        settings = target.settings
        unit = settings.num_speculative_tokens + 1 if settings.mode.keyed_by_running else 1
        common = set.intersection(*(set(m.settings.capture_sizes) for m in members))
        # Under speculative decoding keys are running requests: a size holds size // unit; of
        # sizes that hold as many, the largest stands for them, so the largest is always kept.
        by_capacity = {size // unit: size for size in sorted(common)}
        traffic = target.traffic_since_capture()
        if target.capture_report is None and sum(traffic.values()) < fit.MIN_STEPS:
            traffic = target.recorded_traffic()  # a start: the same plan's earlier traffic
        result = fit.fit(traffic, list(by_capacity), self.options.fit, unit)
        if result.why:
            self.report.fit = result.describe(settings.capture_sizes)
            return None
        sizes = tuple(sorted((by_capacity[c] for c in result.sizes), reverse=True))
        return dataclasses.replace(result, sizes=sizes)

    def _adopt(
        self, members: list[SessionBackend], sizes: tuple[int, ...], mine: fit.Fitted | None
    ) -> None:
        """Every rank captures rank 0's fitted list (none: FastDeploy's); one that cannot (no
        member a fit applies to, not its sizes here, its largest missing) fails the session on
        every rank, as a plan mismatch does."""
        for member in members if sizes else []:
            own = member.settings.capture_sizes
            if not set(sizes) <= set(own) or max(own) not in sizes:
                members = []
        if sizes and not members:
            raise self.agreement.stop(
                RankMismatchError(
                    f"rank 0 fitted the decode sizes {list(sizes)} to its traffic, which this "
                    "rank cannot capture (no backend a fit applies to holds them with its "
                    "largest size); start every rank with the same settings and FD_CUDAGRAPH_* "
                    "variables.",
                    stage="plan",
                )
            )
        for member in members:
            member.adopt_sizes(sizes or None)  # none: FastDeploy's list, whatever came before
        if not sizes:
            return
        self.fitted_sizes = self.report.fit_sizes = sizes
        default = members[0].settings.capture_sizes
        if mine is not None and mine.sizes == sizes:
            source = mine.describe(default)
        else:  # another rank: rank 0's list, whatever its own steps fit
            source = "rank 0's fit" + (
                f"; this rank's steps fit {list(mine.sizes)}" if mine else ""
            )
        self.report.fit = f"decode sizes {', '.join(map(str, sizes))}: {source}"

    def _register(self) -> None:
        """Register the all-reduce buffers of every graph of the session at once (one collective
        over the TP group, entered only once every rank has said its capture loop ended well:
        FastDeploy keeps them all until then, as vLLM registers once per session), publish them,
        then self-check them (a replay each) at one point."""
        pending = self._unregistered  # kept there until registered: _close discards them
        if not pending:
            return
        if self.registers:
            # FastDeploy's own code may still fail on a rank after the last backend step: no rank
            # enters the registration's all_gather_object before every rank said it did not.
            self.agreement.run("capture loop", None, None, lambda: None)
        register(self.agreement, None, None)
        self._unregistered = []
        for member, entry, _ in pending:
            member.publish(entry)
        mode = self.options.self_check
        checked = [(f"{m.role} {e.key}", m, e, kw) for m, e, kw in pending if not e.key.static]
        if mode == "off" or not checked:
            return
        checks = [
            (label, m, e.key, lambda m=m, e=e, kw=kw: m.check(e, kw)) for label, m, e, kw in checked
        ]
        failed = self_checks(self.agreement, checks, mode == "error")
        for label, member, entry, _ in checked:
            if label in failed:
                member.disable(entry)

    def record(
        self, member: SessionBackend, entry: GraphEntry, captured: Captured, kwargs: dict
    ) -> bool:
        """``member`` captured ``entry`` on ``kwargs``: report it. True when it serves only once
        the session registered it, at its end."""
        key = captured.key
        record = CaptureRecord(
            backend=f"{id(member):#x}",
            role=member.role,
            phase=key.phase,
            size=key.size,
            seconds=captured.seconds,
            graph_bytes=captured.graph_bytes,
            warmups=captured.warmups,
        )
        self.report.records.append(record)
        label = "draft" if record.role == "draft" else record.phase
        graph_bytes = sum(r.graph_bytes for r in self.report.records if r.backend == record.backend)
        self._progress.step(
            label,
            record.backend,
            sum(1 for e in member.expected() if e.phase == record.phase),
            f"size {record.size}, graph memory {human_bytes(graph_bytes)}",
        )
        if self.registers:
            self._unregistered.append((member, entry, kwargs))
        return self.registers

    def _my_memory(self) -> RankMemory | None:
        """This rank's figures for the session end: None where no graph was captured."""
        if not self.members or self._device_before is None:
            return None
        member = self.members[0]
        device, before = member.runtime.device_memory(), self._device_before
        taken = self.report.graph_bytes
        if device is not None and before is not None:
            taken = max(before[0] - device[0], taken)
        return RankMemory(
            rank=self.rank,
            graph_bytes=self.report.graph_bytes,
            taken_bytes=taken,
            free=device[0] if device else 0,
            total=device[1] if device else 0,
            utilization=member.settings.gpu_memory_utilization,
            simulated=not member.runtime.real_graphs,
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        agreement = self.agreement
        try:
            if exc_type is None:
                self._register()
                shared = agreement.share(
                    "end", None, None, self._my_memory, (RankMemory, type(None))
                )
                if all(shared):
                    self.report.memory = shared
            else:
                # An interrupt too: posted at this rank's next point, so that the others stop
                # there at once instead of waiting out their timeout.
                forget_locals(exc)
                agreed = agreement.failure or agreement.fail("capture loop", exc)
                if agreed is not exc and isinstance(exc, Exception):
                    # FastDeploy's capture_model() rewraps errors that mention "out of memory";
                    # every rank raises the agreed error itself, with the same text.
                    agreed.__suppress_context__ = True
                    raise agreed
        except BaseException:
            self._close(failed=True)
            raise
        self._close(failed=exc_type is not None)
        if exc_type is None:
            self._finish()
            release_held(self.process)

    def _close(self, failed: bool) -> None:
        for member, entry, _ in self._unregistered:  # never registered: they never serve
            member.discard(entry)
        self._unregistered.clear()
        if self._progress is not None:
            self._progress.close()
        if self._collect_again:
            gc.enable()
        if self.process.session is self:
            self.process.session = None
            self.process.sessions_ended += 1
        if self.report is not None:
            self.report.seconds = time.perf_counter() - self._started
        for member in self.members:
            member.session_closed(None if failed else self.report)

    def _finish(self) -> None:
        report = self.report
        report.warmup_note = warmups.note(report, self.members)
        owner = lifecycle.state(self.process)
        report.cause = owner.cause
        report.moved = owner.captured(
            self.phase, self.members if report.records else [], self.runner
        )
        prefix = f"{self.purpose}: " if self.purpose else ""
        logger.info("%s%s", prefix, report.summary())
        path = self.options.memory_report
        if path:
            path = outputs.output_path(path, self.members[-1].settings if self.members else None)
            try:
                outputs.write_file(path, json.dumps(report.to_json(), indent=1))
            except OSError as error:
                # The graphs are captured; a report that cannot be written must not stop the
                # worker from serving them.
                self.process.outputs.failed("FD_CUDAGRAPH_MEMORY_REPORT", path, error)


__all__ = ["CaptureError", "CaptureReport", "CaptureSession", "Progress"]
