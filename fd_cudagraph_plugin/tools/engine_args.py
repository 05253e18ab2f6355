"""FastDeploy's own flags for ``fd-cudagraph plan``, read as FastDeploy's ``EngineArgs`` reads them.

An operator has a FastDeploy command line; ``plan`` takes its flags as they are spelt there
(``fastdeploy/engine/args_utils.py`` of every tree the rules name): ``--max-num-seqs``,
``--tensor-parallel-size`` (``-tp``), ``--splitwise-role``, ``--enable-expert-parallel``,
``--disable-sequence-parallel-moe``, and the JSON of ``--graph-optimization-config`` and
``--speculative-config``. ``plan``'s own flags (``--spec-method``, ``--capture-sizes``, ...) say
the same things; where both are given and disagree, that is an error naming both.

The JSON is FastDeploy's input, so it is checked as FastDeploy would take it and bounded: a key
FastDeploy's config does not have would be dropped by FastDeploy without a word, so it is refused
here with the closest known key; a key FastDeploy has but that does not change what is captured is
taken and named in a note.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools.capture_rules import (
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
)
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
