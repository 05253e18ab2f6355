"""``fd-cudagraph plan``: the capture sizes and padding maps FastDeploy will derive, before serving.

The lists and maps come from FastDeploy itself where it is importable and is the release asked
for (``installed.py``: its own ``FDConfig`` computes them, so the plan cannot drift from it), and
otherwise from the project's copy of each release's rules (``capture_rules.py``); the plan's first
line says which, and why. ``--fastdeploy-version`` picks the release (default: the installed
FastDeploy's, else develop).

What the plan adds is the plugin's side: how many graphs each backend captures in which mode, per
release (2.4 routes ``cudagraph_only_prefill`` steps to the backend; from 2.5 only static split
mode does, so elsewhere that mode captures nothing), and the padding the plugin really uses.
FastDeploy builds ``real_shape_to_captured_size`` before ``filter_capture_size`` removes sizes
(sequence-parallel MoE), so its map can name graphs that do not exist; the plugin pads through
the lists as they are, and that is the map printed (``--json`` has both).

FastDeploy's own limits are enforced with an error naming the flag, which also bounds this
command's work: ``max_num_seqs`` at most 256 (2.4, 2.5) or 512 (2.6, develop; ``FDConfig.check``),
``num_speculative_tokens`` in 1..5 for mtp, ngram and suffix
(``SpeculativeConfig.check_legality_parameters``), and an even ``max_num_seqs x (k + 1)`` where
2.4 and 2.5 assert it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.fit import MIN_STEPS, Budget
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.sizes import padding_table, table_disagreements
from fd_cudagraph_plugin.tools import capture_rules
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    DRAFT_MODEL_METHODS,
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    MAX_TENSOR_PARALLEL_SIZE,
    SPEC_METHODS,
    SPLITWISE_ROLES,
    Derived,
    Release,
    ServingSettings,
    bad_k,
)
from fd_cudagraph_plugin.tools.installed import (
    FastDeployRefused,
    InstalledFastDeploy,
    derive_with_fastdeploy,
    installed_fastdeploy,
    release_rules,
)
from fd_cudagraph_plugin.tools.launch import SPELLING, PlanInput
from fd_cudagraph_plugin.tools.wording import plural, shown

#: The ``format`` of ``plan --json``; a change that drops or renames a key bumps it.
PLAN_FORMAT = "fd-cudagraph-plan/1"


@dataclass(frozen=True)
class BackendPlan:
    """What one graph backend (one decorated model) captures and how it serves each step kind."""

    name: str
    decode_graphs: int
    prefill_graphs: int
    decode: str
    prefill: str

    @property
    def graphs(self) -> int:
        return self.decode_graphs + self.prefill_graphs


@dataclass(frozen=True)
class Plan:
    inputs: PlanInput
    #: The release whose rules applied (``capture_rules.RELEASES``).
    release: str
    #: Where the lists come from, for the first line of the plan.
    rules: str
    #: True when the installed FastDeploy's own ``FDConfig`` computed them.
    from_fastdeploy: bool
    mode: str
    num_speculative_tokens: int
    draft_model_use_cudagraph: bool
    capture_sizes: list[int]
    #: None on 2.4, which has no prefill capture list.
    capture_sizes_prefill: list[int] | None
    #: FastDeploy's maps, as its config holds them (built before ``filter_capture_size``).
    real_shape_to_captured_size: dict[int, int]
    real_shape_to_captured_size_prefill: dict[int, int]
    real_bsz_to_captured_size: dict[int, int]
    #: The plugin's padding, from the lists as they are: token count -> decode graph size,
    #: prefill tokens -> prefill graph size, running requests (1..max_num_seqs) -> graph size.
    padding: dict[int, int]
    padding_prefill: dict[int, int]
    padding_running: dict[int, int]
    #: True when ``filter_capture_size`` kept only the sizes divisible by tp.
    filtered_for_tp: bool
    backends: list[BackendPlan]
    #: False on a prefill node without ``cudagraph_only_prefill``: FastDeploy captures nothing.
    use_cudagraph: bool = True
    #: ``(tokens, FastDeploy's size, the plugin's size)`` where FastDeploy's map is stale.
    stale_padding: list[tuple[int, int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: What makes the deployment serve steps eagerly that a graph could serve.
    warnings: list[str] = field(default_factory=list)
    #: The plugin's own mode for these lists (``core.mode.Mode``): which graphs a fit may shrink.
    capture_mode: Mode | None = field(default=None, repr=False, compare=False)
    #: ``FD_CUDAGRAPH_FIT`` as the environment set it (None: off), said in a note.
    fit: Budget | None = None

    @property
    def fit_scope(self) -> str:
        """Why ``FD_CUDAGRAPH_FIT`` changes nothing in this plan (``Mode.fittable`` is false:
        not dynamic mode's decode graphs); empty where it may capture fewer of them."""
        mode = self.capture_mode
        if not self.use_cudagraph:
            return "use_cudagraph is off, so FastDeploy captures no graph"
        if mode is None or mode.fittable:
            return ""
        if mode.only_prefill:
            return "with cudagraph_only_prefill no decode graph is captured"
        return f"this is {self.mode} mode"

    @property
    def total_graphs(self) -> int:
        return sum(backend.graphs for backend in self.backends)

    def to_json(self) -> dict:
        def keyed(mapping: dict[int, int]) -> dict[str, int]:
            return {str(key): value for key, value in mapping.items()}

        return {
            "format": PLAN_FORMAT,
            "fastdeploy_version": self.release,
            "fastdeploy_version_asked": self.inputs.fastdeploy_version,
            "rules_branch": capture_rules.RULES[self.release].branch,
            "rules_commit": capture_rules.RULES[self.release].commit,
            "rules": "fastdeploy" if self.from_fastdeploy else "copy",
            "settings": {
                "max_num_seqs": self.inputs.max_num_seqs,
                "spec_method": self.inputs.spec_method,
                "num_speculative_tokens": self.num_speculative_tokens,
                "tensor_parallel_size": self.inputs.tensor_parallel_size,
                "sequence_parallel_moe": self.inputs.sequence_parallel_moe,
                "graph_opt_level": self.inputs.graph_opt_level,
                "full_cuda_graph": self.inputs.full_cuda_graph,
                "cudagraph_only_prefill": self.inputs.only_prefill,
                "max_capture_shape_prefill": self.inputs.prefill_shape,
                "splitwise_role": self.inputs.splitwise_role,
                "draft_model_use_cudagraph": self.draft_model_use_cudagraph,
                "use_cudagraph_given": self.inputs.use_cudagraph,
            },
            "use_cudagraph": self.use_cudagraph,
            "mode": self.mode,
            "cudagraph_capture_sizes": self.capture_sizes,
            "cudagraph_capture_sizes_prefill": self.capture_sizes_prefill,
            "real_shape_to_captured_size": keyed(self.real_shape_to_captured_size),
            "real_shape_to_captured_size_prefill": keyed(self.real_shape_to_captured_size_prefill),
            "real_bsz_to_captured_size": keyed(self.real_bsz_to_captured_size),
            "padding": keyed(self.padding),
            "padding_prefill": keyed(self.padding_prefill),
            "padding_running_requests": keyed(self.padding_running),
            "filtered_for_tensor_parallel": self.filtered_for_tp,
            "stale_padding": [list(entry) for entry in self.stale_padding],
            "backends": [
                {
                    "name": b.name,
                    "graphs": b.graphs,
                    "decode_graphs": b.decode_graphs,
                    "prefill_graphs": b.prefill_graphs,
                    "decode": b.decode,
                    "prefill": b.prefill,
                }
                for b in self.backends
            ],
            "total_graphs": self.total_graphs,
            "fit": None
            if self.fit is None
            else {"option": f"FD_CUDAGRAPH_FIT={self.fit}", "applies": not self.fit_scope},
            "warnings": self.warnings,
            "notes": self.notes,
        }


# ------------------------------------------------------------------ validation


def check_count(flag: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}; got {shown(value)}.")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{flag} must be at most {maximum}; got {shown(value)}.")
    return value


def _check_sizes(flag: str, sizes: tuple[int, ...] | None) -> list[int] | None:
    if sizes is None:
        return None
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    if not sizes or bad:
        raise ConfigError(
            f"{flag} must be a non-empty list of positive integers; got {shown(list(sizes))}, "
            "such as [1, 2, 4, 8]."
        )
    return list(sizes)


def effective_k(release: Release, inputs: PlanInput) -> int:
    """``num_speculative_tokens`` as FastDeploy's ``SpeculativeConfig`` leaves it."""
    method, k = inputs.spec_method, inputs.num_speculative_tokens
    if method is None:
        if k is not None:
            raise ConfigError(
                f"{SPELLING['num_speculative_tokens']} {k} needs a method (mtp, ngram or "
                "suffix): without one FastDeploy serves no draft tokens and ignores it."
            )
        return 0
    if method not in SPEC_METHODS:
        raise ConfigError(
            f"{SPELLING['spec_method']} must be one of {', '.join(SPEC_METHODS)}; got "
            f"{shown(method)}. "
            "Leave it out when serving without speculative decoding."
        )
    if method not in release.spec_methods:
        raise ConfigError(
            f"{SPELLING['spec_method']} {method}: FastDeploy {release.name} has no such method "
            "(it has "
            f"{', '.join(release.spec_methods)}). Pick another --fastdeploy-version or method."
        )
    if method == "naive":
        if k:
            raise ConfigError(
                f"{SPELLING['num_speculative_tokens']} {k} with method naive: FastDeploy's NAIVE "
                "has no draft tokens (SpeculativeConfig resets k to 0). Leave "
                "num_speculative_tokens out."
            )
        return 0
    steps = inputs.num_model_steps
    if steps is not None and method != "mtp":
        raise ConfigError(
            f"--speculative-config num_model_steps {steps} is read by MTP only; with method "
            f"{method} FastDeploy ignores it. Leave it out."
        )
    if k is None:
        k = 1
    elif bad_k(k):
        raise ConfigError(
            f"{SPELLING['num_speculative_tokens']} must be an integer in "
            f"1..{MAX_SPECULATIVE_TOKENS} for "
            f"{method}, FastDeploy's range (SpeculativeConfig refuses others); got {shown(k)}."
        )
    # SpeculativeConfig raises k to num_model_steps for MTP.
    return max(k, steps or 1)


def _validate(release: Release, inputs: PlanInput) -> ServingSettings:
    """The settings as FastDeploy would take them, or a ``ConfigError`` naming the flag."""
    max_num_seqs = check_count("--max-num-seqs", inputs.max_num_seqs, 1)
    if max_num_seqs > release.max_num_seqs:
        raise ConfigError(
            f"--max-num-seqs must be at most {release.max_num_seqs} on FastDeploy "
            f"{release.name} (FDConfig.check asserts max_num_seqs <= {release.max_num_seqs}); "
            f"got {max_num_seqs}."
        )
    tp = check_count(
        "--tensor-parallel-size", inputs.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL_SIZE
    )
    prefill_cap = check_count(
        SPELLING["max_capture_shape_prefill"], inputs.prefill_shape, 1, MAX_PREFILL_SHAPE
    )
    if inputs.splitwise_role not in SPLITWISE_ROLES:
        raise ConfigError(
            f"--splitwise-role must be one of {', '.join(SPLITWISE_ROLES)}; got "
            f"{inputs.splitwise_role!r}."
        )
    if inputs.graph_opt_level not in (0, 1, 2):
        raise ConfigError(
            f"{SPELLING['graph_opt_level']} must be 0, 1 or 2; got "
            f"{shown(inputs.graph_opt_level)}. "
            "0 is dynamic, 1 static (SOT), 2 static with CINN."
        )
    user_decode = _check_sizes(SPELLING["capture_sizes"], inputs.capture_sizes)
    user_prefill = _check_sizes(SPELLING["capture_sizes_prefill"], inputs.capture_sizes_prefill)
    k = effective_k(release, inputs)
    draft = inputs.draft_model_use_cudagraph
    if draft is not None and inputs.spec_method not in DRAFT_MODEL_METHODS:
        given = f"method {inputs.spec_method}" if inputs.spec_method else "no method"
        raise ConfigError(
            f"{SPELLING['draft_model_use_cudagraph']} {str(draft).lower()}: only an MTP draft "
            f"model reads it; with {given} in {SPELLING['spec_method'].split()[0]} FastDeploy "
            'builds no draft model and ignores it. Leave it out, or give "method": "mtp".'
        )
    odd = capture_rules.check_even_token_cap(release, inputs.spec_method, k, max_num_seqs)
    if odd:
        raise ConfigError(odd)
    return ServingSettings(
        max_num_seqs=max_num_seqs,
        method=inputs.spec_method,
        k=k,
        tensor_parallel_size=tp,
        sequence_parallel_moe=inputs.sequence_parallel_moe,
        graph_opt_level=inputs.graph_opt_level,
        full_cuda_graph=inputs.full_cuda_graph,
        only_prefill=inputs.only_prefill,
        capture_sizes=user_decode,
        capture_sizes_prefill=user_prefill,
        max_capture_shape_prefill=prefill_cap,
        splitwise_role=inputs.splitwise_role,
        draft_model_use_cudagraph=inputs.draft_model_use_cudagraph,
        use_cudagraph=inputs.use_cudagraph,
        expert_parallel=inputs.expert_parallel,
        dynamic_load_weight=inputs.dynamic_load_weight,
        host_cache=inputs.host_cache,
    )


def _mode(release: Release, graph_opt_level: int, full_cuda_graph: bool) -> str:
    if graph_opt_level == 0:
        return "dynamic"
    if not release.has_prefill_list:
        return "static (FastDeploy 2.4)"
    return "static full" if full_cuda_graph else "static split"


def _decode_cap(release: Release, s: ServingSettings) -> tuple[int, int, str]:
    """The largest decode size in tokens, the factor FastDeploy multiplies user sizes by, and how
    it computes the cap."""
    scaling = s.method in release.scaling_methods and s.k > 0
    if release.scales_user_sizes:  # init_with_cudagrpah_size scales the cap and the sizes
        scale = s.k + 1 if scaling else 1
        base, formula = (
            (DECODE_CAP, "512 (cudagraph_only_prefill)")
            if s.only_prefill
            else (min(DECODE_CAP, s.max_num_seqs), "min(512, max_num_seqs)")
        )
        return base * scale, scale, formula + (" x (k + 1)" if scale > 1 else "")
    if s.only_prefill:  # 2.4 and 2.5 set 512 after scaling
        return DECODE_CAP, 1, "512 (cudagraph_only_prefill)"
    cap = s.max_num_seqs * (s.k + 1) if scaling else s.max_num_seqs
    if release.caps_speculative_at_512:
        formula = "min(512, max_num_seqs" + (" x (k + 1))" if scaling else ")")
        return min(DECODE_CAP, cap), 1, formula
    return cap, 1, "max_num_seqs" + (" x (k + 1)" if scaling else "")


# ------------------------------------------------------------------ the plan


@dataclass
class _Source:
    """The derivation in use and what the plan says about where it came from."""

    derived: Derived
    rules: str
    from_fastdeploy: bool
    draft_default: bool
    notes: list[str]


def _rules_name(release: Release, version: str | None) -> str:
    """``FastDeploy 2.6 rules``, with the version asked for where it is not the rules' name."""
    name = f"FastDeploy {release.name} rules"
    asked = (version or "").strip()
    if asked and asked.lower() != release.name:
        name += f" (for fastdeploy-gpu {asked})"
    return name


def _source(
    release: Release,
    s: ServingSettings,
    installed: InstalledFastDeploy | None,
    asked: bool,
    inputs: PlanInput,
) -> _Source:
    """FastDeploy's own derivation where it is importable and is ``release``, else the project's
    copy of its rules; ``inputs.read_by`` says which parser read the launch line."""
    copy = capture_rules.derive(release, s)
    name = _rules_name(release, inputs.fastdeploy_version)
    read = f"; {inputs.read_by}" if inputs.read_by else ""
    if installed is None:
        why = "FastDeploy is not importable here" if asked else "asked for the copy"
    elif installed.problem:
        why = f"importing the installed FastDeploy failed: {installed.problem}"
    elif installed.release != release.name:
        why = f"the installed FastDeploy {installed.version} follows {installed.release}'s rules"
    else:
        try:
            theirs, draft_default = derive_with_fastdeploy(installed, s)
        except FastDeployRefused as error:
            raise ConfigError(
                f"FastDeploy {installed.version} refuses these settings: {error}"
            ) from None
        except Exception as error:  # an FDConfig that wants more than a plan has
            why = (
                "the installed FastDeploy's FDConfig could not be built here: "
                f"{type(error).__name__}: {error}"
            )
        else:
            if theirs.use_cudagraph or not copy.use_cudagraph:
                rules = (
                    f"{name}, computed by the installed FastDeploy's own FDConfig (version "
                    f"{installed.version}){read}"
                )
                # FastDeploy keeps no trace of filter_capture_size: the rules say whether it ran.
                derived = dataclasses.replace(theirs, filtered=copy.filtered)
                return _Source(derived, rules, True, draft_default, [])
            why = (
                "the installed FastDeploy turns use_cudagraph off on this machine's platform; "
                "the plan is a CUDA machine's"
            )
    rules = f"{name}, from the project's copy ({why}){read}"
    return _Source(copy, rules, False, release.draft_model_use_cudagraph, [])


def derive_plan(
    inputs: PlanInput, *, use_fastdeploy: bool = True, fit: Budget | None = None
) -> Plan:
    """What FastDeploy's ``FDConfig`` computes for these settings, plus what is captured.

    ``use_fastdeploy=False`` uses the project's copy of the rules even where FastDeploy is
    importable (the tests compare the two). ``fit``: ``FD_CUDAGRAPH_FIT`` (read by the command
    with ``read_option``), whose effect on these lists a note says.
    """
    installed = installed_fastdeploy() if use_fastdeploy else None
    release = release_rules(inputs.fastdeploy_version, installed)
    s = _validate(release, inputs)
    source = _source(release, s, installed, use_fastdeploy, inputs)
    derived, notes = source.derived, source.notes
    mode = _mode(release, derived.graph_opt_level, inputs.full_cuda_graph)
    # What postprocess changed is what FastDeploy serves with: describe the backends from it.
    served = dataclasses.replace(
        inputs, graph_opt_level=derived.graph_opt_level, only_prefill=derived.only_prefill
    )
    prefill = derived.capture_sizes_prefill
    # A 0 in the list (2.4 under expert parallelism) is no graph: the plugin drops it.
    decode = [size for size in derived.capture_sizes if size]
    if len(decode) < len(derived.capture_sizes):
        notes.append(
            f"FastDeploy {release.name} puts 0 first in cudagraph_capture_sizes under expert "
            "parallelism (use_ep); the plugin drops it (a 0-token step runs eagerly)."
        )
    cap, scale, formula = _decode_cap(release, s)
    if s.capture_sizes is not None:
        dropped = sorted({size * scale for size in s.capture_sizes if size * scale > cap})
        if dropped:
            notes.append(
                f"cudagraph_capture_sizes: FastDeploy drops {_listing(dropped)}, above the "
                f"decode cap {formula} = {cap}."
            )
    notes.extend(inputs.given_notes)
    steps = inputs.num_model_steps
    if steps and s.k == steps != (inputs.num_speculative_tokens or 1):
        notes.append(
            f"num_model_steps {inputs.num_model_steps} raises num_speculative_tokens to "
            f"{s.k} (SpeculativeConfig, for MTP)."
        )
    if not inputs.use_cudagraph and s.splitwise_role != "prefill":
        notes.append(
            "use_cudagraph is false: FastDeploy captures no graph and never calls the backend; "
            "the lists above are what it would derive."
        )
    _size_notes(notes, release, inputs, mode, s, prefill)
    _list_notes(notes, release, s, derived)
    _postprocess_notes(notes, release, inputs, derived)
    if not decode:
        noun = "request" if scale > 1 else "token"
        raise ConfigError(
            "no decode capture size is left: FastDeploy would build an empty "
            "cudagraph_capture_sizes and GraphOptBackend fails on its first call. "
            f"Give {SPELLING['capture_sizes']} at or below {plural(cap // scale, noun)}"
            + (f" divisible by {s.tensor_parallel_size}" if derived.filtered else "")
            + ", or raise --max-num-seqs."
        )

    table = padding_table(decode)
    # Token counts above the new largest size never reach the backend (GraphOptBackend runs them
    # eagerly), so only the ones below it are stale in a way that matters.
    stale = [
        entry
        for entry in table_disagreements(table, derived.real_shape_to_captured_size)
        if entry[2] > 0
    ]
    padding_running = _running_padding(derived.real_bsz_to_captured_size, table, s.max_num_seqs)
    _stale_notes(notes, derived, stale, padding_running, s.max_num_seqs)
    warnings = _largest_warnings(release, s, derived, decode, padding_running)
    prefill_sizes = (
        (prefill or []) if mode == "static split" else decode if derived.only_prefill else []
    )

    draft = source.draft_default
    if inputs.draft_model_use_cudagraph is not None:
        draft = inputs.draft_model_use_cudagraph
    backend = {
        "release": release,
        "inputs": served,
        "mode": mode,
        "decode": decode,
        "prefill": prefill,
        "by_running": bool(padding_running),
        "graphs": derived.use_cudagraph,
    }
    backends = [_describe_backend("target model", **backend)]
    default = str(release.draft_model_use_cudagraph).lower()
    if s.method == "mtp" and draft:
        backends.append(_describe_backend("MTP draft model", **backend, draft=True))
        notes.append(
            "The MTP draft model has its own backend with the same lists "
            f"(draft_model_use_cudagraph true; FastDeploy {release.name}'s default is {default})."
        )
    elif s.method == "mtp":
        notes.append(
            f"draft_model_use_cudagraph is false (FastDeploy {release.name}'s default is "
            f"{default}): the MTP draft model runs eagerly."
        )
    capture_mode = Mode.of(
        SimpleNamespace(
            graph_opt_level=derived.graph_opt_level,
            full_cuda_graph=inputs.full_cuda_graph,
            only_prefill=derived.only_prefill,
            fastdeploy_2_4=not release.has_prefill_list,
            speculative_method=s.method,
            capture_sizes=tuple(sorted(set(decode), reverse=True)),
            prefill_sizes=tuple(sorted({size for size in prefill or () if size}, reverse=True)),
            decode_table=tuple(table),
            bsz_table=tuple(padding_running.values()),  # what decides keyed_by_running
        )
    )
    plan = Plan(
        inputs=inputs,
        release=release.name,
        rules=source.rules,
        from_fastdeploy=source.from_fastdeploy,
        mode=mode,
        num_speculative_tokens=s.k,
        draft_model_use_cudagraph=draft,
        capture_sizes=derived.capture_sizes,
        capture_sizes_prefill=prefill,
        real_shape_to_captured_size=derived.real_shape_to_captured_size,
        real_shape_to_captured_size_prefill=derived.real_shape_to_captured_size_prefill,
        real_bsz_to_captured_size=derived.real_bsz_to_captured_size,
        padding=dict(enumerate(table)),
        padding_prefill=dict(enumerate(padding_table(prefill_sizes))) if prefill_sizes else {},
        padding_running=padding_running,
        filtered_for_tp=derived.filtered,
        backends=backends,
        use_cudagraph=derived.use_cudagraph,
        stale_padding=stale,
        notes=notes,
        warnings=warnings,
        capture_mode=capture_mode,
        fit=fit,
    )
    if fit is not None:
        notes.append(_fit_note(plan, fit, len(backends)))
    return plan


def _fit_note(plan: Plan, fit: Budget, backends: int) -> str:
    """What ``FD_CUDAGRAPH_FIT`` does with this plan's decode list (``core/fit.py``): a subset
    of it at each recapture after a lifecycle call, in dynamic mode's decode graphs only."""
    option = f"FD_CUDAGRAPH_FIT={fit}"
    where = "the decode graphs the plugin captures in dynamic mode (graph_opt_level 0)"
    if plan.fit_scope:
        return f"{option} changes nothing here: {plan.fit_scope}, and it fits only {where}."
    decode = sorted({size for size in plan.capture_sizes if size}, reverse=True)
    budget = (
        f"at most {graphs_phrase(fit.graphs)}"
        if fit.graphs
        else f"with the fewest graphs whose padding on those steps is at most {fit.padding:g}% "
        "above the whole list's"
    )
    keyed = plan.capture_mode is not None and plan.capture_mode.keyed_by_running
    keyed_text = " Steps are counted by running requests." if keyed else ""
    draft = " The MTP draft model captures the same sizes." if backends > 1 else ""
    ranks = " Rank 0's traffic decides." if plan.inputs.tensor_parallel_size > 1 else ""
    return (
        f"{option} (it fits {where}, as here): each recapture after a lifecycle call (a wake-up, "
        "a weight update) captures the subset of the decode list above that pads the decode "
        f"steps served since the last capture least, {budget}, always with its largest size, "
        f"{decode[0]} (a step whose size is left out pads to the next size kept: none runs "
        f"eagerly that had a graph); after fewer than {MIN_STEPS} decode steps, the whole list "
        f"({plural(len(decode), 'size')}). The first capture at start makes the whole list, or "
        "fits to what FD_CUDAGRAPH_STATS_FILE recorded of this same plan at earlier starts where "
        f"it holds {MIN_STEPS} steps or more.{keyed_text}{draft}{ranks}"
    )


def _running_padding(bsz_map: dict[int, int], table: list[int], max_num_seqs: int) -> dict:
    """The plugin's key table under speculative decoding (``Settings.bsz_table``): each running-
    request count of FastDeploy's map, up to ``max_num_seqs``, to the graph its size pads to.
    Counts whose size no graph holds are left out: the plugin pads those steps by token count."""
    return {
        bsz: table[size]
        for bsz, size in bsz_map.items()
        if 0 < bsz <= max_num_seqs and 0 < size < len(table)
    }


def _stale_notes(
    notes: list[str],
    derived: Derived,
    stale: list[tuple[int, int, int]],
    padding_running: dict[int, int],
    max_num_seqs: int,
) -> None:
    if stale:
        sizes = sorted({theirs for _, theirs, _ in stale})
        notes.append(
            f"FastDeploy's real_shape_to_captured_size was built before filter_capture_size and "
            f"still maps {plural(len(stale), 'token count')} to removed "
            f"{'size' if len(sizes) == 1 else 'sizes'} {_listing(sizes)}; its own "
            "backend would fail there. The plugin pads through the filtered list, as printed."
        )
    stale_running = [
        bsz
        for bsz, size in derived.real_bsz_to_captured_size.items()
        if 0 < bsz <= max_num_seqs and padding_running.get(bsz) != size
    ]
    if stale_running:
        notes.append(
            "FastDeploy's real_bsz_to_captured_size maps "
            f"{plural(len(stale_running), 'running-request count')} to sizes that are not "
            "captured; the plugin pads them to the next captured "
            "size, or by token count where no graph holds them."
        )


def _size_notes(
    notes: list[str],
    release: Release,
    inputs: PlanInput,
    mode: str,
    s: ServingSettings,
    prefill: list[int] | None,
) -> None:
    """What happened to the sizes the user gave."""
    if not release.has_prefill_list:
        ignored = [
            flag
            for flag, given in (
                ("cudagraph_capture_sizes_prefill", inputs.capture_sizes_prefill is not None),
                ("max_capture_shape_prefill", inputs.max_capture_shape_prefill is not None),
                ("full_cuda_graph false", not inputs.full_cuda_graph),
            )
            if given
        ]
        if ignored:
            notes.append(
                "FastDeploy 2.4 has no prefill capture list and no static split mode: "
                f"{', '.join(ignored)} change nothing there."
            )
        return
    user_decode, user_prefill = s.capture_sizes, s.capture_sizes_prefill
    if user_decode is None and user_prefill is not None:
        notes.append(
            "cudagraph_capture_sizes_prefill is replaced by FastDeploy's automatic list when "
            "cudagraph_capture_sizes is not given; give cudagraph_capture_sizes too to keep it."
        )
    keeps_default = mode == "static split" and user_decode is not None and user_prefill is None
    if keeps_default and s.max_capture_shape_prefill > 8:
        notes.append(
            "static split with user cudagraph_capture_sizes keeps cudagraph_capture_sizes_"
            f"prefill at [8, 4, 2, 1]: prefill steps of 9..{s.max_capture_shape_prefill} tokens "
            "make FastDeploy's backend raise KeyError (the plugin runs them eagerly). Set "
            "cudagraph_capture_sizes_prefill too."
        )
    dropped = sorted({size for size in user_prefill or () if size > s.max_capture_shape_prefill})
    if dropped and user_decode is not None:
        notes.append(
            f"cudagraph_capture_sizes_prefill: FastDeploy drops {_listing(dropped)}, above "
            f"max_capture_shape_prefill = {s.max_capture_shape_prefill}."
        )
    repeated = sorted({size for size in prefill or () if prefill.count(size) > 1})
    if repeated and mode == "static split":
        notes.append(
            f"cudagraph_capture_sizes_prefill holds {_listing(repeated)} twice (FastDeploy does "
            "not deduplicate it); one graph per distinct size."
        )


def _list_notes(notes: list[str], release: Release, s: ServingSettings, derived: Derived) -> None:
    """The release's speculative scaling, the splitwise role and sequence-parallel MoE."""
    if s.method in ("mtp", "ngram", "suffix"):
        if release.generation == "2.4" and s.method == "mtp":
            notes.append(
                "FastDeploy 2.4 multiplies only the decode cap by k + 1 for mtp, not the sizes, "
                "and builds no real_bsz_to_captured_size: graphs are keyed by token count."
            )
        elif release.generation == "2.5":
            within = "within 512" if release.caps_speculative_at_512 else "without 512"
            keyed = (
                ""
                if release.has_bsz_map
                else "; it builds no real_bsz_to_captured_size: graphs are keyed by token count"
            )
            notes.append(
                f"FastDeploy {release.name} multiplies the automatic sizes by k + 1 for every "
                f"method, and the decode cap ({within}) only for "
                f"{' and '.join(release.scaling_methods)}; user-given cudagraph_capture_sizes are "
                f"tokens, as given{keyed}."
            )
        elif s.method not in release.scaling_methods:
            notes.append(
                f"FastDeploy {release.name} does not scale capture sizes for {s.method}: its "
                "graphs are keyed by token count."
            )
    if s.splitwise_role == "prefill" and not derived.use_cudagraph:
        notes.append(
            "splitwise_role prefill sets use_cudagraph to cudagraph_only_prefill (false): this "
            "node captures no graph; give cudagraph_only_prefill true to graph its prefill steps."
        )
    if (
        release.has_prefill_list
        and s.splitwise_role == "prefill"
        and s.method == "mtp"
        and s.k != 1
    ):
        notes.append(
            f"an MTP prefill node resets num_speculative_tokens to 1 after the sizes were scaled "
            f"by k + 1 = {s.k + 1}."
        )
    tp = s.tensor_parallel_size
    if not (s.sequence_parallel_moe and derived.use_cudagraph):
        return
    if s.splitwise_role == "mixed" and not release.filters_before_roles:
        notes.append(
            "sequence-parallel MoE: FastDeploy turns it off in the mixed role with CUDA graphs "
            "before filter_capture_size, so no size is filtered (--splitwise-role decode "
            "filters)."
        )
    elif s.max_num_seqs < tp:
        notes.append(
            f"sequence-parallel MoE: FastDeploy disables it because max_num_seqs "
            f"{s.max_num_seqs} < tensor_parallel_size {tp}."
        )
    elif derived.filtered:
        # The maps were built before the filter: their values are the sizes before it.
        removed = sorted(set(derived.real_shape_to_captured_size.values()) - {0})
        removed = [size for size in removed if size % tp]
        what = f"decode sizes {_listing(removed) or 'none'}"
        if derived.capture_sizes_prefill is not None:
            before = set(derived.real_shape_to_captured_size_prefill.values()) - {0}
            what += f" and prefill sizes {_listing(sorted(x for x in before if x % tp)) or 'none'}"
        order = (
            " (FastDeploy 2.4 filters before the mixed role turns it off)"
            if release.filters_before_roles and s.splitwise_role == "mixed"
            else ""
        )
        notes.append(
            f"sequence-parallel MoE with TP {tp}: filter_capture_size removes {what} (not "
            f"divisible by {tp}) after the padding maps were built{order}."
        )


def _postprocess_notes(
    notes: list[str], release: Release, inputs: PlanInput, derived: Derived
) -> None:
    """What ``FDConfig.postprocess`` changed of what was asked: the level and only-prefill."""
    if inputs.dynamic_load_weight:
        was = (
            f"graph_opt_level {inputs.graph_opt_level} becomes 0"
            if inputs.graph_opt_level
            else "graph_opt_level stays 0"
        )
        notes.append(
            f"--dynamic-load-weight: FastDeploy sets graph_opt_level to 0 for RL weight loading "
            f"on every release ({was}, dynamic mode); the plugin recaptures after a weight "
            "update or wake-up that moved what its graphs read."
        )
    if inputs.only_prefill and inputs.host_cache:
        if derived.only_prefill:
            notes.append(
                f"--swap-space: FastDeploy {release.name} keeps cudagraph_only_prefill with a host "
                "cache (only develop, r3_mm_dev, turns it off)."
            )
        else:
            notes.append(
                f"--swap-space: FastDeploy {release.name} turns cudagraph_only_prefill off with a "
                'host cache ("Layer-by-layer swap-in is incompatible with CUDA Graph prefill '
                'capture") after the decode list was built for it, so it captures decode graphs '
                "up to 512 tokens whatever max_num_seqs is (where the swap space holds at least "
                "one KV block of the model)."
            )


def _largest_warnings(
    release: Release,
    s: ServingSettings,
    derived: Derived,
    decode: list[int],
    padding_running: dict[int, int],
) -> list[str]:
    """Steps a graph could serve that run eagerly because the largest size is below what the
    deployment's decode steps carry: ``GraphOptBackend`` runs them before the plugin's backend
    sees them. Graphs keyed by token count are checked in tokens: a verify step of speculative
    decoding carries k + 1 tokens a request, scaled by FastDeploy or not."""
    if not derived.use_cudagraph or derived.only_prefill or not decode:
        return []
    seqs = s.max_num_seqs
    cap, _, formula = _decode_cap(release, s)
    if padding_running:
        largest, most, unit, why = max(padding_running), seqs, "running requests", ""
    elif s.method is not None and s.k:
        largest, most, unit = max(decode), seqs * (s.k + 1), "tokens"
        why = f" x (k + 1) = {most} tokens (a verify step carries k + 1 tokens a request)"
    else:
        largest, most, unit = max(decode), seqs, "tokens"
        why = " (one token per running request in a decode step)"
    if largest >= most:
        return []
    eager = (
        f"the largest decode graph holds {largest} {unit}, below max_num_seqs {seqs}{why}: "
        f"decode steps of {largest + 1}..{most} {unit} run eagerly, before the plugin's backend "
        "sees them (FastDeploy's GraphOptBackend sends them to the model directly)."
    )
    if unit == "tokens" and cap < most:
        # No list helps above the cap: FastDeploy drops every size above it.
        fix = (
            f" Add a size up to {cap} for the steps of {largest + 1}..{cap} tokens. "
            if largest < cap
            else " "
        )
        return [
            f"{eager} FastDeploy captures no decode size above {formula} = {cap} "
            f"for {s.method or 'plain decoding'}, so steps of {cap + 1}..{most} tokens run "
            f"eagerly whatever the list.{fix}".rstrip()
        ]
    return [f"{eager} Add a size that holds them."]


def _describe_backend(
    name: str,
    release: Release,
    inputs: PlanInput,
    mode: str,
    decode: list[int],
    prefill: list[int] | None,
    by_running: bool,
    graphs: bool,
    *,
    draft: bool = False,
) -> BackendPlan:
    """Which steps of one backend replay graphs, per mode and release (docs/modes.md)."""
    if not graphs:
        return BackendPlan(name, 0, 0, "eager (use_cudagraph off)", "eager (use_cudagraph off)")
    keyed = "running requests via real_bsz_to_captured_size" if by_running else "token count"
    if not release.has_prefill_list:  # 2.4
        kind = (
            "plugin CUDA graphs"
            if mode == "dynamic"
            else "Paddle-managed static graphs (2.4 runs every graphed step as run_static_model)"
        )
        if inputs.only_prefill:
            text = f"prefill-only steps: {kind} keyed by token count via the decode list"
            return BackendPlan(name, 0, len(decode), "eager (cudagraph_only_prefill)", text)
        count = len(decode)
        decode_text = f"{kind} keyed by {keyed}"
        if inputs.spec_method == "mtp" and not draft and 1 in decode:
            count -= 1
            decode_text += "; size 1 is never captured (2.4's MTP loop skips it) and runs eagerly"
        return BackendPlan(name, count, 0, decode_text, "eager")
    static_prefill = (
        "Paddle-managed static graphs, one per distinct cudagraph_capture_sizes_prefill size"
    )
    distinct_prefill = len(set(prefill or ()))
    if inputs.only_prefill:
        decode_text = "eager (cudagraph_only_prefill)"
        if mode == "static split":
            return BackendPlan(name, 0, distinct_prefill, decode_text, static_prefill)
        return BackendPlan(
            name,
            0,
            0,
            decode_text,
            f"eager: from FastDeploy 2.5 GraphOptBackend sends prefill steps to the backend only "
            f"in static split mode, so {mode} mode captures nothing",
        )
    if mode == "static full":
        decode_text = (
            f"Paddle-managed static graphs keyed by {keyed} (FastDeploy's own backend runs "
            "these eagerly)"
        )
        return BackendPlan(name, len(decode), 0, decode_text, "eager")
    decode_text = f"plugin CUDA graphs keyed by {keyed}"
    if mode == "static split":
        return BackendPlan(name, len(decode), distinct_prefill, decode_text, static_prefill)
    return BackendPlan(name, len(decode), 0, decode_text, "eager")


def graphs_phrase(count: int) -> str:
    return plural(count, "graph")


def _listing(values: list[int]) -> str:
    return ", ".join(map(str, values))


def format_ranges(mapping: dict[int, int]) -> str:
    """``0->0, 1->1, 3-4->4, 5-8->8``: runs of keys that map to the same value."""
    parts: list[str] = []
    items = sorted(mapping.items())
    start = 0
    for index, (key, value) in enumerate(items):
        last = index + 1 == len(items)
        if last or items[index + 1][1] != value or items[index + 1][0] != key + 1:
            first = items[start][0]
            parts.append(f"{first}->{value}" if first == key else f"{first}-{key}->{value}")
            start = index + 1
    return ", ".join(parts) if parts else "(empty)"


def _map_line(name: str, ours: dict[int, int], theirs: dict[int, int]) -> str:
    """The plugin's map under FastDeploy's name, said so where FastDeploy's own differs."""
    if ours == theirs:
        return f"{name}: {format_ranges(ours)}"
    return f"{name}, as the plugin pads (FastDeploy's own is stale): {format_ranges(ours)}"


def format_plan(plan: Plan) -> str:
    inputs = plan.inputs
    spec = (
        f"{inputs.spec_method}, k={plan.num_speculative_tokens}" if inputs.spec_method else "none"
    )
    sp_moe = "on" if inputs.sequence_parallel_moe else "off"
    lines = [
        f"rules: {plan.rules}",
        *(
            []
            if plan.from_fastdeploy
            else [f"rules read from: {capture_rules.RULES[plan.release].source}"]
        ),
        f"settings: max_num_seqs={inputs.max_num_seqs}, speculative={spec}, "
        f"tensor_parallel_size={inputs.tensor_parallel_size}, sequence-parallel MoE={sp_moe}, "
        f"graph_opt_level={inputs.graph_opt_level}, full_cuda_graph="
        f"{str(inputs.full_cuda_graph).lower()}, cudagraph_only_prefill="
        f"{str(inputs.only_prefill).lower()}, splitwise_role={inputs.splitwise_role} -> "
        f"{plan.mode} mode",
        f"cudagraph_capture_sizes ({len(plan.capture_sizes)}): {_listing(plan.capture_sizes)}",
    ]
    if plan.capture_sizes_prefill is not None:
        used = "" if plan.mode == "static split" else ", used in static split mode only"
        lines.append(
            f"cudagraph_capture_sizes_prefill ({len(plan.capture_sizes_prefill)}{used}): "
            f"{_listing(plan.capture_sizes_prefill)}"
        )
    lines.append(
        _map_line("real_shape_to_captured_size", plan.padding, plan.real_shape_to_captured_size)
    )
    if plan.mode == "static split":
        lines.append(
            _map_line(
                "real_shape_to_captured_size_prefill",
                plan.padding_prefill,
                plan.real_shape_to_captured_size_prefill,
            )
        )
    if plan.padding_running:
        theirs = {
            b: s for b, s in plan.real_bsz_to_captured_size.items() if 0 < b <= inputs.max_num_seqs
        }
        lines.append(_map_line("real_bsz_to_captured_size", plan.padding_running, theirs))
    lines.append("graphs per backend:")
    for backend in plan.backends:
        lines.append(
            f"  {backend.name}: {graphs_phrase(backend.graphs)} ({backend.decode_graphs} decode, "
            f"{backend.prefill_graphs} prefill)"
        )
        lines.append(f"    decode steps: {backend.decode}")
        lines.append(f"    prefill/mixed steps: {backend.prefill}")
    lines.append(f"total graphs: {plan.total_graphs}")
    lines.extend(f"warning: {warning}" for warning in plan.warnings)
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
