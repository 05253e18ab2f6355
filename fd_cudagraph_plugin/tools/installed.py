"""The importable FastDeploy, for ``plan`` and ``tune``: its release, and its own derivation.

Where FastDeploy is importable, its ``GraphOptimizationConfig``, ``SchedulerConfig``,
``ParallelConfig``, ``SpeculativeConfig`` and ``FDConfig`` compute the capture lists and maps, so
the tools cannot drift from the FastDeploy that will serve. The release is recognised from its
config (``release_of``): 2.4 has no prefill capture list, 2.5 no
``flag_cudagraph_capture_sizes_initlized`` (r3_cherry_pick_2.5 has no
``real_bsz_to_captured_size`` either), and r3_mm_dev turned ``draft_model_use_cudagraph`` on. The
version string decides only between 2.6 and a develop tree that builds its lists as 2.6 does
(``2.6.0`` or ``2.6.0-dev``); 2.4_r3 still reports ``2.3.0-dev``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools import paddle_import
from fd_cudagraph_plugin.tools.capture_rules import (
    DEFAULT_RELEASE,
    RULES,
    Derived,
    Release,
    ServingSettings,
    UnknownVersion,
    rules_for_version,
)


@dataclass(frozen=True)
class InstalledFastDeploy:
    """The importable ``fastdeploy``: its config module and release, or why it cannot serve."""

    version: str
    config: ModuleType | None = None
    release: str | None = None
    problem: str = ""


class FastDeployRefused(Exception):
    """FastDeploy's config asserted against these settings; the message is FastDeploy's."""


def installed_fastdeploy() -> InstalledFastDeploy | None:
    """The FastDeploy this Python imports, or None when there is none."""
    try:
        if importlib.util.find_spec("fastdeploy") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        package = paddle_import.load("fastdeploy")
        with paddle_import.quiet():
            config = importlib.import_module("fastdeploy.config")
            graph = config.GraphOptimizationConfig({})
    except Exception as error:  # whatever FastDeploy's imports raise on this machine
        return InstalledFastDeploy("unknown", problem=f"{type(error).__name__}: {error}")
    version = str(getattr(package, "__version__", "unknown"))
    return InstalledFastDeploy(version, config, release_of(graph, version))


def release_of(graph: Any, version: str) -> str:
    """Which of ``capture_rules.RULES`` a FastDeploy tree follows, from a default
    ``GraphOptimizationConfig`` and its ``__version__``.

    The config tells the derivation apart; the version string only whether a 2.6-shaped tree is
    the 2.6 release (``2.6.0``) or a develop tree (``2.6.0-dev``: develop at e53f518 builds its
    lists as 2.6 does). 2.4_r3 still says ``2.3.0-dev``, so the version decides nothing earlier.
    """
    if not hasattr(graph, "cudagraph_capture_sizes_prefill"):
        return "2.4"
    if not hasattr(graph, "flag_cudagraph_capture_sizes_initlized"):
        # r3_cherry_pick_2.5 builds no real_bsz_to_captured_size; r3_ban_cpucache_2.5 does.
        return "2.5" if hasattr(graph, "real_bsz_to_captured_size") else "2.5-cherry-pick"
    if getattr(graph, "draft_model_use_cudagraph", False):
        return "develop"
    return "2.6" if _RELEASE_VERSION.fullmatch(version) else "develop-e53f518"


#: A release's version string; anything else (``2.6.0-dev``, ``unknown``) is a develop tree.
_RELEASE_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?")


def release_rules(name: str | None, installed: InstalledFastDeploy | None = None) -> Release:
    """The rules of ``--fastdeploy-version``; None: the installed FastDeploy's, else develop.
    ``installed`` saves looking FastDeploy up again."""
    if name is None:
        found = installed if installed is not None else installed_fastdeploy()
        name = found.release if found is not None and found.release else DEFAULT_RELEASE
    try:
        return RULES[rules_for_version(name)]
    except UnknownVersion as error:
        raise ConfigError(f"--fastdeploy-version {error}.") from None


class _ModelStandIn:
    """What ``FDConfig`` reads of a model config when there is no model, as FastDeploy's own graph
    tests stand one in (``tests/graph_optimization``); every other field is None."""

    max_model_len = 8192
    architectures = ("PlanModel",)
    enable_mm = False
    mm_max_tokens_per_item = None

    def __getattr__(self, name: str) -> None:
        return None


def derive_with_fastdeploy(
    installed: InstalledFastDeploy, s: ServingSettings
) -> tuple[Derived, bool]:
    """FastDeploy's own lists, maps and ``use_cudagraph``, and its ``draft_model_use_cudagraph``.

    ``Derived.filtered`` is left False: FastDeploy keeps no trace of the filter; the caller takes
    it from the rules. Raises ``FastDeployRefused`` where FastDeploy asserts, anything else where
    its ``FDConfig`` cannot be built here.
    """
    config = installed.config
    graph: dict[str, Any] = {
        "use_cudagraph": s.use_cudagraph,
        "graph_opt_level": s.graph_opt_level,
        "full_cuda_graph": s.full_cuda_graph,
        "cudagraph_only_prefill": s.only_prefill,
        "max_capture_shape_prefill": s.max_capture_shape_prefill,
    }
    if s.capture_sizes is not None:
        graph["cudagraph_capture_sizes"] = list(s.capture_sizes)
    if s.capture_sizes_prefill is not None:
        graph["cudagraph_capture_sizes_prefill"] = list(s.capture_sizes_prefill)
    if s.draft_model_use_cudagraph is not None:
        graph["draft_model_use_cudagraph"] = s.draft_model_use_cudagraph
    with paddle_import.quiet():
        speculative: dict[str, Any] = {}
        if s.method is not None:
            accepted = getattr(config.SpeculativeConfig({}), "method_list", ())
            # 2.4 and 2.5 spell ngram ngram_match.
            name = "ngram_match" if s.method == "ngram" and "ngram_match" in accepted else s.method
            speculative = {"method": name, "num_speculative_tokens": s.k}
        # FastDeploy's ParallelConfig derives use_sequence_parallel_moe from expert parallelism
        # (2.4_r3 .. r3_mm_dev: not disabled, expert_parallel_size > 1 and tp > 1); the stand-in
        # takes it as given.
        parallel = {
            "tensor_parallel_size": s.tensor_parallel_size,
            "enable_expert_parallel": s.expert_parallel or s.sequence_parallel_moe,
            "disable_sequence_parallel_moe": not s.sequence_parallel_moe,
            "use_sequence_parallel_moe": s.sequence_parallel_moe,
        }
        scheduler = {"max_num_seqs": s.max_num_seqs, "splitwise_role": s.splitwise_role}
        cache = config.CacheConfig({})
        # CacheConfig derives num_cpu_blocks from --swap-space and the model's block size, which
        # a plan has no model for: one block stands for "a host cache", as postprocess reads it.
        cache.num_cpu_blocks = 1 if s.host_cache else 0
        try:
            fd_config = config.FDConfig(
                model_config=_ModelStandIn(),
                cache_config=cache,
                load_config=config.LoadConfig({"dynamic_load_weight": s.dynamic_load_weight}),
                parallel_config=config.ParallelConfig(parallel),
                scheduler_config=config.SchedulerConfig(scheduler),
                graph_opt_config=config.GraphOptimizationConfig(graph),
                speculative_config=config.SpeculativeConfig(speculative),
                test_mode=True,
            )
        except AssertionError as error:
            raise FastDeployRefused(str(error)) from None
    goc = fd_config.graph_opt_config
    prefill = getattr(goc, "cudagraph_capture_sizes_prefill", None)
    derived = Derived(
        capture_sizes=[int(size) for size in goc.cudagraph_capture_sizes],
        capture_sizes_prefill=None if prefill is None else [int(size) for size in prefill],
        real_shape_to_captured_size=_int_map(goc.real_shape_to_captured_size),
        real_shape_to_captured_size_prefill=_int_map(
            getattr(goc, "real_shape_to_captured_size_prefill", None)
        ),
        real_bsz_to_captured_size=_int_map(getattr(goc, "real_bsz_to_captured_size", None)),
        use_cudagraph=bool(goc.use_cudagraph),
        filtered=False,
        graph_opt_level=int(goc.graph_opt_level),
        only_prefill=bool(goc.cudagraph_only_prefill),
    )
    return derived, bool(getattr(goc, "draft_model_use_cudagraph", False))


def _int_map(mapping: object) -> dict[int, int]:
    if not mapping:
        return {}
    return dict(sorted((int(key), int(value)) for key, value in mapping.items()))
