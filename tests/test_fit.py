"""The fit of capture sizes to served steps: exact against brute force, within the budget,
FastDeploy's largest size always kept, FastDeploy's list where the traffic says too little."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections import Counter

import paddle
import pytest
from prometheus_client import REGISTRY

from fd_cudagraph_plugin.core import observability, process
from fd_cudagraph_plugin.core.fit import MIN_STEPS, Budget, fit, padded
from fd_cudagraph_plugin.core.reserve import Record, record_key
from fd_cudagraph_plugin.core.sizes import padding_table

#: FastDeploy develop's automatic list for max_num_seqs 64.
DEFAULT = [64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]


def _brute(histogram, sizes, count, unit):
    top = max(sizes)
    rest = [s for s in sizes if s != top]
    options = ((top, *chosen) for c in range(count) for chosen in itertools.combinations(rest, c))
    return min(padded(option, histogram, unit) for option in options)


@pytest.mark.parametrize("seed", range(40))
def test_the_fit_is_the_least_padding_any_subset_with_the_largest_gets(seed):
    rng = random.Random(seed)
    sizes = sorted(rng.sample(range(1, 80), rng.randint(2, 9)))
    unit = rng.choice([1, 2, 3])
    histogram = {rng.randint(1, max(sizes)): rng.randint(1, 200) for _ in range(rng.randint(1, 30))}
    histogram[1] = histogram.get(1, 0) + MIN_STEPS  # enough traffic to fit
    for count in range(1, len(sizes) + 1):
        got = fit(histogram, sizes, Budget(graphs=count), unit)
        assert max(sizes) in got.sizes and len(got.sizes) <= count
        assert set(got.sizes) <= set(sizes)
        assert got.padded == padded(got.sizes, histogram, unit)
        assert got.padded == _brute(histogram, sizes, count, unit), (sizes, histogram, count)


@pytest.mark.parametrize("percent", [0, 5, 50])
def test_a_padding_budget_takes_the_fewest_sizes_within_it(percent):
    rng = random.Random(percent)
    histogram = {rng.choice([1, 2, 3, 5, 9, 17, 33, 60]): rng.randint(1, 100) for _ in range(60)}
    histogram[3] = histogram.get(3, 0) + MIN_STEPS
    got = fit(histogram, DEFAULT, Budget(padding=percent))
    allowed = padded(DEFAULT, histogram) * (1 + percent / 100)
    assert got.padded <= allowed and got.padded_default == padded(DEFAULT, histogram)
    fewer = (
        fit(histogram, DEFAULT, Budget(graphs=len(got.sizes) - 1)) if len(got.sizes) > 1 else None
    )
    assert fewer is None or fewer.padded > allowed  # one size fewer would break the budget


def test_too_little_traffic_keeps_fastdeploys_list():
    got = fit({3: MIN_STEPS - 1}, DEFAULT, Budget(graphs=2))
    assert got.sizes == tuple(DEFAULT) and "fewer than" in got.why
    got = fit({3: MIN_STEPS}, DEFAULT, Budget(graphs=2))
    assert got.sizes == (64, 4) and not got.why


def test_steps_above_the_largest_are_left_to_fastdeploy():
    got = fit({3: MIN_STEPS, 100: 10_000}, DEFAULT, Budget(graphs=1))
    assert got.sizes == (64,) and got.steps == MIN_STEPS


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("off", None),
        ("graphs:8", Budget(graphs=8)),
        ("padding:10", Budget(padding=10.0)),
        ("padding:0.5", Budget(padding=0.5)),
    ],
)
def test_the_budget_reads_what_the_option_takes(text, budget):
    assert Budget.parse(text) == budget


@pytest.mark.parametrize(
    "text",
    [
        "",
        "on",
        "graphs:0",
        "graphs:513",
        "graphs:-1",
        "graphs:٣",
        "padding:-1",
        "padding:1e3",
        "padding:nan",
        "padding:1001",
        "padding:",
        "graphs",
    ],
)
def test_a_bad_budget_is_refused(text):
    with pytest.raises(ValueError, match="graphs:N"):
        Budget.parse(text)


# ---------------------------------------------------------------- through FastDeploy's runner


def _served(runner, target, counts: dict[int, int]) -> None:
    """Serve decode steps of these token counts through the runner, each equal to eager at
    the size its graph pads to."""
    for tokens, times in counts.items():
        for _ in range(times):
            out = runner.execute_step(tokens)
            size = backend_of(target).mode.decode_table[tokens]
            view = runner.share_inputs["ids"][:size]
            eager = target.forward(ids_remove_padding=view, forward_meta=None)[:tokens]
            assert paddle.allclose(out, eager).item(), tokens


def backend_of(model):
    return model.graph_opt_backend.cudagraph_piecewise_backend


def _runner(max_num_seqs: int = 64):
    from conftest import DecoratedMixing, make_config
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    config = make_config(max_num_seqs, dynamic_load_weight=True)
    target = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, target)
    runner.profile_run()
    runner.update_share_input_block_num(num_gpu_blocks=4)
    runner.capture_model()
    return runner, target


@pytest.mark.parametrize("fd_version", ["2.5", "2.6", "develop"], indirect=True)
def test_a_recapture_after_a_weight_update_captures_the_sizes_the_traffic_used(
    fd_version, monkeypatch, sim, caplog
):
    from fd_cudagraph_plugin import plugin

    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:3")
    monkeypatch.setenv("FD_CUDAGRAPH_METRICS", "1")
    plugin.register()
    runner, target = _runner()
    backend = backend_of(target)
    default = list(backend.settings.capture_sizes)
    assert default == DEFAULT and backend.capture_report.graphs == len(DEFAULT)  # nothing served
    traffic = {3: 200, 5: 100, 17: 50, 40: 10}
    _served(runner, target, traffic)
    runner.sleep("weight")
    caplog.set_level("INFO", logger="fd_cudagraph_plugin")
    runner.wakeup("weight")  # capture_model() again: the loop visits the fitted sizes only
    fitted = fit(traffic, DEFAULT, Budget(graphs=3))
    assert len(fitted.sizes) == 3 and fitted.sizes[0] == 64
    assert backend.capture_report.graphs == 3 and sorted(backend.table.decode) == sorted(
        fitted.sizes
    )
    assert runner.cudagraph_capture_sizes == sorted(DEFAULT)  # FastDeploy's list put back
    said = f"decode sizes {', '.join(map(str, fitted.sizes))}: 3 of FastDeploy's 11 fitted to the "
    said += f"360 decode steps before, {fitted.padded} padded tokens on them against "
    said += f"{fitted.padded_default} with all 11"
    assert any(said in r.getMessage() for r in caplog.records)
    before = backend.stats()
    later = {3: 5, 5: 5, 9: 2, 64: 1}
    _served(runner, target, later)  # every step pads to a size kept, never eager
    stats = backend.stats()
    assert stats["eager_fallbacks"] == before["eager_fallbacks"]
    theirs, ours = padding_table(DEFAULT), padding_table(fitted.sizes)
    past = Counter(before["padded_past_fastdeploy"])
    for tokens, n in later.items():
        if theirs[tokens] != ours[tokens]:
            past[theirs[tokens]] += n
    assert past and stats["padded_past_fastdeploy"] == dict(past)
    # The same counts in the periodic stats line's totals and in the metrics, by size.
    worker = process.current()
    assert observability.aggregate(worker)["padded_past_fastdeploy"] == dict(sorted(past.items()))
    observability.publish_metrics(worker)
    labels = {"rank": "0", "dp_rank": "0", "role": "target"}
    try:
        for size, n in past.items():
            name = "fd_cudagraph_padded_past_fastdeploy_steps_total"
            assert REGISTRY.get_sample_value(name, {**labels, "size": str(size)}) == n
    finally:
        observability.disable()
    # The graph-memory record a start reserves from holds the start's whole list, not the fit.
    record = Record.of(backend.settings)
    plans, problem = record.load()
    assert problem is None and plans[record_key([backend], "decode")]["plan"]["graphs"] == 11
    # The next recapture with no traffic since keeps FastDeploy's list.
    runner.sleep("weight")
    runner.wakeup("weight")
    assert backend.capture_report.graphs == len(DEFAULT)


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_with_the_option_off_a_recapture_makes_fastdeploys_whole_list(
    fd_version, plugin_registered
):
    runner, target = _runner()
    _served(runner, target, {3: 400})
    runner.sleep("weight")
    runner.wakeup("weight")
    assert backend_of(target).capture_report.graphs == len(DEFAULT)


@pytest.mark.parametrize("fd_version", ["2.6", "develop"], indirect=True)
def test_target_and_draft_capture_one_fitted_list_under_mtp(
    fd_version, monkeypatch, sim, recording_ar
):
    """Keys are running requests: a size of c tokens holds c / (k + 1) of them. The draft is
    captured in the target's loop, so both adopt the one list; serving stays equal to eager."""
    from conftest import DecoratedDraft, DecoratedMixing, make_config
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin import plugin

    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:2")
    plugin.register()
    mtp = {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1}
    config = make_config(
        16, speculative=mtp, dynamic_load_weight=True, draft_model_use_cudagraph=True
    )
    target, draft = DecoratedMixing(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    runner.update_share_input_block_num(num_gpu_blocks=4)
    runner.capture_model()
    default = list(backend_of(target).settings.capture_sizes)
    for tokens in [2] * 200 + [6] * 100:  # 1 and 3 requests of 2 tokens each
        runner.execute_step(tokens)
    runner.sleep("weight")
    runner.wakeup("weight")
    sizes = sorted(backend_of(target).table.decode, reverse=True)
    assert len(sizes) == 2 and sizes[0] == max(default) and set(sizes) < set(default)
    assert sorted(backend_of(draft).table.decode, reverse=True) == sizes
    assert backend_of(draft).capture_report.graphs == 2 + 2
    eager_before = dict(backend_of(target).stats()["eager_fallbacks"])
    for tokens in (2, 4, 6, 10):
        out = runner.execute_step(tokens)
        size = backend_of(target).mode.key_table[tokens // 2]
        view = runner.share_inputs["ids"][:size]
        eager = target.forward(ids_remove_padding=view, forward_meta=None)[:tokens]
        assert paddle.allclose(out, eager).item(), tokens
    assert backend_of(target).stats()["eager_fallbacks"] == eager_before
    assert recording_ar.stale_replays == 0 and recording_ar.garbage == 0


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_a_start_fits_to_the_same_plans_recorded_traffic_and_never_to_another_plans(
    fd_version, monkeypatch, sim, tmp_path
):
    from fd_cudagraph_plugin import plugin

    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:3")
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(stats))
    plugin.register()
    runner, target = _runner()
    assert backend_of(target).capture_report.graphs == len(DEFAULT)  # nothing recorded yet
    traffic = {3: 200, 5: 100, 17: 50, 40: 10}
    _served(runner, target, traffic)
    backend_of(target).flush_stats()
    # Lines that are not well formed, or of another rank, cost only themselves.
    with stats.open("a") as out:
        out.write('[1, 2]\n{"plan": 5}\nnot json\n')
        line = json.loads(stats.read_text().splitlines()[0])
        out.write(json.dumps({**line, "rank": 1, "decode_token_counts": {"40": 10**6}}) + "\n")
        out.write(json.dumps({**line, "decode_token_counts": {"99999999": 5, "4": -3}}) + "\n")

    process.reset_for_tests()  # the same deployment starts again
    runner, target = _runner()
    fitted = fit(traffic, DEFAULT, Budget(graphs=3))
    assert sorted(backend_of(target).table.decode, reverse=True) == list(fitted.sizes)
    _served(runner, target, {3: 3, 9: 2})

    process.reset_for_tests()  # another plan (max_num_seqs 32: another capture list)
    runner, target = _runner(32)
    backend = backend_of(target)
    assert backend.capture_report.graphs == len(backend.settings.capture_sizes)


def test_a_rank_that_cannot_take_rank_zeros_fit_fails_the_session(monkeypatch, sim):
    """Rank 0's list is not FastDeploy's sizes here (a peer's bytes are untrusted): the session
    fails with RankMismatchError before any capture, as a plan mismatch does."""
    import copy

    from conftest import PeerLink, TinyBackbone, make_config

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend
    from fd_cudagraph_plugin.core.errors import RankMismatchError
    from fd_cudagraph_plugin.core.session import CaptureSession

    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:2")
    config = make_config(8, cudagraph_capture_sizes=[8, 4, 2, 1])
    model = TinyBackbone()
    CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)

    def rank_zero(rank, label, status):
        if rank == 0 and label == "plan":
            status = copy.deepcopy(status)
            status["payload"]["fitted"] = [8, 5]
        return status

    session = CaptureSession("decode", fd_config=config, link=PeerLink(1, 2, rank_zero))
    with pytest.raises(RankMismatchError, match=r"rank 0 fitted the decode sizes \[8, 5\]"):
        session.__enter__()


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_backends_built_inside_the_capture_loop_take_no_fit_halfway(
    fd_version, monkeypatch, sim, tmp_path
):
    """Without a profile run the backends are built in FastDeploy's loop, after it began to walk
    its list: the plan is agreed there without a fit, and every size is captured and serves."""
    from conftest import DecoratedMixing, make_config
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin import plugin

    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:3")
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(tmp_path / "stats.jsonl"))
    plugin.register()
    runner, target = _runner()
    _served(runner, target, {3: 200, 5: 100, 17: 50, 40: 10})
    backend_of(target).flush_stats()
    process.reset_for_tests()  # a start with a record of the same plan, and no profile run
    config = make_config(64, dynamic_load_weight=True)
    target = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, target)
    runner.update_share_input_block_num(num_gpu_blocks=4)
    runner.capture_model()
    backend = backend_of(target)
    backend.check_capture_successful()
    assert sorted(backend.table.decode, reverse=True) == DEFAULT
    assert backend.capture_report.graphs == len(DEFAULT)


def test_a_stats_file_that_is_a_fifo_or_holds_a_deep_line_is_no_traffic(sim, tmp_path):
    from conftest import make_config

    from fd_cudagraph_plugin.core.observability import recorded_traffic
    from fd_cudagraph_plugin.core.settings import Settings

    settings = Settings.from_fd_config(make_config(64), process.current().options)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert recorded_traffic(str(fifo), settings, "target") == {}  # never blocks on a reader
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "\n")
    assert recorded_traffic(str(deep), settings, "target") == {}


def test_ranks_with_the_option_set_differently_plan_differently(monkeypatch, sim):
    """Whether a session fits is part of the plan the ranks compare: a rank with the option off
    never takes rank 0's fit silently (its loop would walk another list)."""
    import copy

    from conftest import PeerLink, TinyBackbone, make_config

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend
    from fd_cudagraph_plugin.core.errors import RankMismatchError
    from fd_cudagraph_plugin.core.session import CaptureSession

    config = make_config(8, cudagraph_capture_sizes=[8, 4, 2, 1])
    model = TinyBackbone()
    CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)

    def rank_zero(rank, label, status):
        if rank == 0 and label == "plan":
            status = copy.deepcopy(status)
            if "fit" in status["payload"]["plan"]:  # rank 0 runs with the option set
                status["payload"]["plan"]["fit"] = "graphs:2"
            status["payload"]["fitted"] = [8, 2]
        return status

    session = CaptureSession("decode", fd_config=config, link=PeerLink(1, 2, rank_zero))
    with pytest.raises(RankMismatchError, match="fit"):
        session.__enter__()
