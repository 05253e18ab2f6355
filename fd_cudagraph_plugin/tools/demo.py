"""``fd-cudagraph demo``: capture and serve a small decoder through the backend, on any machine.

It does what FastDeploy's worker does with the backend, in miniature: persistent input buffers
updated in place, a FastDeploy-shaped config, capture of every size largest first, then a stream
of decode steps of varying token counts. Every step, captures included, is a call of the model as
FastDeploy's runner makes it, which goes through the model's ``GraphOptBackend`` (``DemoGraphOpt``)
to the backend, so the backend counts each step as in a worker (the stats file, metrics,
``stats()``), those ``GraphOptBackend`` runs without it included. Every step's output is checked
against an eager run of the same inputs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fd_cudagraph_plugin.core import seam
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.observability import format_table
from fd_cudagraph_plugin.core.options import PluginOptions, unknown_options
from fd_cudagraph_plugin.core.sizes import padding_table
from fd_cudagraph_plugin.tools import paddle_import
from fd_cudagraph_plugin.tools.capture_rules import DECODE_CAP
from fd_cudagraph_plugin.tools.wording import plural, shown

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32)
#: The largest size the demo captures: FastDeploy's largest decode graph, the bound ``plan`` and
#: ``tune`` apply too. The demo allocates buffers and a padding table by the largest size.
DEMO_MAX_SIZE = DECODE_CAP
DEMO_SIZE_BOUND = "the largest decode graph FastDeploy captures (min(512, max_num_seqs))"
#: Most steps one demo serves: minutes on a CPU. Each step's work is bounded by the largest size.
DEMO_MAX_STEPS = 1_000_000
#: Seeds as numpy and Paddle take them (uint32).
DEMO_MAX_SEED = 2**32 - 1


@dataclass
class DemoMeta:
    """The ``ForwardMeta`` fields the backend reads (FastDeploy's own class when installed)."""

    ids_remove_padding: Any
    step_use_cudagraph: bool = True
    exist_prefill: bool = False
    real_bsz: int = 0
    seq_lens_this_time: Any = None


@dataclass
class DemoReport:
    runtime: str
    real_graphs: bool
    sizes: list[int]
    #: What chose the runtime (``--runtime simulated``, ``FD_CUDAGRAPH_RUNTIME=simulated``), or
    #: "" when the demo chose it from Paddle's build.
    runtime_source: str = ""
    steps: int = 0
    mismatches: int = 0
    #: Served steps the demo's ``GraphOptBackend`` ran without the backend (above the largest
    #: size), as it counted them; the report prints the backend's count, which must agree.
    eager_above_max: int = 0
    graph_seconds: float = 0.0
    eager_seconds: float = 0.0
    capture_summary: str = ""
    stats: dict = field(default_factory=dict)


def build_model(vocab: int = 512, hidden: int = 64, layers: int = 4):
    import paddle

    class TinyDecoder(paddle.nn.Layer):
        """Token-wise residual blocks: padded rows never change real rows, as in FastDeploy."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = paddle.nn.Embedding(vocab, hidden)
            self.blocks = paddle.nn.LayerList(
                [
                    paddle.nn.Sequential(
                        paddle.nn.LayerNorm(hidden),
                        paddle.nn.Linear(hidden, 2 * hidden),
                        paddle.nn.GELU(),
                        paddle.nn.Linear(2 * hidden, hidden),
                    )
                    for _ in range(layers)
                ]
            )
            self.norm = paddle.nn.LayerNorm(hidden)

        def forward(self, ids_remove_padding, forward_meta):
            hidden_states = self.embed(ids_remove_padding)
            for block in self.blocks:
                hidden_states = hidden_states + block(hidden_states)
            return self.norm(hidden_states)

        def __call__(self, **kwargs):
            # FastDeploy's @support_graph_optimization: a decorated model's call goes through its
            # GraphOptBackend, which the runner never bypasses.
            graph_opt_backend = self.__dict__.get("graph_opt_backend")
            if graph_opt_backend is None:
                return self.forward(**kwargs)
            return graph_opt_backend(**kwargs)

    paddle.seed(0)
    model = TinyDecoder()
    model.eval()
    return model


WARMUPS = 2  # FastDeploy's default cudagraph_num_of_warmups


def build_fd_config(sizes: list[int], max_num_seqs: int) -> Any:
    """FastDeploy's ``FDConfig`` when it is installed, else an object with the same fields."""
    try:
        return _fastdeploy_config(sizes, max_num_seqs, WARMUPS)
    except Exception:  # not installed, or a FastDeploy whose FDConfig wants more than a demo has
        return _equivalent_config(sizes, max_num_seqs, WARMUPS)


def _fastdeploy_config(sizes: list[int], max_num_seqs: int, warmups: int) -> Any:
    from fastdeploy.config import (
        CacheConfig,
        FDConfig,
        GraphOptimizationConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    graph = GraphOptimizationConfig(
        {
            "use_cudagraph": True,
            "cudagraph_capture_sizes": list(sizes),
            "cudagraph_num_of_warmups": warmups,
        }
    )
    # FastDeploy's own graph tests stand a model config in the same way.
    model = SimpleNamespace(
        max_model_len=2048, architectures=["TinyDecoder"], mm_max_tokens_per_item=None
    )
    return FDConfig(
        model_config=model,
        graph_opt_config=graph,
        scheduler_config=SchedulerConfig({"max_num_seqs": max_num_seqs}),
        cache_config=CacheConfig({}),
        parallel_config=ParallelConfig({}),
        speculative_config=SpeculativeConfig({}),
        test_mode=True,
    )


def _equivalent_config(sizes: list[int], max_num_seqs: int, warmups: int) -> Any:
    descending = sorted(set(sizes), reverse=True)
    table = padding_table(descending)
    graph = SimpleNamespace(
        use_cudagraph=True,
        graph_opt_level=0,
        full_cuda_graph=True,
        cudagraph_capture_sizes=descending,
        cudagraph_capture_sizes_prefill=[],
        cudagraph_num_of_warmups=warmups,
        real_shape_to_captured_size={n: table[n] for n in range(len(table))},
        real_bsz_to_captured_size={},
        use_unique_memory_pool=True,
        cudagraph_only_prefill=False,
        max_capture_shape_prefill=512,
    )
    return SimpleNamespace(
        graph_opt_config=graph,
        speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, disable_custom_all_reduce=False),
    )


class DemoGraphOpt:
    """FastDeploy's ``GraphOptBackend`` in miniature (2.5 through develop, dynamic decode): a step
    its runner did not flag for graphs, or above the largest capture size, runs ``dy_runnable``
    without the CUDA-graph backend; every other goes to the backend, built at the first call as
    FastDeploy builds it. The model holds it as ``graph_opt_backend``, where the plugin finds a
    model's ``GraphOptBackend`` to count the steps it runs alone (``seam.py``)."""

    def __init__(self, runnable: Any, fd_config: Any, runtime: Any) -> None:
        self.fd_config = fd_config
        self.runnable = runnable
        self.dy_runnable = runnable
        self.runtime = runtime
        self.largest = max(fd_config.graph_opt_config.cudagraph_capture_sizes)
        self.cudagraph_piecewise_backend: Any = None
        #: Steps run without the backend for being above the largest size (the demo's own tally).
        self.above_largest = 0

    def __call__(self, **kwargs: Any) -> Any:
        if self.cudagraph_piecewise_backend is None:
            from fd_cudagraph_plugin.core.backend import CudaGraphBackend

            self.cudagraph_piecewise_backend = CudaGraphBackend(
                fd_config=self.fd_config,
                dy_runnable=self.dy_runnable,
                runnable=self.runnable,
                runtime=self.runtime,
            )
        meta = kwargs["forward_meta"]
        tokens = meta.ids_remove_padding.shape[0]
        if not meta.step_use_cudagraph or tokens > self.largest:
            self.above_largest += tokens > self.largest
            return self.dy_runnable(**kwargs)
        return self.cudagraph_piecewise_backend(**kwargs)


def _meta_class():
    module = seam.import_or_none(seam.FORWARD_META_MODULE)
    return getattr(module, "ForwardMeta", DemoMeta)


def check_demo_inputs(sizes: list[int] | None, steps: int, seed: int) -> list[int] | None:
    """The demo's inputs, or a ``ConfigError`` naming the option, the value and the bound: its
    work and memory grow with the largest size and the step count."""

    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if sizes is not None:
        bad = [size for size in sizes if not count(size) or not 1 <= size <= DEMO_MAX_SIZE]
        if not sizes or bad:
            raise ConfigError(
                f"--sizes must be integers in 1..{DEMO_MAX_SIZE}, {DEMO_SIZE_BOUND}; got "
                f"{shown(bad[0]) if bad else 'none'}."
            )
    if not count(steps) or not 1 <= steps <= DEMO_MAX_STEPS:
        raise ConfigError(f"--steps must be an integer in 1..{DEMO_MAX_STEPS}; got {shown(steps)}.")
    if not count(seed) or not 0 <= seed <= DEMO_MAX_SEED:
        raise ConfigError(f"--seed must be an integer in 0..{DEMO_MAX_SEED}; got {shown(seed)}.")
    return sizes


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse what the demo would otherwise ignore: the plugin's options are read as in a worker
    (a bad or removed one stops it), FD_CUDAGRAPH_BACKEND=native (the demo always runs the
    plugin's backend) and ``FD_CUDAGRAPH_*`` names that are no option."""
    chosen = PluginOptions.from_env(environ)
    if chosen.backend == "native":
        raise ConfigError(
            "FD_CUDAGRAPH_BACKEND=native: the demo always runs the plugin's backend (native keeps "
            "FastDeploy's own, which needs a FastDeploy worker and CUDA). Unset "
            "FD_CUDAGRAPH_BACKEND to run the demo."
        )
    unknown = unknown_options(environ)
    if unknown:
        raise ConfigError(
            f"{'; '.join(unknown)}: no fd-cudagraph-plugin option has "
            f"{'this name' if len(unknown) == 1 else 'these names'}. Fix or unset "
            f"{'it' if len(unknown) == 1 else 'them'} (fd-cudagraph doctor lists the options)."
        )


def choose_runtime(flag: str | None, environ: Mapping[str, str], has_cuda: bool) -> tuple[str, str]:
    """The runtime the demo runs and what chose it: ``--runtime``, else FD_CUDAGRAPH_RUNTIME,
    else cuda where Paddle has CUDA (source ""). A cuda runtime without CUDA is refused, naming
    the input that asked for it."""
    env = (environ.get("FD_CUDAGRAPH_RUNTIME") or "").strip().lower()
    if flag is not None:
        name, source = flag, f"--runtime {flag}"
    elif env:
        name, source = env, f"FD_CUDAGRAPH_RUNTIME={env}"
    else:
        name, source = ("cuda" if has_cuda else "simulated"), ""
    if name == "cuda" and not has_cuda:
        fix = "pass --runtime simulated" + ("" if flag else " (or unset FD_CUDAGRAPH_RUNTIME)")
        raise ConfigError(
            f"{source}: this Paddle is not compiled with CUDA, so the demo cannot capture CUDA "
            f"graphs here. Install paddlepaddle-gpu, or {fix} to run the demo on the simulated "
            "runtime (CUDA-graph replay semantics on the CPU)."
        )
    return name, source


@contextlib.contextmanager
def private_log_dir(environ: MutableMapping[str, str]) -> Iterator[None]:
    """FD_LOG_DIR pointed at a temporary directory, removed at the end, unless the user set it or
    asked for files under it (FD_CUDAGRAPH_DUMP_DOT=1): a capture session records its graph
    memory under FD_LOG_DIR (FastDeploy's default ``log``, under the current directory), and the
    demo writes nothing there unless asked."""
    asked = (environ.get("FD_CUDAGRAPH_DUMP_DOT") or "").strip() == "1"
    if "FD_LOG_DIR" in environ or asked:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="fd-cudagraph-demo-") as directory:
        environ["FD_LOG_DIR"] = directory
        try:
            yield
        finally:
            environ.pop("FD_LOG_DIR", None)


def run_demo(
    sizes: list[int] | None = None, steps: int = 200, seed: int = 0, runtime_name: str | None = None
) -> DemoReport:
    """Capture and serve; ``runtime_name`` None: FD_CUDAGRAPH_RUNTIME, else cuda where Paddle
    has CUDA, else simulated. Raises ``ConfigError`` for inputs and options it cannot honour."""
    import paddle

    sizes = sorted(set(check_demo_inputs(sizes, steps, seed) or DEFAULT_SIZES), reverse=True)
    check_environment(os.environ)
    runtime_name, source = choose_runtime(
        runtime_name, os.environ, bool(paddle.is_compiled_with_cuda())
    )
    with private_log_dir(os.environ):
        return _serve(sizes, steps, seed, runtime_name, source)


def _serve(sizes: list[int], steps: int, seed: int, runtime_name: str, source: str) -> DemoReport:
    import paddle

    from fd_cudagraph_plugin.core.runtime import make_runtime
    from fd_cudagraph_plugin.core.session import CaptureSession

    runtime = make_runtime(runtime_name)
    max_size = sizes[0]
    fd_config = build_fd_config(sizes, max_num_seqs=max_size)
    model = build_model()
    graph_opt = DemoGraphOpt(model.forward, fd_config, runtime)
    model.graph_opt_backend = graph_opt
    meta_class = _meta_class()
    rng = random.Random(seed)
    # Persistent buffer, as FastDeploy's share_inputs: every step writes into it in place and
    # passes a view of its head, so a captured graph keeps reading the right memory.
    ids_buffer = paddle.zeros([max_size * 2], dtype="int64")
    report = DemoReport(runtime.name, runtime.real_graphs, sizes, source)

    def prepare(tokens: int) -> dict:
        """The runner's input preparation: fill the persistent buffer in place, pass a view."""
        if tokens:
            fresh = paddle.to_tensor([rng.randrange(512) for _ in range(tokens)], dtype="int64")
            ids_buffer[:tokens] = fresh
        ids = ids_buffer[:tokens]
        meta = meta_class(ids_remove_padding=ids, step_use_cudagraph=tokens > 0)
        return {"ids_remove_padding": ids, "forward_meta": meta}

    with paddle.no_grad():
        # capture_model(): exact sizes, largest first, in a capture session as in FastDeploy.
        with CaptureSession("decode", fd_config=fd_config) as session:
            for size in sizes:
                model(**prepare(size))
        report.capture_summary = session.report.summary()
        progress = _progress(steps)
        for _ in range(steps):
            progress.update()
            tokens = rng.choice(
                [rng.randint(1, max_size)] * 9 + [rng.randint(max_size + 1, 2 * max_size)]
            )
            kwargs = prepare(tokens)
            started = time.perf_counter()
            out = model(**kwargs)[:tokens]
            runtime.synchronize()
            report.graph_seconds += time.perf_counter() - started
            started = time.perf_counter()
            expected = model.forward(**kwargs)
            runtime.synchronize()
            report.eager_seconds += time.perf_counter() - started
            report.steps += 1
            if not bool(paddle.allclose(out, expected, rtol=1e-5, atol=1e-5)):
                report.mismatches += 1
        progress.close()
    backend = graph_opt.cudagraph_piecewise_backend
    report.eager_above_max = graph_opt.above_largest
    report.stats = backend.stats()
    backend.clear_graph()
    return report


def format_report(report: DemoReport) -> str:
    lines = []
    chosen = f" ({report.runtime_source})" if report.runtime_source else ""
    if report.real_graphs:
        lines.append(f"runtime: {report.runtime}{chosen} (real CUDA graphs)")
    elif report.runtime_source:
        lines.append(
            f"runtime: {report.runtime}{chosen} -- graphs run on the simulated runtime (CUDA-graph "
            "replay semantics on the CPU); step times are not GPU figures"
        )
    else:
        lines.append(
            f"runtime: {report.runtime} -- this Paddle has no CUDA, so graphs run on the simulated "
            "runtime (CUDA-graph replay semantics on the CPU); step times are not GPU figures"
        )
    stats = report.stats
    lines.append(report.capture_summary)
    # Every figure is of served steps, as the backend counted them (what its stats file and
    # metrics say): the captures ran in a capture session, counted apart
    # (stats()["capture_time"]), and the steps GraphOptBackend ran without the backend, above
    # the largest size, are its "oversized_decode" steps.
    replays = sum(stats["replays"].values())
    fallbacks = dict(stats["eager_fallbacks"])
    above = fallbacks.pop("oversized_decode", 0)
    in_backend = sum(fallbacks.values())
    reasons = ", ".join(f"{why} {n}" for why, n in sorted(fallbacks.items()))
    lines.append(
        f"served {plural(report.steps, 'decode step')}: {replays} replayed a graph, "
        f"{above + in_backend} ran eagerly ({above} above the largest size, "
        f"{plural(report.sizes[0], 'token')}, which GraphOptBackend runs without the backend; "
        f"{in_backend} in the backend{f': {reasons}' if reasons else ''})"
    )
    lines.append(
        format_table(stats, f"the backend, which counted {replays + above + in_backend} of them")
    )
    if report.real_graphs:
        lines.append(
            f"step time: graph {report.graph_seconds / max(report.steps, 1) * 1e3:.3f} ms, "
            f"eager {report.eager_seconds / max(report.steps, 1) * 1e3:.3f} ms"
        )
    else:
        lines.append("step time: not measured (simulated runtime)")
    verdict = "OK" if report.mismatches == 0 else "MISMATCH"
    lines.append(
        f"replay vs eager: {plural(report.mismatches, 'mismatch', 'mismatches')} in "
        f"{plural(report.steps, 'step')} -- {verdict}"
    )
    return "\n".join(lines)


#: Seconds between two progress updates when standard error is no terminal (a log file).
PROGRESS_SECONDS = 5.0


def _progress(steps: int) -> Any:
    """Served steps and their rate on standard error, as the capture's bar: a bar on a terminal,
    a line every few seconds elsewhere."""
    from tqdm import tqdm

    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(
        total=steps,
        desc="demo: served",
        unit="step",
        file=sys.stderr,
        mininterval=0.5 if tty else PROGRESS_SECONDS,
        dynamic_ncols=tty,
        ascii=not tty,
    )


def run_command(sizes: list[int] | None, steps: int, seed: int, runtime: str | None) -> int:
    """``fd-cudagraph demo``: Paddle imported once and quietly (``paddle_import``), then
    ``run_demo``; 0, or 1 on a mismatch."""
    try:
        paddle_import.load("paddle")
    except ImportError:
        print(
            "fd-cudagraph demo needs Paddle. Install the CPU wheel with pip install "
            "paddlepaddle==3.3.1 (what a checkout's demo extra installs: pip install "
            "'/path/to/fd-cudagraph-plugin[demo]'); on a GPU machine keep your paddlepaddle-gpu.",
            file=sys.stderr,
        )
        return 2
    # The demo prints the capture summary and the stats table itself; keep warnings only, and
    # show them: the plugin's log goes to FastDeploy's worker log, which here is under a
    # temporary FD_LOG_DIR removed at the end, so a failed write (a stats file on a full disk)
    # would be said nowhere.
    plugin_logger = logging.getLogger("fd_cudagraph_plugin")
    plugin_logger.setLevel(logging.WARNING)
    shown = logging.StreamHandler(sys.stderr)
    shown.setLevel(logging.WARNING)
    shown.setFormatter(logging.Formatter("fd-cudagraph demo: %(levelname)s: %(message)s"))
    plugin_logger.addHandler(shown)
    try:
        report = run_demo(sizes=sizes, steps=steps, seed=seed, runtime_name=runtime)
    finally:
        plugin_logger.removeHandler(shown)
    paddle_import.check()
    print(format_report(report))
    return 0 if report.mismatches == 0 else 1
