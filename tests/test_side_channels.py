"""Serving never depends on stderr: a closed, full or missing stderr leaves capture and the
demo's serving untouched (the progress bar and the log handlers count their failures)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Beside

STDERRS = ["2>&-", "2>/dev/full"]


def _demo(folder: Path, stderr: str) -> subprocess.CompletedProcess:
    command = f"{sys.executable} -m fd_cudagraph_plugin demo --steps 3 {stderr}"
    env = {**os.environ, "FD_LOG_DIR": str(folder)}
    return subprocess.run(
        ["bash", "-c", command],
        capture_output=False,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        timeout=300,
        cwd=folder,
    )


def start_early(tmp_path_factory) -> Beside:
    """Each demo runs beside the in-process tests (conftest.py)."""
    return Beside(
        {e: functools.partial(_demo, tmp_path_factory.mktemp("demo"), e) for e in STDERRS}
    )


@pytest.mark.parametrize("stderr", STDERRS)
def test_the_demo_captures_and_serves_with_stderr_closed_or_full(started, stderr):
    # Before: with stderr closed the progress bar raised AttributeError ('NoneType' object has
    # no attribute 'write') out of the capture; on /dev/full the demo exited 1 and said nothing.
    done = started[stderr].result()
    assert done.returncode == 0
    assert "replay vs eager: 0 mismatches in 3 steps -- OK" in done.stdout


def _capture_three_sizes() -> None:
    from conftest import Buffers, TinyBackbone, make_config

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend
    from fd_cudagraph_plugin.core.session import CaptureSession

    model = TinyBackbone()
    config = make_config(4, cudagraph_capture_sizes=[4, 2, 1])
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    with CaptureSession("decode"):
        for size in (4, 2, 1):
            backend(**buffers.step(size))
    backend.check_capture_successful()


class FullStderr:
    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize(("stderr", "failed"), [(None, 0), (FullStderr(), 1)], ids=["None", "full"])
def test_a_capture_session_captures_whatever_stderr_does(sim, monkeypatch, stderr, failed):
    """None is what Python sets when fd 2 is closed: no bar at all. A bar that cannot write is
    counted once and never drawn again."""
    from fd_cudagraph_plugin.core import process

    monkeypatch.setattr(sys, "stderr", stderr)
    _capture_three_sizes()
    assert process.current().outputs.counts["progress bar"] == failed
