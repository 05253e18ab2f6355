"""The demo: capture, serve, verify against eager, report; and the console entry."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fd_cudagraph_plugin.tools.demo import format_report, run_demo


def test_demo_serves_every_step_equal_to_eager_on_the_simulated_runtime():
    report = run_demo(sizes=[1, 2, 4, 8], steps=60, seed=3, runtime_name="simulated")
    assert report.mismatches == 0 and report.steps == 60
    assert sum(report.stats["replays"].values()) + report.eager_above_max == 60
    assert report.stats["eager_fallbacks"].get("oversized_decode", 0) == report.eager_above_max
    text = format_report(report)
    assert "simulated runtime" in text and "0 mismatches in 60 steps -- OK" in text


SERVED = re.compile(
    r"served (\d+) decode steps: (\d+) replayed a graph, (\d+) ran eagerly \((\d+) above the "
    r"largest size, (\d+) tokens, which GraphOptBackend runs without the backend; (\d+) in "
    r"the backend(?:: [^)]*)?\)"
)
BACKEND = re.compile(
    r"the backend, which counted (\d+) of them: (\d+) captures, (\d+) replays, (\d+) padded "
    r"tokens, (no|\d+) eager steps?"
)
CAPTURED = re.compile(r"captured (\d+) graphs \(sizes (\d+)\.\.(\d+)\)")


@pytest.mark.parametrize(
    ("sizes", "steps", "seed"), [([1, 2, 4, 8], 60, 3), ([1, 2, 4, 8, 16, 24, 32], 200, 0)]
)
def test_every_figure_the_demo_prints_agrees_with_the_others(sizes, steps, seed):
    """Captures ran in a capture session and are not served traffic: the served steps are the
    replays plus the eager steps, the backend counted every one of them (those GraphOptBackend
    ran without it too), and the table, the header and the summary say the same."""
    report = run_demo(sizes=sizes, steps=steps, seed=seed, runtime_name="simulated")
    text = format_report(report)
    lines = text.splitlines()
    served = SERVED.search(text)
    backend = BACKEND.search(text)
    captured = CAPTURED.search(text)
    assert served and backend and captured, text
    total, replays, eager, above, largest, in_backend = map(int, served.groups())
    saw, captures, backend_replays, padded = map(int, backend.groups()[:4])
    fallbacks = 0 if backend[5] == "no" else int(backend[5])
    assert total == steps == replays + eager and eager == above + in_backend
    assert largest == max(sizes) and (int(captured[2]), int(captured[3])) == (1, max(sizes))
    assert saw == total and backend_replays == replays and fallbacks == eager
    assert above == report.eager_above_max
    assert captures == int(captured[1]) == len(sizes)
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("size"))
    rows = [line.split() for line in lines[header + 1 : header + 1 + len(sizes)]]
    assert [int(row[0]) for row in rows] == sorted(sizes)
    assert sum(int(row[1]) for row in rows) == replays
    assert sum(int(row[2]) for row in rows) == padded
    assert f"replay vs eager: 0 mismatches in {steps} steps -- OK" in text


def test_steps_above_the_largest_graph_reach_the_stats_file_as_the_demo_prints_them(
    monkeypatch, tmp_path
):
    """The demo serves each step through the model's call, as FastDeploy's runner does, so a step
    above the largest graph, which FastDeploy's GraphOptBackend runs without the backend, is
    counted where a worker counts it: the stats file and stats() (what the metrics copy) say
    what the screen says."""
    stats_file = tmp_path / "stats.jsonl"
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(stats_file))
    report = run_demo(sizes=[1, 2, 4], steps=80, seed=5, runtime_name="simulated")
    served = SERVED.search(format_report(report))
    assert served, format_report(report)
    total, above = int(served[1]), int(served[4])
    assert total == 80 and above > 0
    lines = [json.loads(line) for line in stats_file.read_text().splitlines()]

    def steps(value):
        return value if isinstance(value, int) else sum(value.values())

    in_file = sum(steps(line.get("eager_above_largest", 0)) for line in lines)
    counted = sum(steps(line["decode_token_counts"]) for line in lines)
    assert in_file == above == report.eager_above_max, lines
    assert counted + in_file == total
    assert report.stats["eager_fallbacks"].get("oversized_decode", 0) == above


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


def test_the_demo_says_a_failed_write_of_the_plugin_on_standard_error(
    monkeypatch, tmp_path, capsys
):
    """The plugin logs to FastDeploy's worker log, which the demo keeps in a temporary
    FD_LOG_DIR: a stats file the disk refused was said nowhere."""
    from fd_cudagraph_plugin.core import outputs
    from fd_cudagraph_plugin.tools.cli import main

    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv("FD_CUDAGRAPH_STATS_FILE", str(stats))
    real = outputs.write_file

    def full_disk(path, *args, **kwargs):
        if str(path) == str(stats):
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(outputs, "write_file", full_disk)
    assert main(["demo", "--steps", "20", "--sizes", "1,2", "--runtime", "simulated"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"FD_CUDAGRAPH_STATS_FILE: cannot write {stats}") == 1, err[-2000:]
