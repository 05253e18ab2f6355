"""What differs between FastDeploy 2.4, 2.5, 2.6 and develop, and the plugin on each."""

from __future__ import annotations

import logging

import pytest
from conftest import FlakyBackboneForRunner, make_config
from fastdeploy import _stub_version
from fastdeploy.model_executor import forward_meta
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin import plugin


def test_forward_meta_fields_per_release(fd_version):
    meta = forward_meta.ForwardMeta(ids_remove_padding=None)
    assert hasattr(meta, "exist_prefill") is _stub_version.at_least("2.5")
    if _stub_version.at_least("2.6"):
        assert meta.real_bsz == 0 and meta.not_a_field is None
    else:
        with pytest.raises(AttributeError):
            meta.real_bsz  # noqa: B018


@pytest.mark.parametrize("fd_version", ["2.5", "2.6"], indirect=True)
def test_sequence_parallel_moe_is_off_before_filtering_in_the_mixed_role(fd_version):
    config = make_config(16, tp=4, sequence_parallel_moe=True)
    assert config.graph_opt_config.cudagraph_capture_sizes == [16, 8, 4, 2, 1]
    assert not config.parallel_config.use_sequence_parallel_moe


@pytest.mark.parametrize("fd_version", ["2.4"], indirect=True)
def test_release_2_4_filters_before_turning_sequence_parallel_moe_off(fd_version):
    config = make_config(16, tp=4, sequence_parallel_moe=True)
    assert config.graph_opt_config.cudagraph_capture_sizes == [16, 8, 4]


@pytest.mark.parametrize("fd_version", ["2.5", "develop"], indirect=True)
def test_max_capture_shape_prefill_zero_leaves_no_prefill_graph(fd_version):
    config = make_config(4, max_capture_shape_prefill=0)
    assert config.graph_opt_config.cudagraph_capture_sizes_prefill == [0]
    given = make_config(4, max_capture_shape_prefill=0, cudagraph_capture_sizes=[4, 2])
    assert given.graph_opt_config.cudagraph_capture_sizes_prefill == []


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
