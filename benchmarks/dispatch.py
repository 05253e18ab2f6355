"""Replay dispatch overhead: what the backend costs per call above a bare ``graph.replay()``.

CPU only and repeatable: graphs are no-ops, so the figure is pure Python dispatch (CPU stand-in:
this repository's stand-in ``fastdeploy`` and CPU Paddle). With ``--fastdeploy-backend PATH``
(FastDeploy's ``fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py``, from
a FastDeploy checkout or an installed package) FastDeploy's own backend is loaded against the
stand-in ``fastdeploy`` package under ``tests/fastdeploy_stub`` and timed in the same run, on the
same graphs and inputs; without it only the plugin's own figures are printed, and no ratio.

Every variant runs in every round, interleaved, and each row gives the median over the rounds with
the least and the most; a difference between two rows whose per-round differences change sign is
"below noise". The ``FD_CUDAGRAPH_CHECK_ADDRESSES`` rows are built with the option really in force
(options are read once per process, so they are read again for each), and after the timing each
is checked to trip the guard as often as its setting says on an input moved to a new address.

    python benchmarks/dispatch.py \
        --fastdeploy-backend PATH/TO/cudagraph_piecewise_backend.py
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import timeit
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fastdeploy_stub"))
sys.path.insert(0, str(ROOT))
# Paddle's import warns that ccache is missing, which says nothing about what is timed here.
warnings.filterwarnings("ignore", message="No ccache found")
# FastDeploy's backend logs to files under FD_LOG_DIR (default ./log): a folder of its own,
# removed at exit, so a run leaves nothing behind.
if "FD_LOG_DIR" not in os.environ:
    os.environ["FD_LOG_DIR"] = tempfile.mkdtemp(prefix="fd-cudagraph-bench-")
    atexit.register(shutil.rmtree, os.environ["FD_LOG_DIR"], ignore_errors=True)

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

from fd_cudagraph_plugin.core import process  # noqa: E402
from fd_cudagraph_plugin.core.backend import CudaGraphBackend  # noqa: E402
from fd_cudagraph_plugin.core.errors import AddressGuardError  # noqa: E402

#: FD_CUDAGRAPH_CHECK_ADDRESSES per plugin row, and how many of GUARD_CALLS calls with a moved
#: input must trip the guard.
GUARD_CALLS = 100
CHECKS = {"plugin": ("off", 0), "sampled:100": ("sampled:100", 1), "always": ("always", 100)}


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

    def mark_warm(self) -> None:
        self.warmed = True

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


class BackendFileError(Exception):
    """--fastdeploy-backend names no loadable FastDeploy backend; the message says why."""


def load_fastdeploy_backend(path: Path):
    """Load FastDeploy's backend source file as a module (the seed copy has a path line on top)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or error
        raise BackendFileError(
            f"--fastdeploy-backend {path}: cannot read it ({why}); name FastDeploy's "
            "cudagraph_piecewise_backend.py"
        ) from None
    if lines and lines[0].strip().endswith(".py") and " " not in lines[0].strip():
        lines = lines[1:]
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_loader("fastdeploy_native_backend", loader=None)
    )
    sys.modules[module.__name__] = module
    try:
        exec(compile("\n".join(lines), str(path), "exec"), module.__dict__)
    except Exception as error:  # whatever a file that is no such backend raises
        raise BackendFileError(
            f"--fastdeploy-backend {path}: it does not load as FastDeploy's backend "
            f"({type(error).__name__}: {str(error)[:200]}); name FastDeploy's "
            "fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py"
        ) from None
    if not hasattr(module, "CudaGraphPiecewiseBackend"):
        raise BackendFileError(
            f"--fastdeploy-backend {path}: it defines no CudaGraphPiecewiseBackend; name "
            "FastDeploy's cudagraph_piecewise_backend.py"
        )
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


def plugin_backend(config: FDConfig, captures: list[dict], check_addresses: str):
    """The plugin's backend with FD_CUDAGRAPH_CHECK_ADDRESSES in force, its sizes captured.

    A worker reads its options once per process (``process.current().options``); setting the
    variable alone would leave every backend after the first with the first one's options.
    """
    os.environ["FD_CUDAGRAPH_CHECK_ADDRESSES"] = check_addresses
    process.current().forget_options()
    try:
        backend = CudaGraphBackend(
            fd_config=config,
            dy_runnable=model_forward,
            runnable=model_forward,
            runtime=NoopRuntime(),
        )
    finally:
        del os.environ["FD_CUDAGRAPH_CHECK_ADDRESSES"]
        process.current().forget_options()
    for step in captures:
        backend(**step)
    return backend


def guard_trips(backend, step: dict) -> int:
    """How many of GUARD_CALLS calls of ``step`` with its input moved to a new address the
    address guard refuses."""
    moved = step["ids_remove_padding"].clone()
    meta = step["forward_meta"]
    kwargs = {
        "ids_remove_padding": moved,
        "forward_meta": ForwardMeta(moved, True, real_bsz=meta.real_bsz),
    }
    trips = 0
    for _ in range(GUARD_CALLS):
        try:
            backend(**kwargs)
        except AddressGuardError:
            trips += 1
    return trips


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``median (min..max)``."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def difference(first: Sequence[float], second: Sequence[float]) -> str:
    """``first - second`` per round: its median and range, or "below noise" where the rounds
    disagree on its sign."""
    deltas = [a - b for a, b in zip(first, second, strict=True)]
    text = f"{statistics.median(deltas):+.3f} us ({min(deltas):+.3f}..{max(deltas):+.3f})"
    if min(deltas) <= 0 <= max(deltas):
        return f"{text}: below noise"
    return text


def scenario(
    title: str, config: FDConfig, steps: list[dict], captures: list[dict], native_module, args
) -> bool:
    """Time every variant on the same steps, interleaved round by round. False when an address
    check row did not check as its setting says (its timing would be of something else)."""
    sizes = config.graph_opt_config.cudagraph_capture_sizes
    backends = {
        name: plugin_backend(config, captures, value) for name, (value, _) in CHECKS.items()
    }
    variants: dict[str, Callable[[], object]] = {"bare": bare_replay(steps)}
    variants.update({name: cycling(backend, steps) for name, backend in backends.items()})
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
    # Interleave the variants round by round, so load that comes and goes on the machine hits
    # all of them alike; rounds[name][r] is round r's time per call.
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            rounds[name].append(per_call_us(fn, args.number))
    trips = {name: guard_trips(backends[name], steps[0]) for name in CHECKS}
    wrong = [
        f"{value}: {trips[name]} of {GUARD_CALLS} (expected {expected})"
        for name, (value, expected) in CHECKS.items()
        if trips[name] != expected
    ]
    bare = rounds["bare"]
    overhead = {
        name: [t - b for t, b in zip(times, bare, strict=True)] for name, times in rounds.items()
    }

    print(
        f"{title}: {len(sizes)} capture sizes (largest {sizes[0]}), {len(steps)} decode steps; "
        f"{args.repeat} interleaved rounds of {args.number} calls; us per call, median "
        "(min..max over rounds)"
    )
    print(f"{'bare replay() call':48s} {spread(bare)}")

    def row(label: str, name: str, against: str | None = None) -> None:
        versus = f"; {difference(rounds[name], rounds[against])} vs plain" if against else ""
        print(f"{label:48s} {spread(rounds[name])}, overhead {spread(overhead[name])}{versus}")

    row("fd-cudagraph-plugin dispatch", "plugin")
    row("  with FD_CUDAGRAPH_CHECK_ADDRESSES=sampled:100", "sampled:100", "plugin")
    row("  with FD_CUDAGRAPH_CHECK_ADDRESSES=always", "always", "plugin")
    print(
        f"address guard, {GUARD_CALLS} calls with the input moved: "
        + ", ".join(f"{value} refused {trips[name]}" for name, (value, _) in CHECKS.items())
    )
    if wrong:
        print(
            "dispatch.py: FD_CUDAGRAPH_CHECK_ADDRESSES did not take effect as set ("
            + "; ".join(wrong)
            + "), so its rows measure something else.",
            file=sys.stderr,
        )
        return False
    if native_module is not None:
        row("FastDeploy backend dispatch", "fastdeploy")
        ratios = [
            p / max(f, 1e-9)
            for p, f in zip(overhead["plugin"], overhead["fastdeploy"], strict=True)
        ]
        print(
            f"overhead ratio plugin / FastDeploy, per round: {spread(ratios, 2)}; "
            f"plugin - FastDeploy: {difference(rounds['plugin'], rounds['fastdeploy'])}"
        )
    return True


def bounded(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high``."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 12 else high + 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}")
        return value

    return parse


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fastdeploy-backend",
        type=Path,
        default=None,
        help="FastDeploy's cudagraph_piecewise_backend.py, timed beside the plugin (default: none)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_option(parser)
    parser.add_argument("--max-num-seqs", type=bounded(2, 512), default=256)
    parser.add_argument("--number", type=bounded(1, 10_000_000), default=20000)
    parser.add_argument("--repeat", type=bounded(2, 1000), default=7)
    args = parser.parse_args(argv)
    # Each backend's summary table at exit is no figure of this benchmark.
    logging.getLogger("fd_cudagraph_plugin").setLevel(logging.WARNING)
    native_module = None
    if args.fastdeploy_backend is not None:
        try:
            native_module = load_fastdeploy_backend(args.fastdeploy_backend)
        except BackendFileError as error:
            print(f"dispatch.py: {error}.", file=sys.stderr)
            return 2
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
    if not scenario("plain decode", config, steps, captures, native_module, args):
        return 1

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
    if not scenario("speculative decode (MTP, k=1)", config, steps, captures, native_module, args):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
