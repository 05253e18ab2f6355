"""FastDeploy's launch line for every tool: one set of flags, read as FastDeploy reads them.

An operator has a FastDeploy command line; ``plan`` and ``tune`` take it whole, as it is spelt
there (``add_fastdeploy_flags``). The flags that change what FastDeploy captures
(``launch_flags.CAPTURE_FLAGS``: ``--max-num-seqs``, ``--tensor-parallel-size`` (``-tp``),
``--data-parallel-size``, ``--splitwise-role``, ``--enable-expert-parallel``,
``--disable-sequence-parallel-moe``, ``--dynamic-load-weight``, ``--swap-space``, and the JSON of
``--graph-optimization-config`` and ``--speculative-config``) are read with their bounds; every
other flag of the tree's parser (``launch_flags.FLAGS``: ``--model``, ``--port``,
``--quantization``, ...) is taken and named once in a note, and one the chosen tree lacks is
refused, as its parser would. ``serving_input`` turns them into one ``PlanInput``; ``plan``'s own
flags (``--spec-method``, ``--capture-sizes``, ...) say the same things, and where both are given
and disagree, that is an error naming both.

The JSON is FastDeploy's input, so it is checked as FastDeploy would take it and bounded: a key
FastDeploy's config does not have would be dropped by FastDeploy without a word, so it is refused
here with the closest known key; a key FastDeploy has but that does not change what is captured is
taken and named in a note.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools import launch_flags
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    MAX_TENSOR_PARALLEL_SIZE,
    SPEC_METHODS,
    SPLITWISE_ROLES,
)
from fd_cudagraph_plugin.tools.plan import PlanInput
from fd_cudagraph_plugin.tools.traces import TOKEN_LIMIT
from fd_cudagraph_plugin.tools.wording import shown

#: Longest JSON value taken: a capture list of 1024 sizes of 10 digits each fits with room.
MAX_JSON = 64 << 10
#: Most sizes a JSON capture list may hold (FastDeploy's automatic lists hold at most 36).
MAX_SIZES = 1024

#: ``GraphOptimizationConfig`` keys of the six trees (2.4_r3 .. r3_mm_dev), as ``__init__`` sets
#: them, to the ``PlanInput`` field each sets; None: FastDeploy reads it, but it does not change
#: what is captured.
GRAPH_KEYS: dict[str, str | None] = {
    "use_cudagraph": "use_cudagraph",
    "graph_opt_level": "graph_opt_level",
    "full_cuda_graph": "full_cuda_graph",
    "cudagraph_only_prefill": "only_prefill",
    "cudagraph_capture_sizes": "capture_sizes",
    "cudagraph_capture_sizes_prefill": "capture_sizes_prefill",
    "max_capture_shape_prefill": "max_capture_shape_prefill",
    "draft_model_use_cudagraph": "draft_model_use_cudagraph",
    "cudagraph_num_of_warmups": None,
    "cudagraph_copy_inputs": None,
    "cudagraph_splitting_ops": None,
    "use_unique_memory_pool": None,
    "sot_warmup_sizes": None,
    # Derived by FDConfig, overwritten whatever is given.
    "max_capture_size": None,
    "real_shape_to_captured_size": None,
    "real_bsz_to_captured_size": None,
    "flag_cudagraph_capture_sizes_initlized": None,
}
#: ``SpeculativeConfig`` keys of the six trees, the same way.
SPECULATIVE_KEYS: dict[str, str | None] = {
    "method": "spec_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "num_model_steps": "num_model_steps",
    **dict.fromkeys(
        (
            "model",
            "quantization",
            "mtp_strategy",
            "max_candidate_len",
            "verify_window",
            "max_ngram_size",
            "min_ngram_size",
            "num_gpu_block_expand_ratio",
            "model_type",
            "sharing_model",
            "benchmark_mode",
            "enf_gen_phase_tag",
            "enable_draft_logprob",
            "verify_strategy",
            "accept_policy",
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob",
        )
    ),
}
#: 2.4 and 2.5 spell ngram ``ngram_match``.
METHOD_ALIASES = {"ngram_match": "ngram"}


@dataclass
class Given:
    """Settings given on the command line, by ``PlanInput`` field: the value and the flag that
    gave it (``--spec-method`` or ``--speculative-config method``), for conflict messages."""

    values: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, name: str, value: Any, flag: str) -> None:
        if value is None:
            return
        if name in self.values and self.values[name] != value:
            raise ConfigError(
                f"{self.flags[name]} and {flag} disagree ({_echo(self.values[name])} against "
                f"{_echo(value)}); give the setting once, or the same value in both."
            )
        self.values[name] = value
        self.flags.setdefault(name, flag)


def _echo(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if isinstance(value, (bool, list)) else shown(value)


def read_json(flag: str, text: str) -> dict[str, Any]:
    """``--graph-optimization-config '{...}'`` as FastDeploy's ``json.loads`` takes it: an object,
    bounded in size."""
    if len(text) > MAX_JSON:
        raise ConfigError(f"{flag} is {len(text)} characters; at most {MAX_JSON} are read.")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        where = f" at column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        raise ConfigError(
            f"{flag} is not valid JSON ({getattr(error, 'msg', error)}{where}); give an object "
            f"such as {flag} '{{\"use_cudagraph\": true}}' (single quotes around it in a shell)."
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object; got {type(value).__name__}.")
    return value


def _unknown(flag: str, key: str, known: Mapping[str, object]) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(
        f"{flag}: {shown(key)} is no key of FastDeploy's config{hint}; FastDeploy would drop it "
        "without a word. Fix or remove it."
    )


def _bool(flag: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{flag}: {key} must be true or false; got {_echo(value)}.")
    return value


def _int(flag: str, key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{flag}: {key} must be an integer in {low}..{high}; got {_echo(value)}.")
    return value


def _sizes(flag: str, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_SIZES:
        raise ConfigError(
            f"{flag}: {key} must be a non-empty list of at most {MAX_SIZES} sizes, such as "
            f"[1, 2, 4, 8]; got {shown(value)}."
        )
    for size in value:
        _int(flag, f"each {key} entry", size, 1, TOKEN_LIMIT)
    return tuple(value)


def _say_ignored(given: Given, flag: str, ignored: list[str]) -> None:
    if ignored:
        given.notes.append(
            f"{flag}: {', '.join(ignored)} change nothing FastDeploy captures; not shown here."
        )


def add_graph_config(given: Given, text: str) -> None:
    flag = "--graph-optimization-config"
    ignored = []
    for key, value in read_json(flag, text).items():
        if key not in GRAPH_KEYS:
            raise _unknown(flag, key, GRAPH_KEYS)
        name = GRAPH_KEYS[key]
        where = f"{flag} {key}"
        if name is None:
            ignored.append(key)
        elif name in ("capture_sizes", "capture_sizes_prefill"):
            given.set(name, _sizes(flag, key, value), where)
        elif name == "graph_opt_level":
            given.set(name, _int(flag, key, value, 0, 2), where)
        elif name == "max_capture_shape_prefill":
            given.set(name, _int(flag, key, value, 1, MAX_PREFILL_SHAPE), where)
        else:
            given.set(name, _bool(flag, key, value), where)
    _say_ignored(given, flag, ignored)


def add_speculative_config(given: Given, text: str) -> None:
    flag = "--speculative-config"
    ignored = []
    for key, value in read_json(flag, text).items():
        if key not in SPECULATIVE_KEYS:
            raise _unknown(flag, key, SPECULATIVE_KEYS)
        name = SPECULATIVE_KEYS[key]
        where = f"{flag} {key}"
        if name is None:
            ignored.append(key)
        elif name == "spec_method":
            if value is None:
                continue  # FastDeploy's default: no speculative decoding
            method = METHOD_ALIASES.get(value, value) if isinstance(value, str) else value
            if method not in SPEC_METHODS:
                raise ConfigError(
                    f"{flag}: method must be one of {', '.join(SPEC_METHODS)} (ngram_match is "
                    f"ngram); got {_echo(value)}."
                )
            given.set(name, method, where)
        elif name == "num_speculative_tokens":
            # 0 is what naive leaves; the plan checks the range per method.
            given.set(name, _int(flag, key, value, 0, MAX_SPECULATIVE_TOKENS), where)
        else:
            given.set(name, _int(flag, key, value, 1, MAX_SPECULATIVE_TOKENS), where)
    _say_ignored(given, flag, ignored)


# ------------------------------------------------------------------ the flags on a command line

#: Where the launch flags that change nothing captured land in the namespace.
_LAUNCH = "fastdeploy_launch:"
#: The most GiB ``--swap-space`` takes: a host cache of 1 PiB is a typo.
MAX_SWAP_GIB = 1 << 20


def _swap_space(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_SWAP_GIB:
        raise argparse.ArgumentTypeError(
            f"must be GiB of host memory in 0..{MAX_SWAP_GIB}, as FastDeploy's float; got "
            f"{shown(text)}"
        )
    return value


def add_fastdeploy_flags(
    parser: argparse.ArgumentParser, integer: Callable[[int, int, str], Callable[[str], int]]
) -> None:
    """FastDeploy's launch line on ``parser``: the flags that change what is captured, with
    their bounds (``integer(low, high, why)`` is the CLI's bounded integer type), then every other
    flag of every tree's parser, taken as that parser takes it (how many values) and hidden from
    ``--help``."""
    group = parser.add_argument_group(
        "FastDeploy's flags, as its command line spells them (a whole launch line is taken: "
        "the flags that change nothing captured are named in a note)"
    )
    group.add_argument(
        "--max-num-seqs",
        type=integer(1, DECODE_CAP, "512 on FastDeploy 2.6 and later, 256 before"),
        default=None,
        help="max_num_seqs, at most 256 on 2.4 and 2.5 and 512 later (default 8, FastDeploy's "
        "CLI default)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=integer(1, MAX_TENSOR_PARALLEL_SIZE, "no larger group changes the plan"),
        default=None,
        help=f"tensor_parallel_size, 1..{MAX_TENSOR_PARALLEL_SIZE} (default 1)",
    )
    group.add_argument(
        "--splitwise-role",
        choices=SPLITWISE_ROLES,
        default=None,
        help="FastDeploy's splitwise_role (default mixed, as FastDeploy's)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=integer(1, MAX_TENSOR_PARALLEL_SIZE, "no larger group changes the plan"),
        default=None,
        help="data_parallel_size: with --enable-expert-parallel, experts span data-parallel "
        "ranks too (default 1)",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="expert parallelism: with --tensor-parallel-size above 1 FastDeploy turns "
        "sequence-parallel MoE on (default off)",
    )
    group.add_argument(
        "--disable-sequence-parallel-moe",
        action="store_true",
        default=None,
        help="keep sequence-parallel MoE off under expert parallelism (default off)",
    )
    group.add_argument(
        "--dynamic-load-weight",
        action="store_true",
        default=None,
        help="RL weight loading: FastDeploy sets graph_opt_level to 0 (dynamic mode) on every "
        "release (default off)",
    )
    group.add_argument(
        "--swap-space",
        type=_swap_space,
        default=None,
        metavar="GiB",
        help="host KV cache in GiB: above 0, FastDeploy develop turns cudagraph_only_prefill off "
        "(default none)",
    )
    group.add_argument(
        "--graph-optimization-config",
        metavar="JSON",
        default=None,
        help="FastDeploy's --graph-optimization-config object, such as "
        '\'{"use_cudagraph": true, "cudagraph_capture_sizes": [1, 2, 4]}\' (default: none)',
    )
    group.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='FastDeploy\'s --speculative-config object, such as \'{"method": "mtp", '
        '"num_speculative_tokens": 1}\' (default: none, no speculative decoding)',
    )
    trees: dict[str, tuple[str, ...]] = {}
    for spellings, values, tree_names in launch_flags.FLAGS:
        if spellings[0] in launch_flags.CAPTURE_FLAGS:
            continue
        kinds = {launch_flags.arity(values, tree) for tree in tree_names}
        kind = "bool" if "bool" in kinds else kinds.pop()
        action: dict[str, Any] = {
            "0": {"action": "store_const", "const": True},
            "bool": {"action": argparse.BooleanOptionalAction},
            "1": {"metavar": "VALUE"},
            "append": {"action": "append", "metavar": "VALUE"},
            "+": {"nargs": "+", "metavar": "VALUE"},
        }[kind]
        parser.add_argument(
            *spellings, dest=_LAUNCH + spellings[0], default=None, help=argparse.SUPPRESS, **action
        )
        trees[spellings[0]] = tree_names
    parser.add_argument(
        launch_flags.YAML_CONFIG, dest=_LAUNCH + launch_flags.YAML_CONFIG, help=argparse.SUPPRESS
    )


def _launch(options: Mapping[str, Any]) -> tuple[list[tuple[str, bool]], list[str]]:
    """The launch flags given, as ``(flag, negated)``, and the tokens FastDeploy's own parser
    would read for every FastDeploy flag given."""
    if options.get(_LAUNCH + launch_flags.YAML_CONFIG) is not None:
        raise ConfigError(
            f"{launch_flags.YAML_CONFIG} {options[_LAUNCH + launch_flags.YAML_CONFIG]}: FastDeploy "
            "reads settings from that YAML file, which fd-cudagraph does not read, so the plan "
            "could differ from what FastDeploy builds. Give the settings it holds as flags."
        )
    given: list[tuple[str, bool]] = []
    tokens: list[str] = []
    for spellings, _values, _trees in launch_flags.FLAGS:
        flag = spellings[0]
        if flag in launch_flags.CAPTURE_FLAGS:
            value = options.get(flag[2:].replace("-", "_"))
        else:
            value = options.get(_LAUNCH + flag)
        if value is None:
            continue
        given.append((flag, value is False))
        if value is True:
            tokens.append(flag)
        elif value is False:
            tokens.append(f"--no-{flag[2:]}")
        elif isinstance(value, list) and spellings[0] not in launch_flags.CAPTURE_FLAGS:
            if _values_are_appended(_values):
                for item in value:
                    tokens += [flag, str(item)]
            else:
                tokens += [flag, *map(str, value)]
        else:
            tokens += [flag, str(value)]
    return given, tokens


def _values_are_appended(values: str | dict[str, str]) -> bool:
    return "append" in ({values} if isinstance(values, str) else set(values.values()))


#: ``plan``'s own flags, by ``PlanInput`` field (argparse's dest is the field but for these).
_OWN_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "tensor_parallel_size": "--tensor-parallel-size",
    "splitwise_role": "--splitwise-role",
    "spec_method": "--spec-method",
    "num_speculative_tokens": "--num-speculative-tokens",
    "graph_opt_level": "--graph-opt-level",
    "full_cuda_graph": "--full-cuda-graph",
    "max_capture_shape_prefill": "--max-capture-shape-prefill",
    "only_prefill": "--only-prefill",
    "capture_sizes": "--capture-sizes",
    "capture_sizes_prefill": "--capture-sizes-prefill",
    "draft_model_use_cudagraph": "--draft-model-use-cudagraph",
    "sequence_parallel_moe": "--sequence-parallel-moe",
}


def serving_input(options: Mapping[str, Any]) -> PlanInput:
    """The command line's settings as one ``PlanInput``, for every tool: the tool's own flags,
    FastDeploy's launch flags and the JSON of its ``--graph-optimization-config`` and
    ``--speculative-config``, each setting given once or the same wherever given (else a
    ``ConfigError`` naming both)."""
    given = Given()
    for name, flag in _OWN_FLAGS.items():
        value = options.get(name)
        if name == "full_cuda_graph" and value is False:
            flag = "--no-full-cuda-graph"
        if name == "draft_model_use_cudagraph" and value is False:
            flag = "--no-draft-model-use-cudagraph"
        given.set(name, value, flag)
    if options.get("disable_sequence_parallel_moe"):
        given.set("sequence_parallel_moe", False, "--disable-sequence-parallel-moe")
    elif options.get("enable_expert_parallel") and given.values.get("tensor_parallel_size", 1) > 1:
        # ParallelConfig: sequence-parallel MoE is on under expert parallelism with tp > 1.
        given.set("sequence_parallel_moe", True, "--enable-expert-parallel")
    ranks = given.values.get("tensor_parallel_size", 1) * (options.get("data_parallel_size") or 1)
    expert_parallel = bool(options.get("enable_expert_parallel")) and ranks > 1
    if options.get("graph_optimization_config") is not None:
        add_graph_config(given, options["graph_optimization_config"])
    if options.get("speculative_config") is not None:
        add_speculative_config(given, options["speculative_config"])
    launch, tokens = _launch(options)
    swap = options.get("swap_space")
    return PlanInput(
        **given.values,
        fastdeploy_version=options.get("fastdeploy_version"),
        given_notes=tuple(given.notes),
        expert_parallel=expert_parallel,
        dynamic_load_weight=bool(options.get("dynamic_load_weight")),
        host_cache=bool(swap),
        launch_flags=tuple(launch),
        fastdeploy_tokens=tuple(tokens),
    )
