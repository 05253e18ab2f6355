"""Every FastDeploy execution mode, driven the way FastDeploy drives it, with real CPU Paddle.

Each mode test would fail if the mode fell back to eager silently or picked the wrong graph: the
model's rows interact, every step is compared with eager at the size of the graph that should
serve it, and the backend's own counters must say that graph served it. Static modes also check
the CUDA-graph attributes Paddle's partial programs really received.
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
    DecoratedMixing,
    MixingBackbone,
    capture_speculative,
    expected_graph_size,
    make_config,
    meta_for,
    served_by,
)
from fastdeploy.platforms import current_platform
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureIncompleteError

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


def serve(mode: str, config, model_cls=DecoratedMixing):
    model = model_cls(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    if MODES.get(mode, {}).get("full_cuda_graph") is False and hasattr(
        runner, "capture_model_prefill_and_mixed"
    ):
        from fastdeploy import _stub_version

        if _stub_version.at_least("2.5"):
            runner.capture_model_prefill_and_mixed()
    runner.capture_model()
    return model, runner, model.graph_opt_backend.cudagraph_piecewise_backend


def eager_at(model, runner, size, tokens):
    """Eager on the runner's buffer at ``size`` rows (what a graph of that size computes),
    sliced to the step's ``tokens`` as the runner slices a graph's output."""
    view = runner.share_inputs["ids"][:size]
    return model.forward(ids_remove_padding=view, forward_meta=None)[:tokens]


def step_through(backend, runner, tokens, **kwargs):
    """One runner step; its output and the graph size that served it (None: eager)."""
    before = dict(backend.stats()["replays"])
    out = runner.execute_step(tokens, **kwargs)
    after = backend.stats()["replays"]
    grown = [size for size, n in after.items() if n != before.get(size, 0)]
    assert len(grown) <= 1
    return out, grown[0] if grown else None


@pytest.mark.parametrize(
    ("fd_version", "mode"),
    [(version, mode) for mode in MODES for version in MODE_VERSIONS[mode]],
    indirect=["fd_version"],
)
def test_mode_captures_every_planned_size_and_serves_each_step_from_its_graph(
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
        with pytest.raises(CaptureIncompleteError, match=r"no graph for decode size 1\."):
            backend.check_capture_successful()  # 2.4 never captures it: served eagerly
    else:
        backend.check_capture_successful()

    static_keys = decode_sizes if mode == "static_full" else prefill_sizes
    captured = [key for state, key in partial_program_calls if state == "CAPTURE"]
    assert sorted(captured) == sorted(static_keys)  # once per size, nothing else
    if mode not in ("static_split", "static_full"):
        assert partial_program_calls == []

    partial_program_calls.clear()
    per_request = 2 if mode == "speculative" else 1
    steps = [per_request * n for n in (1, 3, 2, 4, 3)]
    served = []
    for tokens in steps:
        out, size = step_through(backend, runner, tokens)
        want = expected_graph_size(backend.settings, tokens, tokens // per_request)
        served.append(size)
        assert size == want, (tokens, size, want)
        # CPU Paddle runs a partial program's REPLAY on the step's own inputs, not on padded
        # rows: a static graph equals eager at the step's size here (the key is checked below).
        rows = tokens if mode == "static_full" else size
        assert paddle.allclose(out, eager_at(model, runner, rows, tokens)).item()
    stats = backend.stats()
    assert stats["eager_fallbacks"] == {}
    if mode == "static_full":
        assert partial_program_calls == [("REPLAY", size) for size in served]

    if mode == "static_split":
        partial_program_calls.clear()
        for tokens in (3, 16, 9):
            out = runner.execute_step(tokens, exist_prefill=True)
            assert paddle.allclose(out, eager_at(model, runner, tokens, tokens)).item()
        assert partial_program_calls == [("REPLAY", 4), ("REPLAY", 16), ("REPLAY", 16)]


@pytest.mark.parametrize("fd_version", ["2.4"], indirect=True)
@pytest.mark.parametrize("full_cuda_graph", [False, True])
def test_fastdeploy_2_4_static_modes_decode_on_paddles_graphs_as_upstream(
    fd_version, plugin_registered, partial_program_calls, full_cuda_graph
):
    """2.4's backend sends every graphed step to run_static_model, whatever full_cuda_graph
    says: Paddle-managed graphs of the SOT program, keyed by the padded token count."""
    config = make_config(4, graph_opt_level=1, full_cuda_graph=full_cuda_graph)
    model, runner, backend = serve("static_2_4", config)
    assert sorted(k for s, k in partial_program_calls if s == "CAPTURE") == [1, 2, 4]
    assert backend.stats()["graph_bytes"] == {4: 0, 2: 0, 1: 0}  # in Paddle's pools, not ours
    partial_program_calls.clear()
    for tokens in (3, 1):
        out = runner.execute_step(tokens)
        assert paddle.allclose(out, eager_at(model, runner, tokens, tokens)).item()
    assert partial_program_calls == [("REPLAY", 4), ("REPLAY", 1)]


@pytest.mark.parametrize("fd_version", ["2.4"], indirect=True)
def test_fastdeploy_2_4_only_prefill_captures_the_prefill_steps_its_runner_routes(
    fd_version, plugin_registered
):
    """2.4's GraphOptBackend ignores cudagraph_only_prefill and routes what its runner flags:
    prefill-only steps, keyed by token count, captured at each capture size (2.4's backend)."""
    config = make_config(4, cudagraph_only_prefill=True, cudagraph_capture_sizes=[8, 4, 2])
    model, runner, backend = serve("only_prefill", config)
    assert backend.captures == 3
    assert [r.size for r in backend.capture_report.records] == [8, 4, 2]
    assert {r.phase for r in backend.capture_report.records} == {"prefill"}
    backend.check_capture_successful()
    prefill_replays = backend.stats()["prefill_replays"]
    out = runner.execute_step(3, exist_prefill=True)
    assert backend.stats()["prefill_replays"] == {**prefill_replays, 4: 1}
    assert paddle.allclose(out, eager_at(model, runner, 4, 3)).item()
    out, size = step_through(backend, runner, 3)  # decode: not flagged, eager
    assert size is None


def test_speculative_key_is_running_requests_mapped_to_a_token_size(plugin_registered):
    config = make_config(4, **MODES["speculative"])
    assert config.graph_opt_config.real_bsz_to_captured_size == {1: 2, 2: 4, 3: 8, 4: 8}
    model, runner, backend = serve("speculative", config)
    out, size = step_through(backend, runner, 6)  # 3 requests x 2 tokens -> the size-8 graph
    assert size == 8
    assert paddle.allclose(out, eager_at(model, runner, 8, 6)).item()


@pytest.mark.parametrize(
    "speculative",
    [{"method": "naive"}, {"method": "mtp", "num_speculative_tokens": 1}],
    ids=["naive-empty-map", "mtp-key-missing"],
)
def test_speculative_without_a_usable_bsz_entry_falls_back_to_the_token_key(sim, speculative):
    config = make_config(4, speculative=speculative)
    model = MixingBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for size in backend.cudagraph_capture_sizes:
        step = buffers.step(size)
        step["forward_meta"].real_bsz = 99  # not in any map: the token count decides
        backend(**step)
    step = buffers.step(3)
    step["forward_meta"].real_bsz = 99
    out, size = served_by(backend, step)
    assert size == 4
    assert paddle.allclose(out, model.forward(**buffers.padded(4))).item()
    assert backend.stats()["eager_fallbacks"] == {}


def test_target_and_mtp_draft_each_have_a_working_backend(plugin_registered):
    config = make_config(4, **MODES["speculative"])
    target, target_runner, target_backend = serve("speculative", config)
    draft, draft_runner, draft_backend = serve("speculative", config)
    assert target_backend is not draft_backend
    for runner, model, backend in (
        (target_runner, target, target_backend),
        (draft_runner, draft, draft_backend),
    ):
        out, size = step_through(backend, runner, 4)
        assert size == 4 and paddle.allclose(out, eager_at(model, runner, 4, 4)).item()
    target_backend.check_capture_successful()
    draft_backend.check_capture_successful()


def test_only_prefill_mode_captures_prefill_steps_by_token_count(sim):
    config = make_config(4, cudagraph_only_prefill=True, cudagraph_capture_sizes=[8, 4, 2])
    model = MixingBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for size in (8, 4, 2):
        step = buffers.step(size)
        step["forward_meta"].exist_prefill = True
        backend(**step)
    backend.check_capture_successful()
    step = buffers.step(3, seed=2)
    step["forward_meta"].exist_prefill = True
    assert paddle.allclose(backend(**step), model.forward(**buffers.padded(4))).item()
    decode = buffers.step(4)  # must not replay a graph that holds prefill kernels
    assert backend(**decode).shape[0] == 4
    stats = backend.stats()
    assert stats["prefill_replays"] == {2: 1, 4: 2, 8: 1} and stats["replays"] == {}
    assert stats["eager_fallbacks"] == {"decode_in_prefill_only_mode": 1}


def test_capture_order_is_not_checked_on_xpu(sim):
    current_platform.device_name = "xpu"
    model = MixingBackbone()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    backend(**Buffers().step(2))
    assert backend.captures == 1


def test_static_capture_order_is_checked_per_backend(sim, partial_program_calls):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True)
    model = DecoratedMixing(fd_config=config)
    from fastdeploy.model_executor.graph_optimization.graph_optimization_backend import (
        apply_to_static_optimization,
    )
    from fastdeploy.model_executor.graph_optimization.utils import sot_warmup_guard
    from paddle.jit.dy2static.utils import Backend

    static = apply_to_static_optimization(model.forward.__func__, Backend.PHI).__get__(model)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=static)
    with pytest.raises(CaptureError, match=r"CaptureOrderError: .*expected size 8 .*got 2"):
        sot_warmup_guard(True)(lambda: backend(**Buffers().step(2)))()
    assert not any(state == "CAPTURE" for state, _ in partial_program_calls)


CYCLES = 10


def test_clear_recapture_cycles_leave_nothing_alive(plugin_registered, recording_ar):
    """Ten cycles: what one cycle leaves alive, or a bounded cache keeps, is seen after any."""
    sim = plugin_registered
    config = make_config(4)
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    graphs, outputs = [], []
    for _ in range(CYCLES):
        runner.capture_model()
        runner.execute_step(3)
        backend = model.graph_opt_backend.cudagraph_piecewise_backend
        graphs += [weakref.ref(e.graph) for e in backend.table.decode.values()]
        outputs += [weakref.ref(e.result) for e in backend.table.decode.values()]
        model.clear_graph_opt_backend(fd_config=config)  # as clear_parameters calls it
    gc.collect()
    assert sim.live_graphs == 0 and sim.live_pools == 0 and sim.pool_bytes(None) == 0
    assert sim.captures == 3 * CYCLES
    assert not [ref for ref in graphs + outputs if ref() is not None]
    assert recording_ar.events.count(("clear_ipc_handles",)) == CYCLES
    assert sim.empty_cache_calls == CYCLES
    assert recording_ar.stale_replays == 0


class FlakyBackbone(MixingBackbone):
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
    assert sim.live_graphs == 0 and not sim.capturing
    step = buffers.step(8, seed=4)
    if phase == "capture":
        with pytest.raises(CaptureError, match="can only captured one by one"):
            backend(**step)
        return
    out, size = served_by(backend, step)
    assert size == 8 and paddle.allclose(out, model.forward(**step)).item()
    assert backend.captures == 1


def test_static_capture_failure_names_the_static_mode_and_says_to_restart(
    sim, partial_program_calls
):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True, cudagraph_num_of_warmups=0)
    model = MixingBackbone()
    calls = {"n": 0}

    def runnable(**kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the probe passes; Paddle's capture then fails
            raise RuntimeError("operation not permitted when stream is capturing")
        return model.forward(**kwargs)

    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=runnable)
    with pytest.raises(CaptureError, match=r"capture failed .*static mode.*restart the worker"):
        backend(**Buffers().step(8))
    assert backend.stats()["static_full_decode"] == "static"
    with pytest.raises(CaptureIncompleteError):
        backend.check_capture_successful()


def test_static_full_mode_graphs_decode_itself_when_the_static_program_is_not_one_graph(
    sim, caplog
):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True)
    model = MixingBackbone()

    def runnable(**kwargs):
        raise RuntimeError("Model has breakgraph, please set env SOT_LOG_LEVEL=3 to check it.")

    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=runnable)
    buffers = Buffers()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        for size in backend.cudagraph_capture_sizes:
            backend(**buffers.step(size))
    assert backend.stats()["static_full_decode"] == "dynamic"
    backend.check_capture_successful()
    assert sum("static full mode" in r.getMessage() for r in caplog.records) == 1
    out, size = served_by(backend, buffers.step(3, seed=2))
    assert size == 4 and paddle.allclose(out, model.forward(**buffers.padded(4))).item()


def test_static_full_probe_raises_on_anything_but_sots_verdicts(sim):
    config = make_config(8, graph_opt_level=1, full_cuda_graph=True)
    model = MixingBackbone()

    def runnable(**kwargs):
        raise RuntimeError("CUDA error(2): out of memory")

    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=runnable)
    with pytest.raises(CaptureError, match=r"static probe failed .*out of memory.*--max-num-seqs"):
        backend(**Buffers().step(8))
    assert backend.stats()["static_full_decode"] is None and backend.captures == 0


def test_zero_token_step_runs_eagerly(sim):
    model = MixingBackbone()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    empty = paddle.zeros([0], dtype="int64")
    out = backend(ids_remove_padding=empty, forward_meta=meta_for(empty))
    assert out.shape[0] == 0
    assert backend.stats()["eager_fallbacks"] == {"zero_tokens": 1}


def test_speculative_step_with_more_tokens_than_its_running_requests_size(sim):
    config = make_config(4, **MODES["speculative"])
    model = MixingBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    step = buffers.step(3, seed=5)
    step["forward_meta"].real_bsz = 1  # predicts size 2, but 3 tokens came: pad by tokens
    out, size = served_by(backend, step)
    assert size == 4
    assert paddle.allclose(out, model.forward(**buffers.padded(4))).item()


def test_speculative_capture_needs_the_exact_size(sim):
    config = make_config(4, **MODES["speculative"])
    model = MixingBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    step = Buffers().step(3)
    step["forward_meta"].real_bsz = 2  # size 4, 3 tokens: no capture on 3 rows
    assert backend(**step).shape[0] == 3
    assert backend.captures == 0
    assert backend.stats()["eager_fallbacks"] == {"not_captured": 1}


def test_only_prefill_through_develops_graphoptbackend_captures_nothing(plugin_registered):
    config = make_config(4, cudagraph_only_prefill=True, cudagraph_capture_sizes=[8, 4, 2])
    model, runner, backend = serve("only_prefill", config)
    assert backend.captures == 0
    assert backend.expected() == []
    backend.check_capture_successful()  # nothing this routing can capture is missing
    out = runner.execute_step(3, exist_prefill=True)
    assert paddle.allclose(out, eager_at(model, runner, 3, 3)).item()
