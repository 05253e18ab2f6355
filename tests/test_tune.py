"""``fd-cudagraph tune`` finds the exactly optimal capture sizes for a recorded decode trace."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import pytest
from conftest import make_config

from fd_cudagraph_plugin.cli import main
from fd_cudagraph_plugin.errors import ConfigError, TraceError
from fd_cudagraph_plugin.plan import default_capture_sizes
from fd_cudagraph_plugin.settings import Settings
from fd_cudagraph_plugin.stats import STATS_FORMAT, StatsFile
from fd_cudagraph_plugin.tune import optimal_sizes, padded_tokens, read_histogram, tune


def _brute_force(histogram: dict[int, int], max_graphs: int, top: int) -> int:
    """Fewest padded tokens over every list of at most N sizes from 1..top that includes top."""
    candidates = range(1, top)
    return min(
        padded_tokens((*extra, top), histogram)
        for count in range(max_graphs)
        for extra in itertools.combinations(candidates, count)
    )


def test_tuned_sizes_are_optimal_against_brute_force_on_random_instances():
    rng = random.Random(20260601)
    for _ in range(400):
        top = rng.randint(1, 24)
        histogram = {rng.randint(1, top): rng.randint(1, 30) for _ in range(rng.randint(1, 10))}
        if rng.random() < 0.5:
            top = max(histogram)  # the largest observed count, as without --max-size
        max_graphs = rng.randint(1, 7)
        sizes = optimal_sizes(histogram, max_graphs, top)
        assert sizes == sorted(set(sizes), reverse=True) and sizes[0] == top
        assert len(sizes) <= max_graphs
        assert padded_tokens(sizes, histogram) == _brute_force(histogram, max_graphs, top)


def test_enough_graphs_capture_every_observed_count_and_pad_nothing():
    result = tune({3: 5, 7: 2, 12: 1}, max_graphs=10)
    assert result.capture_sizes == [12, 7, 3] and result.padded_tokens == 0


def test_one_graph_is_the_largest_size():
    result = tune({1: 4, 10: 1}, max_graphs=1)
    assert result.capture_sizes == [10] and result.padded_tokens == 4 * 9


def test_max_size_above_observed_is_kept_as_the_largest_size():
    result = tune({5: 10, 6: 10}, max_graphs=2, max_size=64)
    assert result.capture_sizes == [64, 6] and result.padded_tokens == 10
    assert result.baseline_capture_sizes == default_capture_sizes(64)


def test_steps_above_max_size_and_zero_token_steps_are_left_out_and_reported():
    result = tune({0: 3, 4: 10, 8: 5, 100: 7}, max_graphs=2, max_size=8)
    assert result.capture_sizes == [8, 4] and result.padded_tokens == 0
    assert (result.eager_above_max, result.eager_zero_tokens, result.steps) == (7, 3, 15)


def test_skewed_trace_beats_the_default_list_at_the_same_number_of_graphs():
    rng = random.Random(7)
    histogram = Counter(min(128, max(1, round(rng.gauss(37, 3)))) for _ in range(5000))
    histogram.update(rng.randint(1, 128) for _ in range(200))
    graphs = len(default_capture_sizes(128))
    result = tune(histogram, graphs, max_size=128)
    assert result.baseline_capture_sizes == default_capture_sizes(128)
    assert result.padded_tokens < 0.7 * result.baseline_padded_tokens


def test_bad_limits_name_the_flag():
    with pytest.raises(ConfigError, match="--max-graphs must be an integer >= 1; got 0"):
        tune({1: 1}, max_graphs=0)
    with pytest.raises(ConfigError, match="--max-size must be an integer >= 1"):
        tune({1: 1}, max_graphs=1, max_size=0)
    with pytest.raises(TraceError, match="more than --max-size 4"):
        tune({9: 1}, max_graphs=1, max_size=4)
    with pytest.raises(TraceError, match="no decode step"):
        tune({0: 5}, max_graphs=1)


def test_tuned_config_is_what_fastdeploy_then_captures():
    """The printed JSON, fed to the stand-in FDConfig, gives back exactly the tuned list."""
    result = tune({3: 50, 9: 20, 17: 5, 40: 1}, max_graphs=3)
    config = make_config(64, **result.graph_optimization_config)
    assert config.graph_opt_config.cudagraph_capture_sizes == result.capture_sizes


# --------------------------------------------------------------- input formats


def test_plain_trace_allows_blank_lines_and_comments(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("# decode tokens per step\n3\n\n 3 \n17  # a burst\n1\n")
    assert read_histogram([trace]) == {3: 2, 17: 1, 1: 1}


def _stats_line(rank: int, backend: str, counts: dict[int, int]) -> str:
    return json.dumps(
        {
            "format": STATS_FORMAT,
            "time": 1767225600.5,
            "rank": rank,
            "backend": backend,
            "decode_token_counts": {str(n): c for n, c in counts.items()},
        }
    )


def test_stats_lines_of_several_ranks_and_backends_are_summed(tmp_path):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(
        "\n".join(
            [
                _stats_line(0, "0x7f3a", {1: 2, 4: 1}),
                _stats_line(1, "0x7f3a", {1: 1}),
                _stats_line(0, "0x7f3a", {4: 3, 9: 1}),  # increments since the previous line
                _stats_line(0, "7f99", {0: 2}),
            ]
        )
        + "\n"
    )
    assert read_histogram([stats]) == {1: 3, 4: 4, 9: 1, 0: 2}


class _CountingBackend:
    """What ``StatsFile`` reads from a backend: its cumulative decode token counts."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def observed_keys(self) -> dict[int, int]:
        return dict(self.counts)


def test_reads_the_stats_file_the_plugin_writes(tmp_path):
    writer = StatsFile(
        str(tmp_path / "stats-{rank}.jsonl"), Settings.from_fd_config(make_config(8))
    )
    target, draft = _CountingBackend(), _CountingBackend()
    target.counts.update({3: 2, 5: 1})
    writer.flush(target)
    target.counts.update({3: 1})
    draft.counts.update({3: 1})
    writer.flush(target)
    writer.flush(draft)
    assert read_histogram([tmp_path / "stats-0.jsonl"]) == {3: 4, 5: 1}


def test_plain_and_stats_files_combine(tmp_path):
    plain, stats = tmp_path / "a.txt", tmp_path / "b.jsonl"
    plain.write_text("2\n2\n")
    stats.write_text(_stats_line(0, "0x1", {2: 1, 6: 2}) + "\n")
    assert read_histogram([plain, stats]) == {2: 3, 6: 2}


MALFORMED = [
    ("12x", "expected a decode token count"),
    ("-3", "expected a decode token count"),
    ("2.5", "expected a decode token count"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a decode token count"),
    ('{"format": "other/9"}', "\"format\" is 'other/9'"),
    (f'{{"format": "{STATS_FORMAT}", "time": 1.0, "rank": 0, "backend": "0x1"}}', "missing"),
    (_stats_line(-1, "0x1", {1: 1}), '"rank" must be an integer >= 0'),
    (_stats_line(0, "not-hex", {1: 1}), '"backend" must be a hex id'),
    (_stats_line(0, "0x1", {1: -2}), "must be a step count >= 0"),
    (_stats_line(0, "0x1", {1: 1}).replace('"1": 1', '"one": 1'), "is not a token count"),
    (_stats_line(0, "0x1", {1: 1}).replace("1767225600.5", '"now"'), '"time" must be a unix'),
    (_stats_line(0, "0x1", {1: 1}).replace('{"1": 1}', "[1]"), "must be an object"),
]


@pytest.mark.parametrize(("line", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_line_exits_2_with_file_and_line_number(line, message, tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text(f"# header\n4\n{line}\n5\n")
    assert main(["tune", str(trace), "--max-graphs", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3: " in err and message in err


def test_unreadable_file_is_a_clear_error(tmp_path, capsys):
    assert main(["tune", str(tmp_path / "missing.txt"), "--max-graphs", "2"]) == 2
    assert "cannot read trace file" in capsys.readouterr().err


def test_malformed_line_prints_no_traceback(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("4\nfour\n")
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "tune", str(trace), "--max-graphs", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert f"{trace}:2: expected a decode token count" in done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------- command line


def test_cli_tune_json_has_the_documented_keys(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(["3"] * 40 + ["5"] * 10 + ["30"] * 2) + "\n")
    assert main(["tune", str(trace), "--max-graphs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capture_sizes"] == [30, 5]  # 40 steps pad 3 -> 5, not 10 steps 5 -> 30
    assert out["padded_tokens"] == 40 * 2
    assert out["baseline_capture_sizes"] == [30, 24, 16, 8, 4, 2, 1]
    assert out["baseline_padded_tokens"] == 40 * 1 + 10 * 3 + 0
    assert out["graph_optimization_config"] == {"cudagraph_capture_sizes": [30, 5]}


def test_cli_tune_text_prints_the_flag_to_use(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("3\n3\n5\n200\n")
    assert main(["tune", str(trace), "--max-graphs", "2", "--max-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "left out (FastDeploy runs them eagerly): 1 steps above 64 tokens" in out
    assert """--graph-optimization-config '{"cudagraph_capture_sizes": [64, 5]}'""" in out


def test_stats_recorded_with_speculative_decoding_get_a_note(tmp_path):
    line = {
        "format": "fd-cudagraph-stats/1",
        "time": 1.0,
        "rank": 0,
        "backend": "0x7f00",
        "decode_token_counts": {"4": 10, "6": 5},
        "speculative_method": "mtp",
    }
    path = tmp_path / "stats.jsonl"
    path.write_text(json.dumps(line) + "\n")
    result = tune(read_histogram([path]), 2)
    assert any("speculative decoding (mtp)" in note for note in result.notes)
