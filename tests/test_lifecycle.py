"""Graphs stay valid through sleep, wake-up and weight updates, as FastDeploy drives them.

FastDeploy's ``sleep("weight")`` (and 2.4/2.5's ``clear_parameters``) clears only the target's
backend, its clear closes every custom all-reduce IPC handle of the process and rewinds the
registration slots, and ``wakeup`` (2.5+) builds the MTP draft's input tensors anew before
``capture_model()``. Draft graphs that survived would replay old addresses and stale slots; the
stand-in's custom all-reduce turns such replays into NaN and counts them (``stale_replays``).
"""

from __future__ import annotations

import paddle
import pytest
from conftest import DecoratedDraft, DecoratedMixing, make_config
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

MTP = {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1}


def build(draft_graphs: bool = True):
    config = make_config(
        4, speculative=MTP, draft_model_use_cudagraph=draft_graphs, dynamic_load_weight=True
    )
    target, draft = DecoratedMixing(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    runner.update_share_input_block_num(num_gpu_blocks=4)  # GpuWorker.initialize_cache
    runner.capture_model()
    return runner, target, draft


def backend_of(model):
    return model.graph_opt_backend.cudagraph_piecewise_backend


def serve_and_check(runner, target, draft, recording_ar) -> None:
    """Serve steps; the target's output must equal eager at its graph's size, each draft substep
    eager on the inputs it was given, and no replay may use a stale all-reduce registration."""
    draft_backend = backend_of(draft)
    for tokens, size in ((4, 4), (2, 2), (6, 8)):  # requests x (k + 1), and the graph it pads to
        draft_replays = sum(draft_backend.stats()["replays"].values())
        out = runner.execute_step(tokens)
        view = runner.share_inputs["ids"][:size]
        eager = target.forward(ids_remove_padding=view, forward_meta=None)[:tokens]
        assert paddle.allclose(out, eager).item(), f"target, {tokens} tokens"
        for step in runner.proposer.steps:
            assert step["step_use_cudagraph"]
            expected = draft.forward(
                ids_remove_padding=step["ids"],
                previous_hidden_states=step["previous_hidden_states"],
                forward_meta=None,
            )
            assert paddle.allclose(step["output"], expected).item(), f"draft, {tokens} tokens"
        assert sum(draft_backend.stats()["replays"].values()) == draft_replays + 1
    assert recording_ar.stale_replays == 0 and recording_ar.garbage == 0


@pytest.mark.parametrize("fd_version", ["2.5", "2.6", "develop"], indirect=True)
def test_after_sleep_and_wakeup_target_and_draft_replays_equal_eager_on_the_new_inputs(
    fd_version, plugin_registered, recording_ar
):
    runner, target, draft = build()
    serve_and_check(runner, target, draft, recording_ar)
    old_ids = runner.proposer.model_inputs["ids"]
    runner.sleep("weight")  # clears the target's graphs only, as FastDeploy does
    runner.wakeup("weight")  # new draft input tensors, then capture_model()
    assert runner.proposer.model_inputs["ids"] is not old_ids
    assert backend_of(draft).capture_report.graphs == 3 + 3  # both recaptured in one session
    serve_and_check(runner, target, draft, recording_ar)


@pytest.mark.parametrize("fd_version", ["2.4", "2.5", "2.6", "develop"], indirect=True)
def test_a_weight_update_recaptures_every_graph_that_held_the_old_registrations(
    fd_version, plugin_registered, recording_ar
):
    runner, target, draft = build()
    serve_and_check(runner, target, draft, recording_ar)
    runner.clear_parameters()  # 2.4 and 2.5 clear the target only
    runner.update_parameters()
    serve_and_check(runner, target, draft, recording_ar)
    assert recording_ar.events.count(("clear_ipc_handles",)) >= 1
