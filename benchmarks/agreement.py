"""What the tensor-parallel ranks' agreement costs in the healthy case: 2 and 4 CPU ranks, 36 sizes.

It launches the ranks with ``paddle.distributed.launch`` (gloo), each running FastDeploy's
``capture_model()`` (the stand-in runner) over 36 sizes, with a custom all-reduce stand-in whose
registration is a real ``all_gather_object`` over the TP group, as FastDeploy's is. Rounds
alternate two arms in the same processes:

* ``agreement``: the plugin as it ships: every agreement point goes through Paddle's job store
  (``ranks/verdict.py``);
* ``no agreement``: the same sessions with a link that answers at once without asking the other
  ranks, which is what capturing without agreement points costs (the session's one registration
  still synchronises the ranks, at its end);
* ``FastDeploy's registrations``: as ``no agreement``, with the custom all-reduce registered after
  every graph, as FastDeploy's own backend does (an ``all_gather_object`` per graph): what a
  capture session's collectives cost without the plugin.

The agreement's cost per session is ``agreement`` minus ``no agreement``, round by round. It
includes what the ranks wait for each other at each point (on 2 cores beside each other, the
scheduler's skew between the ranks, which one collective at the end absorbs once).

``--against REV`` runs the benchmark of an earlier commit too (0.6.0's ZeroMQ channel:
``--against 4dbd48f``, which needs pyzmq installed), from ``git archive`` into a temporary
folder, in the same run: figures of different runs on this machine do not compare.

    python benchmarks/agreement.py [--rounds 7] [--ranks 2 4] [--against REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1, 2, 4, 6, *range(8, 129, 8), *range(144, 257, 16), *range(288, 513, 32)]


def rank_main(args: argparse.Namespace) -> int:
    sys.path[:0] = [str(ROOT / "tests" / "fastdeploy_stub"), str(ROOT / "tests")]
    os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"
    import paddle.distributed as dist
    from conftest import DecoratedMixing, make_config
    from fastdeploy.distributed import communication
    from fastdeploy.distributed.custom_all_reduce import CustomAllreduce
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner
    from simulated import TestRuntime

    from fd_cudagraph_plugin import plugin
    from fd_cudagraph_plugin.core import lifecycle, process, runtime, session
    from fd_cudagraph_plugin.core.ranks.link import Agreed, Outcome

    dist.init_parallel_env()
    world, index = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    plugin.register()

    class NoAgreement:
        """Answers every point at once, as if every rank had posted the same."""

        def __init__(self, rank: int, world: int) -> None:
            self.rank, self.world = rank, world

        def stop(self, point, label, status):
            pass

        def agree(self, point, label, status, timeout):
            everyone = range(self.world)
            return Agreed(
                label,
                Outcome(point, dict.fromkeys(everyone, status), dict.fromkeys(everyone, label)),
            )

    real_link_for = session.link_for
    enter = session.CaptureSession.__enter__

    def registering_per_graph(self):
        entered = enter(self)
        self.registers = False  # each graph registers at its capture, as FastDeploy's does
        return entered

    # A worker opens its client to the job store once per process; that one-off start is timed
    # apart, and every round reuses the link.
    state = process.reset_for_tests()
    started = time.perf_counter()
    real_link_for(make_config_for(world, index, group, make_config), state)
    join_seconds = time.perf_counter() - started
    links = dict(state.links)
    times: dict[str, list[float]] = {
        "agreement": [],
        "no agreement": [],
        "FastDeploy's registrations": [],
    }
    points = 0
    calls = 0
    for _ in range(args.rounds):
        for arm in times:
            fresh = process.reset_for_tests()
            fresh.links.update(links)
            # Each session as a later lifecycle call of the same worker: its points are named
            # after that call (a fresh process state would name them as the first call's again).
            calls += 1
            lifecycle.state(fresh).calls = calls
            runtime.install_runtime(TestRuntime())
            communication._TP_AR = CustomAllreduce(group, initialized=True)
            session.link_for = (
                real_link_for
                if arm == "agreement"
                else (lambda fd_config, worker: NoAgreement(index, world))
            )
            session.CaptureSession.__enter__ = (
                registering_per_graph if arm == "FastDeploy's registrations" else enter
            )
            config = make_config_for(world, index, group, make_config)
            model = DecoratedMixing(fd_config=config)
            runner = GPUModelRunner(config, model)
            runner.profile_run()
            dist.barrier(group=group)
            started = time.perf_counter()
            runner.capture_model()
            times[arm].append(time.perf_counter() - started)
            report = model.graph_opt_backend.cudagraph_piecewise_backend.capture_report
            if arm == "agreement":
                points = report.agreement_points
            dist.barrier(group=group)
    facts = {"times": times, "points": points, "join_seconds": join_seconds}
    Path(args.out, f"rank{index}.json").write_text(json.dumps(facts))
    return 0


def make_config_for(world, index, group, make_config):
    config = make_config(512, tp=world, cudagraph_capture_sizes=SIZES)
    config.parallel_config.tensor_parallel_rank = index
    config.parallel_config.tp_group = group
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--against", default=None, help="a commit whose benchmark runs too")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args)
    failed = 0
    for world in args.ranks:
        print("this checkout:")
        failed = max(failed, _measure(world, args.rounds))
        if args.against:
            print(f"{args.against}:")
            failed = max(failed, _earlier(args.against, world, args.rounds))
    return failed


def _earlier(revision: str, world: int, rounds: int) -> int:
    """The benchmark of ``revision``, run from its own tree."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        script = Path(tree, "benchmarks", "agreement.py")
        command = [sys.executable, str(script), "--rounds", str(rounds), "--ranks", str(world)]
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
        print(done.stdout.rstrip())
        if done.returncode:
            print(done.stderr[-2000:])
        return done.returncode


def _measure(world: int, rounds: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "GLOG_minloglevel": "2",
        }
        command = [
            sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(world),
            "--log_dir", str(Path(out) / "log"), __file__, "--rank", "--out", out,
            "--rounds", str(rounds),
        ]  # fmt: skip
        # Gloo's own rendezvous now and then finds a peer's port not listening yet on this
        # 2-core machine ("Connection refused"): a launch that failed so is started again.
        for _ in range(3):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                break
        else:
            print(done.stdout[-3000:], done.stderr[-3000:])
            return 1
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
    print(
        f"capture_model() over {len(SIZES)} sizes on {world} CPU ranks (gloo), simulated graphs, "
        f"median of {rounds} interleaved rounds; {ranks[0]['points']} agreement points"
    )
    for rank, facts in enumerate(ranks):
        times = facts["times"]
        # Rounds alternate the arms, so each round's difference is the cost within that round.
        costs = sorted(
            a - f for a, f in zip(times["agreement"], times["no agreement"], strict=True)
        )
        agreed, free, native = (
            statistics.median(times["agreement"]),
            statistics.median(times["no agreement"]),
            statistics.median(times["FastDeploy's registrations"]),
        )
        cost = statistics.median(costs)
        spread = f"{costs[0] * 1e3:.1f}..{costs[-1] * 1e3:.1f}"
        verdict = (
            "below noise: the rounds disagree on its sign"
            if costs[0] < 0 < costs[-1]
            else f"{cost / max(facts['points'], 1) * 1e6:.0f} us a point"
        )
        print(
            f"  rank {rank}: with agreement {agreed * 1e3:7.1f} ms, without {free * 1e3:7.1f} ms, "
            f"without but registering per graph as FastDeploy does {native * 1e3:7.1f} ms "
            f"(medians); agreement cost per session {cost * 1e3:.1f} ms (rounds {spread}; "
            f"{verdict}); joining the group's agreement once per process "
            f"{facts['join_seconds'] * 1e3:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
