"""The demo: capture, serve, verify against eager, report; and the console entry."""

from __future__ import annotations

import subprocess
import sys

from fd_cudagraph_plugin.tools.demo import format_report, run_demo


def test_demo_serves_every_step_equal_to_eager_on_the_simulated_runtime():
    report = run_demo(sizes=[1, 2, 4, 8], steps=60, seed=3, runtime_name="simulated")
    assert report.mismatches == 0 and report.steps == 60
    assert sum(report.stats["replays"].values()) + report.eager_above_max == 60
    text = format_report(report)
    assert "simulated runtime" in text and "0 mismatches in 60 steps -- OK" in text


def test_python_dash_m_demo_exits_zero_and_says_which_runtime():
    result = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "demo", "--steps", "20", "--sizes", "1,2,4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "runtime:" in result.stdout and "replay vs eager: 0 mismatches" in result.stdout


def test_cli_rejects_bad_sizes_with_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "demo", "--sizes", "0,4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "positive integers" in result.stderr
