"""The CPU benchmarks time what they say they time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_capture_benchmark_times_a_capture_of_every_size_by_the_plugin():
    """Without --fastdeploy-backend the plugin arm alone runs; its backend must join the session
    capture_model() opens and capture every size, or the figure is of eager runs."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "capture.py"),
            *("--rounds", "2", "--eager-ms", "0", "--max-num-seqs", "8"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("captured 4 graphs (sizes 1..8)") == 2, done.stderr[-3000:]
    assert "no graphs captured" not in done.stderr and "late_capture" not in done.stderr
    assert "every backend captured all 4 sizes in every round" in done.stdout
    assert "ms/size" in done.stdout


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
        f"unknown part '{unknown}' (parts: setup main pair ctime dispatch fail budget)"
    ]
    assert not (tmp_path / "out").exists()
