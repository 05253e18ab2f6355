"""Plugin options, read from ``FD_CUDAGRAPH_*`` environment variables.

They are environment variables because FastDeploy keeps only the
``--graph-optimization-config`` keys its own ``GraphOptimizationConfig`` already has; anything else
is dropped without a word. Workers are spawned with the API server's environment, so a variable set
at launch reaches every rank.

Each option is declared once in ``OPTIONS``; the README table, ``fd-cudagraph doctor`` and the
parser all read that declaration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fd_cudagraph_plugin.errors import ConfigError


@dataclass(frozen=True)
class Option:
    env: str
    default: str
    choices: tuple[str, ...]
    help: str


OPTIONS: tuple[Option, ...] = (
    Option(
        "FD_CUDAGRAPH_BACKEND",
        "plugin",
        ("plugin", "native"),
        "`native` keeps FastDeploy's own backend without uninstalling the plugin.",
    ),
    Option(
        "FD_CUDAGRAPH_RUNTIME",
        "cuda",
        ("cuda", "simulated"),
        "`simulated` runs graphs on the CPU runtime with CUDA-graph semantics (tests, demo). "
        "Never chosen silently.",
    ),
)

_BY_ENV = {option.env: option for option in OPTIONS}


def read_option(env: str, environ: Mapping[str, str] | None = None) -> str:
    """Return the validated value of one option; an unknown value is a ``ConfigError``."""
    option = _BY_ENV[env]
    source = os.environ if environ is None else environ
    raw = source.get(env)
    if raw is None or raw.strip() == "":
        return option.default
    value = raw.strip().lower()
    if value not in option.choices:
        raise ConfigError(
            f"{env}={raw!r} is not a known value; allowed values are "
            f"{', '.join(option.choices)} (default {option.default}). Fix or unset {env}."
        )
    return value


@dataclass(frozen=True)
class PluginOptions:
    backend: str
    runtime: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginOptions:
        return cls(
            backend=read_option("FD_CUDAGRAPH_BACKEND", environ),
            runtime=read_option("FD_CUDAGRAPH_RUNTIME", environ),
        )
