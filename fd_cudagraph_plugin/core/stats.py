"""Every backend of the process, their counters aggregated, logged and written out.

Nothing here runs on the replay path: the hot path only bumps a per-token-count counter, and all
figures are derived from those counters when someone asks (``stats()``, the periodic log line,
the stats file, the reporter's Prometheus publish).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections import Counter
from typing import Any

from fd_cudagraph_plugin.core import metrics, outputs, process
from fd_cudagraph_plugin.core.text import human_bytes, plural

logger = logging.getLogger("fd_cudagraph_plugin")

STATS_FORMAT = "fd-cudagraph-stats/1"


def live_backends() -> list[Any]:
    return process.current().backends()


def aggregate() -> dict[str, Any]:
    """The counters of every live backend, summed, plus each backend's own ``stats()``."""
    replays: Counter[int] = Counter()
    fallbacks: Counter[str] = Counter()
    per_backend = {}
    captures = padded = graph_bytes = 0
    for backend in live_backends():
        own = backend.stats()
        per_backend[f"{id(backend):#x}"] = own
        captures += own["captures"]
        padded += own["padded_tokens"]
        graph_bytes += own["graph_bytes_total"]
        replays.update(own["replays"])
        fallbacks.update(own["eager_fallbacks"])
    return {
        "backends": per_backend,
        "captures": captures,
        "replays": dict(sorted(replays.items())),
        "eager_fallbacks": dict(fallbacks),
        "padded_tokens": padded,
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
    """A per-size table of one backend's ``stats()``: replays, padding, capture time, memory."""
    lines = [
        f"{title}: {plural(own['captures'], 'capture')}, "
        f"{plural(sum(own['replays'].values()), 'replay')}, "
        f"{plural(own['padded_tokens'], 'padded token')}, {_eager(own['eager_fallbacks'])}",
        f"{'size':>6} {'replays':>9} {'padded':>9} {'capture ms':>11} {'graph memory':>13}",
    ]
    sizes = sorted(set(own["replays"]) | set(own["capture_seconds"]))
    for size in sizes:
        lines.append(
            f"{size:>6} {own['replays'].get(size, 0):>9} "
            f"{own['padded_tokens_per_size'].get(size, 0):>9} "
            f"{own['capture_seconds'].get(size, 0.0) * 1e3:>11.1f} "
            f"{human_bytes(own['graph_bytes'].get(size, 0)):>13}"
        )
    return "\n".join(lines)


def log_summary(reason: str, backends: list[Any] | None = None) -> None:
    """Log the table of each backend (every live one by default) that captured or fell back.
    Never raises: it runs in ``clear_graph()``, which must release graphs whatever else fails."""
    try:
        for backend in live_backends() if backends is None else backends:
            own = backend.stats()
            if own["captures"] or own["eager_fallbacks"]:
                title = f"CUDA graph summary ({reason}), backend {id(backend):#x} ({backend.role})"
                logger.info("%s", format_table(own, title))
    except Exception:
        process.current().outputs.failed_here("summary", "summary table")


class StatsFile:
    """Appends a backend's observed decode steps, as increments, for ``fd-cudagraph tune``.

    One JSON object per line: ``{"format": "fd-cudagraph-stats/1", "time": ..., "rank": ...,
    "backend": "0x...", "decode_token_counts": {"<tokens>": <steps>, ...}}``; under speculative
    decoding, where FastDeploy keys graphs by running requests, ``"running_request_counts"``
    instead, with ``speculative_method`` and ``num_speculative_tokens``. Summing the counts of
    every line gives the histogram. Written only at flushes (periodic, on clear, at exit); a
    failed write is logged once and retried with the next flush.
    """

    def __init__(self, path: str, settings: Any, failures: outputs.OutputFailures) -> None:
        self.path = outputs.output_path(path, settings)
        self._failures = failures
        self.rank = settings.tp_rank
        self.by_running = settings.keyed_by_running
        self.method = settings.speculative_method
        self.k = settings.num_speculative_tokens
        self._written: dict[str, dict[int, int]] = {}

    def flush(self, backend: Any) -> None:
        key = f"{id(backend):#x}"
        current = backend.observed_keys()
        previous = self._written.get(key, {})
        increments = {
            n: c - previous.get(n, 0) for n, c in current.items() if c > previous.get(n, 0)
        }
        if not increments:
            return
        counts = {str(n): c for n, c in sorted(increments.items())}
        line: dict[str, Any] = {
            "format": STATS_FORMAT,
            "time": round(time.time(), 3),
            "rank": self.rank,
            "backend": key,
        }
        if self.by_running:
            line["speculative_method"] = self.method
            line["num_speculative_tokens"] = self.k
            line["running_request_counts"] = counts
        else:
            line["decode_token_counts"] = counts
        try:
            outputs.write_file(self.path, json.dumps(line) + "\n", append=True)
        except OSError as error:
            self._failures.failed("FD_CUDAGRAPH_STATS_FILE", self.path, error)
            return
        self._written[key] = current


def flush_all() -> None:
    for backend in live_backends():
        try:
            backend.flush_stats()
        except Exception:
            process.current().outputs.failed_here("flush", "stats flush")


def publish_metrics() -> None:
    """Copy every live backend's counters into the Prometheus metrics, if they are on. A failure
    is logged once and counted, never raised: metrics must not stop serving."""
    if not metrics.enabled():
        return
    failures = process.current().outputs
    try:
        metrics.publish(live_backends(), dict(failures.counts))  # a copy: writers may add keys
    except Exception as error:
        failures.failed("FD_CUDAGRAPH_METRICS", metrics.destination(), error)


#: How often the stats file is written when ``FD_CUDAGRAPH_STATS_INTERVAL`` is 0 and metrics are
#: off. FastDeploy stops workers with SIGTERM, which skips ``atexit``, so waiting for exit would
#: lose the file.
STATS_FILE_FLUSH_SECONDS = 60.0


class Reporter(threading.Thread):
    """Every N seconds: flush the stats files, publish the metrics, and log a line if
    ``FD_CUDAGRAPH_STATS_INTERVAL`` asked for one."""

    def __init__(self, interval: float, log: bool) -> None:
        super().__init__(name="fd-cudagraph-stats", daemon=True)
        self.interval = interval
        self.log = log
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            flush_all()
            publish_metrics()
            if self.log:
                try:
                    self._log_totals()
                except Exception:  # a reporter that dies silently helps nobody
                    process.current().outputs.failed_here("stats_log", "periodic stats line")

    @staticmethod
    def _log_totals() -> None:
        totals = aggregate()
        logger.info(
            "CUDA graphs: %d replays, %d padded tokens, eager fallbacks %s, graph memory "
            "%.0f MiB over %d backends",
            sum(totals["replays"].values()),
            totals["padded_tokens"],
            totals["eager_fallbacks"] or 0,
            totals["graph_bytes"] / (1 << 20),
            len(totals["backends"]),
        )


def reporter_interval(options: Any) -> float:
    """Seconds between reporter runs: ``FD_CUDAGRAPH_STATS_INTERVAL`` when set, else often
    enough for Prometheus when metrics are on, else the stats file's flush period; 0 is none."""
    if options.stats_interval > 0:
        return options.stats_interval
    if options.metrics:
        return metrics.PUBLISH_SECONDS
    return STATS_FILE_FLUSH_SECONDS if options.stats_file else 0.0


def start_reporter(options: Any) -> None:
    """Start the periodic thread once per process, if the options ask for it."""
    owner = process.current()
    interval = reporter_interval(options)
    if owner.reporter is None and interval > 0:
        owner.reporter = Reporter(interval, log=options.stats_interval > 0)
        owner.reporter.start()


def stop_reporter() -> None:
    owner = process.current()
    if owner.reporter is not None:
        owner.reporter.stopped.set()
        owner.reporter = None


@atexit.register
def _at_exit() -> None:
    stop_reporter()
    flush_all()
    publish_metrics()
    log_summary("process exit")
