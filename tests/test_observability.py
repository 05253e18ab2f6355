"""Stats, the summary table, the stats file, Prometheus metrics and the replay guards."""

from __future__ import annotations

import json
import logging
import time

import paddle
import pytest
from conftest import (
    Buffers,
    PeerLink,
    TinyBackbone,
    capture_speculative,
    make_config,
    meta_for,
    served_by,
)

from fd_cudagraph_plugin.core import observability, process
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.guards import AddressGuardError, SelfCheckError
from fd_cudagraph_plugin.core.session import CaptureSession


def backend_for(model=None, config=None, **graph_args):
    model = model or TinyBackbone()
    config = config or make_config(8, cudagraph_capture_sizes=[4, 2, 1], **graph_args)
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    return backend, model


def capture_all(backend, buffers):
    for size in backend.cudagraph_capture_sizes:
        backend(**buffers.step(size))


def test_counters_follow_a_scripted_sequence_of_steps(sim):
    backend, _ = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    for tokens in (3, 3, 1, 4, 0, 6, 2):
        backend(**buffers.step(tokens))
    prefill = buffers.step(5)
    prefill["forward_meta"].exist_prefill = True
    backend(**prefill)
    stats_now = backend.stats()
    assert stats_now["captures"] == 3
    assert stats_now["replays"] == {1: 2, 2: 2, 4: 4}
    assert stats_now["eager_fallbacks"] == {"zero_tokens": 1, "oversized_decode": 1, "prefill": 1}
    assert stats_now["padded_tokens"] == 2
    assert stats_now["padded_tokens_per_size"] == {4: 2}
    assert set(stats_now["capture_seconds"]) == {4, 2, 1}
    assert backend.observed_keys() == {4: 2, 2: 2, 1: 2, 3: 2, 6: 1}


def test_module_level_aggregate_sums_every_backend(sim):
    first, _ = backend_for()
    second, _ = backend_for()
    buffers = Buffers()
    capture_all(first, buffers)
    capture_all(second, buffers)
    first(**buffers.step(3))
    totals = observability.aggregate(process.current())
    ours = {f"{id(first):#x}", f"{id(second):#x}"}
    assert ours <= set(totals["backends"])
    others = [s for key, s in totals["backends"].items() if key not in ours]
    assert totals["captures"] == 6 + sum(s["captures"] for s in others)
    assert totals["replays"][4] == 3 + sum(s["replays"].get(4, 0) for s in others)
    assert first.stats()["replays"] == {1: 1, 2: 1, 4: 2}


def test_the_summary_on_clear_lists_the_sizes_that_served_and_sums_up_the_idle_ones(sim, caplog):
    from conftest import CaptureSessionForOneRank

    backend, _ = backend_for()
    buffers = Buffers()
    with CaptureSessionForOneRank(backend.fd_config):  # as capture_model(): not served traffic
        capture_all(backend, buffers)
    for _ in range(2):
        backend(**buffers.step(3))  # served by size 4, one padded token each
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        backend.clear_graph()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("CUDA graph summary (clear_graph)") == 1
    assert f"backend {id(backend):#x} ({backend.role}): 3 captures, 2 replays, 2 padded" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["4"]]
    assert [row[:3] for row in rows] == [["4", "2", "2"]]  # size, replays, padded tokens
    assert rows[0][-2:] == ["128", "B"]  # its graph's outputs, in a unit that shows them
    assert "2 captured sizes served no step (2, 1)" in text


def test_periodic_stats_line(sim, monkeypatch, caplog):
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_INTERVAL", "1")  # the shortest allowed
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        backend, _ = backend_for()
        capture_all(backend, Buffers())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any("CUDA graphs: " in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.02)
    assert any("CUDA graphs: " in r.getMessage() for r in caplog.records)


def test_stats_file_appends_increments_tune_can_sum(sim, monkeypatch, tmp_path):
    path = tmp_path / "stats-{rank}.jsonl"
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(path))
    backend, _ = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    for tokens in (3, 3, 1):
        backend(**buffers.step(tokens))
    backend.flush_stats()
    backend(**buffers.step(3))
    backend.flush_stats()
    backend.flush_stats()  # nothing new: no line
    lines = [json.loads(line) for line in (tmp_path / "stats-0.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0]["format"] == "fd-cudagraph-stats/1" and lines[0]["rank"] == 0
    assert lines[0]["decode_token_counts"] == {"1": 2, "2": 1, "3": 2, "4": 1}
    assert lines[1]["decode_token_counts"] == {"3": 1}


@pytest.mark.parametrize(("mode", "ok_replays"), [("always", 0), ("sampled:3", 2)])
def test_address_guard_catches_a_swapped_input(sim, monkeypatch, mode, ok_replays):
    monkeypatch.setenv("FD_CUDAGRAPH_CHECK_ADDRESSES", mode)
    backend, _ = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    swapped = paddle.full([4], 3, dtype="int64")  # a new tensor, not the persistent buffer
    for _ in range(ok_replays):
        backend(ids_remove_padding=swapped, forward_meta=meta_for(swapped))
    with pytest.raises(AddressGuardError, match=r"size 4 reads input 'ids_remove_padding'"):
        backend(ids_remove_padding=swapped, forward_meta=meta_for(swapped))


def test_address_guard_passes_persistent_buffers(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_CHECK_ADDRESSES", "always")
    backend, model = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    for tokens in (3, 4, 1, 2):
        step = buffers.step(tokens, seed=tokens)
        assert paddle.allclose(backend(**step)[:tokens], model.forward(**step)).item()


class FrozenHostValue(TinyBackbone):
    """Adds a host-side step counter: a real graph freezes it at capture, eager does not."""

    def __init__(self, runtime) -> None:
        super().__init__()
        self.runtime = runtime
        self.counter = 0
        self.frozen = 0

    def forward(self, ids_remove_padding, forward_meta):
        self.counter += 1
        if not self.runtime.replaying:
            self.frozen = self.counter
        return super().forward(ids_remove_padding, forward_meta) + float(self.frozen)


def test_self_check_warn_serves_the_size_eagerly(sim, monkeypatch, caplog):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", "warn")
    model = FrozenHostValue(sim)
    backend, _ = backend_for(model)
    buffers = Buffers()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        capture_all(backend, buffers)
    assert any("self-check failed for decode size 4" in r.getMessage() for r in caplog.records)
    for tokens in (3, 2, 1):
        out, served = served_by(backend, buffers.step(tokens))
        assert served is None and out.shape[0] == tokens  # eager, not a padded graph output
    assert backend.stats()["eager_fallbacks"]["self_check_failed"] == 3 + 3


def test_self_check_error_raises(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", "error")
    backend, _ = backend_for(FrozenHostValue(sim))
    with pytest.raises(SelfCheckError, match="size 4: output 0 differs"):
        backend(**Buffers().step(4))


def test_self_check_passes_a_capturable_model(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", "error")
    backend, _ = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    assert [served_by(backend, buffers.step(n))[1] for n in (4, 3, 2, 1)] == [4, 4, 2, 1]


def test_dump_dot_says_once_when_the_runtime_cannot(sim, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("FD_CUDAGRAPH_DUMP_DOT", "1")
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path))
    backend, _ = backend_for()
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        capture_all(backend, Buffers())
    assert sum("cannot write dot files" in r.getMessage() for r in caplog.records) == 1
    assert list(tmp_path.iterdir()) == []  # it made an empty GraphDotFiles/ before


def test_counters_survive_clear_graph(sim):
    backend, _ = backend_for()
    buffers = Buffers()
    capture_all(backend, buffers)
    backend(**buffers.step(3))
    before = backend.stats()
    backend.clear_graph()
    after = backend.stats()
    assert after["replays"] == before["replays"] == {1: 1, 2: 1, 4: 2}
    assert after["padded_tokens"] == before["padded_tokens"] == 1
    assert after["captures"] == 3 and after["graph_bytes"] == {}


def test_sampled_address_checks_on_the_general_path_too(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_CHECK_ADDRESSES", "sampled:3")
    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    swapped = paddle.full([8], 3, dtype="int64")
    meta = meta_for(swapped, real_bsz=4)
    backend(ids_remove_padding=swapped, forward_meta=meta)
    backend(ids_remove_padding=swapped, forward_meta=meta)
    with pytest.raises(AddressGuardError):
        backend(ids_remove_padding=swapped, forward_meta=meta)


def test_a_tensor_parallel_backend_never_captures_outside_a_session(sim):
    """Outside FastDeploy's capture loop no rank can agree with the others: a capture on one
    rank alone would leave the others waiting in its all-reduce registration."""
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], tp=2)
    backend, _ = backend_for(config=config)
    _, served = served_by(backend, Buffers().step(4))
    assert served is None and backend.captures == 0
    assert backend.stats()["eager_fallbacks"] == {"late_capture": 1}


def _rank_one_fails_self_check_at_size_2(rank, label, status):
    if label.startswith("self-check decode size 2"):
        verdict = "decode size 2: output 0 differs"
        return {"payload": {"type": "SelfChecks", "failed": {"decode size 2": verdict}}}
    return status


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_tensor_parallel_ranks_act_alike_on_a_self_check_failure_of_another_rank(
    sim, monkeypatch, mode
):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", mode)
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], tp=2)
    backend, _ = backend_for(config=config)
    link = PeerLink(peer=_rank_one_fails_self_check_at_size_2)
    buffers = Buffers()
    session = CaptureSession("decode", fd_config=config, link=link)
    if mode == "error":
        # This rank's graphs are fine, and it stops all the same, as rank 1 does.
        expected = r"rank 1: .*size 2.*Every tensor-parallel rank"
        with pytest.raises(SelfCheckError, match=expected), session:
            capture_all(backend, buffers)
        return
    with session:
        capture_all(backend, buffers)
    assert [label for label, status in link.posted if label.startswith("self-check")] == [
        "self-check decode size 4 (target)",
        "self-check decode size 2 (target)",
        "self-check decode size 1 (target)",
    ]
    posted = [status for label, status in link.posted if "self" in label]
    passed = {"payload": {"type": "SelfChecks", "failed": {}}, "failure": None}
    assert posted and all(status == passed for status in posted)
    assert served_by(backend, buffers.step(2))[1] is None  # eager on this rank too
    assert served_by(backend, buffers.step(4))[1] == 4


def test_a_self_check_failure_on_this_rank_is_shared_not_raised_alone(sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", "warn")
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], tp=2)
    backend, _ = backend_for(FrozenHostValue(sim), config=config)
    link = PeerLink(
        peer=lambda rank, label, status: (
            {"payload": {"type": "SelfChecks", "failed": {}}} if "self" in label else status
        )
    )
    buffers = Buffers()
    with CaptureSession("decode", fd_config=config, link=link):
        capture_all(backend, buffers)
    shared = [status["payload"] for label, status in link.posted if label.startswith("self-check")]
    messages = [m for payload in shared for m in payload["failed"].values()]
    assert [m.split(": ")[0] for m in messages] == [f"decode size {n}" for n in (4, 2, 1)]
    assert all(": output 0 differs (max abs difference" in m for m in messages)
    assert [served_by(backend, buffers.step(n))[1] for n in (4, 2, 1)] == [None, None, None]


def test_counters_can_be_read_by_another_thread_while_serving_inserts_new_keys(sim, tmp_path):
    """The stats thread and the metrics publisher read while the serving thread counts; a read
    that iterates a dict the server grows dies with 'dictionary changed size during iteration'."""
    import sys
    import threading

    backend, _ = backend_for()
    buffers = Buffers(4096)
    capture_all(backend, buffers)
    for tokens in (3, 4, 1):  # replayed steps: the readers merge these with the eager ones
        backend(**buffers.step(tokens))
    writer = observability.StatsFile(
        str(tmp_path / "stats.jsonl"), backend.settings, process.current().outputs
    )
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                backend.stats()
                backend.observed_keys()
                observability.aggregate(process.current())
                writer.flush(backend)
        except BaseException as error:  # the failure under test
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for tokens in range(5, 4000):  # every oversized count is a new key
            backend(**buffers.step(tokens))
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert errors == []


@pytest.mark.parametrize("speculative", [False, True], ids=["tokens", "running requests"])
def test_steps_fastdeploy_runs_above_the_largest_graph_are_counted_and_reach_tune(
    plugin_registered, monkeypatch, tmp_path, speculative
):
    """FastDeploy's GraphOptBackend runs a decode step above its largest graph eagerly without
    calling the backend (2.4 through develop): counted all the same, by reason, in stats(), the
    exit table and the stats file, whose eager_above_largest tune adds to the histogram."""
    from conftest import DecoratedBackbone
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin.tools.traces import read_histogram

    path = tmp_path / "stats-{rank}.jsonl"
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(path))
    spec = {"method": "mtp", "num_speculative_tokens": 1} if speculative else None
    config = make_config(8, speculative=spec, cudagraph_capture_sizes=[4, 2])
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    before = backend.stats()["eager_fallbacks"].get("oversized_decode", 0)
    backend.flush_stats()  # the profile run's steps
    written = tmp_path / "stats-0.jsonl"
    lines = written.read_text().count("\n") if written.exists() else 0
    per_request = 2 if speculative else 1  # MTP (k = 1) scales the sizes: [8, 4] tokens
    for requests in (2, 6, 8, 4):
        runner.execute_step(per_request * requests)
    assert backend.stats()["eager_fallbacks"].get("oversized_decode") == before + 2
    assert "oversized decode" in observability.format_table(backend.stats(), "target")
    backend.flush_stats()
    (line,) = [json.loads(t) for t in (tmp_path / "stats-0.jsonl").read_text().splitlines()[lines:]]
    assert line["eager_above_largest"] == {"6": 1, "8": 1}  # tokens, or running requests
    assert (
        sum(line["eager_above_largest"].values())
        + sum(line["decode_token_counts" if not speculative else "running_request_counts"].values())
        == 4
    )
    histogram = read_histogram([tmp_path / "stats-0.jsonl"])
    assert histogram.eager_recorded
