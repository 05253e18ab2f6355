"""A target (16 layers) and an MTP-style draft (2 layers) in one process, captured by one
capture_model() loop (per size the target's step, then the draft's), as FastDeploy's MTP does.

usage: python bench_pair.py --backend fd [--shared] | --backend plugin [--pool instance|graph]

fd: use_unique_memory_pool=True (a pool per backend); --shared hands both backends one pool id.
plugin: without --pool, FD_CUDAGRAPH_POOL stays unset (the plugin's default, instance).
Prints one JSON line:

* graph memory (``memory_reserved`` growth) and, for the plugin, its accounting per backend and
  the roles its session gave them (target, draft);
* replay against eager of both models, alone and interleaved;
* output survival: does a replay of one graph change another graph's output still held?
* clear_graph() on the draft: what it frees, how many graphs are left, what the target serves
  then (FastDeploy's backend clears one backend; the plugin's clear releases every backend of
  the process, because the clear resets the process's custom all-reduce registrations), then
  clear_graph() on the target, and capture_model() again: both must replay exactly again.

--backend fd needs FD_HARNESS_FASTDEPLOY_BACKEND; without it the line says "skipped".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--backend", choices=["fd", "plugin"], required=True)
ap.add_argument("--shared", action="store_true")
ap.add_argument("--pool", default=None)
ap.add_argument("--tag", default="")
args = ap.parse_args()

import harness as H  # noqa: E402

if args.backend == "plugin":
    H.set_plugin_env(pool=args.pool)
import torch  # noqa: E402

out = {
    "tag": args.tag,
    "backend": args.backend,
    "shared": args.shared,
    "pool": args.pool,
    "errors": [],
}
missing = set()


def finish():
    H.finish(out, missing)


if args.backend == "fd":
    H.skip_without_fastdeploy(out, finish)
if args.shared:  # every backend gets the same pool id
    pool_id = H.paddle.base.core.CUDAGraph.gen_new_memory_pool_id()
    H.paddle.base.core.CUDAGraph.gen_new_memory_pool_id = staticmethod(lambda: pool_id)
try:
    cls = H.backend_class(args.backend)
except Exception as error:
    out["errors"].append("backend class: " + H.fmt_exc(error))
    finish()
if args.backend == "plugin":
    out.update(H.plugin_facts())
    out["plugin_env"] = H.plugin_env()
target_layers, hidden, inter = H.model_dims(16, 2048, 8192)
MAXB = 512
sizes = H.default_sizes(MAXB)
cfg = H.make_config(sizes, warmups=2, unique_pool=True)
X = torch.zeros(MAXB + 8, hidden, dtype=torch.bfloat16)
target = H.Toy(target_layers, hidden, inter, X, seed=0)
draft = H.Toy(2, hidden, inter, X, seed=1)
inp = H.Inputs(MAXB + 8)
for m in (target, draft):
    m(**inp.kw(MAXB))
H.sync()
try:
    bt = H.construct(cls, cfg, target)
    bd = H.construct(cls, cfg, draft)
except Exception as error:
    out["errors"].append("construct: " + H.fmt_exc(error))
    finish()
runner = H.GPUModelRunner(
    cfg, [lambda s: bt(**inp.kw(s)), lambda s: bd(**inp.kw(s))], model=target, draft_model=draft
)


def capture_model():
    if args.backend == "plugin":
        runner.capture_model()
    else:
        H.plain_capture_model(runner)
    H.sync()


H.sync()
r0 = H.reserved()
t = time.perf_counter()
try:
    capture_model()
except Exception as error:
    out["errors"].append("capture: " + H.fmt_exc(error))
    finish()
out["capture_s"] = round(time.perf_counter() - t, 3)
out["pool_mib"] = round((H.reserved() - r0) / H.MiB, 1)
out["live_graphs_after_capture"] = H.live_graphs()
if args.backend == "plugin":
    per = {}
    for name, be in (("target", bt), ("draft", bd)):
        fig, miss = H.plugin_figures(be, report_detail=False)
        missing.update(miss)
        per[name] = (fig.get("plugin_stats") or {}).get("graph_mib_total")
    out["plugin_graph_mib"] = per
    fig, _ = H.plugin_figures(bt, report_detail=False)
    out["pool_policy"] = (fig.get("plugin_stats") or {}).get("pool_policy")
    out["roles"] = [H.plugin_surface.role(bt), H.plugin_surface.role(bd)]
    try:
        out["report_summary"] = H.plugin_surface.summary(bt)
    except Exception:
        missing.add("capture_report.summary")

table = cfg.graph_opt_config.real_shape_to_captured_size


def diff(be, m, real, padded=True):
    X.zero_()
    X[:real] = torch.randn(real, hidden, dtype=torch.bfloat16)
    got = be(**inp.kw(real))[:real].float().clone()
    ref = m(**inp.kw(table[real] if padded else real))[:real].float()
    return (got - ref).abs().max().item()


def worst_diff():
    worst = 0.0
    for real in [1, 3, 5, 17, 100, 250, 257, 511, 512]:
        for be, m in ((bt, target), (bd, draft)):
            worst = max(worst, diff(be, m, real))
    # interleaved steps, as serving alternates target and draft
    for real in [7, 300, 2, 64]:
        X.zero_()
        X[:real] = torch.randn(real, hidden, dtype=torch.bfloat16)
        gt = bt(**inp.kw(real))[:real].float().clone()
        gd = bd(**inp.kw(real))[:real].float().clone()
        et = target(**inp.kw(table[real]))[:real].float()
        ed = draft(**inp.kw(table[real]))[:real].float()
        worst = max(worst, (gt - et).abs().max().item(), (gd - ed).abs().max().item())
    return worst


try:
    out["max_abs_diff_vs_eager_padded"] = worst_diff()
except Exception as error:
    out["errors"].append("correctness: " + H.fmt_exc(error))


def survival(first, second):
    """Replay first at size a, keep its output, replay second at size b (new inputs), and count
    the (a, b) pairs where the first output changed: the second graph's memory overlaps it."""
    hit, pairs, example = 0, 0, None
    for a in sizes:
        for b in sizes:
            if first is second and a == b:
                continue
            X.copy_(torch.randn_like(X))
            o = first(**inp.kw(a))
            ref = o.clone()
            X.copy_(torch.randn_like(X))
            second(**inp.kw(b))
            d = (o - ref).abs().max().item()
            pairs += 1
            if d != 0.0:
                hit += 1
                example = example or f"size {a} output changed by a replay of size {b} ({d:.3g})"
    return {"pairs": pairs, "clobbered": hit, "example": example}


try:
    # Graph outputs are valid until the next replay of a graph that shares their memory. Within
    # one backend FastDeploy consumes each step's output before the next step; across target and
    # draft FastDeploy's MTP copies target_hidden_states into its own buffer before the draft runs.
    out["output_survival_target_then_draft"] = survival(bt, bd)
    out["output_survival_target_then_target"] = survival(bt, bt)
except Exception as error:
    out["errors"].append("survival: " + H.fmt_exc(error))
try:
    H.sync()
    rc0 = H.reserved()
    bd.clear_graph()
    H.sync()
    H.empty_cache()
    out["reserved_freed_mib_by_draft_clear"] = round((rc0 - H.reserved()) / H.MiB, 1)
    out["live_graphs_after_draft_clear"] = H.live_graphs()
    # Graphs left: the target replays them (exact at the padded size); none left: it runs eagerly
    # (exact at the real size).
    out["target_after_draft_clear"] = {
        "diff_vs_eager_padded": diff(bt, target, 33),
        "diff_vs_eager_real": diff(bt, target, 33, padded=False),
    }
    bt.clear_graph()
    H.sync()
    H.empty_cache()
    out["reserved_freed_mib_by_both_clear"] = round((rc0 - H.reserved()) / H.MiB, 1)
    out["reserved_left_vs_before_capture_mib"] = round((H.reserved() - r0) / H.MiB, 1)
    out["live_graphs_after_clear"] = H.live_graphs()
except Exception as error:
    out["errors"].append("clear: " + H.fmt_exc(error))
try:
    r1 = H.reserved()
    capture_model()
    out["recapture"] = {
        "pool_mib": round((H.reserved() - r1) / H.MiB, 1),
        "live_graphs": H.live_graphs(),
        "max_abs_diff_vs_eager_padded": worst_diff(),
    }
except Exception as error:
    out["errors"].append("recapture: " + H.fmt_exc(error))
finish()
