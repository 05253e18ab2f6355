"""A module named ``paddle`` built on torch: just wide enough to run the plugin's CUDA runtime
(``fd_cudagraph_plugin/core/runtime/cuda.py``) and FastDeploy's own backend on a GPU machine that
has torch but no Paddle.

The plugin's runtime takes every Paddle call it makes from ``paddle_cuda()``; ``RUNTIME_CALLS``
lists them, and this module provides exactly those:

* ``paddle.is_compiled_with_cuda()`` (and ``is_compiled_with_rocm()``, False, for the plugin's
  platform check at ``register()``);
* ``paddle.device.synchronize()``, ``paddle.device.cuda.memory_reserved()``,
  ``paddle.device.cuda.empty_cache()``;
* ``paddle.device.cuda.graphs.CUDAGraph(place=None, mode="thread_local", pool_id=None)`` with
  ``capture_begin``, ``capture_end``, ``replay``, ``reset``, ``print_to_dot_files``; ``mode`` is
  Paddle's capture mode and goes to torch as ``capture_error_mode`` (the same three names);
* ``paddle.base.core.CUDAGraph.gen_new_memory_pool_id()``;
* ``paddle.device.cuda.graphs.is_cuda_graph_supported()``.

Paddle semantics kept because graph backends depend on them:

* a graph with ``pool_id=None`` captures into a private pool; graphs given one pool id share it;
  a pool whose graphs are all reset is freed, and a later capture under the same id starts a
  fresh one (``_Pools``);
* ``graph._graph`` is the core graph once captured, None before (as Paddle's Python class);
* ``Tensor._share_buffer_to(dst)`` makes ``dst`` alias the storage, ``Tensor._clear()`` drops it
  (FastDeploy's backend keeps its outputs that way);
* captures run on one side stream, warmed up before the first capture (torch cannot capture on
  the legacy default stream; Paddle captures on the stream its warm-ups ran on).

What it does not keep is in README.md ("What it does NOT prove"): torch's allocator, streams and
error handling are not Paddle's. ``install(dry_run=True)`` swaps the graphs for no-ops on the
CPU, to check the harness's plumbing without a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types
from typing import ClassVar

import torch

#: The Paddle calls of ``fd_cudagraph_plugin.core.runtime.cuda.paddle_cuda()``, by dotted name.
RUNTIME_CALLS = (
    "is_compiled_with_cuda",
    "is_compiled_with_rocm",
    "device.synchronize",
    "device.cuda.memory_reserved",
    "device.cuda.empty_cache",
    "device.cuda.get_device_name",
    "device.cuda.graphs.CUDAGraph",
    "device.cuda.graphs.is_cuda_graph_supported",
    "base.core.CUDAGraph.gen_new_memory_pool_id",
)
#: Paddle's ``paddle.device.cuda.graphs.ALL_MODES``; torch's ``capture_error_mode`` takes the same.
ALL_MODES = ("global", "thread_local", "relaxed")
_dry_run = False


class CUDAGraphState(enum.IntEnum):
    DISABLE = 0
    WARMUP = 1
    CAPTURE = 2
    REPLAY = 3


def _warmed_stream() -> torch.cuda.Stream:
    """The side stream captures run on, with cuBLAS already initialised on it. On a fresh torch
    stream the first matmul would allocate the stream's cuBLAS workspace inside the first
    capture, into that graph's pool, which could then never be freed (and reusing its pool id
    after a clear trips torch's allocator assert 'use_count > 0')."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(16, 16, dtype=dtype, device="cuda")
            a @ a
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return stream


def _end_allocate_to_pool(pool) -> None:
    """Stop routing the stream's allocations to ``pool`` (after a failed ``capture_end``)."""
    if pool is None:
        return
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn(torch.cuda.current_device(), pool)
            return


class _Pools:
    """Paddle pool ids -> torch pool handles.

    In Paddle a pool is freed with the ``reset()`` of its last graph, and a later capture under the
    same id simply starts a fresh pool (FastDeploy's backend keeps its ``unique_memory_pool_id``
    across ``clear_graph()``). torch refuses to begin a capture into a handle whose graphs are all
    gone (allocator assert 'use_count > 0'), and after a failed capture it keeps the handle marked
    as recording. So each id maps to a torch handle that is replaced once no live graph uses it,
    or after a failed capture into it."""

    next_id = 0
    handle: ClassVar[dict] = {}
    live: ClassVar[dict] = {}
    stale: ClassVar[set] = set()

    @classmethod
    def new_id(cls) -> int:
        cls.next_id += 1
        return 1000 + cls.next_id

    @classmethod
    def torch_handle(cls, pool_id):
        if pool_id not in cls.handle or cls.live.get(pool_id, 0) == 0 or pool_id in cls.stale:
            cls.handle[pool_id] = torch.cuda.graph_pool_handle()
            cls.stale.discard(pool_id)
        return cls.handle[pool_id]


class CUDAGraph:
    """``paddle.device.cuda.graphs.CUDAGraph`` on a ``torch.cuda.CUDAGraph``."""

    _capture_stream = None

    def __init__(self, place=None, mode="thread_local", pool_id=None):
        assert mode in ALL_MODES, f"mode must be one of {ALL_MODES}"  # as Paddle asserts
        self._g = torch.cuda.CUDAGraph()
        self._mode = mode
        self._pool = pool_id
        self._counted = False
        self._graph = None

    def capture_begin(self):
        if CUDAGraph._capture_stream is None:  # one side stream for every capture
            CUDAGraph._capture_stream = _warmed_stream()
        self._stream = CUDAGraph._capture_stream
        self._stream.wait_stream(torch.cuda.current_stream())
        self._ctx = torch.cuda.stream(self._stream)
        self._ctx.__enter__()
        self._torch_pool = None if self._pool is None else _Pools.torch_handle(self._pool)
        try:
            self._g.capture_begin(pool=self._torch_pool, capture_error_mode=self._mode)
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise

    def capture_end(self):
        try:
            self._g.capture_end()
        except BaseException:
            # torch raises at cudaStreamEndCapture before it stops routing the stream's
            # allocations to the graph's pool; stop it here, or every later capture fails
            # ("already recording"). Paddle, unlike this, stays in its capturing state.
            _end_allocate_to_pool(self._torch_pool)
            if self._pool is not None:
                _Pools.stale.add(self._pool)
            raise
        finally:  # a failed capture must not leave the side stream current
            self._ctx.__exit__(None, None, None)
            torch.cuda.current_stream().wait_stream(self._stream)
        self._graph = self._g
        if self._pool is not None:
            _Pools.live[self._pool] = _Pools.live.get(self._pool, 0) + 1
            self._counted = True

    def _uncount(self):
        if self._counted:
            self._counted = False
            _Pools.live[self._pool] -= 1

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._uncount()

    def replay(self):
        self._g.replay()

    def reset(self):
        self._g.reset()
        self._uncount()

    def print_to_dot_files(self, dirname, flags=0):
        pass  # torch dumps only graphs captured in its debug mode; no run here needs dot files

    @staticmethod
    def gen_new_memory_pool_id():
        return _Pools.new_id()


class DryGraph:
    """A no-op graph for the CPU dry run: capture runs the model eagerly, replay does nothing
    (outputs are those of the capture: stale)."""

    _pools = 0
    #: True between capture_begin() and capture_end(), as torch.cuda.is_current_stream_capturing()
    capturing = False

    def __init__(self, place=None, mode="thread_local", pool_id=None):
        assert mode in ALL_MODES, f"mode must be one of {ALL_MODES}"
        self._graph = None

    def capture_begin(self):
        DryGraph.capturing = True

    def capture_end(self):
        DryGraph.capturing = False
        self._graph = types.SimpleNamespace(replay=lambda: None, reset=lambda: None)

    def replay(self):
        self._graph.replay()

    def reset(self):
        self._graph = None

    def print_to_dot_files(self, dirname, flags=0):
        pass

    @staticmethod
    def gen_new_memory_pool_id():
        DryGraph._pools += 1
        return 1000 + DryGraph._pools


def _share_buffer_to(self, dst):
    dst.set_(self)


def _clear(self):
    self.set_()


def _astype(self, dtype):
    return self.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)


def _module(name: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []
    return module


def stream_capturing() -> bool:
    """Is a capture open on the current stream (in the dry run: a no-op capture)?"""
    if _dry_run:
        return DryGraph.capturing
    return torch.cuda.is_current_stream_capturing()


def install(dry_run: bool = False) -> types.ModuleType:
    """Register the ``paddle`` modules in ``sys.modules``; return ``paddle``."""
    global _dry_run
    _dry_run = dry_run
    torch.Tensor._share_buffer_to = _share_buffer_to
    torch.Tensor._clear = _clear
    torch.Tensor.astype = _astype  # Paddle's Tensor.astype, for the plugin's self-check
    torch.set_default_device("cpu" if dry_run else "cuda")
    graph_class = DryGraph if dry_run else CUDAGraph

    def nothing(*args, **kwargs):
        return None

    def zero(*args, **kwargs):
        return 0

    p = _module("paddle", package=True)
    p.Tensor = torch.Tensor
    p.zeros_like = torch.zeros_like
    p.zeros = lambda shape, dtype=None: torch.zeros(shape, dtype=dtype)
    p.is_compiled_with_cuda = lambda: True
    p.is_compiled_with_rocm = lambda: False
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        setattr(p, dtype, getattr(torch, dtype))
    p.allclose = lambda x, y, rtol=1e-05, atol=1e-08, equal_nan=False, name=None: torch.allclose(
        x, y, rtol=rtol, atol=atol, equal_nan=equal_nan
    )
    p.equal_all = lambda x, y, name=None: torch.equal(x, y)

    def _reserved(device=None) -> int:
        # Paddle's memory_reserved() reads one allocator counter
        # (core.device_memory_stat_current_value("Reserved", id)); torch.cuda.memory_reserved()
        # builds and flattens the allocator's whole statistics in Python, about 170 us a call on
        # the H200 host. Read the one counter from torch's C statistics instead.
        stats = torch._C._cuda_memoryStats(torch.cuda.current_device())
        return int(stats["reserved_bytes"]["all"]["current"])

    device = _module("paddle.device", package=True)
    cuda = _module("paddle.device.cuda", package=True)
    if dry_run:
        device.synchronize = cuda.synchronize = nothing
        cuda.empty_cache = nothing
        for name in ("memory_reserved", "memory_allocated", "max_memory_reserved"):
            setattr(cuda, name, zero)
    else:
        device.synchronize = cuda.synchronize = lambda *a, **k: torch.cuda.synchronize()
        cuda.empty_cache = torch.cuda.empty_cache
        cuda.memory_reserved = _reserved
        cuda.memory_allocated = torch.cuda.memory_allocated
        cuda.max_memory_reserved = torch.cuda.max_memory_reserved
    cuda.get_device_name = (
        (lambda *a: "CPU dry run") if dry_run else (lambda *a: torch.cuda.get_device_name())
    )
    graphs = _module("paddle.device.cuda.graphs")
    graphs.CUDAGraph = graph_class
    graphs.ALL_MODES = list(ALL_MODES)
    graphs.is_cuda_graph_supported = lambda: True
    cuda.graphs = graphs
    device.cuda = cuda
    p.device = device

    base = _module("paddle.base", package=True)
    core = _module("paddle.base.core")
    core.CUDAGraph = graph_class  # Paddle's core class; only gen_new_memory_pool_id is used
    base.core = core
    p.base = base

    # What FastDeploy's backend imports for its static-graph (dy2st) path, never run here.
    jit = _module("paddle.jit", package=True)
    dy2static = _module("paddle.jit.dy2static", package=True)
    utils = _module("paddle.jit.dy2static.utils")
    utils.CUDAGraphState = CUDAGraphState
    partial = _module("paddle.jit.dy2static.pir_partial_program")
    partial.replace_run_impl_guard = lambda fn: contextlib.nullcontext()
    dy2static.utils = utils
    dy2static.pir_partial_program = partial
    jit.dy2static = dy2static
    p.jit = jit
    nn = _module("paddle.nn", package=True)
    nn.layer = _module("paddle.nn.layer")
    p.nn = nn

    for module in (p, device, cuda, graphs, base, core, jit, dy2static, utils, partial, nn):
        sys.modules[module.__name__] = module
    sys.modules["paddle.nn.layer"] = nn.layer
    return p


def resolve(paddle: types.ModuleType, dotted: str):
    """``paddle.<dotted>``, or None where the shim lacks it (the setup part checks each call)."""
    value = paddle
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
