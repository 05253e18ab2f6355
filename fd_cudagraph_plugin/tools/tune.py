"""``fd-cudagraph tune``: the capture sizes that pad a recorded decode workload least.

Input is a histogram of decode steps, read from plain traces (one count per line, blank lines and
``#`` comments allowed; ``-`` is standard input) or from the plugin's stats files
(``fd-cudagraph-stats/1``: one JSON object per line whose counts are increments since that
backend's previous line, so the histogram is the sum over every line, ranks and backends mixed).

Without speculative decoding a count is the decode step's tokens. With MTP, ngram or suffix
decoding FastDeploy keys graphs by running requests: it captures each ``cudagraph_capture_sizes``
entry ``s`` as ``s * (k + 1)`` tokens and maps ``r`` running requests to the smallest captured
``s >= r``. Stats lines then carry ``running_request_counts`` and ``num_speculative_tokens``; a
plain trace is read as running requests when ``--num-speculative-tokens`` is given. Either way the
sizes are fitted in running requests, and each padded request slot costs ``k + 1`` tokens, so the
same optimum serves both. FastDeploy 2.6 and develop take ``cudagraph_capture_sizes`` in those
units; 2.5 takes tokens, so the config printed for it holds ``s * (k + 1)``; 2.4 keys speculative
graphs by token count and is refused.

``--fastdeploy-version`` picks the release (default: the installed FastDeploy's, else develop): it
bounds the sizes (``min(512, max_num_seqs)`` with ``max_num_seqs`` at most 256 on 2.4 and 2.5, 512
later) and gives the baseline, that release's automatic list, computed as ``plan`` computes it.

A step of ``n`` pads to the smallest captured size ``>= n`` and wastes the difference. With the
largest size fixed (the largest observed count within that bound, or ``--max-size``; never a size
no step pads to unless ``--max-size`` asks for it), the list of at most N sizes
with the fewest padded tokens is found exactly: every size worth having is an observed count, and
choosing them is a dynamic programme over the distinct counts,

    best[c][j] = min over i < j of best[c - 1][i] + cost(i, j)

where ``cost(i, j)`` pads the counts after the i-th up to the j-th. That cost obeys the quadrangle
inequality (``cost(a, d) + cost(b, c) - cost(a, c) - cost(b, d) = (v_d - v_c) * (W_b - W_a) >= 0``
for a <= b <= c <= d), so the best ``i`` never decreases as ``j`` grows and each layer is solved
by divide and conquer in O(n log n) instead of O(n^2): still exact, in integers, no heuristic.

Work is bounded whatever the input: counts above what FastDeploy could ever graph are only
tallied, so memory holds at most a few thousand distinct counts and a line is read at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.sizes import padding_table
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    MAX_SPECULATIVE_TOKENS,
    RULES,
    Release,
    bad_k,
)
from fd_cudagraph_plugin.tools.plan import (
    PlanInput,
    check_count,
    derive_plan,
    graphs_phrase,
    release_rules,
)
from fd_cudagraph_plugin.tools.traces import TraceError
from fd_cudagraph_plugin.tools.wording import plural, shown


def padded_tokens(sizes: Iterable[int], histogram: Mapping[int, int]) -> int:
    """Slots wasted by padding every step up to its captured size (steps above the list: none)."""
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
    #: In the units FastDeploy's ``cudagraph_capture_sizes`` takes: tokens, or running requests
    #: under speculative decoding (FastDeploy multiplies them by k + 1).
    capture_sizes: list[int]
    padded_tokens: int
    baseline_capture_sizes: list[int]
    baseline_padded_tokens: int
    #: Steps not served by any list here: above ``max_size``, or with 0 tokens (eager either way).
    eager_above_max: int = 0
    eager_zero_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    num_speculative_tokens: int = 0
    #: The smallest and largest count of the steps fitted (``max_size`` may be larger).
    observed: tuple[int, int] = (1, 1)
    #: The FastDeploy release whose rules applied; 2.5 takes speculative sizes in tokens.
    fastdeploy_version: str = "develop"

    @property
    def graph_optimization_config(self) -> dict[str, list[int]]:
        tokens = (
            self.num_speculative_tokens and not RULES[self.fastdeploy_version].scales_user_sizes
        )
        sizes = self.captured_token_sizes if tokens else self.capture_sizes
        return {"cudagraph_capture_sizes": sizes}

    @property
    def captured_token_sizes(self) -> list[int]:
        """The graph sizes FastDeploy captures from ``capture_sizes``, in tokens."""
        return [size * (self.num_speculative_tokens + 1) for size in self.capture_sizes]

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
            "num_speculative_tokens": self.num_speculative_tokens,
            "captured_token_sizes": self.captured_token_sizes,
            "steps": self.steps,
            "observed_min": self.observed[0],
            "observed_max": self.observed[1],
            "max_size": self.max_size,
            "fastdeploy_version": self.fastdeploy_version,
            "eager_above_max": self.eager_above_max,
            "eager_zero_tokens": self.eager_zero_tokens,
            "notes": self.notes,
        }


def _speculative_tokens(
    histogram: Mapping[int, int], requested: int | None, release: Release
) -> int:
    """k for this fit: from the stats lines, else ``--num-speculative-tokens``, else 0."""
    recorded = getattr(histogram, "num_speculative_tokens", None)
    kinds = getattr(histogram, "kinds", set())
    k = (recorded or 0) if requested is None else _requested_k(requested, recorded, kinds)
    if k and not release.has_bsz_map:
        raise ConfigError(
            f"FastDeploy {release.name} builds no real_bsz_to_captured_size: its speculative "
            "graphs are keyed by token count, so sizes fitted in running requests do not apply. "
            "Tune a trace of decode token counts (without --num-speculative-tokens), or pick "
            "another --fastdeploy-version."
        )
    return k


def _requested_k(requested: int, recorded: int | None, kinds: set[str]) -> int:
    if bad_k(requested):
        raise ConfigError(
            f"--num-speculative-tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
            f"FastDeploy's range for mtp, ngram and suffix; got {shown(requested)}."
        )
    if recorded is not None and recorded != requested:
        raise ConfigError(
            f"--num-speculative-tokens {requested} differs from the stats files' "
            f"num_speculative_tokens {recorded}; leave the flag out."
        )
    if "decode" in kinds:
        raise ConfigError(
            "--num-speculative-tokens reads a plain trace as running requests, but these stats "
            "files hold decode token counts (recorded without running_request_counts); leave "
            "the flag out."
        )
    return requested


def tune(
    histogram: Mapping[int, int],
    max_graphs: int,
    max_size: int | None = None,
    num_speculative_tokens: int | None = None,
    *,
    fastdeploy_version: str | None = None,
) -> TuneResult:
    """Choose at most ``max_graphs`` capture sizes for a histogram ``{count: steps}``.

    The largest size is ``max_size`` when given, else the largest observed count that
    FastDeploy could graph (``min(512, max_num_seqs)``, with the release's ``max_num_seqs``
    limit). Steps above it are ones FastDeploy runs eagerly whatever the list, so they are left
    out of both totals and reported; so are 0-token steps. ``fastdeploy_version`` picks the
    release's rules (None: the installed FastDeploy's, else develop).
    """
    check_count("--max-graphs", max_graphs, 1, DECODE_CAP)
    release = release_rules(fastdeploy_version)
    # The decode cap is min(512, max_num_seqs) with FDConfig.check's max_num_seqs limit
    # (config.py), so larger counts run eagerly under any list.
    cap = release.decode_cap
    k = _speculative_tokens(histogram, num_speculative_tokens, release)
    noun = "running request" if k else "token"
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or not 1 <= max_size <= cap
    ):
        raise ConfigError(
            f"--max-size must be an integer in 1..{cap} ({noun}s); got {shown(max_size)}. "
            f"FastDeploy captures no decode size above min({DECODE_CAP}, max_num_seqs), and "
            f"FastDeploy {release.name} allows max_num_seqs up to {release.max_num_seqs}."
        )
    bad = sorted(n for n, steps in histogram.items() if n < 0 or steps < 0)
    if bad:
        raise ValueError(f"counts and step counts must be >= 0; got {bad[:5]}")
    observed = [n for n, steps in histogram.items() if n > 0 and steps > 0]
    beyond = getattr(histogram, "beyond", 0)
    limit = cap if max_size is None else max_size
    kept = {n: histogram[n] for n in observed if n <= limit}
    if not kept:
        raise _nothing_to_tune(observed, beyond, max_size, cap, noun, release)
    # Without --max-size the largest size is the largest count a step really has: a larger one
    # would be a graph that no observed step pads to.
    top = max(kept) if max_size is None else max_size
    sizes = optimal_sizes(kept, max_graphs, top)
    # FastDeploy's automatic list for max_num_seqs = top, in the units the user passes: with
    # speculative decoding it scales the same candidates by k + 1.
    baseline = derive_plan(PlanInput(max_num_seqs=top, fastdeploy_version=release.name))
    notes = []
    methods = sorted(getattr(histogram, "speculative_methods", ()))
    if k:
        tokens = ", ".join(map(str, (s * (k + 1) for s in sizes)))
        how = (
            f"FastDeploy captures each size s as s x {k + 1} tokens ({tokens}) and replays the "
            "smallest one that holds the running requests"
            if release.scales_user_sizes
            else f"FastDeploy {release.name} takes the sizes in tokens, s x {k + 1} ({tokens}: "
            "the config below), and for mtp and suffix replays the smallest one that holds the "
            "running requests"
        )
        notes.append(
            f"Speculative decoding with k = {k}: {how}; serve with the same "
            f"num_speculative_tokens and --max-num-seqs >= {top}."
        )
    elif methods:
        notes.append(
            f"These stats were recorded with speculative decoding ({', '.join(methods)}) by token "
            "count: FastDeploy multiplies user-given capture sizes by k + 1 and keys graphs by "
            "running requests, so this token-count list does not carry over as it is. Record "
            "running_request_counts (a newer plugin) or pass a trace of running requests with "
            "--num-speculative-tokens."
        )
    else:
        notes.append(
            f"Serve with --max-num-seqs >= {top}: FastDeploy drops capture sizes above "
            f"min({DECODE_CAP}, max_num_seqs)."
        )
    return TuneResult(
        steps=sum(kept.values()),
        max_size=top,
        capture_sizes=sizes,
        padded_tokens=padded_tokens(sizes, kept) * (k + 1),
        baseline_capture_sizes=baseline.capture_sizes,
        baseline_padded_tokens=padded_tokens(baseline.capture_sizes, kept) * (k + 1),
        eager_above_max=sum(s for n, s in histogram.items() if n > top) + beyond,
        eager_zero_tokens=histogram.get(0, 0),
        notes=notes,
        num_speculative_tokens=k,
        observed=(min(kept), max(kept)),
        fastdeploy_version=release.name,
    )


def _nothing_to_tune(
    observed: list[int], beyond: int, max_size: int | None, cap: int, noun: str, release: Release
) -> TraceError:
    """Why no step of the trace can be graphed, with the bound that applies."""
    if max_size is not None and (observed or beyond):
        smallest = f" (smallest {min(observed)})" if observed else ""
        return TraceError(
            f"every decode step in the trace has more than --max-size {plural(max_size, noun)}"
            f"{smallest}; raise --max-size."
        )
    bound = (
        f"FastDeploy {release.name}'s largest decode graph: min({DECODE_CAP}, max_num_seqs) with "
        f"max_num_seqs at most {release.max_num_seqs}"
    )
    if observed or beyond:
        smallest = f" (the smallest has {min(observed)})" if observed else ""
        return TraceError(
            f"every decode step in the trace has more than {plural(cap, noun)}{smallest}, "
            f"{bound}; "
            "FastDeploy runs them eagerly whatever the list, nothing to tune."
        )
    return TraceError(
        f"the trace holds no decode step with 1 to {plural(cap, noun)} ({bound}); nothing to tune."
    )


def format_result(result: TuneResult) -> str:
    def per_step(tokens: int) -> str:
        return f"{tokens / result.steps:.3f} per step"

    k = result.num_speculative_tokens
    noun = "running request" if k else "token"
    low, high = result.observed
    counts = plural(low, noun) if low == high else f"{low}..{high} {noun}s"
    lines = [f"decode steps: {result.steps} with {counts}"]
    if k:
        takes = (
            "as cudagraph_capture_sizes takes them"
            if RULES[result.fastdeploy_version].scales_user_sizes
            else f"FastDeploy {result.fastdeploy_version} takes cudagraph_capture_sizes in tokens "
            f"(x {k + 1}: the config below)"
        )
        lines.append(
            f"speculative decoding, k = {k}: sizes below are running requests, {takes}; each "
            f"padded request costs {k + 1} tokens"
        )
    if result.eager_above_max or result.eager_zero_tokens:
        lines.append(
            f"left out (FastDeploy runs them eagerly): {plural(result.eager_above_max, 'step')} "
            f"above {plural(result.max_size, noun)}, {plural(result.eager_zero_tokens, 'step')} "
            "with 0 tokens"
        )
    tuned, baseline = result.capture_sizes, result.baseline_capture_sizes
    if result.baseline_padded_tokens:
        change = f"{abs(result.reduction):.1%} {'fewer' if result.reduction >= 0 else 'more'}"
    else:
        change = "the same" if result.padded_tokens == 0 else "the default list pads none"
    lines += [
        f"tuned   ({graphs_phrase(len(tuned))}): {', '.join(map(str, tuned))}",
        f"default ({graphs_phrase(len(baseline))}, FastDeploy {result.fastdeploy_version}'s list "
        f"for max_num_seqs={result.max_size}): {', '.join(map(str, baseline))}",
        f"padded tokens: tuned {result.padded_tokens} ({per_step(result.padded_tokens)}), "
        f"default {result.baseline_padded_tokens} ({per_step(result.baseline_padded_tokens)}), "
        f"{change}",
    ]
    config = f"'{json.dumps(result.graph_optimization_config, separators=(', ', ': '))}'"
    if result.padded_tokens > result.baseline_padded_tokens:
        # Fewer graphs than the default can pad more: say so rather than recommend it.
        lines.append(
            f"keep the default list: with {graphs_phrase(len(baseline))} it pads fewer tokens; "
            f"raise --max-graphs to tune within as many. The tuned list, if graph memory matters "
            f"more: --graph-optimization-config {config}"
        )
    else:
        lines.append(f"use: --graph-optimization-config {config}")
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)
