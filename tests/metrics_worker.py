"""Plays a FastDeploy worker for the multiprocess metrics test (run as a script).

Usage: metrics_worker.py; PROMETHEUS_MULTIPROC_DIR must be set by the caller, as FastDeploy's
engine sets it for its workers, before prometheus_client is imported. Serves scripted steps on
the simulated runtime, publishes the metrics as the reporter thread does, serves more, and exits
normally (the exit handler publishes the rest). Prints the backend's final ``stats()`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fastdeploy_stub"))
os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"
os.environ["FD_CUDAGRAPH_METRICS"] = "1"


def main() -> int:
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"]
    from conftest import Buffers, TinyBackbone, make_config

    from fd_cudagraph_plugin.core import observability, process
    from fd_cudagraph_plugin.core.backend import CudaGraphBackend
    from fd_cudagraph_plugin.core.ranks.link import LocalLink
    from fd_cudagraph_plugin.core.session import CaptureSession

    config = make_config(8, cudagraph_capture_sizes=[4, 2, 1], tp=2)
    config.parallel_config.tensor_parallel_rank = 1
    config.parallel_config.data_parallel_size = 4
    config.parallel_config.data_parallel_rank = 3
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    buffers = Buffers()
    # capture_model(): a session of this rank alone (the rank agreement is test_collective's).
    with CaptureSession("decode", fd_config=config, link=LocalLink()):
        for size in backend.cudagraph_capture_sizes:
            backend(**buffers.step(size))
    for tokens in (3, 3, 1, 0, 6):
        backend(**buffers.step(tokens))
    # What the reporter thread runs every few seconds.
    observability.publish_metrics(process.current())
    for tokens in (4, 2, 3):
        backend(**buffers.step(tokens))
    print(json.dumps(backend.stats()))
    _alive.append(backend)  # as FastDeploy's model runner holds it until the process exits
    return 0  # the exit handler publishes the steps since the last publish


_alive: list[object] = []


if __name__ == "__main__":
    sys.exit(main())
