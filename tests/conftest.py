"""Fixtures: the stand-in ``fastdeploy`` package, the simulated runtime, configs and models."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# SOT compiles even tiny functions into partial programs, so the static (dy2st) modes really run
# Paddle's run_program with CUDA-graph attributes on the CPU. Set before Paddle is imported.
os.environ["MIN_GRAPH_SIZE"] = "0"
# FastDeploy's legacy loggers write files under FD_LOG_DIR; keep them out of the checkout, and
# leave nothing in $TMPDIR either (benchmarks/capture.py imports this module too).
if "FD_LOG_DIR" not in os.environ:
    os.environ["FD_LOG_DIR"] = tempfile.mkdtemp(prefix="fd-stub-log-")
    atexit.register(shutil.rmtree, os.environ["FD_LOG_DIR"], ignore_errors=True)
# The ranks' Unix sockets go under XDG_RUNTIME_DIR (the launched ranks inherit it): one that goes.
if "XDG_RUNTIME_DIR" not in os.environ:
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="fd-cudagraph-run-")
    atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)

STUB = Path(__file__).resolve().parent / "fastdeploy_stub"
if str(STUB) not in sys.path:
    sys.path.insert(0, str(STUB))

import paddle  # noqa: E402
from fastdeploy import _stub_version  # noqa: E402
from fastdeploy.config import (  # noqa: E402
    CacheConfig,
    FDConfig,
    GraphOptimizationConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from fastdeploy.distributed import communication  # noqa: E402
from fastdeploy.distributed.custom_all_reduce import RecordingCustomAllreduce  # noqa: E402
from fastdeploy.model_executor import forward_meta  # noqa: E402
from fastdeploy.model_executor.graph_optimization import (  # noqa: E402
    cudagraph_piecewise_backend,
    graph_optimization_backend,
)
from fastdeploy.model_executor.graph_optimization.decorator import (  # noqa: E402
    support_graph_optimization,
)
from fastdeploy.platforms import current_platform  # noqa: E402
from paddle.jit.sot.opcode_translator.executor.executor_cache import (  # noqa: E402
    OpcodeExecutorCache,
)
from paddle.jit.sot.psdb import in_sot  # noqa: E402
from simulated import TestRuntime  # noqa: E402

from fd_cudagraph_plugin import plugin  # noqa: E402
from fd_cudagraph_plugin.core import hooks, observability, process, runtime  # noqa: E402

HIDDEN = 8
VOCAB = 32

#: FastDeploy releases the stand-in emulates (``fastdeploy._stub_version``).
FD_VERSIONS = _stub_version.VERSIONS


def graph_config(**keys) -> list[str]:
    """``--graph-optimization-config`` with ``keys``, as FastDeploy's launch line spells it."""
    return ["--graph-optimization-config", json.dumps(keys)]


def speculative_config(**keys) -> list[str]:
    """``--speculative-config`` with ``keys``, as FastDeploy's launch line spells it."""
    return ["--speculative-config", json.dumps(keys)]


#: Modes that exist per release: static split needs capture_model_prefill_and_mixed (2.5+).
MODE_VERSIONS = {
    "dynamic": FD_VERSIONS,
    "static_split": ("2.5", "2.6", "develop"),
    "static_full": FD_VERSIONS,
    "speculative": FD_VERSIONS,
}


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch):
    """Every test starts with FastDeploy's native backend bound and no plugin options set."""
    for name in list(os.environ):
        if name.startswith("FD_CUDAGRAPH_") or name == "FD_PLUGINS":
            monkeypatch.delenv(name)
    # A worker reads its options once; a test that changes one mid-way makes it read them again.
    for method in ("setenv", "delenv"):
        original = getattr(monkeypatch, method)

        def changed(name, *args, _original=original, **kwargs):
            _original(name, *args, **kwargs)
            if str(name).startswith("FD_CUDAGRAPH_"):
                process.current().forget_options()

        setattr(monkeypatch, method, changed)
    native = cudagraph_piecewise_backend.CudaGraphPiecewiseBackend
    saved_runtimes = dict(runtime._RUNTIMES)
    saved_tp_ar = communication._TP_AR
    process.reset_for_tests()
    # SOT caches generated code per function code object, process-wide: models built by earlier
    # tests would count as FastDeploy's "multiple generated code" (a worker has one model).
    OpcodeExecutorCache().clear()
    yield
    graph_optimization_backend.CudaGraphPiecewiseBackend = native
    cudagraph_piecewise_backend.CudaGraphPiecewiseBackend = native
    _stub_version.use("develop")
    runtime._RUNTIMES.clear()
    runtime._RUNTIMES.update(saved_runtimes)
    communication._TP_AR = saved_tp_ar
    plugin.reset_for_tests()
    current_platform.device_name = None
    hooks.uninstall()
    observability.stop_reporter(process.current())
    process.reset_for_tests()


@pytest.fixture(params=FD_VERSIONS)
def fd_version(request) -> str:
    """Run the test as each FastDeploy release (parametrise indirectly to pick some)."""
    _stub_version.use(request.param)
    return request.param


@pytest.fixture
def failures():
    """The counts of failed side-channel writes of this test's worker process."""
    return process.current().outputs.counts


@pytest.fixture
def sim(monkeypatch) -> TestRuntime:
    """A fresh simulated runtime, chosen the way an operator would: FD_CUDAGRAPH_RUNTIME."""
    monkeypatch.setenv("FD_CUDAGRAPH_RUNTIME", "simulated")
    fresh = TestRuntime()
    runtime.install_runtime(fresh)
    return fresh


@pytest.fixture
def recording_ar() -> RecordingCustomAllreduce:
    ar = RecordingCustomAllreduce()
    communication._TP_AR = ar
    return ar


@pytest.fixture
def plugin_registered(sim):
    """The plugin's backend bound in FastDeploy, as register() leaves it."""
    plugin.register()
    return sim


@pytest.fixture
def partial_program_calls(monkeypatch) -> list[tuple[str, int]]:
    """Record the CUDA-graph state and dispatch key of every Paddle partial-program run."""
    from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

    calls: list[tuple[str, int]] = []
    original = PartialProgramLayer.run_impl

    def spy(layer, inputs, parameters, attrs):
        _, graph_attrs = attrs
        state = graph_attrs["cuda_graph_state"]
        calls.append((state.name, graph_attrs["cuda_graph_dispatch_key"]))
        return original(layer, inputs, parameters, attrs)

    monkeypatch.setattr(PartialProgramLayer, "run_impl", staticmethod(spy))
    return calls


def make_config(
    max_num_seqs: int = 8,
    *,
    speculative: dict | None = None,
    tp: int = 1,
    sequence_parallel_moe: bool = False,
    splitwise_role: str = "mixed",
    dynamic_load_weight: bool = False,
    **graph_args,
) -> FDConfig:
    """``dynamic_load_weight``: the runner gets FastDeploy's ``DynamicWeightManager``, which its
    weight paths (``clear_parameters``, ``sleep("weight")``, ``update_weights``) need."""
    graph = {"use_cudagraph": True, **graph_args}
    parallel = {"tensor_parallel_size": tp, "use_sequence_parallel_moe": sequence_parallel_moe}
    scheduler = {"max_num_seqs": max_num_seqs, "splitwise_role": splitwise_role}
    return FDConfig(
        graph_opt_config=GraphOptimizationConfig(graph),
        scheduler_config=SchedulerConfig(scheduler),
        cache_config=CacheConfig({}),
        parallel_config=ParallelConfig(parallel),
        speculative_config=SpeculativeConfig(speculative or {}),
        load_config=LoadConfig({"dynamic_load_weight": dynamic_load_weight}),
        test_mode=True,
    )


class TinyBackbone(paddle.nn.Layer):
    """A token-wise decoder stand-in. ``outputs`` picks the structure it returns."""

    def __init__(self, fd_config=None, outputs: str = "tensor") -> None:
        super().__init__()
        paddle.seed(7)
        self.embed = paddle.nn.Embedding(VOCAB, HIDDEN)
        self.proj = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.outputs = outputs
        self.calls = 0

    hidden_size = HIDDEN
    vocab_size = VOCAB

    def forward(self, ids_remove_padding: paddle.Tensor, forward_meta):
        if not in_sot():
            # Counts dygraph runs only: a counter read under SOT would be a guard, so every call
            # would generate new code ("Model has multiple generated code").
            self.calls += 1
        hidden = paddle.tanh(self.proj(self.embed(ids_remove_padding)))
        if communication._TP_AR is not None and not in_sot():
            # A tensor-parallel model sums its row-parallel output: NaN if this runs inside the
            # custom all-reduce capture context outside a stream capture (a warm-up there).
            # FastDeploy registers the all-reduce as a custom Python op, one op to SOT; the
            # stand-in's is plain Python, so SOT-translated programs skip it (the identity on
            # one simulated rank; Paddle-managed captures are no stream capture to it anyway).
            hidden = communication.tensor_model_parallel_all_reduce(hidden)
        if self.outputs == "list_with_none":
            return [hidden, None, hidden * 2.0]
        if self.outputs == "single_list":
            return [hidden]
        return hidden


class MixingBackbone(TinyBackbone):
    """Rows interact: each output row also carries the mean of every row of the step, so the
    graph of any other size than the one the step pads to gives other numbers. (With a token-wise
    model any graph at least as large as the step passes, so a wrong lookup stays invisible.)"""

    def forward(self, ids_remove_padding: paddle.Tensor, forward_meta):
        hidden = super().forward(ids_remove_padding, forward_meta)
        if self.outputs != "tensor":
            return hidden
        return hidden + paddle.mean(hidden, axis=0, keepdim=True)


@support_graph_optimization
class DecoratedBackbone(TinyBackbone):
    """The same backbone behind FastDeploy's ``@support_graph_optimization``."""


class DraftBackbone(TinyBackbone):
    """An MTP draft: also reads the target's ``previous_hidden_states``."""

    def forward(
        self, ids_remove_padding: paddle.Tensor, previous_hidden_states: paddle.Tensor, forward_meta
    ):
        if not in_sot():
            self.calls += 1
        hidden = paddle.tanh(self.proj(self.embed(ids_remove_padding) + previous_hidden_states))
        if communication._TP_AR is not None and not in_sot():
            hidden = communication.tensor_model_parallel_all_reduce(hidden)
        return hidden


@support_graph_optimization
class DecoratedMixing(MixingBackbone):
    """The row-mixing backbone behind ``@support_graph_optimization``."""


def expected_graph_size(settings, tokens: int, running: int = 0) -> int:
    """The size of the graph that should serve a decode step: FastDeploy's running-request map
    under speculative decoding when the step fits it, else padding by token count."""
    if settings.mode.keyed_by_running and 0 < running < len(settings.bsz_table):
        size = settings.bsz_table[running]
        if size and tokens <= size:
            return size
    return settings.decode_table[tokens]


@support_graph_optimization
class DecoratedDraft(DraftBackbone):
    """The draft behind ``@support_graph_optimization``, as ``Ernie4_5_MTPModel`` is."""


def meta_for(ids, **fields):
    """A ``ForwardMeta`` of the emulated release (fields it lacks raise TypeError)."""
    fields.setdefault("step_use_cudagraph", True)
    return forward_meta.ForwardMeta(ids_remove_padding=ids, **fields)


def capture_speculative(backend, buffers: Buffers) -> None:
    """Capture every size the way FastDeploy's MTP capture loop does: ``size // 2`` requests of
    two tokens each (k = 1), largest first."""
    for size in backend.cudagraph_capture_sizes:
        step = buffers.step(size)
        step["forward_meta"].real_bsz = size // 2
        backend(**step)


class Buffers:
    """Persistent input buffer, as FastDeploy's ``share_inputs``: written in place, viewed."""

    def __init__(self, length: int = 1024) -> None:
        self.ids = paddle.zeros([length], dtype="int64")

    def step(self, tokens: int, seed: int = 0) -> dict:
        if tokens:
            values = (paddle.arange(tokens, dtype="int64") * 7 + seed) % VOCAB
            self.ids[:tokens] = values
        view = self.ids[:tokens]
        return {"ids_remove_padding": view, "forward_meta": meta_for(view)}

    def padded(self, size: int) -> dict:
        """What a graph of ``size`` reads: the first ``size`` rows of the buffer as they are."""
        view = self.ids[:size]
        return {"ids_remove_padding": view, "forward_meta": meta_for(view)}


class PeerLink:
    """An agreement link for one process acting as ``rank`` of ``world``: the other ranks'
    statuses come from ``peer(rank, label, status)`` (by default the same as this rank's), as
    plain data (``{"payload": ..., "failure": ...}``, ``msgspec.to_builtins`` of a status), read
    as strictly as a post read back from the job store."""

    def __init__(self, rank: int = 0, world: int = 2, peer=None) -> None:
        self.rank, self.world = rank, world
        self.peer = peer or (lambda other, label, status: status)
        self.labels: list[str] = []
        #: (label, this rank's status as JSON), per point.
        self.posted: list[tuple[str, dict]] = []
        self.points: list[str] = []

    def agree(self, point, label, status, timeout):
        import msgspec

        from fd_cudagraph_plugin.core.ranks.link import Agreed, Outcome
        from fd_cudagraph_plugin.core.ranks.messages import Status, malformed

        mine = msgspec.to_builtins(status)
        self.points.append(point)
        self.labels.append(label)
        self.posted.append((label, mine))
        statuses = {}
        for r in range(self.world):
            try:
                peer = self.peer(r, label, mine)
                statuses[r] = status if r == self.rank else msgspec.convert(peer, Status)
            except msgspec.ValidationError as error:
                statuses[r] = malformed(r, label, str(error))
        return Agreed(label, Outcome(point, statuses, dict.fromkeys(statuses, label)))

    def stop(self, point, label, status):
        pass


def CaptureSessionForOneRank(config, phase: str = "decode"):
    """A capture session of a TP config that agrees with itself (test_collective has real ranks)."""
    from fd_cudagraph_plugin.core.ranks.link import LocalLink
    from fd_cudagraph_plugin.core.session import CaptureSession

    return CaptureSession(phase, fd_config=config, link=LocalLink())


def served_by(backend, step: dict):
    """Run ``step`` through ``backend``; return its output and the size of the graph that
    served it (None: it ran eagerly), read from the backend's own replay counters."""
    before = dict(backend.stats()["replays"])
    out = backend(**step)
    after = backend.stats()["replays"]
    grown = [size for size, n in after.items() if n != before.get(size, 0)]
    assert len(grown) <= 1, f"one step replayed several graphs: {grown}"
    return out, (grown[0] if grown else None)


@support_graph_optimization
class FlakyBackboneForRunner(TinyBackbone):
    """Raises ``message`` from the first call made while a (simulated) graph capture runs."""

    def __init__(self, fd_config=None, message: str = "") -> None:
        super().__init__(fd_config)
        self.message = message

    def forward(self, ids_remove_padding: paddle.Tensor, forward_meta):
        current = runtime._RUNTIMES.get("simulated")
        if current is not None and current.capturing:
            raise RuntimeError(self.message)
        return super().forward(ids_remove_padding, forward_meta)


def pytest_configure(config):
    """Each run gets a temporary directory of its own unless one is named (``--basetemp``):
    pytest's shared ``pytest-of-<user>`` is rotated by any other run of the same user, which once
    removed this one's files mid-run (129 errors)."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="fd-cudagraph-tests-")
        config._fd_cudagraph_basetemp = config.option.basetemp


def pytest_collection_modifyitems(config, items):
    """Modules whose work runs in processes of their own (those that define ``start_early``: the
    real rank launches and rank processes, the benchmark and tool runs, fresh interpreters, the
    four-rank walk) are checked last, each in its own order: their work starts once collection is
    done (``pytest_collection_finish``) and runs on the machine's other core while pytest runs
    the in-process tests, one at a time, on one. What each test asserts is unchanged; only when
    its processes run."""
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "start_early"))


def pytest_collection_finish(session):
    """Start the work of every selected module that defines ``start_early(tmp_path_factory)``;
    its fixtures find it with ``started_early(request)``."""
    config = session.config
    config._fd_cudagraph_early = {}
    if config.option.collectonly:
        return
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    for module in modules:
        start = getattr(module, "start_early", None)
        if start is not None:
            config._fd_cudagraph_early[module.__name__] = start(config._tmp_path_factory)


def started_early(request):
    """What ``pytest_collection_finish`` started for the requesting module, or None."""
    return getattr(request.config, "_fd_cudagraph_early", {}).get(request.module.__name__)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """What the requesting module's ``start_early`` started: by ``pytest_collection_finish``,
    or here where that did not (a run that imports the module some other way)."""
    work = started_early(request)
    if work is None:
        work = request.module.start_early(tmp_path_factory)
    yield work
    work.stop()


_beside: ThreadPoolExecutor | None = None


class Beside(dict):
    """Calls that run beside the in-process tests, by name, each value a future of what its call
    returns: two at a time for the whole run (each is mostly a process of its own that imports
    Paddle, seconds of one core)."""

    def __init__(self, calls: dict[str, Callable[[], Any]]) -> None:
        global _beside
        if _beside is None:
            _beside = ThreadPoolExecutor(2, thread_name_prefix="beside")
        super().__init__({name: _beside.submit(call) for name, call in calls.items()})

    def stop(self) -> None:
        for future in self.values():
            future.cancel()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """What was started early and is still running is stopped (a run stopped by ``-x``, say);
    the run's own temporary directory goes with the run (each test's ``tmp_path`` is already
    removed, ``tmp_path_retention_policy = none``)."""
    for work in getattr(session.config, "_fd_cudagraph_early", {}).values():
        work.stop()
    made = getattr(session.config, "_fd_cudagraph_basetemp", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
