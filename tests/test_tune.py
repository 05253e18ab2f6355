"""``fd-cudagraph tune`` finds the exactly optimal capture sizes for a recorded decode trace."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import pytest
from conftest import graph_config, make_config, speculative_config

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.observability import STATS_FORMAT, StatsFile
from fd_cudagraph_plugin.core.outputs import OutputFailures
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.tools import launch as launch_line
from fd_cudagraph_plugin.tools.capture_rules import default_capture_sizes, fastdeploy_bsz_map
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.plan import derive_plan
from fd_cudagraph_plugin.tools.traces import TraceError, read_histogram
from fd_cudagraph_plugin.tools.tune import format_result, optimal_sizes, padded_tokens, tune


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
    with pytest.raises(ConfigError, match=r"--max-size must be an integer in 1\.\.512"):
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
    """What ``StatsFile`` reads from a backend: its cumulative decode token counts, and its
    role (each line names it)."""

    def __init__(self, role: str = "target") -> None:
        self.counts: Counter[int] = Counter()
        self.role = role

    def observed_keys(self) -> dict[int, int]:
        return dict(self.counts)

    def observed_above(self) -> dict[int, int]:
        return {}


def test_reads_the_stats_file_the_plugin_writes(tmp_path):
    writer = StatsFile(
        str(tmp_path / "stats-{rank}.jsonl"),
        Settings.from_fd_config(make_config(8)),
        OutputFailures(),
    )
    target, draft = _CountingBackend(), _CountingBackend("draft")
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
    (_stats_line(0, "0x1", {1: -2}), "must be a step count in 0.."),
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
    assert "left out (FastDeploy runs them eagerly): 1 step above 64 tokens" in out
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


# --------------------------------------------------------------- bounded work for any input


def test_huge_count_is_an_error_with_file_and_line_not_an_overflow(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("4\n99999999999999999999\n")
    assert main(["tune", str(trace), "--max-graphs", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: 99999999999999999999 is above 2147483647" in err


def test_a_count_of_thousands_of_digits_is_the_same_clean_error(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("4\n" + "9" * 5000 + "  # comment\n")
    assert main(["tune", str(trace), "--max-graphs", "2"]) == 2
    assert f"{trace}:2: 999999999999999999999999... is above" in capsys.readouterr().err


def test_max_size_above_fastdeploys_cap_names_the_flag(capsys):
    with pytest.raises(ConfigError, match=r"--max-size must be an integer in 1\.\.512"):
        tune({1: 1}, max_graphs=2, max_size=1_000_000_000)


def test_counts_above_any_graph_are_tallied_not_stored(tmp_path):
    """Memory follows the distinct counts FastDeploy could graph, not the largest value."""
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{n}\n" for n in range(4000, 200_000, 7)) + "3\n600\n")
    histogram = read_histogram([trace])
    assert dict(histogram) == {3: 1, 600: 1}
    assert histogram.beyond == len(range(4000, 200_000, 7))
    result = tune(histogram, max_graphs=4)
    assert result.max_size == 3 and result.capture_sizes == [3]
    assert result.eager_above_max == histogram.beyond + 1
    assert result.baseline_capture_sizes == default_capture_sizes(3)


MEMORY_REPORT = {
    "format": "fd-cudagraph-memory/1",
    "phase": "decode",
    "rank": 0,
    "graphs": 2,
    "captures": [],
}

TRUTHS = [
    # (trace, flags, exit code, what must be printed, what must not)
    ("", [], 2, "no decode step with 1 to 512 tokens", "3072"),
    ("", ["--fastdeploy-version", "2.5"], 2, "no decode step with 1 to 256 tokens", "3072"),
    ("3\n5\n17\n", [], 0, "decode steps: 3 with 3..17 tokens", "1..17"),
    ("3\n600\n700\n", [], 0, "tuned    (1 graph; at most 2, --max-graphs): 3\n", "512, 3"),
    ("600\n", [], 2, "every decode step in the trace has more than 512 tokens", "--max-size"),
    (
        _stats_line(0, "0x1", {3: 10**29}) + "\n",
        [],
        2,
        f"\"decode_token_counts\"['3'] must be a step count in 0..{2**53 - 1}",
        "decode steps",
    ),
    (
        json.dumps(MEMORY_REPORT, indent=1) + "\n",
        [],
        2,
        "is a graph-memory report (what FD_CUDAGRAPH_MEMORY_REPORT writes",
        "not valid JSON",
    ),
    (
        json.dumps(MEMORY_REPORT) + "\n",
        [],
        2,
        f"this is a graph-memory report (what FD_CUDAGRAPH_MEMORY_REPORT writes after each "
        f"capture session), not a trace; tune reads decode traces: one decode token count per "
        f"line, or the {STATS_FORMAT} JSON lines FD_CUDAGRAPH_STATS_FILE writes.",
        "not valid JSON",
    ),
    ('{"time": 1}\n', [], 2, 'no "format" key', "is None"),
    ('{"format": "x", "decode_token_counts": {"3": "ab\n', [], 2, "starting at column", "at at"),
]


@pytest.mark.parametrize(
    ("trace", "flags", "code", "says", "never"), TRUTHS, ids=[t[3][:40] for t in TRUTHS]
)
def test_tune_output_tells_the_truth_about_the_trace(
    trace, flags, code, says, never, tmp_path, capsys
):
    path = tmp_path / "trace"
    path.write_text(trace)
    assert main(["tune", str(path), "--max-graphs", "2", *flags]) == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert says in text and never not in text, text


@pytest.mark.parametrize(("release", "cap"), [("2.4", 256), ("2.5", 256), ("2.6", 512)])
def test_the_largest_size_is_bounded_by_the_releases_max_num_seqs(release, cap):
    with pytest.raises(ConfigError, match=rf"--max-size must be an integer in 1\.\.{cap} "):
        tune({1: 1}, max_graphs=1, max_size=cap + 1, fastdeploy_version=release)
    result = tune({1: 1, cap + 1: 5}, max_graphs=2, fastdeploy_version=release)
    assert result.capture_sizes == [1] and result.eager_above_max == 5


def test_speculative_sizes_are_tokens_on_2_5_and_refused_on_2_4():
    """2.5 takes user sizes in tokens and maps running requests to int(size / (k + 1)); 2.4
    builds no running-request map at all."""
    result = tune({1: 4, 3: 2}, 2, num_speculative_tokens=1, fastdeploy_version="2.5")
    assert result.capture_sizes == [3, 1]
    assert result.graph_optimization_config == {"cudagraph_capture_sizes": [6, 2]}
    with pytest.raises(ConfigError, match=r"FastDeploy 2\.4 builds no real_bsz_to_captured_size"):
        tune({1: 4}, 1, num_speculative_tokens=1, fastdeploy_version="2.4")


def test_default_baseline_is_fastdeploys_list_for_the_observed_maximum():
    result = tune({3: 4, 100: 1}, max_graphs=2)
    assert (
        result.baseline_capture_sizes == make_config(100).graph_opt_config.cudagraph_capture_sizes
    )


def test_bad_byte_names_the_line_and_a_bom_is_accepted(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_bytes(b"\xef\xbb\xbf4\n5\n")
    assert read_histogram([trace]) == {4: 1, 5: 1}
    trace.write_bytes(b"4\n5\n\xff6\n")
    assert main(["tune", str(trace), "--max-graphs", "2"]) == 2
    assert f"{trace}:3: not UTF-8 text" in capsys.readouterr().err


def test_dash_reads_standard_input():
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "tune", "-", "--max-graphs", "1", "--json"],
        input="3\n3\n7\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["capture_sizes"] == [7]


# --------------------------------------------------------------- speculative decoding


def _running_line(k: int, counts: dict[int, int], method: str = "mtp") -> str:
    return json.dumps(
        {
            "format": STATS_FORMAT,
            "time": 1.0,
            "rank": 0,
            "backend": "0x7f00",
            "speculative_method": method,
            "num_speculative_tokens": k,
            "running_request_counts": {str(n): c for n, c in counts.items()},
        }
    )


def _fastdeploy_padding(requests: list[int], k: int, histogram: dict[int, int]) -> int:
    """Tokens padded when FastDeploy serves ``histogram`` (running requests) with these sizes.

    Goes through FastDeploy's own rules: user sizes times k + 1, then real_bsz_to_captured_size.
    """
    bsz_map = fastdeploy_bsz_map(sorted((s * (k + 1) for s in requests), reverse=True), k)
    return sum(steps * (bsz_map[r] - r * (k + 1)) for r, steps in histogram.items())


def test_speculative_sizes_are_optimal_against_brute_force_in_fastdeploys_terms():
    rng = random.Random(20260602)
    for _ in range(150):
        k = rng.randint(1, 5)
        histogram = {rng.randint(1, 14): rng.randint(1, 30) for _ in range(rng.randint(1, 8))}
        max_graphs = rng.randint(1, 5)
        result = tune(histogram, max_graphs, num_speculative_tokens=k)
        top = max(histogram)
        best = min(
            _fastdeploy_padding([*extra, top], k, histogram)
            for count in range(max_graphs)
            for extra in itertools.combinations(range(1, top), count)
        )
        assert len(result.capture_sizes) <= max_graphs
        assert result.padded_tokens == _fastdeploy_padding(result.capture_sizes, k, histogram)
        assert result.padded_tokens == best


def test_speculative_stats_are_read_and_the_config_yields_the_fitted_graphs(tmp_path):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(_running_line(2, {1: 40, 2: 5, 6: 9}) + "\n" + _running_line(2, {6: 1}) + "\n")
    result = tune(read_histogram([stats]), max_graphs=2)
    assert result.num_speculative_tokens == 2 and result.capture_sizes == [6, 1]
    assert result.padded_tokens == 5 * (6 - 2) * 3
    config = make_config(
        6,
        speculative={"method": "mtp", "num_speculative_tokens": 2},
        **result.graph_optimization_config,
    )
    assert config.graph_opt_config.cudagraph_capture_sizes == result.captured_token_sizes == [18, 3]


def test_cli_reads_a_plain_trace_as_running_requests_with_k(tmp_path, capsys):
    trace = tmp_path / "running.txt"
    trace.write_text("1\n1\n1\n4\n")
    mtp = speculative_config(method="mtp", num_speculative_tokens=3)
    assert main(["tune", str(trace), "--max-graphs", "1", *mtp]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding, k = 3" in out and "padded tokens: tuned 36 " in out
    assert """--graph-optimization-config '{"cudagraph_capture_sizes": [4]}'""" in out


SPECULATIVE_ERRORS = [
    ([_running_line(2, {1: 1}), _running_line(3, {1: 1})], [], "earlier lines say 2"),
    ([_running_line(9, {1: 1})], [], '"num_speculative_tokens" must be an integer in 1..5'),
    ([_running_line(2, {1: 1}), _stats_line(0, "0x1", {1: 1})], [], "mix speculative stats"),
    (
        [_running_line(2, {1: 1})],
        speculative_config(method="mtp", num_speculative_tokens=1),
        "num_speculative_tokens of --speculative-config: 1 differs from the stats files' "
        "num_speculative_tokens 2",
    ),
    (
        [_stats_line(0, "0x1", {1: 1})],
        speculative_config(method="mtp", num_speculative_tokens=1),
        "these stats files hold decode token counts (recorded without running_request_counts); "
        "leave it out",
    ),
    (
        ["3"],
        speculative_config(method="mtp", num_speculative_tokens=100000000),
        "--speculative-config: num_speculative_tokens must be an integer in 0..5; got 100000000.",
    ),
    # 0 is a value of the JSON (naive's), not a k of mtp: plan refuses this launch line too.
    (
        ["3"],
        speculative_config(method="mtp", num_speculative_tokens=0),
        "num_speculative_tokens must be an integer in 1..5",
    ),
]


@pytest.mark.parametrize(("lines", "flags", "message"), SPECULATIVE_ERRORS)
def test_speculative_inconsistencies_exit_2_naming_the_field(
    lines, flags, message, tmp_path, capsys
):
    trace = tmp_path / "stats.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["tune", str(trace), "--max-graphs", "2", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_stats_file_a_speculative_backend_writes_is_tuned_in_running_requests(sim, tmp_path):
    """End to end: the backend's own stats file under MTP, then tune, then FastDeploy's config."""
    from conftest import Buffers, TinyBackbone, capture_speculative

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    config = make_config(4, speculative={"method": "mtp", "num_speculative_tokens": 1})
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    capture_speculative(backend, buffers)
    for tokens, running in [(6, 3)] * 5 + [(2, 1)] * 3:
        step = buffers.step(tokens)
        step["forward_meta"].real_bsz = running
        backend(**step)
    path = tmp_path / "stats.jsonl"
    StatsFile(str(path), backend.settings, OutputFailures()).flush(backend)
    line = json.loads(path.read_text())
    assert line["running_request_counts"] == {"1": 4, "2": 1, "3": 5, "4": 1}  # captures too
    assert line["speculative_method"] == "mtp" and line["num_speculative_tokens"] == 1
    result = tune(read_histogram([path]), max_graphs=2)
    assert result.num_speculative_tokens == 1
    assert result.capture_sizes == [4, 1]  # in requests (pads 2->4, 3->4: 7 slots; [4, 3]: 9)


def test_the_report_never_says_fewer_when_the_default_pads_nothing(tmp_path):
    from fd_cudagraph_plugin.tools.tune import format_result

    trace = tmp_path / "t.txt"
    trace.write_text("1\n2\n4\n")
    text = format_result(tune(read_histogram([trace]), max_graphs=1))
    assert "tuned    (1 graph; at most 1, --max-graphs): 4" in text
    assert "default 0 (0.000 per step), the default list pads none" in text


def test_a_tuned_list_that_pads_more_than_the_default_is_not_recommended():
    # With --max-graphs below the default list's length, the tuned list can pad more; "use:" then
    # recommended the worse list.
    from fd_cudagraph_plugin.tools.tune import format_result, tune

    histogram = {1: 10, 2: 10, 3: 10, 5: 10, 7: 10, 13: 10}
    result = tune(histogram, max_graphs=2, max_size=13, fastdeploy_version="develop")
    assert result.padded_tokens > result.baseline_padded_tokens
    text = format_result(result)
    assert "keep the default list" in text and "\nuse:" not in text


# --------------------------------------------------------------- the deployment it came from


def _deployed_line(counts: dict[int, int], **fields) -> str:
    record = json.loads(_stats_line(0, "0x1", counts))
    record.update(fields)
    return json.dumps(record)


@pytest.mark.parametrize("same", ["twice", "a link", "another spelling"])
def test_the_same_file_given_twice_is_refused_not_counted_twice(same, tmp_path, capsys):
    """``tune f f`` counted every step twice."""
    trace = tmp_path / "t.txt"
    trace.write_text("3\n5\n")
    other = {
        "twice": trace,
        "a link": tmp_path / "link.txt",
        "another spelling": tmp_path / "." / "t.txt",
    }[same]
    if same == "a link":
        other.symlink_to(trace)
    assert main(["tune", str(trace), str(other), "--max-graphs", "2"]) == 2
    assert f"{other} is the same file as {trace}; give each trace once" in capsys.readouterr().err


def test_stats_lines_with_the_deployed_list_and_max_num_seqs_are_the_baseline(tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    line = _deployed_line({3: 40, 5: 10, 30: 2, 80: 1}, capture_sizes=[64, 32, 16], max_num_seqs=64)
    stats.write_text(line + "\n" + line + "\n")
    assert main(["tune", str(stats)]) == 0
    out = capsys.readouterr().out
    assert f"max_num_seqs: 64 (from {stats}:1)" in out
    assert f"deployed (3 graphs, from {stats}:1): 64, 32, 16" in out
    # As many graphs as the deployed list by default; the step of 80 is above max_num_seqs.
    assert "tuned    (3 graphs; at most 3, as many as the deployed list): 30, 5, 3" in out
    assert "left out (FastDeploy runs them eagerly): 2 steps above 30 tokens" in out
    (eager,) = [row.split() for row in out.splitlines() if row.startswith("  >30 ")]
    assert eager[:2] == [">30", "2"] and eager[-1] == "(eager)"


def test_a_flag_that_disagrees_with_the_stats_files_names_both(tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(_deployed_line({3: 4}, capture_sizes=[8, 4], max_num_seqs=8) + "\n")
    assert main(["tune", str(stats), "--max-num-seqs", "16"]) == 2
    assert f"--max-num-seqs 16 and {stats}:1 (max_num_seqs 8) disagree" in capsys.readouterr().err
    assert main(["tune", str(stats), *graph_config(cudagraph_capture_sizes=[8, 2])]) == 2
    err = capsys.readouterr().err
    flag = "--graph-optimization-config cudagraph_capture_sizes"
    assert f"{flag} 8,2 and {stats}:1 (capture_sizes 8,4) disagree" in err
    same = graph_config(cudagraph_capture_sizes=[4, 8])
    assert main(["tune", str(stats), *same, "--max-num-seqs", "8"]) == 0


def test_stats_of_two_deployments_are_refused(tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(
        _deployed_line({3: 4}, capture_sizes=[8, 4]) + "\n"
        + _deployed_line({3: 4}, capture_sizes=[8]) + "\n"
    )  # fmt: skip
    assert main(["tune", str(stats)]) == 2
    assert f'{stats}:2: "capture_sizes" differs from {stats}:1\'s' in capsys.readouterr().err


def test_the_deployed_list_from_the_command_line_is_compared_and_counts_its_eager_steps(capsys):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "fd_cudagraph_plugin", "tune", "-"),
            *graph_config(cudagraph_capture_sizes=[4, 2, 1]),
        ],
        input="1\n3\n3\n7\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    deployed = "deployed (3 graphs, from --graph-optimization-config cudagraph_capture_sizes)"
    assert f"{deployed}: 4, 2, 1" in done.stdout
    assert "above the deployed list's largest size (4): 1 step, which it runs without a graph" in (
        done.stdout
    )


def test_max_graphs_defaults_to_the_default_lists_length_and_says_so():
    result = tune({3: 5, 9: 1, 40: 1})
    assert result.max_graphs == len(default_capture_sizes(40))
    assert result.max_graphs_from == "as many as the default list"


def test_the_traffic_histogram_counts_each_step_under_the_size_it_pads_to():
    result = tune({1: 2, 3: 5, 4: 1, 9: 1}, max_graphs=2, max_size=9)
    assert result.capture_sizes == [9, 3]  # 1 and 3 pad to 3, 4 and 9 to 9
    assert result.traffic == [(3, 7), (9, 2)]
    text = format_result(result)
    assert "steps per tuned size" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["3"], ["9"])]
    assert [row[:3] for row in rows] == [["3", "7", "77.8%"], ["9", "2", "22.2%"]]


def test_tune_json_says_its_format(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    trace.write_text("3\n")
    assert main(["tune", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "fd-cudagraph-tune/1"


# ------------------------------------------------------------------ the launch line (issue 37)


def _lognormal() -> Counter:
    """A log-normal decode trace (20k steps, 1..256 tokens), as the issue's."""
    rng = random.Random(0)
    return Counter(max(1, min(256, int(rng.lognormvariate(3.5, 0.8)))) for _ in range(20000))


EXPERT_PARALLEL = ["-tp", "8", "--enable-expert-parallel", "--splitwise-role", "decode"]


def _tune_json(argv, capsys) -> dict:
    assert main(["tune", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _plan_json(argv, capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("release", ["2.4", "2.6", "develop"])
def test_under_expert_parallelism_tune_recommends_only_what_the_launch_captures(
    release, tmp_path, capsys
):
    """The issue: without the launch, tune chose 27 sizes of which filter_capture_size kept 2.
    With it, every tuned size survives plan's derivation of that launch, and the baseline is the
    default list as that launch keeps it."""
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(str(n) for n, c in _lognormal().items() for _ in range(c)))
    launch = ["--max-num-seqs", "256", "--fastdeploy-version", release, *EXPERT_PARALLEL]
    result = _tune_json([str(trace), *launch], capsys)
    tuned = result["capture_sizes"]
    assert len(tuned) == 24 and all(size % 8 == 0 for size in tuned)
    assert "filter_capture_size keeps only sizes divisible by 8" in result["kept_by"]
    planned = _plan_json([*launch, *graph_config(cudagraph_capture_sizes=tuned)], capsys)
    # 2.4 puts a 0 first under expert parallelism, which is no graph.
    assert [size for size in planned["cudagraph_capture_sizes"] if size] == tuned
    default = [size for size in _plan_json(launch, capsys)["cudagraph_capture_sizes"] if size]
    assert result["baseline_capture_sizes"] == default and len(default) == 24
    assert result["padded_tokens"] < result["baseline_padded_tokens"]


def test_in_the_mixed_role_from_2_5_no_size_is_filtered_and_tune_says_nothing_of_it(capsys):
    """From 2.5 the mixed role turns sequence-parallel MoE off before the filter (2.4 filters)."""
    histogram = {3: 10, 5: 4, 17: 2}
    launch = launch_line.read(["-tp", "8", "--enable-expert-parallel", "--max-num-seqs", "64"])
    mixed = tune(histogram, 3, fastdeploy_version="2.6", launch=launch)
    assert mixed.capture_sizes == [17, 5, 3] and not mixed.kept_by
    older = tune(histogram, 3, fastdeploy_version="2.4", launch=launch)
    assert all(size % 8 == 0 for size in older.capture_sizes) and older.kept_by


def test_under_speculative_decoding_the_filter_is_on_token_sizes(capsys):
    """k = 1: FastDeploy captures s x 2 tokens and keeps those divisible by TP 4, so running
    requests must be even; plan of the same launch keeps every tuned size."""
    launch = launch_line.read(
        [
            *("-tp", "4", "--enable-expert-parallel", "--splitwise-role", "decode"),
            *("--max-num-seqs", "32"),
            *("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'),
        ]
    )
    result = tune(
        {1: 9, 3: 5, 7: 3, 30: 1},
        3,
        num_speculative_tokens=1,
        fastdeploy_version="2.6",
        launch=launch,
    )
    assert result.capture_sizes == [30, 8, 4]
    plan = derive_plan(
        dataclasses.replace(launch, capture_sizes=(30, 8, 4), fastdeploy_version="2.6")
    )
    assert plan.capture_sizes == [60, 16, 8]


def test_a_max_size_the_launch_would_filter_is_refused_with_the_reason(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("3\n9\n30\n")
    argv = ["tune", str(trace), "--max-size", "30", "--max-num-seqs", "64", *EXPERT_PARALLEL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-size 30: with sequence-parallel MoE under TP 8 (role decode)" in err
    assert "Give a multiple of 8." in err


def test_a_tuned_list_the_launch_would_cut_is_refused_not_recommended(monkeypatch):
    """The last guard: whatever the fit chose is derived again as plan derives the launch, and a
    size FastDeploy would drop is refused (here the fit is made to forget the filter)."""
    from fd_cudagraph_plugin.tools import tune as tune_module

    real = tune_module._Target.__init__

    def forgetful(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.divisor = 1

    monkeypatch.setattr(tune_module._Target, "__init__", forgetful)
    launch = launch_line.read(
        ["-tp", "8", "--enable-expert-parallel", "--splitwise-role", "decode"]
    )
    with pytest.raises(ConfigError, match=r"the tuned list \(.*\) would lose 17, 5, 3 in this"):
        tune({3: 10, 5: 4, 17: 2, 64: 1}, 4, fastdeploy_version="2.6", launch=launch)


def test_a_graph_cap_says_what_it_costs_in_padded_tokens(capsys, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(["1", "2", "3", "5", "9", "17", "33", "40"] * 3))
    assert main(["tune", str(trace), "--max-graphs", "3"]) == 0
    out = capsys.readouterr().out
    assert (
        "the cap of 3 graphs (--max-graphs) costs 72 padded tokens against the best 8 graphs"
        in (out)
    )
    assert main(["tune", str(trace)]) == 0
    assert "the cap of" not in capsys.readouterr().out


SATURATED_LINE = (
    '{"format": "fd-cudagraph-stats/1", "time": 1.0, "rank": 0, "backend": "7f", '
    '"decode_token_counts": {"1": 5, "3": 4, "6": 5, "8": 86}, "capture_sizes": [8, 4, 2, 1], '
    '"max_num_seqs": 256'
)


@pytest.mark.parametrize(
    ("eager", "said"),
    [
        ("", "how many ran eagerly above it is unknown: these stats do not count them"),
        (', "eager_above_largest": {"40": 100, "200": 50}', "60.0% of all steps ran eagerly"),
        (', "eager_above_largest": 150', "60.0% of all steps ran eagerly above it (150 steps of"),
    ],
    ids=["before 0.6.0", "by count", "a total"],
)
def test_a_saturated_deployed_list_is_warned_with_the_share_served_eagerly(
    eager, said, tmp_path, capsys
):
    """The issue: sizes [1, 2, 4, 8], 256 requests, 86% of the steps at 8, got "100.0% fewer"
    and no warning. The steps above 8 never reach the plugin's backend."""
    stats = tmp_path / "stats.jsonl"
    stats.write_text(SATURATED_LINE + eager + "}\n")
    result = _tune_json([str(stats)], capsys)
    (warning,) = _deployed_warnings(result)
    assert "the deployed list ends at 8 tokens, below the 256 this deployment allows" in warning
    assert "86.0% of the steps its graphs served ran at 8" in warning and said in warning
    if "200" in eager:  # by count: weighed as the steps they are
        assert result["capture_sizes"][0] == 200 and result["baseline_eager_steps"] == 150
    if eager.endswith("150"):  # counts unknown: the tuned list ends where they fit
        assert result["capture_sizes"][0] == 256


def _deployed_warnings(result: dict) -> list[str]:
    """The warnings about the deployed list (the tuned list's, plan's own, are apart)."""
    return [w for w in result["warnings"] if not w.startswith("with the tuned list, ")]


def test_a_list_at_max_num_seqs_with_few_steps_at_it_is_not_warned(tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    line = SATURATED_LINE.replace('"max_num_seqs": 256', '"max_num_seqs": 8')
    stats.write_text(line + "}\n")
    assert _tune_json([str(stats)], capsys)["warnings"] == []
    stats.write_text(SATURATED_LINE.replace('"8": 86', '"8": 2') + "}\n")
    result = _tune_json([str(stats)], capsys)
    assert _deployed_warnings(result) == []
    # The tuned list ends at 8 too, below the 256 allowed: plan's warning says what runs eagerly.
    (tuned,) = result["warnings"]
    assert "with the tuned list, the largest decode graph holds 8 tokens" in tuned


@pytest.mark.parametrize(
    "value", ['"many"', '{"x": 1}', '{"40": -1}', "true"], ids=["text", "key", "steps", "bool"]
)
def test_a_bad_eager_above_largest_names_the_line(value, tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(SATURATED_LINE + f', "eager_above_largest": {value}}}\n')
    assert main(["tune", str(stats)]) == 2
    assert f'{stats}:1: "eager_above_largest"' in capsys.readouterr().err


def test_tune_takes_the_same_launch_line_as_plan(tmp_path, capsys, monkeypatch):
    """Where FastDeploy is not importable: the small parser reads the capture flags and names
    the others once."""
    from fd_cudagraph_plugin.tools import plan as plan_module

    monkeypatch.setattr(launch_line, "installed_fastdeploy", lambda: None)
    monkeypatch.setattr(plan_module, "installed_fastdeploy", lambda: None)
    launch = [
        *("--model", "/models/ERNIE-4.5-21B-A3B-Paddle", "--port", "8180"),
        *("--max-model-len", "32768", "--quantization", "wint4", "--max-num-seqs", "64"),
    ]
    trace = tmp_path / "trace.txt"
    trace.write_text("3\n5\n17\n40\n")
    assert main(["tune", str(trace), *launch]) == 0, capsys.readouterr().err
    assert "--model, --port, --max-model-len, --quantization change nothing" in (
        capsys.readouterr().out
    )


#: Quiet traffic on a TP 8 expert-parallel decode node: every step fits the smallest size.
QUIET = ["-tp", "8", "--enable-expert-parallel", "--splitwise-role", "decode"]


@pytest.mark.parametrize("max_size", [None, "256"], ids=["tuned to the trace", "--max-size 256"])
def test_advice_that_gains_nothing_says_keep_the_default(max_size, tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(map(str, [1, 2, 3, 4, 5, 6, 1, 2, 3])))
    extra = [] if max_size is None else ["--max-size", max_size]
    argv = ["tune", str(trace), *extra, "--fastdeploy-version", "2.6"]
    assert main([*argv, "--max-num-seqs", "256", *QUIET]) == 0
    out = capsys.readouterr().out
    assert "padded tokens: tuned 45 (5.000 per step), default 45 (5.000 per step)" in out
    assert "\nkeep the default list: the tuned list pads no fewer tokens on this trace" in out
    assert "\nuse:" not in out
    assert main([*argv, "--max-num-seqs", "256", *QUIET, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["advice"] == "keep"


def test_a_tuned_list_below_what_the_deployment_allows_gets_plans_warning(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(map(str, [1, 2, 3, 4, 5, 6, 1, 2, 3])))
    argv = ["tune", str(trace), "--fastdeploy-version", "2.6", "--max-num-seqs", "256", *QUIET]
    assert main(argv) == 0
    assert (
        "warning: with the tuned list, the largest decode graph holds 8 tokens, below "
        "max_num_seqs 256 (one token per running request in a decode step): decode steps of "
        "9..256 tokens run eagerly"
    ) in capsys.readouterr().out
    # Without a known max_num_seqs nothing says what the steps may carry: no warning.
    assert main(["tune", str(trace), "--fastdeploy-version", "2.6", *QUIET]) == 0
    assert "with the tuned list" not in capsys.readouterr().out


def test_advice_that_pads_fewer_tokens_still_says_use(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(map(str, [3, 3, 5, 9, 17, 33, 40] * 3)))
    assert main(["tune", str(trace), "--max-num-seqs", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["padded_tokens"] < result["baseline_padded_tokens"]
    assert result["advice"] == "use"


# ------------------------------------------------------------ --fit: FD_CUDAGRAPH_FIT on a trace

#: 320 decode steps, more than core.fit.MIN_STEPS: enough traffic for a fit.
FIT_TRACE = [3] * 200 + [5] * 60 + [17] * 40 + [30] * 20


def _fit_trace(tmp_path, counts=FIT_TRACE) -> str:
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(map(str, counts)) + "\n")
    return str(trace)


@pytest.mark.parametrize("budget", ["graphs:3", "padding:10"])
def test_fit_prints_what_fd_cudagraph_fit_would_capture_of_fastdeploys_list(
    budget, tmp_path, capsys
):
    """core.fit's own choice over FastDeploy's list (here the default for max_num_seqs 64), its
    padding against the whole list on the same steps, and the line to set."""
    from fd_cudagraph_plugin.core.fit import Budget, fit

    argv = [_fit_trace(tmp_path), "--max-num-seqs", "64", "--fit", budget]
    default = [64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    expected = fit(Counter(FIT_TRACE), default, Budget.parse(budget))
    assert not expected.why and len(expected.sizes) < len(default)
    document = _tune_json(argv, capsys)
    assert document["baseline_capture_sizes"] == default
    assert document["fit"] == {
        "env": f"FD_CUDAGRAPH_FIT={budget}",
        "capture_sizes": list(expected.sizes),
        "fastdeploy_capture_sizes": default,
        "steps": 320,
        "padded_tokens": expected.padded,
        "baseline_padded_tokens": expected.padded_default,
        "kept_because": None,
        "min_steps": 256,
        "changes_nothing": None,
    }
    assert main(["tune", *argv]) == 0
    out = capsys.readouterr().out
    listing = ", ".join(map(str, expected.sizes))
    assert (
        f"\nfit      (FD_CUDAGRAPH_FIT={budget}): {len(expected.sizes)} of the default list's 11 "
        f"sizes, its largest kept: {listing} (a fit over the list this launch captures now, "
        "not over the tuned one)\n"
    ) in out
    assert (
        f"\npadded tokens: fit {expected.padded} ({expected.padded / 320:.3f} per step), default "
        f"{expected.padded_default} ({expected.padded_default / 320:.3f} per step) on the same "
        "320 steps up to 64 tokens"
    ) in out
    assert f"\nset: FD_CUDAGRAPH_FIT={budget} in the server's environment" in out
    assert (
        "; the first capture at start makes the whole list, or fits to what "
        "FD_CUDAGRAPH_STATS_FILE recorded of the same plan at earlier starts\n"
    ) in out
    # Without --fit: nothing of it.
    assert _tune_json(argv[:-2], capsys)["fit"] is None
    assert main(["tune", *argv[:-2]]) == 0
    assert "FD_CUDAGRAPH_FIT" not in capsys.readouterr().out


def test_fit_with_three_graphs_keeps_the_largest_and_pads_to_the_next_size_kept(tmp_path, capsys):
    """The numbers by hand: 3 of 64..1 for steps of 3, 5, 17 and 30 tokens are 64, 32, 8."""
    argv = [_fit_trace(tmp_path), "--max-num-seqs", "64", "--fit", "graphs:3"]
    fitted = _tune_json(argv, capsys)["fit"]
    assert fitted["capture_sizes"] == [64, 32, 8]
    # 200 x (8 - 3) + 60 x (8 - 5) + 40 x (32 - 17) + 20 x (32 - 30); the whole list pads 3 to 4,
    # 5 to 8, 17 to 24 and 30 to 32.
    assert fitted["padded_tokens"] == 1000 + 180 + 600 + 40 == 1820
    assert fitted["baseline_padded_tokens"] == 200 + 180 + 280 + 40 == 700


def test_fit_on_the_deployed_list_below_min_steps_says_fastdeploys_list_is_kept(tmp_path, capsys):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(STATS_LINE_WITH_DEPLOYMENT + "\n")
    argv = [str(stats), "--fit", "graphs:3"]
    fitted = _tune_json(argv, capsys)["fit"]
    assert fitted["capture_sizes"] == fitted["fastdeploy_capture_sizes"] == [64, 32, 16, 8, 4, 2, 1]
    assert fitted["kept_because"] == "58 steps, fewer than 256"
    assert fitted["padded_tokens"] == fitted["baseline_padded_tokens"] == 164
    assert main(["tune", *argv]) == 0
    out = capsys.readouterr().out
    assert (
        "\nfit      (FD_CUDAGRAPH_FIT=graphs:3): the deployed list's 7 sizes, unchanged (58 steps, "
        "fewer than 256: too little traffic to fit to): 64, 32, 16, 8, 4, 2, 1\n"
    ) in out
    assert "\nset: FD_CUDAGRAPH_FIT" not in out  # nothing it would change: nothing to set


#: The stats line of docs/tools.md: 59 steps, a deployed list and max_num_seqs.
STATS_LINE_WITH_DEPLOYMENT = json.dumps(
    {
        "format": STATS_FORMAT,
        "time": 1767225600.5,
        "rank": 0,
        "backend": "7f3a2c",
        "decode_token_counts": {"3": 40, "5": 10, "17": 6, "30": 2, "80": 1},
        "capture_sizes": [64, 32, 16, 8, 4, 2, 1],
        "max_num_seqs": 64,
    }
)


def test_fit_under_speculative_decoding_fits_running_requests_each_k_plus_1_tokens(
    tmp_path, capsys
):
    """Keys are running requests and a size holds size // (k + 1) of them, as the session fits
    (session.CaptureSession._fit): candidates 8, 4, 2, 1 requests of FastDeploy's 24, 12, 6, 3
    tokens, each padded request 3 tokens."""
    from fd_cudagraph_plugin.core.fit import Budget, fit

    counts = [1] * 200 + [3] * 100 + [6] * 30
    argv = [_fit_trace(tmp_path, counts), "--max-num-seqs", "8", "--fit", "graphs:2"]
    argv += speculative_config(method="mtp", num_speculative_tokens=2)
    expected = fit(Counter(counts), [24 // 3, 12 // 3, 6 // 3, 3 // 3], Budget(graphs=2), 3)
    fitted = _tune_json(argv, capsys)["fit"]
    assert fitted["fastdeploy_capture_sizes"] == [8, 4, 2, 1]
    assert fitted["capture_sizes"] == list(expected.sizes) == [8, 1]
    # 100 steps of 3 requests and 30 of 6 pad to 8: (5 x 100 + 2 x 30) x 3 tokens.
    assert fitted["padded_tokens"] == expected.padded == (500 + 60) * 3
    assert main(["tune", *argv]) == 0
    assert "on the same 330 steps up to 8 running requests" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("launch", "said"),
    [
        (graph_config(graph_opt_level=1), "this is static full mode"),
        (graph_config(graph_opt_level=1, full_cuda_graph=False), "this is static split mode"),
    ],
    ids=["static full", "static split"],
)
def test_fit_outside_dynamic_mode_says_the_option_changes_nothing(launch, said, tmp_path, capsys):
    argv = [_fit_trace(tmp_path), "--max-num-seqs", "64", "--fit", "graphs:3", *launch]
    fitted = _tune_json(argv, capsys)["fit"]
    assert said in fitted["changes_nothing"]
    assert fitted["capture_sizes"] == fitted["fastdeploy_capture_sizes"]
    assert main(["tune", *argv]) == 0
    out = capsys.readouterr().out
    assert f"fit      (FD_CUDAGRAPH_FIT=graphs:3): changes nothing for this launch: {said}" in out
    assert "\nset: FD_CUDAGRAPH_FIT" not in out


@pytest.mark.parametrize("value", ["graphs:0", "graphs:x", "padding:2000", "8", "-3", "fit"])
def test_a_bad_fit_is_one_line_naming_the_option_and_its_forms(value, capsys):
    from fd_cudagraph_plugin.tools.wording import shown

    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "-", "--fit", value])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fd-cudagraph tune: argument --fit: must be off, graphs:N")
    assert "padding:P" in line and f"; got {shown(value)}. See fd-cudagraph tune --help." in line
