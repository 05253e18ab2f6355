"""Dynamic-mode dispatch: padding, capture, replay, fallbacks, lifecycle (simulated runtime).

The model's rows interact (``MixingBackbone``), so a step served by a graph of another size than
the one it pads to gives other numbers; every replay is compared with eager at the padded size,
and each test says which graph served each step.
"""

from __future__ import annotations

import logging
import sys

import paddle
import pytest
from conftest import (
    Buffers,
    CaptureSessionForOneRank,
    MixingBackbone,
    capture_speculative,
    make_config,
    served_by,
)

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureIncompleteError


def build(config=None, outputs="tensor", **graph_args):
    config = config or make_config(8, **graph_args)
    model = MixingBackbone(outputs=outputs)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    return backend, model


def capture_all(backend, buffers):
    for size in backend.cudagraph_capture_sizes:
        backend(**buffers.step(size))


def padded_eager(model, buffers, size):
    return model.forward(**buffers.padded(size))


def test_the_model_tells_a_wrong_graph_size_from_the_right_one():
    model, buffers = MixingBackbone(), Buffers()
    buffers.step(8, seed=1)
    buffers.step(3, seed=2)
    right = padded_eager(model, buffers, 4)[:3]
    assert not paddle.allclose(right, padded_eager(model, buffers, 8)[:3]).item()
    assert not paddle.allclose(right, model.forward(**buffers.step(3, seed=2))).item()


def test_each_step_is_served_by_the_graph_of_the_size_it_pads_to(sim):
    backend, model = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    assert backend.cudagraph_capture_sizes == [8, 4, 2, 1]
    for tokens, size in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)):
        out, served = served_by(backend, buffers.step(tokens, seed=tokens))
        assert served == size and out.shape[0] == size
        assert paddle.allclose(out, padded_eager(model, buffers, size)).item()


def test_replay_returns_the_same_output_objects_in_graph_memory(sim):
    backend, _ = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    first = backend(**buffers.step(3, seed=1))
    pointer = first.data_ptr()
    second = backend(**buffers.step(4, seed=2))
    assert second is first and second.data_ptr() == pointer
    assert backend(**buffers.step(5)) is not first  # size 8 has its own buffers


def test_replay_reads_captured_inputs_not_new_tensors(sim):
    backend, model = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    buffers.step(4, seed=3)
    expected_from_buffer = padded_eager(model, buffers, 4).clone()
    swapped = paddle.full([4], 5, dtype="int64")  # a new tensor: a new address on a GPU
    step = {"ids_remove_padding": swapped, "forward_meta": buffers.step(0)["forward_meta"]}
    step["forward_meta"].ids_remove_padding = swapped
    out, served = served_by(backend, step)
    assert served == 4
    assert paddle.allclose(out, expected_from_buffer).item()
    assert not paddle.allclose(
        out, model.forward(ids_remove_padding=swapped, forward_meta=None)
    ).item()


@pytest.mark.parametrize("outputs", ["list_with_none", "single_list"])
def test_list_outputs_keep_their_structure_and_none_entries(sim, outputs):
    backend, model = build(outputs=outputs)
    buffers = Buffers()
    capture_all(backend, buffers)
    out, served = served_by(backend, buffers.step(3, seed=4))
    expected = padded_eager(model, buffers, 4)
    assert served == 4 and isinstance(out, list) and len(out) == len(expected)
    for got, want in zip(out, expected, strict=True):
        if want is None:
            assert got is None
        else:
            assert paddle.allclose(got, want).item()


def test_fallbacks_are_counted_by_reason_and_warned_once_per_shape(sim, caplog):
    backend, model = build()
    buffers = Buffers()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        not_captured, served = served_by(backend, buffers.step(3))  # pads to 4: never captured
        backend(**buffers.step(3))
        oversized = backend(**buffers.step(9, seed=1))
        zero = backend(**buffers.step(0))
    assert served is None
    fallbacks = backend.stats()["eager_fallbacks"]
    assert fallbacks == {"not_captured": 2, "oversized_decode": 1, "zero_tokens": 1}
    assert not_captured.shape[0] == 3 and zero.shape[0] == 0
    assert paddle.allclose(oversized, model.forward(**buffers.step(9, seed=1))).item()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert any("3 tokens ran without a graph (not captured)" in w for w in warnings)
    assert backend.captures == 0


def test_stats_count_replays_and_padded_tokens_per_size(sim):
    backend, _ = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    for tokens in (3, 3, 5, 8, 1):
        backend(**buffers.step(tokens))
    stats = backend.stats()
    # Outside a capture session each capture served its step too.
    assert stats["replays"] == {1: 2, 2: 1, 4: 3, 8: 3}
    assert stats["padded_tokens_per_size"] == {4: 2, 8: 3}
    assert stats["padded_tokens"] == 5
    assert stats["captures"] == 4
    assert set(stats["capture_seconds"]) == {1, 2, 4, 8}


def test_warmups_run_outside_the_allreduce_capture_state_and_capture_inside(sim, recording_ar):
    config = make_config(8, cudagraph_num_of_warmups=3)
    seen = []
    model = MixingBackbone()

    def forward(**kwargs):
        seen.append(recording_ar.capturing)
        return model.forward(**kwargs)

    backend = CudaGraphBackend(fd_config=config, dy_runnable=forward, runnable=forward)
    backend(**Buffers().step(8))
    # 3 eager warm-ups outside, the captured run inside, then the replay (outside again).
    assert seen == [False, False, False, True, False]
    assert recording_ar.events == [
        ("start_capture",),
        ("register_graph_buffers",),
        ("all_gather_object", "tp-group"),
    ]
    assert recording_ar.garbage == 0 and recording_ar.stale_replays == 0


def test_capture_order_must_follow_the_plan_every_rank_follows(sim):
    backend, _ = build()
    buffers = Buffers()
    with pytest.raises(
        CaptureError, match=r"CaptureOrderError: .*expected size 8 .* got 4"
    ) as raised:
        backend(**buffers.step(4))
    assert "cannot be captured" not in str(raised.value)  # the order error says what to do
    capture_all(backend, buffers)
    assert backend.captures == 4


def test_a_failed_capture_publishes_nothing_and_says_to_restart_as_paddle_cannot_retry(sim):
    backend, model = build()
    buffers = Buffers()
    sim.fail_next_capture(RuntimeError("CUDA error: out of memory"))
    with pytest.raises(CaptureError) as raised:
        backend(**buffers.step(8))
    message = str(raised.value)
    assert "capture failed for decode size 8 (dynamic mode" in message
    assert "RuntimeError: CUDA error: out of memory" in message and "--max-num-seqs" in message
    assert "restart the worker" in message
    assert sim.live_graphs == 0 and not sim.capturing
    out, served = served_by(backend, buffers.step(5, seed=9))  # the stream still serves eagerly
    assert served is None
    assert paddle.allclose(out, model.forward(**buffers.step(5, seed=9))).item()
    with pytest.raises(CaptureError, match="can only captured one by one"):
        backend(**buffers.step(8))  # as on Paddle: no capture works after a failed one


def test_only_an_out_of_memory_cause_gets_memory_advice(sim):
    backend, _ = build()
    sim.fail_next_capture(RuntimeError("Model has breakgraph, please set env SOT_LOG_LEVEL=3"))
    with pytest.raises(CaptureError) as raised:
        backend(**Buffers().step(8))
    message = str(raised.value)
    assert "breakgraph" in message and "cannot be captured" in message
    assert "out of memory" not in message.lower() and "--max-num-seqs" not in message


def test_check_capture_successful_in_dynamic_mode(sim):
    backend, _ = build()
    with pytest.raises(CaptureIncompleteError, match=r"decode size 8, decode size 4, .*size 1"):
        backend.check_capture_successful()
    capture_all(backend, Buffers())
    backend.check_capture_successful()


def test_clear_graph_releases_everything_and_recapture_serves_alike(sim, recording_ar):
    backend, model = build()
    buffers = Buffers()
    backend.clear_graph()  # before any capture: harmless
    capture_all(backend, buffers)
    assert sim.live_graphs == 4 and sim.live_pools == 1 and sim.pool_bytes(None) > 0
    backend.clear_graph()
    backend.clear_graph()
    assert sim.live_graphs == 0 and sim.pool_bytes(None) == 0
    assert recording_ar.events.count(("clear_ipc_handles",)) == 3
    out, served = served_by(backend, buffers.step(6, seed=5))
    assert served is None  # nothing to replay until the next capture
    capture_all(backend, buffers)  # the same descending order is accepted again
    out, served = served_by(backend, buffers.step(6, seed=5))
    assert served == 8 and paddle.allclose(out, padded_eager(model, buffers, 8)).item()
    assert recording_ar.stale_replays == 0


def test_padding_uses_the_size_list_not_fastdeploys_stale_map(sim, caplog):
    config = make_config(8, tp=2, sequence_parallel_moe=True, splitwise_role="decode")
    assert config.graph_opt_config.cudagraph_capture_sizes == [8, 4, 2]
    assert config.graph_opt_config.real_shape_to_captured_size[1] == 1  # stale upstream
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend, model = build(config)
    assert any("disagrees" in r.getMessage() for r in caplog.records)
    buffers = Buffers()
    with CaptureSessionForOneRank(config):
        capture_all(backend, buffers)
    out, served = served_by(backend, buffers.step(1))
    assert served == 2 and out.shape[0] == 2
    assert paddle.allclose(out, padded_eager(model, buffers, 2)).item()


def test_hot_path_takes_keywords_only_and_needs_forward_meta(sim):
    backend, _ = build()
    capture_all(backend, Buffers())
    with pytest.raises(TypeError):
        backend(Buffers().step(1))
    with pytest.raises(KeyError, match="forward_meta"):
        backend(ids_remove_padding=paddle.zeros([1], dtype="int64"))


class Exploding(MixingBackbone):
    """Raises from its forward once ``explode`` is set: what the simulated graph replays."""

    explode = False

    def forward(self, ids_remove_padding, forward_meta):
        if self.explode:
            raise RuntimeError("CUDA error(700): an illegal memory access was encountered")
        return super().forward(ids_remove_padding, forward_meta)


def test_a_replay_error_propagates_and_is_not_counted(sim):
    model = Exploding()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward
    )
    buffers = Buffers()
    capture_all(backend, buffers)
    replays = dict(backend.stats()["replays"])
    model.explode = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend(**buffers.step(2))
    assert backend.stats()["replays"] == replays


def test_hot_path_holds_no_extra_references(sim):
    backend, _ = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    step = buffers.step(3)
    result = backend(**step)
    before = (sys.getrefcount(result), sys.getrefcount(step["forward_meta"]))
    for _ in range(1000):
        backend(**step)
    assert (sys.getrefcount(result), sys.getrefcount(step["forward_meta"])) == before


def test_speculative_steps_are_served_from_the_running_request_table(sim):
    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    backend, model = build(config)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    served = []
    for tokens, running in ((3, 2), (4, 2), (6, 3), (1, 1), (5, 2)):
        step = buffers.step(tokens, seed=tokens)
        step["forward_meta"].real_bsz = running
        out, size = served_by(backend, step)
        served.append(size)
        assert paddle.allclose(out, padded_eager(model, buffers, size)).item()
    # (5 tokens, 2 requests) exceeds size 4: padded by its token count to the size-8 graph.
    assert served == [4, 4, 8, 2, 8]
    stats = backend.stats()
    # Counted per size: the captures (8, 4, 2 tokens) and the steps above.
    assert stats["replays"] == {2: 2, 4: 3, 8: 3}
    assert stats["padded_tokens_per_size"] == {2: 1, 4: 1, 8: 5}
    # tune reads running requests: the captures (4, 2, 1 requests) and the steps above.
    assert backend.observed_keys() == {1: 2, 2: 4, 3: 1, 4: 1}


# real_bsz 0 replayed the smallest graph (max(1, 0)); a stale count, which overlap scheduling
# caches, replayed its graph on the hot path: both re-ran kernels on the last step's metadata.
@pytest.mark.parametrize("running", [0, 2])
def test_a_zero_token_speculative_step_runs_eagerly(sim, running):
    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    backend, _ = build(config)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    step = buffers.step(0)
    step["forward_meta"].real_bsz = running
    out, served = served_by(backend, step)
    assert out.shape[0] == 0 and served is None
    assert backend.stats()["eager_fallbacks"] == {"zero_tokens": 1}


def test_a_failed_all_reduce_registration_publishes_no_graph(sim, recording_ar, monkeypatch):
    def registration_fails():
        raise RuntimeError("register_graph_buffers: invalid IPC handle")

    monkeypatch.setattr(recording_ar, "register_graph_buffers", registration_fails)
    backend, _ = build()
    buffers = Buffers()
    with pytest.raises(CaptureError, match=r"registration failed .*invalid IPC handle"):
        backend(**buffers.step(8))
    assert sim.live_graphs == 0 and not recording_ar.capturing
    _, served = served_by(backend, buffers.step(5))  # no graph of size 8 is left to replay
    assert served is None
    assert backend.stats()["eager_fallbacks"] == {"not_captured": 1}


def test_clear_graph_releases_graphs_even_when_the_summary_fails(sim, monkeypatch):
    from fd_cudagraph_plugin.core import observability

    backend, _ = build()
    capture_all(backend, Buffers())

    def broken(*args, **kwargs):
        raise ValueError("formatting broke")

    monkeypatch.setattr(observability, "format_table", broken)
    backend.clear_graph()
    assert sim.live_graphs == 0


def test_a_failed_capture_keeps_nothing_alive_while_the_caller_holds_the_error(sim):
    """The error's traceback reaches the frames of the failed capture, whose tensors live in
    the graph pool: once clear_graph() has run, holding the error must not keep them."""
    import gc
    import weakref

    alive = []

    class FailsInCapture(MixingBackbone):
        def forward(self, ids_remove_padding, forward_meta):
            out = super().forward(ids_remove_padding, forward_meta)
            if sim.capturing and ids_remove_padding.shape[0] == 4:
                alive.append(weakref.ref(out))  # what the capture allocated in the pool
                raise RuntimeError("CUDA error(2): out of memory")
            return out

    model = FailsInCapture()
    backend = CudaGraphBackend(
        fd_config=make_config(8, cudagraph_capture_sizes=[8, 4]),
        dy_runnable=model.forward,
        runnable=model.forward,
    )
    buffers = Buffers()
    backend(**buffers.step(8))
    graphs = [weakref.ref(e.graph) for e in backend.table.all() if e.graph is not None]
    outputs = [weakref.ref(e.result) for e in backend.table.all() if e.result is not None]
    try:
        backend(**buffers.step(4))
    except CaptureError as error:
        held = error
    backend.clear_graph()
    gc.collect()
    assert held is not None and len(alive) == 1 and graphs and outputs
    assert [ref for ref in alive + graphs + outputs if ref() is not None] == []
