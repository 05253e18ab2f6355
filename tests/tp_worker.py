"""One tensor-parallel rank of a FastDeploy worker's capture, over a real paddle.distributed group.

Started once per rank by Paddle's launcher (gloo on CPU Paddle; see ``test_collective.py``)::

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir LOG \\
        tests/tp_worker.py --out DIR --scenario equal-plans --scenario capture-oom@1

Each rank runs the scenarios in the order given and writes ``DIR/<scenario>.rank<R>.json``: what the
scenario returned plus ``outcome``, ``"ok"`` or the name of the plugin error it raised, ``message``
and ``seconds``. A rank exits 0 once every scenario has run, whatever the outcomes; anything else
(an unexpected exception, a collective that never returns) is a failure of the test itself.

Every scenario is a fresh worker: a new simulated runtime, a new custom all-reduce whose
registration is a real ``all_gather_object`` over the TP group (as FastDeploy's), and its own
namespace in the job's store for the plugin's agreement. A scenario named ``name@R``
injects its fault on rank R only.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "fastdeploy_stub"))
os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"
os.environ["MIN_GRAPH_SIZE"] = "0"  # SOT compiles the tiny models (static full probe)
OOM = "CUDA error(2): out of memory"


@dataclass(frozen=True)
class Rank:
    index: int
    world: int
    group: Any  # the TP group, as FastDeploy's worker builds it with new_group
    faulty: bool  # this rank is the one the scenario's fault is injected on
    out: str  # the launch's folder, where a scenario keeps its files (the test removes it)


SCENARIOS: dict[str, Callable[[Rank], dict[str, Any]]] = {}


def scenario(name: str) -> Callable:
    def add(function: Callable[[Rank], dict[str, Any]]) -> Callable[[Rank], dict[str, Any]]:
        SCENARIOS[name] = function
        return function

    return add


def tp_config(rank: Rank, max_num_seqs: int = 8, **graph_args: Any) -> Any:
    """An FDConfig of one TP rank: size, rank and group where FastDeploy's worker sets them."""
    from conftest import make_config

    config = make_config(max_num_seqs, tp=rank.world, **graph_args)
    config.parallel_config.tensor_parallel_rank = rank.index
    config.parallel_config.tp_group = rank.group
    return config


def capture(
    config: Any, *, model_cls: Any = None, runner_cls: Any = None, prepare: Any = None
) -> Any:
    """FastDeploy's start-up on one rank: build the model, profile run, ``capture_model()``.

    Returns the backend, whose ``capture_report`` says what the session captured.
    """
    from conftest import DecoratedMixing
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    model = (model_cls or DecoratedMixing)(fd_config=config)
    if prepare is not None:
        prepare(model)
    runner = (runner_cls or GPUModelRunner)(config, model)
    runner.profile_run()
    runner.capture_model()
    return model.graph_opt_backend.cudagraph_piecewise_backend


def _faulty_model(rank: Rank, stage: str, size: int = 4) -> type:
    """A model that raises ``OOM`` on the faulty rank at ``stage`` of ``size``'s capture."""
    from conftest import DecoratedMixing

    from fd_cudagraph_plugin.core import process, runtime

    sim = runtime.get_runtime("simulated")

    class Faulty(DecoratedMixing):
        eager_runs = 0

        def forward(self, ids_remove_padding, forward_meta):
            if rank.faulty and process.current().session is not None:
                tokens = ids_remove_padding.shape[0]
                if tokens == size:
                    if stage == "capture" and sim.capturing:
                        raise RuntimeError(OOM)
                    if not sim.capturing and not sim.replaying:
                        type(self).eager_runs += 1
                        # warm-ups are the first two eager runs, the self-check's the third
                        fail_at = {"warm-up": 1, "self-check": 3}.get(stage)
                        if type(self).eager_runs == fail_at:
                            raise RuntimeError(OOM)
            return super().forward(ids_remove_padding, forward_meta)

    return Faulty


def _facts(backend: Any) -> dict[str, Any]:
    report = backend.capture_report
    return {
        "captured": [r.size for r in report.records] if report else [],
        "agreement_points": getattr(report, "agreement_points", 0),
        "agreement_seconds": getattr(report, "agreement_seconds", 0.0),
        "session_seconds": getattr(report, "seconds", 0.0),
    }


# ------------------------------------------------------------------------------- scenarios


@scenario("equal-plans")
def equal_plans(rank: Rank) -> dict[str, Any]:
    backend = capture(tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1]))
    return {**_facts(backend), "registrations": _ar().registrations}


def _recapture(rank: Rank, forget: bool) -> dict[str, Any]:
    """Capture, clear as a weight update does, capture again; ``forget``: the faulty rank's
    backend has no warm-up history (as if it had been rebuilt)."""
    from conftest import DecoratedMixing
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin.core.warmups import WarmedSizes

    config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.profile_run()
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    backend.clear_graph()
    if forget and rank.faulty:
        backend.warmed = WarmedSizes()
    runner.capture_model()
    report = backend.capture_report
    return {**_facts(backend), "warmups": [r.warmups for r in report.records]}


@scenario("recapture")
def recapture(rank: Rank) -> dict[str, Any]:
    return _recapture(rank, forget=False)


@scenario("recapture-history-differs")
def recapture_history_differs(rank: Rank) -> dict[str, Any]:
    return _recapture(rank, forget=True)


@scenario("many-sizes")
def many_sizes(rank: Rank) -> dict[str, Any]:
    """36 sizes up to 512, shaped like FastDeploy's default list: the healthy-case cost."""
    sizes = [1, 2, 4, 6, *range(8, 129, 8), *range(144, 257, 16), *range(288, 513, 32)]
    backend = capture(tp_config(rank, max_num_seqs=512, cudagraph_capture_sizes=sizes))
    return _facts(backend)


@scenario("capture-sizes-differ")
def capture_sizes_differ(rank: Rank) -> dict[str, Any]:
    sizes = [8, 4, 2] if rank.faulty else [8, 4, 2, 1]
    return _facts(capture(tp_config(rank, cudagraph_capture_sizes=sizes)))


@scenario("warm-up-oom")
def warm_up_oom(rank: Rank) -> dict[str, Any]:
    config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
    return _facts(capture(config, model_cls=_faulty_model(rank, "warm-up")))


@scenario("capture-oom")
def capture_oom(rank: Rank) -> dict[str, Any]:
    config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
    return _facts(capture(config, model_cls=_faulty_model(rank, "capture")))


@scenario("registration-fails")
def registration_fails(rank: Rank) -> dict[str, Any]:
    """The custom all-reduce's register op fails after its all_gather (the session's one)."""
    allreduce = _ar()
    original = allreduce.register_graph_buffers
    calls = {"n": 0}

    def register() -> None:
        original()
        calls["n"] += 1
        if rank.faulty and calls["n"] == 1:
            raise RuntimeError("register_graph_buffers: cudaIpcOpenMemHandle failed")

    allreduce.register_graph_buffers = register
    return _facts(capture(tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])))


@scenario("self-check-raises")
def self_check_raises(rank: Rank) -> dict[str, Any]:
    with _env("FD_CUDAGRAPH_SELF_CHECK", "warn"):
        config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
        return _facts(capture(config, model_cls=_faulty_model(rank, "self-check")))


def _diverging_at_four() -> type:
    """A model whose size-4 graph replays a host value frozen at capture, unlike eager: the
    self-check fails at size 4 only (a nondeterministic kernel would, on one rank)."""
    from conftest import DecoratedMixing

    from fd_cudagraph_plugin.core.runtime import get_runtime

    runtime = get_runtime("simulated")

    class DivergesAtFour(DecoratedMixing):
        counter = frozen = 0

        def forward(self, ids_remove_padding, forward_meta):
            out = super().forward(ids_remove_padding, forward_meta)
            if ids_remove_padding.shape[0] != 4:
                return out
            self.counter += 1
            if not runtime.replaying:
                self.frozen = self.counter
            return out + float(self.frozen)

    return DivergesAtFour


def _self_check_fails(rank: Rank, mode: str) -> dict[str, Any]:
    with _env("FD_CUDAGRAPH_SELF_CHECK", mode):
        model_cls = _diverging_at_four() if rank.faulty else None
        backend = capture(
            tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1]), model_cls=model_cls
        )
    disabled = [s for s, e in sorted(backend.table.decode.items()) if e.disabled]
    return {**_facts(backend), "disabled": disabled}


@scenario("self-check-error")
def self_check_error(rank: Rank) -> dict[str, Any]:
    return _self_check_fails(rank, "error")


@scenario("self-check-warn")
def self_check_warn(rank: Rank) -> dict[str, Any]:
    return _self_check_fails(rank, "warn")


@scenario("static-probe-oom")
def static_probe_oom(rank: Rank) -> dict[str, Any]:
    """Static full mode: the first run of the SOT-translated program runs out of memory on one
    rank (a real error, not SOT's verdict that the model is not one clean graph)."""
    from fastdeploy.model_executor.graph_optimization.utils import in_profile_run_mode

    def static_program_fails(model: Any) -> None:
        # GraphOptBackend hands the backend its SOT-translated runnable, whose first run outside
        # the profile run is the static full probe.
        static = model.graph_opt_backend.runnable

        def runnable(**kwargs: Any) -> Any:
            if not in_profile_run_mode():
                raise RuntimeError(OOM)
            return static(**kwargs)

        model.graph_opt_backend.runnable = runnable

    config = tp_config(rank, cudagraph_capture_sizes=[4, 2, 1], graph_opt_level=1)
    return _facts(capture(config, prepare=static_program_fails if rank.faulty else None))


@scenario("static-probe-breakgraph")
def static_probe_breakgraph(rank: Rank) -> dict[str, Any]:
    """SOT says on one rank only that the model is not one clean graph: every rank then
    captures decode from the dygraph model, so their graphs (and registrations) line up."""
    from fastdeploy.model_executor.graph_optimization.utils import in_profile_run_mode

    def not_one_graph(model: Any) -> None:
        static = model.graph_opt_backend.runnable

        def runnable(**kwargs: Any) -> Any:
            if not in_profile_run_mode():
                raise RuntimeError(
                    "Model has breakgraph, please set env SOT_LOG_LEVEL=3 to check it."
                )
            return static(**kwargs)

        model.graph_opt_backend.runnable = runnable

    config = tp_config(rank, cudagraph_capture_sizes=[4, 2, 1], graph_opt_level=1)
    backend = capture(config, prepare=not_one_graph if rank.faulty else None)
    return {**_facts(backend), "static_full_decode": backend.stats()["static_full_decode"]}


@scenario("static-full")
def static_full(rank: Rank) -> dict[str, Any]:
    """Static full mode, healthy: every rank agrees Paddle's graphs decode."""
    config = tp_config(rank, cudagraph_capture_sizes=[4, 2, 1], graph_opt_level=1)
    backend = capture(config)
    return {**_facts(backend), "static_full_decode": backend.stats()["static_full_decode"]}


@scenario("fails-between-backend-calls")
def fails_between_backend_calls(rank: Rank) -> dict[str, Any]:
    """FastDeploy's own code raises on one rank after the size-4 decode step (its sampler, say):
    the other ranks are already past the backend's last agreement point for that size."""
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin.core import process

    class SamplerFails(GPUModelRunner):
        def _run(self, num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids=None):
            out = super()._run(num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids)
            if rank.faulty and process.current().session is not None and num_tokens == 4:
                raise RuntimeError("sampler: CUDA error(700): an illegal memory access")
            return out

    config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
    return _facts(capture(config, runner_cls=SamplerFails))


def _after_the_last_size(rank: Rank, raising: Callable[[], None]) -> dict[str, Any]:
    """FastDeploy's runner raises on the faulty rank after the last size's backend step (1),
    outside any backend call: the healthy rank must not enter the session's one registration,
    an all_gather_object the faulty rank will never join."""
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin.core import process

    class FailsAfterTheLastSize(GPUModelRunner):
        def _run(self, num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids=None):
            out = super()._run(num_tokens, seq_lens, exist_prefill, use_graph, real_bsz, dummy, ids)
            if rank.faulty and process.current().session is not None and num_tokens == 1:
                raising()
            return out

    from fd_cudagraph_plugin.core.errors import CudaGraphPluginError

    config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
    try:
        facts = _facts(capture(config, runner_cls=FailsAfterTheLastSize))
    except KeyboardInterrupt:
        facts = {"interrupted": True}
    except CudaGraphPluginError as error:
        facts = {"outcome": type(error).__name__, "message": str(error)}
    except Exception as error:
        facts = {"outcome": f"other:{type(error).__name__}", "message": str(error)}
    return {**facts, "registrations": _ar().registrations}


@scenario("runner-fails-after-the-last-size")
def runner_fails_after_the_last_size(rank: Rank) -> dict[str, Any]:
    def fail() -> None:
        raise RuntimeError("sampler: CUDA error(700): an illegal memory access")

    return _after_the_last_size(rank, fail)


@scenario("runner-interrupted-after-the-last-size")
def runner_interrupted_after_the_last_size(rank: Rank) -> dict[str, Any]:
    return _after_the_last_size(rank, _interrupt)


@scenario("kv-record-missing")
def kv_record_missing(rank: Rank) -> dict[str, Any]:
    """FD_CUDAGRAPH_KV_RESERVE=auto at a second start where the faulty rank's record is gone (a
    new disk, a cleaned log directory): whether to probe is that rank's own finding, and
    FastDeploy's MIN all-reduce of the KV block count follows the memory profile, so the ranks
    must agree on it first."""
    import tempfile

    from fastdeploy.worker.gpu_model_runner import GPUModelRunner
    from fastdeploy.worker.gpu_worker import GpuWorker, initialize_kv_cache

    from fd_cudagraph_plugin.core import reserve

    def start() -> Any:
        from conftest import DecoratedMixing

        config = tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])
        config.cache_config.gpu_memory_utilization = 0.9
        model = DecoratedMixing(fd_config=config)
        runner = GPUModelRunner(config, model)
        initialize_kv_cache(GpuWorker(config, runner))
        runner.capture_model()
        return model.graph_opt_backend.cudagraph_piecewise_backend

    log_dir = tempfile.mkdtemp(prefix=f"kv-rank{rank.index}-", dir=rank.out)
    with (
        _env("FD_CUDAGRAPH_KV_RESERVE", "auto"),
        _env("FD_LOG_DIR", log_dir),
        _env("FD_CUDAGRAPH_RANK_TIMEOUT", "5"),
    ):
        start()
        from fd_cudagraph_plugin.core import process

        # A new worker of the same scenario: its own keys in the job's store.
        prefix = process.current().link_prefix.rpartition("/")[2]
        _fresh_worker(rank, f"{prefix}-second-start")
        if rank.faulty:
            os.remove(reserve.Record.for_rank(log_dir, 0, rank.index).path)
        backend = start()

    return {
        **_facts(backend),
        "captures": backend.captures,
        "reserve": backend.capture_report.reserve.source,
    }


@scenario("less-free-memory")
def less_free_memory(rank: Rank) -> dict[str, Any]:
    """The faulty rank's device has 1 GiB less free: every rank's summary names it as the
    tightest, with its figures."""
    from fd_cudagraph_plugin.core import runtime

    if rank.faulty:
        runtime.get_runtime("simulated").allocate(1 << 30)
    backend = capture(tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1]))
    return {**_facts(backend), "summary": backend.capture_report.summary()}


@scenario("never-joins")
def never_joins(rank: Rank) -> dict[str, Any]:
    """The faulty rank never starts capture_model() (it died, or runs without the plugin)."""
    if rank.faulty:
        return {"skipped": True}
    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "1"):  # waited out: no rank will ever come
        return _facts(capture(tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1])))


# ------------------------------------------------------------------- memory that moves (issue 30)


def _serving(rank: Rank, strategy: str = "rsync") -> tuple[Any, Any, Any]:
    """FastDeploy's start-up with a model that reads the KV cache and rope_emb (graph_reads.py),
    RL weights over ``strategy``: the runner, its worker and the backend."""
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner
    from fastdeploy.worker.gpu_worker import GpuWorker
    from graph_reads import DecoratedKV, prefill

    config = tp_config(rank, 4, cudagraph_capture_sizes=[4, 2, 1], dynamic_load_weight=True)
    config.load_config.load_strategy = strategy
    model = DecoratedKV(fd_config=config)
    runner = GPUModelRunner(config, model)
    worker = GpuWorker(config, runner)
    runner.profile_run()
    worker.initialize_cache(num_gpu_blocks=4)
    worker.graph_optimize_and_warm_up_model()
    prefill(runner.share_inputs["caches"], 1)
    return runner, worker, model.graph_opt_backend.cudagraph_piecewise_backend


def _served(runner: Any, backend: Any) -> dict[str, Any]:
    """One decode step: whether it equals eager, and how the backend served it."""
    import paddle

    replays = sum(backend.stats()["replays"].values())
    out = runner.execute_step(4)
    ids = runner.share_inputs["ids"][:4]
    eager = runner.model.forward(ids_remove_padding=ids, forward_meta=runner.forward_meta)
    return {
        "equals_eager": bool(paddle.allclose(out, eager[:4]).item()),
        "replayed": sum(backend.stats()["replays"].values()) - replays,
        "eager_fallbacks": backend.stats()["eager_fallbacks"],
    }


@scenario("fit-rank-zero-decides")
def fit_rank_zero_decides(rank: Rank) -> dict[str, Any]:
    """FD_CUDAGRAPH_FIT=graphs:2: each rank serves other steps (rank 0 one token, the others
    two), so each fits another list; at the wake-up's recapture every rank captures rank 0's."""
    from fd_cudagraph_plugin.core import process

    os.environ["FD_CUDAGRAPH_FIT"] = "graphs:2"
    process.current().forget_options()
    try:
        runner, worker, backend = _serving(rank)
        # Each graph's first replay after start-up is a point every rank meets: the same steps.
        runner.execute_step(1)
        runner.execute_step(2)
        for _ in range(300):
            runner.execute_step(1 if rank.index == 0 else 2)
        worker.sleep(tags="kv_cache")  # the plugin releases the graphs; wakeup captures again
        worker.wakeup(tags="kv_cache")
        return {
            "captured": sorted(backend.table.decode, reverse=True),
            "graphs": backend.capture_report.graphs,
            "fit": backend.capture_report.fit,
            "loop": list(runner.cudagraph_capture_sizes),
            **_served(runner, backend),
        }
    finally:
        del os.environ["FD_CUDAGRAPH_FIT"]
        process.current().forget_options()


@scenario("moved-on-one-rank")
def moved_on_one_rank(rank: Rank) -> dict[str, Any]:
    """An rsync weight update moves nothing, but on the faulty rank rope_emb was re-made just
    before: every rank recaptures, none alone."""
    runner, worker, backend = _serving(rank)
    captures = backend.captures
    if rank.faulty:
        runner.share_inputs["rope_emb"] = runner.share_inputs["rope_emb"].clone()
    worker.update_weights(version="v2")
    return {"captured_again": backend.captures - captures, **_served(runner, backend)}


@scenario("moved-between-steps-on-one-rank")
def moved_between_steps(rank: Rank) -> dict[str, Any]:
    """After a lifecycle call that moved nothing, the faulty rank's rope_emb moves before the
    next step (a move no fingerprint saw): every rank serves that step eagerly."""
    runner, worker, backend = _serving(rank)
    worker.update_weights(version="v2")
    if rank.faulty:
        runner.share_inputs["rope_emb"] = runner.share_inputs["rope_emb"].clone()
    first = _served(runner, backend)
    return {"first": first, "then": _served(runner, backend), "graphs": backend.has_graphs()}


@scenario("lifecycle-call-fails")
def lifecycle_call_fails(rank: Rank) -> dict[str, Any]:
    """The faulty rank's wake-up raises; the others must not wait for it at the check after."""
    runner, worker, backend = _serving(rank)
    if rank.faulty:
        runner.initialize_kv_cache = _raise_oom
    worker.sleep(tags="kv_cache")
    worker.wakeup(tags="kv_cache")
    return {"captured": backend.has_graphs()}


def _raise_oom(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(OOM)


@scenario("cannot-serve-on-one-rank")
def cannot_serve_on_one_rank(rank: Rank) -> dict[str, Any]:
    """A wake-up with nothing asleep moves rope_emb on every rank, but the faulty rank's runner
    says its weights sleep (it could not capture): no rank captures alone; every rank releases."""
    runner, worker, backend = _serving(rank)
    captures = backend.captures
    if rank.faulty:
        runner.is_weight_sleeping = True
    worker.wakeup(tags="kv_cache")
    runner.is_weight_sleeping = False
    return {"captured_again": backend.captures - captures, **_served(runner, backend)}


def _attempt(call: Callable[[], object]) -> str:
    """``ok``, or the error's type and text."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def _retried(runner: Any, backend: Any, retry: Callable[[], object]) -> dict[str, Any]:
    return {"retry": _attempt(retry), "graphs": backend.has_graphs(), **_served(runner, backend)}


@scenario("wakeup-fails-on-one-rank-then-retried")
def wakeup_fails_then_retried(rank: Rank) -> dict[str, Any]:
    """Weights and KV asleep; the faulty rank's weight reload runs out of memory while the other
    captures; then every rank wakes the weights up again."""
    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "5"):
        runner, worker, backend = _serving(rank, "ipc_snapshot")
        worker.sleep(tags="kv_cache")  # the plugin releases the graphs
        worker.sleep(tags="weight")
        manager = runner.dynamic_weight_manager
        if rank.faulty:
            manager.reload_model_weights = _raise_oom
        first = _attempt(lambda: worker.wakeup(tags="weight,kv_cache"))
        if rank.faulty:
            del manager.reload_model_weights
        prefill_caches(runner)
        return {"first": first, **_retried(runner, backend, lambda: worker.wakeup(tags="weight"))}


@scenario("clear-fails-on-one-rank-then-retried")
def clear_fails_then_retried(rank: Rank) -> dict[str, Any]:
    """The faulty rank's clear_parameters fails before anything is cleared; then every rank
    clears and updates again."""
    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "5"):
        runner, _worker, backend = _serving(rank, "ipc_snapshot")
        if rank.faulty:
            runner._clear_graphs = _raise_oom
        first = _attempt(lambda: runner.clear_parameters(pid=0))
        if rank.faulty:
            del runner._clear_graphs

        def again() -> None:
            runner.clear_parameters(pid=0)
            runner.update_parameters(pid=0)
            prefill_caches(runner)

        return {"first": first, **_retried(runner, backend, again)}


@scenario("stopped-between-calls")
def stopped_between_calls(rank: Rank) -> dict[str, Any]:
    """Serving, the faulty rank's whole process stops for 2 s (a GC pause, swapping, a
    debugger) while the other goes on into a weight update and waits for it there: a stall
    shorter than the timeout (30 s) costs only time. 0.5.0 dropped the rank after 5 s of
    heartbeat silence: every later point of the job failed, the first replay of every size too."""
    import signal
    import subprocess

    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "30"):
        runner, worker, backend = _serving(rank)
        first = _served(runner, backend)
        if rank.faulty:
            subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        update = _attempt(lambda: worker.update_weights(version="v2"))
        return {"first": first, "update": update, "then": _served(runner, backend)}


@scenario("stopped-at-a-first-replay")
def stopped_at_a_first_replay(rank: Rank) -> dict[str, Any]:
    """After a weight update, each graph's first replay is agreed; the faulty rank stops
    before it and stays stopped until the other rank has served that step, which it can only do
    once its timeout (3 s) ran out at the first replay: then it wakes the faulty rank. No decode
    step raises for the agreement: both serve that step eagerly, alike, and the next weight
    update captures again."""
    import signal

    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "3"):
        runner, worker, backend = _serving(rank)
        worker.update_weights(version="v2")  # nothing moved: the graphs stay, first replays agreed
        if rank.faulty:
            os.kill(os.getpid(), signal.SIGSTOP)  # until the other rank has served the step
        try:
            first = _served(runner, backend)
        except Exception as error:
            first = {"raised": f"{type(error).__name__}: {error}"}
        if not rank.faulty:
            _wake_the_stopped(rank)
        update = _attempt(lambda: worker.update_weights(version="v3"))
        return {"first": first, "update": update, "then": _served(runner, backend)}


def _wake_the_stopped(rank: Rank) -> None:
    """SIGCONT to every other rank of the launch, each once the kernel says it is stopped
    (bounded: a rank that never stops is the scenario's failure, seen in its facts)."""
    import signal

    for index in range(rank.world):
        if index == rank.index:
            continue
        pid = int((Path(rank.out) / f"pid.rank{index}").read_text())
        status = Path(f"/proc/{pid}/status")
        deadline = time.monotonic() + 60
        while "T (stopped)" not in status.read_text() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, signal.SIGCONT)


@scenario("interrupted-on-one-rank")
def interrupted_on_one_rank(rank: Rank) -> dict[str, Any]:
    """The faulty rank's weight update is interrupted (KeyboardInterrupt): it posts that like
    any failure, so the other rank's call fails with it rather than pair with the faulty rank's
    next call; then every rank updates again and serves from graphs."""
    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "30"):
        runner, worker, backend = _serving(rank)
        manager = runner.dynamic_weight_manager
        if rank.faulty:
            manager.update_weights_by_rdma = _interrupt
        try:
            first = _attempt(lambda: worker.update_weights(version="v2"))
        except KeyboardInterrupt:
            first = "KeyboardInterrupt"
        if rank.faulty:
            del manager.update_weights_by_rdma
        again = _attempt(lambda: worker.update_weights(version="v3"))
        return {"first": first, "again": again, "then": _served(runner, backend)}


def _storm(rank: Rank, calls: Callable[[Any, Any], list[Callable[[], object]]]) -> dict[str, Any]:
    """SIGINT at random moments on the faulty rank while it is inside a lifecycle call (in
    FastDeploy's code or the plugin's, at a point or between two), for each call of ``calls``;
    then one more call, and one after it."""
    import random
    import signal
    import threading

    with _env("FD_CUDAGRAPH_RANK_TIMEOUT", "5"):
        runner, worker, backend = _serving(rank)
        inside = threading.Event()
        stop = threading.Event()
        chance = random.Random(1000 + rank.index)

        def interrupter() -> None:
            while not stop.is_set():
                if inside.wait(0.05) and not stop.is_set():
                    time.sleep(chance.uniform(0, 0.004))
                    if inside.is_set():
                        os.kill(os.getpid(), signal.SIGINT)
                        inside.clear()

        manager = runner.dynamic_weight_manager
        original = type(manager).update_weights_by_rdma

        def update(*args: Any, **kwargs: Any) -> Any:
            if rank.faulty:
                inside.set()
            return original(manager, *args, **kwargs)

        manager.update_weights_by_rdma = update
        reinitialise = runner.initialize_kv_cache

        def wake(*args: Any, **kwargs: Any) -> Any:
            if rank.faulty:
                inside.set()
            return reinitialise(*args, **kwargs)

        runner.initialize_kv_cache = wake
        thread = threading.Thread(target=interrupter, daemon=True)
        thread.start()
        outcomes = []
        for call in calls(runner, worker):
            try:
                outcomes.append(_attempt(call))
            except KeyboardInterrupt:
                outcomes.append("KeyboardInterrupt")
            inside.clear()
        stop.set()
        thread.join()
        del manager.update_weights_by_rdma
        runner.initialize_kv_cache = reinitialise
        one_more = _attempt(lambda: worker.update_weights(version="last"))
        then = _attempt(lambda: worker.update_weights(version="after-last"))
        return {
            "storm": outcomes,
            "one_more": one_more,
            "then": then,
            "served": _served(runner, backend),
        }


@scenario("interrupt-storm-updates")
def interrupt_storm_updates(rank: Rank) -> dict[str, Any]:
    """Eight weight updates; the faulty rank is interrupted inside them."""
    return _storm(
        rank,
        lambda runner, worker: [
            (lambda i=i: worker.update_weights(version=f"v{i}")) for i in range(8)
        ],
    )


@scenario("interrupt-storm-sleep-wake")
def interrupt_storm_sleep_wake(rank: Rank) -> dict[str, Any]:
    """Four sleep/wake-up pairs, each wake-up recapturing, and a weight update between them;
    the faulty rank is interrupted inside the updates and the wake-ups."""

    def calls(runner: Any, worker: Any) -> list[Callable[[], object]]:
        out: list[Callable[[], object]] = []
        for i in range(4):
            out.append(lambda: worker.sleep(tags="kv_cache"))
            out.append(lambda: (worker.wakeup(tags="kv_cache"), prefill_caches(runner)))
            out.append(lambda i=i: worker.update_weights(version=f"w{i}"))
        return out

    return _storm(rank, calls)


def _interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


def prefill_caches(runner: Any) -> None:
    from graph_reads import prefill

    prefill(runner.share_inputs["caches"], 3)


# ---------------------------------------------------------------------------------- driver


class _env:
    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        self.previous = os.environ.get(self.name)
        os.environ[self.name] = self.value

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.previous


def _ar() -> Any:
    from fastdeploy.distributed import communication

    return communication._TP_AR


def _fresh_worker(rank: Rank, name: str) -> None:
    """What a new worker process starts with."""
    from fastdeploy.distributed import communication
    from fastdeploy.distributed.custom_all_reduce import CustomAllreduce
    from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache
    from simulated import TestRuntime

    from fd_cudagraph_plugin.core import process, runtime

    # The last scenario's garbage goes now, not during this one; what survives is frozen, so that
    # the next collection walks only what this scenario makes (a full one walks all of Paddle's
    # objects: 0.2 s, about 10 s over the launch).
    gc.collect()
    gc.freeze()
    state = process.reset_for_tests()
    if hasattr(state, "link_prefix"):
        state.link_prefix = f"fd-cudagraph/test/{name}"
    runtime.install_runtime(TestRuntime())
    communication._TP_AR = CustomAllreduce(rank.group, initialized=True)
    OpcodeExecutorCache().clear()  # one model per worker, as FastDeploy's SOT check expects


def _run(name: str, rank: Rank) -> dict[str, Any]:
    from fd_cudagraph_plugin.core.errors import CudaGraphPluginError

    started = time.monotonic()
    try:
        facts = {"outcome": "ok", "message": "", **SCENARIOS[name](rank)}
    except CudaGraphPluginError as error:
        facts = {"outcome": type(error).__name__, "message": str(error)}
    except Exception as error:  # FastDeploy's own rewrapping, or the plugin failing to agree
        facts = {"outcome": f"other:{type(error).__name__}", "message": str(error)}
    return {"rank": rank.index, "seconds": time.monotonic() - started, **facts}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument(
        "--deadline", type=float, default=90.0, help="seconds before this rank dumps and exits"
    )
    args = parser.parse_args()
    # A collective that never returns must end this rank with a traceback in its log rather
    # than rely on the test's kill alone; faulthandler's timer fires even inside gloo.
    faulthandler.dump_traceback_later(args.deadline, exit=True)

    import paddle.distributed as dist

    # The job's default group is the TP group here (FastDeploy makes its TP group with new_group
    # over the same ranks when the job is one TP group); a second gloo rendezvous over the same
    # ranks now and then finds a peer's port refused on this machine.
    group = dist.init_parallel_env()
    world = dist.get_world_size()
    index = dist.get_rank()
    (args.out / f"pid.rank{index}").write_text(str(os.getpid()))

    from fd_cudagraph_plugin import plugin

    plugin.register()
    for entry in args.scenario:
        name, _, faulty = entry.partition("@")
        rank = Rank(index, world, group, faulty != "" and int(faulty) == index, str(args.out))
        _fresh_worker(rank, entry.replace("@", "-on-"))
        facts = _run(name, rank)
        (args.out / f"{entry}.rank{index}.json").write_text(json.dumps(facts))
        dist.barrier(group=group)  # the next scenario starts together, as a new job would
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
