"""Where tensor-parallel ranks agree, the one error they all raise, and the one place that opens
points.

**Opening points.** Every point goes through an ``Agreement`` made here: ``for_session`` (a capture
session's), ``outside_session`` (after a lifecycle call, or at a graph's first replay after one)
and ``solo`` (a backend used alone, TP = 1). Every point has a name every rank derives alike: the
scope its caller gives (what the call or session is, and its place in FastDeploy's sequence of
calls, ``lifecycle.py``) and its number in that scope, which the scope's code fixes. So a point
pairs only with the same point of the same call on every rank, and ranks that lost step meet again
at the next scope.

The points, and what each comes before, are docs/design.md's table ("Tensor parallelism"). A rank
whose step failed still posts, and every rank raises the error built from all ranks' statuses
(``agreed_error``), so the message is the same on every rank. An interrupt is posted like any
failure; one that reaches a rank while it waits at a point that then completes is held, posted at
its next point, and raised there or when the plugin hands control back (``release_held``).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fd_cudagraph_plugin.core.errors import (
    CaptureError,
    CudaGraphPluginError,
    RankTimeoutError,
    SelfCheckError,
)
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.process import WorkerProcess
from fd_cudagraph_plugin.core.ranks.link import Agreed, Link, LocalLink, Outcome, StoreLink
from fd_cudagraph_plugin.core.ranks.messages import MAX_RANKS, MAX_TEXT, Failure, Status, text
from fd_cudagraph_plugin.core.ranks.store import JobStore, StoreError, master_address
from fd_cudagraph_plugin.core.settings import read_ranks

T = TypeVar("T")

OOM_ADVICE = (
    "Out of memory: lower --max-num-seqs or --gpu-memory-utilization, or trim "
    "cudagraph_capture_sizes in --graph-optimization-config."
)
_OP_ADVICE = (
    "An op in the model cannot be captured or run at this size: fix it, or serve without CUDA "
    "graphs (--graph-optimization-config '{\"use_cudagraph\": false}')."
)
_REGISTRATION_ADVICE = (
    "FastDeploy's custom all-reduce could not register the graphs' buffers: serve with "
    "--disable-custom-all-reduce, or without CUDA graphs."
)
_RESTART = (
    " The failure happened inside the capture, after which Paddle cannot capture again in that "
    "process: restart the worker once the cause is fixed."
)


class Participant(Protocol):
    """What the agreement asks of a backend taking part in a point: its name in a label and a
    failure."""

    role: str
    mode: Mode


class Subject(Protocol):
    """The graph a point is about, as the point names it (``graphs.GraphKey``)."""

    phase: str
    static: bool


class Report(Protocol):
    """Where the time spent agreeing is counted, and who words the advice after this rank ran
    out of memory (``session.CaptureReport``: it knows what was captured and what is free)."""

    agreement_seconds: float
    agreement_points: int

    def out_of_memory_advice(self, participant: Any, phase: str) -> str: ...


# ------------------------------------------------------------------------- opening points


def link_for(fd_config: Any, worker: WorkerProcess) -> Link:
    """``worker``'s link to its tensor-parallel group's agreement (made once)."""
    ranks = read_ranks(fd_config)
    if ranks.tp_size <= 1:
        return LocalLink()
    group = list(ranks.tp_group)
    if ranks.tp_size > MAX_RANKS:
        raise CaptureError(
            f"a tensor-parallel group of {ranks.tp_size} ranks: fd-cudagraph-plugin agrees "
            f"groups of at most {MAX_RANKS}; serve without the plugin (unset FD_PLUGINS).",
            stage="agreement",
        )
    name = f"{worker.link_prefix}/{'-'.join(str(r) for r in group)}"
    link = worker.links.get(name)
    if link is None:
        try:
            host, port = master_address(os.environ)
            store = JobStore(host, port, worker.options.rank_timeout)
        except StoreError as error:
            raise RankTimeoutError(
                f"tensor-parallel rank {ranks.tp_rank} cannot reach Paddle's job store, where its "
                f"group's ranks agree (ranks {group}): {error}. Every worker of a tensor-parallel "
                f"job has it (paddle.distributed's init_parallel_env); restart the job.",
                stage="agreement",
            ) from error
        link = worker.links[name] = StoreLink(store, name, ranks.tp_rank, ranks.tp_size)
    return link


def for_session(link: Link, worker: WorkerProcess, report: Report, scope: str) -> Agreement:
    """The points of one capture session, named under ``scope``."""
    return Agreement(link, worker, report, scope)


def outside_session(worker: WorkerProcess, fd_config: Any, scope: str) -> Agreement:
    """One point outside a capture session, named ``scope`` (see the module's doc)."""
    return Agreement(link_for(fd_config, worker), worker, None, scope)


def solo(worker: WorkerProcess) -> Agreement:
    """Points for a backend used outside any session (TP = 1 only): it agrees with itself."""
    return Agreement(LocalLink(), worker, None, "solo")


def release_held(worker: WorkerProcess) -> None:
    """Raise the interrupt ``worker`` held at a point that completed, if no later point has
    posted it: the plugin hands control back to FastDeploy here."""
    held, worker.held_interrupt = worker.held_interrupt, None
    if held is not None:
        raise held


# ----------------------------------------------------------------------------- the points


class MalformedPayload(CaptureError):
    """A rank shared a payload its point cannot read: every rank raises this alike."""


class Agreement:
    """The agreement points of one session (or of one point outside a session).

    ``failure`` is the agreed failure that stopped this session, written here only: every later
    point re-raises it. ``worker`` holds an interrupt between points."""

    def __init__(
        self, link: Link, worker: WorkerProcess, report: Report | None, scope: str
    ) -> None:
        self.link = link
        self.worker = worker
        self.timeout = worker.options.rank_timeout
        self.report = report
        self.scope = scope
        self.points = 0
        self.failure: CaptureError | None = None

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def world(self) -> int:
        return self.link.world

    def run(
        self, stage: str, participant: Participant | None, key: Subject | None, fn: Callable[[], T]
    ) -> T:
        """Run ``fn`` on this rank, then agree: raise the same ``CaptureError`` on every rank if
        it failed on any; else return ``fn``'s result."""
        box: list[T] = []
        self._agree(stage, participant, key, lambda: box.append(fn()), None)
        return box[0]

    def share(
        self,
        stage: str,
        participant: Participant | None,
        key: Subject | None,
        fn: Callable[[], Any],
        kind: type | tuple[type, ...],
    ) -> list[Any]:
        """Like ``run``, and return every rank's result of ``fn`` (a payload of
        ``messages.Payload``), in rank order. A rank's payload that is not a ``kind`` stops
        every rank alike (it came over the network)."""
        return self._agree(stage, participant, key, fn, kind)

    def fail(self, stage: str, error: BaseException) -> CaptureError:
        """This rank failed outside a point: post the failure at the next point, return the
        agreed error (the other ranks meet it there, whichever point they are at)."""
        if self.failure is not None:
            return self.failure

        def raise_it() -> None:
            raise error

        try:
            self._agree(stage, None, None, raise_it, None)
        except CaptureError as agreed:
            return agreed
        raise AssertionError("a posted failure always ends in an error")  # pragma: no cover

    def stop(self, error: CaptureError) -> CaptureError:
        """Every rank reached the same verdict outside a point (a plan mismatch, a self-check it
        agreed on): the session stops with ``error``."""
        error.agreed = True
        self.failure = error
        return error

    def _agree(self, stage, participant, key, fn, kind):
        if self.failure is not None:
            raise self.failure
        where = str(key) if key is not None else ""
        worker = self.worker
        local: BaseException | None = worker.held_interrupt
        worker.held_interrupt = None
        try:
            if local is not None:
                raise local  # held at an earlier point: posted here, before anything runs
            result = fn()
            status = Status(payload=result) if kind is not None else Status()
        except BaseException as error:
            # An interrupt too: it is posted like any failure before it propagates, or this
            # rank's peers would wait for it in vain.
            advice = ""
            if participant is not None and self.report is not None and _out_of_memory(error):
                phase = key.phase if key is not None else "decode"
                advice = _safely(lambda: self.report.out_of_memory_advice(participant, phase))
            mode = _mode(participant, key, stage)
            status = Status(failure=failure_of(stage, where, mode, self.rank, error, advice))
            local = error
            forget_locals(error)
        label = f"{stage} {where}".strip()
        if participant is not None:
            label += f" ({participant.role})"
        point = f"{self.scope}.{self.points}"
        self.points += 1
        if status.failure is not None:
            # The others stop at whichever point of this call they wait at, reading why.
            self.link.stop(point, label, status)
        started = time.perf_counter()
        agreed = self.link.agree(point, label, status, self.timeout)
        if self.report is not None:
            self.report.agreement_seconds += time.perf_counter() - started
            self.report.agreement_points += 1
        if agreed.interrupted and local is None:
            local = KeyboardInterrupt()
        error = agreed_error(agreed, self.world, self.timeout)
        if error is None and kind is not None:
            error = _unreadable(agreed, label, kind)
        if error is not None:
            error.agreed = True
            self.failure = error
            if status.failure is None:  # this rank leaves the call too: the others need not wait
                why = failure_of(
                    "agreement", where, _mode(participant, key, stage), self.rank, error
                )
                self.link.stop(point, label, Status(failure=why))
            if local is not None and not isinstance(local, Exception):
                raise local  # an interrupt stays an interrupt; the others raise the agreed error
            if local is not None:
                raise error from local
            raise error
        if local is not None:
            # Interrupted while waiting at a point every rank completed: the others go on to
            # what follows it, so this rank does too and posts the interrupt at its next point.
            worker.held_interrupt = local
        return agreed.shared() if kind is not None else None


def failure_of(
    stage: str, where: str, mode: str, rank: int, error: BaseException, advice: str = ""
) -> Failure:
    """This rank's failure as it posts it, with the advice worded here, where the cause is
    known; every rank prints the text the outcome carries, so the same on every rank."""
    message = str(error).rstrip(". ")
    out_of_memory = _out_of_memory(error)
    explained = isinstance(error, CudaGraphPluginError)
    if not advice:
        if out_of_memory:
            advice = OOM_ADVICE
        elif explained:
            advice = ""  # the plugin's own errors (capture order, configuration) say what to do
        elif stage == "registration":
            advice = _REGISTRATION_ADVICE
        elif stage in ("warm-up", "capture", "static probe"):
            advice = _OP_ADVICE
    return Failure(
        rank=rank,
        stage=text(stage, 100),
        where=text(where, 100),
        mode=text(mode, 300),
        error=text(f"{type(error).__name__}: {message}", MAX_TEXT - 200),
        out_of_memory=out_of_memory,
        explained=explained,
        advice=text(advice, MAX_TEXT),
    )


# ------------------------------------------------------------------------- the agreed error


def agreed_error(agreed: Agreed, world: int, timeout: float) -> CaptureError | None:
    """The error every rank raises for ``agreed``, or None when every rank is fine. Built only
    from the outcome, which every rank reads alike from the store, so the text is the same on
    every rank (the rank that raises it is in its worker log's name)."""
    if agreed.channel_failure:
        return CaptureError(
            f"The CUDA graph agreement of the tensor-parallel ranks failed at "
            f"'{agreed.label}': {agreed.channel_failure}. This rank stops rather than enter a "
            f"collective the others may not join.",
            stage="agreement",
        )
    outcome = agreed.outcome
    failures = agreed.failures
    missing = [r for r in outcome.missing if r not in failures]
    if outcome.stopped:  # a rank left the call: the others gave up at once, at fault or not
        missing = [r for r in missing if r in outcome.stopped]
    # Different labels at one point mean the ranks' code differs, unless a rank failed between
    # points (it posts under its own label).
    apart = not failures and len(set(outcome.labels.values())) > 1
    if outcome.complete and not failures and not apart:
        return None
    parts = [_failed(failures, world)] if failures else []
    if apart:
        parts.append(_apart(outcome))
    if missing:
        parts.append(_absent(outcome, missing, agreed.label, timeout))
    elif not outcome.complete and not failures:
        parts.append(_too_slow(outcome, agreed.label, timeout))
    message = " ".join(p for p in parts if p)
    if world > 1:
        # A rank that gave up because another left the call is not at fault.
        gave = [] if outcome.gave_up is None or outcome.stopped else [outcome.gave_up]
        named = sorted({*failures, *missing, *gave})
        message += (
            f" Every rank stops here, so none waits in a collective that rank{_s(named)} "
            f"{_ranks(named)} will not join."
            if named
            else " Every rank stops here, so none waits in a collective another will not join."
        )
    error_type: type[CaptureError] = RankTimeoutError if missing and not failures else CaptureError
    if failures and not missing and all(f.stage == "self-check" for f in failures.values()):
        error_type = SelfCheckError
    return error_type(
        message,
        stage=next(iter(failures.values())).stage if failures else "agreement",
        failed_ranks=tuple(failures),
        missing_ranks=tuple(missing),
        out_of_memory=any(f.out_of_memory for f in failures.values()),
    )


def _failed(failures: dict[int, Failure], world: int) -> str:
    """What failed on which rank, with one advice for all of them."""
    lines = []
    for rank, failure in failures.items():
        where = f" for {failure.where}" if failure.where else ""
        on = f" on tensor-parallel rank {rank} of {world}" if world > 1 else ""
        lines.append(
            f"CUDA graph {failure.stage} failed{on}{where} ({failure.mode}): {failure.error}"
        )
    message = "; ".join(lines) + "." + _advice(list(failures.values()))
    if any(f.stage == "capture" for f in failures.values()):
        message += _RESTART
    return message


def _advice(failures: list[Failure]) -> str:
    """One advice for the failures of a point, read alike on every rank: the first that ran out
    of memory's; else the failures' own where they all say the same."""
    memory = [f.advice for f in failures if f.out_of_memory and f.advice]
    if memory:
        return " " + memory[0]
    said = {f.advice for f in failures if not f.explained}
    return " " + said.pop() if len(said) == 1 and "" not in said else ""


def _apart(outcome: Outcome) -> str:
    """The ranks' code differs: where each was."""
    by_label: dict[str, list[int]] = {}
    for rank, label in sorted(outcome.labels.items()):
        by_label.setdefault(label, []).append(rank)
    where = "; ".join(f"rank{_s(rs)} {_ranks(rs)} at '{label}'" for label, rs in by_label.items())
    return (
        f"Tensor-parallel ranks reached the same agreement point as different steps: {where}. "
        f"Every rank must run the same FastDeploy and plugin with the same settings; the ranks "
        f"meet again at the next capture session or lifecycle call."
    )


def _absent(outcome: Outcome, missing: list[int], label: str, timeout: float) -> str:
    """Ranks whose post was not there when the first rank's timeout ran out."""
    gave = outcome.gave_up
    who = f"rank {gave}" if gave is not None else "a rank"
    it = "it" if len(missing) == 1 else "them"
    return (
        f"Tensor-parallel rank{_s(missing)} {_ranks(missing)} had not reached the agreement "
        f"point '{label}' when {who} stopped waiting for {it} (FD_CUDAGRAPH_RANK_TIMEOUT, "
        f"{_seconds(timeout)} here): {'it' if len(missing) == 1 else 'they'} exited, hang, are "
        f"at another step, or do not run fd-cudagraph-plugin (set "
        f"FD_PLUGINS=fd_cudagraph_plugin for every worker)."
    )


def _too_slow(outcome: Outcome, label: str, timeout: float) -> str:
    return (
        f"A tensor-parallel rank's FD_CUDAGRAPH_RANK_TIMEOUT ({_seconds(timeout)} here) ran out "
        f"at the agreement point '{label}' before every rank had reached it, and which ranks had "
        f"was not recorded: a rank is too slow for the timeout, or stopped; raise it."
    )


def _unreadable(agreed: Agreed, label: str, kind: type | tuple[type, ...]) -> CaptureError | None:
    bad = [rank for rank, payload in enumerate(agreed.shared()) if not isinstance(payload, kind)]
    if not bad:
        return None
    return MalformedPayload(
        f"Tensor-parallel rank{_s(bad)} {_ranks(bad)} shared at the agreement point '{label}' "
        f"what this point cannot read. Every rank must run the same fd-cudagraph-plugin version; "
        f"every rank stops here.",
        stage="agreement",
        failed_ranks=tuple(bad),
    )


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def _s(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _out_of_memory(error: BaseException) -> bool:
    return "out of memory" in str(error).lower() or isinstance(error, MemoryError)


def _safely(advise: Callable[[], str]) -> str:
    """The out-of-memory advice, or "" (the generic one) should wording it fail: the failure is
    posted either way, or this rank's peers would wait for it in vain."""
    try:
        return advise()
    except Exception:
        return ""


def forget_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames the error's traceback holds: a failed capture's
    frames hold tensors in graph-pool memory, which would stay allocated for as long as anyone
    keeps the error (FastDeploy's worker logs and re-raises it). Line numbers stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


_SESSION_STAGES = {
    "registration": "at the capture session's end, registering every graph's all-reduce buffers",
    "self-check": "at the capture session's end, self-checking its graphs",
}


def _mode(participant: Participant | None, key: Subject | None, stage: str) -> str:
    if participant is None:
        return _SESSION_STAGES.get(
            stage, "between two agreement points, in FastDeploy's capture loop"
        )
    return participant.mode.describe(key.static if key is not None else None)
