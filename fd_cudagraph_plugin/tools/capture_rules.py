"""FastDeploy's capture-size rules and limits per release: the project's own copy.

``plan`` and ``tune`` compute capture lists with the installed FastDeploy's own
``GraphOptimizationConfig`` / ``FDConfig`` when FastDeploy is importable (``plan.py``); this copy is
what they use without FastDeploy, or for another release than the installed one. It was written
from ``fastdeploy/config.py`` of the ``gongshaotian/FastDeploy`` branches and commits named in
``RULES`` (each ``Release`` says its branch, commit and date, and ``plan`` prints them), and
``tests/test_plan.py`` holds it against the test stand-in's ``FDConfig`` for 2.4, 2.5, 2.6 and
develop; ``tests/test_releases.py`` pins what the other trees do differently.

What differs per release, in ``FDConfig.__init__``, ``init_with_cudagrpah_size`` and
``postprocess``:

- 2.4: no prefill capture list and no ``real_bsz_to_captured_size``. MTP multiplies only the decode
  cap by k + 1 (the automatic candidates stay as they are), within 512; other methods change
  nothing.
- 2.5 (r3_ban_cpucache_2.5): MTP and suffix multiply the decode cap by k + 1, without the 512 cap;
  every speculative method multiplies the automatic candidates (decode and prefill) by k + 1;
  user-given sizes are tokens, as given. ``real_bsz_to_captured_size`` (MTP, suffix) is built
  from the untrimmed list.
- 2.5-cherry-pick (r3_cherry_pick_2.5): as 2.5, but only MTP multiplies the cap, within 512, no
  suffix method, and no ``real_bsz_to_captured_size``.
- 2.6, develop-e53f518 and develop (r3_mm_dev): the speculative methods that scale (MTP, suffix;
  r3_mm_dev also ngram) multiply the cap and every decode size by k + 1, user-given sizes
  included (they count requests); ``real_bsz_to_captured_size`` is built from the trimmed list.
- Sequence-parallel MoE: 2.4 runs ``filter_capture_size(tp)`` before the mixed and decode roles
  turn it off, so every role filters; from 2.5 the mixed role turns it off first, so only the
  prefill and decode roles filter. The padding maps are built before the filter either way.
- ``FDConfig.check`` caps ``max_num_seqs`` at 256 (2.4, 2.5) or 512 (2.6 and later).
- ``FDConfig.postprocess``, after the lists are built: the prefill role sets ``use_cudagraph`` to
  ``cudagraph_only_prefill``; ``--dynamic-load-weight`` sets ``graph_opt_level`` to 0 (every tree);
  a host cache (``--swap-space``, ``num_cpu_blocks`` > 0) turns ``cudagraph_only_prefill`` off on
  develop (r3_mm_dev) only, after the role read it and after the decode list was capped at 512
  for it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: FastDeploy never captures a decode size above this many requests (``min(512, max_num_seqs)``).
DECODE_CAP = 512
#: ``SpeculativeConfig.check_legality_parameters`` asserts k in 1..5 for every method but naive.
MAX_SPECULATIVE_TOKENS = 5


def bad_k(k: object) -> bool:
    """Not a ``num_speculative_tokens`` FastDeploy accepts (an integer in 1..5)."""
    return isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS


#: FastDeploy sets no bound on ``max_capture_shape_prefill``, but its prefill padding map holds one
#: entry per token up to it in every process; past this the plan (which prints that map) refuses
#: rather than allocate gigabytes. It is 8x the V1 scheduler's default ``max_num_batched_tokens``.
MAX_PREFILL_SHAPE = 65536
#: FastDeploy sets no bound on ``tensor_parallel_size`` (one GPU per rank). The plan uses it only
#: in ``filter_capture_size`` and in ``max_num_seqs < tensor_parallel_size``, and no group of more
#: ranks than the largest ``max_num_seqs`` changes either, so larger values are refused as typos.
MAX_TENSOR_PARALLEL_SIZE = 512
SPLITWISE_ROLES = ("mixed", "prefill", "decode")
#: ``--speculative-config`` methods; FastDeploy 2.4 and 2.5 call ngram ``ngram_match``.
SPEC_METHODS = ("mtp", "ngram", "suffix", "naive")
#: Methods with a draft model of their own, the only readers of ``draft_model_use_cudagraph``: in
#: every release (2.4_r3 through r3_mm_dev) only ``spec_decode/mtp.py`` and the runner's MTP
#: branches read it; ngram and suffix draft without a model.
DRAFT_MODEL_METHODS = ("mtp",)
#: ``cudagraph_capture_sizes_prefill`` when the decode sizes are given by the user (2.5+).
DEFAULT_PREFILL_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Release:
    """What one FastDeploy tree does with the capture settings, and where that was read."""

    #: The ``--fastdeploy-version`` choice.
    name: str
    #: The ``gongshaotian/FastDeploy`` branch, commit and commit date the rules were read from.
    branch: str
    commit: str
    date: str
    #: ``FDConfig.check`` asserts ``max_num_seqs <=`` this.
    max_num_seqs: int
    #: ``GraphOptimizationConfig.draft_model_use_cudagraph``'s default.
    draft_model_use_cudagraph: bool
    #: Methods ``SpeculativeConfig`` accepts (2.4 and 2.5: ``ngram_match`` for ngram).
    spec_methods: tuple[str, ...]
    #: Methods whose k scales the decode capture sizes (see the module docstring per release).
    scaling_methods: tuple[str, ...]
    #: The shape of the derivation: "2.4" (no prefill list, filter before the roles), "2.5"
    #: (FDConfig scales the cap and the candidates) or "2.6" (init_with_cudagrpah_size scales).
    generation: str
    #: ``FDConfig`` builds ``real_bsz_to_captured_size`` for the scaling methods.
    has_bsz_map: bool = True
    #: The decode cap is ``min(512, ...)`` under speculative decoding too (2.4, r3_cherry_pick_2.5;
    #: r3_ban_cpucache_2.5 applies 512 only without a SpeculativeConfig, which is never).
    caps_speculative_at_512: bool = False
    #: ``postprocess`` turns ``cudagraph_only_prefill`` off when a host cache is configured
    #: (``num_cpu_blocks``, from ``--swap-space``): r3_mm_dev only.
    host_cache_ends_only_prefill: bool = False

    @property
    def source(self) -> str:
        return f"gongshaotian/FastDeploy branch {self.branch} at {self.commit} ({self.date})"

    @property
    def has_prefill_list(self) -> bool:
        """``cudagraph_capture_sizes_prefill`` and static split mode exist (2.5+)."""
        return self.generation != "2.4"

    @property
    def scales_user_sizes(self) -> bool:
        """User-given decode sizes count requests and are multiplied by k + 1 (2.6+)."""
        return self.generation == "2.6"

    @property
    def filters_before_roles(self) -> bool:
        """``filter_capture_size`` runs before the mixed role turns sequence-parallel MoE off."""
        return self.generation == "2.4"

    @property
    def decode_cap(self) -> int:
        """The largest decode size without speculative scaling: ``min(512, max_num_seqs)``."""
        return min(DECODE_CAP, self.max_num_seqs)


#: The trees this copy knows, oldest first. Two 2.5 branches differ: r3_cherry_pick_2.5 has no
#: suffix method, scales only MTP's cap, caps it at 512 and builds no real_bsz_to_captured_size
#: (its graphs are keyed by token count); "2.5" is r3_ban_cpucache_2.5, which does all of these.
#: The develop branch at e53f518 derives its lists as r3_eos_2.6 does (draft_model_use_cudagraph
#: false, only MTP and suffix scale); "develop" is r3_mm_dev, where ngram scales too and the
#: draft model is graphed by default.
RULES = {
    release.name: release
    for release in (
        Release("2.4", "2.4_r3", "f874516", "2025-12-05", 256, False, ("mtp", "ngram"),
                ("mtp",), "2.4", has_bsz_map=False, caps_speculative_at_512=True),
        Release("2.5-cherry-pick", "r3_cherry_pick_2.5", "8d7f3d4", "2026-03-19", 256, False,
                ("mtp", "ngram"), ("mtp",), "2.5", has_bsz_map=False,
                caps_speculative_at_512=True),
        Release("2.5", "r3_ban_cpucache_2.5", "fd6f890", "2026-04-09", 256, False,
                ("mtp", "ngram", "suffix"), ("mtp", "suffix"), "2.5"),
        Release("2.6", "r3_eos_2.6", "41677b9", "2026-06-02", 512, False, SPEC_METHODS,
                ("mtp", "suffix"), "2.6"),
        Release("develop-e53f518", "develop", "e53f518", "2026-04-15", 512, False, SPEC_METHODS,
                ("mtp", "suffix"), "2.6"),
        Release("develop", "r3_mm_dev", "564c78d", "2026-05-20", 512, True, SPEC_METHODS,
                ("mtp", "suffix", "ngram"), "2.6", host_cache_ends_only_prefill=True),
    )
}  # fmt: skip
RELEASES = tuple(RULES)
DEFAULT_RELEASE = "develop"

#: Which rule set answers each ``fastdeploy-gpu`` release line. The 2.5 line has two trees: the
#: later one (r3_ban_cpucache_2.5, release/2.5 with the upstream cherry-picks to 2026-04-09:
#: suffix decoding, real_bsz_to_captured_size) answers 2.5; the other (r3_cherry_pick_2.5,
#: release/2.5 as of 2026-03-18 plus the fork's own commits) only by its tree name, or where
#: plan recognises an installed FastDeploy as that tree.
RELEASE_LINES = {"2.4": "2.4", "2.5": "2.5", "2.6": "2.6"}
#: Tree names the flag also takes, for the two trees no release line maps to.
TREE_NAMES = ("2.5-cherry-pick", "develop-e53f518")
#: A ``fastdeploy-gpu`` version as pip shows it: 2.6, 2.6.1, 2.5.0.post1, a release candidate
#: 2.6.0rc1 (cut from its release branch, so its line's rules), with or without a leading v.
_VERSION = re.compile(
    r"v?([0-9]{1,3})\.([0-9]{1,3})(\.[0-9]{1,5})?(\.post[0-9]{1,5})?((a|b|rc)[0-9]{1,5})?"
)
#: A development build (``2.3.0-dev``, ``2.6.0.dev0``): FastDeploy's trees report the release
#: before the one they become (2.4_r3 says 2.3.0-dev, develop at e53f518 2.6.0-dev).
_DEV = re.compile(r"v?[0-9]{1,3}\.[0-9]{1,3}(\.[0-9]{1,5})?(-dev|\.dev[0-9]{0,5})")
VERSION_FORMS = (
    "a fastdeploy-gpu version: 2.4, 2.5 or 2.6, or a full one such as 2.6.1, 2.5.0.post1, "
    "2.6.0rc1 or v2.6; or develop"
)


class UnknownVersion(ValueError):
    """``--fastdeploy-version`` names no version these rules answer; the message says why."""


def rules_for_version(text: str) -> str:
    """The rule set (a ``RULES`` key) that answers ``--fastdeploy-version text``.

    ``develop`` and the tree names answer themselves; a version answers by its release line.
    """
    word = text.strip().lower()
    if word in RULES:
        return word
    if len(word) > 40:
        raise UnknownVersion(f"must be {VERSION_FORMS}; got {text[:40]!r}... ({len(text)} chars)")
    if _DEV.fullmatch(word):
        raise UnknownVersion(
            f"fastdeploy-gpu {word} is a development build, which no version string places: "
            "FastDeploy's trees report the release before theirs (2.4_r3 says 2.3.0-dev, develop "
            "2.6.0-dev). Pass the release line its tree was cut for (2.4, 2.5 or 2.6), or develop"
        )
    found = _VERSION.fullmatch(word)
    if found is None:
        raise UnknownVersion(f"must be {VERSION_FORMS}; got {text!r}")
    line = f"{int(found[1])}.{int(found[2])}"
    if line not in RELEASE_LINES:
        known = ", ".join(RELEASE_LINES)
        raise UnknownVersion(
            f"fastdeploy-gpu {word} is no release line these rules were read for ({known}, and "
            "develop); pass the nearest, or develop for the newest rules known"
        )
    return RELEASE_LINES[line]


@dataclass(frozen=True)
class ServingSettings:
    """The settings the capture lists depend on, validated (``plan.derive_plan`` does that).

    ``k`` is ``num_speculative_tokens`` as ``SpeculativeConfig`` leaves it (0 without a method,
    and for naive).
    """

    max_num_seqs: int
    method: str | None
    k: int
    tensor_parallel_size: int
    sequence_parallel_moe: bool
    graph_opt_level: int
    full_cuda_graph: bool
    only_prefill: bool
    capture_sizes: Sequence[int] | None
    capture_sizes_prefill: Sequence[int] | None
    max_capture_shape_prefill: int
    splitwise_role: str
    #: None: the release's default.
    draft_model_use_cudagraph: bool | None = None
    #: ``use_cudagraph`` as given (FastDeploy's default: true).
    use_cudagraph: bool = True
    #: FastDeploy's ``use_ep``: expert parallelism over more than one rank.
    expert_parallel: bool = False
    #: ``--dynamic-load-weight`` (``LoadConfig.dynamic_load_weight``).
    dynamic_load_weight: bool = False
    #: A host KV cache: ``--swap-space`` above 0 (``CacheConfig.num_cpu_blocks`` > 0).
    host_cache: bool = False


@dataclass(frozen=True)
class Derived:
    """What ``FDConfig`` leaves in ``graph_opt_config`` for one set of settings."""

    capture_sizes: list[int]
    #: None on 2.4, which has no prefill list.
    capture_sizes_prefill: list[int] | None
    real_shape_to_captured_size: dict[int, int]
    real_shape_to_captured_size_prefill: dict[int, int]
    real_bsz_to_captured_size: dict[int, int]
    use_cudagraph: bool
    #: ``filter_capture_size(tp)`` ran (sequence-parallel MoE kept on with tp > 1).
    filtered: bool
    #: ``graph_opt_level`` and ``cudagraph_only_prefill`` as ``postprocess`` leaves them.
    graph_opt_level: int = 0
    only_prefill: bool = False


def auto_candidates(per_step: int = 1) -> list[int]:
    """FastDeploy's ``_set_cudagraph_sizes`` candidates, ascending (the code's ``range(9, 33)``);
    2.5 multiplies them by ``dec_token_per_query_per_step``."""
    base = [1, 2, 4, *(8 * i for i in range(1, 17)), *(16 * i for i in range(9, 17))]
    return [per_step * c for c in [*base, *(32 * i for i in range(9, 33))]]


def default_capture_sizes(max_size: int) -> list[int]:
    """The automatic decode list for a cap of ``max_size`` tokens, descending and deduplicated.

    Equal to FastDeploy's derived list for ``max_num_seqs = max_size`` when ``max_size`` is within
    the release's ``max_num_seqs`` limit and no speculative decoding, on every release.
    """
    return sorted({s for s in auto_candidates() if s <= max_size} | {max_size}, reverse=True)


def fastdeploy_padding_map(sizes_desc: Sequence[int]) -> dict[int, int]:
    """``real_shape_to_captured_size`` as FastDeploy builds it from a descending list.

    Each descending pair ``(end, start)``, with 0 after the last size, maps ``start`` to itself and
    ``start + 1 .. end - 1`` to ``end``; then the largest size (0 for an empty list) maps to
    itself.
    """
    mapping: dict[int, int] = {}
    for end, start in zip(sizes_desc, [*sizes_desc[1:], 0]):  # noqa: B905 (empty: no pairs)
        mapping[start] = start
        for shape in range(start + 1, end):
            mapping[shape] = end
    largest = sizes_desc[0] if sizes_desc else 0
    mapping[largest] = largest
    return dict(sorted(mapping.items()))


def fastdeploy_bsz_map(sizes: Sequence[int], k: int) -> dict[int, int]:
    """``real_bsz_to_captured_size``: running requests -> captured token size (k != 0 only).

    Each size c, in the order given, maps ``int(c / (k + 1))`` to c (a later size of the same
    count wins: 2.6+ walk the descending list, so the smallest; 2.5 the ascending untrimmed one).
    Counts in between take the size of the next larger count (``expand_bsz_map``).
    """
    if k == 0:
        return {}
    sparse: dict[int, int] = {}
    for size in sizes:
        sparse[int(size / (k + 1))] = size
    mapping: dict[int, int] = {}
    previous = 0
    for bsz, size in sorted(sparse.items()):
        for count in range(previous + 1, bsz + 1):
            mapping[count] = size
        previous = bsz
    return mapping


def check_even_token_cap(release: Release, method: str | None, k: int, max_num_seqs: int) -> str:
    """FastDeploy 2.4 (mtp) and 2.5 (mtp, suffix) assert ``max_num_seqs * (k + 1)`` is even."""
    if release.scales_user_sizes or method not in release.scaling_methods:
        return ""
    tokens = max_num_seqs * (k + 1)
    if tokens % 2 == 0:
        return ""
    return (
        f"FastDeploy {release.name} asserts max_num_seqs x (k + 1) is even for {method} "
        f'("CUDAGraph only supports capturing even token nums in MTP scenarios"); got '
        f"{max_num_seqs} x {k + 1} = {tokens}. Use an even --max-num-seqs or an odd "
        "num_speculative_tokens in --speculative-config."
    )


def derive(release: Release, settings: ServingSettings) -> Derived:
    """The copy of ``FDConfig``'s derivation for ``release``."""
    s = settings
    decode, prefill, bsz = _capture_lists(release, s)
    shape_map = fastdeploy_padding_map(decode)
    prefill_map = fastdeploy_padding_map(prefill) if prefill is not None else {}
    if release.generation == "2.4" and s.expert_parallel:
        decode = [0, *decode]  # 2.4's FDConfig, after the map: "if use_ep: [0] + sizes"

    # FDConfig.postprocess: the prefill role sets use_cudagraph to cudagraph_only_prefill,
    # whatever was given.
    use_cudagraph = s.only_prefill if s.splitwise_role == "prefill" else s.use_cudagraph
    # RL weight loading: "Static Graph does not support to be started together with RL Training".
    level = 0 if s.dynamic_load_weight else s.graph_opt_level
    # r3_mm_dev: "Layer-by-layer swap-in is incompatible with CUDA Graph prefill capture"; the
    # lists were built (decode capped at 512) for cudagraph_only_prefill before this.
    only_prefill = s.only_prefill and not (s.host_cache and release.host_cache_ends_only_prefill)
    sp_moe = s.sequence_parallel_moe and use_cudagraph
    if sp_moe and s.splitwise_role == "mixed" and not release.filters_before_roles:
        sp_moe = False  # _disable_sequence_parallel_moe_if_needed("Mixed"), before the filter
    tp = s.tensor_parallel_size
    filtered = False
    if sp_moe and s.max_num_seqs >= tp:
        # "It will hang when real batch_size < tp_size"; the maps stay as they were.
        decode = [size for size in decode if size % tp == 0]
        if prefill is not None:
            prefill = [size for size in prefill if size % tp == 0]
        filtered = tp > 1
    return Derived(
        capture_sizes=decode,
        capture_sizes_prefill=prefill,
        real_shape_to_captured_size=shape_map,
        real_shape_to_captured_size_prefill=prefill_map,
        real_bsz_to_captured_size=bsz,
        use_cudagraph=use_cudagraph,
        filtered=filtered,
        graph_opt_level=level,
        only_prefill=only_prefill,
    )


def _capture_lists(
    release: Release, s: ServingSettings
) -> tuple[list[int], list[int] | None, dict[int, int]]:
    """Decode list, prefill list (None on 2.4) and bsz map, before ``postprocess``."""
    k, user_decode, user_prefill = s.k, s.capture_sizes, s.capture_sizes_prefill
    prefill_cap = s.max_capture_shape_prefill
    scaling = s.method in release.scaling_methods
    bsz: dict[int, int] = {}
    if release.scales_user_sizes:  # 2.6, develop: init_with_cudagrpah_size scales
        cap = DECODE_CAP if s.only_prefill else min(DECODE_CAP, s.max_num_seqs)
        scale = k + 1 if scaling and k else 1
        if user_decode is None:
            decode, prefill = [*auto_candidates(), cap], [*auto_candidates(), prefill_cap]
        else:
            decode = list(user_decode)
            prefill = list(DEFAULT_PREFILL_SIZES if user_prefill is None else user_prefill)
        decode = sorted({d * scale for d in decode if d * scale <= cap * scale}, reverse=True)
        if scale > 1:
            bsz = fastdeploy_bsz_map(decode, k)
        return decode, _trim_prefill(prefill, prefill_cap), bsz

    cap = s.max_num_seqs * (k + 1) if scaling else s.max_num_seqs
    if s.only_prefill:
        cap = DECODE_CAP
    elif release.caps_speculative_at_512:
        cap = min(DECODE_CAP, cap)
    # r3_ban_cpucache_2.5 caps at 512 only without a SpeculativeConfig, and FastDeploy always
    # builds one.
    if release.generation == "2.4":
        decode = [*auto_candidates(), cap] if user_decode is None else list(user_decode)
        return sorted({d for d in decode if d <= cap}, reverse=True), None, {}
    per_step = k + 1 if s.method is not None else 1  # dec_token_per_query_per_step
    if user_decode is None:
        decode = sorted([*auto_candidates(per_step), cap])
        prefill = [*auto_candidates(per_step), prefill_cap]
    else:
        decode = list(user_decode)
        prefill = list(DEFAULT_PREFILL_SIZES if user_prefill is None else user_prefill)
    if scaling and release.has_bsz_map:
        bsz = fastdeploy_bsz_map(decode, k)  # from the untrimmed list, in its order
    decode = sorted({d for d in decode if d <= cap}, reverse=True)
    return decode, _trim_prefill(prefill, prefill_cap), bsz


def _trim_prefill(prefill: list[int], cap: int) -> list[int]:
    """Sizes up to the cap, descending, and not deduplicated (FastDeploy's default holds 512
    twice)."""
    return sorted((s for s in prefill if s <= cap), reverse=True)
