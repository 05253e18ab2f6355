"""Graph memory inside FastDeploy's KV-cache budget: the figures after capture, the advice after
an out-of-memory, and FD_CUDAGRAPH_KV_RESERVE with its record (simulated device memory).

The stand-in's ``GpuWorker.determine_available_memory()`` does upstream's arithmetic on the
simulated runtime's device: ``total * gpu_memory_utilization - used after the profile run + the
profile KV cache``; the KV cache is then allocated and ``capture_model()`` runs, as in
``worker_process``. Each graph here costs 20 MiB (``graph_overhead``), as scratch memory would.
"""

from __future__ import annotations

import json
import logging

import pytest
from conftest import DecoratedMixing, make_config
from fastdeploy.worker.gpu_model_runner import GPUModelRunner
from fastdeploy.worker.gpu_worker import GpuWorker, initialize_kv_cache

from fd_cudagraph_plugin.core import budget, process, reserve
from fd_cudagraph_plugin.core.errors import CaptureError, ConfigError, human_bytes
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.ranks.messages import RankMemory

MiB = 1 << 20
GRAPH = 20 * MiB
WEIGHTS = 100 * MiB


@pytest.fixture
def device(plugin_registered, monkeypatch, tmp_path):
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path))  # the record lives here
    return _device(plugin_registered)


def _device(sim):
    sim.device_total = 1024 * MiB
    sim.graph_overhead = GRAPH
    sim.allocate(WEIGHTS)
    return sim


def start(utilization: float, sizes=(8, 4, 2, 1), **graph_args):
    """One worker's start: memory profile, KV cache, capture_model()."""
    config = make_config(8, cudagraph_capture_sizes=list(sizes), **graph_args)
    config.cache_config.gpu_memory_utilization = utilization
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    gpu = GpuWorker(config, runner)
    blocks = initialize_kv_cache(gpu)
    runner.capture_model()
    return model.graph_opt_backend.cudagraph_piecewise_backend, blocks


def restart(sim):
    """A new process: a fresh worker, runtime and device; the record on disk kept."""
    from simulated import TestRuntime

    from fd_cudagraph_plugin.core import runtime

    for backend in process.current().backends():
        backend.clear_graph()
    process.reset_for_tests()
    fresh = _device(TestRuntime())
    fresh.first_capture_keeps = sim.first_capture_keeps
    runtime.install_runtime(fresh)
    return fresh


@pytest.mark.parametrize(
    ("utilization", "free_gib", "fit"),
    [(0.90, 10.0, 0.9999), (0.90, 3.0, 0.925), (0.90, 0.5, 0.8937), (0.50, 1.0, 0.5)],
)
def test_the_highest_utilization_that_fits_keeps_the_margin_free(utilization, free_gib, fit):
    total = 80 << 30
    assert budget.margin(total) == 1 << 30
    assert budget.fit_utilization(utilization, int(free_gib * (1 << 30)), total) == fit


def test_the_memory_line_names_the_tightest_rank():
    ranks = [
        RankMemory(0, 100 * MiB, 0, 9 << 30, 80 << 30, 0.9),
        RankMemory(1, 100 * MiB, 0, 5 << 30, 80 << 30, 0.9),
    ]
    line = budget.memory_line(ranks, rank=0)
    assert line == (
        "5.0 GiB of 80.0 GiB free after capture (tightest: rank 1); gpu_memory_utilization up "
        "to 0.95 would fit (now 0.9, keeping 1.0 GiB free)"
    )


def test_after_capture_the_summary_says_where_the_memory_went_and_what_would_fit(device, caplog):
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        backend, _ = start(0.80)
    report = backend.capture_report
    (mine,) = report.memory
    assert mine.graph_bytes == 4 * GRAPH + sum(s * 8 * 4 for s in (8, 4, 2, 1))
    free, total = device.device_memory()
    assert (mine.free, mine.total) == (free, total)
    fit = budget.fit_utilization(0.80, free, total)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("captured")]
    assert summary[0].endswith(
        f"gpu_memory_utilization up to {budget.share(fit)} would fit "
        "(now 0.8, keeping 51.2 MiB free)"
    )
    # Applied at the next start, the advice leaves the margin free, to within a block.
    device = restart(device)
    backend, _ = start(fit)
    free_after, _ = device.device_memory()
    # Four decimals of the device (0.1 MiB here) plus one KV block.
    assert abs(free_after - budget.margin(total)) <= 4 * MiB


@pytest.mark.parametrize(
    ("utilization", "size", "done", "advice"),
    [
        (0.99, 8, "Out of memory before the first of 4 graphs, with 11.0 MiB", "below 0.94"),
        (0.98, 4, "Out of memory after 1 of 4 graphs, which took 20.0 MiB, with 1023", "to 0.87"),
        (0.95, 2, "Out of memory after 2 of 4 graphs, which took 40.0 MiB, with 12.0", "to 0.87"),
    ],
)
def test_at_a_high_utilization_fastdeploys_flow_runs_out_of_memory_in_capture(
    device, utilization, size, done, advice
):
    with pytest.raises(CaptureError) as raised:
        start(utilization)
    message = str(raised.value)
    assert f"capture failed for decode size {size}" in message
    assert done in message and f"Lower --gpu-memory-utilization {advice}" in message
    assert "FD_CUDAGRAPH_KV_RESERVE=auto" in message


def test_the_advice_after_an_out_of_memory_fits_when_applied(device):
    with pytest.raises(CaptureError):
        start(0.95)
    restart(device)
    backend, _ = start(0.87)  # what the advice said
    backend.check_capture_successful()


def test_auto_reserves_a_probes_estimate_then_the_record_and_every_graph_fits(
    device, caplog, monkeypatch
):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        backend, blocks = start(0.98)  # first start: no record, a probe
    reserved = backend.stats()["memory"]
    assert reserved["kv_reserve_bytes"] == GRAPH + 3 * (GRAPH + 2 * 8 * 4) + 8 * 8 * 4
    assert (
        "no record yet; estimated from a probe capture of sizes [8, 2, 1]"
        in (reserved["kv_reserve_source"])
    )
    assert backend.captures == 4 + 3  # the probe's three, released, and the four served
    backend.check_capture_successful()
    free, total = device.device_memory()
    assert free >= 0 and total - free <= total * 0.98 + MiB  # within FastDeploy's budget
    assert any("the KV cache may take" in r.getMessage() for r in caplog.records)

    taken = backend.capture_report.graph_bytes
    restart(device)
    backend, second = start(0.98)  # second start: the record
    reserved = backend.stats()["memory"]
    assert reserved["kv_reserve_bytes"] == taken
    assert "measured at the start of" in reserved["kv_reserve_source"]
    assert backend.captures == 4  # no probe
    assert second >= blocks  # the record is no larger than the probe's estimate


@pytest.mark.parametrize("first", ["off", "auto"])
def test_the_record_holds_what_the_session_took_beside_the_graphs_and_the_next_start_fits(
    device, monkeypatch, first
):
    # On an H200 (benchmarks/gpu/bench_budget.py) the first capture's library workspaces and
    # the warm-ups' cached blocks took 154 MiB beside 108 MiB of graphs; a record of the graphs
    # alone ran the next start out of memory. With a probe (auto), part of it was taken before
    # the capture the record measures.
    kept = 30 * MiB  # more than the 20.5 MiB that 0.98 leaves outside the KV cache
    device.first_capture_keeps = kept
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", first)
    backend, _ = start(0.80 if first == "off" else 0.98)
    graphs = backend.capture_report.graph_bytes
    if first == "auto":  # the probe's estimate counts what its session took beside its graphs
        reserved = backend.stats()["memory"]
        assert reserved["kv_reserve_bytes"] == kept + GRAPH + 3 * (GRAPH + 2 * 8 * 4) + 8 * 8 * 4
        assert "30.0 MiB beside the graphs" in reserved["kv_reserve_source"]
    assert graphs == 4 * GRAPH + sum(s * 8 * 4 for s in (8, 4, 2, 1))
    restart(device)
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    backend, _ = start(0.98)
    assert backend.stats()["memory"]["kv_reserve_bytes"] == graphs + kept
    assert f"{human_bytes(graphs + kept)} taken in all; " in backend.capture_report.summary()
    backend.check_capture_successful()
    assert backend.captures == 4


def test_a_changed_plan_does_not_reuse_a_stale_figure(device, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    _backend, _ = start(0.95)
    restart(device)
    backend, _ = start(0.95, sizes=(8, 4, 2))  # another plan: probe again, not the record
    assert "estimated from a probe" in backend.stats()["memory"]["kv_reserve_source"]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "something else"})])
def test_a_corrupt_record_is_treated_as_missing_and_said(device, monkeypatch, tmp_path, content):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path))
    path = reserve.Record.for_rank(str(tmp_path), 0, 0).path
    import os

    os.makedirs(os.path.dirname(path))
    with open(path, "w") as handle:
        handle.write(content)
    backend, _ = start(0.95)
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert path in source and "estimated from a probe" in source
    backend.check_capture_successful()
    with open(path) as handle:
        assert json.load(handle)["format"] == reserve.RECORD_FORMAT  # rewritten


def test_an_explicit_size_takes_exactly_that_out_of_the_kv_cache(device, monkeypatch):
    _backend, blocks = start(0.90)
    restart(device)
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "64MiB")
    backend, fewer = start(0.90)
    assert blocks - fewer == 64  # 1 MiB blocks
    assert backend.stats()["memory"]["kv_reserve_source"] == "FD_CUDAGRAPH_KV_RESERVE=64.0 MiB"


def test_a_short_reserve_is_said_after_capture(device, monkeypatch, caplog):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "10MiB")
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        start(0.80)
    (warning,) = [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()]
    assert (
        "reserved 10.0 MiB (FD_CUDAGRAPH_KV_RESERVE=10.0 MiB)" in warning
        and "too little" in warning
    )


def test_without_a_profile_run_the_reserve_only_reports(device, monkeypatch, caplog):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    config = make_config(8, cudagraph_capture_sizes=[8, 4, 2, 1])
    config.cache_config.num_gpu_blocks_override = 100
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()  # FastDeploy still builds the backends; no memory profile follows
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        assert initialize_kv_cache(GpuWorker(config, runner)) == 100
        runner.capture_model()
    assert (
        model.graph_opt_backend.cudagraph_piecewise_backend.stats()["memory"]["kv_reserve_bytes"]
        is None
    )
    assert any("num_gpu_blocks_override" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("lots", "must be off, auto, or a size"),
        ("-2GiB", "must be off, auto, or a size"),
        ("2TiB", "at most 1 TiB"),
        ("nanGiB", "must be off, auto, or a size"),
        ("1e400GiB", "no exponent"),
        ("1e3MiB", "no exponent"),  # 1000 MiB before, where FD_CUDAGRAPH_RANK_TIMEOUT=1e3 failed
        (".5GiB", "ASCII digits"),
        ("1_024MiB", "ASCII digits"),
        ("2 parsecs", "'parsecs' is no unit"),
        # Before: a bare number meant bytes, and what rounded to 0 bytes was taken as 0.
        ("2", "needs its unit"),
        ("0", "needs its unit"),
        ("0.5", "needs its unit"),
        ("0.4b", "below 1 MiB"),
        ("0.0001KiB", "below 1 MiB"),
        ("0.000000001GiB", "below 1 MiB"),  # one byte: accepted before
        ("1023KiB", "below 1 MiB"),
    ],
)
def test_a_bad_reserve_is_refused_naming_the_setting_and_why(monkeypatch, value, why):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", value)
    with pytest.raises(ConfigError, match=rf"FD_CUDAGRAPH_KV_RESERVE=.*{why}.*Fix or unset"):
        PluginOptions.from_env()


@pytest.mark.parametrize(
    ("value", "nbytes", "read"),
    [
        ("1TiB", 1 << 40, "1.00 TiB, 1099511627776 bytes"),  # refused before: no TiB unit
        ("2GiB", 2 << 30, "2.00 GiB, 2147483648 bytes"),
        ("1.5GB", 1_500_000_000, "1.40 GiB, 1500000000 bytes"),
        ("512 mib", 512 << 20, "512.00 MiB, 536870912 bytes"),
        ("1048576B", 1 << 20, "1.00 MiB, 1048576 bytes"),
    ],
)
def test_a_reserve_size_is_read_with_its_unit_and_doctor_shows_how(
    monkeypatch, value, nbytes, read
):
    from fd_cudagraph_plugin.tools import doctor

    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", value)
    assert PluginOptions.from_env().kv_reserve == nbytes
    result = doctor.check_options({"FD_CUDAGRAPH_KV_RESERVE": value})
    assert result.status == doctor.OK
    assert f"FD_CUDAGRAPH_KV_RESERVE={value} (read as {read})" in result.detail


def _record_entry(tmp_path, **entry) -> str:
    """Write a record whose one plan is this start's, with ``entry`` as its figures."""
    path = reserve.Record.for_rank(str(tmp_path), 0, 0).path
    with open(path) as handle:
        data = json.load(handle)
    (key,) = data["plans"]
    data["plans"][key].update(entry)
    with open(path, "w") as handle:
        json.dump(data, handle)
    return path


@pytest.mark.parametrize(
    "entry",
    [
        {"time": "yesterday"},
        {"time": 1e20},
        {"time": float("nan")},
        {"bytes": 2**62},
        {"bytes": 1},  # below the graphs' own figure
        {"bytes": True},
        {"graph_bytes": "x"},
    ],
    ids=[
        "time-string",
        "time-1e20",
        "time-nan",
        "bytes-2**62",
        "bytes-below-graphs",
        "bool",
        "str",
    ],
)
def test_a_worker_starts_with_a_bad_record_and_says_why_it_ignored_it(
    device, monkeypatch, tmp_path, entry
):
    # Each of these made every start fail inside determine_available_memory (time.localtime of
    # a string, 1e20 or NaN) or sized the KV budget from nonsense (a negative budget at 2**62).
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    start(0.95)
    device = restart(device)
    path = _record_entry(tmp_path, **entry)
    backend, _ = start(0.95)
    backend.check_capture_successful()
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert f"the record {path} has a bad entry for this plan" in source
    assert "estimated from a probe" in source


def test_a_record_that_is_not_a_regular_file_or_too_long_is_ignored(device, monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    path = reserve.Record.for_rank(str(tmp_path), 0, 0).path
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as handle:
        handle.write(" " * (reserve.MAX_RECORD_BYTES + 1))
    backend, _ = start(0.95)
    backend.check_capture_successful()
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert f"longer than {reserve.MAX_RECORD_BYTES} bytes" in source


def test_a_recorded_figure_that_ran_out_of_memory_is_dropped_and_the_next_start_fits(
    device, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    start(0.95)
    device = restart(device)
    _record_entry(tmp_path, bytes=GRAPH, graph_bytes=GRAPH)  # far too low, but self-consistent
    with pytest.raises(CaptureError) as raised, caplog.at_level(logging.WARNING):
        start(0.98)
    message = str(raised.value)
    assert "(FD_CUDAGRAPH_KV_RESERVE=auto reserved 20.0 MiB, which was too little" in message
    assert "set FD_CUDAGRAPH_KV_RESERVE=auto" not in message  # it is set
    assert any("that figure is dropped" in r.getMessage() for r in caplog.records)
    restart(device)
    backend, _ = start(0.98)  # no record of this plan now: a probe, and every graph fits
    assert "estimated from a probe" in backend.stats()["memory"]["kv_reserve_source"]
    backend.check_capture_successful()


def test_the_record_is_written_through_a_fresh_file_and_never_through_a_planted_link(
    device, monkeypatch, tmp_path
):
    import os

    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    path = reserve.Record.for_rank(str(tmp_path), 0, 0).path
    os.makedirs(os.path.dirname(path))
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    # The old name of the temporary file, planted as a link to another file.
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    start(0.95)
    assert victim.read_text() == "untouched"
    with open(path) as handle:
        assert json.load(handle)["format"] == reserve.RECORD_FORMAT
    assert not os.path.islink(path)


def test_a_record_that_cannot_be_keyed_or_written_never_fails_the_capture(
    device, monkeypatch, failures
):
    # On the GPU harness the stand-in paddle had no __version__: the record's key raised out of
    # capture_model() after every graph was captured.
    def broken() -> str:
        raise AttributeError("module 'paddle' has no attribute '__version__'")

    monkeypatch.setattr(device, "device_name", broken)
    backend, _ = start(0.80)
    backend.check_capture_successful()
    assert failures["reserve"] == 1


@pytest.mark.parametrize(
    ("reserve", "says"),
    [
        (budget.Reserve(budget.Choice.OFF), "set FD_CUDAGRAPH_KV_RESERVE=auto so the KV cache"),
        (
            budget.Reserve(budget.Choice.AUTO, 20 * MiB),
            "FD_CUDAGRAPH_KV_RESERVE=auto reserved 20.0 MiB, which was too little: its recorded "
            "figure is dropped",
        ),
        (
            budget.Reserve(budget.Choice.SIZE, 2 << 30),
            "raise FD_CUDAGRAPH_KV_RESERVE (FD_CUDAGRAPH_KV_RESERVE=2.0 GiB reserved 2.0 GiB",
        ),
    ],
    ids=["off", "auto", "a size"],
)
def test_the_out_of_memory_advice_never_asks_for_the_reserve_already_set(reserve, says):
    advice = budget.oom_advice(40 * MiB, 2, 4, 12 * MiB, 1024 * MiB, 0.95, reserve)
    assert says in advice
    if reserve.choice is not budget.Choice.OFF:
        assert "set FD_CUDAGRAPH_KV_RESERVE=auto" not in advice


def test_a_record_that_cannot_be_looked_up_is_treated_as_missing(device, monkeypatch):
    # Before the ranks agree whether to probe, nothing local to one rank may raise: its peers
    # would wait for it at the point, then in FastDeploy's all-reduce of the KV blocks.
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")

    def broken() -> str:
        raise RuntimeError("no device name")

    monkeypatch.setattr(device, "device_name", broken)
    backend, _ = start(0.95)
    backend.check_capture_successful()
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert "the record could not be looked up (no device name)" in source


@pytest.mark.parametrize(
    "recorded", [1024 * MiB, 900 * MiB], ids=["the device", "900 MiB of 1 GiB"]
)
def test_a_recorded_figure_the_kv_budget_cannot_give_is_dropped_and_the_start_probes(
    device, monkeypatch, tmp_path, caplog, recorded
):
    # Before: it passed the record's checks and left FastDeploy a negative KV block count
    # ("Not enough memory for the KV cache: -152 blocks"); the start never reached capture, so
    # the record was never rewritten, and every later start failed the same way.
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    start(0.95)
    device = restart(device)
    path = _record_entry(tmp_path, bytes=recorded, graph_bytes=GRAPH)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend, blocks = start(0.95)
    backend.check_capture_successful()
    assert blocks > 0
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert f"the record {path} holds" in source and "estimated from a probe" in source
    said = [r.getMessage() for r in caplog.records]
    (warning,) = [m for m in said if m.startswith("FD_CUDAGRAPH_KV_RESERVE=auto: the record")]
    assert path in warning and "the KV budget leaves now; dropped" in warning


def test_a_start_that_took_a_recorded_figure_and_never_captured_marks_it_not_to_be_taken_again(
    device, monkeypatch, tmp_path
):
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    start(0.95)  # measures and records
    device = restart(device)
    config = make_config(8, cudagraph_capture_sizes=[8, 4, 2, 1])
    config.cache_config.gpu_memory_utilization = 0.95
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    initialize_kv_cache(GpuWorker(config, runner))  # takes the record's figure ...
    taken = model.graph_opt_backend.cudagraph_piecewise_backend  # ... and the start dies here
    assert taken.captures == 0
    device = restart(device)
    backend, _ = start(0.95)
    source = backend.stats()["memory"]["kv_reserve_source"]
    assert "a start took this figure and never finished capturing with it" in source
    assert "estimated from a probe" in source
    restart(device)
    backend, _ = start(0.95)  # the probed start's capture wrote the record anew: taken again
    assert "measured at the start of" in backend.stats()["memory"]["kv_reserve_source"]
