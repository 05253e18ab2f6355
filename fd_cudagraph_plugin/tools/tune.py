"""``fd-cudagraph tune``: the capture sizes that pad a recorded decode workload least.

Input is a histogram of decode steps, read from plain traces (one count per line, blank lines and
``#`` comments allowed; ``-`` is standard input) or from the plugin's stats files
(``fd-cudagraph-stats/1``: one JSON object per line whose counts are increments since that
backend's previous line, so the histogram is the sum over every line, ranks and backends mixed).

Without speculative decoding a count is the decode step's tokens. With MTP, ngram or suffix
decoding FastDeploy keys graphs by running requests: it captures each ``cudagraph_capture_sizes``
entry ``s`` as ``s * (k + 1)`` tokens and maps ``r`` running requests to the smallest captured
``s >= r``. Stats lines then carry ``running_request_counts`` and ``num_speculative_tokens``; a
plain trace is read as running requests when the launch line's ``--speculative-config`` gives
mtp, ngram or suffix (k: its ``num_speculative_tokens``, 1 by default). Either way the
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

``--fit graphs:N|padding:P`` also prints what ``FD_CUDAGRAPH_FIT`` would capture at a recapture
after this traffic: ``core.fit.fit`` itself over the baseline (FastDeploy's list), never a copy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fd_cudagraph_plugin.core import fit as fitting
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.sizes import padding_table
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    MAX_SPECULATIVE_TOKENS,
    RULES,
    Release,
    bad_k,
)
from fd_cudagraph_plugin.tools.launch import SPELLING, PlanInput, read
from fd_cudagraph_plugin.tools.plan import (
    check_count,
    derive_plan,
    effective_k,
    graphs_phrase,
    release_rules,
)
from fd_cudagraph_plugin.tools.traces import Histogram, TraceError, read_histogram
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
class FitResult:
    """What ``FD_CUDAGRAPH_FIT`` would capture at a recapture after the trace's traffic: the
    subset of FastDeploy's list (the baseline) that ``core.fit.fit`` chooses, in tune's units."""

    #: The option's value, as ``FD_CUDAGRAPH_FIT`` takes it (``graphs:8``).
    budget: str
    #: FastDeploy's list (the candidates), and the sizes the fit keeps: all of them where
    #: ``kept_because`` or ``changes_nothing`` says why.
    candidates: list[int]
    capture_sizes: list[int]
    #: The steps fitted to (those up to the largest candidate) and the padded tokens on them.
    steps: int
    padded_tokens: int
    baseline_padded_tokens: int
    #: Why FastDeploy's whole list is captured (``core.fit``: too few steps), else "".
    kept_because: str = ""
    #: Why the option changes nothing for this launch (not dynamic mode's decode graphs), else "".
    changes_nothing: str = ""

    @property
    def env(self) -> str:
        return f"FD_CUDAGRAPH_FIT={self.budget}"

    def to_json(self) -> dict:
        return {
            "env": self.env,
            "capture_sizes": self.capture_sizes,
            "fastdeploy_capture_sizes": self.candidates,
            "steps": self.steps,
            "padded_tokens": self.padded_tokens,
            "baseline_padded_tokens": self.baseline_padded_tokens,
            "kept_because": self.kept_because or None,
            "min_steps": fitting.MIN_STEPS,
            "changes_nothing": self.changes_nothing or None,
        }


def fit_to_traffic(
    histogram: Mapping[int, int],
    baseline: list[int],
    budget: fitting.Budget,
    k: int,
    changes_nothing: str = "",
) -> FitResult:
    """``core.fit.fit`` over FastDeploy's list ``baseline`` (tokens, or running requests of
    k + 1 tokens each) on the trace's steps, as a recapture after that traffic would run it."""
    unit = k + 1
    steps = {n: count for n, count in histogram.items() if n > 0 and count > 0}
    fitted = fitting.fit(steps, baseline, budget, unit)
    sizes = baseline if changes_nothing else list(fitted.sizes)
    return FitResult(
        budget=str(budget),
        candidates=list(baseline),
        capture_sizes=sizes,
        steps=fitted.steps,
        padded_tokens=fitted.padded_default if changes_nothing else fitted.padded,
        baseline_padded_tokens=fitted.padded_default,
        kept_because="" if changes_nothing else fitted.why,
        changes_nothing=changes_nothing,
    )


@dataclass(frozen=True)
class TuneResult:
    steps: int
    max_size: int
    #: In the units FastDeploy's ``cudagraph_capture_sizes`` takes: tokens, or running requests
    #: under speculative decoding (FastDeploy multiplies them by k + 1).
    capture_sizes: list[int]
    padded_tokens: int
    #: The list the tuned one is compared with: the deployed one, else FastDeploy's default.
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
    #: What the baseline is: ``from --graph-optimization-config cudagraph_capture_sizes`` (or
    #: ``from stats.jsonl:1``: the deployed list), or ``FastDeploy develop's list for
    #: max_num_seqs=40``.
    baseline_label: str = ""
    #: Steps the tuned list graphs that are above the baseline's largest size (eager there).
    baseline_eager_steps: int = 0
    #: ``max_num_seqs`` of the deployment and where it came from ("" where unknown).
    max_num_seqs: int | None = None
    max_num_seqs_from: str = ""
    #: ``(size, steps)``: the steps of the trace that pad to each tuned size, ascending.
    traffic: list[tuple[int, int]] = field(default_factory=list)
    max_graphs: int = 0
    max_graphs_from: str = ""
    #: Why only some sizes are allowed (FastDeploy's filter for this launch), or "".
    kept_by: str = ""
    #: ``(graphs, padded tokens)`` of the best list without ``--max-graphs``'s cap, where it
    #: capped below the baseline's count.
    cap_cost: tuple[int, int] | None = None
    #: The deployed list saturated or below max_num_seqs, with the share served eagerly.
    warnings: list[str] = field(default_factory=list)
    #: The launch flags that change nothing captured, named once.
    launch_notes: list[str] = field(default_factory=list)
    #: What ``--fit`` asked of FD_CUDAGRAPH_FIT on this traffic (None: not asked).
    fit: FitResult | None = None

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
    def gains_nothing(self) -> bool:
        """The tuned list pads no fewer tokens and graphs no step the baseline leaves eager."""
        return self.padded_tokens >= self.baseline_padded_tokens and not self.baseline_eager_steps

    @property
    def reduction(self) -> float:
        """Fraction of the baseline's padded tokens that the tuned list saves."""
        if self.baseline_padded_tokens == 0:
            return 0.0
        return 1 - self.padded_tokens / self.baseline_padded_tokens

    def to_json(self) -> dict:
        return {
            "format": TUNE_FORMAT,
            "capture_sizes": self.capture_sizes,
            "padded_tokens": self.padded_tokens,
            "baseline": self.baseline_label,
            "baseline_capture_sizes": self.baseline_capture_sizes,
            "baseline_padded_tokens": self.baseline_padded_tokens,
            "baseline_eager_steps": self.baseline_eager_steps,
            "graph_optimization_config": self.graph_optimization_config,
            "num_speculative_tokens": self.num_speculative_tokens,
            "captured_token_sizes": self.captured_token_sizes,
            "steps": self.steps,
            "observed_min": self.observed[0],
            "observed_max": self.observed[1],
            "max_size": self.max_size,
            "max_graphs": self.max_graphs,
            "max_num_seqs": self.max_num_seqs,
            "max_num_seqs_from": self.max_num_seqs_from or None,
            "fastdeploy_version": self.fastdeploy_version,
            "eager_above_max": self.eager_above_max,
            "eager_zero_tokens": self.eager_zero_tokens,
            "traffic": [{"size": size, "steps": steps} for size, steps in self.traffic],
            "kept_by": self.kept_by or None,
            "cap_cost": None
            if self.cap_cost is None
            else {"graphs": self.cap_cost[0], "padded_tokens": self.cap_cost[1]},
            "advice": "keep" if self.gains_nothing else "use",
            "fit": None if self.fit is None else self.fit.to_json(),
            "warnings": self.warnings,
            "notes": [*self.notes, *self.launch_notes],
        }


#: The ``format`` of ``tune --json``; a change that drops or renames a key bumps it.
TUNE_FORMAT = "fd-cudagraph-tune/1"


def _speculative_tokens(
    histogram: Mapping[int, int], requested: int | None, release: Release
) -> int:
    """k for this fit: from the stats lines, else the launch line's, else 0."""
    recorded = getattr(histogram, "num_speculative_tokens", None)
    kinds = getattr(histogram, "kinds", set())
    k = (recorded or 0) if requested is None else _requested_k(requested, recorded, kinds)
    if k and not release.has_bsz_map:
        raise ConfigError(
            f"FastDeploy {release.name} builds no real_bsz_to_captured_size: its speculative "
            "graphs are keyed by token count, so sizes fitted in running requests do not apply. "
            "Tune a trace of decode token counts (without --speculative-config), or pick "
            "another --fastdeploy-version."
        )
    return k


def _requested_k(requested: int, recorded: int | None, kinds: set[str]) -> int:
    if bad_k(requested):
        raise ConfigError(
            "num_speculative_tokens of --speculative-config must be an integer in "
            f"1..{MAX_SPECULATIVE_TOKENS}, "
            f"FastDeploy's range for mtp, ngram and suffix; got {shown(requested)}."
        )
    if recorded is not None and recorded != requested:
        raise ConfigError(
            f"num_speculative_tokens of --speculative-config: {requested} differs from the stats "
            "files' "
            f"num_speculative_tokens {recorded}; leave it out."
        )
    if "decode" in kinds:
        raise ConfigError(
            "--speculative-config makes a plain trace running requests, but these stats "
            "files hold decode token counts (recorded without running_request_counts); leave "
            "it out."
        )
    return requested


@dataclass(frozen=True)
class Deployment:
    """What is known of the deployment the trace came from, each with where it came from
    (``--max-num-seqs``, ``stats.jsonl:1``); sizes as FastDeploy's config takes them."""

    max_num_seqs: int | None = None
    max_num_seqs_from: str = ""
    #: The deployed ``cudagraph_capture_sizes``: as ``--graph-optimization-config`` takes them
    #: (``tokens`` False: running requests under speculative decoding on 2.6 and later), or as
    #: FastDeploy derived them, in tokens (what stats files record).
    capture_sizes: tuple[int, ...] | None = None
    capture_sizes_from: str = ""
    capture_sizes_in_tokens: bool = False


def tune(
    histogram: Mapping[int, int],
    max_graphs: int | None = None,
    max_size: int | None = None,
    num_speculative_tokens: int | None = None,
    *,
    fastdeploy_version: str | None = None,
    deployment: Deployment | None = None,
    launch: PlanInput | None = None,
    fit: fitting.Budget | None = None,
) -> TuneResult:
    """Choose at most ``max_graphs`` capture sizes for a histogram ``{count: steps}``.

    The largest size is ``max_size`` when given, else the largest observed count that
    FastDeploy could graph (``min(512, max_num_seqs)``, with the deployment's ``max_num_seqs``
    where known, else the release's limit). Steps above it are ones FastDeploy runs eagerly
    whatever the list, so they are left out of both totals and reported; so are 0-token steps.
    The tuned list is compared with the deployed one where known, else with the release's
    automatic list; ``max_graphs`` None is as many graphs as that list has.
    ``fastdeploy_version`` picks the release's rules (None: the installed FastDeploy's, else
    develop). ``launch`` is the rest of the deployment's launch line (tensor and expert
    parallelism, the splitwise role, ...): every list here is what FastDeploy keeps of it for
    that launch (``filter_capture_size``), computed by ``plan``'s derivation, and a tuned list
    that launch would cut is refused. ``fit`` (``--fit``): what ``FD_CUDAGRAPH_FIT`` with that
    budget would capture of the baseline on this traffic (``fit_to_traffic``).
    """
    deployment = deployment or Deployment()
    if max_graphs is not None:
        check_count("--max-graphs", max_graphs, 1, DECODE_CAP)
    release = release_rules(fastdeploy_version)
    # The decode cap is min(512, max_num_seqs) with FDConfig.check's max_num_seqs limit
    # (config.py), so larger counts run eagerly under any list.
    cap = release.decode_cap
    seqs = deployment.max_num_seqs
    if seqs is not None:
        if seqs > release.max_num_seqs:
            raise ConfigError(
                f"max_num_seqs {seqs} ({deployment.max_num_seqs_from}) is above "
                f"{release.max_num_seqs}, what FastDeploy {release.name} allows (FDConfig.check); "
                "check --fastdeploy-version."
            )
        cap = min(cap, seqs)
    k = _speculative_tokens(histogram, num_speculative_tokens, release)
    noun = "running request" if k else "token"
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or not 1 <= max_size <= cap
    ):
        raise ConfigError(
            f"--max-size must be an integer in 1..{cap} ({noun}s); got {shown(max_size)}. "
            f"FastDeploy captures no decode size above min({DECODE_CAP}, max_num_seqs), and "
            + (
                f"max_num_seqs is {seqs} ({deployment.max_num_seqs_from})."
                if seqs is not None
                else f"FastDeploy {release.name} allows max_num_seqs up to {release.max_num_seqs}."
            )
        )
    bad = sorted(n for n, steps in histogram.items() if n < 0 or steps < 0)
    if bad:
        raise ValueError(f"counts and step counts must be >= 0; got {bad[:5]}")
    observed = [n for n, steps in histogram.items() if n > 0 and steps > 0]
    beyond = getattr(histogram, "beyond", 0)
    unknown_eager = getattr(histogram, "eager_unknown", 0)
    target = _Target(release, launch, k, seqs if seqs is not None else cap)
    step = target.divisor
    if max_size is not None and max_size % step:
        raise ConfigError(
            f"--max-size {max_size}: {target.why}, so FastDeploy would not capture it. Give a "
            f"multiple of {step}."
        )
    limit = (cap // step) * step if max_size is None else max_size
    kept = {n: histogram[n] for n in observed if _up(n, step) <= limit}
    if not kept:
        raise _nothing_to_tune(observed, beyond, max_size, cap, noun, release)
    # Without --max-size the largest size is the largest observed count a graph can hold: a
    # larger one would be a graph no observed step pads to. Steps recorded as eager without
    # their counts need the largest size FastDeploy allows to get a graph at all.
    top = _up(max(kept), step) if max_size is None else max_size
    if unknown_eager and max_size is None:
        top = limit
    deployed = _deployed_sizes(deployment, k, release)
    if deployed:
        if not deployment.capture_sizes_in_tokens:
            deployed = target.kept(
                deployed, f"cudagraph_capture_sizes {_joined(deployed)}", refuse=False
            )
        baseline = deployed
        label = f"from {deployment.capture_sizes_from}"
    else:
        # FastDeploy's automatic list for max_num_seqs (else the largest count) as this launch
        # keeps it, in the units the user passes.
        base_seqs = seqs if seqs is not None else top
        baseline = target.default_list(base_seqs)
        label = f"FastDeploy {release.name}'s list for max_num_seqs={base_seqs}"
        if target.divisor > 1:
            label += f", as {target.short}"
    graphs_from = "--max-graphs"
    if max_graphs is None:
        kind = "deployed" if deployed else "default"
        max_graphs, graphs_from = len(baseline), f"as many as the {kind} list"
    rounded = _rounded(kept, step)
    sizes = optimal_sizes(rounded, max_graphs, top)
    target.kept(sizes, "the tuned list", refuse=True)
    padded = padded_tokens(sizes, kept) * (k + 1)
    cap_cost = None
    if graphs_from == "--max-graphs" and max_graphs < len(baseline):
        wider = optimal_sizes(rounded, len(baseline), top)
        cap_cost = (len(wider), padded_tokens(wider, kept) * (k + 1))
    notes = _notes(histogram, k, sizes, top, release)
    if unknown_eager and max_size is None:
        notes.append(
            f"{plural(unknown_eager, 'step')} ran eagerly above the deployed largest size "
            "without their counts in the stats; the tuned list ends at the largest size FastDeploy "
            f"allows ({top}) so they get a graph, and their padding is in no figure here."
        )
    return TuneResult(
        steps=sum(kept.values()),
        max_size=top,
        capture_sizes=sizes,
        padded_tokens=padded,
        baseline_capture_sizes=list(baseline),
        baseline_padded_tokens=padded_tokens(baseline, kept) * (k + 1),
        eager_above_max=sum(s for n, s in histogram.items() if n > top) + beyond,
        eager_zero_tokens=histogram.get(0, 0),
        notes=notes,
        num_speculative_tokens=k,
        observed=(min(kept), max(kept)),
        fastdeploy_version=release.name,
        baseline_label=label,
        baseline_eager_steps=sum(s for n, s in kept.items() if n > max(baseline)),
        max_num_seqs=seqs,
        max_num_seqs_from=deployment.max_num_seqs_from,
        traffic=_traffic(sizes, kept),
        max_graphs=max_graphs,
        max_graphs_from=graphs_from,
        kept_by=target.why if step > 1 else "",
        cap_cost=cap_cost,
        warnings=[
            *_saturation(histogram, baseline, deployed, cap, k, unknown_eager),
            # Only a known max_num_seqs says what the deployment's steps may carry.
            *(target.warnings(sizes) if seqs is not None else []),
        ],
        launch_notes=target.launch_notes,
        fit=None
        if fit is None
        else fit_to_traffic(histogram, list(baseline), fit, k, target.fit_scope),
    )


def _up(count: int, step: int) -> int:
    """The smallest multiple of ``step`` that holds ``count``."""
    return -(-count // step) * step


def _rounded(kept: Mapping[int, int], step: int) -> dict[int, int]:
    """The steps by the smallest size a kept list can hold them in: with only multiples of
    ``step`` captured, a step pads to one of those whatever the list, so fitting the rounded
    counts is exact (the padding up to the multiple is the same for every list)."""
    rounded: dict[int, int] = {}
    for count, steps in kept.items():
        rounded[_up(count, step)] = rounded.get(_up(count, step), 0) + steps
    return rounded


def _joined(sizes: Iterable[int]) -> str:
    return ",".join(map(str, sizes))


class _Target:
    """The deployment's launch, as ``plan`` derives it: which sizes FastDeploy keeps.

    Sizes here are in the fit's units (running requests under speculative decoding, else
    tokens); FastDeploy filters the token sizes, ``s * (k + 1)``.
    """

    def __init__(self, release: Release, launch: PlanInput | None, k: int, seqs: int) -> None:
        self.release, self.k = release, k
        base = launch or PlanInput()
        method = base.spec_method or ("mtp" if k else None)
        self.launch = dataclasses.replace(
            base,
            max_num_seqs=seqs,
            fastdeploy_version=release.name,
            capture_sizes=None,
            spec_method=method if k else None,
            num_speculative_tokens=k or None,
            num_model_steps=None,
        )
        plan = derive_plan(self.launch)
        self.launch_notes = [n for n in plan.notes if "change nothing FastDeploy" in n]
        #: Why FD_CUDAGRAPH_FIT changes nothing in this launch's mode, or "".
        self.fit_scope = plan.fit_scope
        tp = self.launch.tensor_parallel_size
        self.divisor = tp // math.gcd(tp, k + 1) if plan.filtered_for_tp else 1
        role = self.launch.splitwise_role
        self.short = f"filter_capture_size keeps it (TP {tp}, role {role})"
        self.why = (
            f"with sequence-parallel MoE under TP {tp} (role {role}) FastDeploy's "
            f"filter_capture_size keeps only {'token ' if k else ''}sizes divisible by {tp}"
            + (f" (here, running requests divisible by {self.divisor})" if k else "")
        )

    def _config(self, sizes: Iterable[int]) -> tuple[int, ...]:
        """As ``cudagraph_capture_sizes`` takes them: 2.5 takes tokens under speculation."""
        scale = self.k + 1 if self.k and not self.release.scales_user_sizes else 1
        return tuple(size * scale for size in sizes)

    def captured(self, sizes: Iterable[int]) -> list[int]:
        """What FastDeploy captures of ``sizes`` with this launch, in the fit's units."""
        plan = derive_plan(dataclasses.replace(self.launch, capture_sizes=self._config(sizes)))
        return sorted(
            {int(size / (self.k + 1)) for size in plan.capture_sizes if size}, reverse=True
        )

    def warnings(self, sizes: Iterable[int]) -> list[str]:
        """``plan``'s warnings for this launch with ``sizes``: steps it would serve eagerly."""
        plan = derive_plan(dataclasses.replace(self.launch, capture_sizes=self._config(sizes)))
        return [f"with the tuned list, {warning}" for warning in plan.warnings]

    def kept(self, sizes: list[int], what: str, *, refuse: bool) -> list[int]:
        """``sizes`` as FastDeploy keeps them; a tuned list it would cut is refused."""
        try:
            captured = self.captured(sizes)
        except ConfigError as error:
            if not refuse:
                raise
            captured, reason = [], str(error)
        else:
            reason = ""
        lost = sorted(set(sizes) - set(captured))
        if refuse and (lost or reason):
            lost_text = ", ".join(map(str, sorted(lost, reverse=True))) or "every size"
            raise ConfigError(
                f"{what} ({', '.join(map(str, sizes))}) would lose {lost_text} in this launch "
                f"({reason or self.why}); "
                "refused, as it would serve those steps eagerly. Please report it: tune should "
                "not have chosen it."
            )
        return captured

    def default_list(self, seqs: int) -> list[int]:
        plan = derive_plan(dataclasses.replace(self.launch, max_num_seqs=seqs))
        return sorted(
            {int(size / (self.k + 1)) for size in plan.capture_sizes if size}, reverse=True
        )


#: A share of steps at the largest size from which the list is said to be saturated.
SATURATED = 0.2


def _saturation(
    histogram: Mapping[int, int],
    baseline: list[int],
    deployed: list[int],
    cap: int,
    k: int,
    unknown_eager: int,
) -> list[str]:
    """The deployed list's largest size below what the deployment allows, with many steps at
    it or recorded above it: steps there ran eagerly, before the plugin's backend."""
    if not deployed:
        return []
    largest = max(baseline)
    if largest >= cap:
        return []
    above = sum(steps for n, steps in histogram.items() if n > largest)
    above += getattr(histogram, "beyond", 0) + unknown_eager
    served = sum(steps for n, steps in histogram.items() if 0 < n <= largest)
    at = histogram.get(largest, 0)
    recorded = getattr(histogram, "eager_recorded", False)
    if not served or (at / served < SATURATED and not above):
        return []
    total = served + above
    noun = "running requests" if k else "tokens"
    if recorded or above:
        eager = (
            f"{above / total:.1%} of all steps ran eagerly above it ({plural(above, 'step')} of "
            f"{total})"
        )
    else:
        eager = (
            "how many ran eagerly above it is unknown: these stats do not count them (the "
            "plugin writes eager_above_largest from 0.6.0), and a full batch at the cap is how "
            "a capped deployment looks"
        )
    return [
        f"the deployed list ends at {largest} {noun}, below the {cap} this deployment allows, and "
        f"{at / served:.1%} of the steps its graphs served ran at {largest}; {eager}. Steps above "
        "the "
        "largest size run without a graph, before the plugin's backend sees them; the padding "
        "figures count only the steps recorded."
    ]


def _deployed_sizes(deployment: Deployment, k: int, release: Release) -> list[int]:
    """The deployed list in the units the fit uses (running requests under speculative
    decoding: FastDeploy maps ``int(size / (k + 1))`` requests to each token size)."""
    sizes = deployment.capture_sizes
    if not sizes:
        return []
    if k and (deployment.capture_sizes_in_tokens or not release.scales_user_sizes):
        sizes = tuple(int(size / (k + 1)) for size in sizes)
    return sorted({size for size in sizes if size > 0}, reverse=True)


def _traffic(sizes: list[int], kept: Mapping[int, int]) -> list[tuple[int, int]]:
    """The steps that pad to each size, ascending."""
    table = padding_table(sizes)
    steps = dict.fromkeys(sizes, 0)
    for count, number in kept.items():
        if 0 < count < len(table):
            steps[table[count]] += number
    return sorted(steps.items())


def _notes(histogram: Mapping[int, int], k: int, sizes: list[int], top: int, release: Release):
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
            "the launch line's --speculative-config."
        )
    else:
        notes.append(
            f"Serve with --max-num-seqs >= {top}: FastDeploy drops capture sizes above "
            f"min({DECODE_CAP}, max_num_seqs)."
        )
    return notes


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
    if result.max_num_seqs is not None:
        lines.append(f"max_num_seqs: {result.max_num_seqs} (from {result.max_num_seqs_from})")
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
    name = "deployed" if result.baseline_label.startswith("from ") else "default"
    if result.baseline_padded_tokens:
        change = f"{abs(result.reduction):.1%} {'fewer' if result.reduction >= 0 else 'more'}"
    else:
        change = "the same" if result.padded_tokens == 0 else f"the {name} list pads none"
    lines += [
        f"tuned    ({graphs_phrase(len(tuned))}; at most {result.max_graphs}, "
        f"{result.max_graphs_from}): "
        f"{', '.join(map(str, tuned))}",
        f"{name:8s} ({graphs_phrase(len(baseline))}, {result.baseline_label}): "
        f"{', '.join(map(str, baseline))}",
        f"padded tokens: tuned {result.padded_tokens} ({per_step(result.padded_tokens)}), "
        f"{name} {result.baseline_padded_tokens} ({per_step(result.baseline_padded_tokens)}), "
        f"{change}",
    ]
    if result.cap_cost is not None:
        graphs, tokens = result.cap_cost
        lines.append(
            f"the cap of {graphs_phrase(len(tuned))} (--max-graphs) costs "
            f"{result.padded_tokens - tokens} padded tokens against the best "
            f"{graphs_phrase(graphs)} ({tokens}, {per_step(tokens)})"
        )
    if result.kept_by:
        lines.append(f"sizes: {result.kept_by}; every list above is what it keeps")
    if result.baseline_eager_steps:
        lines.append(
            f"above the {name} list's largest size ({max(baseline)}): "
            f"{plural(result.baseline_eager_steps, 'step')}, which it runs without a graph and "
            "the tuned list graphs (their padding is in the tuned figure only)"
        )
    lines.extend(_histogram_lines(result, noun))
    config = f"'{json.dumps(result.graph_optimization_config, separators=(', ', ': '))}'"
    if result.padded_tokens > result.baseline_padded_tokens and not result.baseline_eager_steps:
        # Fewer graphs than the baseline can pad more: say so rather than recommend it.
        lines.append(
            f"keep the {name} list: with {graphs_phrase(len(baseline))} it pads fewer tokens; "
            f"raise --max-graphs to tune within as many. The tuned list, if graph memory matters "
            f"more: --graph-optimization-config {config}"
        )
    elif result.gains_nothing:
        lines.append(
            f"keep the {name} list: the tuned list pads no fewer tokens on this trace "
            f"({result.padded_tokens} against {result.baseline_padded_tokens}) and graphs no "
            f"step the {name} list leaves eager. The tuned list, if graph memory matters more "
            f"and the warnings below do not apply: --graph-optimization-config {config}"
        )
    else:
        lines.append(f"use: --graph-optimization-config {config}")
    if result.fit is not None:
        lines.extend(_fit_lines(result.fit, name, noun))
    lines.extend(f"warning: {warning}" for warning in result.warnings)
    lines.extend(f"note: {note}" for note in [*result.notes, *result.launch_notes])
    return "\n".join(lines)


def _fit_lines(fit: FitResult, name: str, noun: str) -> list[str]:
    """What FD_CUDAGRAPH_FIT would capture after this traffic, its padding, the line to set."""
    head = f"fit      ({fit.env})"
    whole = f"the {name} list's {plural(len(fit.candidates), 'size')}"
    if fit.changes_nothing:
        return [
            f"{head}: changes nothing for this launch: {fit.changes_nothing}, and the option "
            "fits only the decode graphs the plugin captures in dynamic mode"
        ]
    listing = ", ".join(map(str, fit.capture_sizes))
    if fit.kept_because:
        few = fit.steps < fitting.MIN_STEPS
        return [
            f"{head}: {whole}, unchanged ({fit.kept_because}"
            f"{': too little traffic to fit to' if few else ''}): {listing}"
        ]
    else:
        per_step = fit.steps or 1
        extra = fit.padded_tokens - fit.baseline_padded_tokens
        if not extra:
            change = "the same"
        elif fit.baseline_padded_tokens:
            change = f"{extra / fit.baseline_padded_tokens:.1%} more"
        else:
            change = f"the {name} list pads none"
        lines = [
            f"{head}: {len(fit.capture_sizes)} of {whole}, its largest kept: {listing} (a fit "
            "over the list this launch captures now, not over the tuned one)",
            f"padded tokens: fit {fit.padded_tokens} ({fit.padded_tokens / per_step:.3f} per "
            f"step), {name} {fit.baseline_padded_tokens} "
            f"({fit.baseline_padded_tokens / per_step:.3f} per step) on the same "
            f"{plural(fit.steps, 'step')} up to {plural(max(fit.candidates), noun)}, {change}",
        ]
    if len(fit.capture_sizes) == len(fit.candidates):
        return lines  # the option would capture what is captured now: nothing to set
    lines.append(
        f"set: {fit.env} in the server's environment to capture "
        f"{len(fit.capture_sizes)} graphs instead of {len(fit.candidates)} at each recapture "
        f"after a lifecycle call, for {change} padded tokens on traffic like this; the first "
        "capture at start makes the whole list, or fits to what FD_CUDAGRAPH_STATS_FILE "
        "recorded of the same plan at earlier starts"
    )
    return lines


#: Widest bar of the traffic histogram.
_BAR = 40


def _histogram_lines(result: TuneResult, noun: str) -> list[str]:
    """The trace's steps against the tuned sizes: how many pad to each, as a bar."""
    total = result.steps + result.eager_above_max
    rows = [(f"{size:>6}", steps) for size, steps in result.traffic]
    if result.eager_above_max:
        rows.append((f">{result.max_size:<5}", result.eager_above_max))
    most = max((steps for _, steps in rows), default=0) or 1
    lines = [f"steps per tuned size (the {noun}s of each step, padded up to it):"]
    for label, steps in rows:
        bar = "#" * max(1 if steps else 0, round(_BAR * steps / most))
        eager = "  (eager)" if label.startswith(">") else ""
        lines.append(f"  {label} {steps:>10} {steps / total:6.1%} {bar}{eager}")
    return lines


def run_tune(args: Any) -> TuneResult:
    """``fd-cudagraph tune``: read the traces, take the deployment from the launch line and the
    stats files (a setting both give with two values is an error naming both), tune."""
    launch = read(args.launch, args.fastdeploy_version)
    histogram = read_histogram(args.trace)
    # k as plan takes it (its refusals included). A plain trace holds running requests only where
    # the release keys this method's graphs by them; elsewhere (ngram on 2.6) by token count.
    release = release_rules(args.fastdeploy_version)
    speculative = launch.spec_method is not None or launch.num_speculative_tokens is not None
    k = effective_k(release, launch) if speculative else 0
    if launch.spec_method not in release.scaling_methods:
        k = 0
    return tune(
        histogram,
        args.max_graphs,
        args.max_size,
        k or None,
        fastdeploy_version=args.fastdeploy_version,
        deployment=_deployment(launch, histogram),
        launch=launch,
        fit=getattr(args, "fit", None),
    )


def _deployment(launch: PlanInput, histogram: Histogram) -> Deployment:
    seqs, seqs_from = histogram.max_num_seqs, histogram.max_num_seqs_from
    if "max_num_seqs" in launch.given:
        if seqs is not None and seqs != launch.max_num_seqs:
            raise ConfigError(
                f"--max-num-seqs {launch.max_num_seqs} and {seqs_from} (max_num_seqs {seqs}) "
                "disagree; leave the flag out, or tune the stats of that deployment."
            )
        seqs, seqs_from = launch.max_num_seqs, seqs_from or "--max-num-seqs"
    sizes, sizes_from = histogram.capture_sizes, histogram.capture_sizes_from
    in_tokens = sizes is not None
    if launch.capture_sizes is not None:
        given = tuple(sorted(set(launch.capture_sizes), reverse=True))
        flag = SPELLING["capture_sizes"]
        if sizes is not None and sizes != given:
            raise ConfigError(
                f"{flag} {_joined(given)} and {sizes_from} (capture_sizes "
                f"{','.join(map(str, sizes))}) disagree; leave it out, or tune the stats "
                "of that deployment."
            )
        if sizes is None:
            sizes, sizes_from, in_tokens = given, flag, False
    return Deployment(seqs, seqs_from, sizes, sizes_from, in_tokens)
