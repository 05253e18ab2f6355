"""Test models that read what FastDeploy's lifecycle moves, as a CUDA graph reads it, and
FastDeploy's own backend run on CPU with graphs that replay the same way.

A CUDA graph reads the device addresses it saw at capture: the parameters, the KV cache
(``forward_meta.caches``), ``rope_emb`` (``forward_meta.rotary_embs``) and the input buffers.
The simulated runtime replays by running the captured function again on the kwargs it was
captured with, so a new *tensor object* (a new ``share_inputs["caches"]`` list, a new
``rope_emb``, new draft inputs) is never seen, as a new address is not. Two things it cannot show
by itself, and these models add:

* a ``Parameter`` keeps its identity when FastDeploy re-makes the weights (``_clear_data`` then
  ``_share_buffer_to``: the same object at a new address), so the replayed function would read the
  new weights;
* ``clear_cache`` deletes ``caches`` from the runner's current ``ForwardMeta``, which may be the
  object a graph was captured with.

So each model reads every such tensor through ``_as_captured``: while a graph is captured it
keeps a view of the tensor's memory (``tensor.view``, which keeps the memory, not the object),
and while that graph replays it reads those views: the memory at the capture-time address, which
the stand-in fills with NaN when it frees it (``fastdeploy/_stub_memory.py``). Outside a capture
or replay (eager, warm-ups) it reads the live tensors.

The models are token-wise: row ``i`` of the output depends on token ``i``, its position's row of
``rotary_embs``, slot ``i`` of the first block of each cache, the mean of every cache, and the
weights, never on other tokens; so a graph padded to a larger size gives the same rows as eager
on the real tokens. They read the caches and never write them: ``prefill`` writes them, in place,
as a prefill's attention would.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import paddle
import paddle.nn.functional as F
from conftest import DraftBackbone, TinyBackbone
from fastdeploy.model_executor.graph_optimization.decorator import support_graph_optimization
from paddle.jit.sot.psdb import in_sot

from fd_cudagraph_plugin.core import runtime

#: FastDeploy's own backend (develop), as other tests and the benchmarks find it.
FASTDEPLOY_BACKEND = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "seed"
    / "cudagraph_piecewise_backend.py.txt"
)


def current_graph() -> tuple[str, object] | None:
    """``("capture" | "replay", graph)`` while a graph is captured or replayed, else None: the
    plugin's simulated runtime, or ``ReplayingCudaGraph`` inside FastDeploy's backend."""
    sim = runtime._RUNTIMES.get("simulated")
    in_flight = getattr(sim, "in_flight", None)
    if in_flight is not None:
        return ("capture" if sim.capturing else "replay", ("simulated", in_flight))
    if ReplayingCudaGraph.capturing is not None:
        return ("capture", ReplayingCudaGraph.capturing)
    if ReplayingCudaGraph.replaying is not None:
        return ("replay", ReplayingCudaGraph.replaying)
    return None


class ReadsAtCaptureAddresses:
    """Mixin: ``_as_captured(name, tensor)`` is what a graph would read (module docstring)."""

    def _as_captured(self, name: str, tensor: paddle.Tensor) -> paddle.Tensor:
        graph = current_graph()
        if graph is None or in_sot():
            return tensor
        phase, key = graph
        reads = self.__dict__.setdefault("_graph_reads", {})
        if phase == "capture":
            reads[(key, name)] = tensor.view(tensor.shape)
            return tensor
        return reads.get((key, name), tensor)

    def _weights(self) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        return (
            self._as_captured("embed.weight", self.embed.weight),
            self._as_captured("proj.weight", self.proj.weight),
            self._as_captured("proj.bias", self.proj.bias),
        )

    def _moved_inputs(self, tokens: int, forward_meta: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
        """What rows ``[0, tokens)`` read from ``rotary_embs`` and ``caches``: a rope factor
        and an additive KV term, as ``[tokens, hidden]`` each."""
        caches = forward_meta.caches
        if not caches:
            raise RuntimeError(
                "this model reads forward_meta.caches: start the runner as FastDeploy does "
                "(profile_run, then update_share_input_block_num) before the first step"
            )
        rope = self._as_captured("rotary_embs", forward_meta.rotary_embs)[:tokens]
        kv = 0.0
        for index, cache in enumerate(caches):
            cache = self._as_captured(f"caches[{index}]", cache)
            slots = cache[0, 0]  # [block_size, hidden]
            repeat = -(-tokens // slots.shape[0])
            kv = kv + (paddle.tile(slots, [repeat, 1])[:tokens] + cache.mean()) / (index + 1)
        return rope, kv


class KVBackbone(ReadsAtCaptureAddresses, TinyBackbone):
    """A target backbone whose output depends on its weights, ``rotary_embs`` and ``caches``."""

    num_hidden_layers = 1

    def forward(self, ids_remove_padding: paddle.Tensor, forward_meta: Any):
        if not in_sot():
            self.calls += 1
        embed, weight, bias = self._weights()
        tokens = ids_remove_padding.shape[0]
        rope, kv = self._moved_inputs(tokens, forward_meta)
        hidden = paddle.tanh(F.linear(F.embedding(ids_remove_padding, embed), weight, bias))
        return hidden * rope + kv


class KVDraft(ReadsAtCaptureAddresses, DraftBackbone):
    """An MTP draft that reads the same, from the proposer's ``model_inputs``."""

    num_hidden_layers = 1

    def forward(
        self, ids_remove_padding: paddle.Tensor, previous_hidden_states: paddle.Tensor, forward_meta
    ):
        if not in_sot():
            self.calls += 1
        embed, weight, bias = self._weights()
        tokens = ids_remove_padding.shape[0]
        rope, kv = self._moved_inputs(tokens, forward_meta)
        x = F.embedding(ids_remove_padding, embed) + previous_hidden_states
        return paddle.tanh(F.linear(x, weight, bias)) * rope + kv


@support_graph_optimization
class DecoratedKV(KVBackbone):
    """``KVBackbone`` behind FastDeploy's ``@support_graph_optimization``."""


@support_graph_optimization
class DecoratedKVDraft(KVDraft):
    """``KVDraft`` behind ``@support_graph_optimization``, as ``Ernie4_5_MTPModel`` is."""


def prefill(caches: list[paddle.Tensor] | None, seed: int) -> None:
    """Write every cache in place, as a prefill's attention writes the prompt's KV."""
    for index, cache in enumerate(caches or []):
        values = paddle.arange(int(cache.numel()), dtype="float32").reshape(cache.shape)
        cache[:] = paddle.sin(values * 0.37 + seed + index)


# ------------------------------------------------------------- FastDeploy's backend on CPU


def _tensors(outputs: Any) -> list[paddle.Tensor]:
    if isinstance(outputs, paddle.Tensor):
        return [outputs]
    return [t for t in outputs if isinstance(t, paddle.Tensor)]


class ReplayingCudaGraph:
    """Stands in for ``paddle.device.cuda.graphs.CUDAGraph`` inside FastDeploy's backend.

    ``capture_begin`` / ``capture_end`` bracket one run of the backend's runnable, which
    ``recording`` keeps with the kwargs it was called with and views of its outputs' memory
    (FastDeploy's backend hands that memory to its output buffers and clears the outputs);
    ``replay`` runs it again on those kwargs and writes the results into that memory, as the
    simulated runtime does for the plugin."""

    capturing: ClassVar[ReplayingCudaGraph | None] = None
    replaying: ClassVar[ReplayingCudaGraph | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.work: tuple[Any, list[paddle.Tensor]] | None = None
        self.replays = 0

    def capture_begin(self) -> None:
        ReplayingCudaGraph.capturing = self

    def capture_end(self) -> None:
        ReplayingCudaGraph.capturing = None

    def replay(self) -> None:
        run, outputs = self.work
        ReplayingCudaGraph.replaying = self
        try:
            fresh = _tensors(run())
        finally:
            ReplayingCudaGraph.replaying = None
        for target, value in zip(outputs, fresh, strict=True):
            paddle.assign(value, output=target)
        self.replays += 1


def recording(runnable: Any) -> Any:
    def run(**kwargs: Any) -> Any:
        graph = ReplayingCudaGraph.capturing
        outputs = runnable(**kwargs)
        if graph is not None:
            graph.work = (lambda: runnable(**kwargs), [t.view(t.shape) for t in _tensors(outputs)])
        return outputs

    return run


def fastdeploy_backend_class() -> type:
    """FastDeploy's ``CudaGraphPiecewiseBackend`` (the file at ``FASTDEPLOY_BACKEND``, loaded
    against the stand-in), its graphs ``ReplayingCudaGraph``s. The caller makes
    ``paddle.device.synchronize`` a no-op (CPU Paddle refuses it)."""
    lines = FASTDEPLOY_BACKEND.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].strip().endswith(".py"):
        lines = lines[1:]  # the seed copy names its upstream path on its first line
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_loader("fastdeploy_own_backend", loader=None)
    )
    sys.modules[module.__name__] = module
    exec(compile("\n".join(lines), str(FASTDEPLOY_BACKEND), "exec"), module.__dict__)
    module.graphs = types.SimpleNamespace(CUDAGraph=ReplayingCudaGraph)
    upstream = module.CudaGraphPiecewiseBackend

    class FastDeployBackend(upstream):
        def __init__(self, fd_config: Any, dy_runnable: Any, runnable: Any) -> None:
            super().__init__(fd_config, recording(dy_runnable), recording(runnable))

    return FastDeployBackend
