"""FD_CUDAGRAPH_KV_RESERVE: room for the graphs inside FastDeploy's KV-cache budget.

FastDeploy sizes the KV cache before it captures (``budget.py`` says how), so the graphs must fit
in what the cache leaves. With a reserve, ``GpuWorker.determine_available_memory()`` answers that
much less. ``auto`` reserves what this plan's capture took on this rank at the last start (the
record), else a probe capture's estimate, else nothing (and the next start reserves what this
one measures). Everything of the reserve is here, in one ``KvReserve`` per process, called at two
seams (``hooks.py``):

* ``on_memory_profile``: inside FastDeploy's memory profile, decide and apply the reserve;
* ``after_capture`` / ``after_failed_capture``: at the end of each capture loop's session, record
  what it took, warn where the reserve was short, and drop a recorded figure that ran out of memory.

The record is a file this process reads back, so it is checked as untrusted input: its size, its
format, each figure against the device, its time. A bad entry costs only itself (a probe, or no
reserve, at that start), never the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import lifecycle, outputs, process, seam
from fd_cudagraph_plugin.core.budget import Choice, Reserve
from fd_cudagraph_plugin.core.errors import human_bytes
from fd_cudagraph_plugin.core.session import CaptureReport, CaptureSession, backends_plan

logger = logging.getLogger("fd_cudagraph_plugin")

RECORD_FORMAT = "fd-cudagraph-graph-memory/2"
#: A record holds a few plans; anything longer is not one of ours.
MAX_RECORD_BYTES = 1 << 20
#: Plans kept per record, newest first.
MAX_PLANS = 32


class KvReserve:
    """What FD_CUDAGRAPH_KV_RESERVE did in this process; it publishes ``current``, a frozen
    ``budget.Reserve`` the hooks hand to every session (its report and its advice)."""

    def __init__(self, worker: process.WorkerProcess) -> None:
        self._worker = worker
        self.options = worker.options
        #: What the reserve did at this start: nothing taken until the memory profile ran.
        self.current = Reserve.asked(self.options.kv_reserve)
        #: What the probe left taken on the device after its graphs were released: a start
        #: without a probe takes it in its capture, so the next record adds it once.
        self.probe_kept = 0
        #: What capture sessions took since the reserve was applied.
        self.taken = 0
        self._warned = False

    # -- seam 1: the memory profile

    def on_memory_profile(self, runner: Any, profile: Callable[[], Any]) -> Any:
        """Run FastDeploy's ``determine_available_memory`` (``profile``) with the reserve."""
        choice = self.current.choice
        if choice is Choice.OFF:
            return profile()
        if choice is Choice.AUTO:
            found: list[Reserve] = []
            with seam.before_profile_cache_is_cleared(
                runner, lambda: found.append(self._auto(runner))
            ):
                available = profile()
            reserve = found[0] if found else _auto(0, "the profile run built no backend")
            reserve = self._checked(reserve, available, runner)
        else:
            available = profile()
            size = int(self.options.kv_reserve)
            reserve = Reserve(choice, size, f"FD_CUDAGRAPH_KV_RESERVE={human_bytes(size)}")
        self.current, self.taken, self._warned = reserve, 0, False
        logger.info(
            "FD_CUDAGRAPH_KV_RESERVE: the KV cache may take %s instead of %s, leaving %s for "
            "this rank's CUDA graphs (%s).",
            human_bytes(max(int(available - reserve.nbytes), 0)),
            human_bytes(max(int(available), 0)),
            human_bytes(reserve.nbytes),
            reserve.source,
        )
        return available - reserve.nbytes

    def _checked(self, reserve: Reserve, available: float, runner: Any) -> Reserve:
        """A recorded figure that would leave FastDeploy's KV cache nothing is not taken: FastDeploy
        would stop the start ("not enough memory for the KV cache") before any capture rewrote
        the record, and every later start with it. A figure taken is marked in the record until
        a capture session confirms it, so that a start that fails after taking it (whatever the
        cause) is never followed by another that takes it again."""
        if not reserve.recorded_keys:
            return reserve
        members = self._worker.backends()
        record = Record.of(members[0].settings) if members else None
        if record is None:
            return reserve
        try:
            if reserve.nbytes >= available:
                record.drop(reserve.recorded_keys)
                logger.warning(
                    "FD_CUDAGRAPH_KV_RESERVE=auto: the record %s holds %s for this plan, no less "
                    "than the %s FastDeploy's memory profile leaves the KV cache; it is dropped "
                    "and nothing is reserved at this start (the next start measures again).",
                    record.path,
                    human_bytes(reserve.nbytes),
                    human_bytes(max(int(available), 0)),
                )
                return _auto(0, f"the record {record.path} held more than the KV budget: dropped")
            record.mark_taken(reserve.recorded_keys)
        except (OSError, ValueError) as error:
            self._worker.outputs.failed("FD_CUDAGRAPH_KV_RESERVE record", record.path, error)
        return reserve

    def _starving(self, record: Record, key: str, nbytes: int, budget: int) -> str:
        """A recorded figure no smaller than the KV budget: dropped (a probe measures again, at
        this start where the mode allows one, else at the next), said once; why, for the log."""
        why = (
            f"the record {record.path} holds {human_bytes(nbytes)} for this plan, no less than "
            f"the {human_bytes(max(budget, 0))} the KV budget leaves now; dropped"
        )
        logger.warning("FD_CUDAGRAPH_KV_RESERVE=auto: %s.", why)
        try:
            record.drop((key,))
        except (OSError, ValueError) as error:
            self._worker.outputs.failed("FD_CUDAGRAPH_KV_RESERVE record", record.path, error)
        return why

    def _auto(self, runner: Any) -> Reserve:
        """``auto`` inside the profile run (the backends exist): the record, else a probe."""
        members = self._worker.backends()
        if not members:
            return _auto(0, "the profile run built no CUDA graph backend")
        settings = members[0].settings
        runtime = members[0].runtime
        mode = settings.mode
        phases = mode.recorded_phases
        record = Record.of(settings)
        device = runtime.device_memory()
        total, why, keys = 0, [], []
        # What FastDeploy's profile will leave the KV cache, as far as it can be told now (the
        # profile run's own cache still in use: a little less than its answer).
        budget = _kv_budget_now(device, settings.gpu_memory_utilization)
        for phase in phases:
            try:
                key = record_key(members, phase)
                nbytes, source = record.lookup(key, device[1] if device else None)
            except Exception as error:  # local to this rank: it must still reach the point below
                nbytes, source = None, f"the record could not be looked up ({error})"
            if nbytes is not None and budget is not None and total + nbytes >= budget:
                nbytes, source = None, self._starving(record, key, total + nbytes, budget)
            if nbytes is None:
                why.append(source)
            else:
                total, keys = total + nbytes, [*keys, key]
        recorded = None if why else _auto(total, f"{source}, from {record.path}", tuple(keys))
        sizes = list(settings.capture_sizes)
        picks = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]}, reverse=True)
        before = None
        # Records are per rank, and FastDeploy's MIN all-reduce of the KV block count follows
        # this profile: whether to probe is agreed, so that no rank probes (and waits) alone.
        session = CaptureSession(
            "decode",
            fd_config=runner.fd_config,
            runner=runner,
            ordered=False,
            purpose="KV-reserve probe",
            reserve=self.current,
        )
        with session:
            lacking = any(
                session.agreement.share("record", None, None, lambda: recorded is None, bool)
            )
            probing = lacking and mode.probe_capturable
            if probing:
                before = runtime.device_memory()
                for size in picks:
                    seam.dummy_decode_step(runner, size)
        if not probing:
            return recorded or _auto(
                0,
                f"{why[0]}, and no probe in {mode.name} mode with speculative method "
                f"{settings.speculative_method}: nothing reserved at this start; the next start "
                f"with this plan reserves what this one measures",
            )
        lifecycle.state(self._worker).release_every_graph(members[0])  # empties the cache too
        after = runtime.device_memory()
        if before is not None and after is not None:
            self.probe_kept = max(before[0] - after[0], 0)
        if recorded is not None:  # another rank lacked its record; this one keeps its own
            return recorded
        return _estimate(session.report, sizes, picks, why[0])

    # -- seam 2: the end of a capture loop

    def after_capture(self, report: CaptureReport, members: list[Any]) -> None:
        """A capture loop's session ended well: record what it took on this rank (``auto``
        reads it at the next start, also after a start with the reserve off), and warn once
        where the reserve taken was short. Never raises: the graphs are captured."""
        try:
            self._after_capture(report, members)
        except Exception:
            self._worker.outputs.failed_here("reserve", "graph-memory record")

    def _after_capture(self, report: CaptureReport, members: list[Any]) -> None:
        mine = report.mine()
        choice = self.current.choice
        # A start captures FastDeploy's whole list: a recapture of fewer sizes fitted to traffic
        # took less than the next start needs, and is no figure to reserve from.
        if mine is None or not report.records or report.fit_sizes:
            return
        taken = mine.taken_bytes
        # A probe at this start already took part of what a start without one takes in the
        # session (library workspaces, cached blocks): the record holds the whole.
        recorded, self.probe_kept = taken + self.probe_kept, 0
        record = Record.of(members[0].settings)
        what = {"phase": report.phase, "graphs": report.graphs}
        try:
            record.store(record_key(members, report.phase), recorded, mine.graph_bytes, what)
        except (OSError, ValueError) as error:
            if choice is not Choice.OFF:
                self._worker.outputs.failed("FD_CUDAGRAPH_KV_RESERVE record", record.path, error)
            else:  # nobody asked for it: a convenience for a later start with auto
                logger.debug("no graph-memory record written to %s: %s", record.path, error)
        if choice is Choice.OFF:
            return
        if self.current.nbytes is None:
            if not self._warned:
                self._warned = True
                logger.info(
                    "FD_CUDAGRAPH_KV_RESERVE is set, but FastDeploy sized the KV cache without "
                    "its memory profile (num_gpu_blocks_override), so nothing was reserved; "
                    "this rank's graphs took %s.",
                    human_bytes(taken),
                )
            return
        self.taken += taken
        if self.taken > self.current.nbytes and not self._warned:
            self._warned = True
            logger.warning(
                "FD_CUDAGRAPH_KV_RESERVE reserved %s (%s) for this rank's graphs, but they took "
                "%s: the KV cache left %s too little.%s",
                human_bytes(self.current.nbytes),
                self.current.source,
                human_bytes(self.taken),
                human_bytes(self.taken - self.current.nbytes),
                " The record now holds the measured figure for the next start."
                if choice is Choice.AUTO
                else "",
            )

    def after_failed_capture(self, error: BaseException, members: list[Any]) -> None:
        """A capture ran out of memory with a reserve from the record: that figure was too low,
        so it is dropped, and the next start measures again instead of failing the same way.
        Never raises: the capture's own error is what the caller raises."""
        try:
            self._after_failed_capture(error, members)
        except Exception:
            self._worker.outputs.failed_here("reserve", "graph-memory record")

    def _after_failed_capture(self, error: BaseException, members: list[Any]) -> None:
        if not getattr(error, "out_of_memory", False) or self.current.nbytes is None:
            return
        keys = self.current.recorded_keys
        if not keys or not members:
            return
        record = Record.of(members[0].settings)
        try:
            record.drop(keys)
        except (OSError, ValueError) as dropped:
            self._worker.outputs.failed("FD_CUDAGRAPH_KV_RESERVE record", record.path, dropped)
            return
        logger.warning(
            "FD_CUDAGRAPH_KV_RESERVE=auto reserved %s from %s and capture still ran out of "
            "memory: that figure is dropped, so the next start measures again.",
            human_bytes(self.current.nbytes),
            record.path,
        )


def state() -> KvReserve:
    """This process's reserve (made at first use): it spans the memory profile and every later
    capture loop, so it lives on the worker process, reached from the two seams only."""
    worker = process.current()
    if not isinstance(worker.reserve, KvReserve):
        worker.reserve = KvReserve(worker)
    return worker.reserve


def _auto(nbytes: int, source: str, keys: tuple[str, ...] = ()) -> Reserve:
    return Reserve(Choice.AUTO, nbytes, source, keys)


def _kv_budget_now(device: tuple[int, int] | None, utilization: float | None) -> int | None:
    """``total * gpu_memory_utilization - used``: FastDeploy's KV budget as of now; None where
    the device or the share is unknown."""
    if device is None or utilization is None:
        return None
    free, total = device
    return int(total * utilization - (total - free))


def _estimate(report: CaptureReport, sizes: list[int], picks: list[int], why: str) -> Reserve:
    """The probe's estimate of this plan's graph memory: the largest graph plus what the bigger
    of the two others took in the same pool for each further size, plus what the probe's
    session took beside its graphs."""
    by_size = {r.size: r.graph_bytes for r in report.records if r.role != "draft"}
    mine = report.mine()
    beside = max(mine.taken_bytes - mine.graph_bytes, 0) if mine is not None else 0
    largest = by_size.get(sizes[0], 0)
    further = max((n for size, n in by_size.items() if size != sizes[0]), default=0)
    return _auto(
        beside + largest + (len(sizes) - 1) * further,
        f"{why}; estimated from a probe capture of sizes {picks} ({human_bytes(largest)} for "
        f"the largest, up to {human_bytes(further)} for each other size, "
        f"{human_bytes(beside)} beside the graphs)",
    )


# ------------------------------------------------------------------------------- the record


def record_key(members: list[Any], phase: str) -> str:
    """What makes a session's graph memory the same at the next start, hashed: the plan as the
    ranks compare it, the model with its dtype and quantization, this rank, the pool, the device
    model and the Paddle and plugin versions."""
    from fd_cudagraph_plugin import __version__

    settings = members[0].settings
    facts = {
        "phase": phase,
        "model": settings.model_name,
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "tp_size": settings.tp_size,
        "tp_rank": settings.tp_rank,
        "pool": settings.options.pool,
        "device": members[0].runtime.device_name(),
        "paddle": _paddle_version(),
        "plugin": __version__,
        **backends_plan(members),
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _paddle_version() -> str:
    try:
        import paddle
    except ImportError:
        return ""
    commit = getattr(getattr(paddle, "version", None), "commit", "")
    return f"{getattr(paddle, '__version__', '')} {commit}".strip()


class Record:
    """What each plan's capture took on this rank, kept under FastDeploy's log directory."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def of(cls, ranks: Any) -> Record:
        return cls.for_rank(outputs.log_dir(), ranks.dp_rank, ranks.tp_rank)

    @classmethod
    def for_rank(cls, log_dir: str, dp_rank: int, tp_rank: int) -> Record:
        name = f"graph_memory.dp{dp_rank}.tp{tp_rank}.json"
        return cls(os.path.join(log_dir, "fd_cudagraph", name))

    def load(self) -> tuple[dict[str, Any], str | None]:
        """The plans recorded, and why none could be read (missing, corrupt) or None."""
        try:
            data = json.loads(outputs.read_file(self.path, MAX_RECORD_BYTES))
        except FileNotFoundError:
            return {}, "no record yet"
        except (OSError, ValueError, RecursionError) as error:
            return {}, f"the record {self.path} is unreadable ({type(error).__name__}: {error})"
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            return {}, f"the record {self.path} is not an {RECORD_FORMAT} file"
        plans = data.get("plans")
        return (plans if isinstance(plans, dict) else {}), None

    def lookup(self, key: str, device_total: int | None) -> tuple[int | None, str]:
        """The bytes recorded for ``key``, or None and why not."""
        plans, problem = self.load()
        if problem is not None:
            return None, problem
        entry = plans.get(key)
        if not isinstance(entry, dict):
            return (
                None,
                "no record of this plan yet (model, sizes, modes, ranks or versions changed)",
            )
        problem = _bad_entry(entry, device_total)
        if problem:
            return None, f"the record {self.path} has a bad entry for this plan ({problem})"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["time"]))
        return entry["bytes"], f"measured at the start of {when} with this plan"

    def store(self, key: str, nbytes: int, graph_bytes: int, what: dict[str, Any]) -> None:
        """Keep ``nbytes`` for ``key``; raises OSError (the caller counts it, never fails on it)."""
        plans, _ = self.load()
        plans.pop(key, None)
        entry = {
            "bytes": int(nbytes),
            "graph_bytes": int(graph_bytes),
            "time": round(time.time(), 3),
            "plan": what,
        }
        kept = {key: entry, **dict(list(plans.items())[: MAX_PLANS - 1])}
        outputs.replace_file(
            self.path, json.dumps({"format": RECORD_FORMAT, "plans": kept}, indent=1)
        )

    def mark_taken(self, keys: tuple[str, ...]) -> None:
        """Mark ``keys``' figures as taken by this start, until its capture writes them anew
        (``store``): a start that never gets there leaves the mark for the next to see."""
        plans, problem = self.load()
        if problem is not None:
            return
        for key in keys:
            if isinstance(plans.get(key), dict):
                plans[key]["taken_unconfirmed"] = round(time.time(), 3)
        outputs.replace_file(
            self.path, json.dumps({"format": RECORD_FORMAT, "plans": plans}, indent=1)
        )

    def drop(self, keys: tuple[str, ...]) -> None:
        plans, problem = self.load()
        if problem is not None or not set(keys) & set(plans):
            return
        for key in keys:
            plans.pop(key, None)
        outputs.replace_file(
            self.path, json.dumps({"format": RECORD_FORMAT, "plans": plans}, indent=1)
        )


def _bad_entry(entry: dict[str, Any], device_total: int | None) -> str:
    """Why a recorded entry cannot be used, or ""."""
    nbytes, graphs, when = entry.get("bytes"), entry.get("graph_bytes"), entry.get("time")
    if type(nbytes) is not int or type(graphs) is not int:
        return "bytes and graph_bytes must be integers"
    if not 0 <= graphs <= nbytes:
        return f"bytes {nbytes} is below the graphs' own graph_bytes {graphs}"
    if device_total and nbytes > device_total:
        return f"bytes {nbytes} is more than the device has ({device_total})"
    if type(when) not in (int, float) or not math.isfinite(when):
        return "time must be a number"
    if not 0 <= when <= time.time() + 86400:
        return f"time {when} is not a past moment"
    if "taken_unconfirmed" in entry:
        return (
            "a start took this figure and never finished capturing with it, so it is not taken "
            "again"
        )
    return ""
