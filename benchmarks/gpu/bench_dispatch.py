"""Host time per decode step on a GPU: the plugin, FastDeploy's backend and a bare graph replay,
on a tiny model so that host work dominates.

usage: python bench_dispatch.py [--layers 1 --hidden 256 --inter 1024] [--steps 64 --reps 4
           --rounds 30] [--tag NAME]

Every backend captures in one process (27 sizes: FastDeploy's list for max_num_seqs=256). The
same pre-built list of decode steps (token counts 1..256, seeded) is served by each variant: a
loop of steps * reps calls with no synchronisation between steps, then one synchronize.

* host_us: per step, the time until the loop has issued everything (before the synchronize);
  total_us: per step, until the GPU finished. Variants interleave by round; best and median.
* ``bare_replay``: graphs the harness captured itself through the shim, one ``replay()`` per
  step, the call both backends end in; a backend's ``host_overhead_us`` is its host time above
  that, and ``overhead_ratio_plugin_over_fd`` compares the two backends' overheads.
* Timed twice: with the shim's default-device mode on (as installed: a Python TorchFunctionMode
  in front of every torch call, Tensor.shape included, which Paddle does not have) and off (the
  closer figure for Paddle, whose Tensor.shape is a plain C getter).

Without FD_HARNESS_FASTDEPLOY_BACKEND the FastDeploy variant is skipped and the line says so.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=1)
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--inter", type=int, default=1024)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--reps", type=int, default=4)
ap.add_argument("--rounds", type=int, default=30)
ap.add_argument("--tag", default="")
args = ap.parse_args()

import harness as H  # noqa: E402

H.set_plugin_env()
import torch  # noqa: E402

sizes = [1, 2, 4, *range(8, 129, 8), *range(144, 257, 16)]
MAXB = 256
layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
if H.DRY:  # bf16 matmuls are slow on a CPU: a plumbing check only
    args.rounds, args.reps = min(args.rounds, 3), 1
X = torch.zeros(MAXB + 8, hidden, dtype=torch.bfloat16)
model = H.Toy(layers, hidden, inter, X, seed=0)
inp = H.Inputs(MAXB + 8)
model(**inp.kw(MAXB))
H.sync()
out = {
    "tag": args.tag,
    "layers": layers,
    "hidden": hidden,
    "graphs": len(sizes),
    "fastdeploy": H.fastdeploy_status(),
    "errors": [],
}
table = H.make_config(sizes).graph_opt_config.real_shape_to_captured_size


def bare_graphs():
    """One shim graph per size in one pool, warmed up as the backends warm up: no backend."""
    graphs_api = H.paddle.device.cuda.graphs
    pool = H.paddle.base.core.CUDAGraph.gen_new_memory_pool_id()
    graphs = {}
    for size in sorted(sizes, reverse=True):
        kw = inp.kw(size)
        for _ in range(2):
            model(**kw)
        graph = graphs_api.CUDAGraph(pool_id=pool)
        H.paddle.device.synchronize()
        graph.capture_begin()
        model(**kw)
        graph.capture_end()
        H.paddle.device.synchronize()
        graphs[size] = graph
    return graphs


backends = {}
try:
    # FastDeploy's backend first; it runs the runner's loop unwrapped.
    if H.FASTDEPLOY_CLASS is not None:
        cfg = H.make_config(sizes, warmups=2, unique_pool=True)
        fd = H.construct(H.backend_class("fd"), cfg, model)
        H.plain_capture_model(H.GPUModelRunner(cfg, [lambda s: fd(**inp.kw(s))], model=model))
        backends["fastdeploy"] = fd
    elif H.FASTDEPLOY_ERROR:
        out["errors"].append("fastdeploy backend: " + H.FASTDEPLOY_ERROR)
    cls = H.backend_class("plugin")
    out.update(H.plugin_facts())
    cfg = H.make_config(sizes, warmups=2, unique_pool=True)
    plug = H.construct(cls, cfg, model)
    H.GPUModelRunner(cfg, [lambda s: plug(**inp.kw(s))], model=model).capture_model()
    backends["plugin"] = plug
    bare = bare_graphs()
    H.sync()
except Exception as error:
    out["errors"].append("set-up: " + H.fmt_exc(error))
    H.emit(out)
    sys.exit(1)

rng = random.Random(0)
counts = [rng.randint(1, MAXB) for _ in range(args.steps)]
kws = [inp.kw(n) for n in counts]
bare_fns = [bare[table[n]].replay for n in counts]


def loop_bare():
    for f in bare_fns:
        f()


def make_loop(be):
    def loop():
        for kw in kws:
            be(**kw)

    return loop


def loop_eager():
    for kw in kws:
        model(**kw)


variants = {
    "bare_replay": loop_bare,
    **{k: make_loop(b) for k, b in backends.items()},
    "eager": loop_eager,
}
# outputs agree (one pass per variant, compared at the last step)
ref = None
for name, be in backends.items():
    X.zero_()
    X[: counts[-1]] = 1.0
    o = be(**kws[-1])[: counts[-1]].float().clone()
    ref = o if ref is None else ref
    out[f"agree_{name}"] = bool(torch.equal(o, ref))


def measure():
    host = {k: [] for k in variants}
    total = {k: [] for k in variants}
    n_calls = args.steps * args.reps
    for rnd in range(args.rounds + 2):
        for name, loop in variants.items():
            H.sync()
            t0 = time.perf_counter()
            for _ in range(args.reps):
                loop()
            t1 = time.perf_counter()
            H.sync()
            t2 = time.perf_counter()
            if rnd >= 2:  # two warm rounds
                host[name].append((t1 - t0) / n_calls * 1e6)
                total[name].append((t2 - t0) / n_calls * 1e6)
    res = {}
    for name in variants:
        res[name] = {
            "host_us_best": round(min(host[name]), 3),
            "host_us_median": round(statistics.median(host[name]), 3),
            "total_us_best": round(min(total[name]), 3),
            "total_us_median": round(statistics.median(total[name]), 3),
        }
    base = res["bare_replay"]
    for name in backends:
        res[name]["host_overhead_us_best"] = round(
            res[name]["host_us_best"] - base["host_us_best"], 3
        )
        res[name]["host_overhead_us_median"] = round(
            res[name]["host_us_median"] - base["host_us_median"], 3
        )
    if "fastdeploy" in backends:
        ov_p = res["plugin"]["host_overhead_us_best"]
        ov_f = res["fastdeploy"]["host_overhead_us_best"]
        res["overhead_ratio_plugin_over_fd_best"] = round(ov_p / ov_f, 2) if ov_f > 0 else None
    else:
        res["overhead_ratio_plugin_over_fd_best"] = "skipped: " + (
            H.FASTDEPLOY_SKIPPED or "FastDeploy's backend did not load"
        )
    return res


try:
    out["per_step_default_device_mode_on"] = measure()
    torch.set_default_device(None)
    out["per_step_default_device_mode_off"] = measure()
except Exception as error:
    out["errors"].append("measure: " + H.fmt_exc(error))
fig, miss = H.plugin_figures(plug, report_detail=False)
out["plugin_stats"] = fig.get("plugin_stats")
if miss:
    out["surface_missing"] = miss
H.emit(out)
sys.exit(1 if out["errors"] else 0)
