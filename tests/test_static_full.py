"""Static full-graph mode (graph_opt_level >= 1, full_cuda_graph) with models SOT cannot translate
whole. FastDeploy serves them (its backend hands decode ``dy_runnable``); the plugin must too, and
must still graph decode: Paddle-managed static graphs if the SOT code works, else its own capture
of ``dy_runnable``, decided once per backend and logged once."""

from __future__ import annotations

import logging

import paddle
import pytest
from conftest import Buffers, DecoratedBackbone, TinyBackbone, make_config
from fastdeploy.model_executor.graph_optimization.decorator import support_graph_optimization
from fastdeploy.model_executor.graph_optimization.utils import sot_warmup_guard
from fastdeploy.worker.gpu_model_runner import GPUModelRunner


@support_graph_optimization
class BreakingBackbone(TinyBackbone):
    """A graph break: a host read in forward (as an ``.item()`` on a length would be)."""

    def forward(self, ids_remove_padding: paddle.Tensor, forward_meta):
        hidden = paddle.tanh(self.proj(self.embed(ids_remove_padding)))
        scale = float(hidden.numpy().shape[0] > -1)  # always 1.0, but SOT must break here
        return hidden * scale


STATIC_FULL = {"graph_opt_level": 1, "full_cuda_graph": True}


@pytest.mark.parametrize(
    ("model_cls", "expected"),
    [(DecoratedBackbone, "static"), (BreakingBackbone, "dynamic")],
    ids=["sot-clean", "graph-break"],
)
def test_static_full_decode_is_graphed_either_way(plugin_registered, caplog, model_cls, expected):
    config = make_config(4, **STATIC_FULL)
    model = model_cls(fd_config=config)
    runner = GPUModelRunner(config, model)
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        runner.profile_run()
        runner.capture_model()  # start-up never fails on this
    backend = model.graph_opt_backend.cudagraph_piecewise_backend
    stats = backend.stats()
    assert stats["static_full_decode"] == expected
    warnings = [r for r in caplog.records if "static full" in r.getMessage()]
    assert len(warnings) == (1 if expected == "dynamic" else 0)
    before = sum(stats["replays"].values())
    for tokens in (1, 3, 4, 2):
        out = runner.execute_step(tokens)
        view = runner.share_inputs["ids"][:tokens]
        assert paddle.allclose(
            out, model.forward(ids_remove_padding=view, forward_meta=None)
        ).item()
    assert sum(backend.stats()["replays"].values()) - before == 4
    assert backend.stats()["eager_fallbacks"] == {}


def test_static_full_decode_is_none_in_other_modes(plugin_registered):
    config = make_config(4)
    model = DecoratedBackbone(fd_config=config)
    runner = GPUModelRunner(config, model)
    runner.capture_model()
    assert model.graph_opt_backend.cudagraph_piecewise_backend.stats()["static_full_decode"] is None


def test_a_replay_of_a_key_paddle_never_captured_runs_the_program_plainly(partial_program_calls):
    """REPLAY reaches Paddle only for keys it captured: there is no graph to replay otherwise."""
    from fd_cudagraph_plugin.core.dy2st import StaticGraphDriver

    model = DecoratedBackbone(fd_config=make_config(4, graph_opt_level=1))
    static = model.graph_opt_backend.runnable
    driver = StaticGraphDriver()
    step = Buffers().step(2)
    with sot_warmup_guard(True):
        driver.capture(static, step, 2)
    driver.replay(static, step, 2)
    driver.replay(static, step, 4)  # never captured
    assert partial_program_calls[-2:] == [("REPLAY", 2), ("DISABLE", 0)]
