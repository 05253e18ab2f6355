"""``fd-cudagraph plan``: the capture sizes and padding maps FastDeploy will derive, before serving.

The rules are FastDeploy's ``FDConfig`` / ``GraphOptimizationConfig`` capture-size derivation,
written here from its documented behaviour (shared/docs/fastdeploy-integration.md §2.2) so the
plan runs on any machine, FastDeploy installed or not:

- decode cap ``min(512, max_num_seqs)`` (512 with ``cudagraph_only_prefill``); prefill cap
  ``max_capture_shape_prefill``;
- automatic lists from the candidates 1, 2, 4, 8..128 by 8, 144..256 by 16, 288..1024 by 32, plus
  the cap;
- speculative decoding (MTP, ngram, suffix; k draft tokens, PR #7215) multiplies the cap and every
  decode size by k + 1, user-given sizes included (they count requests, not tokens);
- sizes above a cap are dropped; the decode list is deduplicated, the prefill list is not;
- ``FDConfig.postprocess`` then applies the splitwise role, in this order (develop ``r3_mm_dev``
  and 2.6 ``r3_eos_2.6``, ``fastdeploy/config.py``): the prefill role sets ``use_cudagraph`` to
  ``cudagraph_only_prefill``; the mixed role turns sequence-parallel MoE off when CUDA graphs are
  on; only after that, sequence-parallel MoE with ``max_num_seqs >= tp`` runs
  ``filter_capture_size(tp)``, keeping the sizes divisible by tp (decode and prefill lists), and
  with ``max_num_seqs < tp`` turns itself off. So only the decode role (and a prefill node with
  ``cudagraph_only_prefill``) ever filters. The filter runs after the padding maps were built, so
  FastDeploy's maps still name removed sizes (the plugin re-pads through the lists).

FastDeploy's own limits are enforced with an error, which also bounds this command's work:
``max_num_seqs <= 512`` (``FDConfig.check``) and ``num_speculative_tokens`` in 1..5 for mtp,
ngram and suffix (``SpeculativeConfig.check_legality_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.sizes import padding_table, table_disagreements
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    DEFAULT_PREFILL_SIZES,
    MAX_NUM_SEQS,
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
    SPLITWISE_ROLES,
    auto_candidates,
    fastdeploy_bsz_map,
    fastdeploy_padding_map,
)


@dataclass(frozen=True)
class PlanInput:
    """The serving settings that decide the capture lists; defaults are FastDeploy's CLI ones."""

    max_num_seqs: int = 8
    num_speculative_tokens: int | None = None
    spec_method: str | None = None
    tensor_parallel_size: int = 1
    sequence_parallel_moe: bool = False
    graph_opt_level: int = 0
    full_cuda_graph: bool = True
    max_capture_shape_prefill: int = 512
    only_prefill: bool = False
    capture_sizes: tuple[int, ...] | None = None
    capture_sizes_prefill: tuple[int, ...] | None = None
    splitwise_role: str = "mixed"
    #: develop's default; release 2.6 defaults to False.
    draft_model_use_cudagraph: bool = True

    @property
    def mode(self) -> str:
        if self.graph_opt_level == 0:
            return "dynamic"
        return "static full" if self.full_cuda_graph else "static split"


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
    num_speculative_tokens: int
    capture_sizes: list[int]
    capture_sizes_prefill: list[int]
    real_shape_to_captured_size: dict[int, int]
    real_shape_to_captured_size_prefill: dict[int, int]
    real_bsz_to_captured_size: dict[int, int]
    #: True when ``filter_capture_size`` kept only the decode sizes divisible by tp.
    filtered_for_tp: bool
    backends: list[BackendPlan]
    #: False on a prefill node without ``cudagraph_only_prefill``: FastDeploy captures nothing.
    use_cudagraph: bool = True
    #: ``(tokens, FastDeploy's size, the plugin's size)`` where the stale map differs.
    stale_padding: list[tuple[int, int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_graphs(self) -> int:
        return sum(backend.graphs for backend in self.backends)

    def to_json(self) -> dict:
        def keyed(mapping: dict[int, int]) -> dict[str, int]:
            return {str(key): value for key, value in mapping.items()}

        return {
            "settings": {
                "max_num_seqs": self.inputs.max_num_seqs,
                "spec_method": self.inputs.spec_method,
                "num_speculative_tokens": self.num_speculative_tokens,
                "tensor_parallel_size": self.inputs.tensor_parallel_size,
                "sequence_parallel_moe": self.inputs.sequence_parallel_moe,
                "graph_opt_level": self.inputs.graph_opt_level,
                "full_cuda_graph": self.inputs.full_cuda_graph,
                "cudagraph_only_prefill": self.inputs.only_prefill,
                "max_capture_shape_prefill": self.inputs.max_capture_shape_prefill,
                "splitwise_role": self.inputs.splitwise_role,
                "draft_model_use_cudagraph": self.inputs.draft_model_use_cudagraph,
            },
            "use_cudagraph": self.use_cudagraph,
            "mode": self.inputs.mode,
            "cudagraph_capture_sizes": self.capture_sizes,
            "cudagraph_capture_sizes_prefill": self.capture_sizes_prefill,
            "real_shape_to_captured_size": keyed(self.real_shape_to_captured_size),
            "real_shape_to_captured_size_prefill": keyed(self.real_shape_to_captured_size_prefill),
            "real_bsz_to_captured_size": keyed(self.real_bsz_to_captured_size),
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
            "notes": self.notes,
        }


def _check_count(flag: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}; got {value!r}.")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{flag} must be at most {maximum}; got {value}.")
    return value


def _check_sizes(flag: str, sizes: tuple[int, ...] | None) -> list[int] | None:
    if sizes is None:
        return None
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    if not sizes or bad:
        raise ConfigError(
            f"{flag} must be a non-empty list of positive integers; got {list(sizes)!r}. "
            f"Pass e.g. {flag} 1,2,4,8."
        )
    return list(sizes)


def _effective_k(inputs: PlanInput, notes: list[str]) -> int:
    """The k FastDeploy scales graphs by (``SpeculativeConfig`` defaults and fix-ups included)."""
    method, k = inputs.spec_method, inputs.num_speculative_tokens
    if method is None:
        if k:
            notes.append(
                f"--num-speculative-tokens {k} has no effect without --spec-method: FastDeploy "
                "scales capture sizes only for mtp, ngram and suffix."
            )
        return 0
    if method not in SPEC_METHODS:
        raise ConfigError(
            f"--spec-method must be one of {', '.join(SPEC_METHODS)}; got {method!r}. "
            "Leave it out when serving without speculative decoding."
        )
    if method == "naive":
        return 0  # SpeculativeConfig forces k = 0 for naive.
    if k is None:
        return 1
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            f"--num-speculative-tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS} for "
            f"{method}, FastDeploy's range (SpeculativeConfig refuses others); got {k!r}."
        )
    return k


def _describe_backend(
    name: str, inputs: PlanInput, decode: list[int], prefill: list[int], k: int, graphs: bool
) -> BackendPlan:
    """Which steps of one backend replay graphs, per mode (the README's execution-mode table)."""
    if not graphs:
        return BackendPlan(name, 0, 0, "eager (use_cudagraph off)", "eager (use_cudagraph off)")
    mode = inputs.mode
    keyed = "running requests via real_bsz_to_captured_size" if k else "token count"
    static_prefill = (
        "Paddle-managed static graphs, one per distinct cudagraph_capture_sizes_prefill size"
    )
    if inputs.only_prefill:
        decode_text = "eager (cudagraph_only_prefill)"
        if mode == "static split":
            return BackendPlan(name, 0, len(set(prefill)), decode_text, static_prefill)
        kind = "plugin CUDA graphs" if mode == "dynamic" else "Paddle-managed static graphs"
        prefill_text = f"prefill-only steps: {kind} keyed by token count via the decode list"
        return BackendPlan(name, 0, len(decode), decode_text, prefill_text)
    if mode == "static full":
        decode_text = (
            f"Paddle-managed static graphs keyed by {keyed} (FastDeploy's own backend runs "
            "these eagerly)"
        )
        return BackendPlan(name, len(decode), 0, decode_text, "eager")
    decode_text = f"plugin CUDA graphs keyed by {keyed}"
    if mode == "static split":
        return BackendPlan(name, len(decode), len(set(prefill)), decode_text, static_prefill)
    return BackendPlan(name, len(decode), 0, decode_text, "eager")


def derive_plan(inputs: PlanInput) -> Plan:
    """Derive what FastDeploy's ``FDConfig`` computes for these settings, plus what is captured."""
    notes: list[str] = []
    max_num_seqs = _check_count("--max-num-seqs", inputs.max_num_seqs, 1, MAX_NUM_SEQS)
    tp = _check_count("--tensor-parallel-size", inputs.tensor_parallel_size, 1)
    prefill_cap = _check_count(
        "--max-capture-shape-prefill", inputs.max_capture_shape_prefill, 1, MAX_PREFILL_SHAPE
    )
    if inputs.splitwise_role not in SPLITWISE_ROLES:
        raise ConfigError(
            f"--splitwise-role must be one of {', '.join(SPLITWISE_ROLES)}; got "
            f"{inputs.splitwise_role!r}."
        )
    if inputs.graph_opt_level not in (0, 1, 2):
        raise ConfigError(
            f"--graph-opt-level must be 0, 1 or 2; got {inputs.graph_opt_level!r}. "
            "0 is dynamic, 1 static (SOT), 2 static with CINN."
        )
    user_decode = _check_sizes("--capture-sizes", inputs.capture_sizes)
    user_prefill = _check_sizes("--capture-sizes-prefill", inputs.capture_sizes_prefill)
    k = _effective_k(inputs, notes)

    decode_cap = DECODE_CAP if inputs.only_prefill else min(DECODE_CAP, max_num_seqs)
    if user_decode is None:
        # _set_cudagraph_sizes builds both automatic lists, replacing a given prefill list.
        decode = sorted([*auto_candidates(), decode_cap])
        prefill = sorted([*auto_candidates(), prefill_cap])
        if user_prefill is not None:
            notes.append(
                "cudagraph_capture_sizes_prefill is replaced by FastDeploy's automatic list when "
                "cudagraph_capture_sizes is not given; pass --capture-sizes too to keep it."
            )
    else:
        decode = user_decode
        prefill = list(DEFAULT_PREFILL_SIZES) if user_prefill is None else user_prefill
        if inputs.mode == "static split" and user_prefill is None and prefill_cap > 8:
            notes.append(
                "static split with user cudagraph_capture_sizes keeps cudagraph_capture_sizes_"
                f"prefill at [8, 4, 2, 1]: prefill steps of 9..{prefill_cap} tokens make "
                "FastDeploy's backend raise KeyError (the plugin runs them eagerly). Set "
                "--capture-sizes-prefill too."
            )

    if k:
        decode_cap *= k + 1
        decode = [size * (k + 1) for size in decode]  # user sizes too: they count requests
    dropped = sorted({s for s in decode if s > decode_cap})
    if dropped and user_decode is not None:
        scaled = f" x (k+1) = {decode_cap}" if k else f" = {decode_cap}"
        notes.append(
            f"cudagraph_capture_sizes: FastDeploy drops {_listing(dropped)}, above the decode cap "
            f"min(512, max_num_seqs){scaled}."
        )
    decode = sorted({s for s in decode if s <= decode_cap}, reverse=True)
    dropped_prefill = sorted({s for s in prefill if s > prefill_cap})
    if dropped_prefill and user_prefill is not None:
        notes.append(
            f"cudagraph_capture_sizes_prefill: FastDeploy drops {_listing(dropped_prefill)}, above "
            f"max_capture_shape_prefill = {prefill_cap}."
        )
    prefill = sorted((s for s in prefill if s <= prefill_cap), reverse=True)
    repeated = sorted({s for s in prefill if prefill.count(s) > 1})
    if repeated and inputs.mode == "static split":
        notes.append(
            f"cudagraph_capture_sizes_prefill holds {_listing(repeated)} twice (FastDeploy does "
            "not deduplicate it); one graph per distinct size."
        )

    shape_map = fastdeploy_padding_map(decode)
    prefill_map = fastdeploy_padding_map(prefill)
    bsz_map = fastdeploy_bsz_map(decode, k)

    # FDConfig.postprocess order: the prefill role decides use_cudagraph, then the mixed role
    # turns sequence-parallel MoE off, and only then may filter_capture_size run.
    use_cudagraph = inputs.splitwise_role != "prefill" or inputs.only_prefill
    if not use_cudagraph:
        notes.append(
            "splitwise_role prefill sets use_cudagraph to cudagraph_only_prefill (false): this "
            "node captures no graph; pass --only-prefill to graph its prefill steps."
        )
    if inputs.splitwise_role == "prefill" and inputs.spec_method == "mtp" and k != 1:
        notes.append(
            f"an MTP prefill node resets num_speculative_tokens to 1 after the sizes were scaled "
            f"by k + 1 = {k + 1}."
        )
    filtered = False
    if not (inputs.sequence_parallel_moe and use_cudagraph):
        pass
    elif inputs.splitwise_role == "mixed":
        notes.append(
            "sequence-parallel MoE: FastDeploy turns it off in the mixed role with CUDA graphs "
            "before filter_capture_size, so no size is filtered (--splitwise-role decode "
            "filters)."
        )
    elif max_num_seqs < tp:
        notes.append(
            f"sequence-parallel MoE: FastDeploy disables it because max_num_seqs {max_num_seqs} < "
            f"tensor_parallel_size {tp}."
        )
    elif tp > 1:
        filtered = True
        removed = sorted(s for s in decode if s % tp)
        decode = [s for s in decode if s % tp == 0]
        removed_prefill = sorted({s for s in prefill if s % tp})
        prefill = [s for s in prefill if s % tp == 0]
        if removed or removed_prefill:
            notes.append(
                f"sequence-parallel MoE with TP {tp}: filter_capture_size removes decode sizes "
                f"{_listing(removed) or 'none'} and prefill sizes "
                f"{_listing(removed_prefill) or 'none'} (not divisible by {tp}) after the padding "
                "maps were built."
            )

    if not decode:
        raise ConfigError(
            "no decode capture size is left: FastDeploy would build an empty "
            "cudagraph_capture_sizes and GraphOptBackend fails on its first call. "
            f"Give --capture-sizes at or below {decode_cap // (k + 1)} requests"
            + (f" divisible by {tp}" if filtered else "")
            + ", or raise --max-num-seqs."
        )
    # Token counts above the new largest size never reach the backend (GraphOptBackend runs them
    # eagerly), so only the ones below it are stale in a way that matters.
    stale = [e for e in table_disagreements(padding_table(decode), shape_map) if e[2] > 0]
    if stale:
        sizes = sorted({theirs for _, theirs, _ in stale})
        notes.append(
            f"FastDeploy's real_shape_to_captured_size still maps {len(stale)} token counts to "
            f"removed sizes {_listing(sizes)}; its backend would fail there, the plugin pads them "
            "to the next size in the list."
        )

    backends = [_describe_backend("target model", inputs, decode, prefill, k, use_cudagraph)]
    if inputs.spec_method == "mtp" and inputs.draft_model_use_cudagraph:
        backends.append(
            _describe_backend("MTP draft model", inputs, decode, prefill, k, use_cudagraph)
        )
        notes.append(
            "The MTP draft model has its own backend with the same lists "
            "(draft_model_use_cudagraph: develop's default true, release 2.6's false)."
        )
    elif inputs.spec_method == "mtp":
        notes.append("draft_model_use_cudagraph is false: the MTP draft model runs eagerly.")
    return Plan(
        inputs=inputs,
        num_speculative_tokens=k,
        capture_sizes=decode,
        capture_sizes_prefill=prefill,
        real_shape_to_captured_size=shape_map,
        real_shape_to_captured_size_prefill=prefill_map,
        real_bsz_to_captured_size=bsz_map,
        filtered_for_tp=filtered,
        backends=backends,
        use_cudagraph=use_cudagraph,
        stale_padding=stale,
        notes=notes,
    )


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


def format_plan(plan: Plan) -> str:
    inputs = plan.inputs
    spec = (
        f"{inputs.spec_method}, k={plan.num_speculative_tokens}" if inputs.spec_method else "none"
    )
    sp_moe = "on" if inputs.sequence_parallel_moe else "off"
    lines = [
        f"settings: max_num_seqs={inputs.max_num_seqs}, speculative={spec}, "
        f"tensor_parallel_size={inputs.tensor_parallel_size}, sequence-parallel MoE={sp_moe}, "
        f"graph_opt_level={inputs.graph_opt_level}, full_cuda_graph="
        f"{str(inputs.full_cuda_graph).lower()}, cudagraph_only_prefill="
        f"{str(inputs.only_prefill).lower()}, splitwise_role={inputs.splitwise_role} -> "
        f"{inputs.mode} mode",
        f"cudagraph_capture_sizes ({len(plan.capture_sizes)}): {_listing(plan.capture_sizes)}",
        f"cudagraph_capture_sizes_prefill ({len(plan.capture_sizes_prefill)}"
        f"{'' if inputs.mode == 'static split' else ', used in static split mode only'}): "
        f"{_listing(plan.capture_sizes_prefill)}",
        f"real_shape_to_captured_size: {format_ranges(plan.real_shape_to_captured_size)}",
    ]
    if inputs.mode == "static split":
        lines.append(
            "real_shape_to_captured_size_prefill: "
            + format_ranges(plan.real_shape_to_captured_size_prefill)
        )
    if plan.real_bsz_to_captured_size:
        lines.append(f"real_bsz_to_captured_size: {format_ranges(plan.real_bsz_to_captured_size)}")
    lines.append("graphs per backend:")
    for backend in plan.backends:
        lines.append(
            f"  {backend.name}: {backend.graphs} graphs ({backend.decode_graphs} decode, "
            f"{backend.prefill_graphs} prefill)"
        )
        lines.append(f"    decode steps: {backend.decode}")
        lines.append(f"    prefill/mixed steps: {backend.prefill}")
    lines.append(f"total graphs: {plan.total_graphs}")
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
