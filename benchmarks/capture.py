"""Capture-session time per size: FastDeploy's backend against the plugin's.

CPU and repeatable. The model's eager forward has a fixed cost (``--eager-ms``, a sleep), graphs
are no-ops to replay, and FastDeploy's own ``capture_model()`` loop (the stand-in runner under
``tests/fastdeploy_stub``) drives both backends, so the difference is what each backend runs
eagerly per size: warm-ups, the captured run, and the replay that ends a capture. Each size's
dummy run also runs one eager prefill step, outside either backend.

``--recapture`` times a second ``capture_model()`` after ``clear_graph()`` on the target, as
FastDeploy recaptures after an RL weight update or a wake-up: FastDeploy's backend warms every
size up again in full, the plugin once per size it captured before (core/warmups.py). It prints
the warm-ups per size each backend ran (forwards through the backend, less the captured one;
for the plugin also its ``capture_report``). Every time per size is the median over the rounds
with the least and the most; with ``--fastdeploy-backend`` each capture also gets the per-round
ratio plugin / FastDeploy, "below noise" where the rounds disagree on which was faster. Without it
only the plugin's own figures are printed.

    python benchmarks/capture.py [--recapture] \
        --fastdeploy-backend PATH/TO/cudagraph_piecewise_backend.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fastdeploy_stub"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
# Paddle's import warns that ccache is missing, which says nothing about what is timed here.
warnings.filterwarnings("ignore", message="No ccache found")

import paddle  # noqa: E402
from conftest import TinyBackbone, make_config  # noqa: E402
from dispatch import (  # noqa: E402
    BackendFileError,
    NoopRuntime,
    add_backend_option,
    bounded,
    load_fastdeploy_backend,
)
from fastdeploy.model_executor.graph_optimization import graph_optimization_backend  # noqa: E402
from fastdeploy.model_executor.graph_optimization.decorator import (  # noqa: E402
    support_graph_optimization,
)
from fastdeploy.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from fd_cudagraph_plugin.core import hooks, process, runtime  # noqa: E402
from fd_cudagraph_plugin.core.backend import CudaGraphBackend  # noqa: E402

EAGER_SECONDS = 0.002
PLUGIN, FASTDEPLOY = "fd-cudagraph-plugin", "FastDeploy backend"


class Timing(NamedTuple):
    seconds: float
    setup: float
    sizes: int
    graphs: int
    #: Forwards through the backend per size, less the captured one.
    warmups: float
    #: The warm-ups per graph in the plugin's capture_report (None for FastDeploy's backend).
    reported_warmups: tuple[int, ...] | None

    @property
    def per_size(self) -> float:
        """Seconds per size, without the session's one-off setup."""
        return (self.seconds - self.setup) / self.sizes


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


def time_capture(
    backend_class, max_num_seqs: int, recapture: bool = False, warmups: int | None = None
) -> list[Timing]:
    """One ``capture_model()`` and, with ``recapture``, ``clear_graph()`` and a second one.
    ``warmups``: ``cudagraph_num_of_warmups`` (None: FastDeploy's default, 2)."""
    graph_optimization_backend.CudaGraphPiecewiseBackend = backend_class
    # A fresh worker before the model is built: each backend belongs to the worker it was built
    # in, and one built before the reset never joins the session capture_model() opens (it then
    # runs every size eagerly as a late capture, and the timing is of eager runs).
    process.reset_for_tests()
    graph = {} if warmups is None else {"cudagraph_num_of_warmups": warmups}
    config = make_config(max_num_seqs, **graph)
    model = FixedCostBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()  # builds the backend (GraphOptBackend makes it at its first call)
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    forwards = count_forwards(backend)
    timings = [timed_capture(runner, backend, forwards)]
    if recapture:
        model.clear_graph_opt_backend(fd_config=config)  # as FastDeploy's clear_parameters
        timings.append(timed_capture(runner, backend, forwards))
    hooks.uninstall()  # after every capture: the plugin's session wraps capture_model()
    return timings


def count_forwards(backend) -> list[int]:
    """Count the calls the backend makes of ``dy_runnable`` (its warm-ups and captured runs):
    both backends take the model from there at capture time."""
    count = [0]
    forward = backend.dy_runnable

    def counted(**kwargs):
        count[0] += 1
        return forward(**kwargs)

    backend.dy_runnable = counted
    return count


def timed_capture(runner, backend, forwards: list[int]) -> Timing:
    forwards[0] = 0
    started = time.perf_counter()
    runner.capture_model()
    elapsed = time.perf_counter() - started
    report = getattr(backend, "capture_report", None)
    setup = report.setup_seconds if report is not None else 0.0
    reported = None if report is None else tuple(sorted({r.warmups for r in report.records}))
    sizes = len(runner.fd_config.graph_opt_config.cudagraph_capture_sizes)
    graphs = captured_graphs(backend)
    return Timing(elapsed, setup, sizes, graphs, forwards[0] / sizes - 1, reported)


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
    add_backend_option(parser)
    parser.add_argument("--max-num-seqs", type=bounded(1, 512), default=64)
    parser.add_argument("--eager-ms", type=bounded(0, 1000), default=2)
    parser.add_argument(
        "--rounds", type=bounded(1, 100), default=5, help="interleaved rounds; medians shown"
    )
    parser.add_argument(
        "--recapture", action="store_true", help="also clear_graph() + capture_model() again"
    )
    parser.add_argument(
        "--fastdeploy-warmups",
        type=bounded(1, 10),
        default=None,
        help="with --fastdeploy-backend, also time FastDeploy's backend with "
        "--graph-optimization-config '{\"cudagraph_num_of_warmups\": N}' in the same rounds",
    )
    args = parser.parse_args(argv)
    EAGER_SECONDS = args.eager_ms / 1e3

    os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"
    # Captures by running once; a replay costs the host little on a GPU, and nothing here.
    runtime.install_runtime(NoopRuntime(), name="simulated")
    backends = {}
    if args.fastdeploy_backend is not None:
        try:
            native = load_fastdeploy_backend(args.fastdeploy_backend)
        except BackendFileError as error:
            print(f"capture.py: {error}.", file=sys.stderr)
            return 2
        native.graphs = type("graphs", (), {"CUDAGraph": NoopCudaGraph})
        paddle.device.synchronize = lambda *a, **k: None  # CPU Paddle refuses; a GPU would wait
        backends[FASTDEPLOY] = (native.CudaGraphPiecewiseBackend, None)
        if args.fastdeploy_warmups is not None:
            each = "warm-up" if args.fastdeploy_warmups == 1 else "warm-ups"
            tuned = f"{FASTDEPLOY}, {args.fastdeploy_warmups} {each}"
            backends[tuned] = (native.CudaGraphPiecewiseBackend, args.fastdeploy_warmups)
    elif args.fastdeploy_warmups is not None:
        print("capture.py: --fastdeploy-warmups needs --fastdeploy-backend.", file=sys.stderr)
        return 2
    backends[PLUGIN] = (CudaGraphBackend, None)
    # Interleaved rounds, the order reversed on odd ones, medians: load that comes and goes
    # hits both alike. timings[name][round] is [first capture] or [first, recapture].
    timings: dict[str, list[list[Timing]]] = {name: [] for name in backends}
    for round_ in range(args.rounds):
        order = list(backends) if round_ % 2 == 0 else list(reversed(backends))
        for name in order:
            backend_class, warmups = backends[name]
            timings[name].append(
                time_capture(backend_class, args.max_num_seqs, args.recapture, warmups)
            )
    # A backend that captured fewer graphs than sizes ran them eagerly: its time per size would
    # be of eager runs, not of captures, so no figure is printed for it.
    short = [
        f"{name} captured {run.graphs} of {run.sizes} sizes"
        for name, rounds in timings.items()
        for runs in rounds
        for run in runs
        if run.graphs != run.sizes
    ]
    if short:
        print(f"capture.py: {short[0]}; no timing printed.", file=sys.stderr)
        return 1
    first = timings[next(iter(backends))][0][0]
    print(
        f"capture_model() over {first.sizes} sizes (max_num_seqs={args.max_num_seqs}), "
        f"eager forward {args.eager_ms:g} ms, 2 warm-ups per size (FastDeploy's default); every "
        f"backend captured all {first.sizes} sizes in every round.\n"
        f"{args.rounds} interleaved rounds: the median round's total, and time per size as the "
        "median (min..max over rounds). Per size excludes the session's one-off setup (the plan "
        "agreement), shown apart."
        + ("" if FASTDEPLOY in backends else " Without --fastdeploy-backend: the plugin alone.")
    )
    print_section(timings, 0)
    if args.recapture:
        print(
            "clear_graph() on the target, then capture_model() again (recapture, as after an RL "
            "weight update or a wake-up):"
        )
        print_section(timings, 1)
    return 0


def print_section(timings: dict[str, list[list[Timing]]], index: int) -> None:
    """One row per backend for capture ``index`` (0 first, 1 recapture): the median round, and
    the least and most time per size over the rounds. With FastDeploy's backend, the plugin's
    time as a multiple of FastDeploy's, per round; none without it (a row against itself says
    nothing)."""
    names = list(timings)
    per_size = {
        name: [runs[index].per_size * 1e3 for runs in rounds] for name, rounds in timings.items()
    }
    for name, rounds in timings.items():
        run = sorted(runs[index] for runs in rounds)[len(rounds) // 2]
        reported = (
            ""
            if run.reported_warmups is None
            else f" (its report: {', '.join(map(str, run.reported_warmups))})"
        )
        each = "warm-up" if run.warmups == 1 else "warm-ups"
        print(
            f"  {name:22s} total {run.seconds * 1e3:6.1f} ms (setup {run.setup * 1e3:4.1f} ms)  "
            f"{spread(per_size[name], 2)} ms/size  {run.warmups:g} {each}/size{reported}"
        )
    for other in names:
        if other.startswith(FASTDEPLOY):
            print(f"  {PLUGIN} / {other}'s time per size, per round: {ratio_text(per_size, other)}")


def spread(values: list[float], digits: int) -> str:
    """``median (min..max)``."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def ratio_text(per_size: dict[str, list[float]], other: str = FASTDEPLOY) -> str:
    """The per-round ratios plugin / FastDeploy: median (min..max), and "below noise" where the
    rounds disagree on which backend was faster."""
    ratios = [p / f for p, f in zip(per_size[PLUGIN], per_size[other], strict=True)]
    text = f"{spread(ratios, 2)}x"
    return f"{text}: below noise" if min(ratios) <= 1 <= max(ratios) else text


if __name__ == "__main__":
    sys.exit(main())
