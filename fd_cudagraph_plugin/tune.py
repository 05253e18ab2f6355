"""``fd-cudagraph tune``: the capture sizes that pad a recorded decode workload least.

Input is a histogram of decode token counts, read from plain traces (one count per line, blank
lines and ``#`` comments allowed) or from the plugin's stats files (``fd-cudagraph-stats/1``: one
JSON object per line whose ``decode_token_counts`` are increments since that backend's previous
line, so the histogram is the sum over every line, ranks and backends mixed).

A step of ``n`` tokens replays the smallest captured size ``>= n`` and wastes the difference. With
the largest size fixed (the largest observed count, or ``--max-size``), the list of at most N
sizes with the fewest padded tokens is found exactly: every size worth having is an observed
count, and choosing them is a dynamic programme over the distinct counts,

    best[c][j] = min over i < j of best[c - 1][i] + cost(i, j)

where ``cost(i, j)`` pads the counts after the i-th up to the j-th. That cost obeys the quadrangle
inequality (``cost(a, d) + cost(b, c) - cost(a, c) - cost(b, d) = (v_d - v_c) * (W_b - W_a) >= 0``
for a <= b <= c <= d), so the best ``i`` never decreases as ``j`` grows and each layer is solved
by divide and conquer in O(n log n) instead of O(n^2): still exact, in integers, no heuristic.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fd_cudagraph_plugin.errors import ConfigError, TraceError
from fd_cudagraph_plugin.plan import DECODE_CAP, default_capture_sizes
from fd_cudagraph_plugin.sizes import padding_table
from fd_cudagraph_plugin.stats import STATS_FORMAT

_HEX_ID = re.compile(r"(0x)?[0-9a-fA-F]+")
_DIGITS = re.compile(r"[0-9]+")


class Histogram(Counter):
    """``{tokens: steps}``, plus the speculative methods the stats lines were recorded under."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.speculative_methods: set[str] = set()


def read_histogram(paths: Iterable[str | Path]) -> Histogram:
    """Sum the decode token counts of every trace or stats file: ``{tokens: steps}``."""
    histogram = Histogram()
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                for lineno, raw in enumerate(handle, 1):
                    _add_line(histogram, raw.strip(), f"{path}:{lineno}")
        except OSError as error:
            raise TraceError(f"cannot read trace file {path}: {error.strerror or error}.") from None
        except UnicodeDecodeError as error:
            raise TraceError(
                f"{path}: not a UTF-8 text file ({error.reason} at byte {error.start}); a trace "
                "is one decode token count per line or fd-cudagraph-stats/1 JSON lines."
            ) from None
    return histogram


def _add_line(histogram: Counter[int], text: str, where: str) -> None:
    if not text or text.startswith("#"):
        return
    if text.startswith("{"):
        for tokens, steps in _stats_counts(text, where, histogram).items():
            histogram[tokens] += steps
        return
    value = text.split("#", 1)[0].strip()
    if not _DIGITS.fullmatch(value):
        raise TraceError(
            f"{where}: expected a decode token count (an integer >= 0) or an {STATS_FORMAT} JSON "
            f"line; got {text[:80]!r}."
        )
    histogram[int(value)] += 1


def _stats_counts(text: str, where: str, histogram: Histogram) -> dict[int, int]:
    """Validate one stats line and return its ``{tokens: steps}`` increments."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); each stats line is "
            f"one {STATS_FORMAT} object."
        ) from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object; got {type(record).__name__}.")
    fmt = record.get("format")
    if fmt != STATS_FORMAT:
        raise TraceError(f'{where}: "format" is {fmt!r}; this tool reads "{STATS_FORMAT}".')
    missing = [k for k in ("time", "rank", "backend", "decode_token_counts") if k not in record]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(map(repr, missing))} in the stats line.")
    time, rank, backend = record["time"], record["rank"], record["backend"]
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not math.isfinite(time):
        raise TraceError(f'{where}: "time" must be a unix time in seconds; got {time!r}.')
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TraceError(f'{where}: "rank" must be an integer >= 0; got {rank!r}.')
    if not isinstance(backend, str) or not _HEX_ID.fullmatch(backend):
        raise TraceError(f'{where}: "backend" must be a hex id such as "7f3a2c"; got {backend!r}.')
    counts = record["decode_token_counts"]
    if not isinstance(counts, dict):
        raise TraceError(f'{where}: "decode_token_counts" must be an object; got {counts!r}.')
    parsed: dict[int, int] = {}
    for key, steps in counts.items():
        if not _DIGITS.fullmatch(key):
            raise TraceError(
                f'{where}: "decode_token_counts" key {key!r} is not a token count (digits only).'
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise TraceError(
                f'{where}: "decode_token_counts"[{key!r}] must be a step count >= 0; got {steps!r}.'
            )
        parsed[int(key)] = steps
    method = record.get("speculative_method")
    if method:
        histogram.speculative_methods.add(str(method))
    return parsed


def padded_tokens(sizes: Iterable[int], histogram: Mapping[int, int]) -> int:
    """Tokens wasted by padding every step up to its captured size (steps above the list: none)."""
    table = padding_table(sizes)
    return sum(steps * (table[n] - n) for n, steps in histogram.items() if 0 < n < len(table))


def optimal_sizes(histogram: Mapping[int, int], max_graphs: int, top: int) -> list[int]:
    """At most ``max_graphs`` sizes, ``top`` among them, with the fewest padded tokens; descending.

    ``histogram`` holds steps per token count, every count in ``1..top``.
    """
    values = sorted(n for n, steps in histogram.items() if steps > 0)
    if values and not 0 < values[0] <= values[-1] <= top:
        raise ValueError(f"token counts must lie in 1..{top}; got {values[0]}..{values[-1]}")
    weights = [histogram[v] for v in values]
    if not values or values[-1] != top:
        values.append(top)
        weights.append(0)
    n = len(values)
    k = min(max_graphs, n)
    if k == n:
        return values[::-1]
    # Prefix sums: W[j] steps and S[j] tokens of the first j counts. cost(i, j), padding counts
    # i+1..j up to values[j-1], is values[j-1] * (W[j] - W[i]) - (S[j] - S[i]).
    steps_prefix, tokens_prefix = [0] * (n + 1), [0] * (n + 1)
    for j, (value, weight) in enumerate(zip(values, weights, strict=True), 1):
        steps_prefix[j] = steps_prefix[j - 1] + weight
        tokens_prefix[j] = tokens_prefix[j - 1] + weight * value
    best = [values[j - 1] * steps_prefix[j] - tokens_prefix[j] if j else 0 for j in range(n + 1)]
    splits: list[list[int]] = []
    for layer in range(2, k + 1):
        # With c sizes the last at j, j runs from c to n - (k - c): later sizes need counts too.
        best, split = _next_layer(best, values, steps_prefix, tokens_prefix, layer, n - (k - layer))
        splits.append(split)
    chosen, j = [], n
    for split in reversed(splits):
        chosen.append(values[j - 1])
        j = split[j]
    chosen.append(values[j - 1])
    return chosen


def _next_layer(
    previous: list[int],
    values: list[int],
    steps_prefix: list[int],
    tokens_prefix: list[int],
    layer: int,
    last: int,
) -> tuple[list[int], list[int]]:
    """One DP layer by divide and conquer over monotone split points."""
    base = [previous[i] + tokens_prefix[i] for i in range(len(previous))]
    best = [0] * len(previous)
    split = [0] * len(previous)
    stack = [(layer, last, layer - 1, last - 1)]
    while stack:
        lo, hi, split_lo, split_hi = stack.pop()
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        value = values[mid - 1]
        best_i = split_lo
        best_cost = base[split_lo] - value * steps_prefix[split_lo]
        for i in range(split_lo + 1, min(mid - 1, split_hi) + 1):
            cost = base[i] - value * steps_prefix[i]
            if cost < best_cost:
                best_cost, best_i = cost, i
        best[mid] = best_cost + value * steps_prefix[mid] - tokens_prefix[mid]
        split[mid] = best_i
        stack.append((lo, mid - 1, split_lo, best_i))
        stack.append((mid + 1, hi, best_i, split_hi))
    return best, split


@dataclass(frozen=True)
class TuneResult:
    steps: int
    max_size: int
    capture_sizes: list[int]
    padded_tokens: int
    baseline_capture_sizes: list[int]
    baseline_padded_tokens: int
    #: Steps not served by any list here: above ``max_size``, or with 0 tokens (eager either way).
    eager_above_max: int = 0
    eager_zero_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def graph_optimization_config(self) -> dict[str, list[int]]:
        return {"cudagraph_capture_sizes": self.capture_sizes}

    @property
    def reduction(self) -> float:
        """Fraction of the default list's padded tokens that the tuned list saves."""
        if self.baseline_padded_tokens == 0:
            return 0.0
        return 1 - self.padded_tokens / self.baseline_padded_tokens

    def to_json(self) -> dict:
        return {
            "capture_sizes": self.capture_sizes,
            "padded_tokens": self.padded_tokens,
            "baseline_capture_sizes": self.baseline_capture_sizes,
            "baseline_padded_tokens": self.baseline_padded_tokens,
            "graph_optimization_config": self.graph_optimization_config,
            "steps": self.steps,
            "max_size": self.max_size,
            "eager_above_max": self.eager_above_max,
            "eager_zero_tokens": self.eager_zero_tokens,
            "notes": self.notes,
        }


def tune(histogram: Mapping[int, int], max_graphs: int, max_size: int | None = None) -> TuneResult:
    """Choose at most ``max_graphs`` capture sizes for a decode histogram ``{tokens: steps}``.

    The largest size is ``max_size`` when given, else the largest observed count. Steps above
    ``max_size`` are ones FastDeploy runs eagerly whatever the list, so they are left out of both
    totals and reported; so are 0-token steps.
    """
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ConfigError(f"--max-graphs must be an integer >= 1; got {max_graphs!r}.")
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1
    ):
        raise ConfigError(f"--max-size must be an integer >= 1; got {max_size!r}.")
    bad = sorted(n for n, steps in histogram.items() if n < 0 or steps < 0)
    if bad:
        raise ValueError(f"token counts and step counts must be >= 0; got {bad[:5]}")
    observed = [n for n, steps in histogram.items() if n > 0 and steps > 0]
    if not observed:
        raise TraceError("the trace holds no decode step with 1 or more tokens; nothing to tune.")
    top = max(observed) if max_size is None else max_size
    kept = {n: histogram[n] for n in observed if n <= top}
    if not kept:
        raise TraceError(
            f"every decode step in the trace has more than --max-size {top} tokens "
            f"(smallest {min(observed)}); raise --max-size."
        )
    sizes = optimal_sizes(kept, max_graphs, top)
    baseline = default_capture_sizes(top)
    notes = []
    methods = sorted(getattr(histogram, "speculative_methods", ()))
    if methods:
        notes.append(
            f"These stats were recorded with speculative decoding ({', '.join(methods)}): "
            "FastDeploy multiplies user-given capture sizes by k + 1 and keys graphs by running "
            "requests, so this token-count list does not carry over as it is."
        )
    if top > DECODE_CAP:
        notes.append(
            f"Without speculative decoding FastDeploy drops every capture size above "
            f"min({DECODE_CAP}, max_num_seqs), so sizes above {DECODE_CAP} here would not be "
            f"captured; rerun with --max-size {DECODE_CAP}."
        )
    else:
        notes.append(
            f"Serve with --max-num-seqs >= {top}: FastDeploy drops capture sizes above "
            "min(512, max_num_seqs)."
        )
    return TuneResult(
        steps=sum(kept.values()),
        max_size=top,
        capture_sizes=sizes,
        padded_tokens=padded_tokens(sizes, kept),
        baseline_capture_sizes=baseline,
        baseline_padded_tokens=padded_tokens(baseline, kept),
        eager_above_max=sum(s for n, s in histogram.items() if n > top),
        eager_zero_tokens=histogram.get(0, 0),
        notes=notes,
    )


def format_result(result: TuneResult) -> str:
    def per_step(tokens: int) -> str:
        return f"{tokens / result.steps:.3f} per step"

    lines = [
        f"decode steps: {result.steps} with 1..{result.max_size} tokens",
    ]
    if result.eager_above_max or result.eager_zero_tokens:
        lines.append(
            f"left out (FastDeploy runs them eagerly): {result.eager_above_max} steps above "
            f"{result.max_size} tokens, {result.eager_zero_tokens} steps with 0 tokens"
        )
    tuned, baseline = result.capture_sizes, result.baseline_capture_sizes
    lines += [
        f"tuned   ({len(tuned)} graphs): {', '.join(map(str, tuned))}",
        f"default ({len(baseline)} graphs, FastDeploy's list for max_num_seqs={result.max_size}): "
        f"{', '.join(map(str, baseline))}",
        f"padded tokens: tuned {result.padded_tokens} ({per_step(result.padded_tokens)}), "
        f"default {result.baseline_padded_tokens} ({per_step(result.baseline_padded_tokens)}), "
        f"{abs(result.reduction):.1%} {'fewer' if result.reduction >= 0 else 'more'}",
        "use: --graph-optimization-config "
        f"'{json.dumps(result.graph_optimization_config, separators=(', ', ': '))}'",
    ]
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)
