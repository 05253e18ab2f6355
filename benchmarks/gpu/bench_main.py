"""One backend on the GPU: graph memory, replay against eager, clear/recapture cycles, latency.

usage: python bench_main.py --backend fd|plugin [--unique-pool] [--pool instance|graph]
           [--self-check error|warn] [--warmups 2] [--cycles N] [--latency] [--no-correct]
           [--layers 16 --hidden 2048 --inter 8192 --max-bs 512] [--tag NAME]

Prints one JSON line. Captures go through the stand-in GPUModelRunner.capture_model() (the loop
the plugin wraps in its capture session; FastDeploy's backend gets the same loop unwrapped),
after an eager profile run at the largest size, as FastDeploy's worker does. Measured:

* capture seconds; graph memory as the ``memory_reserved()`` growth over capture_model(), with
  the plugin's own accounting beside it (``stats()``, ``capture_report``, the memory report);
* replay against eager at every token count 1..max: against eager at the padded size it must be
  bit-exact; against eager at the real size it is shown too (padding changes bf16 results);
* N cycles of clear_graph() + capture_model(): reserved and allocated memory and live graphs
  after each clear, capture time, a replay check after each recapture;
* eager against replay step latency at 1, 8, 64 and 256 tokens.

--backend fd needs FD_HARNESS_FASTDEPLOY_BACKEND; without it the line says "skipped".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ap = argparse.ArgumentParser()
ap.add_argument("--backend", choices=["fd", "plugin"], required=True)
ap.add_argument("--unique-pool", action="store_true", help="fd: use_unique_memory_pool=True")
ap.add_argument("--pool", default=None, help="plugin: FD_CUDAGRAPH_POOL (instance or graph)")
ap.add_argument("--self-check", default=None, help="plugin: FD_CUDAGRAPH_SELF_CHECK")
ap.add_argument("--warmups", type=int, default=2)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=8192)
ap.add_argument("--max-bs", type=int, default=512)
ap.add_argument("--cycles", type=int, default=0)
ap.add_argument("--latency", action="store_true")
ap.add_argument("--no-correct", action="store_true")
ap.add_argument("--tag", default="")
args = ap.parse_args()

report_path = os.path.join(tempfile.gettempdir(), f"fdcg_memreport_{os.getpid()}.json")
import harness as H  # noqa: E402

if args.backend == "plugin":
    H.set_plugin_env(pool=args.pool, self_check=args.self_check, memory_report=report_path)
import torch  # noqa: E402

layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
if H.DRY:  # a plumbing check: fewer cycles (and fewer token counts below)
    args.cycles = min(args.cycles, 2)
out = {
    "tag": args.tag,
    "backend": args.backend,
    "unique_pool": args.unique_pool,
    "pool": args.pool,
    "warmups": args.warmups,
    "self_check": args.self_check,
    "layers": layers,
    "hidden": hidden,
    "errors": [],
}
missing = set()


def plugin_figures(**kw):
    fig, miss = H.plugin_figures(backend, **kw)
    missing.update(miss)
    return fig


def finish():
    H.finish(out, missing)


if args.backend == "fd":
    H.skip_without_fastdeploy(out, finish)
try:
    cls = H.backend_class(args.backend)
except Exception as error:
    out["errors"].append("backend class: " + H.fmt_exc(error))
    finish()
if args.backend == "plugin":
    out.update(H.plugin_facts())
    out["plugin_env"] = H.plugin_env()

if os.environ.get("FD_HARNESS_SIZES"):
    sizes = [int(x) for x in os.environ["FD_HARNESS_SIZES"].split(",")]
else:
    sizes = H.default_sizes(args.max_bs)
MAXB = args.max_bs
# The plugin takes FastDeploy's use_unique_memory_pool as its default pool policy; --pool overrides.
unique = True if args.backend == "plugin" else args.unique_pool
cfg = H.make_config(sizes, warmups=args.warmups, unique_pool=unique)
dt = torch.bfloat16
X = torch.zeros(MAXB + 8, hidden, dtype=dt)
model = H.Toy(layers, hidden, inter, X, seed=0)
inp = H.Inputs(MAXB + 8)
out["graphs"] = len(sizes)
out["use_unique_memory_pool"] = cfg.graph_opt_config.use_unique_memory_pool

# FastDeploy's profile run: eager forwards at the largest size before any capture.
r_before_profile = H.reserved()
for _ in range(2):
    model(**inp.kw(MAXB))
H.sync()

try:
    backend = H.construct(cls, cfg, model)
except Exception as error:
    out["errors"].append("construct: " + H.fmt_exc(error))
    finish()
runner = H.GPUModelRunner(cfg, [lambda s: backend(**inp.kw(s))], model=model)
capture_model = (
    runner.capture_model if args.backend == "plugin" else lambda: H.plain_capture_model(runner)
)


def capture_all():
    H.sync()
    t = time.perf_counter()
    capture_model()
    H.sync()
    return time.perf_counter() - t


r0, a0 = H.reserved(), H.allocated()
try:
    out["capture_s"] = round(capture_all(), 3)
except Exception as error:
    out["errors"].append("first capture: " + H.fmt_exc(error))
    finish()
r1, a1 = H.reserved(), H.allocated()
out["pool_mib"] = round((r1 - r0) / H.MiB, 1)
out["pool_mib_incl_profile_run"] = round((r1 - r_before_profile) / H.MiB, 1)
out["allocated_growth_mib"] = round((a1 - a0) / H.MiB, 1)
out["live_graphs_after_capture"] = H.live_graphs()

try:
    backend.check_capture_successful()
    out["check_capture_successful"] = "ok"
except Exception as error:
    out["check_capture_successful"] = f"{type(error).__name__}: {str(error)[:160]}"

if args.backend == "plugin":
    out.update(plugin_figures(report_path=report_path))


def check(counts):
    """Replay against eager over token counts: max |diff| against eager at the padded size and
    at the real size."""
    worst_pad = worst_real = 0.0
    nonexact = 0
    table = cfg.graph_opt_config.real_shape_to_captured_size
    for real in counts:
        X.zero_()
        X[:real] = torch.randn(real, hidden, dtype=dt)
        got = backend(**inp.kw(real))
        got = got[:real].float().clone()
        ref_pad = model(**inp.kw(table[real]))[:real].float()
        ref_real = model(**inp.kw(real)).float()
        d_pad = (got - ref_pad).abs().max().item()
        d_real = (got - ref_real).abs().max().item()
        nonexact += d_pad != 0.0
        worst_pad, worst_real = max(worst_pad, d_pad), max(worst_real, d_real)
    return {
        "counts": len(counts),
        "max_abs_diff_vs_eager_padded": worst_pad,
        "max_abs_diff_vs_eager_real": worst_real,
        "nonexact_vs_padded": int(nonexact),
    }


if not args.no_correct:
    try:
        every = range(1, MAXB + 1)
        out["correct"] = check(sorted({*range(1, MAXB + 1, 37), MAXB}) if H.DRY else every)
        if args.backend == "plugin":
            # the same output object on every replay of one size
            o1 = backend(**inp.kw(5))
            o2 = backend(**inp.kw(7))
            out["same_object_per_size"] = o1 is o2
            del o1, o2  # graph outputs held here would pin their pool across clear_graph()
            # steps FastDeploy's backend fails on (0 tokens, above the largest size) run eagerly
            extra = {}
            for n in (0, MAXB + 1):
                try:
                    r = backend(**inp.kw(n))
                    ref = model(**inp.kw(n))
                    extra[n] = "ok" if torch.equal(r, ref) else "mismatch"
                    del r, ref
                except Exception as error:
                    extra[n] = f"{type(error).__name__}: {error}"[:200]
            out["odd_steps"] = extra
            out["stats_after_check"] = plugin_figures(report_detail=False).get("plugin_stats")
    except Exception as error:
        out["errors"].append("correctness: " + H.fmt_exc(error))

if args.cycles:
    cyc = {
        "reserved_mib_after_clear": [],
        "allocated_mib_after_clear": [],
        "reserved_mib_after_capture": [],
        "allocated_mib_after_capture": [],
        "live_graphs_after_clear": [],
        "capture_s": [],
        "max_abs_diff_vs_eager_padded": 0.0,
    }
    try:
        for _ in range(args.cycles):
            backend.clear_graph()
            H.sync()
            H.empty_cache()
            cyc["reserved_mib_after_clear"].append(round(H.reserved() / H.MiB, 1))
            cyc["allocated_mib_after_clear"].append(round(H.allocated() / H.MiB, 1))
            cyc["live_graphs_after_clear"].append(H.live_graphs())
            cyc["capture_s"].append(round(capture_all(), 3))
            cyc["reserved_mib_after_capture"].append(round(H.reserved() / H.MiB, 1))
            cyc["allocated_mib_after_capture"].append(round(H.allocated() / H.MiB, 1))
            r = check([n for n in (1, 3, 17, 100, 255, MAXB - 1) if n <= MAXB])
            cyc["max_abs_diff_vs_eager_padded"] = max(
                cyc["max_abs_diff_vs_eager_padded"], r["max_abs_diff_vs_eager_padded"]
            )
    except Exception as error:
        out["errors"].append(f"cycle {len(cyc['capture_s'])}: " + H.fmt_exc(error))
    after = cyc["reserved_mib_after_clear"]
    cyc["reserved_after_clear_flat"] = bool(after) and max(after) - min(after) == 0
    cyc["capture_s_median"] = None if not cyc["capture_s"] else round(H.med(cyc["capture_s"]), 3)
    out["cycles"] = cyc
    out["reserved_mib_before_first_capture"] = round(r0 / H.MiB, 1)
    out["allocated_mib_before_first_capture"] = round(a0 / H.MiB, 1)
    out["reserved_mib_after_first_capture"] = round(r1 / H.MiB, 1)
    out["allocated_mib_after_first_capture"] = round(a1 / H.MiB, 1)
    if args.backend == "plugin":
        out["stats_after_cycles"] = plugin_figures(report_detail=False).get("plugin_stats")

if args.latency:

    def latency():
        lat = {}
        for n in [n for n in (1, 8, 64, 256) if n <= MAXB]:
            kw = inp.kw(n)
            e = H.step_time_us(lambda kw=kw: model(**kw))
            g = H.step_time_us(lambda kw=kw: backend(**kw))
            lat[n] = {"eager_us": round(e, 1), "graph_us": round(g, 1), "speedup": round(e / g, 2)}
        return lat

    try:
        out["latency"] = latency()  # as the shim installs torch: default-device mode on
        # without the shim's default-device TorchFunctionMode (it taxes every eager torch call)
        torch.set_default_device(None)
        out["latency_default_device_mode_off"] = latency()
    except Exception as error:
        out["errors"].append("latency: " + H.fmt_exc(error))
finish()
