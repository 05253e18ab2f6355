"""The demo's surroundings: the options it is given, the files it writes, the signals it gets."""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Beside

from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.demo import format_report, run_demo

REPO = Path(__file__).resolve().parent.parent


def _env_without(*names: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in names and "FD_CUDAGRAPH_" not in k}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.parametrize("environment", [{}, {"FD_CUDAGRAPH_RUNTIME": "simulated"}])
def test_demo_runtime_cuda_without_cuda_names_the_flag_and_suggests_runtime_simulated(
    environment, monkeypatch, capsys
):
    """It used to say FD_CUDAGRAPH_RUNTIME=cuda and suggest --graph-optimization-config, which
    the demo does not take."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(["demo", "--runtime", "cuda", "--steps", "1", "--sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fd-cudagraph: --runtime cuda: this Paddle is not compiled with CUDA")
    assert "pass --runtime simulated" in err and err.count("\n") == 1
    assert "FD_CUDAGRAPH_RUNTIME=cuda" not in err and "--graph-optimization-config" not in err


def test_demo_takes_its_runtime_from_fd_cudagraph_runtime_and_says_so(monkeypatch):
    monkeypatch.setenv("FD_CUDAGRAPH_RUNTIME", "simulated")
    text = format_report(run_demo(sizes=[1, 2], steps=2))
    assert text.startswith("runtime: simulated (FD_CUDAGRAPH_RUNTIME=simulated) -- graphs run")
    assert "this Paddle has no CUDA" not in text


def test_demo_runtime_simulated_asked_for_does_not_blame_paddle():
    text = format_report(run_demo(sizes=[1, 2], steps=2, runtime_name="simulated"))
    assert text.startswith("runtime: simulated (--runtime simulated) -- graphs run")


def test_demo_with_fd_cudagraph_runtime_cuda_without_cuda_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("FD_CUDAGRAPH_RUNTIME", "cuda")
    assert main(["demo", "--steps", "1", "--sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "FD_CUDAGRAPH_RUNTIME=cuda: this Paddle is not compiled with CUDA" in err
    assert "pass --runtime simulated (or unset FD_CUDAGRAPH_RUNTIME)" in err


@pytest.mark.parametrize(
    ("name", "value", "wanted"),
    [
        ("FD_CUDAGRAPH_BACKEND", "native", "FD_CUDAGRAPH_BACKEND=native: the demo always runs"),
        ("FD_CUDAGRAPH_RUNTIM", "simulated", "did you mean FD_CUDAGRAPH_RUNTIME?"),
        ("FD_CUDAGRAPH_SELFCHECK", "warn", "did you mean FD_CUDAGRAPH_SELF_CHECK?"),
        ("FD_CUDAGRAPH_POOL", "device", "FD_CUDAGRAPH_POOL=device was removed"),
    ],
)
def test_demo_refuses_options_it_would_ignore_naming_the_variable(
    name, value, wanted, monkeypatch, capsys
):
    monkeypatch.setenv(name, value)
    assert main(["demo", "--runtime", "simulated", "--steps", "1", "--sizes", "1"]) == 2
    out, err = capsys.readouterr()
    assert wanted in err and err.count("\n") == 1 and out == ""


def _sigterm_while_serving(folder: Path) -> tuple[int | None, bytes, bytes, bytes]:
    """The demo, sent SIGTERM once it serves: its exit code, what it showed before, its output."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "fd_cudagraph_plugin", "demo", "--steps", "1000000"],
        cwd=folder,
        env=_env_without("FD_LOG_DIR"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    seen = b""
    deadline = time.monotonic() + 120
    # Serving has begun once its progress bar is shown, after the capture's.
    while b"demo: served:" not in seen and time.monotonic() < deadline and demo.poll() is None:
        ready, _, _ = select.select([demo.stderr], [], [], 1)
        if ready:
            seen += os.read(demo.stderr.fileno(), 65536)
    demo.send_signal(signal.SIGTERM)
    out, err = demo.communicate(timeout=60)
    return demo.returncode, seen, out, err


def test_sigterm_ends_the_demo_with_143_and_no_traceback(started):
    """Paddle's import installs a C++ SIGTERM handler that prints a C++ traceback to stdout."""
    (code, seen, out, err), folder = started["sigterm"].result()
    assert b"100%" in seen and b"demo: served:" in seen, seen[-2000:]
    assert code == 143, (out + err)[-2000:]
    assert b"Traceback" not in out + err and b"Termination signal" not in out + err
    assert out == b""
    assert sorted(p.name for p in folder.iterdir()) == []


def test_a_long_demo_shows_progress_and_its_rate_on_standard_error(capsys):
    """``demo --steps 100000`` ran 4.5 minutes without a word."""
    run_demo(sizes=[1, 2], steps=40, runtime_name="simulated")
    err = capsys.readouterr().err
    assert "demo: served: 100%" in err and "40/40" in err and "step/s" in err


def _tool(folder: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", *argv],
        cwd=folder,
        env={**_env_without("FD_LOG_DIR"), **env},
        input="3\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_demo_error_is_one_line_without_paddles_warnings(started):
    """Paddle's ccache warning made each demo error three lines."""
    done, _ = started["demo error"].result()
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("fd-cudagraph: --runtime cuda: this Paddle is not compiled with CUDA")


TOOLS = {
    "plan": ["plan"],
    "tune": ["tune", "-"],
    "doctor": ["doctor"],
    "demo": ["demo", "--steps", "3", "--sizes", "1,2"],
}


@pytest.mark.parametrize("tool", TOOLS)
def test_no_tool_leaves_anything_in_tmpdir_or_the_current_directory(started, tool):
    """The demo's capture session records graph memory under FD_LOG_DIR, FastDeploy's default
    log, never under the current directory; no tool leaves a temporary file."""
    done, folder = started[tool].result()
    assert done.returncode in ((0,) if tool == "demo" else (0, 1)), done.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["tmp"]
    assert list((folder / "tmp").iterdir()) == []


def _in(folder: Path, call, *args, **kwargs):
    """``call``'s result and the folder it ran in."""
    return call(folder, *args, **kwargs), folder


def _with_tmpdir(folder: Path, argv: list[str]):
    (folder / "tmp").mkdir()
    return _in(folder, _tool, *argv, TMPDIR=str(folder / "tmp"))


def start_early(tmp_path_factory) -> Beside:
    """The processes of this file run beside the in-process tests (conftest.py), each in an
    empty folder of its own."""

    def folder() -> Path:
        return tmp_path_factory.mktemp("demo-env")

    calls = {
        "sigterm": functools.partial(_in, folder(), _sigterm_while_serving),
        "demo error": functools.partial(_in, folder(), _tool, "demo", "--runtime", "cuda"),
    }
    for tool, argv in TOOLS.items():
        calls[tool] = functools.partial(_with_tmpdir, folder(), argv)
    return Beside(calls)
