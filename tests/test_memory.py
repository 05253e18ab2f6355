"""Graph memory: pool policy, per-size accounting, release on clear, no leaks."""

from __future__ import annotations

import logging

import pytest
from conftest import HIDDEN, Buffers, TinyBackbone, make_config

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import ConfigError


def backend_for(config=None):
    model = TinyBackbone()
    config = config or make_config(8, cudagraph_capture_sizes=[4, 2, 1])
    return CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)


def capture_all(backend):
    buffers = Buffers()
    for size in backend.cudagraph_capture_sizes:
        backend(**buffers.step(size))


def output_bytes(size: int) -> int:
    return size * HIDDEN * 4  # TinyBackbone returns [size, HIDDEN] float32


@pytest.mark.parametrize(("policy", "pools"), [("instance", 2), ("graph", 6)])
def test_each_policy_hands_out_the_documented_pools(sim, monkeypatch, policy, pools):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", policy)
    target, draft = backend_for(), backend_for()
    capture_all(target)
    capture_all(draft)
    assert target.stats()["pool_policy"] == draft.stats()["pool_policy"] == policy
    assert sim.live_pools == pools  # one per backend, or one per graph


def test_the_shared_device_pool_is_refused_as_removed(monkeypatch):
    from fd_cudagraph_plugin.core.options import PluginOptions

    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "device")
    with pytest.raises(ConfigError, match=r"FD_CUDAGRAPH_POOL=device was removed .*Unset"):
        PluginOptions.from_env()


def test_unique_memory_pool_off_maps_to_private_pools_with_a_warning(sim, caplog):
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], use_unique_memory_pool=False)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend = backend_for(config)
    assert backend.stats()["pool_policy"] == "graph"
    assert any("FD_CUDAGRAPH_POOL=instance" in r.getMessage() for r in caplog.records)


def test_an_explicit_pool_option_wins_over_use_unique_memory_pool(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "instance")
    config = make_config(8, use_unique_memory_pool=False)
    assert backend_for(config).stats()["pool_policy"] == "instance"


def test_graph_memory_is_measured_per_size_and_summed(sim):
    backend = backend_for()
    capture_all(backend)
    stats = backend.stats()
    assert stats["graph_bytes"] == {4: output_bytes(4), 2: output_bytes(2), 1: output_bytes(1)}
    assert stats["graph_bytes_total"] == output_bytes(7)
    assert stats["largest_graph_bytes"] == output_bytes(4)
    assert sim.pool_bytes(None) == output_bytes(7)


def test_a_clear_of_one_backend_releases_every_backend_of_the_process(sim):
    """A clear closes every custom all-reduce IPC handle of the process, and a wake-up
    recreates the draft's inputs: the draft's graphs must go with the target's."""
    target, draft = backend_for(), backend_for()
    capture_all(target)
    capture_all(draft)
    assert sim.live_pools == 2 and sim.live_graphs == 6
    target.clear_graph()  # /v1/sleep clears the target only
    assert sim.live_pools == 0 and sim.live_graphs == 0 and sim.pool_bytes(None) == 0
    capture_all(target)
    capture_all(draft)
    assert sim.live_graphs == 6


@pytest.mark.parametrize("policy", ["instance", "graph"])
def test_repeated_clear_and_recapture_leaks_no_pool_memory(sim, monkeypatch, policy):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", policy)
    backend = backend_for()
    for _ in range(20):
        capture_all(backend)
        assert backend.stats()["graph_bytes_total"] == output_bytes(7)
        backend.clear_graph()
        assert sim.live_pools == 0 and sim.live_graphs == 0
    assert sim.captures == 60
