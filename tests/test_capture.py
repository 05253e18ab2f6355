"""Capture sessions around FastDeploy's capture loops: report, GC, plan check, policies."""

from __future__ import annotations

import gc
import json
import logging
import re

import paddle
import pytest
from conftest import Buffers, DecoratedBackbone, TinyBackbone, make_config
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin.core import capture, session
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import RankMismatchError


def runner_for(config, model_cls=DecoratedBackbone):
    model = model_cls(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()  # builds the backend, which installs the session hooks
    return model, runner


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
        r"captured 3 graphs \(sizes 1\.\.4\) in \d+\.\d s, graph memory 224 B "
        r"\(largest graph 128 B\), 2 warm-ups each",
        summaries[0],
    )
    assert session.active() is None and session.sessions_ended() == 1


def test_static_split_prefill_loop_gets_its_own_session(plugin_registered):
    config = make_config(4, graph_opt_level=1, full_cuda_graph=False, max_capture_shape_prefill=8)
    model, runner = runner_for(config)
    runner.capture_model_prefill_and_mixed()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert backend.capture_report.phase == "prefill"
    assert {r.phase for r in backend.capture_report.records} == {"prefill"}
    runner.capture_model()
    assert backend.capture_report.phase == "decode"


def test_gc_is_frozen_during_the_session_and_restored_after_an_error(plugin_registered):
    config = make_config(4)
    seen = []

    class Recording(DecoratedBackbone):
        def forward(self, ids_remove_padding, forward_meta):
            seen.append(gc.get_freeze_count())
            if ids_remove_padding.shape[0] == 2 and session.active() is not None:
                raise RuntimeError("CUDA error: out of memory")
            return super().forward(ids_remove_padding, forward_meta)

    _, runner = runner_for(config, Recording)
    seen.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.capture_model()
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0
    assert session.active() is None


class OneRankDiffers:
    """Two ranks; rank 1 differs from this one in one key."""

    def __init__(self, **changes):
        self.changes = changes

    def all_gather(self, obj):
        return [obj, {**obj, **self.changes}]


def test_plan_check_diff_names_the_key_and_both_values(sim):
    config = make_config(8)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    assert session.stats.live_backends() == [backend]
    exchange = OneRankDiffers(warmup_policy="largest_only")
    expected = r"\. rank 1: warmup_policy: rank 0 'per_size' vs rank 1 'largest_only'\. Start"
    with (
        pytest.raises(RankMismatchError, match=expected),
        session.CaptureSession("decode", exchange=exchange),
    ):
        pass
    assert session.active() is None and gc.get_freeze_count() == 0


def _captured_some(sizes):
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1])
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with session.CaptureSession("decode"):
        for size in sizes:
            backend(**buffers.step(size))
    return backend, model, buffers


def test_a_size_first_seen_after_the_sessions_runs_eagerly_and_warns_once(sim, caplog):
    backend, model, buffers = _captured_some([4, 2])
    step = buffers.step(1, seed=3)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        out = backend(**step)
        backend(**step)
    assert paddle.allclose(out[:1], model.forward(**step)).item()
    assert backend.decode_entries[1].graph is None
    assert backend.stats()["eager_fallbacks"] == {"late_capture": 2}
    assert sum("late capture" in r.getMessage() for r in caplog.records) == 1


def test_custom_allreduce_registers_after_every_graph(plugin_registered, recording_ar):
    config = make_config(4)
    model, runner = runner_for(config)
    recording_ar.events.clear()
    runner.capture_model()
    assert (
        recording_ar.events
        == [("capture_enter",), ("register_graph_buffers",), ("all_gather_object", "tp-group")] * 3
    )
    out = runner.execute_step(3)
    view = runner.share_inputs["ids"][:3]
    assert paddle.allclose(out, model.forward(ids_remove_padding=view, forward_meta=None)).item()


@pytest.mark.parametrize(
    ("policy", "warmups", "in_capture_pass", "loop_passes"),
    [
        ("per_size", [2, 2, 2], 6, 1),
        ("largest_only", [2, 0, 0], 2, 1),
        ("warm_all_first", [2, 2, 2], 0, 2),  # all warm-ups in the first pass
    ],
)
def test_warmup_policies(
    plugin_registered, monkeypatch, policy, warmups, in_capture_pass, loop_passes
):
    monkeypatch.setenv("FD_CUDAGRAPH_WARMUP", policy)
    config = make_config(4)
    model, runner = runner_for(config)
    capture.mark_warmed()
    calls_before = model.calls
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert [r.warmups for r in backend.capture_report.records] == warmups
    # A loop pass runs a prefill step per size; the capturing pass adds each size's warm-ups, its
    # captured run and the replay that ends a capture (the simulated runtime re-executes it).
    # warm_all_first first runs a warm-only pass: a prefill step plus 2 warm-ups per size.
    sizes = 3
    expected = sizes + in_capture_pass + 2 * sizes + (sizes * (1 + 2) if loop_passes == 2 else 0)
    assert model.calls - calls_before == expected
    for tokens in (1, 3, 4):
        out = runner.execute_step(tokens)
        view = runner.share_inputs["ids"][:tokens]
        expected_out = model.forward(ids_remove_padding=view, forward_meta=None)
        assert paddle.allclose(out, expected_out).item()


def test_first_capture_in_a_process_follows_an_eager_run_even_with_zero_warmups(sim):
    config = make_config(4, cudagraph_num_of_warmups=0)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with session.CaptureSession("decode") as running:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    assert [r.warmups for r in running.report.records] == [1, 0, 0]


def test_progress_bars_only_on_rank_zero(sim):
    config = make_config(4)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with session.CaptureSession("decode", fd_config=config) as running:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
        bars = dict(running._bars)
    assert list(bars) == [("decode", f"{id(backend):#x}")]
    assert bars[("decode", f"{id(backend):#x}")].total == 3
    backend.clear_graph()
    config.parallel_config.tensor_parallel_rank = 1
    with session.CaptureSession("decode", fd_config=config) as running:
        for size in (4, 2, 1):
            backend(**buffers.step(size))
        assert running._bars == {}


def test_memory_report_is_written_per_rank_after_each_session(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("FD_CUDAGRAPH_MEMORY_REPORT", str(tmp_path / "graphs-{rank}.json"))
    config = make_config(4)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with session.CaptureSession("decode", fd_config=config):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    report = json.loads((tmp_path / "graphs-0.json").read_text())
    assert report["format"] == "fd-cudagraph-memory/1" and report["graphs"] == 3
    assert [c["size"] for c in report["captures"]] == [4, 2, 1]
    per_size = {c["size"]: c["graph_bytes"] for c in report["captures"]}
    assert per_size == {4: 4 * 8 * 4, 2: 2 * 8 * 4, 1: 1 * 8 * 4}  # [size, hidden] float32
    assert report["graph_bytes"] == sum(per_size.values())
    assert report["largest_graph_bytes"] == 128


class DraftRunner(GPUModelRunner):
    """A runner whose steps also run an MTP-style draft model, as FastDeploy's proposer does."""

    def __init__(self, fd_config, model, draft) -> None:
        super().__init__(fd_config, model)
        self.draft = draft

    def _run(self, num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids=None):
        out = super()._run(num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids)
        view = self.share_inputs["ids"][:num_tokens]
        meta = type(self.draft_meta_source)(
            ids_remove_padding=view,
            step_use_cudagraph=use_graph,
            exist_prefill=exist_prefill,
            real_bsz=real_bsz,
        )
        self.draft(ids_remove_padding=view, forward_meta=meta)
        return out

    @property
    def draft_meta_source(self):
        from fastdeploy.model_executor.forward_meta import ForwardMeta

        return ForwardMeta(ids_remove_padding=None)


def test_target_and_draft_capture_in_one_session_into_their_own_pools(plugin_registered):
    sim = plugin_registered
    config = make_config(4)
    target = DecoratedBackbone(fd_config=config)
    draft = DecoratedBackbone(fd_config=config)
    runner = DraftRunner(config, target, draft)
    runner.profile_run()
    runner.capture_model()
    target_backend = target.graph_opt_backend.cudagraph_piecewise_backend
    draft_backend = draft.graph_opt_backend.cudagraph_piecewise_backend
    report = target_backend.capture_report
    assert report is draft_backend.capture_report
    by_backend = {}
    for record in report.records:
        by_backend.setdefault(record.backend, []).append(record.size)
    assert list(by_backend.values()) == [[4, 2, 1], [4, 2, 1]]
    assert target_backend.pool is not draft_backend.pool and sim.live_pools == 2
    target_backend.clear_graph()  # /v1/sleep clears the target only; its pool goes at once
    assert sim.live_pools == 1 and draft_backend.decode_entries[4].graph is not None


def test_the_plan_is_checked_at_the_first_capture_when_no_backend_existed_at_the_start(sim):
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1])
    exchange = OneRankDiffers(**{"backend0.capture_sizes": [4, 2]})
    buffers = Buffers()
    with session.CaptureSession("decode", exchange=exchange):
        model = TinyBackbone()  # built inside capture_model(), as without a profile run
        backend = CudaGraphBackend(
            fd_config=config, dy_runnable=model.forward, runnable=model.forward
        )
        with pytest.raises(RankMismatchError, match=r"backend0.capture_sizes: rank 0 \[4, 2, 1\]"):
            backend(**buffers.step(4))
    assert backend.decode_entries[4].graph is None
