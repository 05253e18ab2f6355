"""Graph memory: pool policy, per-size accounting, shared-pool release order, no leaks."""

from __future__ import annotations

import logging

import pytest
from conftest import HIDDEN, Buffers, TinyBackbone, make_config

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.memory import pools_for


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


@pytest.mark.parametrize("policy", ["device", "instance", "graph"])
def test_each_policy_hands_out_the_documented_pools(sim, monkeypatch, policy):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", policy)
    target, draft = backend_for(), backend_for()
    capture_all(target)
    capture_all(draft)
    assert target.pool_policy == draft.pool_policy == policy
    if policy == "device":
        assert target.pool is draft.pool is not None and sim.live_pools == 1
    elif policy == "instance":
        assert target.pool is not draft.pool and sim.live_pools == 2
    else:
        assert target.pool is None and draft.pool is None and sim.live_pools == 6  # one per graph


def test_unique_memory_pool_off_maps_to_private_pools_with_a_warning(sim, caplog):
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], use_unique_memory_pool=False)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend = backend_for(config)
    assert backend.pool_policy == "graph"
    assert any("892 MiB" in r.getMessage() for r in caplog.records)


def test_an_explicit_pool_option_wins_over_use_unique_memory_pool(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "device")
    config = make_config(8, use_unique_memory_pool=False)
    assert backend_for(config).pool_policy == "device"


def test_graph_memory_is_measured_per_size_and_summed(sim):
    backend = backend_for()
    capture_all(backend)
    stats = backend.stats()
    assert stats["graph_bytes"] == {4: output_bytes(4), 2: output_bytes(2), 1: output_bytes(1)}
    assert stats["graph_bytes_total"] == output_bytes(7)
    assert stats["largest_graph_bytes"] == output_bytes(4)
    assert sim.pool_bytes(backend.pool) == output_bytes(7)


def test_two_backends_hold_different_pools_by_default(sim):
    target, draft = backend_for(), backend_for()
    capture_all(target)
    capture_all(draft)
    assert target.pool_policy == draft.pool_policy == "instance"
    assert target.pool is not None and draft.pool is not None and target.pool is not draft.pool
    target.clear_graph()  # /v1/sleep clears the target only: its pool goes all the same
    assert sim.live_pools == 1 and sim.pool_bytes(draft.pool) == output_bytes(7)


def test_a_shared_pool_is_refused_with_a_draft_model(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "device")
    config = make_config(8, speculative={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(
        ConfigError, match=r"FD_CUDAGRAPH_POOL=device cannot be used with speculative method 'mtp'"
    ):
        backend_for(config)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_shared_pool_is_allowed_without_a_draft_model(sim, monkeypatch, method):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "device")
    config = make_config(8, speculative={"method": method, "num_speculative_tokens": 1})
    assert backend_for(config).pool_policy == "device"


def test_shared_pool_goes_only_when_its_last_user_clears(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", "device")
    target, draft = backend_for(), backend_for()
    capture_all(target)
    capture_all(draft)
    pool = target.pool
    assert pools_for(sim).device_users == {id(target), id(draft)}
    draft.clear_graph()
    assert sim.live_pools == 1 and sim.pool_bytes(pool) == output_bytes(7)  # target's graphs
    assert target(**Buffers().step(3)) is target.decode_entries[4].result
    target.clear_graph()
    assert sim.live_pools == 0 and sim.live_graphs == 0


@pytest.mark.parametrize("policy", ["device", "instance", "graph"])
def test_repeated_clear_and_recapture_leaks_no_pool_memory(sim, monkeypatch, policy):
    monkeypatch.setenv("FD_CUDAGRAPH_POOL", policy)
    backend = backend_for()
    for _ in range(20):
        capture_all(backend)
        assert backend.stats()["graph_bytes_total"] == output_bytes(7)
        backend.clear_graph()
        assert sim.live_pools == 0 and sim.live_graphs == 0
    assert sim.captures == 60
