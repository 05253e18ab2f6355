"""The CPU benchmarks time what they say they time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
