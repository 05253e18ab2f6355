"""Capture sessions around FastDeploy's capture loops: report, GC, plan check, counting."""

from __future__ import annotations

import gc
import json
import logging
import re

import paddle
import pytest
from conftest import Buffers, DecoratedBackbone, MixingBackbone, PeerLink, make_config, served_by
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin.core import process
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, RankMismatchError
from fd_cudagraph_plugin.core.session import CaptureSession


def runner_for(config, model_cls=DecoratedBackbone):
    model = model_cls(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()  # builds the backend, which installs the session hooks
    return model, runner


def build(config):
    model = MixingBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    return backend, model


def test_capture_model_runs_in_a_session_with_one_summary_line(plugin_registered, caplog):
    config = make_config(4)
    model, runner = runner_for(config)
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    report = backend.capture_report
    assert report is not None and report.phase == "decode"
    assert [r.size for r in report.records] == [4, 2, 1]
    assert report.graph_bytes == sum(r.graph_bytes for r in report.records) > 0
    assert all(r.seconds > 0 and r.warmups == 2 for r in report.records)
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("captured")]
    assert len(summaries) == 1
    assert re.fullmatch(
        r"captured 3 graphs \(sizes 1\.\.4\) in (\d+ ms|\d+\.\d s), graph memory 224 B "
        r"\(largest graph 128 B\), 2 warm-ups each; 16\.0 GiB of 16\.0 GiB of the simulated device "
        r"free after capture; gpu_memory_utilization up to 0\.9999 would fit \(now 0\.9, keeping "
        r"819\.2 MiB free\)",
        summaries[0],
    )
    assert process.current().session is None and process.current().sessions_ended == 1


def test_capture_time_steps_are_not_counted_as_served_traffic(plugin_registered):
    model, runner = runner_for(make_config(4))
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    stats = backend.stats()
    assert stats["replays"] == {} and stats["eager_fallbacks"] == {}
    assert backend.observed_keys() == {}
    assert sum(stats["capture_time"]["replays"].values()) == 3  # each capture's own run
    for tokens in (3, 4, 1):
        runner.execute_step(tokens)
    stats = backend.stats()
    assert stats["replays"] == {1: 1, 4: 2} and backend.observed_keys() == {1: 1, 3: 1, 4: 1}
    assert sum(stats["capture_time"]["replays"].values()) == 3


def test_static_split_prefill_loop_gets_its_own_session(plugin_registered):
    config = make_config(4, graph_opt_level=1, full_cuda_graph=False, max_capture_shape_prefill=8)
    model, runner = runner_for(config)
    runner.capture_model_prefill_and_mixed()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert backend.capture_report.phase == "prefill"
    assert {r.phase for r in backend.capture_report.records} == {"prefill"}
    runner.capture_model()
    assert backend.capture_report.phase == "decode"


def test_gc_is_held_off_during_the_session_and_restored_after_an_error(plugin_registered):
    config = make_config(4)
    seen = []

    class Recording(DecoratedBackbone):
        def forward(self, ids_remove_padding, forward_meta):
            seen.append(gc.isenabled())
            if ids_remove_padding.shape[0] == 2 and process.current().session is not None:
                raise RuntimeError("CUDA error: out of memory")
            return super().forward(ids_remove_padding, forward_meta)

    _, runner = runner_for(config, Recording)
    seen.clear()
    with pytest.raises(CaptureError, match=r"warm-up failed for decode size 2 .*out of memory"):
        runner.capture_model()
    assert seen and not any(seen)  # no automatic collection during the session
    assert gc.isenabled()
    assert process.current().session is None


def test_plan_check_diff_names_the_key_and_both_values(sim):
    build(make_config(8))

    def peer(rank, label, status):
        if label == "plan":
            payload = status["payload"]
            plan = {**payload["plan"], "self_check": "warn"}
            return {**status, "payload": {**payload, "plan": plan}}
        return status

    expected = r"\. rank 1: self_check: rank 0 'off' vs rank 1 'warn'\. Start"
    with (
        pytest.raises(RankMismatchError, match=expected),
        CaptureSession("decode", link=PeerLink(peer=peer)),
    ):
        pass
    assert process.current().session is None and gc.isenabled()


def test_a_size_first_seen_after_the_sessions_runs_eagerly_and_warns_once(sim, caplog):
    backend, model = build(make_config(8, cudagraph_capture_sizes=[4, 2, 1]))
    buffers = Buffers()
    with CaptureSession("decode"):
        for size in (4, 2):
            backend(**buffers.step(size))
    step = buffers.step(1, seed=3)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        out, served = served_by(backend, step)
        backend(**step)
    assert served is None
    assert paddle.allclose(out, model.forward(**step)).item()
    assert backend.stats()["eager_fallbacks"] == {"late_capture": 2}
    assert sum("late capture" in r.getMessage() for r in caplog.records) == 1


def test_custom_allreduce_registers_once_after_every_graph_of_the_session(
    plugin_registered, recording_ar
):
    config = make_config(4)
    model, runner = runner_for(config)
    recording_ar.events.clear()
    runner.capture_model()
    assert recording_ar.events == [("start_capture",)] * 3 + [
        ("register_graph_buffers",),
        ("all_gather_object", "tp-group"),
    ]
    assert recording_ar.garbage == 0
    out = runner.execute_step(3)
    view = runner.share_inputs["ids"][:3]
    assert paddle.allclose(out, model.forward(ids_remove_padding=view, forward_meta=None)).item()
    assert recording_ar.stale_replays == 0


def test_a_failed_registration_discards_the_sessions_graphs_and_the_next_session_serves(
    plugin_registered, recording_ar, monkeypatch
):
    """The session's one registration raises: none of its graphs was registered, so none may
    stay captured (held, unserved, and counted in the capture order); the next capture loop
    captures every size again and serves them as eager does."""
    config = make_config(4)
    model, runner = runner_for(config)
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    register = recording_ar.register_graph_buffers
    monkeypatch.setattr(recording_ar, "register_graph_buffers", lambda: 1 / 0)
    with pytest.raises(CaptureError, match="division by zero"):
        runner.capture_model()
    assert plugin_registered.live_graphs == 0 and not backend.has_graphs()
    monkeypatch.setattr(recording_ar, "register_graph_buffers", register)
    runner.capture_model()
    assert plugin_registered.live_graphs == 3
    for tokens in (4, 3, 2, 1):
        before = sum(backend.stats()["replays"].values())
        out = runner.execute_step(tokens)
        assert sum(backend.stats()["replays"].values()) == before + 1
        view = runner.share_inputs["ids"][:tokens]
        eager = model.forward(ids_remove_padding=view, forward_meta=None)
        assert paddle.allclose(out, eager).item()


def test_first_capture_in_a_process_follows_an_eager_run_even_with_zero_warmups(sim):
    backend, _ = build(make_config(4, cudagraph_num_of_warmups=0))
    buffers = Buffers()
    with CaptureSession("decode") as running:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    assert [r.warmups for r in running.report.records] == [1, 0, 0]


@pytest.mark.parametrize(("rank", "shown"), [(0, True), (1, False)])
def test_progress_bars_only_on_rank_zero(sim, capsys, rank, shown):
    backend, _ = build(make_config(4))
    buffers = Buffers()
    with CaptureSession("decode", link=PeerLink(rank=rank)):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    err = capsys.readouterr().err
    assert ("CUDA graphs (decode)" in err and "3/3" in err) is shown


def test_memory_report_is_written_per_rank_after_each_session(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("FD_CUDAGRAPH_MEMORY_REPORT", str(tmp_path / "graphs-{rank}.json"))
    config = make_config(4)
    backend, _ = build(config)
    buffers = Buffers()
    with CaptureSession("decode", fd_config=config):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    report = json.loads((tmp_path / "graphs-0.json").read_text())
    assert report["format"] == "fd-cudagraph-memory/1" and report["graphs"] == 3
    assert [c["size"] for c in report["captures"]] == [4, 2, 1]
    per_size = {c["size"]: c["graph_bytes"] for c in report["captures"]}
    assert per_size == {4: 4 * 8 * 4, 2: 2 * 8 * 4, 1: 1 * 8 * 4}  # [size, hidden] float32
    assert report["graph_bytes"] == sum(per_size.values())
    assert report["largest_graph_bytes"] == 128
    assert report["agreement_points"] == 1 + 3 * 2 + 1  # plan, warm-up and capture, end


def test_the_plan_is_checked_at_the_first_capture_when_no_backend_existed_at_the_start(sim):
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1])

    def peer(rank, label, status):
        payload = status["payload"]
        if label == "plan" and payload and payload["plan"]["backends"]:
            plan = {**payload["plan"], "backend0.capture_sizes": [4, 2]}
            return {**status, "payload": {**payload, "plan": plan}}
        return status

    link = PeerLink(peer=peer)
    buffers = Buffers()
    with (
        pytest.raises(RankMismatchError, match=r"backend0.capture_sizes: rank 0 \[4, 2, 1\]"),
        CaptureSession("decode", link=link),
    ):
        backend, _ = build(config)  # built inside capture_model(), as without a profile run
        backend(**buffers.step(4))
    assert link.labels == ["plan", "plan"]
    _, served = served_by(backend, buffers.step(4))
    assert served is None


def test_roles_come_from_the_runner_not_from_the_order_backends_were_built(plugin_registered):
    from conftest import DecoratedDraft, DecoratedMixing

    mtp = {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1}
    config = make_config(4, speculative=mtp, draft_model_use_cudagraph=True)
    old = DecoratedMixing(fd_config=config)  # a model the worker rebuilt, its backend still alive
    GPUModelRunner(config, old).profile_run()
    target, draft = DecoratedMixing(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    runner.capture_model()
    backends = {
        name: model.graph_opt_backend.cudagraph_piecewise_backend
        for name, model in (("old", old), ("target", target), ("draft", draft))
    }
    assert {name: b.role for name, b in backends.items()} == {
        "old": "other",
        "target": "target",
        "draft": "draft",
    }
    roles = {r.backend: r.role for r in backends["target"].capture_report.records}
    assert sorted(roles.values()) == ["draft", "target"]


def test_a_failure_on_another_rank_stops_this_one_with_that_ranks_cause(sim):
    """This rank's capture is fine; rank 1 reports an out-of-memory at the same point."""
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], tp=2)
    backend, _ = build(config)

    def peer(rank, label, status):
        if label.startswith("capture decode size 2"):
            failure = {"rank": 1, "stage": "capture", "where": "decode size 2", "mode": "dynamic"}
            failure.update(error="RuntimeError: CUDA error(2): out of memory", explained=False)
            failure.update(advice="Out of memory: lower --max-num-seqs.")
            return {"payload": None, "failure": {**failure, "out_of_memory": True}}
        return status

    buffers = Buffers()
    expected = r"failed on tensor-parallel rank 1 of 2 .*size 2"
    session = CaptureSession("decode", fd_config=config, link=PeerLink(peer=peer))
    with pytest.raises(CaptureError, match=expected), session:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    assert served_by(backend, buffers.step(2))[1] is None  # rank 1's failed size: no graph here
