"""How long ``fd-cudagraph tune`` takes on a large decode trace, and how much memory it holds.

CPU only, seeded. Writes a plain decode trace (one token count per line, the format ``tune``
reads; every count FastDeploy could graph, 1..512, appears, the rest skewed low as served
traffic is), runs ``python -m fd_cudagraph_plugin tune TRACE --max-graphs N`` on it as a
subprocess with this checkout first on ``PYTHONPATH``, and prints its wall time and its peak
resident memory (``ru_maxrss`` of ``resource.getrusage(RUSAGE_CHILDREN)``), beside the peak of a
bare ``python -c pass`` for scale. This is the command behind the README's "a 10,000,000-line
trace took N s and M MB".

On Linux a child's ``ru_maxrss`` also counts the peak of the process that started it (spawning
runs in the parent's address space until ``exec``), so ``tune`` is started from a fresh, small
``python -S`` process (``MEASURE``), not from this one, which grew while writing the trace.

    python benchmarks/tune_trace.py [--lines 10000000] [--max-graphs 35] [--seed 0]
        [--keep PATH] [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from itertools import accumulate
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fd_cudagraph_plugin.tools.capture_rules import default_capture_sizes  # noqa: E402

TOP = 512  # FastDeploy's largest decode capture size
CHUNK = 1_000_000


def write_trace(path: Path, lines: int, seed: int) -> None:
    """``lines`` token counts: 1..TOP once each, then counts drawn with weight exp(-n / 120)."""
    rng = random.Random(seed)
    counts = range(1, TOP + 1)
    cumulative = list(accumulate(math.exp(-n / 120) for n in counts))
    with open(path, "w", encoding="ascii") as handle:
        head = min(lines, TOP)
        handle.write("".join(f"{n}\n" for n in range(1, head + 1)))
        left = lines - head
        while left > 0:
            batch = min(left, CHUNK)
            drawn = rng.choices(counts, cum_weights=cumulative, k=batch)
            handle.write("\n".join(map(str, drawn)) + "\n")
            left -= batch


#: Run by a fresh ``python -S`` (no site, few imports): it starts ``tune`` and a bare interpreter
#: and reports their peaks, so the floor under them is this small process, not the one that
#: wrote the trace. argv: trace, max graphs.
MEASURE = """
import json, resource, subprocess, sys, time

def peak():  # the largest resident set of any child waited for so far (Linux: KiB)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

def own_peak():  # VmHWM: the floor under every child's ru_maxrss
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None

trace, max_graphs = sys.argv[1:]
subprocess.run([sys.executable, "-c", "pass"], check=True)  # the smaller child first
bare = peak()
command = [sys.executable, "-m", "fd_cudagraph_plugin", "tune", trace, "--max-graphs", max_graphs]
started = time.perf_counter()
done = subprocess.run(command, capture_output=True, text=True)
wall = time.perf_counter() - started
print(json.dumps({"returncode": done.returncode, "output": (done.stdout + done.stderr).rstrip(),
                  "wall_s": wall, "peak_mb": peak(), "bare_python_mb": bare,
                  "floor_mb": own_peak()}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000_000)
    parser.add_argument(
        "--max-graphs",
        type=int,
        default=len(default_capture_sizes(TOP)),
        help="default: as many graphs as FastDeploy's default list for max_num_seqs=512",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="write the trace here and keep it")
    parser.add_argument("--trace", type=Path, default=None, help="tune this trace instead")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        path = args.trace or args.keep or Path(folder) / "trace.txt"
        if args.trace is None:
            started = time.perf_counter()
            write_trace(path, args.lines, args.seed)
            print(
                f"trace: {args.lines} lines, counts 1..{TOP} (each at least once), seed "
                f"{args.seed}, {path.stat().st_size / 1e6:.1f} MB, written in "
                f"{time.perf_counter() - started:.1f} s"
            )
        else:
            print(f"trace: {path} ({path.stat().st_size / 1e6:.1f} MB)")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        measurer = [sys.executable, "-S", "-c", MEASURE, str(path), str(args.max_graphs)]
        done = subprocess.run(measurer, check=True, capture_output=True, env=env, cwd=ROOT)
        result = json.loads(done.stdout)

    print(
        f"python -m fd_cudagraph_plugin tune TRACE --max-graphs {args.max_graphs}: exit "
        f"{result['returncode']}"
    )
    for line in result["output"].splitlines():
        print(f"  | {line}")
    floor = result["floor_mb"]
    print(
        f"wall time {result['wall_s']:.1f} s, peak resident memory {result['peak_mb']:.0f} MB "
        f"(a bare python -c pass: {result['bare_python_mb']:.0f} MB"
        + (f"; the measuring process: {floor:.0f} MB" if floor is not None else "")
        + ")"
    )
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
