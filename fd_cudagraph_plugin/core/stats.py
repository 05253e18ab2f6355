"""Every backend of the process, their counters aggregated, logged and written out.

Nothing here runs on the replay path: the hot path only bumps a per-token-count counter, and all
figures are derived from those counters when someone asks (``stats()``, the periodic log line,
the stats file, the reporter's Prometheus publish).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Protocol

from fd_cudagraph_plugin.core import metrics, worker

logger = logging.getLogger("fd_cudagraph_plugin")

STATS_FORMAT = "fd-cudagraph-stats/1"

_reporter: _Reporter | None = None


#: Writes of the plugin's own files that failed, by setting: logged once each, never raised.
output_failures: Counter[str] = Counter()


def output_failed(setting: str, path: str, error: BaseException) -> None:
    """A report, stats or dot file could not be written: log once per setting and count it.
    Observability must never stop capture, serving or ``clear_graph()``."""
    output_failures[setting] += 1
    if output_failures[setting] == 1:
        logger.warning(
            "%s: cannot write %s (%s: %s); serving goes on without it. Further failures are "
            "counted in stats.output_failures without another warning.",
            setting,
            path,
            type(error).__name__,
            error,
        )


def _failed_once(key: str, what: str) -> None:
    """In an ``except`` block: log the traceback the first time ``key`` fails, count every time.
    Observability never takes serving down."""
    if not output_failures[key]:
        logger.exception("fd-cudagraph %s failed; serving goes on", what)
    output_failures[key] += 1


class Ranks(Protocol):
    """Where a process sits in the deployment (``Settings`` is one)."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def log_dir() -> str:
    """FastDeploy's log directory (``FD_LOG_DIR``, FastDeploy's default ``log``): where the
    graph-memory record and the dot files go."""
    return os.environ.get("FD_LOG_DIR", "log")


def output_path(template: str, ranks: Ranks | None = None) -> str:
    """The file this process writes for FD_CUDAGRAPH_MEMORY_REPORT or FD_CUDAGRAPH_STATS_FILE.

    ``{rank}`` becomes the tensor-parallel rank and ``{dp_rank}`` the data-parallel rank. So that
    no two workers of a deployment write one file, a placeholder the deployment needs (``{rank}``
    when TP > 1, ``{dp_rank}`` when DP > 1) but the template lacks is added before the extension:
    ``graphs.json`` becomes ``graphs.dp1.tp0.json``. A single-GPU deployment keeps the path as
    given. ``ranks`` defaults to those of this process's backends.
    """
    if ranks is None:
        backends = live_backends()
        if not backends:
            return template.replace("{rank}", "0").replace("{dp_rank}", "0")
        ranks = backends[-1].settings  # every backend of a process has the same ranks
    suffix = ""
    if ranks.dp_size > 1 and "{dp_rank}" not in template:
        suffix += f".dp{ranks.dp_rank}"
    if ranks.tp_size > 1 and "{rank}" not in template:
        suffix += f".tp{ranks.tp_rank}"
    path = template.replace("{rank}", str(ranks.tp_rank)).replace("{dp_rank}", str(ranks.dp_rank))
    if suffix:
        head, name = os.path.split(path)
        stem, extension = os.path.splitext(name)
        path = os.path.join(head, f"{stem}{suffix}{extension}")
    return path


def live_backends() -> list[Any]:
    return worker.current().backends()


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


def human_bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _eager(fallbacks: dict[str, int]) -> str:
    """``3 eager steps (oversized decode 2, zero tokens 1)``, or ``no eager steps``."""
    total = sum(fallbacks.values())
    if not total:
        return "no eager steps"
    reasons = ", ".join(
        f"{reason.replace('_', ' ')} {n}" for reason, n in sorted(fallbacks.items()) if n
    )
    return f"{total} eager step{'s' if total != 1 else ''} ({reasons})"


def format_table(own: dict[str, Any], title: str) -> str:
    """A per-size table of one backend's ``stats()``: replays, padding, capture time, memory."""
    lines = [
        f"{title}: {own['captures']} captures, {sum(own['replays'].values())} replays, "
        f"{own['padded_tokens']} padded tokens, {_eager(own['eager_fallbacks'])}",
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
        _failed_once("summary", "summary table")


class StatsFile:
    """Appends a backend's observed decode steps, as increments, for ``fd-cudagraph tune``.

    One JSON object per line: ``{"format": "fd-cudagraph-stats/1", "time": ..., "rank": ...,
    "backend": "0x...", "decode_token_counts": {"<tokens>": <steps>, ...}}``; under speculative
    decoding, where FastDeploy keys graphs by running requests, ``"running_request_counts"``
    instead, with ``speculative_method`` and ``num_speculative_tokens``. Summing the counts of
    every line gives the histogram. Written only at flushes (periodic, on clear, at exit); a
    failed write is logged once and retried with the next flush.
    """

    def __init__(self, path: str, settings: Any) -> None:
        self.path = output_path(path, settings)
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
            directory = os.path.dirname(self.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")
        except OSError as error:
            output_failed("FD_CUDAGRAPH_STATS_FILE", self.path, error)
            return
        self._written[key] = current


def flush_all() -> None:
    for backend in live_backends():
        try:
            backend.flush_stats()
        except Exception:
            _failed_once("flush", "stats flush")


def publish_metrics() -> None:
    """Copy every live backend's counters into the Prometheus metrics, if they are on. A failure
    is logged once and counted, never raised: metrics must not stop serving."""
    if not metrics.enabled():
        return
    try:
        metrics.publish(live_backends(), dict(output_failures))  # a copy: writers may add keys
    except Exception as error:
        output_failed("FD_CUDAGRAPH_METRICS", metrics.destination(), error)


#: How often the stats file is written when ``FD_CUDAGRAPH_STATS_INTERVAL`` is 0 and metrics are
#: off. FastDeploy stops workers with SIGTERM, which skips ``atexit``, so waiting for exit would
#: lose the file.
STATS_FILE_FLUSH_SECONDS = 60.0


class _Reporter(threading.Thread):
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
                    _failed_once("stats_log", "periodic stats line")

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
    global _reporter
    interval = reporter_interval(options)
    if _reporter is None and interval > 0:
        _reporter = _Reporter(interval, log=options.stats_interval > 0)
        _reporter.start()


def stop_reporter() -> None:
    global _reporter
    if _reporter is not None:
        _reporter.stopped.set()
        _reporter = None


@atexit.register
def _at_exit() -> None:
    stop_reporter()
    flush_all()
    publish_metrics()
    log_summary("process exit")
