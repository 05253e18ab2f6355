"""Driving the CUDA graphs that Paddle itself keeps inside dy2st partial programs.

With ``graph_opt_level`` >= 1 the model runs as SOT-translated static programs. Paddle can
capture and replay a CUDA graph per partial program; it is told what to do through two attributes
of each ``run_program`` call, ``cuda_graph_state`` and ``cuda_graph_dispatch_key``. Paddle offers
one hook to set them, ``pir_partial_program.replace_run_impl_guard``, and this module owns it.
The graphs live inside Paddle's executor, so this module only tracks which keys were captured.

It also reads SOT's verdict on a model (``static_probe``): in static full mode Paddle-managed
graphs decode only where the SOT-translated program is one clean static graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: SOT's verdicts that a model is not one clean static graph (FastDeploy's
#: ``apply_to_static_optimization`` raises them in its warm-up mode); nothing else means that.
NOT_ONE_STATIC_GRAPH = ("Model has breakgraph", "Model has multiple generated code")


def static_probe(runnable: Callable[..., Any], kwargs: dict) -> str | None:
    """Run the SOT-translated program once, eagerly: None when it ran (it is one clean static
    graph), else SOT's verdict why not. Any other error is raised: an out-of-memory there is no
    verdict on the model.

    FastDeploy hands its own backend ``dy_runnable`` for decode in static full mode, so it never
    runs this program; models SOT cannot translate whole serve fine eagerly."""
    try:
        runnable(**kwargs)
    except Exception as error:
        if any(text in str(error) for text in NOT_ONE_STATIC_GRAPH):
            return f"{type(error).__name__}: {error}"
        raise
    return None


class StaticGraphDriver:
    """Tells Paddle's partial programs to capture, replay or run plainly, per dispatch key."""

    def __init__(self) -> None:
        from paddle.jit.dy2static.utils import CUDAGraphState

        self._states = CUDAGraphState
        self._state = CUDAGraphState.DISABLE
        self._key = 0
        self.captured_keys: set[int] = set()

    def _run_impl(self, original: Callable, inputs, parameters, attrs):
        program_attrs, graph_attrs = attrs
        state, key = self._state, self._key
        if state == self._states.REPLAY and key not in self.captured_keys:
            # A key never captured must not reach Paddle as REPLAY: there is no graph to replay.
            state, key = self._states.DISABLE, 0
        graph_attrs = {**graph_attrs, "cuda_graph_state": state, "cuda_graph_dispatch_key": key}
        return original(inputs, parameters, (program_attrs, graph_attrs))

    @contextlib.contextmanager
    def _guard(self, state, key: int) -> Iterator[None]:
        from paddle.jit.dy2static.pir_partial_program import replace_run_impl_guard

        self._state, self._key = state, key
        try:
            with replace_run_impl_guard(self._run_impl):
                yield
        finally:
            self._state, self._key = self._states.DISABLE, 0

    def capture(self, runnable: Callable, kwargs: dict, key: int) -> object:
        with self._guard(self._states.CAPTURE, key):
            outputs = runnable(**kwargs)
        self.captured_keys.add(key)
        return outputs

    def replay(self, runnable: Callable, kwargs: dict, key: int) -> object:
        with self._guard(self._states.REPLAY, key):
            return runnable(**kwargs)

    def discard(self, key: int) -> None:
        """A capture some rank failed: never replay it."""
        self.captured_keys.discard(key)

    def forget(self) -> None:
        self.captured_keys.clear()
