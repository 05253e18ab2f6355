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

from fd_cudagraph_plugin.core import budget
from fd_cudagraph_plugin.core.channel import Link, LocalLink
from fd_cudagraph_plugin.core.errors import (
    CaptureError,
    CudaGraphPluginError,
    RankTimeoutError,
    SelfCheckError,
)
from fd_cudagraph_plugin.core.key import GraphKey
from fd_cudagraph_plugin.core.wire import MAX_TEXT, Outcome

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


class Participant(Protocol):
    """What the agreement asks of a backend taking part in a point."""

    role: str
    settings: Any
    runtime: Any

    def graphs_expected(self, phase: str) -> int:
        """How many graphs of ``phase`` this backend captures in a full session."""


class Report(Protocol):
    """Where the time spent agreeing is counted (``report.CaptureReport``)."""

    agreement_seconds: float
    agreement_points: int

    def memory_at_failure(self, participant: Participant, phase: str) -> dict[str, Any]: ...


def failure_status(stage: str, where: str, mode: str, rank: int, error: BaseException) -> dict:
    text = str(error).rstrip(". ")
    # The channel caps a post; the start and the end of a long message say the most.
    if len(text) > MAX_TEXT - 200:
        text = text[: MAX_TEXT // 2 - 100] + " ... " + text[-(MAX_TEXT // 2 - 200) :]
    return {
        "rank": rank,
        "stage": stage[:100],
        "where": where[:100],
        "mode": mode[:300],
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


def agreed_error(outcome: Outcome, world: int, timeout: float) -> CaptureError | None:
    """The error every rank raises for ``outcome``, or None when every rank is fine.

    Built only from the outcome, which the server gives every rank alike, so the text is the same
    on every rank (the rank that raises it is in its worker log's name). The channel checked every
    field read here."""
    if outcome.channel_failure:
        return CaptureError(
            f"The CUDA graph agreement of the tensor-parallel ranks failed at "
            f"'{outcome.label}': {outcome.channel_failure}. This rank stops rather than enter a "
            f"collective the others may not join; restart the workers.",
            stage="agreement",
        )
    failures = outcome.failures
    missing = [r for r in outcome.missing if r not in failures]
    # A rank that failed outside a point posts at its next one under its own label: a failure
    # explains different labels; without one, the ranks have lost step.
    labels = sorted(set(outcome.labels.values())) if not failures else []
    if not failures and not missing and not outcome.gave_up and len(labels) <= 1:
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
    if len(labels) > 1:
        text += (
            (" " if text else "")
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
        if text:
            text += " "
        for rank in dropped:
            text += (
                f"The agreement server dropped tensor-parallel rank {rank} for what it sent "
                f"({outcome.dropped[rank]}) before the agreement point '{outcome.label}'. "
            )
        if lost:
            text += (
                f"Tensor-parallel rank{_s(lost)} {_ranks(lost)} closed {_their(lost)} connection "
                f"(the process exited or crashed) before the agreement point "
                f"'{outcome.label}'. "
            )
        if late:
            # Said from the server's clock and the ranks that gave up, which every rank reads
            # alike: true also when a rank gave up early (its own shorter timeout).
            gave = [r for r in outcome.gave_up if r not in late] or list(outcome.gave_up)
            who = f"rank{_s(gave)} {_ranks(gave)} stopped waiting for " if gave else ""
            text += (
                f"Tensor-parallel rank{_s(late)} {_ranks(late)} had not reached the agreement "
                f"point '{outcome.label}' when {who or 'the others stopped waiting for '}"
                f"{'it' if len(late) == 1 else 'them'}, after {_seconds(outcome.open_seconds)} "
                f"(FD_CUDAGRAPH_RANK_TIMEOUT, {_seconds(timeout)} here): "
                f"{'it' if len(late) == 1 else 'they'} exited, hang, or do not run "
                f"fd-cudagraph-plugin (set FD_PLUGINS=fd_cudagraph_plugin for every worker). "
            )
        text = text.rstrip()
    elif outcome.gave_up and not failures and len(labels) <= 1:
        gave = list(outcome.gave_up)
        text += (
            f"Tensor-parallel rank{_s(gave)} {_ranks(gave)} stopped waiting at the agreement "
            f"point '{outcome.label}' after {_seconds(outcome.open_seconds)} "
            f"(FD_CUDAGRAPH_RANK_TIMEOUT, {_seconds(timeout)} here) just as the last rank arrived: "
            f"a rank is too slow for the timeout; raise it."
        )
    if world > 1:
        named = sorted({*failures, *missing, *outcome.gave_up})
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
        out_of_memory=any(f["out_of_memory"] for f in failures.values()),
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
        check: Callable[[Any], bool],
    ) -> list[Any]:
        """Like ``run``, and return every rank's result of ``fn`` (JSON-able), in rank order.
        ``check`` says whether a rank's result is one this point can read; one that is not stops
        every rank alike (the payload came over the network)."""
        return self._agree(stage, participant, key, fn, check)

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
        self.failure = error
        return error

    def _agree(self, stage, participant, key, fn, check):
        if self.failure is not None:
            raise self.failure
        where = str(key) if key is not None else ""
        mode = _mode(participant, key)
        status: dict[str, Any] | None
        try:
            result = fn()
        except Exception as error:
            failure = failure_status(stage, where, mode, self.rank, error)
            if failure["out_of_memory"] and participant is not None and self.report is not None:
                phase = key.phase if key is not None else "decode"
                failure["memory"] = self.report.memory_at_failure(participant, phase)
            status = {"failure": failure}
            local: BaseException | None = error
            forget_locals(error)
        else:
            status = {"payload": result} if check is not None else None
            local = None
        label = f"{stage} {where}".strip()
        if participant is not None:
            label += f" ({participant.role})"
        started = time.perf_counter()
        outcome = self.link.agree(label, status, self.timeout)
        if self.report is not None:
            self.report.agreement_seconds += time.perf_counter() - started
            self.report.agreement_points += 1
        error = agreed_error(outcome, self.world, self.timeout)
        if error is None and check is not None:
            error = _unreadable(outcome, label, check)
        if error is not None:
            self.failure = error
            if local is not None:
                raise error from local
            raise error
        return outcome.shared() if check is not None else None


def _unreadable(outcome: Outcome, label: str, check: Callable[[Any], bool]) -> CaptureError | None:
    bad = [rank for rank, payload in enumerate(outcome.shared()) if not _safely(check, payload)]
    if not bad:
        return None
    return MalformedPayload(
        f"Tensor-parallel rank{_s(bad)} {_ranks(bad)} shared at the agreement point '{label}' "
        f"what this point cannot read. Every rank must run the same fd-cudagraph-plugin version; "
        f"every rank stops here.",
        stage="agreement",
        failed_ranks=tuple(bad),
    )


def _safely(check: Callable[[Any], bool], payload: Any) -> bool:
    try:
        return bool(check(payload))
    except Exception:
        return False


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
    settings = participant.settings
    mode = key.mode if key is not None else settings.mode
    return (
        f"{mode} mode, graph_opt_level={settings.graph_opt_level}, "
        f"full_cuda_graph={settings.full_cuda_graph}"
    )


def solo(timeout: float) -> Agreement:
    """Points for a backend used outside any session (TP = 1 only): it agrees with itself."""
    return Agreement(LocalLink(), timeout, None)
