"""``EngineArgs.add_cli_args``: the flags of a launch line, as upstream's parser takes them.

A subset: the flags that change what is captured and a few that do not (``--model``,
``--max-model-len``, ``--quantization``), with upstream's types, so that a tool that hands a
launch line to the installed FastDeploy's own parser meets its refusals (an unknown flag, a value
its type refuses). Upstream's API server adds its own flags (``--port``, ...) in
``fastdeploy/entrypoints/openai/utils.py``, which the stand-in does not have.
"""

from __future__ import annotations

import argparse
import json


class EngineArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model", type=str, default="baidu/ERNIE-4.5-0.3B-PT")
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--quantization", type=str, default=None)
        parser.add_argument("--speculative-config", type=json.loads, default=None)
        parser.add_argument("--dynamic-load-weight", action="store_true")
        parser.add_argument("--graph-optimization-config", type=json.loads, default=None)
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        parser.add_argument("--disable-sequence-parallel-moe", action="store_true")
        parser.add_argument("--max-num-seqs", type=int, default=8)
        parser.add_argument("--data-parallel-size", type=int, default=1)
        parser.add_argument("--enable-expert-parallel", action="store_true")
        parser.add_argument("--swap-space", type=float, default=None)
        parser.add_argument("--splitwise-role", type=str, default="mixed")
        return parser
