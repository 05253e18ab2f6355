"""Registration: the installed entry point, the FD_PLUGINS loader, the rebinding, the switch."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys

import paddle
import pytest
from conftest import DecoratedBackbone, make_config
from fastdeploy.model_executor.graph_optimization import (
    cudagraph_piecewise_backend,
    graph_optimization_backend,
)
from fastdeploy.plugins import model_register
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fd_cudagraph_plugin import __version__, plugin
from fd_cudagraph_plugin.core import process
from fd_cudagraph_plugin.core import seam as fastdeploy_seam
from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import ConfigError

NATIVE = cudagraph_piecewise_backend.CudaGraphPiecewiseBackend


def _load_plugins() -> None:
    model_register.reset_for_tests()
    model_register.load_model_register_plugins()


def test_entry_point_is_installed_in_fastdeploys_group():
    found = [
        ep
        for ep in importlib.metadata.entry_points(group=plugin.ENTRY_POINT_GROUP)
        if ep.name == plugin.ENTRY_POINT_NAME
    ]
    assert len(found) == 1
    assert found[0].value == "fd_cudagraph_plugin.plugin:register"
    assert found[0].load() is plugin.register


def test_fd_plugins_loader_rebinds_the_name_graphoptbackend_looks_up(monkeypatch, sim):
    monkeypatch.setenv("FD_PLUGINS", "some_other_plugin,fd_cudagraph_plugin")
    _load_plugins()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is CudaGraphBackend
    assert cudagraph_piecewise_backend.CudaGraphPiecewiseBackend is CudaGraphBackend


@pytest.mark.parametrize("fd_plugins", [None, "fd-cudagraph-plugin", "some_other_plugin"])
def test_loader_keeps_native_backend_unless_entry_point_name_listed(monkeypatch, fd_plugins):
    if fd_plugins is not None:
        monkeypatch.setenv("FD_PLUGINS", fd_plugins)
    _load_plugins()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE


def test_register_is_idempotent_and_logs_active_backend_once(caplog, sim):
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        plugin.register()
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is CudaGraphBackend
    assert graph_optimization_backend._fd_cudagraph_native_backend is NATIVE
    active = [r for r in caplog.records if "active" in r.getMessage()]
    assert len(active) == 1
    assert "FastDeploy 2.6.0" in active[0].getMessage()
    assert "(fd_config, dy_runnable, runnable)" in active[0].getMessage()


def test_native_switch_keeps_fastdeploys_backend(monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_BACKEND", "native")
    plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE


def test_unknown_backend_switch_is_a_config_error_listing_allowed_values(monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_BACKEND", "fast")
    with pytest.raises(ConfigError, match=r"FD_CUDAGRAPH_BACKEND='fast'.*plugin, native"):
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE


def test_importing_the_plugin_does_no_heavy_import():
    code = (
        "import sys, fd_cudagraph_plugin, fd_cudagraph_plugin.plugin;"
        "print(sorted(m for m in ('paddle', 'fastdeploy', 'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("legacy", [False, True], ids=["develop-3-arg", "release-2.4-2-arg"])
def test_decorated_model_serves_through_plugin_backend(plugin_registered, legacy):
    if legacy:
        graph_optimization_backend.emulate_release_2_4(True)
        plugin.register()
    config = make_config(8)
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    assert isinstance(backend, CudaGraphBackend)
    assert backend.captures == len(config.graph_opt_config.cudagraph_capture_sizes)
    backend.check_capture_successful()
    calls_after_capture = model.calls
    for tokens in (1, 3, 5, 8, 2, 7):
        out = runner.execute_step(tokens)
        view = runner.share_inputs["ids"][:tokens]
        expected = model.forward(ids_remove_padding=view, forward_meta=None)
        assert out.shape == [tokens, expected.shape[1]]
        assert paddle.allclose(out, expected).item()
    # Each step replays a graph (one eager re-run by the simulated runtime) plus our eager check.
    assert model.calls == calls_after_capture + 2 * 6
    assert sum(backend.stats()["replays"].values()) == 6  # served; the capture runs apart


def test_records_reach_fastdeploys_log_handlers(monkeypatch, sim):
    import fastdeploy.utils

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    target = logging.getLogger("fastdeploy.worker_log_for_test")
    target.propagate = False
    target.addHandler(Collect())
    monkeypatch.setattr(fastdeploy.utils, "get_logger", lambda name, file_name=None: target)
    ours = logging.getLogger("fd_cudagraph_plugin")
    try:
        plugin.register()
        plugin.register()
        forwarding = [h for h in ours.handlers if isinstance(h, fastdeploy_seam._ToFastDeploy)]
        assert len(forwarding) == 1
        assert any(f"fd-cudagraph-plugin {__version__} active" in m for m in records)
    finally:
        for handler in [h for h in ours.handlers if isinstance(h, fastdeploy_seam._ToFastDeploy)]:
            ours.removeHandler(handler)
        ours.setLevel(logging.NOTSET)


def test_any_bad_option_stops_register_with_the_fix(monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_SELF_CHECK", "twice")
    with pytest.raises(ConfigError, match=r"FD_CUDAGRAPH_SELF_CHECK='twice'.*off, warn, error"):
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("FD_CUDAGRAPH_BACKNED", "FD_CUDAGRAPH_BACKEND"),
        ("FD_CUDAGRAPH_KV_RESERV", "FD_CUDAGRAPH_KV_RESERVE"),
    ],
)
def test_a_misspelt_option_stops_register_naming_the_closest_one(monkeypatch, sim, name, closest):
    # A misspelt FD_CUDAGRAPH_KV_RESERV=auto used to leave the reserve off with a warning only.
    monkeypatch.setenv(name, "auto")
    with pytest.raises(ConfigError, match=rf"does not know {name} \(did you mean {closest}\?\)"):
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE


def test_each_record_reaches_the_console_once_when_fastdeploys_logger_propagates(monkeypatch, sim):
    import fastdeploy.utils

    # FastDeploy's get_logger(name, file) logger: file handlers, and it propagates to root.
    fastdeploy_file, console = [], []

    class Collect(logging.Handler):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def emit(self, record):
            self.into.append(record.getMessage())

    target = logging.getLogger("legacy.fd_cudagraph_plugin_for_test")
    target.addHandler(Collect(fastdeploy_file))
    monkeypatch.setattr(fastdeploy.utils, "get_logger", lambda name, file_name=None: target)
    root_handler = Collect(console)
    logging.getLogger().addHandler(root_handler)
    ours = logging.getLogger("fd_cudagraph_plugin")
    try:
        plugin.register()
        ours.warning("one line, please")
        assert fastdeploy_file.count("one line, please") == 1
        assert console.count("one line, please") == 1
    finally:
        logging.getLogger().removeHandler(root_handler)
        for handler in [h for h in ours.handlers if isinstance(h, fastdeploy_seam._ToFastDeploy)]:
            ours.removeHandler(handler)
        ours.setLevel(logging.NOTSET)


def test_forward_meta_of_older_releases_gets_the_fields_the_backend_reads(sim, monkeypatch):
    from dataclasses import dataclass

    from conftest import Buffers, TinyBackbone, capture_speculative

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    @dataclass
    class ForwardMeta24:  # FastDeploy 2.4: no exist_prefill, no real_bsz
        ids_remove_padding: object
        step_use_cudagraph: bool = False
        seq_lens_this_time: object = None

    from fastdeploy.model_executor import forward_meta

    monkeypatch.setattr(forward_meta, "ForwardMeta", ForwardMeta24)
    patches = process.current().patches
    assert fastdeploy_seam.backfill_forward_meta(patches) == ["exist_prefill", "real_bsz"]
    assert fastdeploy_seam.backfill_forward_meta(patches) == []
    model = TinyBackbone()
    for speculative in (None, {"method": "mtp", "num_speculative_tokens": 1}):
        config = make_config(4, speculative=speculative)
        backend = CudaGraphBackend(
            fd_config=config, dy_runnable=model.forward, runnable=model.forward
        )
        buffers = Buffers()
        if speculative:
            capture_speculative(backend, buffers)
        else:
            for size in backend.cudagraph_capture_sizes:
                backend(**buffers.step(size))
        view = buffers.step(3)["ids_remove_padding"]
        lens = paddle.to_tensor([2, 1, 0, 0], dtype="int32")
        meta = ForwardMeta24(view, True, seq_lens_this_time=lens)
        assert backend(ids_remove_padding=view, forward_meta=meta).shape[0] == 4


def test_register_works_on_a_fastdeploy_layout_without_forward_meta(monkeypatch, sim):
    monkeypatch.setitem(sys.modules, "fastdeploy.model_executor.forward_meta", None)
    plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is not NATIVE


def test_the_active_line_names_every_option_not_at_its_default(caplog, sim, monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_CHECK_ADDRESSES", "always")
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        plugin.register()
    (active,) = [r.getMessage() for r in caplog.records if " active: " in r.getMessage()]
    assert active.endswith(
        "options: FD_CUDAGRAPH_RUNTIME=simulated (the CPU test runtime: no CUDA graph runs; unset "
        "it to serve), FD_CUDAGRAPH_CHECK_ADDRESSES=always."
    )


@pytest.mark.parametrize(
    ("device", "why"),
    [
        ("xpu", "FastDeploy's platform is XPU, not NVIDIA CUDA"),
        ("maca", "FastDeploy's platform is MetaX (MACA), not NVIDIA CUDA"),
        ("dcu", "FastDeploy's platform is DCU, not NVIDIA CUDA"),
        ("cpu", "FastDeploy's platform is CPU, not NVIDIA CUDA"),
    ],
)
def test_register_stands_aside_where_the_cuda_runtime_cannot_run(caplog, device, why):
    """XPU and MetaX allow CUDA graphs from 2.5 through their own runners; the plugin's runtime
    drives NVIDIA CUDA graphs only, so FastDeploy keeps its backend and its runners there."""
    from fastdeploy.platforms import current_platform
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner as Runner

    current_platform.device_name = device
    loop = Runner.__dict__["capture_model"]
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        plugin.register()
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE
    assert Runner.__dict__["capture_model"] is loop  # no session wrapper
    lines = [r.getMessage() for r in caplog.records if "stands aside" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and "keeps its own CUDA-graph backend" in lines[0]


def test_register_stands_aside_on_a_paddle_without_cuda(caplog):
    # This machine's Paddle is the CPU build; FastDeploy's platform says CUDA here.
    from fastdeploy.platforms import current_platform

    current_platform.device_name = "cuda"
    with caplog.at_level(logging.INFO, logger="fd_cudagraph_plugin"):
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is NATIVE
    assert any("this Paddle is not compiled with CUDA" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "env",
    [
        {"FD_CUDAGRAPH_AGREEMENT_INTERFACE": "eth99"},
        {"FD_CUDAGRAPH_AGREEMENT_PORTS": "29500-29509"},
        {"FD_CUDAGRAPH_AGREEMENT_INTERFACE": "0.0.0.0", "FD_CUDAGRAPH_AGREEMENT_PORTS": "80"},
    ],
    ids=["interface", "ports", "both, with values 0.6.0 refused"],
)
def test_agreement_options_of_0_6_are_named_as_unused_and_never_stop_a_start(
    monkeypatch, caplog, sim, env
):
    """The ranks agree through Paddle's job store: no address or port of the plugin's own. A
    deployment that still sets one starts, is told the option does nothing, and doctor warns."""
    from fd_cudagraph_plugin.tools import doctor

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        plugin.register()
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is not NATIVE
    said = [r.getMessage() for r in caplog.records if "no longer used" in r.getMessage()]
    assert sorted(m.split()[0] for m in said) == sorted(env), said
    assert all("Paddle's job store" in m and "Unset it" in m for m in said)
    result = doctor.check_options(env)
    assert result.status == doctor.WARN and all(key in result.detail for key in env)
    assert all(f"unset {key}" in result.fix for key in env)
