"""Every FastDeploy execution mode, driven the way FastDeploy drives it, with real CPU Paddle.

Each mode test would fail if the mode fell back to eager silently: it checks the number of
captures, that serving replays graphs, and (static modes) the CUDA-graph attributes Paddle's
partial programs really received.
"""

from __future__ import annotations

import gc
import logging
import weakref

import paddle
import pytest
from conftest import (
    MODE_VERSIONS,
    Buffers,
    DecoratedBackbone,
    TinyBackbone,
    capture_speculative,
    make_config,
    meta_for,
)
from fastdeploy.platforms import current_platform
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureIncompleteError, CaptureOrderError

MODES = {
    "dynamic": {},
    "static_split": {
        "graph_opt_level": 1,
        "full_cuda_graph": False,
        "max_capture_shape_prefill": 16,
    },
    "static_full": {"graph_opt_level": 1, "full_cuda_graph": True},
    "speculative": {"speculative": {"method": "mtp", "num_speculative_tokens": 1}},
}


def serve(mode: str, config):
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    if MODES[mode].get("full_cuda_graph") is False:
        runner.capture_model_prefill_and_mixed()
    runner.capture_model()
    return model, runner, model.graph_opt_backend.cudagraph_piecewise_backend


def eager_output(model, runner, tokens):
    view = runner.share_inputs["ids"][:tokens]
    return model.forward(ids_remove_padding=view, forward_meta=None)


@pytest.mark.parametrize(
    ("fd_version", "mode"),
    [(version, mode) for mode in MODES for version in MODE_VERSIONS[mode]],
    indirect=["fd_version"],
)
def test_mode_captures_every_planned_size_and_serves_from_graphs(
    fd_version, mode, plugin_registered, partial_program_calls
):
    config = make_config(4, **MODES[mode])
    decode_sizes = config.graph_opt_config.cudagraph_capture_sizes
    if fd_version == "2.4" and mode == "speculative":
        decode_sizes = [s for s in decode_sizes if s != 1]  # 2.4's MTP loop skips size 1
    model, runner, backend = serve(mode, config)
    assert isinstance(backend, CudaGraphBackend)
    prefill_sizes = []
    if mode == "static_split":  # FastDeploy derives the list: [16, 16, 8, 4, 2, 1] here
        prefill_sizes = sorted(set(config.graph_opt_config.cudagraph_capture_sizes_prefill))
    assert backend.captures == len(decode_sizes) + len(prefill_sizes)
    if len(decode_sizes) < len(config.graph_opt_config.cudagraph_capture_sizes):
        with pytest.raises(CaptureIncompleteError, match=r"no graph for decode 1\."):
            backend.check_capture_successful()  # 2.4 never captures it: served eagerly
    else:
        backend.check_capture_successful()

    static_keys = decode_sizes if mode == "static_full" else prefill_sizes
    captured = [key for state, key in partial_program_calls if state == "CAPTURE"]
    assert sorted(captured) == sorted(static_keys)  # once per size, nothing else
    if mode not in ("static_split", "static_full"):
        assert partial_program_calls == []

    replays_before = sum(backend.stats()["replays"].values())
    partial_program_calls.clear()
    per_request = 2 if mode == "speculative" else 1
    steps = [per_request * n for n in (1, 3, 2, 4, 3)]
    for tokens in steps:
        out = runner.execute_step(tokens)
        assert paddle.allclose(out, eager_output(model, runner, tokens)).item()
    stats = backend.stats()
    assert sum(stats["replays"].values()) - replays_before == len(steps)
    assert stats["eager_fallbacks"] == {}
    if mode == "static_full":
        table = backend.settings.decode_table
        assert partial_program_calls == [("REPLAY", table[n]) for n in steps]

    if mode == "static_split":
        partial_program_calls.clear()
        for tokens in (3, 16, 9):
            out = runner.execute_step(tokens, exist_prefill=True)
            assert paddle.allclose(out, eager_output(model, runner, tokens)).item()
        assert partial_program_calls == [("REPLAY", 4), ("REPLAY", 16), ("REPLAY", 16)]


def test_speculative_key_is_running_requests_mapped_to_a_token_size(plugin_registered):
    config = make_config(4, **MODES["speculative"])
    assert config.graph_opt_config.real_bsz_to_captured_size == {1: 2, 2: 4, 3: 8, 4: 8}
    _, runner, backend = serve("speculative", config)
    before = backend.stats()["replays"]
    runner.execute_step(6)  # 3 requests x 2 tokens -> the size-8 graph
    after = backend.stats()["replays"]
    assert {size: after[size] - before.get(size, 0) for size in after} == {8: 1, 4: 0, 2: 0}


@pytest.mark.parametrize(
    "speculative",
    [{"method": "naive"}, {"method": "mtp", "num_speculative_tokens": 1}],
    ids=["naive-empty-map", "mtp-key-missing"],
)
def test_speculative_without_a_usable_bsz_entry_falls_back_to_the_token_key(sim, speculative):
    config = make_config(4, speculative=speculative)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for size in backend.cudagraph_capture_sizes:
        step = buffers.step(size)
        step["forward_meta"].real_bsz = 99  # not in any map: the token count decides
        backend(**step)
    step = buffers.step(3)
    step["forward_meta"].real_bsz = 99
    out = backend(**step)
    assert out.shape[0] == backend.settings.decode_table[3]
    assert backend.stats()["eager_fallbacks"] == {}


def test_target_and_mtp_draft_each_have_a_working_backend(plugin_registered):
    config = make_config(4, **MODES["speculative"])
    target, target_runner, target_backend = serve("speculative", config)
    draft, draft_runner, draft_backend = serve("speculative", config)
    assert target_backend is not draft_backend
    for runner, model in ((target_runner, target), (draft_runner, draft)):
        out = runner.execute_step(4)
        assert paddle.allclose(out, eager_output(model, runner, 4)).item()
    target_backend.check_capture_successful()
    draft_backend.check_capture_successful()


def test_only_prefill_mode_captures_prefill_steps_by_token_count(sim):
    config = make_config(4, cudagraph_only_prefill=True, cudagraph_capture_sizes=[8, 4, 2])
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for size in (8, 4, 2):
        step = buffers.step(size)
        step["forward_meta"].exist_prefill = True
        backend(**step)
    backend.check_capture_successful()
    step = buffers.step(3, seed=2)
    step["forward_meta"].exist_prefill = True
    assert paddle.allclose(backend(**step)[:3], model.forward(**step)).item()
    decode = buffers.step(4)  # must not replay a graph that holds prefill kernels
    assert backend(**decode).shape[0] == 4
    stats = backend.stats()
    assert stats["replays"] == {2: 1, 4: 2, 8: 1}
    assert stats["eager_fallbacks"] == {"decode_in_prefill_only_mode": 1}


def test_capture_order_is_not_checked_on_xpu(sim):
    current_platform.device_name = "xpu"
    model = TinyBackbone()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    backend(**Buffers().step(2))
    assert backend.captures == 1


def test_static_capture_order_is_checked_per_backend(sim, partial_program_calls):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True)
    model = DecoratedBackbone(fd_config=config)
    from fastdeploy.model_executor.graph_optimization.graph_optimization_backend import (
        apply_to_static_optimization,
    )
    from paddle.jit.dy2static.utils import Backend

    static = apply_to_static_optimization(model.forward.__func__, Backend.PHI).__get__(model)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=static)
    with pytest.raises(CaptureOrderError, match=r"expected size 8 .*got 2"):
        backend(**Buffers().step(2))
    assert not any(state == "CAPTURE" for state, _ in partial_program_calls)


def test_hundred_clear_recapture_cycles_leave_nothing_alive(plugin_registered, recording_ar):
    sim = plugin_registered
    config = make_config(4)
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    graphs, outputs = [], []
    for _ in range(100):
        runner.capture_model()
        runner.execute_step(3)
        backend = model.graph_opt_backend.cudagraph_piecewise_backend
        graphs += [weakref.ref(e.graph) for e in backend.decode_entries.values()]
        outputs += [weakref.ref(e.result) for e in backend.decode_entries.values()]
        runner.clear_graph_opt_backend()
    gc.collect()
    assert sim.live_graphs == 0 and sim.pool_bytes(backend.pool) == 0
    assert sim.captures == 300
    assert not [ref for ref in graphs + outputs if ref() is not None]
    assert recording_ar.events.count(("clear_ipc_handles",)) == 100
    assert sim.empty_cache_calls == 100


class FlakyBackbone(TinyBackbone):
    """Raises on chosen call numbers, as an op that cannot be captured or an OOM would."""

    def __init__(self, fail_on: set[int]) -> None:
        super().__init__()
        self.fail_on = fail_on

    def forward(self, ids_remove_padding, forward_meta):
        if self.calls + 1 in self.fail_on:
            self.calls += 1
            raise RuntimeError("CUDA error: out of memory")
        return super().forward(ids_remove_padding, forward_meta)


@pytest.mark.parametrize(("phase", "call"), [("warm-up", 2), ("capture", 3)])
def test_failure_in_warmup_or_capture_is_reported_and_only_a_warmup_can_be_retried(
    sim, phase, call
):
    model = FlakyBackbone(fail_on={call})
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    buffers = Buffers()
    with pytest.raises(CaptureError) as raised:
        backend(**buffers.step(8))
    message = str(raised.value)
    assert f"{phase} failed for decode size 8" in message and "dynamic mode" in message
    assert "--max-num-seqs" in message and "cudagraph_capture_sizes" in message
    assert ("restart the worker" in message) == (phase == "capture")
    assert backend.decode_entries[8].graph is None and sim.live_graphs == 0
    assert not sim.capturing
    step = buffers.step(8, seed=4)
    if phase == "capture":
        with pytest.raises(CaptureError, match="can only captured one by one"):
            backend(**step)
        return
    assert paddle.allclose(backend(**step), model.forward(**step)).item()
    assert backend.captures == 1


def test_static_capture_failure_names_the_static_mode_and_says_to_restart(
    sim, partial_program_calls
):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True, cudagraph_num_of_warmups=0)
    model = TinyBackbone()
    calls = {"n": 0}

    def runnable(**kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the probe and warm-up pass; Paddle's capture then fails
            raise RuntimeError("operation not permitted when stream is capturing")
        return model.forward(**kwargs)

    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=runnable)
    with pytest.raises(CaptureError, match=r"capture failed .*static mode.*restart the worker"):
        backend(**Buffers().step(8))
    assert not backend.decode_entries[8].captured
    assert backend.stats()["static_full_decode"] == "static"


def test_static_full_mode_graphs_decode_itself_when_the_static_program_fails(sim, caplog):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True)
    model = TinyBackbone()

    def runnable(**kwargs):
        raise RuntimeError("Model has breakgraph, please set env SOT_LOG_LEVEL=3 to check it.")

    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=runnable)
    buffers = Buffers()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        for size in backend.cudagraph_capture_sizes:
            backend(**buffers.step(size))
    assert backend.stats()["static_full_decode"] == "dynamic"
    assert all(entry.graph is not None for entry in backend.decode_entries.values())
    assert sum("static full mode" in r.getMessage() for r in caplog.records) == 1
    step = buffers.step(3, seed=2)
    assert paddle.allclose(backend(**step)[:3], model.forward(**step)).item()


def test_zero_token_step_runs_eagerly(sim):
    model = TinyBackbone()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    empty = paddle.zeros([0], dtype="int64")
    out = backend(ids_remove_padding=empty, forward_meta=meta_for(empty))
    assert out.shape[0] == 0
    assert backend.stats()["eager_fallbacks"] == {"zero_tokens": 1}


def test_speculative_step_with_more_tokens_than_its_running_requests_size(sim):
    config = make_config(4, **MODES["speculative"])
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    step = buffers.step(3, seed=5)
    step["forward_meta"].real_bsz = 1  # predicts size 2, but 3 tokens came: pad by tokens
    out = backend(**step)
    assert out.shape[0] == 4
    assert paddle.allclose(out[:3], model.forward(**step)).item()


def test_speculative_capture_needs_the_exact_size(sim):
    config = make_config(4, **MODES["speculative"])
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    step = Buffers().step(3)
    step["forward_meta"].real_bsz = 2  # size 4, 3 tokens: no capture on 3 rows
    assert backend(**step).shape[0] == 3
    assert backend.decode_entries[4].graph is None
    assert backend.stats()["eager_fallbacks"] == {"not_captured": 1}


def test_only_prefill_through_develops_graphoptbackend_captures_nothing(plugin_registered):
    config = make_config(4, cudagraph_only_prefill=True, cudagraph_capture_sizes=[8, 4, 2])
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert backend.captures == 0
    assert backend.expected_entries() == []
    backend.check_capture_successful()  # nothing this routing can capture is missing
    out = runner.execute_step(3, exist_prefill=True)
    view = runner.share_inputs["ids"][:3]
    assert paddle.allclose(out, model.forward(ids_remove_padding=view, forward_meta=None)).item()
