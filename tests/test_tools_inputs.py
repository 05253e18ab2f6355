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
    (["plan", "--capture-sizes", HUGE], ["--capture-sizes", "(5000 digits)", "2147483647"]),
    (["plan", "--max-num-seqs", HUGE], ["--max-num-seqs", "in 1..512", "(5000 digits)"]),
    (["plan", "--num-speculative-tokens", HUGE], ["--num-speculative-tokens", "in 1..5"]),
    (["plan", "--tensor-parallel-size", HUGE], ["--tensor-parallel-size", "in 1..512"]),
    (["plan", "--max-capture-shape-prefill", HUGE], ["--max-capture-shape-prefill", "65536"]),
    (["plan", "--graph-opt-level", HUGE], ["--graph-opt-level", "in 0..2"]),
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


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["plan", "--capture-sizes", "1,,2"], "entry 2 of '1,,2' is empty"),
        (["plan", "--capture-sizes", "1,2,"], "entry 3 of '1,2,' is empty"),
        (["plan", "--capture-sizes-prefill", ",8"], "entry 1 of ',8' is empty"),
        (["demo", "--sizes", "1,,2"], "entry 2 of '1,,2' is empty"),
        (["plan", "--capture-sizes", "1,x"], "entry 2, 'x', is not an integer"),
    ],
)
def test_a_size_list_with_an_empty_or_wrong_entry_is_refused_saying_which(argv, wanted, capsys):
    """``--capture-sizes 1,,2`` used to be read as 1,2: a setting FastDeploy would not take."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert wanted in capsys.readouterr().err


def test_a_5000_digit_size_is_called_too_large_not_a_non_integer(capsys):
    assert main_exit(["plan", "--capture-sizes", HUGE]) == 2
    err = capsys.readouterr().err
    assert "comma-separated integers" not in err and HUGE not in err
    assert "size 111111111111111111111111... (5000 digits) is above 2147483647" in err


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
        elif action.help == argparse.SUPPRESS:
            # FastDeploy's launch flags that change nothing captured: taken, named in a note,
            # and left out of --help (test_engine_args.py).
            continue
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
@pytest.mark.parametrize("flag", ["--draft-model-use-cudagraph", "--no-draft-model-use-cudagraph"])
def test_plan_refuses_draft_model_use_cudagraph_without_an_mtp_draft_model(method, flag, capsys):
    """Only an MTP draft model reads draft_model_use_cudagraph, in every release."""
    spec = ["--spec-method", method] if method else []
    assert main(["plan", *spec, flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fd-cudagraph: {flag} sets draft_model_use_cudagraph")
    given = f"--spec-method {method}" if method else "no --spec-method"
    assert f"with {given} FastDeploy builds no draft model and ignores it" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--draft-model-use-cudagraph", "--no-draft-model-use-cudagraph"])
def test_plan_takes_draft_model_use_cudagraph_with_mtp(flag, capsys):
    assert main(["plan", "--spec-method", "mtp", flag]) == 0
    assert "total graphs:" in capsys.readouterr().out
