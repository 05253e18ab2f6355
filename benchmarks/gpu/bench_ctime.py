"""capture_model() time of FastDeploy's backend and the plugin in ONE process, interleaved.

usage: python bench_ctime.py [--rounds 6] [--variants fd_unique_pool,plugin,fd_private_pools]
           [--breakdown] [--layers 16 --hidden 2048 --inter 8192] [--warmups 2] [--tag NAME]

Eager forwards dominate capture time and their speed differs from process to process
(CPU-bound launches), so separate processes do not compare; here every variant shares one
process, model and inputs. Each round runs every variant once (order reversed on odd rounds):
clear_graph() (from round 1), empty_cache(), then capture_model(), timed to a synchronize.
Round 0 is the first capture and is shown apart; medians are over the later rounds.

Variants: ``fd_unique_pool`` (FastDeploy, use_unique_memory_pool=True), ``fd_private_pools``
(False: a pool per graph), ``plugin`` (FD_CUDAGRAPH_POOL unset: one pool per backend) and, on
request, ``plugin_graph`` (FD_CUDAGRAPH_POOL=graph; a second plugin backend in the process joins
every plugin capture session and is released by every plugin clear).

Figures (the goal is a ratio <= 1.0):

* ``ratio_plugin_over_fd_unique.capture_model``: the median over rounds of plugin / FastDeploy
  capture_model() time, each round's pair measured back to back;
* ``per_size``: per capture size, each backend's step time (warm-ups, capture, the replay that
  ends the step; the loop's steps run back to back, so a step's queued GPU work can finish in
  the next one) and the median over rounds of their ratio; ``per_size_median``/``max`` and
  ``sizes_above_1`` summarise it;
* ``ms_per_size``: median capture_model() time / graphs, and the same inside the steps only.

--breakdown splits each capture_model() into categories (capture_breakdown.py) with timing
wrappers around the shim's calls and the model, for both backends alike, and shows the
plugin's extra milliseconds per category against FastDeploy's. The wrappers cost a little, so
run.sh times the headline ratio in a run without them.

Without FD_HARNESS_FASTDEPLOY_BACKEND only the plugin variants run and the ratios say
"skipped".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--variants", default="fd_unique_pool,plugin,fd_private_pools")
ap.add_argument("--breakdown", action="store_true")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=8192)
ap.add_argument("--warmups", type=int, default=2)
ap.add_argument("--tag", default="")
args = ap.parse_args()
import harness as H  # noqa: E402

if args.breakdown:  # before any backend or runtime exists
    import capture_breakdown as B

    B.install(H.paddle)
H.set_plugin_env()
import torch  # noqa: E402

KNOWN = ("fd_unique_pool", "fd_private_pools", "plugin", "plugin_graph")
layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
if H.DRY:
    args.rounds = min(args.rounds, 3)
if os.environ.get("FD_HARNESS_SIZES"):
    sizes = sorted({int(x) for x in os.environ["FD_HARNESS_SIZES"].split(",")})
else:
    sizes = H.default_sizes(512)
MAXB = max(sizes)
X = torch.zeros(MAXB + 8, hidden, dtype=torch.bfloat16)
toy = H.Toy(layers, hidden, inter, X, seed=0)
model = B.timed_model(toy) if args.breakdown else toy
inp = H.Inputs(MAXB + 8)
for _ in range(2):  # FastDeploy's profile run
    toy(**inp.kw(MAXB))
H.sync()
out = {
    "tag": args.tag,
    "graphs": len(sizes),
    "warmups": args.warmups,
    "layers": layers,
    "hidden": hidden,
    "rounds": args.rounds,
    "breakdown": args.breakdown,
    "fastdeploy": H.fastdeploy_status(),
    "errors": [],
}
wanted = [v for v in args.variants.split(",") if v]
unknown = [v for v in wanted if v not in KNOWN]
if unknown:
    out["errors"].append(f"unknown variants {unknown}; known: {', '.join(KNOWN)}")
if H.FASTDEPLOY_ERROR:
    out["errors"].append("fastdeploy backend: " + H.FASTDEPLOY_ERROR)

variants = {}  # name -> (backend, capture_model(), its per-size step times, is the plugin)


def add(name, make):
    step_s = {}
    try:
        be, cfg, is_plugin = make()
    except Exception as error:
        out["errors"].append(f"{name}: " + H.fmt_exc(error, 1500))
        return

    def step(size, be=be):
        started = time.perf_counter()
        be(**inp.kw(size))
        step_s[size] = time.perf_counter() - started

    runner = H.GPUModelRunner(cfg, [step], model=toy)
    # The plugin's register() wrapped the runner's capture_model() in its capture session;
    # FastDeploy's backend has no hook and runs the same loop unwrapped.
    capture = runner.capture_model if is_plugin else lambda: H.plain_capture_model(runner)
    variants[name] = (be, capture, step_s, is_plugin)


def fastdeploy_variant(unique):
    cfg = H.make_config(sizes, warmups=args.warmups, unique_pool=unique)
    return H.construct(H.backend_class("fd"), cfg, model), cfg, False


def plugin_variant(pool):
    H.set_plugin_env(pool=pool)  # read at construction
    cfg = H.make_config(sizes, warmups=args.warmups, unique_pool=True)
    try:
        return H.construct(H.backend_class("plugin"), cfg, model), cfg, True
    finally:
        H.set_plugin_env()


for name in wanted:
    if name.startswith("fd_") and H.FASTDEPLOY_CLASS is None:
        continue
    if name == "fd_unique_pool":
        add(name, lambda: fastdeploy_variant(True))
    elif name == "fd_private_pools":
        add(name, lambda: fastdeploy_variant(False))
    elif name == "plugin":
        add(name, lambda: plugin_variant(None))
    elif name == "plugin_graph":
        add(name, lambda: plugin_variant("graph"))
if any(is_plugin for *_, is_plugin in variants.values()):
    out.update(H.plugin_facts())

totals = {k: [] for k in variants}
steps = {k: [] for k in variants}  # per round: {size: seconds}
parts = {k: [] for k in variants}  # per round: breakdown categories
calls = {}
reports = {k: [] for k in variants}
eager_ms = []
broken = set()
for rnd in range(args.rounds):
    order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
    for name in order:
        if name in broken:
            continue
        be, capture, step_s, is_plugin = variants[name]
        try:
            if rnd:
                be.clear_graph()
            H.sync()
            H.empty_cache()
            step_s.clear()
            if args.breakdown:
                B.RECORDER.start()
            started = time.perf_counter()
            capture()
            H.sync()
            total = time.perf_counter() - started
            if args.breakdown:
                seconds, calls[name] = B.RECORDER.stop()
                parts[name].append(B.split(total, sum(step_s.values()), seconds))
            totals[name].append(total)
            steps[name].append(dict(step_s))
            if is_plugin:
                reports[name].append(H.plugin_surface.session_timings(be))
        except Exception as error:
            broken.add(name)
            out["errors"].append(f"{name} round {rnd}: " + H.fmt_exc(error, 1500))
    # the eager forward speed of this round, for context: 3 sizes
    kws = [inp.kw(n) for n in (1, min(64, MAXB), MAXB)]
    H.sync()
    t = time.perf_counter()
    for kw in kws:
        toy(**kw)
    H.sync()
    eager_ms.append((time.perf_counter() - t) / 3 * 1e3)


def later(xs):
    """The rounds after the first capture (all of them when there is only one)."""
    return xs[1:] if len(xs) > 1 else xs


def ms(x):
    return None if x is None else round(x * 1e3, 2)


out["capture_s"] = {
    k: {
        "first": round(v[0], 4) if v else None,
        "median_later": round(H.med(later(v)), 4) if v else None,
        "all": [round(x, 4) for x in v],
    }
    for k, v in totals.items()
}
out["ms_per_size"] = {
    k: {
        "capture_model": ms(H.med(later(totals[k])) / len(sizes)) if totals[k] else None,
        "in_steps": ms(H.med([sum(s.values()) for s in later(steps[k])]) / len(sizes))
        if steps[k]
        else None,
    }
    for k in variants
}
REF = "fd_unique_pool"
if REF in variants and "plugin" in variants and totals[REF] and totals["plugin"]:
    pairs = list(zip(later(totals["plugin"]), later(totals[REF]), strict=False))
    per_size = {}
    paired = list(zip(later(steps["plugin"]), later(steps[REF]), strict=False))
    for size in sorted(sizes, reverse=True):
        ratios = [p[size] / f[size] for p, f in paired if size in p and size in f]
        per_size[size] = {
            "fd_unique_pool_ms": ms(H.med([f[size] for _, f in paired if size in f])),
            "plugin_ms": ms(H.med([p[size] for p, _ in paired if size in p])),
            "ratio": round(H.med(ratios), 3) if ratios else None,
        }
    size_ratios = [v["ratio"] for v in per_size.values() if v["ratio"] is not None]
    headline = round(H.med([p / f for p, f in pairs]), 3)
    out["ratio_plugin_over_fd_unique"] = {
        "capture_model": headline,
        "per_size_median": round(H.med(size_ratios), 3) if size_ratios else None,
        "per_size_max": max(size_ratios, default=None),
        "sizes_above_1": sum(r > 1.0 for r in size_ratios),
        "goal": "<= 1.0",
        "meets_goal": headline <= 1.0,
    }
    out["per_size"] = per_size
else:
    out["ratio_plugin_over_fd_unique"] = (
        "skipped: " + (H.FASTDEPLOY_SKIPPED or "FastDeploy's backend did not load")
        if H.FASTDEPLOY_CLASS is None
        else "n/a: needs the fd_unique_pool and plugin variants"
    )
if any(reports.values()):
    # The plugin's own timings (capture_report, stats()["capture_seconds"]), medians.
    out["plugin_session"] = {
        k: {key: round(H.med([r[key] for r in later(v)]), 3) for key in v[0]}
        for k, v in reports.items()
        if v
    }
if args.breakdown:
    summary = {}
    for k, rows in parts.items():
        if not rows:
            continue
        keys = rows[0].keys()
        summary[k] = {
            "ms_per_capture_model": {c: ms(H.med([r[c] for r in later(rows)])) for c in keys},
            "calls_per_capture_model": calls.get(k),
        }
    out["breakdown"] = summary
    if REF in summary and "plugin" in summary:
        mine = summary["plugin"]["ms_per_capture_model"]
        theirs = summary[REF]["ms_per_capture_model"]
        out["breakdown_plugin_minus_fd_unique_ms"] = {
            c: round(mine[c] - theirs[c], 2) for c in mine if mine[c] is not None
        }
out["eager_forward_ms_per_round"] = [round(x, 2) for x in eager_ms]
H.emit(out)
sys.exit(1 if out["errors"] else 0)
