"""Prometheus metrics: published by the reporter, never by the replay path, and readable by
FastDeploy's /metrics through prometheus_client's multiprocess files."""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Beside, Buffers, TinyBackbone, make_config

from fd_cudagraph_plugin.core import observability, process
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.options import PluginOptions

prometheus_client = pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def metrics_on(monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_METRICS", "1")
    yield
    observability.disable()


def served_backend():
    model = TinyBackbone()
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1])
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for tokens in (4, 2, 1, 3, 3, 0):
        backend(**buffers.step(tokens))
    return backend, buffers


def sample(name, backend, **labels):
    return prometheus_client.REGISTRY.get_sample_value(
        name, {"rank": "0", "dp_rank": "0", "role": backend.role, **labels}
    )


def _worker(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    worker = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "metrics_worker.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return worker, folder


def start_early(tmp_path_factory) -> Beside:
    """The worker process runs beside the in-process tests (conftest.py)."""
    return Beside({"worker": functools.partial(_worker, tmp_path_factory.mktemp("metrics"))})


def test_worker_metrics_reach_a_multiprocess_collector_in_another_process(started):
    from prometheus_client import CollectorRegistry, multiprocess

    worker, tmp_path = started["worker"].result()
    assert worker.returncode == 0, worker.stderr
    served = json.loads(worker.stdout.splitlines()[-1])

    # What FastDeploy's get_filtered_metrics() does in the API server.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }
    base = (("dp_rank", "3"), ("rank", "1"), ("role", "target"))

    def value(name, **extra):
        return found.get((name, tuple(sorted((*base, *extra.items())))))

    assert all(name.startswith("fd_cudagraph_") for name, _ in found)
    assert value("fd_cudagraph_captures_total") == served["captures"] == 3
    assert value("fd_cudagraph_padded_tokens_total") == served["padded_tokens"] == 3
    for size, count in served["replays"].items():
        assert value("fd_cudagraph_replays_total", size=size) == count
    # Served steps only: 3, 3, 1, 6 (eager, oversized), 0 (eager), 4, 2, 3.
    assert sum(v for (n, _), v in found.items() if n == "fd_cudagraph_replays_total") == 6
    for reason, count in served["eager_fallbacks"].items():
        assert value("fd_cudagraph_eager_fallbacks_total", reason=reason) == count
    for size, nbytes in served["graph_bytes"].items():
        assert value("fd_cudagraph_graph_memory_bytes", size=size) == nbytes
    for size, seconds in served["capture_seconds"].items():
        assert value("fd_cudagraph_capture_seconds", size=size) == pytest.approx(seconds)
    memory = served["memory"]
    assert memory["free_after_capture_bytes"] > 0
    assert (
        value("fd_cudagraph_device_free_after_capture_bytes") == memory["free_after_capture_bytes"]
    )
    assert value("fd_cudagraph_fit_gpu_memory_utilization") == memory["fit_gpu_memory_utilization"]


def test_without_a_multiprocess_dir_metrics_are_in_the_default_registry(sim, metrics_on):
    gc.collect()  # backends of earlier tests, still alive, would be published with this one
    backend, _ = served_backend()
    observability.publish_metrics(process.current())
    assert sample("fd_cudagraph_replays_total", backend, size="4") == 3  # capture step + 3, 3
    assert sample("fd_cudagraph_captures_total", backend) == 3
    assert sample("fd_cudagraph_graph_memory_bytes", backend, size="2") == 64
    observability.disable()
    assert b"fd_cudagraph_" not in prometheus_client.generate_latest()


def test_metrics_are_absent_unless_switched_on(sim):
    served_backend()
    observability.publish_metrics(process.current())
    assert not observability.enabled()
    assert b"fd_cudagraph_" not in prometheus_client.generate_latest()


def test_counters_grow_by_the_delta_and_released_graphs_drop_to_zero(sim, metrics_on):
    backend, buffers = served_backend()
    observability.publish([backend], {})
    observability.publish([backend], {})  # nothing new: nothing added
    assert sample("fd_cudagraph_replays_total", backend, size="4") == 3
    backend(**buffers.step(4))
    backend.clear_graph()
    observability.publish([backend], {})
    assert sample("fd_cudagraph_replays_total", backend, size="4") == 4
    assert sample("fd_cudagraph_graph_memory_bytes", backend, size="4") == 0
    assert sample("fd_cudagraph_eager_fallbacks_total", backend, reason="zero_tokens") == 1


def test_replay_path_writes_no_metric(sim, metrics_on):
    backend, buffers = served_backend()
    observability.publish_metrics(process.current())
    before = sample("fd_cudagraph_replays_total", backend, size="4")
    for _ in range(3):
        backend(**buffers.step(4))
    assert sample("fd_cudagraph_replays_total", backend, size="4") == before
    observability.publish_metrics(process.current())
    assert sample("fd_cudagraph_replays_total", backend, size="4") == before + 3


def test_output_failures_are_exported(sim, metrics_on, failures):
    backend, _ = served_backend()
    process.current().outputs.failed("FD_CUDAGRAPH_STATS_FILE", "/x", OSError(28, "No space left"))
    observability.publish([backend], failures)
    labels = {"rank": "0", "dp_rank": "0", "setting": "FD_CUDAGRAPH_STATS_FILE"}
    assert (
        prometheus_client.REGISTRY.get_sample_value("fd_cudagraph_output_failures_total", labels)
        == 1
    )


def test_a_failing_publish_is_logged_once_counted_and_never_raised(
    sim, metrics_on, monkeypatch, caplog, failures
):
    served_backend()

    def broken(backends, failures):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(observability, "publish", broken)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        observability.publish_metrics(process.current())
        observability.publish_metrics(process.current())
    assert failures["FD_CUDAGRAPH_METRICS"] == 2
    lines = [r.getMessage() for r in caplog.records if "FD_CUDAGRAPH_METRICS" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0]


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({}, 0.0),
        ({"FD_CUDAGRAPH_METRICS": "1"}, observability.PUBLISH_SECONDS),
        (
            {"FD_CUDAGRAPH_STATS_FILE": "observability.jsonl"},
            observability.STATS_FILE_FLUSH_SECONDS,
        ),
        (
            {"FD_CUDAGRAPH_METRICS": "1", "FD_CUDAGRAPH_STATS_FILE": "observability.jsonl"},
            observability.PUBLISH_SECONDS,
        ),
        ({"FD_CUDAGRAPH_METRICS": "1", "FD_CUDAGRAPH_STATS_INTERVAL": "30"}, 30.0),
    ],
)
def test_reporter_interval(env, interval, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert observability.reporter_interval(PluginOptions.from_env(env)) == interval


def test_metrics_alone_start_the_reporter(sim, metrics_on):
    served_backend()
    reporter = process.current().reporter
    assert reporter is not None and reporter.interval == observability.PUBLISH_SECONDS
    assert not reporter.log
