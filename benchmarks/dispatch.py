"""Replay dispatch overhead: what the backend costs per call above a bare ``graph.replay()``.

CPU only and repeatable: graphs are no-ops, so the figure is pure Python dispatch. With
``--fastdeploy-backend PATH`` (FastDeploy's
``fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py``, from a FastDeploy
checkout or an installed package) FastDeploy's own backend is loaded against the stand-in
``fastdeploy`` package under ``tests/fastdeploy_stub`` and timed in the same run, on the same graphs
and inputs.

    python benchmarks/dispatch.py \
        --fastdeploy-backend PATH/TO/cudagraph_piecewise_backend.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fastdeploy_stub"))
sys.path.insert(0, str(ROOT))

import paddle  # noqa: E402
from fastdeploy.config import (  # noqa: E402
    CacheConfig,
    FDConfig,
    GraphOptimizationConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from fastdeploy.model_executor.forward_meta import ForwardMeta  # noqa: E402

from fd_cudagraph_plugin.core.backend import CudaGraphBackend  # noqa: E402


class NoopGraph:
    __slots__ = ()

    def replay(self) -> None:
        return None

    def release(self) -> None:
        return None


class NoopRuntime:
    """Captures by running once; replays nothing. Isolates dispatch cost."""

    name = "noop"
    real_graphs = False
    warmed = True  # as after FastDeploy's profile run

    def new_pool(self) -> object:
        return None

    def release_pool(self, pool) -> None:
        return None

    def capture(self, fn, pool):
        return NoopGraph(), fn()

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def pool_bytes(self, pool) -> int:
        return 0

    def device_memory(self) -> None:
        return None  # no device: the summary leaves the memory figures out

    def dump_dot(self, graph, path) -> bool:
        return False


def make_config(max_num_seqs: int, speculative: dict | None = None) -> FDConfig:
    return FDConfig(
        graph_opt_config=GraphOptimizationConfig({"use_cudagraph": True}),
        scheduler_config=SchedulerConfig({"max_num_seqs": max_num_seqs}),
        cache_config=CacheConfig({}),
        parallel_config=ParallelConfig({}),
        speculative_config=SpeculativeConfig(speculative or {}),
        test_mode=True,
    )


def load_fastdeploy_backend(path: Path):
    """Load FastDeploy's backend source file as a module (the seed copy has a path line on top)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].strip().endswith(".py") and " " not in lines[0].strip():
        lines = lines[1:]
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_loader("fastdeploy_native_backend", loader=None)
    )
    sys.modules[module.__name__] = module
    exec(compile("\n".join(lines), str(path), "exec"), module.__dict__)
    return module


def model_forward(ids_remove_padding, forward_meta):
    return ids_remove_padding


def per_call_us(fn, number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


def cycling(backend, steps: list[dict]):
    """A zero-argument call that feeds ``backend`` the steps in turn."""
    state = {"i": 0}
    cycle = len(steps)

    def call():
        i = state["i"]
        state["i"] = i + 1 if i + 1 < cycle else 0
        return backend(**steps[i])

    return call


def bare_replay(steps: list[dict]):
    graph = NoopGraph()
    state = {"i": 0}
    cycle = len(steps)

    def call():
        i = state["i"]
        state["i"] = i + 1 if i + 1 < cycle else 0
        steps[i]  # the same indexing work the backend calls do
        return graph.replay()

    return call


def scenario(
    title: str, config: FDConfig, steps: list[dict], captures: list[dict], native_module, args
) -> None:
    """Time every variant on the same steps, interleaved round by round, best round each."""
    sizes = config.graph_opt_config.cudagraph_capture_sizes

    def captured(cls, check_addresses: str = "off"):
        os.environ["FD_CUDAGRAPH_CHECK_ADDRESSES"] = check_addresses
        backend = cls(
            fd_config=config,
            dy_runnable=model_forward,
            runnable=model_forward,
            runtime=NoopRuntime(),
        )
        del os.environ["FD_CUDAGRAPH_CHECK_ADDRESSES"]
        for step in captures:
            backend(**step)
        return backend

    variants = {
        "bare": bare_replay(steps),
        "plugin": cycling(captured(CudaGraphBackend), steps),
        "sampled:100": cycling(captured(CudaGraphBackend, "sampled:100"), steps),
        "always": cycling(captured(CudaGraphBackend, "always"), steps),
    }
    if native_module is not None:
        native = native_module.CudaGraphPiecewiseBackend(
            fd_config=config, dy_runnable=model_forward, runnable=model_forward
        )
        buffer = steps[0]["ids_remove_padding"]
        for (size, _prefill), entry in native.concrete_size_entries.items():
            # Its capture needs CUDA; give each entry the same no-op graph and a buffer instead.
            entry.cuda_graph = NoopGraph()
            entry.output_buffers = [buffer[:size]]
        variants["fastdeploy"] = cycling(native, steps)
    # Interleave the variants round by round and keep each one's best round, so load that comes
    # and goes on the machine hits all of them alike.
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeat):
        for name, fn in variants.items():
            best[name] = min(best[name], per_call_us(fn, args.number))
    base = best["bare"]

    def row(label: str, name: str, note: str = "") -> None:
        print(f"{label:48s} {best[name]:7.3f} us  (overhead {best[name] - base:.3f} us{note})")

    print(f"{title}: {len(sizes)} capture sizes (largest {sizes[0]}), {len(steps)} decode steps")
    print(f"{'bare replay() call':48s} {base:7.3f} us")
    row("fd-cudagraph-plugin dispatch", "plugin")
    row("  with FD_CUDAGRAPH_CHECK_ADDRESSES=sampled:100", "sampled:100")
    row("  with FD_CUDAGRAPH_CHECK_ADDRESSES=always", "always")
    if "fastdeploy" in best:
        row("FastDeploy backend dispatch", "fastdeploy")
        ratio = (best["plugin"] - base) / max(best["fastdeploy"] - base, 1e-9)
        print(f"overhead ratio plugin / FastDeploy: {ratio:.2f} (goal <= 0.40)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fastdeploy-backend", type=Path, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    native_module = None
    if args.fastdeploy_backend is not None:
        native_module = load_fastdeploy_backend(args.fastdeploy_backend)
    rng = random.Random(0)

    def meta(view, running: int = 0) -> ForwardMeta:
        return ForwardMeta(view, True, real_bsz=running)

    config = make_config(args.max_num_seqs)
    sizes = config.graph_opt_config.cudagraph_capture_sizes
    buffer = paddle.zeros([sizes[0]], dtype="int64")
    steps = []
    for _ in range(64):
        n = rng.randint(1, sizes[0])
        steps.append({"ids_remove_padding": buffer[:n], "forward_meta": meta(buffer[:n])})
    captures = [{"ids_remove_padding": buffer[:s], "forward_meta": meta(buffer[:s])} for s in sizes]
    scenario("plain decode", config, steps, captures, native_module, args)

    # MTP with one draft token: graphs keyed by running requests (forward_meta.real_bsz).
    config = make_config(args.max_num_seqs // 2, {"method": "mtp", "num_speculative_tokens": 1})
    sizes = config.graph_opt_config.cudagraph_capture_sizes
    buffer = paddle.zeros([sizes[0]], dtype="int64")
    steps = []
    for _ in range(64):
        running = rng.randint(1, sizes[0] // 2)
        n = rng.randint(running, 2 * running)  # 0 or 1 accepted draft token per request
        steps.append({"ids_remove_padding": buffer[:n], "forward_meta": meta(buffer[:n], running)})
    captures = [
        {"ids_remove_padding": buffer[:s], "forward_meta": meta(buffer[:s], s // 2)} for s in sizes
    ]
    print()
    scenario("speculative decode (MTP, k=1)", config, steps, captures, native_module, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
