"""Prometheus metrics (``FD_CUDAGRAPH_METRICS=1`` and ``prometheus_client`` importable).

A collector registered once per process reads the backends' counters at scrape time, so the replay
path pays nothing whether metrics are on or off, and there is no hard dependency.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("fd_cudagraph_plugin")

_collector = None


class _Collector:
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from fd_cudagraph_plugin import stats

        labels = ["rank", "backend", "role"]
        replays = CounterMetricFamily(
            "fd_cudagraph_replays", "CUDA graph replays", labels=[*labels, "size"]
        )
        captures = CounterMetricFamily(
            "fd_cudagraph_captures", "CUDA graphs captured", labels=labels
        )
        fallbacks = CounterMetricFamily(
            "fd_cudagraph_eager_fallbacks",
            "Steps run eagerly, by reason",
            labels=[*labels, "reason"],
        )
        padded = CounterMetricFamily(
            "fd_cudagraph_padded_tokens",
            "Tokens added by padding to a captured size",
            labels=labels,
        )
        memory = GaugeMetricFamily(
            "fd_cudagraph_graph_memory_bytes",
            "Graph memory per captured size",
            labels=[*labels, "size"],
        )
        capture_time = GaugeMetricFamily(
            "fd_cudagraph_capture_seconds", "Capture time per size", labels=[*labels, "size"]
        )
        for backend in stats.live_backends():
            own = backend.stats()
            base = [str(backend.settings.tp_rank), f"{id(backend):#x}", backend.role]
            captures.add_metric(base, own["captures"])
            padded.add_metric(base, own["padded_tokens"])
            for size, count in own["replays"].items():
                replays.add_metric([*base, str(size)], count)
            for reason, count in own["eager_fallbacks"].items():
                fallbacks.add_metric([*base, reason], count)
            for size, nbytes in own["graph_bytes"].items():
                memory.add_metric([*base, str(size)], nbytes)
            for size, seconds in own["capture_seconds"].items():
                capture_time.add_metric([*base, str(size)], seconds)
        yield from (replays, captures, fallbacks, padded, memory, capture_time)


def enable() -> bool:
    """Register the collector once; False (and a log line) when prometheus_client is missing."""
    global _collector
    if _collector is not None:
        return True
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        logger.warning(
            "FD_CUDAGRAPH_METRICS=1 but prometheus_client is not importable; no metrics exported."
        )
        return False
    collector = _Collector()
    REGISTRY.register(collector)
    _collector = collector
    return True


def disable() -> None:
    global _collector
    if _collector is not None:
        from prometheus_client import REGISTRY

        REGISTRY.unregister(_collector)
        _collector = None
