"""Every flag of FastDeploy's launch line, per source tree: facts read from its source, no code.

``python -m fastdeploy.entrypoints.openai.api_server`` builds its parser from the api server's own
flags (``make_arg_parser`` in ``fastdeploy/entrypoints/openai/utils.py``) and
``EngineArgs.add_cli_args`` (``fastdeploy/engine/args_utils.py``), on a ``FlexibleArgumentParser``
that also takes ``--config FILE`` (a YAML file of the same settings). The table below lists each
``add_argument`` of those two functions in the ``gongshaotian/FastDeploy`` tree of every rule set
(``capture_rules.RULES``: the same branches and commits), read from the source with Python's
``ast`` outside this repository; only the spellings, how many values each takes and the trees
that have it are kept.

``plan`` and ``tune`` accept every one of them, so a whole launch line can be pasted; the ones
that change what FastDeploy captures are read (``engine_args.CAPTURE_FLAGS``), the others are
named once in a note. A flag the chosen tree lacks is refused, as that tree's parser would refuse
it.
"""

from __future__ import annotations

from fd_cudagraph_plugin.core.errors import ConfigError

#: The trees, as ``capture_rules.RULES`` names them.
ALL = ("2.4", "2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop")

#: ``(spellings, values, trees)``. ``values``: "0" a switch (``store_true``, or FastDeploy's
#: ``DeprecatedOptionWarning``), "bool" a switch with a ``--no-`` form
#: (``BooleanOptionalAction``), "1" one value, "append" one value each time it is given, "+" one
#: or more values; a dict where the trees differ. ``trees``: the trees whose parser has it.
FLAGS: tuple[tuple[tuple[str, ...], str | dict[str, str], tuple[str, ...]], ...] = (
    (("--model",), "1", ALL),
    (("--served-model-name",), "1", ALL),
    (("--revision",), "1", ALL),
    (("--model-config-name",), "1", ALL),
    (("--tokenizer",), "1", ALL),
    (("--tokenizer-base-url",), "1", ALL),
    (("--max-model-len",), "1", ALL),
    (("--block-size",), "1", ALL),
    (("--task",), "1", ALL),
    (("--runner",), "1", ALL),
    (("--convert",), "1", ALL),
    (("--override-pooler-config",), "1", ALL),
    (("--use-warmup",), "1", ALL),
    (("--limit-mm-per-prompt",), "1", ALL),
    (("--mm-processor-kwargs",), "1", ALL),
    (("--max-encoder-cache",), "1", ALL),
    (("--max-processor-cache",), "1", ALL),
    (("--enable-mm",), "0", ALL),
    (("--reasoning-parser",), "1", ALL),
    (("--chat-template",), "1", ALL),
    (("--tool-call-parser",), "1", ALL),
    (("--tool-parser-plugin",), "1", ALL),
    (("--speculative-config",), "1", ALL),
    (("--dynamic-load-weight",), "0", ALL),
    (("--load-strategy",), "1", ALL),
    (("--engine-worker-queue-port",), "1", ALL),
    (("--quantization",), "1", ALL),
    (("--graph-optimization-config",), "1", ALL),
    (("--plas-attention-config",), "1", ALL),
    (("--guided-decoding-backend",), "1", ALL),
    (("--guided-decoding-disable-any-whitespace",), "1", ALL),
    (("--enable-logprob",), "0", ALL),
    (("--max-logprobs",), "1", ALL),
    (("--logprobs-mode",), "1", ALL),
    (("--seed",), "1", ALL),
    (("--enable-early-stop",), "0", ALL),
    (("--early-stop-config",), "1", ALL),
    (("--lm_head-fp32",), "0", ALL),
    (("--logits-processors",), "+", ALL),
    (("--tensor-parallel-size", "-tp"), "1", ALL),
    (("--disable-custom-all-reduce",), "0", ALL),
    (("--use-internode-ll-two-stage",), "0", ALL),
    (("--disable-sequence-parallel-moe",), "0", ALL),
    (("--max-num-seqs",), "1", ALL),
    (("--num-gpu-blocks-override",), "1", ALL),
    (("--max-num-batched-tokens",), "1", ALL),
    (("--gpu-memory-utilization",), "1", ALL),
    (("--data-parallel-size",), "1", ALL),
    (("--local-data-parallel-id",), "1", ALL),
    (("--enable-expert-parallel",), "0", ALL),
    (("--enable-eplb",), "0", ALL),
    (("--eplb-config",), "1", ALL),
    (("--routing-replay-config",), "1", ALL),
    (("--enable-chunked-moe",), "0", ALL),
    (("--chunked-moe-size",), "1", ALL),
    (("--load-choices",), "1", ALL),
    (("--kv-cache-ratio",), "1", ALL),
    (("--swap-space",), "1", ALL),
    (("--prealloc-dec-block-slot-num-threshold",), "1", ALL),
    (("--cache-queue-port",), "1", ALL),
    (("--static-decode-blocks",), "1", ALL),
    (("--ips",), "1", ALL),
    (("--enable-prefix-caching",), "bool", ALL),
    (("--enable-output-caching",), "bool", ALL),
    (("--enable-chunked-prefill",), "0", ALL),
    (("--max-num-partial-prefills",), "1", ALL),
    (("--max-long-partial-prefills",), "1", ALL),
    (("--long-prefill-token-threshold",), "1", ALL),
    (("--splitwise-role",), "1", ALL),
    (("--cache-transfer-protocol",), "1", ALL),
    (("--pd-comm-port",), "1", ALL),
    (("--rdma-comm-ports",), "1", ALL),
    (("--disable-chunked-mm-input",), "0", ALL),
    (("--router",), "1", ALL),
    (("--scheduler-name",), "1", ALL),
    (("--scheduler-max-size",), "1", ALL),
    (("--scheduler-ttl",), "1", ALL),
    (("--scheduler-host",), "1", ALL),
    (("--scheduler-port",), "1", ALL),
    (("--scheduler-db",), "1", ALL),
    (("--scheduler-password",), "1", ALL),
    (("--scheduler-topic",), "1", ALL),
    (("--scheduler-min-load-score",), "1", ALL),
    (("--scheduler-load-shards-num",), "1", ALL),
    (("--scheduler-sync-period",), "1", ALL),
    (("--scheduler-expire-period",), "1", ALL),
    (("--scheduler-release-load-expire-period",), "1", ALL),
    (("--scheduler-reader-parallel",), "1", ALL),
    (("--scheduler-writer-parallel",), "1", ALL),
    (("--scheduler-reader-batch-size",), "1", ALL),
    (("--scheduler-writer-batch-size",), "1", ALL),
    (("--port",), "1", ALL),
    (("--host",), "1", ALL),
    (("--workers",), "1", ALL),
    (("--metrics-port",), "1", ALL),
    (("--controller-port",), "1", ALL),
    (("--max-waiting-time",), "1", ALL),
    (("--max-concurrency",), "1", ALL),
    (("--enable-mm-output",), "0", ALL),
    (("--timeout-graceful-shutdown",), "1", ALL),
    (("--timeout",), "1", ALL),
    (("--api-key",), "append", ALL),
    (("--rsync-config",), "1", ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop")),
    (("--enable-entropy",), "0", ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop")),
    (("--model-impl",), "1", ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop")),
    (
        ("--shutdown-comm-group-if-worker-idle",),
        "bool",
        ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop"),
    ),
    (
        ("--kvcache-storage-backend",),
        "1",
        ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop"),
    ),
    (("--write-policy",), "1", ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop")),
    (
        ("--enable-overlap-schedule",),
        {
            "2.5-cherry-pick": "0",
            "2.5": "0",
            "2.6": "bool",
            "develop-e53f518": "bool",
            "develop": "bool",
        },
        ("2.5-cherry-pick", "2.5", "2.6", "develop-e53f518", "develop"),
    ),
    (("--benchmark-metrics-config",), "1", ("2.6",)),
    (("--enable-keep-sampling-mask",), "0", ("2.6",)),
    (("--moe-gate-fp32",), "0", ("2.6", "develop-e53f518", "develop")),
    (("--enable-flashinfer-allreduce-fusion",), "0", ("2.6", "develop")),
    (("--ep-prefill-use-worst-num-tokens",), "0", ("2.6", "develop-e53f518", "develop")),
    (("--enable-moe-scores-elementwise-fuse",), "0", ("2.6", "develop")),
    (("--deploy-modality",), "1", ("2.6", "develop-e53f518", "develop")),
    (("--model-loader-extra-config",), "1", ("develop-e53f518", "develop")),
    (("--write-through-threshold",), "1", ("develop",)),
)


def arity(values: str | dict[str, str], tree: str) -> str:
    return values if isinstance(values, str) else values[tree]


#: The flags that change what FastDeploy captures: ``engine_args`` reads them with types and
#: bounds. Every other flag of the table changes nothing any tree's ``config.py`` derives for the
#: capture (read there: the capture lists, ``use_cudagraph``, ``graph_opt_level`` and
#: ``cudagraph_only_prefill`` are set from these alone).
CAPTURE_FLAGS = frozenset(
    {
        "--max-num-seqs",
        "--tensor-parallel-size",
        "--data-parallel-size",
        "--splitwise-role",
        "--enable-expert-parallel",
        "--disable-sequence-parallel-moe",
        "--graph-optimization-config",
        "--speculative-config",
        "--dynamic-load-weight",
        "--swap-space",
    }
)
#: The API server's own flags (``make_arg_parser``, the same in every tree); the rest are
#: ``EngineArgs.add_cli_args``'s.
API_SERVER_FLAGS = frozenset(
    {
        "--port",
        "--host",
        "--workers",
        "--metrics-port",
        "--controller-port",
        "--max-waiting-time",
        "--max-concurrency",
        "--enable-mm-output",
        "--timeout-graceful-shutdown",
        "--timeout",
        "--api-key",
    }
)
#: FlexibleArgumentParser's own: a YAML file of settings.
YAML_CONFIG = "--config"


def check(tree: str, given: list[tuple[str, bool]]) -> list[str]:
    """The launch flags given (``(flag, negated)``: ``--no-x`` for a ``bool`` flag), against the
    parser of ``tree``. Returns the note naming the flags that change nothing captured; raises
    a ``ConfigError`` with the reason where ``tree``'s parser would refuse one."""
    table = {spellings[0]: (values, trees) for spellings, values, trees in FLAGS}
    names = []
    for flag, negated in given:
        values, trees = table[flag]
        shown = f"--no-{flag[2:]}" if negated else flag
        if tree not in trees or (negated and arity(values, tree) != "bool"):
            have = [t for t in trees if not negated or arity(values, t) == "bool"]
            raise ConfigError(
                f"{shown}: FastDeploy {tree}'s launch line has no such flag, so its parser would "
                f"stop at it (unrecognized arguments); {_trees(have)}. Remove it, or pass the "
                "--fastdeploy-version of the FastDeploy that serves."
            )
        if flag not in CAPTURE_FLAGS and shown not in names:
            names.append(shown)
    if not names:
        return []
    return [
        f"{', '.join(names)} {'change' if len(names) > 1 else 'changes'} nothing FastDeploy "
        f"captures (FastDeploy {tree}'s config.py derives the capture from the other flags); "
        "taken and not shown."
    ]


def _trees(trees: list[str]) -> str:
    if not trees:
        return "no tree these rules were read for has it"
    return f"it is a flag of FastDeploy {', '.join(trees)}"
