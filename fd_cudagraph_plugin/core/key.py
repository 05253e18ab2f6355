"""The graph key: which captured graph serves a step (after vLLM's ``BatchDescriptor``).

The dispatcher decides a step's key in one place (``dispatch.py``); capture, replay and the
counters trust it. Keys are made once per entry at construction, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE = "decode"
PREFILL = "prefill"
#: What a key's size was found from: the step's token count, or (speculative decoding, where
#: FastDeploy maps ``real_bsz`` to a captured size) its running requests.
TOKENS = "tokens"
RUNNING = "running"


@dataclass(frozen=True, slots=True)
class GraphKey:
    phase: str
    #: Paddle-managed graph inside the dy2st partial programs (``dy2st.py``), else a stream
    #: capture of the dygraph runnable by the plugin's runtime.
    static: bool
    #: The captured size in tokens.
    size: int

    @property
    def mode(self) -> str:
        return "static" if self.static else "dynamic"

    def __str__(self) -> str:
        return f"{self.phase} size {self.size}"


@dataclass(frozen=True, slots=True)
class Step:
    """The dispatcher's decision for one step that the hot path did not serve."""

    #: The graph that serves it; None: it runs eagerly.
    key: GraphKey | None
    #: Why it runs eagerly ("" when a graph serves it).
    reason: str = ""
    #: What the step is counted under for ``fd-cudagraph tune``: its decode key (token count, or
    #: running requests under speculative decoding); None for prefill and 0-token steps.
    observed: int | None = None
    #: ``TOKENS`` or ``RUNNING``: what ``key.size`` was found from.
    by: str = TOKENS
