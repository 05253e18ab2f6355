"""Output paths (memory report, stats file): checked at register() and by doctor, unique per
process under tensor and data parallelism, and a write that fails later never stops serving."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Buffers, TinyBackbone, make_config

from fd_cudagraph_plugin import plugin
from fd_cudagraph_plugin.core import observability, outputs, process, session
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools import doctor

PATH_OPTIONS = ("FD_CUDAGRAPH_MEMORY_REPORT", "FD_CUDAGRAPH_STATS_FILE")


@dataclass(frozen=True)
class Ranks:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1


@pytest.mark.parametrize(
    ("template", "ranks", "expected"),
    [
        ("/r/graphs.json", Ranks(), "/r/graphs.json"),
        ("/r/graphs-{rank}.json", Ranks(), "/r/graphs-0.json"),
        ("/r/graphs-{rank}.json", Ranks(tp_rank=1, tp_size=2), "/r/graphs-1.json"),
        ("/r/graphs.json", Ranks(tp_rank=1, tp_size=2), "/r/graphs.tp1.json"),
        # {rank} alone is not enough under DP: replicas share TP rank numbers.
        ("/r/graphs-{rank}.json", Ranks(1, 2, 3, 4), "/r/graphs-1.dp3.json"),
        ("/r/graphs.json", Ranks(1, 2, 3, 4), "/r/graphs.dp3.tp1.json"),
        ("/r/dp{dp_rank}/graphs-{rank}.json", Ranks(1, 2, 3, 4), "/r/dp3/graphs-1.json"),
        ("/r/stats-{dp_rank}", Ranks(0, 1, 2, 4), "/r/stats-2"),
        ("/r/stats", Ranks(0, 1, 2, 4), "/r/stats.dp2"),
    ],
)
def test_output_path_is_unique_per_process_of_the_deployment(template, ranks, expected):
    assert outputs.output_path(template, ranks) == expected


def test_every_process_of_a_dp_tp_deployment_gets_its_own_file():
    deployment = [Ranks(t, 2, d, 4) for d in range(4) for t in range(2)]
    for template in ("/r/g.json", "/r/g-{rank}.json", "/r/g-{dp_rank}.json"):
        paths = {outputs.output_path(template, ranks) for ranks in deployment}
        assert len(paths) == len(deployment), template


def test_settings_read_fastdeploys_data_parallel_rank(sim):
    config = make_config(8, tp=2)
    config.parallel_config.tensor_parallel_rank = 1
    config.parallel_config.data_parallel_size = 4
    config.parallel_config.data_parallel_rank = 3
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    settings = backend.settings
    assert (settings.tp_rank, settings.tp_size, settings.dp_rank, settings.dp_size) == (1, 2, 3, 4)


def test_memory_report_and_stats_file_of_a_dp_replica_carry_its_rank(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("FD_CUDAGRAPH_MEMORY_REPORT", str(tmp_path / "graphs-{rank}.json"))
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(tmp_path / "stats-{dp_rank}.jsonl"))
    config = make_config(4, cudagraph_capture_sizes=[4, 2, 1])
    config.parallel_config.data_parallel_size = 2
    config.parallel_config.data_parallel_rank = 1
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with session.CaptureSession("decode", fd_config=config):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    backend(**buffers.step(3))
    backend.flush_stats()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graphs-0.dp1.json", "stats-1.jsonl"]


def _bad_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Case -> (path, what the error says)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "proc": ("/proc/x.json", "is under /proc, the kernel's own files"),
        "a read-only file under /proc": ("/proc/version", "is under /proc"),
        "a device": ("/dev/full", "is under /dev"),
        "directory": (str(tmp_path), "is a directory"),
        "trailing slash": (str(tmp_path / "new") + "/", "names a directory"),
        "parent is a file": (str(a_file / "x.json"), f"{a_file} is a file"),
        # Over NAME_MAX (255 bytes): the plugin started and every write failed, counted.
        "file name too long": (
            str(tmp_path / ("s" * 300)),
            "the name 'ssssssssssssssss...' is 300 bytes, longer than the 255 bytes",
        ),
        "directory name too long": (
            str(tmp_path / ("d" * 300) / "out.json"),
            "the name 'dddddddddddddddd...' is 300 bytes, longer than the 255 bytes",
        ),
        "path too long": (
            str(tmp_path.joinpath(*["p" * 250] * 17, "out.json")),
            "bytes, longer than the 4095 bytes this file system takes for a whole path",
        ),
    }


BAD_CASES = (
    "proc",
    "a read-only file under /proc",
    "a device",
    "directory",
    "trailing slash",
    "parent is a file",
    "file name too long",
    "directory name too long",
    "path too long",
)


@pytest.mark.parametrize("option", PATH_OPTIONS)
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_output_path_stops_register_naming_the_variable(monkeypatch, tmp_path, option, case):
    path, reason = _bad_paths(tmp_path)[case]
    monkeypatch.setenv(option, path)
    with pytest.raises(ConfigError, match=rf"^{option}=.*{reason}.*Fix or unset {option}\.$"):
        plugin.register()


@pytest.mark.parametrize("option", PATH_OPTIONS)
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_output_path_fails_doctor_naming_the_variable(tmp_path, option, case):
    """Once, on the options line, where register() refuses it."""
    path, reason = _bad_paths(tmp_path)[case]
    checks = {r.name: r for r in doctor.run_checks({option: path, "FD_LOG_DIR": str(tmp_path)})}
    failed = [checks[name] for name in ("options", "outputs") if checks[name].status == doctor.FAIL]
    assert len(failed) == 1 and failed[0].name == "options"
    assert option in failed[0].detail and reason in failed[0].detail


BRACES = {
    "unknown placeholder": ("out-{foo}.json", "'{foo}' is no placeholder"),
    "unclosed": ("out-{rank", "'{rank' is no placeholder"),
    "misspelt": ("out-{Rank}.json", "'{Rank}' is no placeholder"),
    "lone closing brace": ("out-{rank}}.json", "'}' is no placeholder"),
    "in a directory": ("dp{dp}/out.json", "'{dp}' is no placeholder"),
}


@pytest.mark.parametrize("option", PATH_OPTIONS)
@pytest.mark.parametrize("case", list(BRACES))
def test_only_rank_and_dp_rank_are_placeholders_other_braces_are_refused(
    monkeypatch, tmp_path, option, case
):
    """``{foo}`` or ``{rank`` used to be accepted and written literally."""
    relative, reason = BRACES[case]
    path = str(tmp_path / relative)
    monkeypatch.setenv(option, path)
    pattern = rf"^{option}=.*{re.escape(reason)}.*Fix or unset {option}\.$"
    with pytest.raises(ConfigError, match=pattern):
        plugin.register()
    result = doctor.check_options({option: path})
    assert result.status == doctor.FAIL and option in result.detail and reason in result.detail
    assert "only {rank} and {dp_rank} are" in result.detail
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", PATH_OPTIONS)
@pytest.mark.parametrize(
    "relative", ["out.json", "not/yet/made/out-{rank}.json", "dp{dp_rank}/out-{rank}.json"]
)
def test_writable_output_paths_pass_and_nothing_is_left_behind(tmp_path, option, relative):
    assert doctor.check_options({option: str(tmp_path / relative)}).status == doctor.OK
    assert list(tmp_path.iterdir()) == []


def _served_three_sizes() -> CudaGraphBackend:
    """A backend that captured 4, 2 and 1 and served a step of 3."""
    model = TinyBackbone()
    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1])
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    for size in (4, 2, 1, 3):
        backend(**buffers.step(size))
    return backend


def test_a_path_that_stops_being_writable_after_the_start_only_has_its_writes_counted(
    sim, monkeypatch, caplog, failures, tmp_path
):
    # Starting creates no file to find out (every rank reads its options at every start); a
    # directory that goes away afterwards (a cleaned log disk) fails the writes, which are
    # counted, and serving goes on.
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(tmp_path / "gone" / "stats.json"))
    plugin.register()
    backend = _served_three_sizes()
    (tmp_path / "gone").write_text("a file where the directory would be")
    backend.flush_stats()
    assert failures["FD_CUDAGRAPH_STATS_FILE"] == 1 and sim.live_graphs == 3


def test_a_stats_file_that_is_no_regular_file_is_logged_once_and_clear_graph_still_releases(
    sim, monkeypatch, caplog, failures, tmp_path
):
    # A FIFO would block open() for good. It does not stop the start: each write is refused,
    # counted, and logged once.
    special = str(tmp_path / "stats.fifo")
    os.mkfifo(special)
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", special)
    plugin.register()
    backend = _served_three_sizes()
    assert sim.live_graphs == 3
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        backend.flush_stats()
        backend.clear_graph()
        observability.flush_all(process.current())
    assert sim.live_graphs == 0 and backend.stats()["graph_bytes"] == {}
    assert failures["FD_CUDAGRAPH_STATS_FILE"] == 3
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and f"FD_CUDAGRAPH_STATS_FILE: cannot write {special}" in warnings[0]
    assert "not a regular file" in warnings[0]


@pytest.mark.parametrize("special", ["fifo", "becomes a directory"])
def test_a_memory_report_that_cannot_be_written_does_not_stop_capture(
    sim, monkeypatch, caplog, failures, tmp_path, special
):
    path = {"fifo": str(tmp_path / "report.fifo"), "becomes a directory": str(tmp_path / "r")}
    path = path.get(special, special)
    monkeypatch.setenv("FD_CUDAGRAPH_MEMORY_REPORT", path)
    plugin.register()  # accepted: it does not exist yet
    if special == "fifo":
        os.mkfifo(path)
    elif special == "becomes a directory":
        os.mkdir(path)
    config = make_config(4, cudagraph_capture_sizes=[4, 2, 1])
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with (
        caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"),
        session.CaptureSession("decode", fd_config=config),
    ):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    assert failures["FD_CUDAGRAPH_MEMORY_REPORT"] == 1
    assert sim.live_graphs == 3
    assert json.dumps(backend.stats())  # still serving and reporting
