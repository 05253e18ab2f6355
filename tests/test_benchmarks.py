"""The CPU benchmarks time what they say they time."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Beside

REPO = Path(__file__).resolve().parent.parent


SEED_BACKEND = REPO.parent / "shared" / "seed" / "cudagraph_piecewise_backend.py.txt"
needs_seed = pytest.mark.skipif(
    not SEED_BACKEND.exists(), reason="needs ../shared/seed (FastDeploy's backend)"
)
#: benchmarks/capture.py, fast: 4 sizes, no eager cost.
CAPTURE = ("capture.py", "--rounds", "2", "--eager-ms", "0", "--max-num-seqs", "8")
DISPATCH = ("dispatch.py", "--number", "200", "--repeat", "2")
NOT_A_BACKEND = "NOT_A_BACKEND"  # replaced by a file that is not FastDeploy's backend


def _runs_wanted() -> dict[str, tuple[str, ...]]:
    """Every benchmark run of this file, by name, in the order its tests read them: a file under
    benchmarks/ and its arguments (those with FastDeploy's backend where ../shared/seed has it)."""
    seed = ("--fastdeploy-backend", str(SEED_BACKEND))
    runs = {
        "capture": CAPTURE,
        "capture --recapture": (*CAPTURE, "--recapture"),
        "dispatch": DISPATCH,
        "dispatch with fastdeploy": (*DISPATCH, *seed),
        "dispatch.py not a backend": ("dispatch.py", "--fastdeploy-backend", NOT_A_BACKEND),
        "capture.py not a backend": ("capture.py", "--fastdeploy-backend", NOT_A_BACKEND),
        "capture with fastdeploy": (*CAPTURE, *seed),
        "moved": ("moved.py", "--layers", "20", "--caches", "6"),
        "capture --fastdeploy-warmups alone": (*CAPTURE, "--fastdeploy-warmups", "1"),
        "capture with fastdeploy, 1 warm-up": (
            *CAPTURE,
            "--recapture",
            *seed,
            "--fastdeploy-warmups",
            "1",
        ),
    }
    if SEED_BACKEND.exists():
        return runs
    return {key: argv for key, argv in runs.items() if str(SEED_BACKEND) not in argv}


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=False,
    )


def start_early(tmp_path_factory) -> Beside:
    """Every benchmark run of this file, by name (conftest.py starts them once collection is done,
    and this module's tests go last); ``not_a_backend``: the file the "not a backend" runs are
    given."""
    not_a_backend = tmp_path_factory.mktemp("benchmarks") / "backend.py"
    not_a_backend.write_text("this is not python\n")
    calls = {
        key: functools.partial(
            _run, *(str(not_a_backend) if a == NOT_A_BACKEND else a for a in argv)
        )
        for key, argv in _runs_wanted().items()
    }
    runs = Beside(calls)
    runs.not_a_backend = not_a_backend
    return runs


@pytest.fixture(scope="module")
def runs(started) -> Beside:
    return started


def test_capture_benchmark_times_a_capture_of_every_size_by_the_plugin(runs):
    """Without --fastdeploy-backend the plugin arm alone runs; its backend must join the session
    capture_model() opens and capture every size, or the figure is of eager runs."""
    done = runs["capture"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("captured 4 graphs (sizes 1..8)") == 2, done.stderr[-3000:]
    assert "no graphs captured" not in done.stderr and "late_capture" not in done.stderr
    assert "every backend captured all 4 sizes in every round" in done.stdout
    assert "ms/size" in done.stdout


def test_capture_benchmark_recapture_warms_each_size_once_and_captures_every_size(runs):
    """--recapture: clear_graph() and capture_model() again in the same worker. The plugin
    captures every size again, in a capture session, with one warm-up per size (its report and
    the forwards counted through the backend agree); the first capture keeps FastDeploy's two."""
    done = runs["capture --recapture"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    sessions = [
        line for line in done.stderr.splitlines() if "captured 4 graphs (sizes 1..8)" in line
    ]
    assert len(sessions) == 4, done.stderr[-3000:]  # 2 rounds, a capture and a recapture each
    assert ["1 each for all 4 graphs" in line for line in sessions] == [False, True] * 2
    assert "late_capture" not in done.stderr
    assert "every backend captured all 4 sizes in every round" in done.stdout
    first, recapture = done.stdout.split("capture_model() again (recapture")
    plugin_row = "fd-cudagraph-plugin"
    assert "2 warm-ups/size (its report: 2)" in next(
        line for line in first.splitlines() if plugin_row in line
    )
    assert "1 warm-up/size (its report: 1)" in next(
        line for line in recapture.splitlines() if plugin_row in line
    )


def test_gpu_summary_reads_a_recapture_line_as_one():
    """bench_recapture.py's line has a capture_s dict, as bench_ctime.py's: the summary must
    read it as a recapture run."""
    spec = importlib.util.spec_from_file_location(
        "gpu_summary", REPO / "benchmarks" / "gpu" / "summary.py"
    )
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    per = {"first": 1.0, "weight_update": 0.6, "wake_up": 0.6}
    text = summary.line(
        {
            "tag": "recapture",
            "errors": [],
            "fastdeploy": "loaded x",
            "capture_s": {"fd": {}, "plugin": {}},
            "ms_per_graph": {"fd": per, "plugin": per},
            "ratio_plugin_over_fd": {
                **per,
                "goal": {"first": "<= 1.0", "weight_update": "<= 0.4", "wake_up": "<= 0.4"},
                "meets_goal": False,
            },
            "forwards_per_graph": {
                "plugin": {e: {"target": {"eager": 1.0}} for e in per},
            },
            "plugin_report_warmups": {"weight_update": {"target": [1], "draft": [1]}},
            "stale_graphs_after_clear": {"plugin": {"weight_update": 0, "wake_up": 0}},
            "max_abs_diff_vs_eager_padded": 0.0,
        }
    )
    assert "goal NOT met" in text and "weight_update 0.6 (<= 0.4)" in text
    assert "stale after clear plugin 0" in text and "diff vs eager 0.0" in text
    # With --traffic and --fit: each arm's ratio to FastDeploy's with its spread, a fit arm's
    # sizes and padded tokens against FastDeploy's list.
    events = ["first", "weight_update/skewed", "wake_up/skewed"]
    spread = {"median": 0.3, "min": 0.2, "max": 0.35}
    padded = {"padded_tokens_served": {"ratio": 1.06}, "padded_tokens_held_out": {"ratio": 1.2}}
    text = summary.line(
        {
            "tag": "recapture",
            "errors": [],
            "events": events,
            "stale_graphs_after_clear": {"plugin": {}},
            "ratio_plugin_over_fd": "skipped: no",
            "ratio_over_fd": {
                "plugin_fit_padding10": {**{e: spread for e in events}, "meets_goal": True}
            },
            "fitted": {
                "plugin_fit_padding10": {
                    e: {"sizes": [512, 64, 32], **padded, "within_budget": True} for e in events[1:]
                }
            },
        }
    )
    assert (
        "plugin_fit_padding10/fd weight_update/skewed 0.3 (0.2..0.35) 3 sizes, padded x1.06 "
        "(held-out x1.2, in budget True)" in text
    ) and "goal met" in text


@pytest.mark.parametrize("parts", [["bogus"], ["setup", "bogus"], ["main pair"]], ids=" ".join)
def test_gpu_run_sh_refuses_an_unknown_part_with_exit_2_before_running_any(parts, tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), *parts],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": "false"},
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    unknown = next(part for part in parts if part != "setup")
    assert done.stderr.splitlines() == [
        f"unknown part '{unknown}' "
        "(parts: setup main pair ctime dispatch fail budget recapture wakeup)"
    ]
    assert not (tmp_path / "out").exists()


def test_dispatch_benchmark_rows_run_with_the_address_check_they_name(runs):
    """Options are read once per process: the sampled:100 and always rows measured plain
    dispatch until each backend read them again. The benchmark now proves each row's guard."""
    done = runs["dispatch"].result()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    guard_lines = [line for line in done.stdout.splitlines() if line.startswith("address guard")]
    assert (
        guard_lines
        == [
            "address guard, 100 calls with the input moved: off refused 0, sampled:100 refused 1, "
            "always refused 100"
        ]
        * 2
    )
    assert "median (min..max over rounds)" in done.stdout
    # Without FastDeploy's backend, the plugin's own figures and no ratio.
    assert "ratio" not in done.stdout and "FastDeploy backend" not in done.stdout
    assert "No ccache found" not in done.stderr


@needs_seed
def test_dispatch_benchmark_with_fastdeploys_backend_prints_the_ratio_with_its_spread(runs):
    done = runs["dispatch with fastdeploy"].result()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    ratios = [line for line in done.stdout.splitlines() if line.startswith("overhead ratio")]
    assert len(ratios) == 2 and all("per round: " in line and ".." in line for line in ratios)


@pytest.mark.parametrize("name", ["dispatch.py", "capture.py"])
def test_a_file_that_is_no_fastdeploy_backend_is_one_line_naming_the_flag(name, runs):
    path, done = runs.not_a_backend, runs[f"{name} not a backend"].result()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith(name)]
    assert f"--fastdeploy-backend {path}: it does not load as FastDeploy's backend" in line


def test_capture_benchmark_without_fastdeploys_backend_prints_no_ratio_against_itself(runs):
    """It printed "1.00x fd-cudagraph-plugin's time" for the plugin against itself."""
    done = runs["capture"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x " not in done.stdout.replace("max ", "") and "1.00x" not in done.stdout
    assert "Without --fastdeploy-backend: the plugin alone." in done.stdout
    assert "ms/size" in done.stdout and "(" in done.stdout.split("ms/size")[0]


@needs_seed
def test_capture_benchmark_with_fastdeploys_backend_gives_the_per_round_ratio(runs):
    done = runs["capture with fastdeploy"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if "per round:" in x]
    assert line.strip().startswith("fd-cudagraph-plugin / FastDeploy backend's time per size")


def test_moved_memory_benchmark_times_the_checks_on_the_parameters_and_buffers_it_names(runs):
    done = runs["moved"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    # 20 Linear layers (40 parameters) and the model's own 3; the 6 caches among the buffers.
    found = re.search(r"(\d+) parameters, (\d+) runner buffers the graphs read", done.stdout)
    assert found is not None, done.stdout
    assert int(found[1]) == 43 and int(found[2]) >= 6, done.stdout
    for row in ("take", "compare", "after rsync update"):
        assert f"  {row} " in done.stdout


# ------------------------------------------------------------------ the GPU parts, on the CPU

GPU = REPO / "benchmarks" / "gpu"
#: What a bench may not touch of the plugin but through plugin_surface.py: the package, the
#: backend's public fields, and the mark register() leaves on the runner's methods.
PLUGIN_ATTRIBUTES = {"capture_report", "stats", "captures", "role", "_fd_cudagraph_original"}
PLUGIN_NAMES = {"fd_cudagraph_plugin", "capture_report", "_fd_cudagraph_original"}


def _plugin_surface():
    spec = importlib.util.spec_from_file_location("plugin_surface", GPU / "plugin_surface.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reaches_around(path: Path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Attribute) and node.attr in PLUGIN_ATTRIBUTES:
            if ast.unparse(node.value).endswith("plugin_surface"):
                continue  # plugin_surface.role(...): the way in
            names = [f".{node.attr}"]
        elif isinstance(node, ast.Constant) and node.value in PLUGIN_NAMES:
            names = [repr(node.value)]
        else:
            continue
        found += [
            f"{path.name}:{node.lineno} {name}"
            for name in names
            if name.startswith(("fd_cudagraph_plugin", ".", "'"))
        ]
    return found


def test_every_gpu_part_reaches_the_plugin_only_through_plugin_surface():
    """run.sh's parts need a GPU and torch, which CI has not; what they read of the plugin is
    in plugin_surface.py, which the next test runs on the CPU. bench_budget.py read
    process.current().reserve.applied, which a refactor removed, and crashed on an H200."""
    parts = sorted(GPU.glob("*.py"))
    assert {p.name for p in parts} >= {"harness.py", "bench_budget.py", "bench_wakeup.py"}
    around = [hit for path in parts if path.name != "plugin_surface.py" for hit in
              _reaches_around(path)]  # fmt: skip
    assert not around, around
    # Every part run.sh runs is a file here.
    run_sh = (GPU / "run.sh").read_text(encoding="utf-8")
    assert {p.name for p in parts} >= set(re.findall(r"run (\w+\.py) ", run_sh))


def test_plugin_surface_needs_no_torch_and_every_call_works_on_the_plugin(
    plugin_registered, monkeypatch, tmp_path
):
    """Each function a GPU part calls, against the plugin on the simulated runtime with the
    FastDeploy stand-in; a function added to plugin_surface.py must be called here too."""
    import inspect

    from conftest import DecoratedMixing, make_config
    from fastdeploy.model_executor.graph_optimization import graph_optimization_backend
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner
    from fastdeploy.worker.gpu_worker import GpuWorker, initialize_kv_cache

    surface = _plugin_surface()
    assert "torch" not in sys.modules
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("FD_CUDAGRAPH_KV_RESERVE", "auto")
    report_path = tmp_path / "memory.json"
    monkeypatch.setenv("FD_CUDAGRAPH_MEMORY_REPORT", str(report_path))
    plugin_registered.device_total = 1 << 30
    config = make_config(8, cudagraph_capture_sizes=[8, 4, 2, 1])
    model = DecoratedMixing(fd_config=config)
    runner = GPUModelRunner(config, model)
    initialize_kv_cache(GpuWorker(config, runner))
    runner.capture_model()
    backend = model.graph_opt_backend.cudagraph_piecewise_backend

    called = {}

    def call(name, *args):
        called[name] = getattr(surface, name)(*args)
        return called[name]

    target = call("entry_point_target", str(REPO))
    assert target == "fd_cudagraph_plugin.plugin:register"
    call("register", target)
    assert graph_optimization_backend.CudaGraphPiecewiseBackend is type(backend)
    # The stand-in's platform is the CPU: register() stood aside from the CUDA runtime there.
    assert "not NVIDIA CUDA" in call("why_not_bound")
    try:
        assert set(call("runtime_check")) == {"paddle_cuda_unset", "cuda_graph_support"}
    except Exception as error:  # CPU Paddle lacks CUDA calls; the GPU's setup part reports it
        called["runtime_check"] = error
        assert "cuda" in f"{type(error).__name__}: {error}".lower()
    facts = call("plugin_facts", str(REPO), "installed")
    assert facts["plugin_is_this_checkout"] and facts["plugin_version"]
    figures, missing = call("figures", backend, str(report_path))
    # 7 captures: the KV reserve's probe captured 3 of the sizes first.
    assert missing == [] and figures["plugin_stats"]["captures"] == 7
    assert figures["memory_report_file"]["graphs"] == 4
    assert call("report", backend).graphs == 4
    assert call("summary", backend).startswith("captured 4 graphs")
    assert set(call("session_timings", backend)) >= {"setup_ms", "own_capture_seconds_sum_ms"}
    # 1 for the 3 sizes the probe warmed, 2 for the one it did not.
    assert call("warmups_by_role", backend) == {"target": [1, 2]}
    assert set(call("served", backend)) == {"replays", "eager"}
    fields, lacking = call("report_fields", backend)
    assert not lacking and fields["graphs"] == 4
    nbytes, source = call("kv_reserve", backend)
    assert nbytes is not None and nbytes > 0 and source
    assert call("margin", 1 << 30) == (1 << 30) // 20
    assert call("is_wrapped", GPUModelRunner.capture_model)
    original = call("unwrapped", GPUModelRunner.capture_model)
    assert not surface.is_wrapped(original)
    assert call("captures", backend) == 7 and call("role", backend) == "target"
    needs = call("requirements", str(REPO))
    assert needs["msgspec"] == "msgspec" and "tqdm" in needs and "pyzmq" not in needs
    readme = (GPU / "README.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in readme for name in needs), "the GPU README must list each"
    import logging

    assert logging.getLogger(surface.LOGGER) is logging.getLogger("fd_cudagraph_plugin")
    # bench_recapture runs plugin arms with other FD_CUDAGRAPH_FIT one after another.
    from fd_cudagraph_plugin.core import process

    assert process.current().options.fit is None
    monkeypatch.setitem(os.environ, "FD_CUDAGRAPH_FIT", "graphs:8")  # read once: unseen
    assert process.current().options.fit is None
    call("forget_options")
    assert str(process.current().options.fit) == "graphs:8"
    public = {
        name
        for name, value in vars(surface).items()
        if inspect.isfunction(value)
        and not name.startswith("_")
        and value.__module__ == "plugin_surface"
    }
    assert public == set(called)
    assert "torch" not in sys.modules


def test_fastdeploy_warmups_needs_fastdeploys_backend(runs):
    done = runs["capture --fastdeploy-warmups alone"].result()
    assert done.returncode == 2
    assert "--fastdeploy-warmups needs --fastdeploy-backend" in done.stderr


@needs_seed
def test_capture_benchmark_times_fastdeploys_own_warmup_knob_in_the_same_rounds(runs):
    """README's recapture figure stands beside what FastDeploy's cudagraph_num_of_warmups: 1
    gives: a third row, timed in the same interleaved rounds, with its own ratio."""
    done = runs["capture with fastdeploy, 1 warm-up"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if "FastDeploy backend, 1 warm-up " in line]
    assert len(rows) == 2 and all("1 warm-up/size" in row for row in rows)
    ratios = [
        line for line in done.stdout.splitlines() if "/ FastDeploy backend, 1 warm-up's" in line
    ]
    assert len(ratios) == 2
