"""Graph memory inside FastDeploy's KV-cache budget, on the GPU: the worker's start as FastDeploy
runs it (memory profile, KV cache, capture_model()) at a given ``gpu_memory_utilization``.

usage: python bench_budget.py [--high 0.9997] [--low 0.9] [--layers 16 ...] [--tag NAME]
       python bench_budget.py --one --backend fd|plugin --util U [--reserve off|auto|SIZE]

The driver runs each start in its own process (a fresh device, as a restart is) and prints one
JSON line with every start's result:

* ``fd_high``: FastDeploy's backend at a high utilization: the KV cache leaves too little for
  the graphs, and the capture runs out of memory;
* ``plugin_off_high``: the plugin at the same utilization: a CaptureError whose advice names a
  lower utilization; ``plugin_advice`` starts at that advice and must capture every graph;
* ``plugin_auto_1`` / ``plugin_auto_2``: FD_CUDAGRAPH_KV_RESERVE=auto at the high utilization,
  first start (no record: a probe capture) and second start (the record), both must fit;
* ``plugin_off_low`` at ``--low`` says "gpu_memory_utilization up to U would fit";
  ``plugin_fit`` starts at U and the free memory after capture is compared with the margin.

The stand-in worker does the arithmetic of FastDeploy's ``GpuWorker.determine_available_memory()``
(2.4 through develop, gpu_worker.py) on torch's counters: ``total * utilization - used after the
profile run and empty_cache - max_allocated increase over the profile run + the profile's KV
blocks``; ``used`` and ``total`` are NVML's, as FastDeploy reads them (pynvml).
The KV cache is then one tensor of whole blocks, as FastDeploy allocates its cache before
``capture_model()``. Nothing here is FastDeploy's code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ap = argparse.ArgumentParser()
ap.add_argument("--one", action="store_true", help="one start (the driver runs these)")
ap.add_argument("--backend", choices=["fd", "plugin"], default="plugin")
ap.add_argument("--util", type=float, default=0.9)
ap.add_argument("--reserve", default="off", help="plugin: FD_CUDAGRAPH_KV_RESERVE")
ap.add_argument("--high", type=float, default=0.9997)
ap.add_argument("--low", type=float, default=0.9)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=8192)
ap.add_argument("--max-bs", type=int, default=512)
ap.add_argument("--block-mib", type=int, default=2, help="bytes of one KV block, in MiB")
ap.add_argument("--profile-blocks", type=int, default=64, help="the profile's total_block_num")
ap.add_argument("--tag", default="")
args = ap.parse_args()
MiB = 1 << 20
UTILIZATION = re.compile(r"gpu[-_]memory[-_]utilization (?:up to|to|below) ([0-9.]+)")


# ------------------------------------------------------------------ one start, in its own process


def one_start() -> dict:
    import harness as H

    out: dict = {"backend": args.backend, "util": args.util, "errors": []}
    if args.backend == "plugin":
        H.set_plugin_env()
        os.environ["FD_CUDAGRAPH_KV_RESERVE"] = args.reserve
        out["reserve_option"] = args.reserve
    elif H.FASTDEPLOY_CLASS is None:
        out["skipped"] = H.FASTDEPLOY_SKIPPED or H.FASTDEPLOY_ERROR
        return out
    import torch

    block = args.block_mib * MiB

    class GpuWorker:
        """``fastdeploy.worker.gpu_worker.GpuWorker``: its memory profile only."""

        def __init__(self, fd_config, model_runner):
            self.fd_config, self.cache_config = fd_config, fd_config.cache_config
            self.model_runner = model_runner

        def determine_available_memory(self) -> int:
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.max_memory_allocated()
            self.model_runner.profile_run()
            peak_increase = torch.cuda.max_memory_allocated() - allocated_before
            torch.cuda.empty_cache()
            used, total = driver_memory()
            available = total * self.cache_config.gpu_memory_utilization - used - peak_increase
            return int(available + block * self.cache_config.total_block_num)

    def driver_memory() -> tuple[int, int]:
        """(used, total) as FastDeploy reads them: NVML's, whose total is the whole device
        (614 MiB more than cudaMemGetInfo's on the H200); cudaMemGetInfo where NVML is missing."""
        try:
            import pynvml

            pynvml.nvmlInit()
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
            out["memory_source"] = "nvml"
            return int(info.used), int(info.total)
        except Exception:
            free, total = torch.cuda.mem_get_info()
            out["memory_source"] = "cudaMemGetInfo (no NVML)"
            return total - free, total

    module = types.ModuleType("fastdeploy.worker.gpu_worker")
    module.GpuWorker = GpuWorker
    sys.modules[module.__name__] = module  # before register(), which wraps what is loaded
    sys.modules["fastdeploy.worker"].gpu_worker = module

    try:
        cls = H.backend_class(args.backend)
    except Exception as error:
        out["errors"].append("backend class: " + H.fmt_exc(error))
        return out
    layers, hidden, inter = H.model_dims(args.layers, args.hidden, args.inter)
    sizes = H.default_sizes(args.max_bs)
    cfg = H.make_config(sizes, unique_pool=True)
    cfg.cache_config = types.SimpleNamespace(
        gpu_memory_utilization=args.util, total_block_num=args.profile_blocks, block_size=64
    )
    cfg.scheduler_config.max_num_batched_tokens = args.max_bs
    X = torch.zeros(args.max_bs + 8, hidden, dtype=torch.bfloat16)
    model = H.Toy(layers, hidden, inter, X, seed=0)
    inp = H.Inputs(args.max_bs + 8)
    backend = H.construct(cls, cfg, model)

    class Runner(H.GPUModelRunner):
        """The runner's profile run and dummy run around the stand-in's capture loop."""

        kv = None

        def initialize_kv_cache(self, profile=False):
            blocks = args.profile_blocks if profile else self.num_gpu_blocks
            self.kv = torch.empty(blocks * block, dtype=torch.uint8)

        def clear_cache(self, profile=False):
            self.kv = None

        def profile_run(self):
            self.initialize_kv_cache(profile=True)
            # GraphOptBackend runs the profile's dummy step eagerly (step_use_cudagraph False).
            model(**inp.kw(args.max_bs))
            torch.cuda.synchronize()
            self.clear_cache(profile=True)

        def _dummy_run(self, num_tokens, batch_size, in_capturing=False, **_):
            backend(**inp.kw(batch_size))

    runner = Runner(cfg, [], model=model)
    runner.steps = [lambda size: runner._dummy_run(args.max_bs, size, in_capturing=True)]
    gpu = module.GpuWorker(cfg, runner)
    out["total_mib"] = round(torch.cuda.mem_get_info()[1] / MiB, 1)
    try:
        available = gpu.determine_available_memory()
        runner.num_gpu_blocks = int(available // block)
        out["kv_blocks"] = runner.num_gpu_blocks
        out["kv_mib"] = runner.num_gpu_blocks * block // MiB
        runner.initialize_kv_cache()
    except Exception as error:
        out["errors"].append("profile / KV cache: " + H.fmt_exc(error, 1500))
        return out
    out["free_before_capture_mib"] = round(torch.cuda.mem_get_info()[0] / MiB, 1)
    started = time.perf_counter()
    try:
        if args.backend == "plugin":
            runner.capture_model()
        else:
            H.plain_capture_model(runner)
        torch.cuda.synchronize()
        out["captured"] = True
    except Exception as error:
        out["captured"] = False
        out["capture_error"] = f"{type(error).__name__}: {error}"[:1200]
    out["capture_s"] = round(time.perf_counter() - started, 2)
    try:
        torch.cuda.synchronize()
        out["free_after_capture_mib"] = round(torch.cuda.mem_get_info()[0] / MiB, 1)
        used, total = driver_memory()  # the free memory the plugin's advice aims at
        out["driver_free_after_capture_mib"] = round((total - used) / MiB, 1)
        out["cuda_usable_after"] = bool((torch.ones(4) * 2).sum().item() == 8)
    except Exception as error:
        out["cuda_usable_after"] = f"{type(error).__name__}: {str(error)[:200]}"
    if args.backend == "plugin":
        import plugin_surface

        nbytes, source = plugin_surface.kv_reserve(backend)
        if nbytes is not None:
            out["reserve_mib"] = round(nbytes / MiB, 1)
            out["reserve_source"] = source[:300]
        report = plugin_surface.report(backend)
        if report is not None and out["captured"]:
            out["graph_mib"] = round(report.graph_bytes / MiB, 1)
            out["graphs"] = report.graphs
            out["summary"] = report.summary()
        out["margin_mib"] = round(plugin_surface.margin(torch.cuda.mem_get_info()[1]) / MiB, 1)
    text = out.get("capture_error") or out.get("summary") or ""
    found = UTILIZATION.search(text)
    out["advised_util"] = float(found.group(1)) if found else None
    return out


# ------------------------------------------------------------------ the driver


def start(tag, backend, util, reserve="off", log_dir=None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--one", "--backend", backend]
    command += ["--util", str(util), "--reserve", reserve, "--max-bs", str(args.max_bs)]
    command += ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    command += ["--inter", str(args.inter), "--block-mib", str(args.block_mib)]
    env = dict(os.environ, FD_LOG_DIR=log_dir or tempfile.mkdtemp(prefix="fdcg_budget_"))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    sys.stderr.write(f"### {tag}\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"errors": [f"no result; rc={done.returncode}"]}
    result["rc"] = done.returncode
    print(f"{tag}: {json.dumps(result, default=str)[:300]}", file=sys.stderr, flush=True)
    return result


def drive() -> dict:
    import harness as H

    out = {"tag": args.tag, "high": args.high, "low": args.low, "fastdeploy": H.fastdeploy_status()}
    starts = out["starts"] = {}
    starts["fd_high"] = start("fd_high", "fd", args.high)
    starts["plugin_off_high"] = start("plugin_off_high", "plugin", args.high)
    advice = starts["plugin_off_high"].get("advised_util")
    if advice:
        starts["plugin_advice"] = start("plugin_advice", "plugin", advice)
    record = tempfile.mkdtemp(prefix="fdcg_budget_record_")
    starts["plugin_auto_1"] = start("plugin_auto_1", "plugin", args.high, "auto", record)
    starts["plugin_auto_2"] = start("plugin_auto_2", "plugin", args.high, "auto", record)
    starts["plugin_off_low"] = start("plugin_off_low", "plugin", args.low)
    fit = starts["plugin_off_low"].get("advised_util")
    if fit:
        starts["plugin_fit"] = start("plugin_fit", "plugin", fit)
    errors = out["errors"] = []
    for tag, result in starts.items():
        errors += [f"{tag}: {e}" for e in result.get("errors", [])]
    expect_captured = {"plugin_advice", "plugin_auto_1", "plugin_auto_2", "plugin_fit"}
    for tag in expect_captured & set(starts):
        if not starts[tag].get("captured"):
            errors.append(f"{tag}: did not capture every graph")
    if not advice:
        errors.append("plugin_off_high: no advice to apply")
    if not fit:
        errors.append("plugin_off_low: no 'up to U would fit'")
    fit_run = starts.get("plugin_fit", {})
    if fit_run.get("captured"):
        out["fit_free_minus_margin_mib"] = round(
            fit_run["driver_free_after_capture_mib"] - fit_run["margin_mib"], 1
        )
    a1, a2 = starts["plugin_auto_1"], starts["plugin_auto_2"]
    if a1.get("captured") and a2.get("captured"):
        out["auto_probe_estimate_mib"] = a1.get("reserve_mib")
        out["auto_record_mib"] = a2.get("reserve_mib")
        out["auto_graph_mib"] = a2.get("graph_mib")
    return out


if __name__ == "__main__":
    if args.one:
        result = one_start()
        print(json.dumps(result, default=str), flush=True)
        sys.exit(1 if result.get("errors") else 0)
    result = drive()
    import harness as H

    H.emit(result)
    sys.exit(1 if result["errors"] else 0)
