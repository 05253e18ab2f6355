"""FastDeploy's launch line as ``plan`` and ``tune`` read it: each setting spelt as FastDeploy does.

An operator has a FastDeploy command line (``python -m fastdeploy.entrypoints.openai.api_server
--model ... --max-num-seqs 128 --graph-optimization-config '{...}'``); the tools take it whole,
head included. Where FastDeploy is importable and is the release asked for, its own parser
(``make_arg_parser``, else ``EngineArgs.add_cli_args``) reads the line, ``parse_known_args``: a
flag it does not know is one it would refuse at launch, so it is refused here too. Elsewhere a
small parser reads the flags that change what FastDeploy captures and the two JSON objects; every
other flag is named once in a note (FastDeploy itself refuses its unknown flags at launch, so no
table of them is kept here).

Whichever parser read them, the values go through the same checks: the bounds FastDeploy
enforces, and the JSON keys FastDeploy's configs have (a key they lack would be dropped by
FastDeploy without a word, so it is refused with the closest known one).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools import paddle_import
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    MAX_TENSOR_PARALLEL_SIZE,
    SPEC_METHODS,
    SPLITWISE_ROLES,
)
from fd_cudagraph_plugin.tools.installed import (
    InstalledFastDeploy,
    installed_fastdeploy,
    release_rules,
)
from fd_cudagraph_plugin.tools.traces import TOKEN_LIMIT
from fd_cudagraph_plugin.tools.wording import as_integer, shown

#: Longest JSON value taken: a capture list of 1024 sizes of 10 digits each fits with room.
MAX_JSON = 64 << 10
#: Most sizes a JSON capture list may hold (FastDeploy's automatic lists hold at most 36).
MAX_SIZES = 1024
#: The most GiB ``--swap-space`` takes: a host cache of 1 PiB is a typo.
MAX_SWAP_GIB = 1 << 20
#: FastDeploy's default ``max_capture_shape_prefill``.
DEFAULT_PREFILL_SHAPE = 512

GRAPH = "--graph-optimization-config"
SPECULATIVE = "--speculative-config"
#: Each setting's one spelling, by ``PlanInput`` field, for the messages that name it.
SPELLING = {
    "max_num_seqs": "--max-num-seqs",
    "tensor_parallel_size": "--tensor-parallel-size",
    "splitwise_role": "--splitwise-role",
    "spec_method": f"{SPECULATIVE} method",
    "num_speculative_tokens": f"{SPECULATIVE} num_speculative_tokens",
    "num_model_steps": f"{SPECULATIVE} num_model_steps",
    "graph_opt_level": f"{GRAPH} graph_opt_level",
    "full_cuda_graph": f"{GRAPH} full_cuda_graph",
    "only_prefill": f"{GRAPH} cudagraph_only_prefill",
    "capture_sizes": f"{GRAPH} cudagraph_capture_sizes",
    "capture_sizes_prefill": f"{GRAPH} cudagraph_capture_sizes_prefill",
    "max_capture_shape_prefill": f"{GRAPH} max_capture_shape_prefill",
    "draft_model_use_cudagraph": f"{GRAPH} draft_model_use_cudagraph",
    "use_cudagraph": f"{GRAPH} use_cudagraph",
}

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
    **dict.fromkeys(
        (
            "cudagraph_num_of_warmups",
            "cudagraph_copy_inputs",
            "cudagraph_splitting_ops",
            "use_unique_memory_pool",
            "sot_warmup_sizes",
            # Derived by FDConfig, overwritten whatever is given.
            "max_capture_size",
            "real_shape_to_captured_size",
            "real_bsz_to_captured_size",
            "flag_cudagraph_capture_sizes_initlized",
        )
    ),
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

#: The tools' own flags of earlier versions for settings FastDeploy's line names: the JSON object
#: and key that name it now, and the kind of value ("sizes", "int", "str", or a fixed value).
REMOVED: dict[str, tuple[str, str, Any]] = {
    "--spec-method": (SPECULATIVE, "method", "str"),
    "--num-speculative-tokens": (SPECULATIVE, "num_speculative_tokens", "int"),
    "--graph-opt-level": (GRAPH, "graph_opt_level", "int"),
    "--full-cuda-graph": (GRAPH, "full_cuda_graph", True),
    "--no-full-cuda-graph": (GRAPH, "full_cuda_graph", False),
    "--max-capture-shape-prefill": (GRAPH, "max_capture_shape_prefill", "int"),
    "--only-prefill": (GRAPH, "cudagraph_only_prefill", True),
    "--capture-sizes": (GRAPH, "cudagraph_capture_sizes", "sizes"),
    "--capture-sizes-prefill": (GRAPH, "cudagraph_capture_sizes_prefill", "sizes"),
    "--draft-model-use-cudagraph": (GRAPH, "draft_model_use_cudagraph", True),
    "--no-draft-model-use-cudagraph": (GRAPH, "draft_model_use_cudagraph", False),
    "--sequence-parallel-moe": ("--enable-expert-parallel", "", True),
}
#: What a removed flag's value stands for where the value cannot be carried over.
_EXAMPLES = {"sizes": [1, 2, 4, 8], "int": 1, "str": "mtp"}


def replacement(tokens: list[str]) -> str:
    """FastDeploy's spelling of every removed flag in ``tokens``, one JSON object per FastDeploy
    flag, with the values given where they read as values."""
    objects: dict[str, dict[str, Any]] = {GRAPH: {}, SPECULATIVE: {}}
    words = []
    for index, token in enumerate(tokens):
        flag, _, attached = token.partition("=")
        if flag not in REMOVED:
            continue
        where, key, kind = REMOVED[flag]
        if not key:
            words.append(
                f"{where} with --tensor-parallel-size above 1 (FastDeploy turns "
                "sequence-parallel MoE on there)"
            )
            continue
        value = attached or (tokens[index + 1] if index + 1 < len(tokens) else "")
        item: Any = kind if not isinstance(kind, str) else _EXAMPLES[kind]
        numbers = [as_integer(word) for word in value.split(",")]
        if kind == "sizes" and all(isinstance(n, int) and 0 < n <= TOKEN_LIMIT for n in numbers):
            item = numbers
        elif kind == "int" and len(numbers) == 1 and isinstance(numbers[0], int):
            item = numbers[0] if 0 <= numbers[0] <= TOKEN_LIMIT else item
        elif kind == "str" and value in SPEC_METHODS:
            item = value
        objects[where][key] = item
    words += [f"{flag} '{json.dumps(value)}'" for flag, value in objects.items() if value]
    return " ".join(words)


#: FlexibleArgumentParser's own: a YAML file of settings, which the tools do not read.
YAML_CONFIG = "--config"
#: The module a pasted launch line names before its flags.
_SERVER_MODULES = ("fastdeploy.entrypoints.openai.api_server", "fastdeploy.entrypoints.api_server")


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
    #: None: FastDeploy's default, 512 (2.4 has no prefill capture).
    max_capture_shape_prefill: int | None = None
    only_prefill: bool = False
    capture_sizes: tuple[int, ...] | None = None
    capture_sizes_prefill: tuple[int, ...] | None = None
    splitwise_role: str = "mixed"
    #: None: the release's default (true on develop, r3_mm_dev; false on the others).
    draft_model_use_cudagraph: bool | None = None
    #: None: the installed FastDeploy's release, else develop; else a fastdeploy-gpu version
    #: (``2.6.1``), ``develop`` or a tree name (``capture_rules.rules_for_version``).
    fastdeploy_version: str | None = None
    #: ``use_cudagraph`` of ``--graph-optimization-config`` (FastDeploy's default: true).
    use_cudagraph: bool = True
    #: ``num_model_steps`` of ``--speculative-config``: MTP raises k to it (None: 1).
    num_model_steps: int | None = None
    #: What the launch line said that the plan does not show.
    given_notes: tuple[str, ...] = ()
    #: FastDeploy's ``use_ep`` (``--enable-expert-parallel`` over more than one rank).
    expert_parallel: bool = False
    #: ``--dynamic-load-weight``, and a host KV cache (``--swap-space`` above 0).
    dynamic_load_weight: bool = False
    host_cache: bool = False
    #: Which parser read the launch line, for the plan's first line ("" when none was given).
    read_by: str = ""
    #: The settings the launch line gave, by field: a tool compares them with a stats file's.
    given: frozenset[str] = frozenset()

    @property
    def prefill_shape(self) -> int:
        given = self.max_capture_shape_prefill
        return DEFAULT_PREFILL_SHAPE if given is None else given


# ------------------------------------------------------------------ reading a launch line


def read(
    tokens: list[str], version: str | None = None, *, use_fastdeploy: bool = True
) -> PlanInput:
    """The launch line ``tokens`` as one ``PlanInput``: read by the installed FastDeploy's parser
    where it is the release ``version`` names, else by the small parser here."""
    tokens = _without_head(list(tokens))
    removed = list(
        dict.fromkeys(t.partition("=")[0] for t in tokens if t.partition("=")[0] in REMOVED)
    )
    if removed:
        raise ConfigError(
            f"{', '.join(removed)} {'are' if len(removed) > 1 else 'is'} gone: the tools read "
            "FastDeploy's launch line and nothing else for what it names. Give "
            f"{replacement(tokens)} instead."
        )
    for token in tokens:
        if token.partition("=")[0] == YAML_CONFIG:
            raise ConfigError(
                f"{YAML_CONFIG}: FastDeploy reads settings from that YAML file, which "
                "fd-cudagraph does not read, so the plan could differ from what FastDeploy "
                "builds. Give the settings it holds as flags."
            )
    installed = installed_fastdeploy() if use_fastdeploy else None
    release = release_rules(version, installed)
    if installed is not None and not installed.problem and installed.release == release.name:
        values, given, read_by, notes = _read_with_fastdeploy(installed, tokens)
    else:
        values, given, notes = _read_here(tokens)
        read_by = "the launch line read by fd-cudagraph's parser of the capture flags"
    return _inputs(values, notes, given, version, read_by if tokens else "")


def _without_head(tokens: list[str]) -> list[str]:
    """A pasted line without ``python -m fastdeploy.entrypoints.openai.api_server``."""
    for index, token in enumerate(tokens[:4]):
        if token in _SERVER_MODULES:
            return tokens[index + 1 :]
    return tokens


class _SmallParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}.")


def _small_parser() -> argparse.ArgumentParser:
    """The flags that change what FastDeploy captures (every tree's ``config.py`` derives the
    capture from these alone), with FastDeploy's spellings and destinations."""
    parser = _SmallParser(prog="fastdeploy", add_help=False, allow_abbrev=False)
    parser.add_argument("--max-num-seqs")
    parser.add_argument("--tensor-parallel-size", "-tp")
    parser.add_argument("--data-parallel-size")
    parser.add_argument("--splitwise-role")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--disable-sequence-parallel-moe", action="store_true")
    parser.add_argument("--dynamic-load-weight", action="store_true")
    parser.add_argument("--swap-space")
    parser.add_argument(GRAPH)
    parser.add_argument(SPECULATIVE)
    return parser


#: The destinations of the capture flags: what a launch line gave of them is what the tools read.
CAPTURE_DESTS = (
    *("max_num_seqs", "tensor_parallel_size", "data_parallel_size", "splitwise_role"),
    *("enable_expert_parallel", "disable_sequence_parallel_moe", "dynamic_load_weight"),
    *("swap_space", "graph_optimization_config", "speculative_config"),
)
_UNSET = object()


def _parse(
    parser: argparse.ArgumentParser, tokens: list[str]
) -> tuple[dict[str, Any], frozenset[str], list[str]]:
    """``parse_known_args`` with the capture flags' defaults kept apart: the values (defaults
    where not given), which of the capture flags the line gave, however spelt (FastDeploy's
    parser takes abbreviations), and the tokens left."""
    dests = [d for d in CAPTURE_DESTS if any(a.dest == d for a in parser._actions)]
    defaults = {dest: parser.get_default(dest) for dest in dests}
    parser.set_defaults(**dict.fromkeys(dests, _UNSET))
    namespace, rest = parser.parse_known_args(tokens)
    values = vars(namespace)
    given = frozenset(dest for dest in dests if values[dest] is not _UNSET)
    values.update({dest: defaults[dest] for dest in dests if dest not in given})
    return values, given, rest


def _flags(rest: list[str]) -> list[str]:
    return list(dict.fromkeys(t.split("=", 1)[0] for t in rest if t.startswith("-")))


def _read_here(tokens: list[str]) -> tuple[dict[str, Any], frozenset[str], list[str]]:
    parser = _small_parser()
    values, given, rest = _parse(parser, tokens)
    flags = _flags(rest)
    spelt = [s for a in parser._actions for s in a.option_strings]
    short = [f for f in flags if f.startswith("--") and any(s.startswith(f) for s in spelt)]
    if short:
        raise ConfigError(
            f"{short[0]} is an abbreviation, which FastDeploy's parser may read as one of "
            f"{', '.join(s for s in spelt if s.startswith(short[0]))}: spell the flag whole."
        )
    notes = []
    if flags:
        notes.append(
            f"{', '.join(flags)} {'change' if len(flags) > 1 else 'changes'} nothing FastDeploy "
            "captures; not read here (FastDeploy's own parser checks them at launch)."
        )
    stray = [t for t in rest if not t.startswith("-")]
    if stray and not flags:
        raise ConfigError(
            f"{shown(stray[0])} is no flag of FastDeploy's launch line; give flags such as "
            "--max-num-seqs 64."
        )
    return values, given, notes


def _read_with_fastdeploy(
    installed: InstalledFastDeploy, tokens: list[str]
) -> tuple[dict[str, Any], frozenset[str], str, list[str]]:
    """FastDeploy's own parser on the line: its API server's where that imports here (a flag it
    leaves is one FastDeploy refuses at launch), else ``EngineArgs.add_cli_args`` (whose leftovers
    may be the server's own flags, such as ``--port``: named, not refused)."""
    with paddle_import.quiet():
        args_utils = importlib.import_module("fastdeploy.engine.args_utils")
        utils = importlib.import_module("fastdeploy.utils")
        flexible = getattr(utils, "FlexibleArgumentParser", argparse.ArgumentParser)
        try:
            server = importlib.import_module("fastdeploy.entrypoints.openai.utils")
            parser = server.make_arg_parser(flexible(prog="fastdeploy"))
            which, whole = "its API server's parser (make_arg_parser)", True
        except Exception:  # the server's own imports (fastapi, uvicorn) may be missing here
            parser = args_utils.EngineArgs.add_cli_args(flexible(prog="fastdeploy"))
            which, whole = "its EngineArgs.add_cli_args", False
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                values, given, rest = _parse(parser, tokens)
        except SystemExit:
            lines = said.getvalue().strip().splitlines()
            raise ConfigError(
                f"FastDeploy {installed.version}'s own parser refuses this launch line: "
                f"{_short(lines[-1]) if lines else 'its parser exited'}"
            ) from None
    read_by = f"the launch line read by the installed FastDeploy's parser, {which}"
    if rest and whole:
        raise ConfigError(
            f"FastDeploy {installed.version}'s own parser ({which}) does not take "
            f"{shown(' '.join(rest))}; FastDeploy would refuse this launch line. Remove it, or "
            "pass the --fastdeploy-version of the FastDeploy that serves."
        )
    notes = []
    flags = _flags(rest)
    if flags:
        notes.append(
            f"{', '.join(flags)}: not flags of EngineArgs; the API server's own parser could not "
            "be built here to check them (they change nothing captured)."
        )
    return values, given, read_by, notes


# ------------------------------------------------------------------ the values, checked


def _short(text: str) -> str:
    """A parser's message with each long run of digits counted, not echoed, and bounded."""
    text = re.sub(r"[0-9]{19,}", lambda run: f"... ({len(run.group())} digits)", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _integer(flag: str, value: Any, low: int, high: int, *, text: bool = True) -> int:
    """An integer as FastDeploy's ``type=int`` takes it (a string here, an int from its parser);
    ``text=False`` for a JSON value, where a string is no integer to FastDeploy."""
    number: Any = value
    if isinstance(value, _Digits):
        number = None
    elif isinstance(value, str) and text:
        number = as_integer(value)  # infinite past 18 digits: out of every bound here
    if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
        raise ConfigError(f"{flag} must be an integer in {low}..{high}; got {shown(value)}.")
    return number


def _object(flag: str, value: Any) -> dict[str, Any]:
    """``--graph-optimization-config '{...}'`` as FastDeploy's ``json.loads`` takes it: an object,
    bounded in size."""
    if isinstance(value, str):
        if len(value) > MAX_JSON:
            raise ConfigError(f"{flag} is {len(value)} characters; at most {MAX_JSON} are read.")
        try:
            value = json.loads(value, parse_int=_json_int)
        except (ValueError, RecursionError) as error:
            where = f" at column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
            raise ConfigError(
                f"{flag} is not valid JSON ({getattr(error, 'msg', error)}{where}); give an "
                f"object such as {flag} '{{\"use_cudagraph\": true}}' (single quotes around it "
                "in a shell)."
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object; got {type(value).__name__}.")
    return value


class _Digits(str):
    """A JSON integer too long to be any setting: kept as its digits, so that the check of the
    key it sets names it (``int()`` refuses 4301 digits and more with advice of its own)."""


def _json_int(digits: str) -> int | _Digits:
    return int(digits) if len(digits.lstrip("-")) <= 18 else _Digits(digits)


def _unknown(flag: str, key: str, known: Mapping[str, object]) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(
        f"{flag}: {shown(key)} is no key of FastDeploy's config{hint}; FastDeploy would drop it "
        "without a word. Fix or remove it."
    )


def _bool(flag: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{flag}: {key} must be true or false; got {shown(value)}.")
    return value


def _sizes(flag: str, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_SIZES:
        raise ConfigError(
            f"{flag}: {key} must be a non-empty list of at most {MAX_SIZES} sizes, such as "
            f"[1, 2, 4, 8]; got {shown(value)}."
        )
    return tuple(
        _integer(f"{flag}: each {key} entry", size, 1, TOKEN_LIMIT, text=False) for size in value
    )


def _known_items(
    flag: str, value: Any, keys: Mapping[str, str | None], notes: list[str]
) -> Iterator[tuple[str, str, Any]]:
    """``(key, PlanInput field, value)`` of each key of the JSON object that changes what is
    captured; a key FastDeploy's config lacks is refused, the others named once in a note."""
    ignored = []
    for key, item in _object(flag, value).items():
        if key not in keys:
            raise _unknown(flag, key, keys)
        name = keys[key]
        if name is None:
            ignored.append(key)
        else:
            yield key, name, item
    if ignored:
        notes.append(
            f"{flag}: {', '.join(ignored)} change nothing FastDeploy captures; not shown here."
        )


def _graph(settings: dict[str, Any], value: Any, notes: list[str]) -> None:
    for key, name, item in _known_items(GRAPH, value, GRAPH_KEYS, notes):
        if name in ("capture_sizes", "capture_sizes_prefill"):
            settings[name] = _sizes(GRAPH, key, item)
        elif name == "graph_opt_level":
            settings[name] = _integer(f"{GRAPH}: {key}", item, 0, 2, text=False)
        elif name == "max_capture_shape_prefill":
            settings[name] = _integer(f"{GRAPH}: {key}", item, 1, MAX_PREFILL_SHAPE, text=False)
        else:
            settings[name] = _bool(GRAPH, key, item)


def _speculative(settings: dict[str, Any], value: Any, notes: list[str]) -> None:
    for key, name, item in _known_items(SPECULATIVE, value, SPECULATIVE_KEYS, notes):
        if name == "spec_method":
            if item is None:
                continue  # FastDeploy's default: no speculative decoding
            method = METHOD_ALIASES.get(item, item) if isinstance(item, str) else item
            if method not in SPEC_METHODS:
                raise ConfigError(
                    f"{SPECULATIVE}: method must be one of {', '.join(SPEC_METHODS)} "
                    f"(ngram_match is ngram); got {shown(item)}."
                )
            settings[name] = method
        else:
            # 0 is what naive leaves; the plan checks the range per method.
            low = 0 if name == "num_speculative_tokens" else 1
            settings[name] = _integer(
                f"{SPECULATIVE}: {key}", item, low, MAX_SPECULATIVE_TOKENS, text=False
            )


def _swap_space(value: Any) -> float:
    try:
        gib = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        gib = math.nan
    if not math.isfinite(gib) or not 0 <= gib <= MAX_SWAP_GIB:
        raise ConfigError(
            f"--swap-space must be GiB of host memory in 0..{MAX_SWAP_GIB}, as FastDeploy's "
            f"float; got {shown(value)}."
        )
    return gib


def _inputs(
    values: Mapping[str, Any],
    notes: list[str],
    given: frozenset[str],
    version: str | None,
    read_by: str,
) -> PlanInput:
    settings: dict[str, Any] = {}
    if "max_num_seqs" in given:
        settings["max_num_seqs"] = _integer("--max-num-seqs", values["max_num_seqs"], 1, DECODE_CAP)
    tp = 1
    if "tensor_parallel_size" in given:
        tp = _integer(
            "--tensor-parallel-size", values["tensor_parallel_size"], 1, MAX_TENSOR_PARALLEL_SIZE
        )
        settings["tensor_parallel_size"] = tp
    dp = 1
    if "data_parallel_size" in given:
        dp = _integer(
            "--data-parallel-size", values["data_parallel_size"], 1, MAX_TENSOR_PARALLEL_SIZE
        )
    if "splitwise_role" in given:
        role = values["splitwise_role"]
        if role not in SPLITWISE_ROLES:
            raise ConfigError(
                f"--splitwise-role must be one of {', '.join(SPLITWISE_ROLES)}; got {shown(role)}."
            )
        settings["splitwise_role"] = role
    expert = bool(values.get("enable_expert_parallel"))
    # ParallelConfig: sequence-parallel MoE is on under expert parallelism with tp > 1.
    settings["sequence_parallel_moe"] = (
        expert and tp > 1 and not values.get("disable_sequence_parallel_moe")
    )
    if values.get(_dest(GRAPH)) is not None:
        _graph(settings, values[_dest(GRAPH)], notes)
    if values.get(_dest(SPECULATIVE)) is not None:
        _speculative(settings, values[_dest(SPECULATIVE)], notes)
    swap = _swap_space(values.get("swap_space")) if "swap_space" in given else 0.0
    return PlanInput(
        **settings,
        fastdeploy_version=version,
        given_notes=tuple(notes),
        expert_parallel=expert and tp * dp > 1,
        dynamic_load_weight=bool(values.get("dynamic_load_weight")),
        host_cache=bool(swap),
        read_by=read_by,
        given=given,
    )


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")
