"""How many warm-ups each graph of a capture session gets.

FastDeploy runs ``cudagraph_num_of_warmups`` (2) eager runs before every capture, at every
``capture_model()``: also after an RL weight update or a wake-up, where each recapture repeats the
first in full. docs/design.md ("Warm-ups") lists what a warm-up builds, with the Paddle and
FastDeploy source that makes and frees each:

* what a warm-up builds is never freed by ``clear_graph()``, a weight update, a sleep or a
  wake-up, and is keyed by shape, stream or process, never by a weight's address: library
  handles (Paddle makes them itself before each capture), autotune and GEMM-config caches,
  kernels compiled or loaded on first use, buffers a layer makes on its first call;
* but a capture reads host state that only the eager run right before it wrote: FastDeploy's
  append- and flash-attention skip their device-to-host copy while Paddle captures and branch on
  the last eager run's ``max_len_tensor_cpu`` (``get_block_shape_and_split_kv_block.cu``); the
  w4afp8 MoE GEMM sizes its captured grid from the last eager batch; NCCL communicators shut
  down by a weight update are made again at their first eager use.

So a size this backend captured before in this process gets one warm-up, the eager run of the
same inputs right before its capture, and a size new to it (the first session, a new size, a
static graph Paddle keeps itself) gets FastDeploy's full count.

Under tensor parallelism a warm-up runs collectives, so every rank must run the same ones: each
rank says at the plan point what it has not warmed, and every rank warms in full what any rank
has not (``agreed``). A backend keeps what it has warmed itself (``WarmedSizes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fd_cudagraph_plugin.core.errors import plural
from fd_cudagraph_plugin.core.graphs import DECODE, PREFILL, GraphKey
from fd_cudagraph_plugin.core.ranks.messages import Unwarmed

#: Warm-ups of a size captured before in this process: the eager run a capture reads host
#: state from (see above). Never more than FastDeploy's configured count.
AFTER_FIRST_CAPTURE = 1


class WarmedSizes:
    """The dynamic graph keys one backend has warmed and captured in this process."""

    def __init__(self) -> None:
        self._keys: set[GraphKey] = set()

    def add(self, key: GraphKey) -> None:
        if not key.static:
            self._keys.add(key)

    def missing(self, planned: Iterable[GraphKey]) -> Unwarmed:
        """Of ``planned``, the sizes by phase still to warm (static keys always are: Paddle
        keeps those graphs and their programs itself)."""
        todo: dict[str, list[int]] = {DECODE: [], PREFILL: []}
        for key in planned:
            if key.static or key not in self._keys:
                todo[key.phase].append(key.size)
        return Unwarmed(decode=todo[DECODE], prefill=todo[PREFILL])


def agreed(unwarmed: list[list[Unwarmed]], members: int) -> dict[int, dict[str, set[int]]]:
    """What every rank warms: per member (by place), per phase, the sizes any rank has not
    warmed. The same on every rank: every rank computes it from every rank's post."""
    to_warm: dict[int, dict[str, set[int]]] = {}
    for index in range(members):
        union: dict[str, set[int]] = {DECODE: set(), PREFILL: set()}
        for rank_todo in unwarmed:
            if index < len(rank_todo):
                union[DECODE].update(rank_todo[index].decode)
                union[PREFILL].update(rank_todo[index].prefill)
        to_warm[index] = union
    return to_warm


def note(report: Any, members: list[Any]) -> str:
    """Why a session ran fewer warm-ups than FastDeploy would have, for its summary line; ""
    when it ran them all."""
    configured = {f"{id(m):#x}": m.settings.num_warmups for m in members}
    fewer = [r for r in report.records if r.warmups < configured.get(r.backend, 0)]
    if not fewer:
        return ""
    each = f"{AFTER_FIRST_CAPTURE} each for"
    if len(fewer) == len(report.records):
        return (
            f"{each} all {plural(len(fewer), 'graph')}, their sizes warmed earlier in this process"
        )
    return (
        f"{each} {len(fewer)} of {plural(len(report.records), 'graph')}, their sizes warmed "
        f"earlier in this process"
    )
