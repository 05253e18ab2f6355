"""What differs between FastDeploy 2.4, 2.5, 2.6 and develop, and the plugin on each."""

from __future__ import annotations

import logging

import pytest
from conftest import FlakyBackboneForRunner, make_config
from fastdeploy.model_executor import forward_meta
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin import plugin


def test_the_hot_path_reads_every_releases_forward_meta_as_plain_attributes(fd_version, sim):
    """2.4 has neither exist_prefill nor real_bsz, 2.5 no real_bsz: register() gives the class
    the values that mean the same there, and takes them back."""
    lacking = {"2.4": {"exist_prefill", "real_bsz"}, "2.5": {"real_bsz"}}.get(fd_version, set())
    meta = forward_meta.ForwardMeta(ids_remove_padding=None)
    assert {name for name in ("exist_prefill", "real_bsz") if not hasattr(meta, name)} == lacking
    plugin.register()
    meta = forward_meta.ForwardMeta(ids_remove_padding=None)
    assert meta.exist_prefill is False and meta.real_bsz == 0
    plugin.reset_for_tests()
    meta = forward_meta.ForwardMeta(ids_remove_padding=None)
    assert {name for name in ("exist_prefill", "real_bsz") if not hasattr(meta, name)} == lacking


@pytest.mark.parametrize(
    ("fd_version", "captured"),
    # 2.5 on turns sequence-parallel MoE off in the mixed role before filtering (nothing is
    # filtered); 2.4 filters first: only sizes divisible by the TP size stay.
    [("2.4", [16, 8, 4]), ("2.5", [16, 8, 4, 2, 1]), ("2.6", [16, 8, 4, 2, 1])],
    indirect=["fd_version"],
)
def test_the_backend_captures_the_sizes_fastdeploys_filter_left(
    fd_version, plugin_registered, captured
):
    from conftest import CaptureSessionForOneRank, DecoratedMixing

    config = make_config(16, tp=4, sequence_parallel_moe=True)
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    with CaptureSessionForOneRank(config):
        runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert [r.size for r in backend.capture_report.records] == captured
    backend.check_capture_successful()


@pytest.mark.parametrize("fd_version", ["2.5", "develop"], indirect=True)
def test_max_capture_shape_prefill_zero_captures_no_prefill_graph_and_requires_none(
    fd_version, plugin_registered
):
    from conftest import DecoratedMixing

    config = make_config(4, max_capture_shape_prefill=0, graph_opt_level=1, full_cuda_graph=False)
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    runner.capture_model_prefill_and_mixed()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert backend.mode.prefill_sizes == () and backend.captures == 3  # decode 4, 2, 1
    backend.check_capture_successful()  # no prefill graph is required
    runner.execute_step(3, exist_prefill=True)
    assert backend.stats()["prefill_replays"] == {}


def test_plugin_lines_reach_the_console_once_though_the_legacy_logger_propagates(sim):
    lines = []

    class Console(logging.Handler):
        def emit(self, record):
            if "fd-cudagraph-plugin" in record.getMessage():
                lines.append(record.getMessage())

    root = logging.getLogger()
    console = Console()
    root.addHandler(console)
    try:
        plugin.register()
    finally:
        root.removeHandler(console)
    assert len(lines) == 1, lines


def test_a_capture_failure_that_is_no_oom_is_not_reported_as_one(plugin_registered):
    config = make_config(4)
    model = FlakyBackboneForRunner(fd_config=config, message="the op cannot be captured")
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    with pytest.raises(Exception) as raised:
        runner.capture_model()
    assert "out of memory" not in str(raised.value)
    assert "cannot be captured" in str(raised.value)
