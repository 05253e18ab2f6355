"""Capture sessions whatever builds the first backend: the hooks follow the runner's import.

A worker whose first backend is built inside ``capture_model()`` (no memory-profile run before it)
must still capture in a session. Each case runs in a fresh interpreter because what matters is
the import order of a real worker: FastDeploy loads plugins (so calls ``register()``) while
``gpu_model_runner`` is still being imported, or before it is imported at all.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Beside

TESTS = Path(__file__).resolve().parent

WORKER = """
import json, sys
from pathlib import Path
tests = Path(sys.argv[1])
sys.path[:0] = [str(tests), str(tests / "fastdeploy_stub")]
import importlib
importlib.import_module(sys.argv[2])  # what the worker imports first loads the plugins
from conftest import DecoratedBackbone, make_config
from fastdeploy.worker.gpu_model_runner import GPUModelRunner
from fd_cudagraph_plugin.core import process

config = make_config(4)
model = DecoratedBackbone(fd_config=config)
GPUModelRunner(config, model).capture_model()  # no profile_run: the backend is built here
backend = model.graph_opt_backend.cudagraph_piecewise_backend
report = backend.capture_report
print(json.dumps({
    "sessions": process.current().sessions_ended,
    "phase": None if report is None else report.phase,
    "report_sizes": None if report is None else [r.size for r in report.records],
}))
"""


FIRST_IMPORTS = [
    # FastDeploy's order: gpu_model_runner imports the models package, which loads plugins.
    "fastdeploy.worker.gpu_model_runner",
    # Plugins loaded before the runner module exists (a loader imported the models first).
    "fastdeploy.model_executor.models",
]


def _worker(folder: Path, first_import: str) -> tuple[subprocess.CompletedProcess, Path]:
    report_path = folder / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "FD_PLUGINS": "fd_cudagraph_plugin",
        "FD_CUDAGRAPH_RUNTIME": "simulated",
        "FD_CUDAGRAPH_MEMORY_REPORT": str(report_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(TESTS), first_import],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, report_path


def start_early(tmp_path_factory) -> Beside:
    """Each fresh interpreter runs beside the in-process tests (conftest.py)."""
    return Beside(
        {
            name: functools.partial(_worker, tmp_path_factory.mktemp("hooks"), name)
            for name in FIRST_IMPORTS
        }
    )


@pytest.mark.parametrize("first_import", FIRST_IMPORTS)
def test_first_backend_built_inside_capture_model_still_captures_in_a_session(
    started, first_import
):
    done, report_path = started[first_import].result()
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {"sessions": 1, "phase": "decode", "report_sizes": [4, 2, 1]}
    assert json.loads(report_path.read_text())["graphs"] == 3
