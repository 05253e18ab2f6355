"""The custom all-reduce as FastDeploy has it: garbage inside the capture context unless a stream
capture runs, and a TP collective at every registration. Nothing but the capture may run inside,
a capture session registers every graph's buffers once, and no graph replays before."""

from __future__ import annotations

import paddle
import pytest
from conftest import DecoratedBackbone, make_config
from fastdeploy.distributed import communication
from fastdeploy.worker.gpu_model_runner import GPUModelRunner


def test_stand_in_reduce_is_garbage_in_the_context_outside_a_stream_capture(sim, recording_ar):
    x = paddle.ones([4, 2])
    assert paddle.equal_all(communication.tensor_model_parallel_all_reduce(x), x).item()
    with pytest.raises(ValueError), recording_ar.capture():
        assert paddle.isnan(communication.tensor_model_parallel_all_reduce(x)).all().item()
        raise ValueError("the capture failed")
    # Registration ran in `finally`: one all_gather_object over the TP group.
    assert recording_ar.collectives == 1
    assert ("all_gather_object", "tp-group") in recording_ar.events
    assert recording_ar.garbage == 1


@pytest.mark.parametrize("mode", ["dynamic", "speculative"])
def test_no_step_runs_inside_the_allreduce_context_outside_the_capture(
    plugin_registered, recording_ar, mode
):
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mode == "speculative" else None
    config = make_config(4, speculative=spec)
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert recording_ar.garbage == 0  # no warm-up or eager step inside the context
    assert backend.captures == 3 and recording_ar.collectives == 1  # one for the session
    per_request = 2 if mode == "speculative" else 1
    for tokens in (1, 3, 4, 2):
        out = runner.execute_step(per_request * tokens)
        assert not paddle.isnan(out).any().item()


@pytest.mark.parametrize("mode", ["dynamic", "speculative"])
def test_no_graph_replays_before_the_sessions_one_registration(
    plugin_registered, recording_ar, mode
):
    """FastDeploy's MTP capture loop runs (k + 1) * 2 decode steps per size, so a graph would
    replay inside the session, before the registration at its end: its all-reduces would read
    peer buffers not registered yet (NaN here, garbage or a fault on a GPU)."""
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mode == "speculative" else None
    config = make_config(4, speculative=spec)
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    outputs = []
    run = runner._run

    def recording_run(*args, **kwargs):
        out = run(*args, **kwargs)
        outputs.append(out)
        return out

    runner._run = recording_run
    runner.capture_model()
    assert recording_ar.stale_replays == 0
    assert outputs and not any(paddle.isnan(out).any().item() for out in outputs)
    assert recording_ar.events[-2:] == [
        ("register_graph_buffers",),
        ("all_gather_object", "tp-group"),
    ]
