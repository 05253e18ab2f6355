"""Recapture after an RL weight update and after sleep + wake-up: FastDeploy's backend (unique
pool) against the plugin, a target (16 layers) and an MTP-style draft (2 layers), in ONE process.

usage: python bench_recapture.py [--rounds 5] [--full-check-rounds 1] [--warmups 2]
           [--fastdeploy-warmups 1] [--fit graphs:8,padding:10] [--traffic skewed,rollout]
           [--steps 1024] [--seed 0] [--max-seconds 0]
           [--layers 16 --draft-layers 2 --hidden 2048 --inter 8192] [--tag NAME]

FastDeploy runs ``cudagraph_num_of_warmups`` (2) eager runs before every capture, recaptures
included; the plugin runs them for a size new to a backend and one (the eager run right before
the capture) for a size that backend captured before in this process (core/warmups.py).

The arms, each with its own models: ``fd`` (FastDeploy's defaults: ``--warmups``, unique pool),
``fd_warmupsN`` with ``--fastdeploy-warmups N`` (FastDeploy's own knob), ``plugin``, and one
``plugin_fit_<budget>`` per ``--fit`` budget: the plugin with ``FD_CUDAGRAPH_FIT=<budget>``, whose
recapture captures the subset of FastDeploy's sizes that pads the steps served since the last
capture least (core/fit.py), FastDeploy's largest always kept. The plugin's options are read
once per process and its capture session takes every live plugin backend of the process, so
each round runs one arm at a time, all its events, its backends cleared and dropped before the
next arm's are built (the order reversed on odd rounds).

``--traffic``: before each recapture, ``--steps`` decode steps served through the target's
backend of every arm (the same steps for all, every round): ``skewed`` is benchmarks/tune.py's
skewed trace (running requests log-normal around 40, sigma 0.45, capped at the largest size);
``rollout`` is RL rollouts: as many requests as the largest size start together and decode to
their lengths (log-normal around 128 tokens, sigma 0.5, at most 512), the batch draining from
full to empty, then the next rollout. Each trace gets a weight update and a wake-up of its own
(events ``weight_update/skewed``, ...). For a fit arm the padded tokens of FastDeploy's list and
of the list it fitted are given on the steps served and on a held-out draw of the same shape
(``--seed`` + 1: the traffic after the recapture). The replay check after a capture of a fit
arm serves steps too, which the next fit would count: an untimed clear_graph() +
capture_model() after the check starts the count afresh, so each fit sees the trace alone.

Each round builds fresh backends for every arm (a first capture again) and runs its events in
turn, each timed as capture_model() to a synchronize:

* ``first``: capture_model() after FastDeploy's profile run;
* ``weight_update``: clear_graph() on the target (the plugin's clear releases every backend of
  the process; FastDeploy's backend clears one, so the draft's is cleared too, as FastDeploy
  2.6/develop does when draft_model_use_cudagraph), every weight replaced by a new tensor at a
  new address with new values (copy plus a small perturbation), the persistent buffer the
  target reads (X, standing for the KV cache) and the draft's inputs (its X and ids)
  allocated anew, empty_cache(), capture_model();
* ``wake_up``: clear_graph() as above, weights to the host and every persistent input freed,
  empty_cache() (sleep), then all of it allocated again on the GPU (wake-up), capture_model().

Each arm has its own models and inputs, so one's events never move another's tensors.
Medians are over the rounds after the first (round 0 holds the process's first capture); a
ratio is the median of the per-round ratios arm / FastDeploy (``ratio_over_fd``, with the
rounds' least and most). Goal: recapture <= 0.4x, first capture <= 1.0x (``meets_goal``; for a
fit arm, its recaptures within its budget).

Also per backend and event: the forwards of each model per graph inside capture_model(),
eager (warm-ups) and captured, counted on the models; the plugin's own
``capture_report.records[].warmups``; host time in eager and captured forwards against the
rest (``breakdown_ms``: the forwards' GPU work is queued, so much of it waits in the next
synchronize, under ``rest``); the graphs captured before the clear that are still alive and not
reset after it (``stale_graphs_after_clear``, 0 expected); how many of the models' tensors the
event moved to a new address; replay against eager after each capture: bit-exact against an
eager run at the size the captured list pads to (a fit arm's: its fitted list), at every token
count 1..max for target and draft in the first ``--full-check-rounds`` rounds' recaptures, one
padded count per graph otherwise.

``--max-seconds``: a round that would end past it is not started (at least two run; ``rounds``
says how many did). Without FD_HARNESS_FASTDEPLOY_BACKEND only the plugin runs and the ratios say
"skipped".
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import re
import sys
import time
import weakref
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--full-check-rounds", type=int, default=1)
ap.add_argument("--warmups", type=int, default=2)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--draft-layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=8192)
ap.add_argument("--fastdeploy-warmups", type=int, default=None)
ap.add_argument("--fit", default="", help="FD_CUDAGRAPH_FIT budgets, a plugin arm each")
ap.add_argument("--traffic", default="none", help="none, or traces: skewed,rollout")
ap.add_argument("--steps", type=int, default=1024)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--max-seconds", type=float, default=0, help="start no round past it (0: off)")
ap.add_argument("--tag", default="")
args = ap.parse_args()
FITS = [b for b in args.fit.split(",") if b]
TRACES = [] if args.traffic == "none" else args.traffic.split(",")
for budget in FITS:
    if not re.fullmatch(r"graphs:\d+|padding:\d+(\.\d+)?", budget):
        ap.error(f"--fit {budget}: each budget is graphs:N or padding:P")
for trace in TRACES:
    if trace not in ("skewed", "rollout"):
        ap.error(f"--traffic {trace}: none, or skewed and/or rollout")
import harness as H  # noqa: E402

H.set_plugin_env()
import torch  # noqa: E402
from torch_paddle_shim import stream_capturing  # noqa: E402

RECAPTURES = ("weight_update", "wake_up")
EVENTS = ("first", *(e if t is None else f"{e}/{t}" for t in TRACES or [None] for e in RECAPTURES))
GOAL = {e: 1.0 if e == "first" else 0.4 for e in EVENTS}
layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
draft_layers = min(args.draft_layers, layers)
if H.DRY:
    args.rounds = min(args.rounds, 2)
if os.environ.get("FD_HARNESS_SIZES"):
    sizes = sorted({int(x) for x in os.environ["FD_HARNESS_SIZES"].split(",")})
else:
    sizes = H.default_sizes(512)
MAXB = max(sizes)
DT = torch.bfloat16
out = {
    "tag": args.tag,
    "graphs_per_model": len(sizes),
    "warmups": args.warmups,
    "layers": {"target": layers, "draft": draft_layers},
    "hidden": hidden,
    "rounds": args.rounds,
    "events": list(EVENTS),
    "fastdeploy": H.fastdeploy_status(),
    "errors": [],
}
missing: set[str] = set()
if H.FASTDEPLOY_ERROR:
    out["errors"].append("fastdeploy backend: " + H.FASTDEPLOY_ERROR)

# Which graphs a capture_model() made, and which of them a clear released: marks on the shim's
# graph class, which both backends build their graphs from (nothing read from either backend).
GRAPH = H.paddle.device.cuda.graphs.CUDAGraph
_capture_end, _reset = GRAPH.capture_end, GRAPH.reset
made = {"now": weakref.WeakSet()}


def _marked_capture_end(self):
    _capture_end(self)
    made["now"].add(self)


def _marked_reset(self):
    self.harness_released = True
    _reset(self)


GRAPH.capture_end, GRAPH.reset = _marked_capture_end, _marked_reset


class CountedToy(H.Toy):
    """The harness's toy, counting its forwards and their host time: eager (outside a capture:
    inside capture_model() these are the warm-ups) and captured."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def __call__(self, forward_meta=None, **kw):
        kind = "captured" if stream_capturing() else "eager"
        started = time.perf_counter()
        try:
            return super().__call__(forward_meta=forward_meta, **kw)
        finally:
            self.calls[kind] += 1
            self.seconds[kind] += time.perf_counter() - started


class World:
    """One backend's models and the persistent tensors they read: the target's X (the KV
    cache's stand-in) and ids, the draft's own X and ids (the MTP draft's inputs)."""

    def __init__(self):
        self.target = CountedToy(layers, hidden, inter, self._buffer(), seed=0, dtype=DT)
        self.draft = CountedToy(draft_layers, hidden, inter, self._buffer(), seed=1, dtype=DT)
        self.inp, self.draft_inp = H.Inputs(MAXB + 8), H.Inputs(MAXB + 8)
        self.device = self.target.X.device
        self.host = None

    @staticmethod
    def _buffer():
        return torch.zeros(MAXB + 8, hidden, dtype=DT)

    def models(self):
        return self.target, self.draft

    def addresses(self) -> list[int]:
        tensors = [m.X for m in self.models()] + [self.inp.ids, self.draft_inp.ids]
        tensors += [w for m in self.models() for layer in m.W for w in layer]
        return [t.data_ptr() for t in tensors]

    def update_weights(self, generator) -> None:
        """New weights at new addresses with new values; the KV stand-in and the draft's inputs
        allocated anew. Each new tensor is made while the old one lives: a new address."""
        for m in self.models():
            m.W = [
                tuple(
                    w + 1e-3 * torch.randn(w.shape, dtype=w.dtype, generator=generator)
                    for w in layer
                )
                for layer in m.W
            ]
            m.X = self._buffer()
        self.draft_inp = H.Inputs(MAXB + 8)

    def sleep(self) -> None:
        """Weights to the host; every persistent input freed."""
        self.host = [
            [tuple(w.to("cpu", copy=True) for w in layer) for layer in m.W] for m in self.models()
        ]
        for m in self.models():
            m.W, m.X = [], None
        self.inp = self.draft_inp = None

    def wake_up(self) -> None:
        for m, weights in zip(self.models(), self.host, strict=True):
            m.W = [tuple(w.to(self.device, copy=True) for w in layer) for layer in weights]
            m.X = self._buffer()
        self.inp, self.draft_inp = H.Inputs(MAXB + 8), H.Inputs(MAXB + 8)
        self.host = None


def skewed(rng: random.Random, steps: int, top: int) -> list[int]:
    """benchmarks/tune.py's skewed trace: a steady load, log-normal around 40, a long tail."""
    return [min(top, max(1, round(rng.lognormvariate(math.log(40), 0.45)))) for _ in range(steps)]


def rollout(rng: random.Random, steps: int, top: int) -> list[int]:
    """RL rollouts: ``top`` requests start together, each decodes to its length (log-normal
    around 128, at most 512 tokens), the batch drains to empty, and the next rollout starts."""
    trace: list[int] = []
    while len(trace) < steps:
        ends = [min(512, max(1, round(rng.lognormvariate(math.log(128), 0.5)))) for _ in range(top)]
        trace += [sum(end > t for end in ends) for t in range(max(ends))]
    return trace[:steps]


def make_trace(name: str, seed: int) -> list[int]:
    return {"skewed": skewed, "rollout": rollout}[name](random.Random(seed), args.steps, MAXB)


SERVED = {t: make_trace(t, args.seed) for t in TRACES}
HELD_OUT = {t: make_trace(t, args.seed + 1) for t in TRACES}


def padded(captured, steps) -> int:
    """Padded tokens of these steps where ``captured`` is the list of sizes (FastDeploy's table)."""
    pads = H.fd_stubs.padding_table(captured)
    return sum(pads[n] - n for n in steps)


out["traffic"] = {
    t: {
        "steps": len(steps),
        "seed": args.seed,
        "mean_tokens": round(sum(steps) / len(steps), 1),
        "distinct_tokens": len(set(steps)),
        "padded_tokens_fastdeploy": padded(sizes, steps),
    }
    for t, steps in SERVED.items()
}
FULL = sorted({*range(1, MAXB + 1, 37), MAXB}) if H.DRY else list(range(1, MAXB + 1))


def sparse(captured) -> list[int]:
    """One padded token count per graph: the smallest count that replays it."""
    ascending = sorted(captured)
    return [low + 1 for low in [0, *ascending[:-1]]]


def check(be, model, inp, counts, table) -> dict:
    """Replay against eager: graph rows [:n] against an eager run at the padded size."""
    worst, nonexact = 0.0, 0
    X = model.X
    for real in counts:
        X.zero_()
        X[:real] = torch.randn(real, hidden, dtype=DT)
        got = be(**inp.kw(real))[:real].float().clone()
        ref = model(**inp.kw(table[real]))[:real].float()
        d = (got - ref).abs().max().item()
        nonexact += d != 0.0
        worst = max(worst, d)
    return {"counts": len(counts), "max_abs_diff_vs_eager_padded": worst, "nonexact": nonexact}


#: name: (backend, cudagraph_num_of_warmups, FD_CUDAGRAPH_FIT)
ARMS = {"fd": ("fd", args.warmups, None)}
if args.fastdeploy_warmups is not None:
    ARMS[f"fd_warmups{args.fastdeploy_warmups}"] = ("fd", args.fastdeploy_warmups, None)
ARMS["plugin"] = ("plugin", args.warmups, None)
ARMS.update({"plugin_fit_" + b.replace(":", ""): ("plugin", args.warmups, b) for b in FITS})
out["arms"] = {k: {"backend": b, "warmups": w, "fit": f} for k, (b, w, f) in ARMS.items()}


class Arm:
    """One arm's target and draft backends over its world, rebuilt each round."""

    def __init__(self, kind: str, world: World):
        self.kind, self.world = kind, world
        self.backend, warmups, self.fit = ARMS[kind]
        self.graphs = weakref.WeakSet()
        if self.backend == "plugin":
            H.set_plugin_env(fit=self.fit)
            H.plugin_surface.forget_options()  # read at its next use: this arm's
        cls = H.backend_class(self.backend)
        cfg = H.make_config(sizes, warmups=warmups, unique_pool=True)
        self.bt = H.construct(cls, cfg, world.target)
        self.bd = H.construct(cls, cfg, world.draft)
        runner = H.GPUModelRunner(
            cfg,
            [lambda s: self.bt(**world.inp.kw(s)), lambda s: self.bd(**world.draft_inp.kw(s))],
            model=world.target,
            draft_model=world.draft,
        )
        # The plugin's register() wrapped the runner's capture_model() in its capture session;
        # FastDeploy's backend has no hook and runs the same loop unwrapped.
        self.capture_model = (
            runner.capture_model
            if self.backend == "plugin"
            else lambda: H.plain_capture_model(runner)
        )

    def clear(self) -> None:
        self.bt.clear_graph()  # the plugin's releases the draft's backend too
        if self.backend == "fd":
            self.bd.clear_graph()

    def captured(self) -> tuple[list[int], dict]:
        """The decode sizes the last capture_model() made (a fit's, else FastDeploy's list), and
        the plugin's report of it."""
        if self.backend != "plugin":
            return sizes, {}
        found, lacking = H.plugin_surface.report_fields(
            self.bt, ("graphs", "graph_bytes", "fit", "fit_sizes")
        )
        missing.update(lacking)
        return sorted(found.get("fit_sizes") or sizes), found


world = {}
kinds = [k for k, (b, *_) in ARMS.items() if b == "plugin" or H.FASTDEPLOY_CLASS is not None]
try:
    for kind in kinds:
        world[kind] = World()
        w = world[kind]
        w.target(**w.inp.kw(MAXB))  # FastDeploy's profile run
        w.draft(**w.draft_inp.kw(MAXB))
    H.sync()
except Exception as error:
    out["errors"].append("models: " + H.fmt_exc(error))
    H.finish(out, missing)
generator = torch.Generator(device=world["plugin"].device).manual_seed(1234)

# per kind, event: one dict per round
rows: dict[str, dict[str, list[dict]]] = {k: {e: [] for e in EVENTS} for k in kinds}


def plugin_warmups(arm: Arm) -> dict | None:
    """The plugin's own count: capture_report.records[].warmups by role."""
    try:
        return H.plugin_surface.warmups_by_role(arm.bt)
    except AttributeError:
        missing.add("capture_report.records[].role/warmups")
        return None


def run_event(arm: Arm, event: str, rnd: int) -> dict:
    w, row = arm.world, {}
    if event != "first":
        what, _, trace = event.partition("/")
        for n in SERVED.get(trace, ()):  # the traffic served before the recapture
            arm.bt(**w.inp.kw(n))
        H.sync()
        before = w.addresses()
        arm.clear()
        H.sync()
        gc.collect()
        row["stale_graphs_after_clear"] = sum(
            1 for g in arm.graphs if not getattr(g, "harness_released", False)
        )
        if what == "weight_update":
            w.update_weights(generator)
        else:
            w.sleep()
            H.sync()
            H.empty_cache()
            w.wake_up()
        after = w.addresses()
        row["moved"] = sum(a != b for a, b in zip(before, after, strict=True)) / len(before)
    H.sync()
    H.empty_cache()
    for m in w.models():
        m.calls.clear()
        m.seconds.clear()
    made["now"] = arm.graphs = weakref.WeakSet()
    r0 = H.reserved()
    started = time.perf_counter()
    arm.capture_model()
    H.sync()
    row["seconds"] = time.perf_counter() - started
    row["reserved_growth_mib"] = (H.reserved() - r0) / H.MiB
    row["graphs"] = len(arm.graphs)
    captured, report = arm.captured()
    row["sizes"] = captured
    if report:
        row["fit"] = report.get("fit")
        row["plugin_graph_mib"] = (report.get("graph_bytes") or 0) / H.MiB
    if row["graphs"] != 2 * len(captured):
        # Fewer graphs than sizes: the rest ran eagerly, and the time is not of captures.
        raise RuntimeError(f"captured {row['graphs']} graphs, not {2 * len(captured)}")
    row["forwards_per_graph"] = {
        name: {k: m.calls[k] / len(captured) for k in ("eager", "captured")}
        for name, m in (("target", w.target), ("draft", w.draft))
    }
    seconds = {k: sum(m.seconds[k] for m in w.models()) for k in ("eager", "captured")}
    row["breakdown"] = {
        "warmup_forward": seconds["eager"],
        "captured_forward": seconds["captured"],
        "rest": row["seconds"] - seconds["eager"] - seconds["captured"],
    }
    if arm.backend == "plugin":
        row["plugin_report_warmups"] = plugin_warmups(arm)
    full = event != "first" and rnd < args.full_check_rounds
    counts = FULL if full else sparse(captured)
    pads = H.fd_stubs.padding_table(captured)
    row["correct"] = {
        "target": check(arm.bt, w.target, w.inp, counts, pads),
        "draft": check(arm.bd, w.draft, w.draft_inp, counts, pads),
        "every_count": full,
    }
    if arm.fit and event != EVENTS[-1]:  # the check's steps would count in the next fit
        arm.clear()
        arm.capture_model()
        H.sync()
    return row


broken: set[str] = set()
began = time.perf_counter()
for rnd in range(args.rounds):
    spent = time.perf_counter() - began
    if rnd >= 2 and args.max_seconds and spent * (rnd + 1) / rnd > args.max_seconds:
        out["rounds"] = rnd  # the next round would end past --max-seconds
        break
    for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
        if kind in broken:
            continue
        try:
            arm = Arm(kind, world[kind])
        except Exception as error:
            broken.add(kind)
            out["errors"].append(f"{kind} round {rnd} construct: " + H.fmt_exc(error, 1500))
            continue
        for event in EVENTS:
            try:
                rows[kind][event].append(run_event(arm, event, rnd))
            except Exception as error:
                broken.add(kind)
                out["errors"].append(f"{kind} round {rnd} {event}: " + H.fmt_exc(error, 1500))
                break
        try:  # release this arm's backends before the next arm builds its own
            arm.clear()
        except Exception as error:
            out["errors"].append(f"{kind} round {rnd} clear: " + H.fmt_exc(error, 1500))
        del arm
        gc.collect()
        H.empty_cache()
if "plugin" in kinds:
    out.update(H.plugin_facts())  # the plugin is imported now (register())


def later(xs):
    """The rounds after the first (round 0 holds the process's first capture)."""
    return xs[1:] if len(xs) > 1 else xs


def ms(x):
    return None if x is None else round(x * 1e3, 2)


def median_of(kind, event, f):
    return H.med([f(r) for r in later(rows[kind][event])])


def spread(xs, digits):
    return {
        "median": round(H.med(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
    }


out["capture_s"] = {
    k: {
        e: {
            **spread([r["seconds"] for r in later(rows[k][e])], 4),
            "all": [round(r["seconds"], 4) for r in rows[k][e]],
        }
        for e in EVENTS
        if rows[k][e]
    }
    for k in kinds
}
out["ms_per_graph"] = {
    k: {e: ms(median_of(k, e, lambda r: r["seconds"] / r["graphs"])) for e in EVENTS if rows[k][e]}
    for k in kinds
}
out["graphs"] = {k: {e: rows[k][e][-1]["graphs"] for e in EVENTS if rows[k][e]} for k in kinds}
out["forwards_per_graph"] = {
    k: {e: rows[k][e][-1]["forwards_per_graph"] for e in EVENTS if rows[k][e]} for k in kinds
}
if "plugin" in kinds:
    out["plugin_report_warmups"] = {
        e: rows["plugin"][e][-1].get("plugin_report_warmups") for e in EVENTS if rows["plugin"][e]
    }
out["breakdown_ms"] = {
    k: {
        e: {
            part: ms(median_of(k, e, lambda r, part=part: r["breakdown"][part]))
            for part in ("warmup_forward", "captured_forward", "rest")
        }
        for e in EVENTS
        if rows[k][e]
    }
    for k in kinds
}
out["stale_graphs_after_clear"] = {
    k: {e: max(r["stale_graphs_after_clear"] for r in rows[k][e]) for e in EVENTS[1:] if rows[k][e]}
    for k in kinds
}
out["tensors_moved"] = {
    k: {e: round(min(r["moved"] for r in rows[k][e]), 3) for e in EVENTS[1:] if rows[k][e]}
    for k in kinds
}
out["reserved_growth_mib"] = {
    k: {
        e: round(median_of(k, e, lambda r: r["reserved_growth_mib"]), 1)
        for e in EVENTS
        if rows[k][e]
    }
    for k in kinds
}

out["plugin_graph_mib"] = {
    k: {e: round(median_of(k, e, lambda r: r["plugin_graph_mib"]), 1) for e in EVENTS if rows[k][e]}
    for k in kinds
    if ARMS[k][0] == "plugin"
}


def worst_correct(kind, event):
    rs = rows[kind][event]
    res = {}
    for model in ("target", "draft"):
        res[model] = {
            "max_abs_diff_vs_eager_padded": max(
                r["correct"][model]["max_abs_diff_vs_eager_padded"] for r in rs
            ),
            "nonexact": sum(r["correct"][model]["nonexact"] for r in rs),
            "counts": sum(r["correct"][model]["counts"] for r in rs),
        }
    res["every_count_rounds"] = sum(r["correct"]["every_count"] for r in rs)
    return res


out["correct"] = {k: {e: worst_correct(k, e) for e in EVENTS if rows[k][e]} for k in kinds}
out["max_abs_diff_vs_eager_padded"] = max(
    (
        c[model]["max_abs_diff_vs_eager_padded"]
        for per_event in out["correct"].values()
        for c in per_event.values()
        for model in ("target", "draft")
    ),
    default=None,
)


def fitted(kind, event) -> dict:
    """What a fit arm captured at this event: the list of its last round (and whether every
    round fitted the same), and the padded tokens of the served steps and of a held-out draw of
    the same trace, FastDeploy's whole list against the fitted one."""
    rs, budget = rows[kind][event], ARMS[kind][2]
    lists = {tuple(r["sizes"]) for r in rs}
    res = {
        "sizes": rs[-1]["sizes"],
        "same_every_round": len(lists) == 1,
        "fit": rs[-1].get("fit"),
    }
    trace = event.partition("/")[2]
    if trace:
        for name, steps in (("served", SERVED[trace]), ("held_out", HELD_OUT[trace])):
            theirs, ours = padded(sizes, steps), padded(rs[-1]["sizes"], steps)
            res[f"padded_tokens_{name}"] = {
                "fastdeploy": theirs,
                "fitted": ours,
                "ratio": round(ours / theirs, 3) if theirs else None,
            }
        what, _, amount = budget.partition(":")
        limit = len(sizes) if what == "padding" else int(amount)
        cap = 1 + float(amount) / 100 if what == "padding" else math.inf
        res["within_budget"] = all(
            len(r["sizes"]) <= limit
            and padded(r["sizes"], SERVED[trace]) <= cap * padded(sizes, SERVED[trace])
            for r in rs
        )
    return res


out["fitted"] = {
    k: {e: fitted(k, e) for e in EVENTS if rows[k][e]} for k in kinds if ARMS[k][2] is not None
}
paired = "fd" in kinds and all(len(rows[k][e]) == out["rounds"] for k in kinds for e in EVENTS)
if paired:
    out["ratio_over_fd"] = {
        k: {
            e: spread(
                [
                    a["seconds"] / f["seconds"]
                    for a, f in zip(later(rows[k][e]), later(rows["fd"][e]), strict=True)
                ],
                3,
            )
            for e in EVENTS
        }
        for k in kinds
        if k != "fd"
    }
    for k, per_event in out["ratio_over_fd"].items():
        per_event["meets_goal"] = all(per_event[e]["median"] <= GOAL[e] for e in EVENTS) and all(
            f.get("within_budget", True) for f in out["fitted"].get(k, {}).values()
        )
    ratios = {e: out["ratio_over_fd"]["plugin"][e]["median"] for e in EVENTS}
    out["ratio_plugin_over_fd"] = {
        **ratios,
        "goal": {e: f"<= {g}" for e, g in GOAL.items()},
        "meets_goal": all(ratios[e] <= GOAL[e] for e in EVENTS),
    }
    out["warmup_forwards_saved_per_graph"] = {
        e: {
            model: out["forwards_per_graph"]["fd"][e][model]["eager"]
            - out["forwards_per_graph"]["plugin"][e][model]["eager"]
            for model in ("target", "draft")
        }
        for e in EVENTS
    }
else:
    out["ratio_plugin_over_fd"] = out["ratio_over_fd"] = (
        "skipped: " + (H.FASTDEPLOY_SKIPPED or "FastDeploy's backend did not load")
        if H.FASTDEPLOY_CLASS is None
        else "n/a: a backend broke (errors)"
    )
H.finish(out, missing)
