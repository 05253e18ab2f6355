"""Recapture without redundant warm-ups: a size captured before in the process gets the one eager
run its capture reads host state from; a new size gets FastDeploy's full count; every
tensor-parallel rank runs the same warm-ups (docs/design.md, "Warm-ups")."""

from __future__ import annotations

import pytest
from conftest import (
    Buffers,
    DecoratedDraft,
    DecoratedMixing,
    PeerLink,
    TinyBackbone,
    make_config,
)
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.session import CaptureSession

MTP = {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1}


def warmups_by_size(backend) -> dict[int, int]:
    return {r.size: r.warmups for r in backend.capture_report.records if r.role == backend.role}


def backend_of(model):
    return model.graph_opt_backend.cudagraph_piecewise_backend


def test_the_first_capture_of_a_process_runs_fastdeploys_warmups_in_full(plugin_registered):
    config = make_config(4, cudagraph_num_of_warmups=2)
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    assert warmups_by_size(backend_of(model)) == {4: 2, 2: 2, 1: 2}
    assert "6 warm-ups" not in backend_of(model).capture_report.summary()
    assert "2 warm-ups each" in backend_of(model).capture_report.summary()


@pytest.mark.parametrize("event", ["weight update", "sleep and wake-up"])
def test_a_recapture_warms_each_size_once_and_says_why(fd_version, plugin_registered, event):
    if event == "sleep and wake-up" and fd_version in ("2.4",):
        pytest.skip("2.4 has no sleep and wake-up")
    config = make_config(
        4, speculative=MTP, draft_model_use_cudagraph=True, dynamic_load_weight=True
    )
    target, draft = DecoratedMixing(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    runner.update_share_input_block_num(num_gpu_blocks=4)  # GpuWorker.initialize_cache
    runner.capture_model()
    if event == "weight update":
        runner.clear_parameters()
        runner.update_parameters()
    else:
        runner.sleep("weight")
        runner.wakeup("weight")
    for backend in (backend_of(target), backend_of(draft)):
        assert set(warmups_by_size(backend).values()) == {1}, backend.role
    summary = backend_of(target).capture_report.summary()
    graphs = backend_of(target).capture_report.graphs
    assert f"{graphs} warm-ups: 1 each for all {graphs} graphs, their sizes warmed earlier" in (
        summary
    )


def test_a_warm_up_really_runs_before_each_recapture_on_the_same_inputs(sim):
    """The one kept warm-up is an eager run of the capture's own inputs (the host state the
    capture reads is what it leaves); a recapture without it would read the last step's."""
    model = TinyBackbone()
    config = make_config(4, cudagraph_capture_sizes=[4, 2, 1], cudagraph_num_of_warmups=2)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    calls = []
    original = model.forward

    def forward(**kwargs):
        if sim.capturing:
            calls.append(("capture", kwargs["ids_remove_padding"].shape[0]))
        else:
            calls.append(("eager", kwargs["ids_remove_padding"].shape[0]))
        return original(**kwargs)

    backend.dy_runnable = forward
    for session_number in range(2):
        calls.clear()
        with CaptureSession("decode"):
            for size in (4, 2, 1):
                backend(**buffers.step(size))
        expected_warmups = 2 if session_number == 0 else 1
        for size in (4, 2, 1):
            index = calls.index(("capture", size))
            before = calls[index - expected_warmups : index]
            assert before == [("eager", size)] * expected_warmups, calls
        backend.clear_graph()


def test_ranks_whose_histories_differ_all_warm_in_full(sim):
    """A rank that has not warmed a size makes every rank warm it: warm-ups run collectives."""
    model = TinyBackbone()
    config = make_config(4, cudagraph_capture_sizes=[4, 2, 1], cudagraph_num_of_warmups=2)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with CaptureSession("decode"):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    backend.clear_graph()

    def fresh_peer(rank, label, status):
        if label != "plan":
            return status
        payload = status["payload"]
        return {
            **status,
            "payload": {**payload, "unwarmed": [{"decode": [4, 2, 1], "prefill": []}]},
        }

    with CaptureSession("decode", link=PeerLink(peer=fresh_peer)) as session:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    assert [r.warmups for r in session.report.records] == [2, 2, 2]


def test_configured_zero_warmups_stay_zero_on_a_recapture(sim):
    model = TinyBackbone()
    config = make_config(4, cudagraph_capture_sizes=[4, 2], cudagraph_num_of_warmups=0)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for _ in range(2):
        with CaptureSession("decode") as session:
            for size in (4, 2):
                backend(**buffers.step(size))
        backend.clear_graph()
    assert [r.warmups for r in session.report.records] == [0, 0]
