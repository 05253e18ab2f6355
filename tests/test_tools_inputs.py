"""What a user types into ``fd-cudagraph`` is bounded, and a bad value gets one clear line.

The line names the option, echoes the value (shortened when huge) and says the bound or the fix;
nothing is run and no traceback is printed. The parser is exercised directly where the old
behaviour was to run (a demo of 3,000,000,000 tokens grew to 23.7 GB before it was killed).
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import graph_config, speculative_config

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools.cli import build_parser, main
from fd_cudagraph_plugin.tools.demo import format_report, run_demo
from fd_cudagraph_plugin.tools.traces import TraceError, read_histogram
from fd_cudagraph_plugin.tools.tune import format_result, tune
from fd_cudagraph_plugin.tools.wording import plural, shown

REPO = Path(__file__).resolve().parent.parent
HUGE = "1" * 5000

UNBOUNDED = [
    # (argv, what the one error line must hold)
    (["demo", "--sizes", "3000000000"], ["--sizes", "3000000000", "above 512"]),
    (["demo", "--sizes", "99999999999999999999"], ["--sizes", "above 512"]),
    (["demo", "--sizes", "1,2,513"], ["--sizes", "513", "above 512"]),
    (["demo", "--sizes", HUGE], ["--sizes", "(5000 digits)", "above 512"]),
    (["demo", "--steps", "1000001"], ["--steps", "in 1..1000000", "1000001"]),
    (["demo", "--steps", "9" * 40], ["--steps", "in 1..1000000", "(40 digits)"]),
    (["demo", "--steps", HUGE], ["--steps", "in 1..1000000", "(5000 digits)"]),
    (["demo", "--seed", HUGE], ["--seed", "0..4294967295", "(5000 digits)"]),
    (["demo", "--seed", "-1"], ["--seed", "0..4294967295", "got -1"]),
    (["tune", "-", "--max-graphs", HUGE], ["--max-graphs", "in 1..512", "(5000 digits)"]),
    (["tune", "-", "--max-graphs", "1", "--max-size", HUGE], ["--max-size", "in 1..512"]),
]


@pytest.mark.parametrize(("argv", "wanted"), UNBOUNDED, ids=lambda v: " ".join(v)[:40])
def test_every_size_and_count_is_bounded_with_one_line_naming_option_and_bound(
    argv, wanted, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(part in error for part in wanted), error
    assert len(error) < 300, error


def _huge(key: str) -> str:
    """A JSON object whose ``key`` holds the 5000-digit integer (past what Python converts)."""
    value = f"[{HUGE}]" if key == "cudagraph_capture_sizes" else HUGE
    method = '"method": "mtp", ' if key == "num_speculative_tokens" else ""
    return f'{{{method}"{key}": {value}}}'


UNBOUNDED_LAUNCH = [
    # (FastDeploy's launch line, what the one error line must hold)
    (
        ["--graph-optimization-config", _huge("cudagraph_capture_sizes")],
        ["--graph-optimization-config", "cudagraph_capture_sizes", "(5000 digits)", "2147483647"],
    ),
    (["--max-num-seqs", HUGE], ["--max-num-seqs", "in 1..512", "(5000 digits)"]),
    (
        ["--speculative-config", _huge("num_speculative_tokens")],
        ["--speculative-config", "num_speculative_tokens", "(5000 digits)", "..5"],
    ),
    (["--tensor-parallel-size", HUGE], ["--tensor-parallel-size", "in 1..512", "(5000 digits)"]),
    (
        ["--graph-optimization-config", _huge("max_capture_shape_prefill")],
        ["max_capture_shape_prefill", "1..65536", "(5000 digits)"],
    ),
    (
        ["--graph-optimization-config", _huge("graph_opt_level")],
        ["graph_opt_level", "in 0..2", "(5000 digits)"],
    ),
]


@pytest.mark.parametrize("release", ["2.6", "develop"], ids=["copy", "FastDeploy's parser"])
@pytest.mark.parametrize(
    ("launch", "wanted"),
    UNBOUNDED_LAUNCH,
    ids=["sizes", "max_num_seqs", "k", "tp", "prefill shape", "graph_opt_level"],
)
def test_every_launch_line_size_and_count_is_bounded_with_one_short_line(
    launch, wanted, release, capsys
):
    """Read by the small parser (2.6 here) or by the stand-in FastDeploy's own (develop): one line
    naming the setting and its bound, the value shortened. Where FastDeploy's parser refuses the
    value itself, the line is its refusal, the value shortened all the same."""
    assert main(["plan", "--fastdeploy-version", release, *launch]) == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert HUGE not in error, error[:300]
    if "own parser refuses this launch line" not in error:
        assert all(part in error for part in wanted), error
    assert len(error) < 300, error


def test_a_size_list_with_an_empty_or_wrong_entry_is_refused_saying_which(capsys):
    """``--sizes 1,,2`` used to be read as 1,2: a setting FastDeploy would not take."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--sizes", "1,,2"])
    assert exit_info.value.code == 2
    assert "entry 2 of '1,,2' is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "wanted"),
    [
        ('{"cudagraph_capture_sizes": [1,,2]}', "is not valid JSON (Expecting value at column 32)"),
        ('{"cudagraph_capture_sizes": [1,2,]}', "is not valid JSON (Expecting value at column 34)"),
        (
            '{"cudagraph_capture_sizes_prefill": [,8]}',
            "is not valid JSON (Expecting value at column 38)",
        ),
        (
            '{"cudagraph_capture_sizes": [1, "x"]}',
            "each cudagraph_capture_sizes entry must be an integer in 1..2147483647; got 'x'.",
        ),
        # A string FastDeploy would keep as a string in its list of sizes.
        (
            '{"cudagraph_capture_sizes": [1, "8"]}',
            "each cudagraph_capture_sizes entry must be an integer in 1..2147483647; got ",
        ),
    ],
)
def test_a_json_size_list_with_an_empty_or_wrong_entry_is_refused_saying_which(
    value, wanted, capsys
):
    """Read by the small parser (the stand-in's own refuses what it cannot load: test_plan.py)."""
    argv = ["plan", "--fastdeploy-version", "2.6", "--graph-optimization-config", value]
    assert main(argv) == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith("fd-cudagraph: --graph-optimization-config") and wanted in error


@pytest.mark.parametrize("release", ["2.6", "develop"], ids=["copy", "FastDeploy's parser"])
def test_a_5000_digit_size_is_called_too_large_not_a_non_integer(release, capsys):
    """Read by the small parser the size is called too large for its bound; FastDeploy's own
    parser (the stand-in's, develop) cannot load such JSON and refuses the line, and that
    refusal is shortened as any echo of a value is."""
    argv = ["plan", "--fastdeploy-version", release]
    assert main_exit([*argv, *graph_config(cudagraph_capture_sizes=[int(HUGE[:4000])])]) == 2
    assert "(4000 digits)" in capsys.readouterr().err  # within what json.loads takes
    assert main_exit([*argv, "--graph-optimization-config", _huge("cudagraph_capture_sizes")]) == 2
    err = capsys.readouterr().err
    assert HUGE not in err and err.count("\n") == 1 and len(err) < 300, err[:300]
    if release == "develop":
        assert "FastDeploy 2.6.0's own parser refuses this launch line" in err
    else:
        assert "not valid JSON" not in err and "sys.set_int_max_str_digits" not in err
        assert "111111111111111111111111... (5000 digits)" in err and "2147483647" in err


def main_exit(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


@pytest.mark.parametrize(
    "kwargs",
    [{"sizes": [513]}, {"sizes": [0]}, {"steps": 0}, {"seed": -1}, {"sizes": [True]}],
    ids=str,
)
def test_run_demo_refuses_what_the_command_line_refuses(kwargs):
    with pytest.raises(ConfigError, match=r"--(sizes|steps|seed) must be"):
        run_demo(runtime_name="simulated", **{"steps": 1, **kwargs})


def test_values_are_echoed_shortened_past_24_characters():
    assert shown(7) == "7" and shown("x") == "'x'" and shown("-5") == "-5"
    assert shown(int("9" * 30)) == "9" * 24 + "... (30 digits)"
    assert shown("a" * 100) == repr("a" * 24) + "... (100 characters)"
    assert plural(1, "step") == "1 step" and plural(2, "mismatch", "mismatches") == "2 mismatches"


def test_demo_output_says_1_step_1_token_not_1_steps():
    report = run_demo(sizes=[1], steps=1, seed=0, runtime_name="simulated")
    text = format_report(report)
    assert "served 1 decode step:" in text and "largest size, 1 token," in text
    assert "0 mismatches in 1 step --" in text
    assert "1 steps" not in text and "1 tokens" not in text


def test_demo_output_says_1_mismatch():
    report = run_demo(sizes=[1, 2], steps=3, seed=0, runtime_name="simulated")
    report.mismatches = 1
    assert "1 mismatch in 3 steps -- MISMATCH" in format_report(report)


@pytest.mark.parametrize(
    ("histogram", "max_size", "wanted"),
    [
        ({1: 1}, None, "decode steps: 1 with 1 token\n"),
        ({3: 2, 200: 1}, 64, "left out (FastDeploy runs them eagerly): 1 step above 64 tokens"),
        ({1: 1, 9: 1}, 1, "1 step above 1 token, 0 steps with 0 tokens"),
    ],
)
def test_tune_output_says_1_step_and_1_token(histogram, max_size, wanted):
    text = format_result(tune(histogram, 2, max_size, fastdeploy_version="develop"))
    assert wanted in text, text


def _actions(parser: argparse.ArgumentParser, name: str = "fd-cudagraph"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions if choice.help}
            assert helped == set(action.choices), f"{name}: subcommands without help"
            for sub_name, sub in action.choices.items():
                yield from _actions(sub, f"{name} {sub_name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


OPTIONS = list(_actions(build_parser()))


@pytest.mark.parametrize(("command", "action"), OPTIONS, ids=[f"{c} {a.dest}" for c, a in OPTIONS])
def test_every_option_of_every_subcommand_has_help_that_states_its_default(command, action):
    """A value option says its default (or that it is required); a flag that is on by default
    says so. ``--seed``, ``--spec-method`` and ``--graph-opt-level`` had no help at all."""
    assert action.help, f"{command} {action.option_strings or action.dest}: no help text"
    if not action.option_strings:
        return
    text = action.help.lower()
    takes_value = action.nargs != 0
    if takes_value and not action.required:
        assert "default" in text, f"{command} {action.option_strings[0]}: default not said"
        if action.default is not None:
            assert str(action.default).lower() in text, action.help
    if not takes_value and action.default not in (False, None):
        assert "default" in text, f"{command} {action.option_strings[0]}: default not said"
    if action.required:
        assert "required" in text


def test_demo_sizes_help_names_the_default_list():
    sizes = next(action for command, action in OPTIONS if action.dest == "sizes")
    assert "default 1,2,4,8,16,24,32" in sizes.help


def test_check_count_echoes_a_huge_value_shortened():
    from fd_cudagraph_plugin.tools.plan import check_count

    with pytest.raises(ConfigError) as error:
        check_count("--max-num-seqs", int("9" * 4000), 1, 512)
    assert "(4000 digits)" in str(error.value) and len(str(error.value)) < 120


def test_tune_with_standard_input_closed_exits_2_with_one_line():
    """``fd-cudagraph tune - <&-`` ended in AttributeError: Python has no sys.stdin then."""
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "tune", "-", "--max-graphs", "2"],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: os.close(0),
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "fd-cudagraph: standard input is closed, so - has nothing to read; pass a trace file, or "
        "pipe a trace into fd-cudagraph tune -."
    ]
    assert done.stdout == b""


def test_tune_reports_a_read_error_on_standard_input_as_such(tmp_path):
    """An error reading - is the input's, not "cannot write the output" (exit 1)."""

    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(TraceError, match=r"^cannot read standard input: Input/output error\.$"):
        read_histogram(["-"], stdin=io.BufferedReader(Failing()))


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "naive"])
@pytest.mark.parametrize("draft", [True, False])
def test_plan_refuses_draft_model_use_cudagraph_without_an_mtp_draft_model(method, draft, capsys):
    """Only an MTP draft model reads draft_model_use_cudagraph, in every release."""
    spec = speculative_config(method=method) if method else []
    assert main(["plan", *spec, *graph_config(draft_model_use_cudagraph=draft)]) == 2
    err = capsys.readouterr().err
    setting = f"--graph-optimization-config draft_model_use_cudagraph {str(draft).lower()}"
    assert err.startswith(f"fd-cudagraph: {setting}: only an MTP draft model reads it")
    given = f"method {method}" if method else "no method"
    assert f"with {given} in --speculative-config FastDeploy builds no draft model" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("draft", [True, False])
def test_plan_takes_draft_model_use_cudagraph_with_mtp(draft, capsys):
    mtp = speculative_config(method="mtp")
    assert main(["plan", *mtp, *graph_config(draft_model_use_cudagraph=draft)]) == 0
    assert "total graphs:" in capsys.readouterr().out
