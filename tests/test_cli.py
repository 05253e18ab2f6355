"""``fd-cudagraph`` follows command-line conventions: usage errors, signals, pipes, help text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fd_cudagraph_plugin import __version__
from fd_cudagraph_plugin.tools.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent


def _run(*argv: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
        check=False,
    )


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fd-cudagraph {__version__}"


@pytest.mark.parametrize("steps", ["-5", "0", "many"])
def test_demo_with_a_bad_step_count_is_a_usage_error(steps, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", steps])
    assert exit_info.value.code == 2
    assert "--steps: must be an integer in 1..1000000 (the demo's limit)" in capsys.readouterr().err


def test_doctor_json_lists_every_check(capsys):
    code = main(["doctor", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert document["exit_code"] == code
    assert {"name", "status", "detail", "fix"} <= set(document["checks"][0])


def _texts(parser) -> list[str]:
    texts = [parser.format_help()]
    for action in parser._actions:
        for sub in getattr(action, "choices", None) or {}:
            if hasattr(action.choices[sub], "format_help"):
                texts.append(action.choices[sub].format_help())
    return texts


def test_help_is_plain_text_without_rest_markup():
    for text in _texts(build_parser()):
        assert "``" not in text


def test_closed_stdout_ends_without_a_traceback():
    reader = subprocess.Popen(
        [sys.executable, "-m", "fd_cudagraph_plugin", "plan", "--max-num-seqs", "512", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    reader.stdout.close()  # the reader went away, as `| head -0` does
    _, err = reader.communicate()
    assert reader.returncode == 1
    assert b"Traceback" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_stdout_ends_without_a_traceback():
    with open("/dev/full", "w") as full:
        done = _run("plan", "--max-num-seqs", "8", stdout=full)
    assert done.returncode == 1
    assert b"No space left on device" in done.stderr and b"Traceback" not in done.stderr


def test_ctrl_c_exits_130_without_a_traceback():
    reader = subprocess.Popen(
        [sys.executable, "-m", "fd_cudagraph_plugin", "tune", "-", "--max-graphs", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    reader.stdin.write(b"3\n")
    reader.stdin.flush()
    # Wait until the process is reading standard input, i.e. inside main(), then interrupt it.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{reader.pid}/wchan")
        if stat.exists() and "pipe" in stat.read_text():
            break
        time.sleep(0.05)
    reader.send_signal(signal.SIGINT)
    _, err = reader.communicate(timeout=60)
    assert reader.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err


@pytest.mark.parametrize(
    "argv", [["plan"], ["doctor"], ["tune", "-", "--max-graphs", "1"]], ids=lambda a: a[0]
)
def test_started_with_stdout_closed_exits_2_with_one_line_and_no_traceback(argv):
    """``fd-cudagraph plan >&-``: Python has no sys.stdout then; the command's result goes nowhere
    (bad input is said as such: ``test_with_stdout_closed_bad_input_is_said_as_such``)."""
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", *argv],
        input=b"5\n",
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: os.close(1),
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "fd-cudagraph: standard output is closed; nothing to write the result to. Redirect it "
        "to a file or /dev/null instead."
    ]


#: A ``paddle`` that is interrupted while it imports: as Paddle's bare ``except:`` clauses do,
#: it swallows the KeyboardInterrupt and then fails to import; or it lets it through.
FAKE_PADDLE = """
import os, signal
try:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100000):
        pass
except {caught}:
    pass
raise ImportError("libpaddle.so: cannot open shared object file")
"""


@pytest.mark.parametrize("caught", ["BaseException", "ImportError"], ids=["swallowed", "raised"])
@pytest.mark.parametrize("command", [["demo"], ["doctor"]], ids=lambda c: c[0])
def test_ctrl_c_while_paddle_imports_is_an_interrupt_not_a_missing_paddle(
    command, caught, tmp_path
):
    package = tmp_path / "paddle"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_PADDLE.format(caught=caught))
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", *command],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        timeout=120,
        check=False,
    )
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "fd-cudagraph: interrupted while Paddle was loading"
    ]
    assert "paddle" not in done.stdout.lower()


@pytest.mark.parametrize("error", ["ImportError", "ModuleNotFoundError"])
def test_demo_without_paddle_says_what_to_install_and_no_name_from_an_index(error, tmp_path):
    """The plugin is not on PyPI: the advice installs Paddle, or the demo extra of a checkout."""
    package = tmp_path / "paddle"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise {error}('No module named paddle.base')\n")
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "demo"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install paddlepaddle==3.3.1" in done.stderr
    assert "pip install 'fd-cudagraph-plugin" not in done.stderr
    assert "'/path/to/fd-cudagraph-plugin[demo]'" in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["plan", "--help"]], ids=" ".join)
def test_help_and_version_exit_1_when_stdout_is_full(argv):
    """argparse swallowed the write error of --help and --version and exited 0."""
    with open("/dev/full", "w") as full:
        done = _run(*argv, stdout=full)
    assert done.returncode == 1
    assert done.stderr.decode().splitlines() == [
        "fd-cudagraph: cannot write the output: No space left on device"
    ]


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["tune", "--help"]], ids=" ".join)
def test_help_and_version_exit_1_when_the_reader_is_gone(argv):
    reader = subprocess.Popen(
        [sys.executable, "-m", "fd_cudagraph_plugin", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    reader.stdout.close()  # the reader went away before the help was written
    _, err = reader.communicate(timeout=60)
    assert reader.returncode == 1
    assert b"Traceback" not in err


@pytest.mark.parametrize(
    ("command", "stdin"),
    [
        ("plan --json --max-num-seqs -5", None),
        ("tune - --max-graphs 2", ""),
        ("bogus", None),
    ],
)
def test_an_error_with_stderr_closed_never_lands_in_the_output(command, stdin):
    # Python sets sys.stderr to None when fd 2 is closed, and print(file=None) writes to stdout:
    # a script reading --json got the error line instead.
    done = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m fd_cudagraph_plugin {command} 2>&-"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""


def test_bad_input_exits_2_even_when_its_message_cannot_be_written():
    done = subprocess.run(
        [
            "bash",
            "-c",
            f"{sys.executable} -m fd_cudagraph_plugin plan --max-num-seqs -5 2>/dev/full",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2


def test_with_stdout_closed_bad_input_is_said_as_such():
    done = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m fd_cudagraph_plugin plan --max-num-seqs -5 >&-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--max-num-seqs must be an integer in 1..512; got -5." in done.stderr
    assert "standard output is closed" not in done.stderr


@pytest.mark.parametrize("value", ["513", "99999999999999999999"])
def test_tune_max_graphs_is_bounded_as_its_help_says(value):
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "tune", "-", "--max-graphs", value],
        input="5\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--max-graphs: must be an integer in 1..512" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "-", "--max-graphs", "abc"],
        ["bogus"],
        ["demo", "--bogus"],
        ["plan", "--fastdeploy-version"],
        ["tune"],
    ],
)
def test_a_usage_error_is_one_line_that_says_where_the_usage_is(argv):
    """A usage error of the tools' own options. (plan's other words are FastDeploy's launch line,
    whose bad values are the next test's.)"""
    # Before: argparse's usage block, 15 lines for plan, then the error.
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("fd-cudagraph") and line.endswith("--help.")


def test_a_bad_launch_line_value_is_one_line_naming_the_flag_and_its_bound():
    done = subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "plan", "--max-num-seqs", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "fd-cudagraph: --max-num-seqs must be an integer in 1..512; got 'abc'."
    ]
