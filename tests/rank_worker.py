"""One tensor-parallel rank in a multi-process plan-check test (run as a script).

Ranks exchange plan fingerprints through files in a shared folder, the way the real TP group's
all_gather_object would; usage: rank_worker.py DIR RANK WORLD SIZES(comma-separated).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fastdeploy_stub"))
os.environ["FD_CUDAGRAPH_RUNTIME"] = "simulated"


class FileExchange:
    """all_gather over files; gives up after ``timeout`` seconds instead of hanging."""

    def __init__(self, folder: str, rank: int, world: int, timeout: float = 30.0) -> None:
        self.folder, self.rank, self.world, self.timeout = Path(folder), rank, world, timeout

    def all_gather(self, obj):
        mine = self.folder / f"rank{self.rank}.json"
        mine.with_suffix(".tmp").write_text(json.dumps(obj))
        mine.with_suffix(".tmp").rename(mine)
        deadline = time.monotonic() + self.timeout
        paths = [self.folder / f"rank{r}.json" for r in range(self.world)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: not every rank arrived")
            time.sleep(0.01)
        return [json.loads(p.read_text()) for p in paths]


def main() -> int:
    folder, rank, world, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from conftest import TinyBackbone, make_config

    from fd_cudagraph_plugin import session
    from fd_cudagraph_plugin.backend import CudaGraphBackend
    from fd_cudagraph_plugin.errors import RankMismatchError

    config = make_config(8, cudagraph_capture_sizes=[int(s) for s in sizes.split(",")])
    config.parallel_config.tensor_parallel_rank = rank
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    exchange = FileExchange(folder, rank, world)
    try:
        with session.CaptureSession("decode", fd_config=config, exchange=exchange):
            pass
    except RankMismatchError as error:
        print(f"MISMATCH {error}")
        return 3
    print(f"OK {backend.cudagraph_capture_sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
