"""``make_arg_parser``: the API server's own flags, then ``EngineArgs.add_cli_args``'s.

A subset of upstream's (``fastdeploy/entrypoints/openai/utils.py``: ``--port``, ``--host``,
``--workers``, ``--metrics-port``, ``--api-key`` and more), with its types, so that a tool that
hands a whole launch line to the installed FastDeploy's parser meets its refusals.
"""

from __future__ import annotations

import argparse

from fastdeploy.engine.args_utils import EngineArgs


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--port", default=8000, type=int)
    parser.add_argument("--host", default="0.0.0.0", type=str)
    parser.add_argument("--workers", default=1, type=int)
    parser.add_argument("--metrics-port", default=None, type=int)
    parser.add_argument("--api-key", type=str, action="append")
    return EngineArgs.add_cli_args(parser)
