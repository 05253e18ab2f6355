"""``GraphOptBackend``: picks eager, static (SOT) or the piecewise CUDA-graph backend per call.

The module global ``CudaGraphPiecewiseBackend`` is looked up when the first call builds the
backend, so rebinding it here (what a model-register plugin does) swaps the implementation.
Routing and the constructor call follow the release chosen in ``fastdeploy._stub_version``.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, get_type_hints

from fastdeploy import _stub_version
from fastdeploy.model_executor.graph_optimization.cudagraph_piecewise_backend import (
    CudaGraphPiecewiseBackend,
)
from fastdeploy.model_executor.graph_optimization.utils import (
    in_profile_run_mode,
    in_sot_warmup_mode,
)

in_warmup_mode = in_sot_warmup_mode


def emulate_release_2_4(enabled: bool = True) -> None:
    """Test helper kept for older tests: ``_stub_version.use("2.4")`` (or back to develop)."""
    _stub_version.use("2.4" if enabled else "develop")


def _legacy_two_arg() -> bool:
    return _stub_version.current() == "2.4"


def resolve_dynamic_dims(arg: Any, name: str, annotation: Any) -> None:
    """Mark dim 0 of tensor arguments, and of the tensor fields of dataclass arguments such as
    ``ForwardMeta``, dynamic, so one program serves every token count. Upstream resolves by the
    annotations (``Annotated``/``Optional``/lists too); this goes by value, which the test models
    need."""
    import dataclasses

    import paddle

    if isinstance(arg, paddle.Tensor):
        if arg.ndim > 0:
            paddle.jit.marker.dynamic_dims(arg, [0])
    elif dataclasses.is_dataclass(arg) and not isinstance(arg, type):
        for field in dataclasses.fields(arg):
            value = getattr(arg, field.name, None)
            if isinstance(value, paddle.Tensor) and value.ndim > 0:
                paddle.jit.marker.dynamic_dims(value, [0])


def apply_to_static_optimization(fn: Callable, backend: Any) -> Callable:
    """The SOT wrapper, with upstream's three modes.

    * profile run (``profile_run_guard``): the plain dygraph function;
    * warm-up (``sot_warmup_guard``, which ``capture_model`` sets): translate with SOT, then insist
      on one generated code without a graph break, and keep that code;
    * otherwise: call the kept code (an AssertionError before any warm-up).
    """
    from paddle.jit import sot
    from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache

    forward_fn = fn
    signature = inspect.signature(forward_fn)
    try:
        hints = get_type_hints(forward_fn)
    except Exception:  # unresolvable annotations: nothing to mark
        hints = {}
    translated = sot.symbolic_translate(forward_fn, training=False, backend=backend)
    unsafe_static_fn: Callable | None = None

    def warmup_impl(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal unsafe_static_fn
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name, arg in bound.arguments.items():
            if name != "self":
                resolve_dynamic_dims(arg, name, hints.get(name))
        result = translated(self, *args, **kwargs)
        guarded_codes, _ = OpcodeExecutorCache().cache[forward_fn.__code__]
        if len(guarded_codes) > 1:
            raise RuntimeError(
                "Model has multiple generated code, please check all dynamic dim has marked."
            )
        code = guarded_codes[0][0][0]
        if any(name.startswith("$") for name in code.co_names):
            raise RuntimeError("Model has breakgraph, please set env SOT_LOG_LEVEL=3 to check it.")
        unsafe_static_fn = types.FunctionType(
            code,
            forward_fn.__globals__,
            forward_fn.__name__,
            forward_fn.__defaults__,
            forward_fn.__closure__,
        )
        return result

    @functools.wraps(forward_fn)
    def static_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_profile_run_mode():
            return forward_fn(self, *args, **kwargs)
        if in_warmup_mode():
            return warmup_impl(self, *args, **kwargs)
        assert unsafe_static_fn is not None
        return unsafe_static_fn(self, *args, **kwargs)

    return static_forward


def _to_static_backend(level: int) -> Any:
    from paddle.jit.dy2static.utils import Backend

    return Backend.CINN if level > 1 else Backend.PHI


class GraphOptBackend:
    cudagraph_piecewise_backend: Any = None

    def __init__(self, runnable: Callable, fd_config: Any) -> None:
        goc = fd_config.graph_opt_config
        self.fd_config = fd_config
        self.runnable = runnable
        self.dy_runnable = runnable
        self.max_captre_size = goc.cudagraph_capture_sizes[0]  # IndexError on [], as upstream
        if _stub_version.at_least("2.5"):
            self.max_captre_size_prefill = goc.max_capture_shape_prefill
        self._debug_count_total_step = 0
        self._debug_count_cudagraph_replay = 0
        if goc.graph_opt_level > 0:
            static_fn = apply_to_static_optimization(
                runnable.__func__, _to_static_backend(goc.graph_opt_level)
            )
            self.runnable = static_fn.__get__(runnable.__self__)
        if _legacy_two_arg():
            self.cudagraph_switch_threshold = (
                1024 if goc.graph_opt_level > 0 else self.max_captre_size
            )

    def _create_piecewise_backend(self) -> Any:
        if _legacy_two_arg():
            return CudaGraphPiecewiseBackend(fd_config=self.fd_config, runnable=self.runnable)
        return CudaGraphPiecewiseBackend(
            fd_config=self.fd_config, dy_runnable=self.dy_runnable, runnable=self.runnable
        )

    def _skip_graph(self, forward_meta: Any, real_shape: int) -> bool:
        if not forward_meta.step_use_cudagraph:
            return True
        goc = self.fd_config.graph_opt_config
        if forward_meta.exist_prefill:
            if goc.graph_opt_level > 0 and not goc.full_cuda_graph:
                return real_shape > self.max_captre_size_prefill
            return True  # dynamic and static full: prefill is never graphed
        return real_shape > self.max_captre_size

    def __call__(self, **kwargs: Any) -> Any:
        if _legacy_two_arg():
            return self._call_2_4(kwargs)
        if not self.fd_config.graph_opt_config.use_cudagraph:
            return self.runnable(**kwargs)
        if self.cudagraph_piecewise_backend is None:
            self.cudagraph_piecewise_backend = self._create_piecewise_backend()
        forward_meta = kwargs["forward_meta"]
        assert forward_meta.ids_remove_padding is not None
        real_shape = forward_meta.ids_remove_padding.shape[0]
        if real_shape > 0:
            self._debug_count_total_step += 1
        if self._skip_graph(forward_meta, real_shape):
            return self.dy_runnable(**kwargs)
        self._debug_count_cudagraph_replay += 1
        return self.cudagraph_piecewise_backend.__call__(**kwargs)

    def _call_2_4(self, kwargs: dict) -> Any:
        # 2.4 routes by a token threshold alone; it never reads exist_prefill.
        self._debug_count_total_step += 1
        if not self.fd_config.graph_opt_config.use_cudagraph:
            return self.runnable(**kwargs)
        if self.cudagraph_piecewise_backend is None:
            self.cudagraph_piecewise_backend = self._create_piecewise_backend()
        forward_meta = kwargs["forward_meta"]
        assert forward_meta.ids_remove_padding is not None
        real_shape = forward_meta.ids_remove_padding.shape[0]
        if (not forward_meta.step_use_cudagraph) or real_shape > self.cudagraph_switch_threshold:
            return self.dy_runnable(**kwargs)
        self._debug_count_cudagraph_replay += 1
        return self.cudagraph_piecewise_backend.__call__(**kwargs)

    def clear_cudagraph_piecewise_backend(self) -> None:
        # AttributeError when no backend was built yet, as upstream.
        self.cudagraph_piecewise_backend.clear_graph()
