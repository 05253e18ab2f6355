"""FastDeploy's capture loops run inside a ``CaptureSession``, and its memory profile leaves
room for the graphs (``FD_CUDAGRAPH_KV_RESERVE``).

``GPUModelRunner.capture_model()`` (decode) and ``capture_model_prefill_and_mixed()`` (static split
prefill) own the dummy runs that make the backends capture; the wrappers keep those loops and
open a session around each. ``GpuWorker.determine_available_memory()`` answers how much memory the
KV cache may take; with a reserve its answer is that much less (``budget.py`` says why), so the
graphs captured afterwards fit. ``fastdeploy.py`` knows which classes and methods there are.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core import budget, fastdeploy, stats, worker
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.session import CaptureSession, record_fingerprint
from fd_cudagraph_plugin.core.stats import human_bytes

logger = logging.getLogger("fd_cudagraph_plugin")


def _in_session(method: Callable, phase: str) -> Callable:
    @functools.wraps(method)
    def run_in_session(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if worker.current().session is not None:
            return method(runner, *args, **kwargs)
        with CaptureSession(phase, fd_config=getattr(runner, "fd_config", None), runner=runner):
            return method(runner, *args, **kwargs)

    run_in_session._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return run_in_session


def _reserving(method: Callable) -> Callable:
    @functools.wraps(method)
    def determine_available_memory(gpu_worker: Any, *args: Any, **kwargs: Any) -> Any:
        choice = PluginOptions.from_env().kv_reserve
        if choice == "off":
            return method(gpu_worker, *args, **kwargs)
        runner = gpu_worker.model_runner
        if choice == "auto":
            found: list[budget.Reserve] = []
            with fastdeploy.before_profile_cache_is_cleared(
                runner, lambda: found.append(auto_reserve(runner))
            ):
                available = method(gpu_worker, *args, **kwargs)
            reserve = found[0] if found else budget.Reserve(0, "the profile run built no backend")
        else:
            available = method(gpu_worker, *args, **kwargs)
            reserve = budget.Reserve(int(choice), f"FD_CUDAGRAPH_KV_RESERVE={human_bytes(choice)}")
        worker.current().kv_reserve = reserve
        logger.info(
            "FD_CUDAGRAPH_KV_RESERVE: the KV cache may take %s instead of %s, leaving %s for "
            "this rank's CUDA graphs (%s).",
            human_bytes(max(int(available - reserve.nbytes), 0)),
            human_bytes(max(int(available), 0)),
            human_bytes(reserve.nbytes),
            reserve.source,
        )
        return available - reserve.nbytes

    determine_available_memory._fd_cudagraph_original = method  # type: ignore[attr-defined]
    return determine_available_memory


def auto_reserve(runner: Any) -> budget.Reserve:
    """``auto``: what this plan's capture took on this rank at the last start, read from the
    record; else a probe capture's estimate (plain decode); else nothing, and the next start
    reserves what this one measures. Runs inside the profile run: the backends exist."""
    members = worker.current().backends()
    if not members:
        return budget.Reserve(0, "the profile run built no CUDA graph backend")
    settings = members[0].settings
    phases = ("prefill", "decode") if settings.static_split else ("decode",)
    record = budget.Record.for_rank(stats.log_dir(), settings.dp_rank, settings.tp_rank)
    total, why = 0, []
    for phase in phases:
        nbytes, source = record.lookup(budget.plan_key(record_fingerprint(members, phase)))
        if nbytes is None:
            why.append(source)
        else:
            total += nbytes
    recorded = None if why else budget.Reserve(total, f"{source}, from {record.path}")
    plain = settings.mode == "dynamic" and not settings.speculative_method
    sizes = list(settings.capture_sizes)
    picks = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]}, reverse=True)
    runtime, before = members[0].runtime, None
    # Records are per rank, and FastDeploy's MIN all-reduce of the KV block count follows this
    # profile: whether to probe is agreed, so that no rank probes (and waits) alone.
    with CaptureSession("probe", fd_config=runner.fd_config, runner=runner) as session:
        lacking = any(session.points.share("record", None, None, lambda: recorded is None))
        probing = lacking and plain and not settings.only_prefill
        if probing:
            before = runtime.device_memory()
            for size in picks:
                fastdeploy.dummy_decode_step(runner, size)
    if not probing:
        return recorded or budget.Reserve(
            0,
            f"{why[0]}, and no probe in {settings.mode} mode with speculative method "
            f"{settings.speculative_method}: nothing reserved at this start; the next start "
            f"with this plan reserves what this one measures",
        )
    members[0].clear_graph()  # releases every backend's graphs and the IPC handles; empties
    after = runtime.device_memory()  # the allocator's cache
    if before is not None and after is not None:
        # Kept past the release (library workspaces): the capture at this start will not take
        # it again, a start without a probe will; the record adds it (session.py).
        worker.current().probe_kept = max(before[0] - after[0], 0)
    if recorded is not None:  # another rank lacked its record; this one keeps its own
        return recorded
    return _estimate(session, sizes, picks, why[0])


def _estimate(session: CaptureSession, sizes: list[int], picks: list[int], why: str):
    """The probe's estimate of this plan's graph memory: the largest graph plus what the bigger
    of the two others took in the same pool for each further size, plus what the probe's
    session took beside its graphs."""
    by_size = {r.size: r.graph_bytes for r in session.report.records if r.role != "draft"}
    mine = next((m for m in session.report.memory if m.rank == session.rank), None)
    beside = max(mine.taken_bytes - mine.graph_bytes, 0) if mine is not None else 0
    largest = by_size.get(sizes[0], 0)
    further = max((n for size, n in by_size.items() if size != sizes[0]), default=0)
    return budget.Reserve(
        beside + largest + (len(sizes) - 1) * further,
        f"{why}; estimated from a probe capture of sizes {picks} ({human_bytes(largest)} for "
        f"the largest, up to {human_bytes(further)} for each other size, "
        f"{human_bytes(beside)} beside the graphs)",
    )


def install() -> bool:
    """Wrap FastDeploy's capture loops and memory profile. Idempotent; False if no runner is
    loaded. Called as soon as a runner or worker module has finished importing (``watch()``),
    and by each backend's constructor, for runners imported some other way."""
    runners = fastdeploy.loaded_runners()
    for runner in runners:
        for name, phase in fastdeploy.CAPTURE_LOOPS:
            method = runner.__dict__.get(name)
            if method is not None and not hasattr(method, "_fd_cudagraph_original"):
                setattr(runner, name, _in_session(method, phase))
    for gpu_worker in fastdeploy.loaded_workers():
        method = gpu_worker.__dict__.get("determine_available_memory")
        if method is not None and not hasattr(method, "_fd_cudagraph_original"):
            gpu_worker.determine_available_memory = _reserving(method)
    return bool(runners)


def watch() -> None:
    """Install the wrappers now, and again whenever a runner module finishes importing."""
    fastdeploy.on_runner_import(install)


def uninstall() -> None:
    wrapped = [(r, n) for r in fastdeploy.loaded_runners() for n, _ in fastdeploy.CAPTURE_LOOPS]
    wrapped += [(w, "determine_available_memory") for w in fastdeploy.loaded_workers()]
    for owner, name in wrapped:
        original = getattr(owner.__dict__.get(name), "_fd_cudagraph_original", None)
        if original is not None:
            setattr(owner, name, original)
