"""Where capture time goes: host time per category inside ``capture_model()``, for either backend.

Both backends reach the GPU only through the shim's Paddle API and the model, so timing wrappers
around those calls split their capture time the same way, with nothing read from either
backend's internals:

==================  ==================================================================
``warmup_forward``  model calls outside a capture (the eager warm-ups; kernels are queued,
                    so most of their GPU time shows up in the next ``synchronize``)
``captured_forward`` the model call between ``capture_begin`` and ``capture_end``
``synchronize``     ``paddle.device.synchronize()``
``graph_new``       ``CUDAGraph(...)`` construction
``capture_begin``   ``CUDAGraph.capture_begin()``
``capture_end``     ``CUDAGraph.capture_end()`` (torch instantiates the graph here)
``replay``          ``CUDAGraph.replay()`` (the replay each capturing step ends with)
``memory_reserved`` ``paddle.device.cuda.memory_reserved()`` (the plugin's graph accounting)
``progress_bar``    tqdm's bar: created, updated and labelled once per graph (the plugin's
                    capture progress on rank 0; FastDeploy's backend has none)
``other_in_steps``  the rest of each step: the backend's own Python (dispatch, order checks,
                    agreement points, output buffers, logging)
``outside_steps``   ``capture_model()`` time outside the steps: the plugin's capture session
                    (GC freeze, plan and end agreement, summary line, memory report)
==================  ==================================================================

The plugin's own public timings are added beside these: ``capture_report.setup_seconds`` and
``agreement_seconds`` (its agreement points; with TP = 1 they agree with themselves).

``install()`` must run before any backend is built (the plugin's runtime binds
``paddle.device.synchronize`` once). The wrappers cost a few hundred nanoseconds per call while
recording and one flag test otherwise; run.sh times the headline ratio in a separate process
without them.
"""

from __future__ import annotations

import time
from collections import defaultdict

CATEGORIES = (
    "warmup_forward",
    "captured_forward",
    "synchronize",
    "graph_new",
    "capture_begin",
    "capture_end",
    "replay",
    "memory_reserved",
    "progress_bar",
)


class Recorder:
    def __init__(self) -> None:
        self.active = False
        self.capturing = False
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def start(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.active = True

    def stop(self) -> tuple[dict[str, float], dict[str, int]]:
        self.active = False
        return dict(self.seconds), dict(self.calls)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1


RECORDER = Recorder()
perf_counter = time.perf_counter


def _record(name: str, started: float) -> None:
    if RECORDER.active:
        RECORDER.add(name, perf_counter() - started)


def _timed(name: str, fn):
    def timed(*args, **kwargs):
        if not RECORDER.active:
            return fn(*args, **kwargs)
        started = perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            RECORDER.add(name, perf_counter() - started)

    return timed


def install(paddle) -> None:
    """Wrap the shim's calls (before any backend or runtime exists)."""
    graphs = paddle.device.cuda.graphs
    base = graphs.CUDAGraph

    class TimedCUDAGraph(base):
        def __init__(self, *args, **kwargs):
            started = perf_counter()
            super().__init__(*args, **kwargs)
            _record("graph_new", started)

        def capture_begin(self):
            started = perf_counter()
            super().capture_begin()
            _record("capture_begin", started)
            RECORDER.capturing = True

        def capture_end(self):
            RECORDER.capturing = False
            started = perf_counter()
            super().capture_end()
            _record("capture_end", started)

        def replay(self):
            started = perf_counter()
            base.replay(self)
            _record("replay", started)

    TimedCUDAGraph.__name__ = "CUDAGraph"
    graphs.CUDAGraph = TimedCUDAGraph
    paddle.base.core.CUDAGraph = TimedCUDAGraph
    paddle.device.synchronize = _timed("synchronize", paddle.device.synchronize)
    _time_progress_bar()
    paddle.device.cuda.memory_reserved = _timed(
        "memory_reserved", paddle.device.cuda.memory_reserved
    )


def _time_progress_bar() -> None:
    """Time tqdm where the plugin takes it (``from tqdm import tqdm`` at its first graph)."""
    import tqdm

    bar = tqdm.tqdm

    class TimedBar(bar):
        def __init__(self, *args, **kwargs):
            started = perf_counter()
            super().__init__(*args, **kwargs)
            _record("progress_bar", started)

        def update(self, n=1):
            started = perf_counter()
            try:
                return super().update(n)
            finally:
                _record("progress_bar", started)

        def set_postfix_str(self, *args, **kwargs):
            started = perf_counter()
            try:
                return super().set_postfix_str(*args, **kwargs)
            finally:
                _record("progress_bar", started)

    tqdm.tqdm = TimedBar


def timed_model(model):
    """``model`` with its calls timed as warm-up or captured forwards."""

    class Timed:
        def __call__(self, **kwargs):
            if not RECORDER.active:
                return model(**kwargs)
            name = "captured_forward" if RECORDER.capturing else "warmup_forward"
            started = perf_counter()
            try:
                return model(**kwargs)
            finally:
                RECORDER.add(name, perf_counter() - started)

    return Timed()


def split(total: float, step_seconds: float, seconds: dict[str, float]) -> dict[str, float]:
    """One ``capture_model()``'s categories, with the two remainders."""
    out = {name: seconds.get(name, 0.0) for name in CATEGORIES}
    out["other_in_steps"] = step_seconds - sum(out.values())
    out["outside_steps"] = total - step_seconds
    out["total"] = total
    return out
