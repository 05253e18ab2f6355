"""The MTP draft model driven by the stand-in's ``MTPProposer``, as FastDeploy drives it: dummy
runs with ``real_bsz=0``, substep 0 with bsz*(k+1) tokens, later substeps eager at capture but
graph-routed while serving, ``seq_lens_this_time`` swapped for the full buffer."""

from __future__ import annotations

import paddle
import pytest
from conftest import DecoratedBackbone, DecoratedDraft, make_config
from fastdeploy import _stub_version
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

MTP = {"method": "mtp", "num_speculative_tokens": 2, "num_model_steps": 2}  # k + 1 = 3


def serve_with_draft(**graph):
    config = make_config(4, speculative=MTP, **graph)
    target, draft = DecoratedBackbone(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    runner.capture_model()
    return runner, draft


def assert_draft_matches_eager(runner, draft):
    for step in runner.proposer.steps:
        eager = draft.forward(
            ids_remove_padding=step["ids"],
            previous_hidden_states=step["previous_hidden_states"],
            forward_meta=None,
        )
        assert paddle.allclose(step["output"], eager).item()


@pytest.mark.parametrize("fd_version", ["2.6", "develop"], indirect=True)
def test_the_draft_is_graphed_by_default_exactly_where_its_release_defaults_it(
    fd_version, plugin_registered
):
    runner, draft = serve_with_draft()  # draft_model_use_cudagraph left to the release
    backend = draft.graph_opt_backend.cudagraph_piecewise_backend
    graphed = fd_version == "develop"
    assert (backend is not None and backend.captures > 0) is graphed
    runner.execute_step(6)
    assert_draft_matches_eager(runner, draft)


def test_draft_captures_substep_zero_and_serves_every_substep_from_graphs(plugin_registered):
    runner, draft = serve_with_draft(draft_model_use_cudagraph=True)
    backend = draft.graph_opt_backend.cudagraph_piecewise_backend
    assert backend.captures == len(backend.cudagraph_capture_sizes)  # substep 0 sizes only
    before = sum(backend.stats()["replays"].values())
    for tokens in (3, 9, 6, 12):  # requests x (k + 1)
        runner.execute_step(tokens)
        steps = runner.proposer.steps
        assert [s["step_use_cudagraph"] for s in steps] == [True, True]
        assert [s["tokens"] for s in steps] == [tokens, tokens // 3]
        assert_draft_matches_eager(runner, draft)
    assert sum(backend.stats()["replays"].values()) - before == 8
    assert backend.stats()["eager_fallbacks"] == {}


def test_draft_without_its_flag_runs_eagerly(plugin_registered):
    runner, draft = serve_with_draft(draft_model_use_cudagraph=False)
    assert draft.graph_opt_backend.cudagraph_piecewise_backend is None or (
        draft.graph_opt_backend.cudagraph_piecewise_backend.captures == 0
    )
    runner.execute_step(6)
    assert [s["step_use_cudagraph"] for s in runner.proposer.steps] == [False, False]
    assert_draft_matches_eager(runner, draft)


def test_zero_token_speculative_step_with_no_running_request_runs_eagerly(plugin_registered):
    _stub_version.use("develop")
    runner, _ = serve_with_draft(draft_model_use_cudagraph=True)
    backend = runner.model.graph_opt_backend.cudagraph_piecewise_backend
    empty = runner.share_inputs["ids"][:0]
    from fastdeploy.model_executor import forward_meta

    meta = forward_meta.ForwardMeta(
        ids_remove_padding=empty,
        step_use_cudagraph=True,
        seq_lens_this_time=paddle.zeros([4], dtype="int32"),
    )
    meta.real_bsz = 0
    out = backend(ids_remove_padding=empty, forward_meta=meta)
    assert out.shape[0] == 0
    assert backend.stats()["eager_fallbacks"] == {"zero_tokens": 1}
