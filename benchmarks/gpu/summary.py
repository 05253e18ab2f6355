"""Key figures of a results.jsonl, one line per run (run.sh prints this into summary.txt).

usage: python summary.py results.jsonl

The JSON lines hold everything; this is the first look. README.md, "Reading the results", says
what each figure should be.
"""

from __future__ import annotations

import json
import sys


def g(d, *path):
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def short(s, n=70):
    s = str(s).replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def _memory_run(j, bits):  # bench_main.py / bench_pair.py
    bits.append(f"capture {j['capture_s']} s")
    bits.append(f"pool {j.get('pool_mib')} MiB")
    if g(j, "plugin_stats", "graph_mib_total") is not None:
        bits.append(f"plugin counts {g(j, 'plugin_stats', 'graph_mib_total')} MiB")
    if "plugin_graph_mib" in j:
        bits.append(f"plugin counts {j['plugin_graph_mib']} roles {j.get('roles')}")
    if "correct" in j:
        c = j["correct"]
        bits.append(
            f"diff vs eager {c.get('max_abs_diff_vs_eager_padded')} "
            f"({c.get('nonexact_vs_padded')} inexact of {c.get('counts')})"
        )
    if "max_abs_diff_vs_eager_padded" in j:
        bits.append(f"diff vs eager {j['max_abs_diff_vs_eager_padded']}")
    cyc = j.get("cycles")
    if cyc:
        after = cyc.get("reserved_mib_after_clear") or [None]
        live = max(cyc.get("live_graphs_after_clear") or [], default=None)
        bits.append(
            f"{len(cyc.get('capture_s') or [])} cycles: reserved after clear "
            f"{after[0]}..{after[-1]} MiB (flat {cyc.get('reserved_after_clear_flat')}), "
            f"live graphs after clear max {live}, "
            f"capture median {cyc.get('capture_s_median')} s"
        )
    lat = j.get("latency_default_device_mode_off")
    if lat:
        bits.append("graph us " + ", ".join(f"bs{k}={v.get('graph_us')}" for k, v in lat.items()))
    if "output_survival_target_then_draft" in j:
        s = j["output_survival_target_then_draft"]
        bits.append(f"target outputs clobbered by draft {s.get('clobbered')}/{s.get('pairs')}")
    if "reserved_freed_mib_by_draft_clear" in j:
        bits.append(
            f"draft clear frees {j.get('reserved_freed_mib_by_draft_clear')} MiB, leaves "
            f"{j.get('live_graphs_after_draft_clear')} graphs; both "
            f"{j.get('reserved_freed_mib_by_both_clear')} MiB"
        )
    if "recapture" in j:
        r = j["recapture"]
        bits.append(
            f"recapture {r.get('pool_mib')} MiB, diff {r.get('max_abs_diff_vs_eager_padded')}"
        )
    if j.get("check_capture_successful") not in (None, "ok"):
        bits.append("check_capture_successful: " + short(j["check_capture_successful"], 60))


def _ctime_run(j, bits):  # bench_ctime.py
    bits.append(
        "capture median s: "
        + ", ".join(f"{k}={v.get('median_later')}" for k, v in j["capture_s"].items())
    )
    ratio = j.get("ratio_plugin_over_fd_unique")
    if isinstance(ratio, dict):
        bits.append(
            f"plugin/fd_unique {ratio.get('capture_model')} (per size median "
            f"{ratio.get('per_size_median')}, max {ratio.get('per_size_max')}, "
            f"{ratio.get('sizes_above_1')} sizes > 1; goal {ratio.get('goal')}: "
            f"{'met' if ratio.get('meets_goal') else 'NOT met'})"
        )
    else:
        bits.append(f"plugin/fd_unique: {short(ratio, 80)}")
    extra = j.get("breakdown_plugin_minus_fd_unique_ms")
    if extra:
        top = sorted(((v, k) for k, v in extra.items() if k != "total"), reverse=True)[:4]
        bits.append(
            f"plugin extra ms: total {extra.get('total')}; "
            + ", ".join(f"{k} {v:+}" for v, k in top)
        )


def _fit(f):
    """A fit arm's recapture: its sizes and padded tokens against FastDeploy's list."""
    if not f or "padded_tokens_served" not in f:
        return ""
    return (
        f" {len(f['sizes'])} sizes, padded x{g(f, 'padded_tokens_served', 'ratio')} (held-out "
        f"x{g(f, 'padded_tokens_held_out', 'ratio')}, in budget {f.get('within_budget')})"
    )


def _recapture_run(j, bits):  # bench_recapture.py
    per = j.get("ms_per_graph") or {}
    events = j.get("events") or ("first", "weight_update", "wake_up")
    bits.append(
        "ms/graph "
        + "; ".join(
            f"{e} " + " ".join(f"{k}={per[k].get(e)}" for k in per if per[k].get(e) is not None)
            for e in events
        )
    )
    ratio = j.get("ratio_plugin_over_fd")
    if isinstance(ratio, dict):
        bits.append(
            "plugin/fd "
            + ", ".join(f"{e} {ratio.get(e)} ({g})" for e, g in (ratio.get("goal") or {}).items())
            + f": goal {'met' if ratio.get('meets_goal') else 'NOT met'}"
        )
    else:
        bits.append(f"plugin/fd: {short(ratio, 80)}")
    arms = j.get("ratio_over_fd")
    for arm, r in (arms if isinstance(arms, dict) else {}).items():
        if arm == "plugin":
            continue  # above
        fitted = g(j, "fitted", arm) or {}
        bits.append(
            f"{arm}/fd "
            + ", ".join(
                f"{e} {g(r, e, 'median')} ({g(r, e, 'min')}..{g(r, e, 'max')})"
                + _fit(fitted.get(e))
                for e in events[1:]
            )
            + f": goal {'met' if r.get('meets_goal') else 'NOT met'}"
        )
    fwd = j.get("forwards_per_graph") or {}
    bits.append(
        "warm-ups/graph (target) "
        + ", ".join(
            f"{k} " + "/".join(str(g(fwd, k, e, "target", "eager")) for e in events) for k in fwd
        )
        + f"; plugin's report {g(j, 'plugin_report_warmups', events[1])}"
    )
    stale = j.get("stale_graphs_after_clear") or {}
    bits.append(
        "stale after clear "
        + ", ".join(f"{k} {max(v.values(), default=None)}" for k, v in stale.items())
    )
    bits.append(f"diff vs eager {j.get('max_abs_diff_vs_eager_padded')}")


def _wakeup_run(j, bits):  # bench_wakeup.py
    bits.append(
        f"{j.get('backend')}, {j.get('event')}, freed memory filled with {j.get('freed_fill')}"
    )
    captured = j.get("graphs_captured") or {}
    bits.append(f"graphs first {captured.get('first')}, in wakeup {captured.get('during_wakeup')}")
    verdict = g(j, "verdict", "after")
    if isinstance(verdict, dict):
        bits.append(
            "after wake-up: " + "; ".join(f"{m} {short(v, 60)}" for m, v in verdict.items())
        )
    elif verdict is not None:
        bits.append("after wake-up: " + short(verdict, 100) + f" ({j.get('fault_at')})")
    for model in ("target", "draft"):
        diff = g(j, "after", model, "max_abs_diff_where_finite")
        if diff is not None:
            bits.append(f"{model} max finite diff {diff}")
    bits.append(f"wakeup {j.get('wakeup_s')} s")
    if g(j, "plugin_recapture", "seconds") is not None:
        bits.append(f"plugin recapture {round(g(j, 'plugin_recapture', 'seconds'), 3)} s")
    moved = j.get("moved") or {}
    bits.append("moved " + ", ".join(f"{k} {v}" for k, v in moved.items()))


def line(j):
    tag = j.get("tag") or "?"
    errs = len(j.get("errors") or [])
    bits = []
    if j.get("skipped"):
        bits.append("SKIPPED: " + short(j["skipped"], 90))
    elif "freed_fill" in j:
        _wakeup_run(j, bits)
    elif "stale_graphs_after_clear" in j:
        _recapture_run(j, bits)
    elif isinstance(j.get("capture_s"), (int, float)):
        _memory_run(j, bits)
    elif isinstance(j.get("capture_s"), dict):
        _ctime_run(j, bits)
    elif "per_step_default_device_mode_off" in j:  # bench_dispatch.py
        r = j["per_step_default_device_mode_off"]
        bits.append(
            "host overhead us (mode off): "
            + ", ".join(
                f"{k}={v.get('host_overhead_us_best')}"
                for k, v in r.items()
                if isinstance(v, dict) and "host_overhead_us_best" in v
            )
        )
        bits.append(f"plugin/fd {short(r.get('overhead_ratio_plugin_over_fd_best'), 40)}")
    elif "first_capture_model" in j:  # bench_fail.py
        bits.append("1st: " + short(j["first_capture_model"], 60))
        bits.append(f"cuda ok after: {short(j.get('cuda_ok_after_failure'), 40)}")
        bits.append("2nd: " + short(j.get("second_capture_model"), 50))
        bits.append("then serves: " + short(j.get("serve_after_failure"), 50))
        bits.append(f"diff vs eager {j.get('max_abs_diff_vs_eager_padded')}")
    elif "starts" in j:  # bench_budget.py
        for name, r in j["starts"].items():
            state = "captured" if r.get("captured") else short(r.get("capture_error"), 50)
            bits.append(
                f"{name} util {r.get('util')}: {state}, free after "
                f"{r.get('free_after_capture_mib')} MiB, advice {r.get('advised_util')}"
            )
        bits.append(f"fit: free - margin {j.get('fit_free_minus_margin_mib')} MiB")
        bits.append(
            f"auto: probe {j.get('auto_probe_estimate_mib')} MiB, record "
            f"{j.get('auto_record_mib')} MiB, graphs {j.get('auto_graph_mib')} MiB"
        )
    elif tag == "setup_check":
        bits.append(f"device {j.get('device')}, torch {j.get('torch')}, tqdm {j.get('tqdm')}")
        bits.append(
            f"plugin {j.get('plugin_class')} from this checkout: {j.get('plugin_is_this_checkout')}"
        )
    if not j.get("skipped") and not str(j.get("fastdeploy", "loaded")).startswith("loaded"):
        bits.append("FastDeploy " + short(j["fastdeploy"], 60))
    if j.get("surface_missing"):
        bits.append(f"surface missing: {', '.join(j['surface_missing'])}")
    if j.get("dry_run"):
        bits.append("DRY RUN")
    for error in (j.get("errors") or [])[:2]:
        bits.append(
            "error: " + short(error.strip().splitlines()[-1] if error.strip() else error, 100)
        )
    return f"{tag:28s} errors={errs} | " + " | ".join(str(b) for b in bits)


def main(path):
    with open(path) as f:
        for raw in f:
            raw = raw.strip()
            if not raw.startswith("{"):
                continue
            try:
                print(line(json.loads(raw)))
            except Exception as e:
                print(f"(unreadable line: {type(e).__name__}: {e})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results.jsonl")
