"""Prometheus metrics (``FD_CUDAGRAPH_METRICS=1`` and ``prometheus_client`` importable).

FastDeploy sets ``PROMETHEUS_MULTIPROC_DIR`` in every process (on ``import fastdeploy``), and its
API server's ``/metrics`` reads worker metrics only from the files in that directory, through
``prometheus_client.multiprocess.MultiProcessCollector``: a collector registered in a worker's own
registry is never scraped. So the metrics are ordinary ``Counter`` and ``Gauge`` objects, which
``prometheus_client`` backs with those files when the variable is set (and keeps in the default
registry when it is not: the demo, a bare process). One path serves both, with the same names
and values.

``publish`` copies the backends' ``stats()`` into them; the stats reporter thread calls it every
few seconds, so the replay path never writes a metric. Counters grow by the delta since the last
publish. Names start with ``fd_cudagraph_``: FastDeploy drops from ``/metrics`` any worker metric
whose name starts with one of its own gauge names, which all start with ``fastdeploy:``.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger("fd_cudagraph_plugin")

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
