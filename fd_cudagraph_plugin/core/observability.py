"""What the plugin tells about the traffic it served: ``stats()``, the log lines, the stats file
for ``fd-cudagraph tune``, and Prometheus metrics; every backend of the process aggregated.

Nothing here runs on the replay path: the hot path only bumps a per-key counter
(``dispatch.py``), and every figure is derived from those counters when someone asks
(``stats()``, the periodic log line, the stats file, the reporter's Prometheus publish).

Prometheus (``FD_CUDAGRAPH_METRICS=1`` and ``prometheus_client`` importable): FastDeploy sets
``PROMETHEUS_MULTIPROC_DIR`` in every process (on ``import fastdeploy``), and its API server's
``/metrics`` reads worker metrics only from the files in that directory, through
``prometheus_client.multiprocess.MultiProcessCollector``: a collector registered in a worker's own
registry is never scraped. So the metrics are ordinary ``Counter`` and ``Gauge`` objects, which
``prometheus_client`` backs with those files when the variable is set (and keeps in the default
registry when it is not: the demo, a bare process). One path serves both, with the same names
and values. ``publish`` copies the backends' ``stats()`` into them; the stats reporter thread
calls it every few seconds, so the replay path never writes a metric. Counters grow by the delta
since the last publish. Names start with ``fd_cudagraph_``: FastDeploy drops from ``/metrics``
any worker metric whose name starts with one of its own gauge names, which all start with
``fastdeploy:``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from fd_cudagraph_plugin.core import budget, outputs, process, seam
from fd_cudagraph_plugin.core.dispatch import Dispatcher
from fd_cudagraph_plugin.core.errors import human_bytes, plural
from fd_cudagraph_plugin.core.graphs import GraphTable
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.process import WorkerProcess
from fd_cudagraph_plugin.core.session import CaptureReport
from fd_cudagraph_plugin.core.settings import Settings

logger = logging.getLogger("fd_cudagraph_plugin")


def backend_stats(
    dispatcher: Dispatcher,
    table: GraphTable,
    mode: Mode,
    captures: int,
    pool_policy: str,
    report: CaptureReport | None,
) -> dict[str, Any]:
    """One backend's ``stats()``: served traffic, and apart from it what ran while FastDeploy
    captured; its graphs; the memory after its last capture session."""
    entries = table.all()
    captured = [e for e in entries if e.captured]
    decode = [e for e in captured if e.phase == "decode"]
    capture_time = dispatcher.capture_counts.summary()
    return {
        "captures": captures,
        **dispatcher.served_counts.summary(),
        "capture_time": {
            "replays": capture_time["replays"],
            "prefill_replays": capture_time["prefill_replays"],
            "eager_steps": capture_time["eager_fallbacks"],
        },
        "capture_seconds": {e.size: e.capture_seconds for e in decode},
        "graph_bytes": {e.size: e.graph_bytes for e in decode},
        "graph_bytes_total": sum(e.graph_bytes for e in captured),
        "largest_graph_bytes": max((e.graph_bytes for e in captured), default=0),
        "pool_policy": pool_policy,
        "memory": _memory(report),
        "static_full_decode": mode.static_decode_verdict,
    }


def _memory(report: CaptureReport | None) -> dict[str, Any]:
    """This rank's device memory after the last capture session, and the reserve taken."""
    figures: dict[str, Any] = {"kv_reserve_bytes": None, "kv_reserve_source": ""}
    if report is None:
        return figures
    figures["kv_reserve_bytes"] = report.reserve.nbytes
    figures["kv_reserve_source"] = report.reserve.source
    mine = report.mine()
    if mine is not None and mine.total:
        figures["free_after_capture_bytes"] = mine.free
        if mine.utilization is not None:
            figures["fit_gpu_memory_utilization"] = budget.fit_utilization(
                mine.utilization, mine.free, mine.total
            )
    return figures


STATS_FORMAT = "fd-cudagraph-stats/1"


def aggregate(worker: WorkerProcess) -> dict[str, Any]:
    """The counters of every live backend of ``worker``, summed, plus each one's ``stats()``."""
    replays: Counter[int] = Counter()
    fallbacks: Counter[str] = Counter()
    past: Counter[int] = Counter()
    per_backend = {}
    captures = padded = graph_bytes = 0
    for backend in worker.backends():
        own = backend.stats()
        per_backend[f"{id(backend):#x}"] = own
        captures += own["captures"]
        padded += own["padded_tokens"]
        graph_bytes += own["graph_bytes_total"]
        replays.update(own["replays"])
        fallbacks.update(own["eager_fallbacks"])
        past.update(own["padded_past_fastdeploy"])
    return {
        "backends": per_backend,
        "captures": captures,
        "replays": dict(sorted(replays.items())),
        "eager_fallbacks": dict(fallbacks),
        "padded_tokens": padded,
        "padded_past_fastdeploy": dict(sorted(past.items())),
        "graph_bytes": graph_bytes,
    }


def _eager(fallbacks: dict[str, int]) -> str:
    """``3 eager steps (oversized decode 2, zero tokens 1)``, or ``no eager steps``."""
    total = sum(fallbacks.values())
    if not total:
        return "no eager steps"
    reasons = ", ".join(
        f"{reason.replace('_', ' ')} {n}" for reason, n in sorted(fallbacks.items()) if n
    )
    return f"{plural(total, 'eager step')} ({reasons})"


def format_table(own: dict[str, Any], title: str) -> str:
    """A per-size table of one backend's ``stats()``: replays, padding, capture time, memory,
    for the sizes that served steps; the captured sizes that served none in one line."""
    lines = [
        f"{title}: {plural(own['captures'], 'capture')}, "
        f"{plural(sum(own['replays'].values()), 'replay')}, "
        f"{plural(own['padded_tokens'], 'padded token')}, {_eager(own['eager_fallbacks'])}",
    ]
    sizes = sorted(size for size, n in own["replays"].items() if n)
    idle = sorted(set(own["capture_seconds"]) - set(sizes), reverse=True)
    if sizes:
        lines.append(
            f"{'size':>6} {'replays':>9} {'padded':>9} {'capture ms':>11} {'graph memory':>13}"
        )
    for size in sizes:
        lines.append(
            f"{size:>6} {own['replays'].get(size, 0):>9} "
            f"{own['padded_tokens_per_size'].get(size, 0):>9} "
            f"{own['capture_seconds'].get(size, 0.0) * 1e3:>11.1f} "
            f"{human_bytes(own['graph_bytes'].get(size, 0)):>13}"
        )
    if idle:
        shown = ", ".join(str(s) for s in idle[:12]) + (", ..." if idle[12:] else "")
        idle_bytes = sum(own["graph_bytes"].get(s, 0) for s in idle)
        lines.append(
            f"{plural(len(idle), 'captured size')} served no step ({shown}), holding "
            f"{human_bytes(idle_bytes)} of graph memory"
        )
    return "\n".join(lines)


def log_summary(reason: str, backends: list[Any], failures: outputs.OutputFailures) -> None:
    """Log the table of each of ``backends`` that captured or fell back. Never raises: it runs in
    ``clear_graph()``, which must release graphs whatever else fails."""
    try:
        for backend in backends:
            own = backend.stats()
            if own["captures"] or own["eager_fallbacks"]:
                title = f"CUDA graph summary ({reason}), backend {id(backend):#x} ({backend.role})"
                logger.info("%s", format_table(own, title))
    except Exception:
        failures.failed_here("summary", "summary table")


class StatsFile:
    """Appends a backend's observed decode steps, as increments, for ``fd-cudagraph tune``.

    One JSON object per line: ``{"format": "fd-cudagraph-stats/1", "time": ..., "rank": ...,
    "backend": "0x...", "capture_sizes": [...], "max_num_seqs": N, "decode_token_counts":
    {"<tokens>": <steps>, ...}}``; under speculative decoding, where FastDeploy keys graphs by
    running requests, ``"running_request_counts"`` instead, with ``speculative_method`` and
    ``num_speculative_tokens``. ``capture_sizes`` is the deployed decode list in tokens, as
    FastDeploy derived it, largest first. ``eager_above_largest`` holds the steps above its
    largest, run eagerly (by FastDeploy's ``GraphOptBackend``, mostly), in the same unit and
    apart from the others. Summing the counts of every line, both kinds, gives the histogram.
    ``plan`` and ``role`` say whose traffic it is (``plan_digest``, ``target`` or ``draft``): what a
    later start of the same plan fits its capture to (``recorded_traffic``).
    Written only at flushes (periodic, on clear, at exit); a failed write is logged once and
    retried with the next flush.
    """

    def __init__(self, path: str, settings: Settings, failures: outputs.OutputFailures) -> None:
        self.path = outputs.output_path(path, settings)
        self._failures = failures
        self.rank = settings.tp_rank
        self.by_running = settings.mode.keyed_by_running
        self.method = settings.speculative_method
        self.k = settings.num_speculative_tokens
        self.capture_sizes = list(settings.capture_sizes)
        self.max_num_seqs = settings.max_num_seqs
        self.plan = plan_digest(settings)
        self._written: dict[str, tuple[Counter[int], dict[int, int]]] = {}

    def flush(self, backend: Any) -> None:
        key = f"{id(backend):#x}"
        above = backend.observed_above()
        current = (Counter(backend.observed_keys()) - Counter(above), above)
        previous = self._written.get(key, ({}, {}))
        counts, eager = (
            {str(n): c - before.get(n, 0) for n, c in sorted(now.items()) if c > before.get(n, 0)}
            for now, before in zip(current, previous, strict=True)
        )
        if not counts and not eager:
            return
        line: dict[str, Any] = {
            "format": STATS_FORMAT,
            "time": round(time.time(), 3),
            "rank": self.rank,
            "backend": key,
            "capture_sizes": self.capture_sizes,
            "max_num_seqs": self.max_num_seqs,
            "plan": self.plan,
            "role": backend.role,
        }
        if self.by_running:
            line["speculative_method"] = self.method
            line["num_speculative_tokens"] = self.k
            line["running_request_counts"] = counts
        else:
            line["decode_token_counts"] = counts
        line["eager_above_largest"] = eager
        try:
            outputs.write_file(self.path, json.dumps(line) + "\n", append=True)
        except OSError as error:
            self._failures.failed("FD_CUDAGRAPH_STATS_FILE", self.path, error)
            return
        self._written[key] = current


def plan_digest(settings: Settings) -> str:
    """What a stats record must share with a deployment for its traffic to stand for this one's
    (``FD_CUDAGRAPH_FIT`` at start): the model, the TP size, the speculative settings, the
    FastDeploy release and the capture list it derived."""
    plan = [
        settings.model_name,
        settings.dtype,
        settings.quantization,
        settings.ranks.tp_size,
        settings.speculative_method,
        settings.num_speculative_tokens,
        list(settings.capture_sizes),
        seam.version(),
    ]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:16]


#: The most of a stats file read back at start: its tail, where the newest lines are.
MAX_RECORD_READ = 4 << 20


def recorded_traffic(path: str, settings: Settings, role: str) -> dict[int, int]:
    """The decode steps a stats file recorded for this plan and role (``plan_digest``), summed
    per key: the traffic a first capture fits to. Untrusted: a line that is not this plan's, or
    not well formed, costs only itself; an unreadable file is no traffic."""
    try:
        lines = outputs.read_file(path, MAX_RECORD_READ, tail=True).splitlines()
    except (OSError, ValueError):
        return {}
    plan = plan_digest(settings)
    field = "running_request_counts" if settings.mode.keyed_by_running else "decode_token_counts"
    top = max(settings.capture_sizes, default=0)
    traffic: Counter[int] = Counter()
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict):
            continue
        counts = record.get(field)
        ours = (record.get("plan"), record.get("role"), record.get("rank"))
        if ours != (plan, role, settings.tp_rank) or not isinstance(counts, dict):
            continue
        for key, steps in counts.items():
            key_ok = key.isascii() and key.isdigit() and len(key) <= 6 and 0 < int(key) <= top
            steps_ok = isinstance(steps, int) and not isinstance(steps, bool) and steps > 0
            if key_ok and steps_ok and steps < 1 << 40:
                traffic[int(key)] += steps
    return dict(traffic)


def flush_all(worker: WorkerProcess) -> None:
    for backend in worker.backends():
        try:
            backend.flush_stats()
        except Exception:
            worker.outputs.failed_here("flush", "stats flush")


def publish_metrics(worker: WorkerProcess) -> None:
    """Copy the counters of ``worker``'s live backends into the Prometheus metrics, if they are
    on. A failure is logged once and counted, never raised: metrics must not stop serving."""
    if not enabled():
        return
    failures = worker.outputs
    try:
        publish(worker.backends(), dict(failures.counts))  # a copy: writers may add keys
    except Exception as error:
        failures.failed("FD_CUDAGRAPH_METRICS", destination(), error)


#: How often the stats file is written when ``FD_CUDAGRAPH_STATS_INTERVAL`` is 0 and metrics are
#: off. FastDeploy stops workers with SIGTERM, which skips ``atexit``, so waiting for exit would
#: lose the file.
STATS_FILE_FLUSH_SECONDS = 60.0


class Reporter(threading.Thread):
    """Every N seconds: flush the stats files, publish the metrics, and log a line if
    ``FD_CUDAGRAPH_STATS_INTERVAL`` asked for one."""

    def __init__(self, worker: WorkerProcess, interval: float, log: bool) -> None:
        super().__init__(name="fd-cudagraph-stats", daemon=True)
        self.worker = worker
        self.interval = interval
        self.log = log
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            flush_all(self.worker)
            publish_metrics(self.worker)
            if self.log:
                try:
                    self._log_totals()
                except Exception:  # a reporter that dies silently helps nobody
                    self.worker.outputs.failed_here("stats_log", "periodic stats line")

    def _log_totals(self) -> None:
        totals = aggregate(self.worker)
        past = totals["padded_past_fastdeploy"]
        logger.info(
            "CUDA graphs: %d replays, %d padded tokens, eager fallbacks %s, graph memory "
            "%.0f MiB over %d backends%s",
            sum(totals["replays"].values()),
            totals["padded_tokens"],
            totals["eager_fallbacks"] or 0,
            totals["graph_bytes"] / (1 << 20),
            len(totals["backends"]),
            f"; padded past FastDeploy's sizes (FD_CUDAGRAPH_FIT), steps by size {past}"
            if past
            else "",
        )


def start(worker: WorkerProcess, options: PluginOptions) -> None:
    """What a process's first backend starts: the periodic reporter (once per process, if the
    options ask for it), and the metrics."""
    interval = reporter_interval(options)
    if worker.reporter is None and interval > 0:
        worker.reporter = Reporter(worker, interval, log=options.stats_interval > 0)
        worker.reporter.start()
    if options.metrics:
        enable()


def reporter_interval(options: PluginOptions) -> float:
    """Seconds between reporter runs: ``FD_CUDAGRAPH_STATS_INTERVAL`` when set, else often
    enough for Prometheus when metrics are on, else the stats file's flush period; 0 is none."""
    if options.stats_interval > 0:
        return options.stats_interval
    if options.metrics:
        return PUBLISH_SECONDS
    return STATS_FILE_FLUSH_SECONDS if options.stats_file else 0.0


def stop_reporter(worker: WorkerProcess) -> None:
    if worker.reporter is not None:
        worker.reporter.stop()
        worker.reporter = None


@atexit.register
def _at_exit() -> None:
    worker = process.current()
    stop_reporter(worker)
    flush_all(worker)
    publish_metrics(worker)
    log_summary("process exit", worker.backends(), worker.outputs)


# ---------------------------------------------------------------------------- Prometheus

#: Seconds between publishes when ``FD_CUDAGRAPH_STATS_INTERVAL`` is 0: a scrape every 15 s (a
#: common Prometheus interval) then sees values at most this old.
PUBLISH_SECONDS = 10.0

_LABELS = ("rank", "dp_rank", "role")

_metrics: _Metrics | None = None


class _Metrics:
    """The metric objects and what was last published, to increment counters by the delta."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        def counter(name: str, doc: str, *extra: str) -> Any:
            return Counter(name, doc, [*_LABELS, *extra], registry=registry)

        def gauge(name: str, doc: str, *extra: str) -> Any:
            # One worker process owns each label set, so the newest value is the value, even
            # across a worker restart that leaves the dead process's file behind.
            return Gauge(
                name, doc, [*_LABELS, *extra], registry=registry, multiprocess_mode="mostrecent"
            )

        self.counters = {
            "replays": counter("fd_cudagraph_replays", "CUDA graph replays", "size"),
            "captures": counter("fd_cudagraph_captures", "CUDA graphs captured"),
            "eager_fallbacks": counter(
                "fd_cudagraph_eager_fallbacks", "Steps run eagerly, by reason", "reason"
            ),
            "padded_tokens": counter(
                "fd_cudagraph_padded_tokens", "Tokens added by padding to a captured size"
            ),
            "padded_past_fastdeploy": counter(
                "fd_cudagraph_padded_past_fastdeploy_steps",
                "Decode steps FD_CUDAGRAPH_FIT padded past FastDeploy's size for them, by it",
                "size",
            ),
        }
        self.failures = Counter(
            "fd_cudagraph_output_failures",
            "Failed writes of the plugin's own outputs (report, stats file, metrics), by setting",
            ["rank", "dp_rank", "setting"],
            registry=registry,
        )
        self.gauges = {
            "graph_bytes": gauge(
                "fd_cudagraph_graph_memory_bytes", "Graph memory per captured size", "size"
            ),
            "capture_seconds": gauge(
                "fd_cudagraph_capture_seconds", "Capture time per captured size", "size"
            ),
            "free_after_capture_bytes": gauge(
                "fd_cudagraph_device_free_after_capture_bytes",
                "Device memory free after the last capture session (the driver's count)",
            ),
            "fit_gpu_memory_utilization": gauge(
                "fd_cudagraph_fit_gpu_memory_utilization",
                "The highest gpu_memory_utilization that would have fit the last capture",
            ),
            "kv_reserve_bytes": gauge(
                "fd_cudagraph_kv_reserve_bytes",
                "Memory FD_CUDAGRAPH_KV_RESERVE took out of FastDeploy's KV-cache budget",
            ),
        }
        self.registry = registry
        self.published: dict[tuple[str, tuple[str, ...]], float] = {}
        self.gauge_keys: set[tuple[str, tuple[str, ...]]] = set()

    def all(self) -> list[Any]:
        return [*self.counters.values(), self.failures, *self.gauges.values()]


def enable() -> bool:
    """Create the metrics once per process; False (and a log line) without prometheus_client."""
    global _metrics
    if _metrics is not None:
        return True
    try:
        from prometheus_client import REGISTRY, values
    except ImportError:
        logger.warning(
            "FD_CUDAGRAPH_METRICS=1 but prometheus_client is not importable; no metrics exported."
        )
        return False
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass is values.MutexValue:
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was imported before it was, "
            "so this process's fd_cudagraph_* metrics stay in memory and FastDeploy's /metrics "
            "cannot show them. Set PROMETHEUS_MULTIPROC_DIR before the process starts."
        )
    _metrics = _Metrics(REGISTRY)
    return True


def enabled() -> bool:
    return _metrics is not None


def disable() -> None:
    """Unregister the metrics (files already written in multiprocess mode stay)."""
    global _metrics
    if _metrics is not None:
        for metric in _metrics.all():
            _metrics.registry.unregister(metric)
        _metrics = None


def destination() -> str:
    """Where a publish writes, for the log line when one fails."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return f"PROMETHEUS_MULTIPROC_DIR={directory}" if directory else "the default registry"


def publish(backends: Iterable[Any], failures: Mapping[str, int]) -> None:
    """Copy the backends' ``stats()`` (and the output-failure counts) into the metrics.

    Backends of one role in a process are summed: a FastDeploy worker has one target and at most
    one draft backend. Gauges of a size that is gone (after ``clear_graph``) drop to 0.
    """
    metrics = _metrics
    if metrics is None:
        return
    counts: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    gauges: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    ranks: tuple[str, str] | None = None
    for backend in backends:
        own = backend.stats()
        settings = backend.settings
        ranks = (str(settings.tp_rank), str(settings.dp_rank))
        base = (*ranks, backend.role)
        counts[("captures", base)] += own["captures"]
        counts[("padded_tokens", base)] += own["padded_tokens"]
        for size, replays in own["replays"].items():
            counts[("replays", (*base, str(size)))] += replays
        for reason, steps in own["eager_fallbacks"].items():
            counts[("eager_fallbacks", (*base, reason))] += steps
        for size, steps in own["padded_past_fastdeploy"].items():
            counts[("padded_past_fastdeploy", (*base, str(size)))] += steps
        for name in ("graph_bytes", "capture_seconds"):
            for size, value in own[name].items():
                gauges[(name, (*base, str(size)))] += value
        for name, value in own.get("memory", {}).items():
            if value is not None and name in metrics.gauges:
                gauges[(name, base)] = value  # one device per process: the same for each role
    if ranks is not None:
        for setting, failed in failures.items():
            counts[("failures", (*ranks, setting))] += failed

    for (name, labels), value in counts.items():
        delta = value - metrics.published.get((name, labels), 0)
        if delta > 0:
            metric = metrics.failures if name == "failures" else metrics.counters[name]
            metric.labels(*labels).inc(delta)
    # Forget what is gone, so a later backend of the same role counts from its own zero.
    metrics.published = dict(counts)

    for name, labels in metrics.gauge_keys - gauges.keys():
        metrics.gauges[name].labels(*labels).set(0)
    for (name, labels), value in gauges.items():
        metrics.gauges[name].labels(*labels).set(value)
    metrics.gauge_keys = set(gauges)
