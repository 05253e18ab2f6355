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
    """FastDeploy's decode capture loop: every size of ``runner.cudagraph_capture_sizes``, largest
    first; per size the target model's dummy step, then the draft's (MTP)."""
    for size in sorted(runner.cudagraph_capture_sizes, reverse=True):
        for step in runner.steps:
            step(size)


#: What the stand-in's ``sleep`` and ``wakeup`` write into a tensor before dropping it (-1 into
#: an integer one; None: nothing). Not FastDeploy's behaviour: torch's caching allocator keeps a
#: freed block as it was until it hands the block out again, so a graph that reads freed memory
#: may still see the old values; on a serving worker that memory goes to the trainer (sleep) or
#: to the new tensors. ``bench_wakeup.py`` sets NaN here to make such a read visible, and runs
#: once without it.
FREED_FILL = None


def _drop(tensor) -> None:
    """Write ``FREED_FILL`` into a tensor about to be freed (-1 into an integer one)."""
    if tensor is not None and FREED_FILL is not None:
        tensor.fill_(FREED_FILL if tensor.is_floating_point() else -1)


def _empty_cache() -> None:
    import paddle  # the torch stand-in (harness.py installs it first)

    paddle.device.cuda.empty_cache()


class ShareInputs(dict):
    """What ``sleep``/``wakeup("kv_cache")`` free and make anew in FastDeploy's input buffers
    (``share_inputs``, an ``InputBatch`` from 2.5; the MTP draft's ``model_inputs``): the KV
    caches (``"caches"``, a list of tensors), ``"rope_emb"`` and the ids. ``make_caches``,
    ``make_rope`` and ``make_ids`` build new tensors; every other key stays as given."""

    def __init__(self, make_caches, make_rope, make_ids, **buffers):
        super().__init__(buffers)
        self._make_caches, self._make_rope, self._make_ids = make_caches, make_rope, make_ids
        self["ids_remove_padding"] = make_ids()
        self["rope_emb"] = make_rope()

    def initialize_caches(self) -> None:
        """New caches (``initialize_kv_cache``): the old list, if any, is dropped first."""
        self.drop_caches()
        self["caches"] = self._make_caches()

    def drop_caches(self) -> None:
        """``clear_cache``: the caches popped from the inputs (their memory freed)."""
        for tensor in self.pop("caches", None) or []:
            _drop(tensor)

    def reset_share_inputs(self) -> None:
        """The target's reset (every ``wakeup``, 2.5+): the ids filled in place, a new
        ``rope_emb``, made while the old one lives (so at a new address), then the old freed."""
        self["ids_remove_padding"].zero_()
        old, self["rope_emb"] = self["rope_emb"], self._make_rope()
        _drop(old)

    def reset_model_inputs(self) -> None:
        """The MTP draft's reset (every ``wakeup``, 2.5+): new ids and a new ``rope_emb``."""
        for name, make in (("ids_remove_padding", self._make_ids), ("rope_emb", self._make_rope)):
            old, self[name] = self[name], make()
            _drop(old)


class Proposer:
    """The MTP proposer: its ``model`` (where the plugin tells the draft's backend from the
    target's), its ``model_inputs`` and KV cache when given (``ShareInputs``)."""

    def __init__(self, model, model_inputs=None):
        self.model = model
        self.model_inputs = model_inputs

    def initialize_kv_cache(self, main_model_num_blocks=None) -> None:
        self.model_inputs.initialize_caches()

    def clear_mtp_cache(self, profile: bool = False) -> None:
        self.model_inputs.drop_caches()
        _empty_cache()


class GPUModelRunner:
    """``fastdeploy.worker.gpu_model_runner.GPUModelRunner``: its decode capture loop and, when
    given ``share_inputs`` (``ShareInputs``), the KV-cache part of its lifecycle.

    The plugin's ``hooks.install()`` wraps ``capture_model`` of this class in a capture session,
    as it wraps FastDeploy's (from ``register()`` and from each backend's constructor), and the
    lifecycle calls below where its version wraps them. FastDeploy's own backend has no such
    hook: drive it with ``plain_capture_model(runner)``. ``model`` and ``proposer.model`` are
    where the plugin's session tells the target backend from the draft's.

    ``sleep("kv_cache")`` and ``wakeup("kv_cache")`` follow FastDeploy 2.6 (``r3_eos_2.6``) and
    develop, in its order: sleep frees the draft's KV cache, then the target's
    (``clear_cache``), and empties the allocator's cache; wakeup resets the inputs first (the
    draft's ``reset_model_inputs()``, the target's ``reset_share_inputs()``: a new ``rope_emb``,
    new draft ids), then makes new caches (the draft's, then ``initialize_kv_cache()``), and
    captures nothing. The "weight" tag (weights to the host and back, with a capture) is not
    modelled here.
    """

    def __init__(
        self, fd_config, steps, model=None, draft_model=None, share_inputs=None, draft_inputs=None
    ):
        self.fd_config = fd_config
        # Kept ascending, as FastDeploy keeps it; the plugin's FD_CUDAGRAPH_FIT has the loop
        # visit its fitted sizes by setting it for one capture_model() (seam.loop_visits).
        self.cudagraph_capture_sizes = sorted(fd_config.graph_opt_config.cudagraph_capture_sizes)
        self.steps = list(steps)  # callables step(size): one decode dummy run of one model
        self.model = model
        self.proposer = None if draft_model is None else Proposer(draft_model, draft_inputs)
        self.share_inputs = share_inputs
        self.use_cudagraph = True
        self.is_kvcache_sleeping = False
        self.is_weight_sleeping = False
        if share_inputs is not None:
            self.initialize_kv_cache()
            if draft_inputs is not None:
                self.proposer.initialize_kv_cache()

    def capture_model(self) -> None:
        plain_capture_model(self)

    def _draft_inputs(self):
        return None if self.proposer is None else self.proposer.model_inputs

    def initialize_kv_cache(self, profile: bool = False) -> None:
        self.share_inputs.initialize_caches()

    def clear_cache(self, profile: bool = False) -> None:
        self.share_inputs.drop_caches()
        _empty_cache()

    def sleep(self, tags: str = "kv_cache") -> None:
        _only_kv_cache(tags)
        if self.is_kvcache_sleeping:
            return
        if self._draft_inputs() is not None:
            self.proposer.clear_mtp_cache()
        self.clear_cache()
        self.is_kvcache_sleeping = True
        _empty_cache()

    def wakeup(self, tags: str = "kv_cache") -> None:
        _only_kv_cache(tags)
        if self._draft_inputs() is not None:
            self.proposer.model_inputs.reset_model_inputs()
        self.share_inputs.reset_share_inputs()
        if not self.is_kvcache_sleeping:
            return
        if self._draft_inputs() is not None:
            self.proposer.initialize_kv_cache()
        self.initialize_kv_cache()
        self.is_kvcache_sleeping = False


def _only_kv_cache(tags: str) -> None:
    if tags.split(",") != ["kv_cache"]:
        raise NotImplementedError(f"the stand-in models only the 'kv_cache' tag, not {tags!r}")


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
