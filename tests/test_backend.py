"""Dynamic-mode dispatch: padding, capture, replay, fallbacks, lifecycle (simulated runtime)."""

from __future__ import annotations

import logging
import sys

import paddle
import pytest
from conftest import Buffers, TinyBackbone, capture_speculative, make_config, meta_for

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, CaptureIncompleteError, CaptureOrderError


def build(config=None, outputs="tensor", **graph_args):
    config = config or make_config(8, **graph_args)
    model = TinyBackbone(outputs=outputs)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    return backend, model


def capture_all(backend, buffers):
    for size in backend.cudagraph_capture_sizes:
        backend(**buffers.step(size))


def eager(model, step):
    return model.forward(**step)


def test_replay_equals_eager_on_every_padded_shape(sim):
    backend, model = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    assert backend.cudagraph_capture_sizes == [8, 4, 2, 1]
    for tokens in range(1, 9):
        step = buffers.step(tokens, seed=tokens)
        out = backend(**step)
        padded = backend.settings.decode_table[tokens]
        assert out.shape[0] == padded
        assert paddle.allclose(out[:tokens], eager(model, step)).item()


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
    captured = buffers.step(4, seed=3)
    expected_from_buffer = eager(model, captured).clone()
    swapped = paddle.full([4], 5, dtype="int64")  # a new tensor: a new address on a GPU
    out = backend(ids_remove_padding=swapped, forward_meta=meta_for(swapped))
    assert paddle.allclose(out, expected_from_buffer).item()
    from_swapped = eager(model, {"ids_remove_padding": swapped, "forward_meta": None})
    assert not paddle.allclose(out, from_swapped).item()


@pytest.mark.parametrize("outputs", ["list_with_none", "single_list"])
def test_list_outputs_keep_their_structure_and_none_entries(sim, outputs):
    backend, model = build(outputs=outputs)
    buffers = Buffers()
    capture_all(backend, buffers)
    step = buffers.step(3, seed=4)
    out = backend(**step)
    expected = eager(model, step)
    assert isinstance(out, list) and len(out) == len(expected)
    for got, want in zip(out, expected, strict=True):
        if want is None:
            assert got is None
        else:
            assert paddle.allclose(got[:3], want).item()


def test_fallbacks_are_counted_by_reason_and_warned_once_per_shape(sim, caplog):
    backend, _ = build()
    buffers = Buffers()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        not_captured = backend(**buffers.step(3))  # pads to 4, never captured: eager
        backend(**buffers.step(3))
        backend(**buffers.step(9))
        zero = backend(**buffers.step(0))
    fallbacks = backend.stats()["eager_fallbacks"]
    assert fallbacks == {"not_captured": 2, "oversized_decode": 1, "zero_tokens": 1}
    assert not_captured.shape[0] == 3 and zero.shape[0] == 0
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
    # Each capture ends with a replay too.
    assert stats["replays"] == {1: 2, 2: 1, 4: 3, 8: 3}
    assert stats["padded_tokens_per_size"] == {4: 2, 8: 3}
    assert stats["padded_tokens"] == 5
    assert stats["captures"] == 4
    assert set(stats["capture_seconds"]) == {1, 2, 4, 8}


def test_warmups_run_outside_the_allreduce_context_and_capture_inside(sim, recording_ar):
    config = make_config(8, cudagraph_num_of_warmups=3)
    seen = []
    model = TinyBackbone()

    def forward(**kwargs):
        seen.append(recording_ar.capturing)
        return model.forward(**kwargs)

    backend = CudaGraphBackend(fd_config=config, dy_runnable=forward, runnable=forward)
    buffers = Buffers()
    backend(**buffers.step(8))
    # 3 eager warm-ups outside, the captured run inside, then the replay (outside again).
    assert seen == [False, False, False, True, False]
    assert recording_ar.events == [
        ("capture_enter",),
        ("register_graph_buffers",),
        ("all_gather_object", "tp-group"),
    ]


def test_capture_order_must_follow_the_plan_every_rank_follows(sim):
    backend, _ = build()
    buffers = Buffers()
    with pytest.raises(CaptureOrderError, match=r"expected size 8 .* got 4"):
        backend(**buffers.step(4))
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
    assert backend.decode_entries[8].graph is None and backend.tables.served[5] is None
    assert sim.live_graphs == 0 and not sim.capturing
    step = buffers.step(5, seed=9)  # the stream still serves eagerly
    assert paddle.allclose(backend(**step)[:5], eager(model, step)).item()
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
    with pytest.raises(CaptureIncompleteError, match="decode 8, decode 4, decode 2, decode 1"):
        backend.check_capture_successful()
    capture_all(backend, Buffers())
    backend.check_capture_successful()


def test_clear_graph_releases_everything_and_recapture_works(sim, recording_ar):
    backend, model = build()
    buffers = Buffers()
    backend.clear_graph()  # before any capture: harmless
    capture_all(backend, buffers)
    assert sim.live_graphs == 4 and sim.pool_bytes(backend.pool) > 0
    backend.clear_graph()
    backend.clear_graph()
    assert sim.live_graphs == 0 and sim.pool_bytes(backend.pool) == 0
    assert recording_ar.events.count(("clear_ipc_handles",)) == 3
    capture_all(backend, buffers)  # the same descending order is accepted again
    step = buffers.step(6, seed=5)
    assert paddle.allclose(backend(**step)[:6], eager(model, step)).item()


def test_padding_uses_the_size_list_not_fastdeploys_stale_map(sim, caplog):
    config = make_config(8, tp=2, sequence_parallel_moe=True, splitwise_role="decode")
    assert config.graph_opt_config.cudagraph_capture_sizes == [8, 4, 2]
    assert config.graph_opt_config.real_shape_to_captured_size[1] == 1  # stale upstream
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend, model = build(config)
    assert any("disagrees" in r.getMessage() for r in caplog.records)
    buffers = Buffers()
    capture_all(backend, buffers)
    step = buffers.step(1)
    out = backend(**step)
    assert out.shape[0] == 2
    assert paddle.allclose(out[:1], eager(model, step)).item()


def test_hot_path_takes_keywords_only_and_needs_forward_meta(sim):
    backend, _ = build()
    capture_all(backend, Buffers())
    with pytest.raises(TypeError):
        backend(Buffers().step(1))
    with pytest.raises(KeyError, match="forward_meta"):
        backend(ids_remove_padding=paddle.zeros([1], dtype="int64"))


def test_replay_error_propagates_and_is_not_counted(sim):
    backend, _ = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    graph = backend.decode_entries[2].graph
    graph.release()  # a released simulated graph raises on replay
    with pytest.raises(RuntimeError, match="released"):
        backend(**buffers.step(2))
    assert backend.stats()["replays"].get(2, 0) == 1  # only the replay that ended its capture


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


def test_a_replay_that_clears_the_graphs_leaves_the_backend_consistent(sim):
    backend, _ = build()
    buffers = Buffers()
    capture_all(backend, buffers)
    entry = backend.decode_entries[4]
    result = entry.result
    entry.replay = backend.clear_graph  # a "replay" that clears, as a weight update might
    assert backend(**buffers.step(3)) is result
    assert backend.tables.served == [None] * 9  # fresh tables: nothing left to replay
    assert backend.stats()["replays"][4] == 2  # the capture's run and this one, both counted
    assert backend(**buffers.step(8)).shape[0] == 8  # serves again: recaptures from scratch
    assert backend.decode_entries[8].graph is not None


def test_speculative_steps_are_served_from_the_running_request_table(sim):
    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    backend, model = build(config)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    served = []
    for tokens, running in ((3, 2), (4, 2), (6, 3), (1, 1), (5, 2)):
        step = buffers.step(tokens, seed=tokens)
        step["forward_meta"].real_bsz = running
        out = backend(**step)
        served.append(out.shape[0])
        assert paddle.allclose(out[:tokens], model.forward(**step)).item()
    # (5 tokens, 2 requests) exceeds size 4: padded by its token count to the size-8 graph.
    assert served == [4, 4, 8, 2, 8]
    # Counted by running requests: the captures (4, 2, 1 requests) and the steps above.
    assert backend.counts.steps == [0, 2, 3, 1, 1] and backend.counts.tokens[2] == 4 + 3 + 4
    stats = backend.stats()
    # The 5-token step (2 requests, more tokens than size 4) was served by token count.
    assert stats["replays"] == {2: 2, 4: 3, 8: 3}
    assert stats["padded_tokens_per_size"] == {2: 1, 4: 1, 8: 5}
    assert backend.observed_keys() == {1: 2, 2: 4, 3: 1, 4: 1}


# real_bsz 0 replayed the smallest graph (max(1, 0)); a stale count, which overlap scheduling
# caches, replayed its graph on the hot path: both re-ran kernels on the last step's metadata.
@pytest.mark.parametrize("running", [0, 2])
def test_a_zero_token_speculative_step_runs_eagerly(sim, running):
    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    backend, _ = build(config)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    replays = backend.stats()["replays"]
    step = buffers.step(0)
    step["forward_meta"].real_bsz = running
    assert backend(**step).shape[0] == 0
    assert backend.stats()["replays"] == replays
    assert backend.stats()["eager_fallbacks"] == {"zero_tokens": 1}


def test_a_failed_all_reduce_registration_publishes_no_graph(sim, monkeypatch):
    import contextlib

    from fd_cudagraph_plugin.core import allreduce

    @contextlib.contextmanager
    def registration_fails():
        yield
        raise RuntimeError("all_gather_object over the TP group failed")

    monkeypatch.setattr(allreduce, "capture_context", registration_fails)
    backend, _ = build()
    buffers = Buffers()
    with pytest.raises(CaptureError, match="all_gather_object over the TP group failed"):
        backend(**buffers.step(8))
    entry = backend.decode_entries[8]
    assert entry.graph is None and entry.replay is None and not entry.captured
    assert backend.tables.served == [None] * 9 and sim.live_graphs == 0


def test_clear_graph_releases_graphs_even_when_the_summary_fails(sim, monkeypatch):
    from fd_cudagraph_plugin.core import stats

    backend, _ = build()
    capture_all(backend, Buffers())

    def broken(*args, **kwargs):
        raise ValueError("formatting broke")

    monkeypatch.setattr(stats, "format_table", broken)
    backend.clear_graph()
    assert sim.live_graphs == 0
