"""Where tensor-parallel ranks agree during a capture session, and the one error they all raise.

The points of a session, in order (TP = 1 runs the same code, agreeing with itself):

1. ``plan`` at the start: every rank's capture plan; a difference is a ``RankMismatchError``;
2. per graph: ``warm-up`` (after the eager warm-ups, before the device synchronises: a rank whose
   warm-up failed never launched its all-reduces, so a peer must not block on them),
   ``capture`` (before the custom all-reduce registration, so a failed rank is never waited for
   there), ``registration`` (before the next warm-up's all-reduces), ``self-check`` when it is on;
3. ``static probe`` before the first static-full decode capture: which graphs decode;
4. ``end``: catches a rank that failed anywhere between two points (FastDeploy's code between
   backend calls included): that rank posts its failure at its next point, whichever it is.

A rank whose step failed still posts and waits at that point; every rank raises the error built
from all ranks' statuses (``agreed_error``), so the message is the same on every rank. The
transport is ``channel.py``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fd_cudagraph_plugin.core.channel import Agreed, Link, LocalLink
from fd_cudagraph_plugin.core.errors import (
    CaptureError,
    CudaGraphPluginError,
    RankTimeoutError,
    SelfCheckError,
)
from fd_cudagraph_plugin.core.graphs import GraphKey
from fd_cudagraph_plugin.core.messages import MAX_TEXT, BadMessage, Failure, Kind, Status, text
from fd_cudagraph_plugin.core.mode import Mode

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
    "FastDeploy's custom all-reduce could not register the graph's buffers: serve with "
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


class Report(Protocol):
    """Where the time spent agreeing is counted, and who words the advice after this rank ran
    out of memory (``session.CaptureReport``: it knows what was captured and what is free)."""

    agreement_seconds: float
    agreement_points: int

    def out_of_memory_advice(self, participant: Any, phase: str) -> str: ...


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


def _advice(failures: list[Failure]) -> str:
    """One advice for the failures of a point, read alike on every rank: the first that ran out
    of memory's; else the failures' own where they all say the same."""
    memory = [f.advice for f in failures if f.out_of_memory and f.advice]
    if memory:
        return " " + memory[0]
    said = {f.advice for f in failures if not f.explained}
    return " " + said.pop() if len(said) == 1 and "" not in said else ""


def agreed_error(agreed: Agreed, world: int, timeout: float) -> CaptureError | None:
    """The error every rank raises for ``agreed``, or None when every rank is fine.

    Built only from the outcome, which the server gives every rank alike, so the text is the same
    on every rank (the rank that raises it is in its worker log's name). The channel checked every
    field read here."""
    outcome = agreed.outcome
    if agreed.channel_failure:
        return CaptureError(
            f"The CUDA graph agreement of the tensor-parallel ranks failed at "
            f"'{agreed.label}': {agreed.channel_failure}. This rank stops rather than enter a "
            f"collective the others may not join; restart the workers.",
            stage="agreement",
        )
    failures = agreed.failures
    missing = [r for r in outcome.missing if r not in failures]
    # A rank that failed outside a point posts at its next one under its own label: a failure
    # explains different labels; without one, the ranks have lost step.
    labels = sorted(set(outcome.labels.values())) if not failures else []
    if not failures and not missing and not outcome.gave_up and len(labels) <= 1:
        return None
    parts = []
    for failed_rank, failure in failures.items():
        where = f" for {failure.where}" if failure.where else ""
        on = f" on tensor-parallel rank {failed_rank} of {world}" if world > 1 else ""
        parts.append(
            f"CUDA graph {failure.stage} failed{on}{where} ({failure.mode}): {failure.error}"
        )
    text_ = "; ".join(parts)
    if failures:
        text_ += "." + _advice(list(failures.values()))
        if any(f.stage == "capture" for f in failures.values()):
            text_ += _RESTART
    if len(labels) > 1:
        text_ += (
            (" " if text_ else "")
            + "Tensor-parallel ranks reached different agreement points at once: "
            + "; ".join(
                f"rank{_s(rs)} {_ranks(rs)} at '{label}'"
                for label in labels
                for rs in [[r for r, lb in sorted(outcome.labels.items()) if lb == label]]
            )
            + ". Every rank must run the same FastDeploy and plugin with the same settings."
        )
    if missing:
        dropped = [r for r in missing if r in outcome.dropped]
        lost = [r for r in missing if r in outcome.lost and r not in outcome.dropped]
        late = [r for r in missing if r not in outcome.lost]
        if text_:
            text_ += " "
        for rank in dropped:
            text_ += (
                f"The agreement server dropped tensor-parallel rank {rank} for what it sent "
                f"({outcome.dropped[rank]}) before the agreement point '{agreed.label}'. "
            )
        if lost:
            text_ += (
                f"Tensor-parallel rank{_s(lost)} {_ranks(lost)} closed {_their(lost)} connection "
                f"or stopped answering (the process exited, crashed or froze) before the "
                f"agreement point '{agreed.label}' was decided. "
            )
        if late:
            # Said from the server's clock and the ranks that gave up, which every rank reads
            # alike: true also when a rank gave up early (its own shorter timeout).
            gave = [r for r in outcome.gave_up if r not in late] or list(outcome.gave_up)
            who = f"rank{_s(gave)} {_ranks(gave)} stopped waiting for " if gave else ""
            text_ += (
                f"Tensor-parallel rank{_s(late)} {_ranks(late)} had not reached the agreement "
                f"point '{agreed.label}' when {who or 'the others stopped waiting for '}"
                f"{'it' if len(late) == 1 else 'them'}, after {_seconds(outcome.waited)} "
                f"(FD_CUDAGRAPH_RANK_TIMEOUT, {_seconds(timeout)} here): "
                f"{'it' if len(late) == 1 else 'they'} exited, hang, or do not run "
                f"fd-cudagraph-plugin (set FD_PLUGINS=fd_cudagraph_plugin for every worker). "
            )
        text_ = text_.rstrip()
    elif outcome.gave_up and not failures and len(labels) <= 1:
        gave = list(outcome.gave_up)
        text_ += (
            f"Tensor-parallel rank{_s(gave)} {_ranks(gave)} stopped waiting at the agreement "
            f"point '{agreed.label}' after {_seconds(outcome.waited)} "
            f"(FD_CUDAGRAPH_RANK_TIMEOUT, {_seconds(timeout)} here) just as the last rank arrived: "
            f"a rank is too slow for the timeout; raise it."
        )
    if world > 1:
        named = sorted({*failures, *missing, *outcome.gave_up})
        text_ += (
            f" Every rank stops here, so none waits in a collective that rank{_s(named)} "
            f"{_ranks(named)} will not join."
        )
    error_type: type[CaptureError] = RankTimeoutError if missing and not failures else CaptureError
    if failures and all(f.stage == "self-check" for f in failures.values()):
        error_type = SelfCheckError if not missing else CaptureError
    stage = next(iter(failures.values())).stage if failures else "agreement"
    return error_type(
        text_,
        stage=stage,
        failed_ranks=tuple(failures),
        missing_ranks=tuple(missing),
        out_of_memory=any(f.out_of_memory for f in failures.values()),
    )


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def _s(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _their(ranks: list[int]) -> str:
    return "their" if len(ranks) > 1 else "its"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class MalformedPayload(CaptureError):
    """A rank shared a payload its point cannot read: every rank raises this alike."""


class Agreement:
    """The agreement points of one session (or, with no session, of one backend alone).

    ``failure`` is the agreed failure that stopped this session, written here only: every later
    point re-raises it."""

    def __init__(self, link: Link, timeout: float, report: Report | None) -> None:
        self.link = link
        self.timeout = timeout
        self.report = report
        self.failure: CaptureError | None = None

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def world(self) -> int:
        return self.link.world

    def run(
        self,
        stage: str,
        participant: Participant | None,
        key: GraphKey | None,
        fn: Callable[[], T],
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
        key: GraphKey | None,
        fn: Callable[[], Any],
        kind: Kind,
    ) -> list[Any]:
        """Like ``run``, and return every rank's result of ``fn``, in rank order, each read as
        ``kind`` (``messages.py``). One that cannot be read stops every rank alike (it came over
        the network)."""
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

    def _agree(self, stage, participant, key, fn, kind: Kind | None):
        if self.failure is not None:
            raise self.failure
        where = str(key) if key is not None else ""
        local: BaseException | None = None
        try:
            result = fn()
            status = Status(payload=kind.dump(result)) if kind is not None else Status()
        except Exception as error:
            advice = ""
            if participant is not None and self.report is not None and _out_of_memory(error):
                phase = key.phase if key is not None else "decode"
                advice = _safely(lambda: self.report.out_of_memory_advice(participant, phase))
            mode = _mode(participant, key)
            status = Status(failure=failure_of(stage, where, mode, self.rank, error, advice))
            local = error
            forget_locals(error)
        label = f"{stage} {where}".strip()
        if participant is not None:
            label += f" ({participant.role})"
        started = time.perf_counter()
        agreed = self.link.agree(label, status, self.timeout)
        if self.report is not None:
            self.report.agreement_seconds += time.perf_counter() - started
            self.report.agreement_points += 1
        error = agreed_error(agreed, self.world, self.timeout)
        shared = None
        if error is None and kind is not None:
            shared, error = _read(agreed, label, kind)
        if error is not None:
            error.agreed = True
            self.failure = error
            if local is not None:
                raise error from local
            raise error
        return shared


def _out_of_memory(error: BaseException) -> bool:
    return "out of memory" in str(error).lower() or isinstance(error, MemoryError)


def _safely(advise: Callable[[], str]) -> str:
    """The out-of-memory advice, or "" (the generic one) should wording it fail: the failure is
    posted either way, or this rank's peers would wait for it in vain."""
    try:
        return advise()
    except Exception:
        return ""


def _read(agreed: Agreed, label: str, kind: Kind) -> tuple[list[Any], CaptureError | None]:
    read, bad = [], []
    for rank, payload in enumerate(agreed.shared()):
        try:
            read.append(kind.check(payload))
        except BadMessage:
            bad.append(rank)
    if not bad:
        return read, None
    return read, MalformedPayload(
        f"Tensor-parallel rank{_s(bad)} {_ranks(bad)} shared at the agreement point '{label}' "
        f"what this point cannot read. Every rank must run the same fd-cudagraph-plugin version; "
        f"every rank stops here.",
        stage="agreement",
        failed_ranks=tuple(bad),
    )


def forget_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames the error's traceback holds: a failed capture's
    frames hold tensors in graph-pool memory, which would stay allocated for as long as anyone
    keeps the error (FastDeploy's worker logs and re-raises it). Line numbers stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _mode(participant: Participant | None, key: GraphKey | None) -> str:
    if participant is None:
        return "between two agreement points, in FastDeploy's capture loop"
    return participant.mode.describe(key.static if key is not None else None)


def solo(timeout: float) -> Agreement:
    """Points for a backend used outside any session (TP = 1 only): it agrees with itself."""
    return Agreement(LocalLink(), timeout, None)
