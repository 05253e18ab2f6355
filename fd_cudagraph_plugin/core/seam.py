"""The seam to FastDeploy: the one module that knows FastDeploy's internals.

A call into this module (``seam.clear_ipc_handles()``) is the plugin adapting to FastDeploy, never
FastDeploy's own code. Everything the plugin reads or changes in FastDeploy goes through here,
with the release differences it depends on: the backend binding ``GraphOptBackend`` looks up,
``ForwardMeta``'s fields, the worker log, the runners' capture loops, the custom all-reduce, the
platform and the store Paddle's launcher gives every worker. Facts are from the
``gongshaotian/FastDeploy`` branches ``2.4_r3``, ``r3_ban_cpucache_2.5``, ``r3_eos_2.6`` and
``r3_mm_dev`` (develop).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from fd_cudagraph_plugin.core.moved import tensors_in

logger = logging.getLogger("fd_cudagraph_plugin")

BACKEND_MODULE = "fastdeploy.model_executor.graph_optimization.graph_optimization_backend"
NATIVE_MODULE = "fastdeploy.model_executor.graph_optimization.cudagraph_piecewise_backend"
BACKEND_NAME = "CudaGraphPiecewiseBackend"
FORWARD_META_MODULE = "fastdeploy.model_executor.forward_meta"
#: ForwardMeta fields the backend reads that older releases lack (2.4: both; 2.5: real_bsz), with
#: the value that means the same there: 2.4 routes to the backend only steps its runner flagged
#: (decode, or in cudagraph_only_prefill mode prefill-only steps; settings.fastdeploy_2_4 tells
#: which), and 0 running requests makes the backend count them from seq_lens_this_time, as 2.5's
#: own backend does.
FORWARD_META_DEFAULTS = {"exist_prefill": False, "real_bsz": 0}


def import_or_none(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def version() -> str:
    module = import_or_none("fastdeploy")
    if module is None:
        return "(not installed)"
    return str(getattr(module, "__version__", "unknown"))


def constructor_shape(cls: object) -> str:
    """``(fd_config, dy_runnable, runnable)`` on 2.5+, ``(fd_config, runnable)`` on 2.4."""
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    except (TypeError, ValueError):
        return "unknown"
    return "(" + ", ".join(params) + ")"


# ---------------------------------------------------------------------- the backend binding


def bind_backend(cls: type) -> object:
    """Make ``GraphOptBackend`` build ``cls``; return the class bound before.

    ``GraphOptBackend`` looks ``CudaGraphPiecewiseBackend`` up as a global of its own module at its
    first call, so rebinding that global is enough; the class's home module is rebound too, for
    code that imports it from there later."""
    module = importlib.import_module(BACKEND_MODULE)
    native = getattr(module, BACKEND_NAME, None)
    if native is not cls:
        module._fd_cudagraph_native_backend = native
        setattr(module, BACKEND_NAME, cls)
        setattr(importlib.import_module(NATIVE_MODULE), BACKEND_NAME, cls)
    return getattr(module, "_fd_cudagraph_native_backend", native)


def count_steps_run_without(layer: object, count: Callable[[Any], None]) -> bool:
    """Make ``count(forward_meta)`` see every step FastDeploy's ``GraphOptBackend`` of ``layer``
    runs without the CUDA-graph backend: a decode step above ``max_captre_size`` (sic), prefill
    outside static split mode, a step its runner did not flag. It runs those, and nothing else,
    through its ``dy_runnable`` (2.4 through develop), which is wrapped here once; steps it gives
    the backend pay nothing. False where ``layer`` has none."""
    graph_opt_backend = getattr(layer, "graph_opt_backend", None)
    run = getattr(graph_opt_backend, "dy_runnable", None)
    if run is None or hasattr(run, "_fd_cudagraph_original"):
        return False

    def dy_runnable(**kwargs: Any) -> Any:
        count(kwargs.get("forward_meta"))
        return run(**kwargs)

    dy_runnable._fd_cudagraph_original = run  # type: ignore[attr-defined]
    graph_opt_backend.dy_runnable = dy_runnable
    return True


def backfill_forward_meta(patches: list[tuple[type, str]]) -> list[str]:
    """Give ``ForwardMeta`` class-level defaults for the fields its release lacks, so the replay
    path reads plain attributes on every release; return the names added, and note each in
    ``patches`` (the process's list, so tests can take them away). Fields the class has (as
    dataclass defaults, on 2.5+) are left alone."""
    cls = getattr(import_or_none(FORWARD_META_MODULE), "ForwardMeta", None)
    if cls is None:  # every release has it; a layout we do not know keeps its own
        return []
    added = [name for name in FORWARD_META_DEFAULTS if not hasattr(cls, name)]
    for name in added:
        setattr(cls, name, FORWARD_META_DEFAULTS[name])
        patches.append((cls, name))
    return added


def undo_patches(patches: list[tuple[type, str]]) -> None:
    while patches:
        cls, name = patches.pop()
        delattr(cls, name)


# ---------------------------------------------------------------------------- the worker log


class _ToFastDeploy(logging.Handler):
    """Hands the plugin's records to a FastDeploy logger's own handlers (its log files).

    Only to its handlers: FastDeploy's file loggers (``legacy.<name>``) propagate to the root
    logger, and so does ours, so passing records through the FastDeploy logger itself would print
    every line twice wherever root has a handler. Its handlers are read at each record, because
    FastDeploy replaces them whenever ``get_logger`` is called for that name.
    """

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if not self.target.isEnabledFor(record.levelno):
            return
        for handler in self.target.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def log_to_worker_log() -> None:
    """Send the package logger's records to FastDeploy's ``worker_process.log``."""
    if any(isinstance(h, _ToFastDeploy) for h in logger.handlers):
        return
    try:
        from fastdeploy.utils import get_logger

        target = get_logger("fd_cudagraph_plugin", "worker_process.log")
    except Exception:  # an older or newer FastDeploy without this helper: keep Python's logging
        return
    if target is logger or not target.handlers:
        return
    logger.addHandler(_ToFastDeploy(target))
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def stop_logging_to_worker_log() -> None:
    for handler in [h for h in logger.handlers if isinstance(h, _ToFastDeploy)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


# ------------------------------------------------------------------------------- platforms


def cuda_runtime_blocker() -> str | None:
    """Why the plugin's CUDA runtime cannot run in this worker, or None.

    FastDeploy allows CUDA graphs on XPU and MetaX from 2.5 and on Iluvatar from 2.6
    (``config.py``), through their own runners; DCU builds Paddle for ROCm, where FastDeploy's
    ``is_cuda()`` is false. The plugin's runtime drives ``paddle.device.cuda.graphs`` on NVIDIA
    CUDA only, so anywhere else FastDeploy's own backend must stay.
    """
    platforms = import_or_none("fastdeploy.platforms")
    platform = getattr(platforms, "current_platform", None)
    if platform is not None and not _is_cuda(platform):
        return f"FastDeploy's platform is {_platform_name(platform)}, not NVIDIA CUDA"
    try:
        import paddle
    except ImportError:
        return "Paddle is not importable"
    if paddle.is_compiled_with_rocm():
        return "this Paddle is built for ROCm, not CUDA"
    if not paddle.is_compiled_with_cuda():
        return "this Paddle is not compiled with CUDA"
    return None


def _is_cuda(platform: Any) -> bool:
    try:
        return bool(platform.is_cuda())
    except Exception:  # a platform object we do not know: let Paddle's build decide
        return True


def _platform_name(platform: Any) -> str:
    for name in ("xpu", "dcu", "maca", "iluvatar", "gcu", "intel_hpu", "npu", "cpu"):
        probe = getattr(platform, f"is_{name}", None)
        try:
            if probe is not None and probe():
                return {"maca": "MetaX (MACA)", "intel_hpu": "Intel HPU"}.get(name, name.upper())
        except Exception:
            continue
    return type(platform).__name__


def is_xpu() -> bool:
    platform = getattr(import_or_none("fastdeploy.platforms"), "current_platform", None)
    try:
        return bool(platform is not None and platform.is_xpu())
    except Exception:
        return False


# ---------------------------------------------------------------------------- runner loops

#: The runners with their own CUDA-graph capture loops: GPU (and its DCU and Iluvatar subclasses)
#: and MetaX MACA. The MTP proposer has none; its draft captures inside the target's loop.
RUNNERS = (
    ("fastdeploy.worker.gpu_model_runner", "GPUModelRunner"),
    ("fastdeploy.worker.metax_model_runner", "MetaxModelRunner"),
)
#: The loops, and the phase each captures: ``capture_model`` (decode) on every release,
#: ``capture_model_prefill_and_mixed`` (static split prefill) from 2.5.
CAPTURE_LOOPS = (("capture_model", "decode"), ("capture_model_prefill_and_mixed", "prefill"))


@contextlib.contextmanager
def loop_visits(runner: Any, sizes: tuple[int, ...] | None) -> Iterator[None]:
    """``capture_model()`` walks ``runner.cudagraph_capture_sizes`` (every release, kept
    ascending); with ``sizes`` it walks those alone, and FastDeploy's list is put back after."""
    if not sizes or not hasattr(runner, "cudagraph_capture_sizes"):
        yield
        return
    own = runner.cudagraph_capture_sizes
    runner.cudagraph_capture_sizes = sorted(sizes)
    try:
        yield
    finally:
        runner.cudagraph_capture_sizes = own


#: The worker whose memory profile sizes the KV cache (2.4 through develop).
WORKERS = (("fastdeploy.worker.gpu_worker", "GpuWorker"),)
_RUNNER_PACKAGE = "fastdeploy.worker"
_RUNNER_MODULES = frozenset(module.rpartition(".")[2] for module, _ in (*RUNNERS, *WORKERS))


def loaded_workers() -> list[type]:
    return _loaded(WORKERS)


def loaded_runners() -> list[type]:
    return _loaded(RUNNERS)


def _loaded(classes: tuple[tuple[str, str], ...]) -> list[type]:
    found = []
    for module_name, class_name in classes:
        runner = getattr(sys.modules.get(module_name), class_name, None)
        if runner is not None:
            found.append(runner)
    return found


class _RunnerPackage(types.ModuleType):
    """``fastdeploy.worker``, which reports when one of its runner modules has been executed.

    ``register()`` runs while ``gpu_model_runner`` is still executing (its import of the models
    package loads the plugins), before ``GPUModelRunner`` exists. The import system binds a
    submodule on its parent package right after the submodule has executed, with ``setattr``, so
    that is the first moment the class exists, whatever the import order. Replacing a module's
    ``__class__`` by a ``ModuleType`` subclass is the documented way to customise a module.
    """

    _fd_cudagraph_on_runner: Callable[[], object] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        callback = type(self)._fd_cudagraph_on_runner
        if name in _RUNNER_MODULES and callback is not None:
            callback()


def on_runner_import(callback: Callable[[], object]) -> None:
    """Call ``callback`` now, and whenever a runner module finishes importing."""
    callback()
    package = import_or_none(_RUNNER_PACKAGE)
    if package is None:  # a FastDeploy without it: the backends' constructors call back
        return
    _RunnerPackage._fd_cudagraph_on_runner = staticmethod(callback)
    if type(package) is types.ModuleType:
        package.__class__ = _RunnerPackage


@contextlib.contextmanager
def before_profile_cache_is_cleared(runner: Any, callback: Callable[[], object]) -> Iterator[None]:
    """Call ``callback`` inside the runner's profile run, after its dummy run and before it frees
    the profile's KV cache (``profile_run`` ends with ``clear_cache``, 2.4 through develop): the
    backends exist then, and a probe capture still has a KV cache to run on."""
    clear = runner.clear_cache

    def clear_cache(*args: Any, **kwargs: Any) -> Any:
        try:
            callback()
        except BaseException:
            clear(*args, **kwargs)
            raise
        return clear(*args, **kwargs)

    runner.clear_cache = clear_cache
    try:
        yield
    finally:
        del runner.clear_cache  # the instance attribute; the class's method shows again


def dummy_decode_step(runner: Any, size: int) -> None:
    """One of ``capture_model()``'s plain decode dummy runs: ``size`` requests of one token, so
    the backend captures ``size`` (2.5+ pass ``get_max_chunk_tokens()`` as the prompt tokens,
    2.4 ``max_num_batched_tokens``)."""
    config = runner.fd_config
    chunk = getattr(config, "get_max_chunk_tokens", None)
    num_tokens = chunk() if chunk is not None else config.scheduler_config.max_num_batched_tokens
    runner._dummy_run(num_tokens=num_tokens, batch_size=size, in_capturing=True)


def role_of(backend_layer: object, runner: object) -> str | None:
    """``draft`` for the MTP proposer's model, ``target`` for the runner's, else None.

    The runner keeps the target as ``model`` and the proposer (``proposer``, 2.4 through
    develop) keeps the draft as ``model``; the backbone a backend serves is a sublayer of one."""
    for role, holder in (("draft", getattr(runner, "proposer", None)), ("target", runner)):
        model = getattr(holder, "model", None)
        if model is not None and _holds(model, backend_layer):
            return role
    return None


def _holds(model: Any, layer: object) -> bool:
    if model is layer:
        return True
    sublayers = getattr(model, "sublayers", None)
    try:
        return sublayers is not None and any(sub is layer for sub in sublayers())
    except Exception:
        return False


# ------------------------------------------------------------------------ the lifecycle


class LifecycleCall(NamedTuple):
    """A runner call that frees or re-makes what a graph reads; ``servable``: the model can serve
    (and so capture) right after it, else its weights or KV cache are gone until a later call."""

    name: str
    servable: bool


#: ``sleep``, ``wakeup`` and ``update_weights`` exist from 2.5 (``r3_cherry_pick_2.5`` has no
#: ``sleep`` or ``wakeup``); ``clear_parameters`` and ``update_parameters`` (the legacy RL path) on
#: every release. ``GpuWorker.sleep``, ``wakeup`` and ``update_weights`` only delegate to these.
LIFECYCLE = (
    LifecycleCall("sleep", servable=False),
    LifecycleCall("wakeup", servable=True),
    LifecycleCall("clear_parameters", servable=False),
    LifecycleCall("update_parameters", servable=True),
    LifecycleCall("update_weights", servable=True),
)
#: The worker's start-up: on 2.6 and develop, with ``FD_DETERMINISTIC_MODE=1``, it calls
#: ``share_inputs.reset_share_inputs()`` after ``capture_model()``: a new ``rope_emb``.
START_UP = "graph_optimize_and_warm_up_model"


def input_buffers(runner: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of the runner's input buffers and the MTP draft's: ``share_inputs``
    and ``proposer.model_inputs`` (a dict on 2.4, an ``InputBatch`` object from 2.5), each
    tensor of a list (the KV ``caches``) on its own."""
    found = list(tensors_in("share_inputs.", getattr(runner, "share_inputs", None)))
    proposer = getattr(runner, "proposer", None)
    found += tensors_in("proposer.model_inputs.", getattr(proposer, "model_inputs", None))
    return found


def can_serve(runner: Any) -> bool:
    """Weights and KV cache are both awake (``is_weight_sleeping`` / ``is_kvcache_sleeping``
    from 2.5; 2.4 has neither) and the KV cache exists."""
    if getattr(runner, "is_weight_sleeping", False) or getattr(
        runner, "is_kvcache_sleeping", False
    ):
        return False
    inputs = getattr(runner, "share_inputs", None)
    try:  # 2.5's InputBatch has no get()
        return inputs is not None and "caches" in inputs and inputs["caches"] is not None
    except Exception:
        return False


@contextlib.contextmanager
def inputs_kept(runner: Any) -> Iterator[None]:
    """Put back, in place, the values of the runner's input buffers and the random state after
    a capture the plugin runs: its dummy runs write them, and FastDeploy's deterministic mode
    reset them on purpose right before (``graph_optimize_and_warm_up_model``, 2.6+). The copies
    are kept in host memory (a wake-up has just filled the device with the KV cache)."""
    import paddle

    kept = []
    for name, tensor in input_buffers(runner):
        if ".caches[" not in name:
            with contextlib.suppress(Exception):  # one without memory has nothing to put back
                value = tensor.cpu()
                if value.data_ptr() == tensor.data_ptr():  # already in host memory: the same
                    value = tensor.clone()
                kept.append((tensor, value))
    random_state = paddle.get_rng_state()
    try:
        yield
    finally:
        paddle.set_rng_state(random_state)
        for tensor, value in kept:
            tensor.copy_(value.to(tensor.place), False)


def capture_loops(runner: Any, prefill: bool) -> list[Callable[[], object]]:
    """The runner's capture loops to run again after the plugin released its graphs, in the
    order ``graph_optimize_and_warm_up_model`` runs them: static split prefill (when a prefill
    graph was captured), then decode."""
    loops = [runner.capture_model]
    if prefill and hasattr(runner, "capture_model_prefill_and_mixed"):
        loops.insert(0, runner.capture_model_prefill_and_mixed)
    return loops


# ------------------------------------------------------------------------ custom all-reduce


def custom_allreduce() -> Any:
    """FastDeploy's process-wide custom all-reduce (``communication._TP_AR``), or None: TP = 1,
    ``disable_custom_all_reduce``, or no FastDeploy."""
    communication = import_or_none("fastdeploy.distributed.communication")
    return getattr(communication, "_TP_AR", None)


@contextlib.contextmanager
def allreduce_capturing(allreduce: Any) -> Iterator[None]:
    """FastDeploy's ``capture_custom_allreduce()`` without the registration at its exit.

    Inside it, an all-reduce that a stream capture records runs on the graph's own buffers, and
    any other all-reduce returns uninitialised memory: only the capture goes inside. FastDeploy's
    context registers the new graph's buffers in its ``finally``, a collective over the TP group,
    even when the capture raised; the plugin registers (``register_graph_buffers``) only after
    every rank has said its capture succeeded, so a failed rank is never waited for there.
    ``start_capture`` and the flag are the same on 2.4 through develop.
    """
    if allreduce is None:
        yield
        return
    allreduce.start_capture()
    try:
        yield
    finally:
        allreduce.capturing = False


def register_graph_buffers(allreduce: Any) -> None:
    """The registration of ``stop_capture()``: an ``all_gather_object`` over the TP group."""
    allreduce.register_graph_buffers()


def clear_ipc_handles() -> None:
    """Close every graph buffer IPC handle of the process (FastDeploy #4305). From 2.5 this also
    rewinds the registration slots, so graphs of every backend registered before are invalid."""
    communication = import_or_none("fastdeploy.distributed.communication")
    if communication is not None:
        communication.custom_ar_clear_ipc_handles()
