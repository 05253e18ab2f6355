"""The CPU benchmarks time what they say they time."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_capture_benchmark(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/capture.py, fast: 4 sizes, no eager cost."""
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "capture.py"),
            *("--rounds", "2", "--eager-ms", "0", "--max-num-seqs", "8", *args),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=False,
    )


def test_capture_benchmark_times_a_capture_of_every_size_by_the_plugin():
    """Without --fastdeploy-backend the plugin arm alone runs; its backend must join the session
    capture_model() opens and capture every size, or the figure is of eager runs."""
    done = run_capture_benchmark()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("captured 4 graphs (sizes 1..8)") == 2, done.stderr[-3000:]
    assert "no graphs captured" not in done.stderr and "late_capture" not in done.stderr
    assert "every backend captured all 4 sizes in every round" in done.stdout
    assert "ms/size" in done.stdout


def test_capture_benchmark_recapture_warms_each_size_once_and_captures_every_size():
    """--recapture: clear_graph() and capture_model() again in the same worker. The plugin
    captures every size again, in a capture session, with one warm-up per size (its report and
    the forwards counted through the backend agree); the first capture keeps FastDeploy's two."""
    done = run_capture_benchmark("--recapture")
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
        f"unknown part '{unknown}' (parts: setup main pair ctime dispatch fail budget recapture)"
    ]
    assert not (tmp_path / "out").exists()
