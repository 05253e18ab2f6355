"""What checking for memory that moved costs (issue 30): CPU stand-in, one rank.

A backend on the stand-in runner (``tests/fastdeploy_stub``) whose backbone holds ``--layers``
Linear layers (two parameters each) besides the KV-reading model of ``tests/graph_reads.py``, with
``--caches`` KV tensors in ``share_inputs``. Timed, median (min..max) over ``--rounds`` rounds of
``--number`` calls each:

* ``take``: the fingerprint a backend takes when a capture session ends;
* ``compare``: the comparison every rank makes after a lifecycle call (what moved since capture);
* ``after rsync update``: everything the plugin adds to an ``update_weights`` that moves nothing,
  its agreement point included (one rank: the point answers at once).

None of these runs on the replay path; the first replay of each graph after a lifecycle call goes
through the general path once (an agreement point, then back on the fast path).

    python benchmarks/moved.py [--layers 300] [--caches 128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fastdeploy_stub"), str(ROOT / "tests"), str(ROOT)]
warnings.filterwarnings("ignore", message="No ccache found")
os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--caches", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20)
    args = parser.parse_args()

    import logging

    import paddle
    from conftest import make_config
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner
    from fastdeploy.worker.gpu_worker import GpuWorker
    from graph_reads import DecoratedKV
    from simulated import TestRuntime

    from fd_cudagraph_plugin import plugin
    from fd_cudagraph_plugin.core import lifecycle, moved, process, runtime, seam

    logging.getLogger("fd_cudagraph_plugin").setLevel(logging.WARNING)
    plugin.register()
    runtime.install_runtime(TestRuntime())
    config = make_config(4, dynamic_load_weight=True)
    config.load_config.load_strategy = "rsync"
    model = DecoratedKV(fd_config=config)
    runner = GPUModelRunner(config, model)
    worker = GpuWorker(config, runner)
    runner.profile_run()
    worker.initialize_cache(num_gpu_blocks=4)
    worker.graph_optimize_and_warm_up_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    backend.layer.extra = paddle.nn.LayerList([paddle.nn.Linear(8, 8) for _ in range(args.layers)])
    caches = runner.share_inputs["caches"]
    runner.share_inputs["caches"] = caches + [
        paddle.zeros_like(caches[0]) for _ in range(args.caches - len(caches))
    ]
    for entry in backend.table.all():  # as if the graphs read every cache
        entry.addresses += tuple(
            (f"forward_meta.caches[{i}]", t.data_ptr())
            for i, t in enumerate(runner.share_inputs["caches"])
        )
    owner = lifecycle.state(process.current())
    owner.captured("decode", [backend], runner)
    taken = moved.at_capture(
        backend.layer, seam.input_buffers(runner), backend.input_addresses(), None
    )
    params, buffers = len(taken.params), len(taken.buffers)
    assert owner.moved(backend, runner) == []

    rows = {
        "take": lambda: owner.captured("decode", [backend], runner),
        "compare": lambda: owner.moved(backend, runner),
        "after rsync update": lambda: owner.after("update_weights", runner, True),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, call in rows.items():
            seconds = timeit.timeit(call, number=args.number)
            times[name].append(seconds / args.number * 1e3)
    assert backend.captures == len(backend.table.all())  # nothing was captured again
    print(
        f"Memory that moved, CPU stand-in, one rank: {params} parameters, {buffers} runner "
        f"buffers the graphs read, {len(backend.table.all())} graphs; ms per call, median "
        f"(min..max) of {args.rounds} rounds of {args.number}"
    )
    for name, values in times.items():
        print(
            f"  {name:<20} {statistics.median(values):7.3f} ({min(values):.3f}..{max(values):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
