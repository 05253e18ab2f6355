"""A wake-up that makes the KV cache anew without a capture (issue 30): FastDeploy's backend or
the plugin, a target (16 layers) and an MTP-style draft (2 layers), each reading its KV stand-in
and ``rope_emb`` through ``forward_meta``, one backend per process.

usage: python bench_wakeup.py --backend fd|plugin [--fill nan|none] [--no-sleep]
           [--draft-layers 2] [--layers 16 --hidden 2048 --inter 8192] [--tag NAME]

The runner is fd_stubs.GPUModelRunner with ``share_inputs`` (and the draft's ``model_inputs``):
KV caches (one tensor per layer for keys, one for values), ``rope_emb`` and the ids, read by
the toy through ``forward_meta.caches`` and ``forward_meta.rotary_embs`` as FastDeploy's
attention reads them (a new ``forward_meta`` each step, pointing at the runner's buffers).
``sleep("kv_cache")`` and ``wakeup("kv_cache")`` follow FastDeploy 2.6 / develop
(fd_stubs.py says in which order): the caches are freed and made anew, ``rope_emb`` and the
draft's ids are made anew, and nothing is captured.

Steps:

1. the KV history of the requests before the sleep written into the caches (values A);
   FastDeploy's profile run; ``capture_model()`` (the plugin's wrapped in its capture session;
   FastDeploy's backend runs the same loop unwrapped);
2. decode steps at ``COUNTS`` token counts for target and draft: the backend's output rows
   against an eager run of the model at the padded size on the same inputs (bit-exact
   expected);
3. ``sleep("kv_cache")``, then ``wakeup("kv_cache")`` (timed; with the plugin it includes the
   recapture it runs itself when what a graph reads has moved), then the KV history of the
   requests after the wake-up written into the new caches (values B);
4. the same decode steps again, with the eager run on the tensors as they are now.

``--fill nan`` (the default) writes NaN into each tensor the stand-in frees before it drops
it (``fd_stubs.FREED_FILL``). torch's caching allocator keeps a freed block's contents until it
hands the block out again, so a graph reading freed memory may see the old values and look
right; on a serving worker that memory goes to the trainer while asleep and to the new tensors
after. With the fill, any read of freed memory that no new tensor has taken over shows as NaN.
``--fill none`` shows what the stale graphs give without it. A read of memory the allocator
returned to the driver (``empty_cache()`` in sleep) can fault instead: that is recorded
(``after.fault``, ``fault_at``), not an error, and ends the run's checks (the CUDA context is
lost).

``--no-sleep``: ``wakeup("kv_cache")`` with nothing asleep, which FastDeploy also serves: it
resets the inputs (a new ``rope_emb``, new draft ids) before it finds the KV cache awake and
returns. The caches stay; the old ``rope_emb`` goes back to torch's cache, still mapped, so a
stale graph reads it (NaN with the fill) or whatever took its block, instead of faulting.

Recorded: ``before``/``after`` per model (``max_abs_diff_vs_eager_padded``, None when an output
has NaN; ``nan_counts``; ``nonexact``; the first counts' diffs), ``verdict``; ``moved``: which
of the tensors a graph reads the sleep and wake-up put at a new address, and
``new_at_old_address``: which new tensors the allocator put where a freed one was; graph captures
before and after (counted on the shim's graphs; with the plugin also its backends'
``captures``); ``wakeup_s`` and the plugin's recapture (its ``capture_report``); the plugin's
log lines (logger ``fd_cudagraph_plugin``) from the sleep on; whether the plugin wraps the
runner's ``sleep``/``wakeup`` (``plugin_wraps_lifecycle``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import weakref
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--backend", choices=("fd", "plugin"), required=True)
ap.add_argument("--fill", choices=("nan", "none"), default="nan")
ap.add_argument("--no-sleep", action="store_true", help="wakeup('kv_cache') with nothing asleep")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--draft-layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=8192)
ap.add_argument("--tag", default="")
args = ap.parse_args()
import harness as H  # noqa: E402

H.set_plugin_env()
import torch  # noqa: E402

fd_stubs = H.fd_stubs
layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
draft_layers = min(args.draft_layers, layers)
if os.environ.get("FD_HARNESS_SIZES"):
    sizes = sorted({int(x) for x in os.environ["FD_HARNESS_SIZES"].split(",")})
else:
    sizes = H.default_sizes(512)
MAXB = max(sizes)
ROWS = MAXB + 8
DT = torch.bfloat16
table = fd_stubs.padding_table(sizes)
COUNTS = sorted(
    {n for n in (1, 2, 3, 5, 8, 9, 16, 17, 31, 64, 100, 128, 200, 256, 257, 384, 500, 512)}
    & set(range(1, MAXB + 1))
    | {MAXB}
)
fd_stubs.FREED_FILL = float("nan") if args.fill == "nan" else None
out = {
    "tag": args.tag,
    "backend": args.backend,
    "freed_fill": args.fill,
    "event": "wakeup('kv_cache'), nothing asleep"
    if args.no_sleep
    else "sleep('kv_cache') then wakeup('kv_cache')",
    "graphs_per_model": len(sizes),
    "layers": {"target": layers, "draft": draft_layers},
    "hidden": hidden,
    "counts": COUNTS,
    "fastdeploy": H.fastdeploy_status(),
    "errors": [],
}
missing: set[str] = set()
if args.backend == "fd":
    H.skip_without_fastdeploy(out, lambda: H.finish(out, missing))

# The plugin's log lines, from the sleep on (its logger: fd_cudagraph_plugin).
records: list[str] = []
phase = {"now": "start"}


class Collect(logging.Handler):
    def emit(self, record):
        if phase["now"] != "start":
            records.append(f"[{phase['now']}] {record.levelname}: {record.getMessage()}"[:600])


plugin_logger = logging.getLogger(H.plugin_surface.LOGGER)
plugin_logger.addHandler(Collect(logging.INFO))
if plugin_logger.level == logging.NOTSET:
    plugin_logger.setLevel(logging.INFO)

# Every graph captured, counted on the shim's graph class (both backends build theirs from it).
GRAPH = H.paddle.device.cuda.graphs.CUDAGraph
_capture_end, _reset = GRAPH.capture_end, GRAPH.reset
made = {"graphs": 0, "alive": weakref.WeakSet()}


def _counted_capture_end(self):
    _capture_end(self)
    made["graphs"] += 1
    made["alive"].add(self)


def _marked_reset(self):
    self.harness_released = True
    _reset(self)


GRAPH.capture_end, GRAPH.reset = _counted_capture_end, _marked_reset


def graphs_alive() -> int:
    """Graphs captured in this process, not freed and not reset: what could still replay."""
    return sum(1 for graph in made["alive"] if not getattr(graph, "harness_released", False))


class KVToy(H.Toy):
    """The harness's toy decoder, reading the runner's buffers through ``forward_meta`` as
    FastDeploy's attention does: layer i scales q and k by ``rotary_embs[:n]`` and adds
    ``caches[2i][:n]`` to its keys and ``caches[2i + 1][:n]`` to its values."""

    def __call__(self, forward_meta=None, **kw):
        meta = forward_meta
        n = meta.ids_remove_padding.shape[0]
        h = self.X[:n]
        rope = meta.rotary_embs[:n]
        for i, (wqkv, wo, w1, w2) in enumerate(self.W):
            r = h
            q, k, v = (self.rms(h) @ wqkv).chunk(3, -1)
            q = q * rope
            k = k * rope + meta.caches[2 * i][:n]
            v = v + meta.caches[2 * i + 1][:n]
            h = r + (torch.softmax(q * k, -1) * v) @ wo
            r = h
            h = r + torch.nn.functional.silu(self.rms(h) @ w1) @ w2
        return h


def make_rope():
    """A rotary table (cos of position x frequency): the same values each time it is made."""
    position = torch.arange(ROWS, dtype=torch.float32)[:, None]
    frequency = 1e-4 ** (torch.arange(hidden, dtype=torch.float32) / hidden)[None, :]
    return torch.cos(position * frequency).to(DT)


def inputs_for(n_layers: int) -> fd_stubs.ShareInputs:
    return fd_stubs.ShareInputs(
        make_caches=lambda: [torch.zeros(ROWS, hidden, dtype=DT) for _ in range(2 * n_layers)],
        make_rope=make_rope,
        make_ids=lambda: torch.zeros(ROWS, dtype=torch.int64),
    )


def kw(inputs: fd_stubs.ShareInputs, n: int) -> dict:
    """A decode step's arguments: a new forward_meta pointing at the buffers as they are now."""
    ids = inputs["ids_remove_padding"][:n]
    meta = SimpleNamespace(
        ids_remove_padding=ids,
        exist_prefill=False,
        seq_lens_this_time=None,
        real_bsz=0,
        step_use_cudagraph=True,
        caches=inputs["caches"],
        rotary_embs=inputs["rope_emb"],
    )
    return {"ids_remove_padding": ids, "forward_meta": meta}


def write_history(inputs: fd_stubs.ShareInputs, generator) -> None:
    """The KV that requests' prefills wrote: new values in the caches, in place."""
    for cache in inputs["caches"]:
        cache.copy_(0.5 * torch.randn(cache.shape, dtype=DT, generator=generator))


def addresses(runner) -> dict[str, list[int]]:
    found = {}
    for who, inputs in (("target", runner.share_inputs), ("draft", runner.proposer.model_inputs)):
        found[f"{who} caches"] = [t.data_ptr() for t in inputs["caches"]]
        found[f"{who} rope_emb"] = [inputs["rope_emb"].data_ptr()]
        found[f"{who} ids"] = [inputs["ids_remove_padding"].data_ptr()]
    return found


#: The step being checked: where a fault surfaced (CUDA reports it at the next synchronisation).
current = {"step": None}


def check(backend, model, inputs, who) -> dict:
    """Each count's output rows against an eager run at the padded size on the same inputs."""
    worst, nonexact, nans, first = 0.0, 0, 0, {}
    for real in COUNTS:
        current["step"] = f"{who} at {real} tokens"
        model.X.zero_()
        model.X[:real] = torch.randn(real, hidden, dtype=DT)
        got = backend(**kw(inputs, real))[:real].float().clone()
        ref = model(**kw(inputs, table[real]))[:real].float()
        nan = bool(torch.isnan(got).any().item())
        diff = None if nan else (got - ref).abs().max().item()
        nans += nan
        nonexact += nan or diff != 0.0
        if not nan:
            worst = max(worst, diff)
        if len(first) < 6:
            first[real] = "nan" if nan else diff
    return {
        "counts": len(COUNTS),
        "max_abs_diff_vs_eager_padded": None if nans else worst,
        "max_abs_diff_where_finite": worst,
        "nan_counts": nans,
        "nonexact": nonexact,
        "first_counts": first,
    }


def verdict(result: dict) -> str:
    if result["nan_counts"]:
        return f"NaN at {result['nan_counts']} of {result['counts']} counts (read freed memory)"
    if result["nonexact"]:
        return f"garbage: {result['nonexact']} of {result['counts']} counts differ from eager"
    return "equals eager (bit-exact at the padded size)"


def fault_line(trace: str) -> str:
    """The exception's own line of a traceback (CUDA appends advice after it)."""
    lines = [line for line in trace.splitlines() if line and not line.startswith(" ")]
    named = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b:", line)]
    return (named or lines or [""])[-1][:200]


def plugin_captures(bt, bd) -> dict | None:
    try:
        return {"target": H.plugin_surface.captures(bt), "draft": H.plugin_surface.captures(bd)}
    except AttributeError:
        missing.add("backend.captures")
        return None


def served(bt, bd) -> dict:
    """The plugin's count of the steps each backend served since construction: replays and
    eager steps (any reason)."""
    found = {}
    for name, backend in (("target", bt), ("draft", bd)):
        try:
            found[name] = H.plugin_surface.served(backend)
        except Exception as error:
            missing.add(f"stats(): {type(error).__name__}: {error}"[:200])
            found[name] = {"replays": 0, "eager": 0}
    return found


def plugin_report(backend) -> dict | None:
    if H.plugin_surface.report(backend) is None:
        return None
    found, lacking = H.plugin_surface.report_fields(backend)
    missing.update(lacking)
    return found


try:
    cls = H.backend_class(args.backend)
    if args.backend == "plugin":
        out.update(H.plugin_facts())
    cfg = H.make_config(sizes, warmups=2, unique_pool=True)
    g = torch.Generator(device="cpu" if H.DRY else "cuda").manual_seed(7)
    target = KVToy(layers, hidden, inter, torch.zeros(ROWS, hidden, dtype=DT), seed=0, dtype=DT)
    draft = KVToy(draft_layers, hidden, inter, torch.zeros(ROWS, hidden, dtype=DT), 1, DT)
    bt, bd = H.construct(cls, cfg, target), H.construct(cls, cfg, draft)
    holder = {}
    runner = H.GPUModelRunner(
        cfg,
        [
            lambda s: bt(**kw(holder["runner"].share_inputs, s)),
            lambda s: bd(**kw(holder["runner"].proposer.model_inputs, s)),
        ],
        model=target,
        draft_model=draft,
        share_inputs=inputs_for(layers),
        draft_inputs=inputs_for(draft_layers),
    )
    holder["runner"] = runner
    Runner = type(runner)
    out["plugin_wraps_lifecycle"] = {
        name: H.plugin_surface.is_wrapped(getattr(Runner, name))
        for name in ("capture_model", "sleep", "wakeup")
    }
    if args.backend == "fd":
        # FastDeploy's backend has no hooks: its runner's methods as written, whatever wrapped
        # them (the plugin is never registered in this process).
        def unwrapped(name):
            method = H.plugin_surface.unwrapped(getattr(Runner, name))
            return lambda *a: method(runner, *a)

        capture_model = lambda: H.plain_capture_model(runner)  # noqa: E731
        sleep, wakeup = unwrapped("sleep"), unwrapped("wakeup")
    else:
        capture_model, sleep, wakeup = runner.capture_model, runner.sleep, runner.wakeup

    # 1. the requests' KV, FastDeploy's profile run, capture_model()
    write_history(runner.share_inputs, g)
    write_history(runner.proposer.model_inputs, g)
    target(**kw(runner.share_inputs, MAXB))
    draft(**kw(runner.proposer.model_inputs, MAXB))
    H.sync()
    started = time.perf_counter()
    capture_model()
    H.sync()
    out["first_capture_s"] = round(time.perf_counter() - started, 4)
    out["graphs_captured"] = {"first": made["graphs"]}
    first_report = H.plugin_surface.report(bt)
    if args.backend == "plugin":
        out["plugin_captures"] = {"first": plugin_captures(bt, bd)}
        out["plugin_first_capture"] = plugin_report(bt)

    # 2. decode steps before the sleep
    out["before"] = {
        "target": check(bt, target, runner.share_inputs, "target"),
        "draft": check(bd, draft, runner.proposer.model_inputs, "draft"),
    }
    H.sync()
    before = addresses(runner)
    if args.backend == "plugin":
        steps_before = served(bt, bd)

    # 3. sleep("kv_cache"), wakeup("kv_cache"), the new requests' KV
    if not args.no_sleep:
        phase["now"] = "sleep"
        started = time.perf_counter()
        sleep("kv_cache")
        H.sync()
        out["sleep_s"] = round(time.perf_counter() - started, 4)
        out["graphs_alive_after_sleep"] = graphs_alive()
    phase["now"] = "wakeup"
    captured_before = made["graphs"]
    started = time.perf_counter()
    wakeup("kv_cache")
    H.sync()
    out["wakeup_s"] = round(time.perf_counter() - started, 4)
    phase["now"] = "steps after wakeup"
    out["graphs_captured"]["during_wakeup"] = made["graphs"] - captured_before
    out["graphs_alive_after_wakeup"] = graphs_alive()
    after = addresses(runner)
    out["moved"] = {
        name: f"{sum(a != b for a, b in zip(before[name], after[name], strict=True))} of "
        f"{len(before[name])}"
        for name in before
    }
    # A new tensor at the address of a freed one: a stale graph reads it and may look right.
    owner = {p: f"{n}[{i}]" for n, ps in before.items() for i, p in enumerate(ps)}
    reused = {
        f"{n}[{i}]": owner[p]
        for n, ps in after.items()
        for i, p in enumerate(ps)
        if p in owner and owner[p] != f"{n}[{i}]"
    }
    out["new_at_old_address"] = {"count": len(reused), "first": dict(list(reused.items())[:12])}
    if args.backend == "plugin":
        out["plugin_captures"]["after_wakeup"] = plugin_captures(bt, bd)
        out["plugin_recapture"] = (
            plugin_report(bt)
            if H.plugin_surface.report(bt) is not first_report
            else "none: no capture session ran during the wake-up"
        )
    write_history(runner.share_inputs, g)
    write_history(runner.proposer.model_inputs, g)
    H.sync()

    # 4. decode steps after the wake-up
    try:
        out["after"] = {
            "target": check(bt, target, runner.share_inputs, "target"),
            "draft": check(bd, draft, runner.proposer.model_inputs, "draft"),
        }
        H.sync()
    except Exception as error:  # a read of memory given back to the driver
        out["after"] = {"fault": H.fmt_exc(error, 1200)}
        out["fault_at"] = current["step"]
    out["verdict"] = {
        when: (
            {m: verdict(out[when][m]) for m in ("target", "draft")}
            if "fault" not in out[when]
            else "fault: " + fault_line(out[when]["fault"])
        )
        for when in ("before", "after")
    }
    out["graphs_captured"]["total"] = made["graphs"]
    # What must hold on the GPU (the dry run's replays are stale by design): every replay
    # before the sleep equals eager, and the plugin's after the wake-up too. FastDeploy's
    # after the wake-up is the finding, not an error.
    must = [("before", "target"), ("before", "draft")]
    if args.backend == "plugin":
        must += [("after", "target"), ("after", "draft")]
    for when, model in must if not H.DRY else []:
        result = out[when].get(model)
        if result is None or result["nonexact"]:
            out["errors"].append(
                f"{args.backend} {model} {when} the wake-up: "
                + (verdict(result) if result else out["verdict"][when])
            )
    if args.backend == "plugin":
        recaptured = out["graphs_captured"]["during_wakeup"]
        if recaptured != 2 * len(sizes):
            out["errors"].append(
                f"the plugin captured {recaptured} graphs during the wake-up, not {2 * len(sizes)}"
            )
        cause = out["plugin_recapture"]
        if not isinstance(cause, dict) or "wakeup" not in str(cause.get("cause")):
            out["errors"].append(f"the plugin's recapture does not name the wake-up: {cause}"[:300])
    if args.backend == "plugin":
        out["plugin_steps_after_wakeup"] = {
            name: {k: now[k] - steps_before[name][k] for k in now}
            for name, now in served(bt, bd).items()
        }
except Exception as error:
    out["errors"].append(H.fmt_exc(error))
out["plugin_log"] = records
if "fault" in out.get("after", {}):
    # The CUDA context is lost: the graphs' and tensors' destructors would fail at exit.
    out["surface_missing"] = sorted(missing)
    H.emit(out)
    os._exit(1 if out["errors"] else 0)
H.finish(out, missing)
