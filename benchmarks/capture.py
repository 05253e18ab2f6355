"""Capture-session time per size: FastDeploy's backend against the plugin's.

CPU and repeatable. The model's eager forward has a fixed cost (``--eager-ms``, a sleep), graphs
are no-ops to replay, and FastDeploy's own ``capture_model()`` loop (the stand-in runner under
``tests/fastdeploy_stub``) drives both backends, so the difference is what each backend runs
eagerly per size: warm-ups, the captured run, and the replay that ends a capture.


    python benchmarks/capture.py \
        --fastdeploy-backend PATH/TO/cudagraph_piecewise_backend.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fastdeploy_stub"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import paddle  # noqa: E402
from conftest import TinyBackbone, make_config  # noqa: E402
from dispatch import NoopRuntime, load_fastdeploy_backend  # noqa: E402
from fastdeploy.model_executor.graph_optimization import graph_optimization_backend  # noqa: E402
from fastdeploy.model_executor.graph_optimization.decorator import (  # noqa: E402
    support_graph_optimization,
)
from fastdeploy.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from fd_cudagraph_plugin.core import hooks, process, runtime  # noqa: E402
from fd_cudagraph_plugin.core.backend import CudaGraphBackend  # noqa: E402

EAGER_SECONDS = 0.002


class Timing(NamedTuple):
    seconds: float
    setup: float
    sizes: int
    graphs: int


@support_graph_optimization
class FixedCostBackbone(TinyBackbone):
    def forward(self, ids_remove_padding, forward_meta):
        time.sleep(EAGER_SECONDS)
        return super().forward(ids_remove_padding, forward_meta)


class NoopCudaGraph:
    """Stands in for ``paddle.device.cuda.graphs.CUDAGraph`` inside FastDeploy's backend."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


def time_capture(backend_class, max_num_seqs: int) -> Timing:
    """One ``capture_model()``: its seconds, the one-off session setup, sizes and graphs."""
    graph_optimization_backend.CudaGraphPiecewiseBackend = backend_class
    # A fresh worker before the model is built: each backend belongs to the worker it was built
    # in, and one built before the reset never joins the session capture_model() opens (it then
    # runs every size eagerly as a late capture, and the timing is of eager runs).
    process.reset_for_tests()
    config = make_config(max_num_seqs)
    model = FixedCostBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    started = time.perf_counter()
    runner.capture_model()
    elapsed = time.perf_counter() - started
    hooks.uninstall()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    report = getattr(backend, "capture_report", None)
    setup = report.setup_seconds if report is not None else 0.0
    sizes = len(config.graph_opt_config.cudagraph_capture_sizes)
    return Timing(elapsed, setup, sizes, captured_graphs(backend))


def captured_graphs(backend) -> int:
    """Graphs the backend holds after capture_model(): the plugin's capture report, or the
    entries of FastDeploy's backend that hold a graph."""
    report = getattr(backend, "capture_report", None)
    if report is not None:
        return report.graphs
    entries = getattr(backend, "concrete_size_entries", {})
    return sum(getattr(entry, "cuda_graph", None) is not None for entry in entries.values())


def main(argv: list[str] | None = None) -> int:
    global EAGER_SECONDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fastdeploy-backend", type=Path, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--eager-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians shown")
    args = parser.parse_args(argv)
    EAGER_SECONDS = args.eager_ms / 1e3

    os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"
    # Captures by running once; a replay costs the host little on a GPU, and nothing here.
    runtime.install_runtime(NoopRuntime(), name="simulated")
    backends = {}
    if args.fastdeploy_backend is not None:
        native = load_fastdeploy_backend(args.fastdeploy_backend)
        native.graphs = type("graphs", (), {"CUDAGraph": NoopCudaGraph})
        paddle.device.synchronize = lambda *a, **k: None  # CPU Paddle refuses; a GPU would wait
        backends["FastDeploy backend"] = native.CudaGraphPiecewiseBackend
    backends["fd-cudagraph-plugin"] = CudaGraphBackend
    # Interleaved rounds, medians: load that comes and goes hits both alike.
    timings: dict[str, list[Timing]] = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name, cls in backends.items():
            timings[name].append(time_capture(cls, args.max_num_seqs))
    # A backend that captured fewer graphs than sizes ran them eagerly: its time per size would
    # be of eager runs, not of captures, so no figure is printed for it.
    short = [
        f"{name} captured {run.graphs} of {run.sizes} sizes"
        for name, runs in timings.items()
        for run in runs
        if run.graphs != run.sizes
    ]
    if short:
        print(f"capture.py: {short[0]}; no timing printed.", file=sys.stderr)
        return 1
    rows = [(name, sorted(runs)[len(runs) // 2]) for name, runs in timings.items()]

    first = rows[0][1]
    print(
        f"capture_model() over {first.sizes} sizes (max_num_seqs={args.max_num_seqs}), "
        f"eager forward {args.eager_ms:g} ms, 2 warm-ups per size (FastDeploy's default); every "
        f"backend captured all {first.sizes} sizes in every round.\n"
        f"Median of {args.rounds} interleaved rounds. Per size excludes the session's one-off "
        f"setup (the plan agreement), shown apart."
    )
    reference = (first.seconds - first.setup) / first.sizes
    for name, run in rows:
        per_size = (run.seconds - run.setup) / run.sizes
        print(
            f"  {name:44s} total {run.seconds * 1e3:6.1f} ms (setup {run.setup * 1e3:4.1f} ms)  "
            f"{per_size * 1e3:6.2f} ms/size  x{reference / per_size:.2f} vs {rows[0][0]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
