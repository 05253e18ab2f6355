"""One tensor-parallel rank of a FastDeploy worker's capture, over a real paddle.distributed group.

Started once per rank by Paddle's launcher (gloo on CPU Paddle; see ``test_collective.py``)::

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir LOG \\
        tests/tp_worker.py --out DIR --scenario equal-plans --scenario capture-sizes-differ

Each rank runs the scenarios in the order given and writes ``DIR/<scenario>.rank<R>.json``: what the
scenario returned plus ``outcome``, ``"ok"`` or the name of the plugin error it raised, and
``message``. A rank exits 0 once every scenario has run, whatever the outcomes; anything else
(an unexpected exception, a collective that never returns) is a failure of the test itself.

Adding a scenario is a function taking a ``Rank`` and returning a dict of facts, decorated with
``@scenario("name")``. Build its config with ``tp_config`` (the TP group set where FastDeploy sets
it) and drive FastDeploy's capture loop with ``capture``; raise nothing yourself: a plugin error
escaping the function is the outcome the test reads.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "fastdeploy_stub"))
os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"


@dataclass(frozen=True)
class Rank:
    index: int
    world: int
    group: Any  # the TP group, as FastDeploy's set_communicate_group builds it


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


def capture(config: Any, *, profile_run: bool = True, model_cls: Any = None) -> Any:
    """FastDeploy's start-up on one rank: build the model, profile run, ``capture_model()``.

    Returns the backend, whose ``capture_report`` says what the session captured.
    """
    from conftest import DecoratedBackbone
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    model = (model_cls or DecoratedBackbone)(fd_config=config)
    runner = GPUModelRunner(config, model)
    if profile_run:
        runner.profile_run()
    runner.capture_model()
    return model.graph_opt_backend.cudagraph_piecewise_backend


# ------------------------------------------------------------------------------- scenarios


@scenario("equal-plans")
def equal_plans(rank: Rank) -> dict[str, Any]:
    backend = capture(tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1]))
    return {"captured": [r.size for r in backend.capture_report.records]}


@scenario("capture-sizes-differ")
def capture_sizes_differ(rank: Rank) -> dict[str, Any]:
    sizes = [8, 4, 2] if rank.index == 1 else [8, 4, 2, 1]
    backend = capture(tp_config(rank, cudagraph_capture_sizes=sizes))
    return {"captured": [r.size for r in backend.capture_report.records]}


def _diverging_at_four() -> type:
    """A model whose size-4 graph replays a host value frozen at capture, unlike eager: the
    self-check fails at size 4 only (a nondeterministic kernel would, on one rank)."""
    from conftest import DecoratedBackbone

    from fd_cudagraph_plugin.core.runtime import get_runtime

    runtime = get_runtime("simulated")

    class DivergesAtFour(DecoratedBackbone):
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


def _self_check_fails_on_rank_one(rank: Rank, mode: str) -> dict[str, Any]:
    previous = os.environ.get("FD_CUDAGRAPH_SELF_CHECK")
    os.environ["FD_CUDAGRAPH_SELF_CHECK"] = mode
    try:
        model_cls = _diverging_at_four() if rank.index == 1 else None
        backend = capture(
            tp_config(rank, cudagraph_capture_sizes=[8, 4, 2, 1]), model_cls=model_cls
        )
    finally:
        if previous is None:
            os.environ.pop("FD_CUDAGRAPH_SELF_CHECK")
        else:
            os.environ["FD_CUDAGRAPH_SELF_CHECK"] = previous
    return {"disabled": sorted(s for s, e in backend.decode_entries.items() if e.disabled)}


@scenario("self-check-error-on-one-rank")
def self_check_error_on_one_rank(rank: Rank) -> dict[str, Any]:
    return _self_check_fails_on_rank_one(rank, "error")


@scenario("self-check-warn-on-one-rank")
def self_check_warn_on_one_rank(rank: Rank) -> dict[str, Any]:
    return _self_check_fails_on_rank_one(rank, "warn")


# ---------------------------------------------------------------------------------- driver


#: How many ranks answered each exchange over the TP group during the current scenario.
_exchanges: list[int] = []


def _count_exchanges() -> None:
    """Note every exchange the plugin makes, so the test sees the real collective ran."""
    from fd_cudagraph_plugin.core import session

    gather = session.PaddleExchange.all_gather

    def counted(self: Any, obj: Any) -> list[Any]:
        everyone = gather(self, obj)
        _exchanges.append(len(everyone))
        return everyone

    session.PaddleExchange.all_gather = counted


def _run(name: str, rank: Rank) -> dict[str, Any]:
    from fd_cudagraph_plugin.core import capture as capture_module
    from fd_cudagraph_plugin.core import session
    from fd_cudagraph_plugin.core.errors import CudaGraphPluginError

    _exchanges.clear()
    try:
        facts = {"outcome": "ok", "message": "", **SCENARIOS[name](rank)}
    except CudaGraphPluginError as error:
        facts = {"outcome": type(error).__name__, "message": str(error)}
    finally:
        # The next scenario starts as a fresh worker would: no live backends, no session.
        gc.collect()
        session.reset_for_tests()
        capture_module.reset_for_tests()
    return {"rank": rank.index, "exchanges": list(_exchanges), **facts}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), required=True)
    parser.add_argument(
        "--deadline", type=float, default=90.0, help="seconds before this rank dumps and exits"
    )
    args = parser.parse_args()
    # A collective that never returns must end this rank with a traceback in its log rather
    # than rely on the test's kill alone; faulthandler's timer fires even inside gloo.
    faulthandler.dump_traceback_later(args.deadline, exit=True)

    import paddle.distributed as dist

    dist.init_parallel_env()
    world = dist.get_world_size()
    rank = Rank(dist.get_rank(), world, dist.new_group(list(range(world))))
    (args.out / f"pid.rank{rank.index}").write_text(str(os.getpid()))

    from fd_cudagraph_plugin import plugin

    plugin.register()
    _count_exchanges()
    for name in args.scenario:
        facts = _run(name, rank)
        (args.out / f"{name}.rank{rank.index}.json").write_text(json.dumps(facts))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
