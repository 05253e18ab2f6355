"""Capture sessions: FastDeploy's capture loops, wrapped, and the points where ranks agree.

FastDeploy's ``capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture. Each runs inside a ``CaptureSession``
(``hooks.py`` opens it), which:

* holds off Python's automatic garbage collection for the session, so no collection of the
  process's live objects pauses a capture, and turns it back on afterwards, also on error (no
  full collection first: with Paddle loaded one took 60-100 ms that FastDeploy's own capture does
  not spend; ``gc.freeze()``'s bookkeeping, ``gc.get_freeze_count()``, took up to 17 ms a
  session on the H200 host, so it is not used);
* has every tensor-parallel rank agree at fixed points (``Points``), so that a failure on one rank
  becomes the same ``CaptureError`` on every rank before any rank enters a collective the failed
  one will not join;
* shows a progress bar per phase on rank 0, records each graph's capture time and memory, and
  ends with one summary line and a ``CaptureReport`` on every member backend.

The agreement points of a session, in order (TP = 1 runs the same code, agreeing with itself):

1. ``plan`` at the start: every rank's capture plan; a difference is a ``RankMismatchError``;
2. per graph: ``warm-up`` (after the eager warm-ups, before the device synchronises: a rank whose
   warm-up failed never launched its all-reduces, so a peer must not block on them),
   ``capture`` (before the custom all-reduce registration, so a failed rank is never waited for
   there), ``registration`` (before the next warm-up's all-reduces), ``self-check`` when it is on;
3. ``static probe`` before the first static-full decode capture: which graphs decode;
4. ``end``: catches a rank that failed anywhere between two points (FastDeploy's code between
   backend calls included): that rank posts its failure at its next point, whichever it is.

A rank whose step failed still posts and waits at that point; every rank raises the error built
from all ranks' statuses, so the message is the same on every rank.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from fd_cudagraph_plugin.core import budget, fastdeploy, stats, worker
from fd_cudagraph_plugin.core.agreement import Link, LocalLink, Outcome, SocketLink, bind_host
from fd_cudagraph_plugin.core.errors import (
    CaptureError,
    CudaGraphPluginError,
    RankMismatchError,
    RankTimeoutError,
    SelfCheckError,
)
from fd_cudagraph_plugin.core.key import GraphKey
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.stats import human_bytes

logger = logging.getLogger("fd_cudagraph_plugin")

T = TypeVar("T")

_OOM_ADVICE = (
    "Out of memory: lower --max-num-seqs or --gpu-memory-utilization, or trim "
    "cudagraph_capture_sizes in --graph-optimization-config."
)
_OP_ADVICE = (
    "An op in the model cannot be captured or run at this size: fix it, or serve without CUDA "
    "graphs (--graph-optimization-config '{\"use_cudagraph\": false}')."
)
_REGISTRATION_ADVICE = (
    "FastDeploy's custom all-reduce could not register the graph's buffers: serve with "
    "--disable-custom-all-reduce, or without CUDA graphs."
)
_RESTART = (
    " The failure happened inside the capture, after which Paddle cannot capture again in that "
    "process: restart the worker once the cause is fixed."
)


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
    seconds: float = 0.0
    #: Of ``seconds``: the one-off start (the plan agreement).
    setup_seconds: float = 0.0
    #: Of ``seconds``: time spent at agreement points (waiting for other ranks included).
    agreement_seconds: float = 0.0
    agreement_points: int = 0
    records: list[CaptureRecord] = field(default_factory=list)
    #: Every rank's memory after the session (shared at its end), when the device can say.
    memory: list[Any] = field(default_factory=list)

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
        seconds = _seconds(self.seconds)
        if not self.records:
            return f"{self.phase} capture session: no graphs captured in {seconds}"
        sizes = sorted({r.size for r in self.records})
        warmups = sorted({r.warmups for r in self.records})
        warm = f"{warmups[0]}" if len(warmups) == 1 else f"{warmups[0]}-{warmups[-1]}"
        backends = len({r.backend for r in self.records})
        size_text = f"size {sizes[0]}" if len(sizes) == 1 else f"sizes {sizes[0]}..{sizes[-1]}"
        text = (
            f"captured {self.graphs} graph{'s' if self.graphs != 1 else ''} ({size_text}"
            f"{f', {backends} backends' if backends > 1 else ''}) in {seconds}, "
            f"graph memory {human_bytes(self.graph_bytes)} "
            f"(largest graph {human_bytes(self.largest_graph_bytes)}), {warm} warm-ups each"
        )
        if self.memory:
            text += "; " + budget.memory_line(self.memory, self.rank)
        return text

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


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 0.1 else f"{value * 1e3:.0f} ms"


class Member(Protocol):
    """What a session asks of each backend taking part in it."""

    role: str
    capture_report: CaptureReport | None
    settings: Any
    runtime: Any

    def plan_fingerprint(self) -> dict[str, Any]:
        """What must be equal on every tensor-parallel rank for captures to line up."""

    def graphs_expected(self, phase: str) -> int:
        """How many graphs of ``phase`` this backend captures in a full session."""

    def join_session(self, session: CaptureSession | None) -> None:
        """The session opened (or, with None, closed) for this backend."""


# ------------------------------------------------------------------------ agreement points


def _failure(stage: str, where: str, mode: str, rank: int, error: BaseException) -> dict:
    text = str(error).rstrip(". ")
    return {
        "rank": rank,
        "stage": stage,
        "where": where,
        "mode": mode,
        "error": f"{type(error).__name__}: {text}",
        "out_of_memory": "out of memory" in text.lower() or isinstance(error, MemoryError),
        # The plugin's own errors (capture order, configuration) already say what to do.
        "explained": isinstance(error, CudaGraphPluginError),
    }


def _advice(failures: list[dict]) -> str:
    memory = [f["memory"] for f in failures if f["out_of_memory"] and f.get("memory")]
    if memory:
        return " " + budget.oom_advice(**memory[0])
    if any(f["out_of_memory"] for f in failures):
        return " " + _OOM_ADVICE
    unexplained = [f for f in failures if not f["explained"]]
    if not unexplained:
        return ""
    if all(f["stage"] == "registration" for f in unexplained):
        return " " + _REGISTRATION_ADVICE
    if all(f["stage"] in ("warm-up", "capture", "static probe") for f in unexplained):
        return " " + _OP_ADVICE
    return ""


def agreed_error(outcome: Outcome, world: int, timeout: float, rank: int) -> CaptureError | None:
    """The error every rank raises for ``outcome``, or None when every rank is fine.

    Built only from the outcome, which the server gives every rank alike, so the text is the same
    on every rank (the rank that raises it is in its worker log's name)."""
    failures = outcome.failures
    missing = [r for r in outcome.missing if r not in failures]
    if not failures and not missing:
        return None
    parts = []
    for failed_rank, failure in failures.items():
        where = f" for {failure['where']}" if failure["where"] else ""
        on = f" on tensor-parallel rank {failed_rank} of {world}" if world > 1 else ""
        parts.append(
            f"CUDA graph {failure['stage']} failed{on}{where} ({failure['mode']}): "
            f"{failure['error']}"
        )
    text = "; ".join(parts)
    if failures:
        text += "." + _advice(list(failures.values()))
        if any(f["stage"] == "capture" for f in failures.values()):
            text += _RESTART
    if missing:
        lost = [r for r in missing if r in outcome.lost]
        late = [r for r in missing if r not in outcome.lost]
        if text:
            text += " "
        if lost:
            text += (
                f"Tensor-parallel rank{_s(lost)} {_ranks(lost)} closed {_their(lost)} connection "
                f"(the process exited or crashed) before the agreement point "
                f"'{outcome.label}'. "
            )
        if late:
            text += (
                f"Tensor-parallel rank{_s(late)} {_ranks(late)} did not reach the agreement point "
                f"'{outcome.label}' within {timeout:.0f} s (FD_CUDAGRAPH_RANK_TIMEOUT): "
                f"{'it' if len(late) == 1 else 'they'} exited, hang, or do not run "
                f"fd-cudagraph-plugin (set FD_PLUGINS=fd_cudagraph_plugin for every worker). "
            )
        text = text.rstrip()
    if world > 1:
        named = sorted({*failures, *missing})
        text += (
            f" Every rank stops here, so none waits in a collective that rank{_s(named)} "
            f"{_ranks(named)} will not join."
        )
    error_type: type[CaptureError] = RankTimeoutError if missing and not failures else CaptureError
    if failures and all(f["stage"] == "self-check" for f in failures.values()):
        error_type = SelfCheckError if not missing else CaptureError
    stage = next(iter(failures.values()))["stage"] if failures else "agreement"
    return error_type(
        text,
        stage=stage,
        failed_ranks=tuple(failures),
        missing_ranks=tuple(missing),
    )


def _s(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _their(ranks: list[int]) -> str:
    return "their" if len(ranks) > 1 else "its"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class Points:
    """The agreement points of one session (or, with no session, of one backend alone)."""

    def __init__(self, link: Link, options: PluginOptions, report: CaptureReport | None) -> None:
        self.link = link
        self.options = options
        self.report = report
        #: The agreed failure that stopped this session; every later point re-raises it.
        self.failure: CaptureError | None = None

    @property
    def rank(self) -> int:
        return self.link.rank

    def run(
        self,
        stage: str,
        member: Member | None,
        key: GraphKey | None,
        fn: Callable[[], T],
    ) -> T:
        """Run ``fn`` on this rank, then agree: raise the same ``CaptureError`` on every rank if
        it failed on any; else return ``fn``'s result."""
        box: list[T] = []
        return self._agree(stage, member, key, lambda: box.append(fn()), share=False, box=box)

    def share(
        self, stage: str, member: Member | None, key: GraphKey | None, fn: Callable[[], Any]
    ) -> list[Any]:
        """Like ``run``, and return every rank's result of ``fn`` (JSON-able), in rank order."""
        return self._agree(stage, member, key, fn, share=True, box=None)

    def fail(self, stage: str, error: BaseException) -> CaptureError:
        """This rank failed outside a point: post the failure at the next point, return the
        agreed error (the other ranks meet it there, whichever point they are at)."""
        if self.failure is not None:
            return self.failure

        def raise_it() -> None:
            raise error

        try:
            self._agree(stage, None, None, raise_it, share=False, box=None)
        except CaptureError as agreed:
            return agreed
        raise AssertionError("a posted failure always ends in an error")  # pragma: no cover

    def _agree(self, stage, member, key, fn, *, share, box):
        if self.failure is not None:
            raise self.failure
        where = str(key) if key is not None else ""
        mode = _mode(member, key)
        status: dict[str, Any] | None
        try:
            result = fn()
        except Exception as error:
            failure = _failure(stage, where, mode, self.rank, error)
            if failure["out_of_memory"] and member is not None:
                failure["memory"] = self._memory_at_failure(member, key)
            status = {"failure": failure}
            local: BaseException | None = error
            _forget_locals(error)
        else:
            status = {"payload": result} if share else None
            local = None
        label = f"{stage} {where}".strip()
        if member is not None:
            label += f" ({member.role})"
        started = time.perf_counter()
        outcome = self.link.agree(label, status, self.options.rank_timeout)
        if self.report is not None:
            self.report.agreement_seconds += time.perf_counter() - started
            self.report.agreement_points += 1
        error = agreed_error(outcome, self.link.world, self.options.rank_timeout, self.rank)
        if error is not None:
            self.failure = error
            if local is not None:
                raise error from local
            raise error
        if share:
            return outcome.shared()
        return box[0] if box else None

    def _memory_at_failure(self, member: Member, key: GraphKey | None) -> dict[str, Any]:
        """What the failing rank knew of memory when a capture ran out of it."""
        device = member.runtime.device_memory()
        records = self.report.records if self.report is not None else []
        phase = key.phase if key is not None else "decode"
        return {
            "captured_bytes": sum(r.graph_bytes for r in records),
            "graphs_done": len(records),
            "graphs_planned": max(member.graphs_expected(phase), len(records) + 1),
            "free": device[0] if device else None,
            "total": device[1] if device else None,
            "utilization": member.settings.gpu_memory_utilization,
        }


def _forget_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames the error's traceback holds: a failed capture's
    frames hold tensors in graph-pool memory, which would stay allocated for as long as anyone
    keeps the error (FastDeploy's worker logs and re-raises it). Line numbers stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _mode(member: Member | None, key: GraphKey | None) -> str:
    if member is None:
        return "between two agreement points, in FastDeploy's capture loop"
    settings = member.settings
    mode = key.mode if key is not None else settings.mode
    return (
        f"{mode} mode, graph_opt_level={settings.graph_opt_level}, "
        f"full_cuda_graph={settings.full_cuda_graph}"
    )


def solo_points(options: PluginOptions) -> Points:
    """Points for a backend used outside any session (TP = 1 only): it agrees with itself."""
    return Points(LocalLink(), options, None)


def link_for(fd_config: Any, options: PluginOptions) -> Link:
    """This process's link to its tensor-parallel group's agreement server (made once)."""
    group = fastdeploy.tensor_parallel_group(fd_config)
    if group is None:
        return LocalLink()
    ranks, rank = group
    state = worker.current()
    name = f"{state.link_prefix}/{'-'.join(str(r) for r in ranks)}"
    link = state.links.get(name)
    if link is None:
        try:
            link = SocketLink.connect(
                fastdeploy.job_store(),
                name,
                rank,
                len(ranks),
                bind_host(),
                options.rank_timeout,
            )
        except Exception as error:
            raise RankTimeoutError(
                f"tensor-parallel rank {rank} could not join its group's CUDA graph agreement "
                f"(ranks {ranks}) within {options.rank_timeout:.0f} s: {type(error).__name__}: "
                f"{error}. Every worker of the group must run fd-cudagraph-plugin (FD_PLUGINS) "
                f"and start capture_model(); raise FD_CUDAGRAPH_RANK_TIMEOUT if rank 0 is slow.",
                stage="agreement",
            ) from error
        state.links[name] = link
    return link


# ------------------------------------------------------------------------------ the session


class CaptureSession:
    """One run of a FastDeploy capture loop. Use as a context manager."""

    def __init__(
        self,
        phase: str,
        *,
        fd_config: Any = None,
        runner: Any = None,
        options: PluginOptions | None = None,
        link: Link | None = None,
    ) -> None:
        self.options = options or PluginOptions.from_env()
        self.phase = phase
        self.fd_config = fd_config
        self.runner = runner
        self.worker = worker.current()
        self._link = link
        self.points: Points | None = None
        self.report: CaptureReport | None = None
        self.members: list[Member] = []
        self._plan_checked = False
        #: The driver's (free, total) before the first capture's warm-ups.
        self._device_before: tuple[int, int] | None = None
        self._bars: dict[tuple[str, str], Any] = {}
        self._started = 0.0
        self._collect_again = False

    @property
    def rank(self) -> int:
        return self.points.rank if self.points is not None else 0

    def __enter__(self) -> CaptureSession:
        if self.worker.session is not None:
            raise RuntimeError("capture sessions do not nest")
        self._started = time.perf_counter()
        self._collect_again = gc.isenabled()
        gc.disable()
        try:
            link = self._link or link_for(self.fd_config, self.options)
            link.next_epoch()
            self.report = CaptureReport(self.phase, link.rank)
            self.points = Points(link, self.options, self.report)
            self.worker.session = self
            for backend in self.worker.backends():
                self.join(backend)
            self.check_plan()
        except BaseException:
            self._close()
            raise
        self.report.setup_seconds = time.perf_counter() - self._started
        return self

    def join(self, member: Member) -> None:
        """``member`` takes part in this session (it existed at the start, or was built in it)."""
        if member in self.members:
            return
        if self.runner is not None:
            # From FastDeploy's structure, not from the order backends were built: a worker that
            # rebuilt its model may still hold the old model's backend.
            role = fastdeploy.role_of(getattr(member, "layer", None), self.runner)
            member.role = role or "other"
        self.members.append(member)
        member.join_session(self)

    def before_capture(self, member: Member) -> None:
        """Called by each capture. Where the backends were built inside the capture loop (no
        profile run), none existed at ``__enter__``: the plan is agreed again, with them."""
        if not self._plan_checked:
            self.check_plan()
        if self._device_before is None:  # before the first warm-up: it counts too
            self._device_before = member.runtime.device_memory()

    def _my_memory(self) -> dict[str, Any] | None:
        """This rank's figures for the session end: None where no graph was captured."""
        if not self.members or self._device_before is None:
            return None
        member = self.members[0]
        device, before = member.runtime.device_memory(), self._device_before
        taken = self.report.graph_bytes
        if device is not None and before is not None:
            taken = max(before[0] - device[0], taken)
        return asdict(
            budget.RankMemory(
                rank=self.rank,
                graph_bytes=self.report.graph_bytes,
                taken_bytes=taken,
                free=device[0] if device else 0,
                total=device[1] if device else 0,
                utilization=member.settings.gpu_memory_utilization,
                simulated=not member.runtime.real_graphs,
            )
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        points = self.points
        try:
            if exc_type is None:
                shared = points.share("end", None, None, self._my_memory)
                if all(shared):
                    self.report.memory = [budget.RankMemory.of(m) for m in shared]
            elif isinstance(exc, Exception):
                _forget_locals(exc)
                agreed = points.failure or points.fail("capture loop", exc)
                if agreed is not exc:
                    # FastDeploy's capture_model() rewraps errors that mention "out of memory";
                    # every rank raises the agreed error itself, with the same text.
                    agreed.__suppress_context__ = True
                    raise agreed
        finally:
            self._close()
        if exc_type is None:
            self._finish()

    def _close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        if self._collect_again:
            gc.enable()
        if self.worker.session is self:
            self.worker.session = None
            self.worker.sessions_ended += 1
            for member in self.members:
                member.join_session(None)
        if self.report is not None:
            self.report.seconds = time.perf_counter() - self._started

    def _finish(self) -> None:
        if self.phase == "probe" and not self.report.records:
            return  # every rank had its record: nothing was probed
        logger.info("%s", self.report.summary())
        for member in self.members:
            member.capture_report = self.report
        if self.report.memory and self.report.records and self.phase != "probe":
            self._remember_graph_memory()
        path = self.options.memory_report
        if path:
            path = stats.output_path(path, self.members[-1].settings if self.members else None)
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

    def _remember_graph_memory(self) -> None:
        """Record what this plan's graphs took on this rank (FD_CUDAGRAPH_KV_RESERVE=auto reads
        it at the next start), and warn where a reserve taken this start was short."""
        mine = next(m for m in self.report.memory if m.rank == self.rank)
        taken = mine.taken_bytes
        state, settings = self.worker, self.members[0].settings
        # A probe at this start already took part of what a start without one takes in this
        # session (library workspaces, cached blocks): the record holds the whole.
        recorded = taken + state.probe_kept
        state.probe_kept = 0
        key = budget.plan_key(self.record_fingerprint())
        record = budget.Record.for_rank(stats.log_dir(), settings.dp_rank, settings.tp_rank)
        try:
            record.store(key, recorded, {"phase": self.phase, "graphs": self.report.graphs})
        except OSError as error:
            stats.output_failed("FD_CUDAGRAPH_KV_RESERVE record", record.path, error)
        reserve = state.kv_reserve
        if reserve is None:
            if self.options.kv_reserve != "off" and not state.reserve_warned:
                state.reserve_warned = True
                logger.info(
                    "FD_CUDAGRAPH_KV_RESERVE is set, but FastDeploy sized the KV cache without "
                    "its memory profile (num_gpu_blocks_override), so nothing was reserved; this "
                    "rank's graphs took %s.",
                    stats.human_bytes(taken),
                )
            return
        state.taken_since_reserve += taken
        if state.taken_since_reserve > reserve.nbytes and not state.reserve_warned:
            state.reserve_warned = True
            logger.warning(
                "FD_CUDAGRAPH_KV_RESERVE reserved %s (%s) for this rank's graphs, but they took "
                "%s: the KV cache left %s too little. The record now holds the measured figure "
                "for the next start.",
                stats.human_bytes(reserve.nbytes),
                reserve.source,
                stats.human_bytes(state.taken_since_reserve),
                stats.human_bytes(state.taken_since_reserve - reserve.nbytes),
            )

    def record_fingerprint(self) -> dict[str, Any]:
        """What makes this session's graph memory the same at the next start: the plan (as the
        ranks compare it), the model, this rank, the phase."""
        return record_fingerprint(self.members, self.phase)

    def check_plan(self) -> None:
        """Every TP rank must plan the same captures; compared before the first one."""
        from fd_cudagraph_plugin import __version__

        self._plan_checked = bool(self.members)
        mine: dict[str, Any] = {
            "plugin_version": __version__,
            "phase": self.phase,
            "pool": self.options.pool,
            "self_check": self.options.self_check,
            "custom_allreduce": fastdeploy.custom_allreduce() is not None,
            "backends": len(self.members),
            **_backends_plan(self.members),
        }
        everyone = self.points.share("plan", None, None, lambda: mine)
        diff = plan_diff(everyone)
        if diff:
            error = RankMismatchError(
                "tensor-parallel ranks plan different CUDA-graph captures; capturing would hang "
                "in the custom all-reduce registration. "
                + " | ".join(diff)
                + ". Start every rank with the same --graph-optimization-config, "
                "--speculative-config, --max-num-seqs and FD_CUDAGRAPH_* variables.",
                stage="plan",
            )
            self.points.failure = error
            raise error

    def record(
        self, backend: Member, phase: str, size: int, seconds: float, graph_bytes: int, warmups: int
    ) -> None:
        """One graph captured: report it."""
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
        # Drawn at tqdm's own pace (update's mininterval), not at every graph.
        bar.set_postfix_str(
            f"size {record.size}, graph memory {human_bytes(graph_bytes)}", refresh=False
        )
        bar.update(1)


def record_fingerprint(members: list[Member], phase: str) -> dict[str, Any]:
    settings = members[0].settings
    return {
        "phase": phase,
        "model": settings.model_name,
        "tp_size": settings.tp_size,
        "tp_rank": settings.tp_rank,
        "pool": settings.options.pool,
        **_backends_plan(members),
    }


def _backends_plan(members: list[Member]) -> dict[str, Any]:
    """Each member's plan fingerprint, its keys prefixed with the member's place."""
    return {
        f"backend{index}.{key}": value
        for index, member in enumerate(members)
        for key, value in member.plan_fingerprint().items()
    }


def plan_diff(fingerprints: list[dict]) -> list[str]:
    """One line per rank whose plan differs from rank 0's, naming each differing key."""
    lines = []
    reference = fingerprints[0]
    for rank, fingerprint in enumerate(fingerprints[1:], start=1):
        fingerprint = fingerprint or {}
        keys = sorted(set(reference) | set(fingerprint))
        diffs = [
            f"{key}: rank 0 {reference.get(key)!r} vs rank {rank} {fingerprint.get(key)!r}"
            for key in keys
            if reference.get(key) != fingerprint.get(key)
        ]
        if diffs:
            lines.append(f"rank {rank}: " + "; ".join(diffs))
    return lines
