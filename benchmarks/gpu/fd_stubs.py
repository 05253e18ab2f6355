"""Stand-ins for the ``fastdeploy`` modules that FastDeploy's backend and the plugin import, a
``GPUModelRunner`` with FastDeploy's decode capture loop, and ``make_fd_config()``: a duck-typed
``FDConfig`` with the fields both backends read. Nothing here is FastDeploy's code, and nothing
runs FastDeploy: README.md says what that leaves out.

The platform is NVIDIA CUDA (``current_platform.is_cuda()``), so the plugin's ``register()``
does not stand aside. There is no custom all-reduce (``communication._TP_AR`` is None: TP = 1).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from types import SimpleNamespace

BACKEND_MODULE = "fastdeploy.model_executor.graph_optimization.graph_optimization_backend"
NATIVE_MODULE = "fastdeploy.model_executor.graph_optimization.cudagraph_piecewise_backend"
RUNNER_MODULE = "fastdeploy.worker.gpu_model_runner"


class Platform:
    """``fastdeploy.platforms.current_platform`` on an NVIDIA GPU."""

    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name: str):
        if name.startswith("is_"):  # is_xpu, is_dcu, is_maca, ...: not this machine
            return lambda: False
        raise AttributeError(name)


def plain_capture_model(runner) -> None:
    """FastDeploy's decode capture loop: every size, largest first; per size the target model's
    dummy step, then the draft's (MTP)."""
    for size in sorted(runner.fd_config.graph_opt_config.cudagraph_capture_sizes, reverse=True):
        for step in runner.steps:
            step(size)


class GPUModelRunner:
    """``fastdeploy.worker.gpu_model_runner.GPUModelRunner``: only its decode capture loop.

    The plugin's ``hooks.install()`` wraps ``capture_model`` of this class in a capture session,
    as it wraps FastDeploy's (from ``register()`` and from each backend's constructor). FastDeploy's
    own backend has no such hook: drive it with ``plain_capture_model(runner)``. ``model`` and
    ``proposer.model`` are where the plugin's session tells the target backend from the draft's.
    """

    def __init__(self, fd_config, steps, model=None, draft_model=None):
        self.fd_config = fd_config
        self.steps = list(steps)  # callables step(size): one decode dummy run of one model
        self.model = model
        self.proposer = None if draft_model is None else SimpleNamespace(model=draft_model)

    def capture_model(self) -> None:
        plain_capture_model(self)


def _get_logger(name, file_name=None):
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    return logger


def install() -> None:
    """Register the stand-in modules in ``sys.modules`` (once per process)."""
    if getattr(sys.modules.get("fastdeploy"), "_is_harness_stub", False):
        return
    modules: dict[str, types.ModuleType] = {}

    def module(name: str, package: bool = False, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        if package:
            mod.__path__ = []
        mod.__dict__.update(attrs)
        modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, mod)
        return mod

    class FDConfig:  # a type for annotations only
        pass

    module("fastdeploy", package=True, _is_harness_stub=True, __version__="2.6.0")
    module("fastdeploy.envs", FD_LOG_DIR="/tmp/fd_log")
    module("fastdeploy.config", FDConfig=FDConfig)
    module("fastdeploy.utils", get_logger=_get_logger)
    module("fastdeploy.platforms", current_platform=Platform())
    module("fastdeploy.distributed", package=True)
    module(
        "fastdeploy.distributed.communication",
        capture_custom_allreduce=contextlib.nullcontext,
        custom_ar_clear_ipc_handles=lambda: None,
        _TP_AR=None,
    )
    module("fastdeploy.model_executor", package=True)
    module("fastdeploy.model_executor.graph_optimization", package=True)
    # GraphOptBackend looks this global up at its first call; a plugin's register() rebinds it.
    # harness.py binds FastDeploy's own class here first, as FastDeploy's import does.
    module(BACKEND_MODULE, CudaGraphPiecewiseBackend=None)
    module(NATIVE_MODULE, CudaGraphPiecewiseBackend=None)
    module("fastdeploy.worker", package=True)
    module(RUNNER_MODULE, GPUModelRunner=GPUModelRunner)
    sys.modules.update(modules)


def padding_table(sizes) -> dict[int, int]:
    """Token count -> captured size, as FastDeploy's config builds real_shape_to_captured_size:
    for each descending pair (end, start), with 0 after the last size, start maps to itself and
    start+1..end-1 to end; then max to max. Sizes [8, 4, 2, 1]: 0->0, 1->1, 2->2, 3->4, 5..8->8."""
    desc = sorted(set(sizes), reverse=True)
    table = {}
    for end, start in zip(desc, [*desc[1:], 0], strict=True):
        for n in range(start, end):
            table[n] = start if n == start else end
    if desc:
        table[desc[0]] = desc[0]
    return table


def make_fd_config(capture_sizes, warmups=2, unique_pool=True, max_num_seqs=256):
    """A duck-typed FDConfig in dynamic mode (graph_opt_level 0), TP = 1, no speculation."""
    sizes = sorted(set(capture_sizes), reverse=True)  # FastDeploy keeps them descending
    graph = SimpleNamespace(
        use_cudagraph=True,
        cudagraph_capture_sizes=sizes,
        cudagraph_capture_sizes_prefill=[],
        cudagraph_num_of_warmups=warmups,
        real_shape_to_captured_size=padding_table(sizes),
        real_shape_to_captured_size_prefill={},
        full_cuda_graph=True,
        graph_opt_level=0,
        use_unique_memory_pool=unique_pool,
        real_bsz_to_captured_size={},
        max_capture_size=sizes[0],
        max_capture_shape_prefill=512,  # FastDeploy's field default
        cudagraph_only_prefill=False,
        draft_model_use_cudagraph=True,
    )
    return SimpleNamespace(
        graph_opt_config=graph,
        speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            tensor_parallel_rank=0,
            data_parallel_size=1,
            data_parallel_rank=0,
            disable_custom_all_reduce=False,
            use_sequence_parallel_moe=False,
        ),
    )
