"""``fd-cudagraph tune`` against FastDeploy's default capture list, and how long tuning takes.

CPU only, seeded, repeatable. Each synthetic decode trace (tokens per step, 100k steps, at most
``--max-num-seqs`` tokens) is tuned to as many graphs as FastDeploy's default list for that
maximum has, and both lists' padded tokens are compared:

- skewed: a steady load, running requests log-normally spread around 40 with a long tail;
- bursty: a request-count random walk with idle spells and arrival bursts up to the maximum;
- uniform: every count equally likely, the case where no list can do much better (a control).

Then the time to read a 100k-line trace whose counts cover 1..512 (FastDeploy's cap) and tune it.

    python benchmarks/tune.py
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd_cudagraph_plugin.tools.capture_rules import default_capture_sizes
from fd_cudagraph_plugin.tools.traces import read_histogram
from fd_cudagraph_plugin.tools.tune import tune


def skewed(rng: random.Random, steps: int, top: int) -> list[int]:
    return [min(top, max(1, round(rng.lognormvariate(math.log(40), 0.45)))) for _ in range(steps)]


def bursty(rng: random.Random, steps: int, top: int) -> list[int]:
    """Running requests: arrivals switch between quiet and busy spells, plus sudden bursts; each
    request finishes with probability 1/250 per step (about 250 output tokens)."""
    running, busy, trace = 1, False, []
    for _ in range(steps):
        if rng.random() < 0.001:
            busy = not busy
        arrivals = int(rng.random() < (0.6 if busy else 0.08))
        if rng.random() < 0.0005:
            arrivals += rng.randint(top // 4, top // 2)
        mean = running / 250
        finished = max(0, round(rng.gauss(mean, math.sqrt(mean))))
        running = min(top, max(1, running + arrivals - finished))
        trace.append(running)
    return trace


def uniform(rng: random.Random, steps: int, top: int) -> list[int]:
    return [rng.randint(1, top) for _ in range(steps)]


TRACES: dict[str, Callable[[random.Random, int, int], list[int]]] = {
    "skewed": skewed,
    "bursty": bursty,
    "uniform": uniform,
}


def compare(steps: int, top: int, seed: int) -> list[tuple[str, int, int, int, float]]:
    graphs = len(default_capture_sizes(top))
    rows = []
    for name, make in TRACES.items():
        histogram = Counter(make(random.Random(seed), steps, top))
        result = tune(histogram, graphs, max_size=top)
        rows.append(
            (name, graphs, result.baseline_padded_tokens, result.padded_tokens, result.reduction)
        )
    return rows


def time_tuning(samples: int, top: int, seed: int, repeats: int) -> tuple[int, int, float, float]:
    rng = random.Random(seed)
    # Every count in 1..top appears (the most distinct counts, the slowest case), skewed low.
    values = list(range(1, top + 1)) + [
        min(top, max(1, round(rng.expovariate(1 / 120)))) for _ in range(samples - top)
    ]
    rng.shuffle(values)
    graphs = len(default_capture_sizes(top))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.txt"
        path.write_text("\n".join(map(str, values)) + "\n", encoding="utf-8")
        end_to_end, tune_only = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            histogram = read_histogram([path])
            parsed = time.perf_counter()
            tune(histogram, graphs, max_size=top)
            done = time.perf_counter()
            end_to_end.append(done - started)
            tune_only.append(done - parsed)
    return len(set(values)), graphs, statistics.median(end_to_end), statistics.median(tune_only)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rows = compare(args.steps, args.max_num_seqs, args.seed)
    print(
        f"{args.steps} decode steps per trace, max {args.max_num_seqs} tokens, seed {args.seed}; "
        "tuned to the default list's number of graphs"
    )
    print(f"{'trace':<8} {'graphs':>6} {'default padded':>15} {'tuned padded':>13} {'fewer':>7}")
    for name, graphs, baseline, tuned, reduction in rows:
        print(f"{name:<8} {graphs:>6} {baseline:>15} {tuned:>13} {reduction:>7.1%}")

    distinct, graphs, end_to_end, tune_only = time_tuning(100_000, 512, args.seed, args.repeats)
    print(
        f"tune time, 100000 samples, max 512 ({distinct} distinct counts, {graphs} graphs), "
        f"median of {args.repeats}: read + tune {end_to_end:.3f} s, tune alone {tune_only:.3f} s"
    )

    skewed_reduction = next(r for name, *_, r in rows if name == "skewed")
    checks = [
        (
            f"skewed trace: {skewed_reduction:.1%} fewer padded tokens (>= 30%)",
            skewed_reduction >= 0.3,
        ),
        (f"tune time {end_to_end:.3f} s (< 1 s)", end_to_end < 1.0),
    ]
    for text, passed in checks:
        print(f"{'OK' if passed else 'FAIL'}: {text}")
    return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
