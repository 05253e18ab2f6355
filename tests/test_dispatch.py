"""One routing rule: the fast path serves exactly the steps ``Dispatcher.route`` gives a published
graph, with that graph, and hands every other step to the general path.

Every combination of token count, prefill flag, running requests (stale or not, 0), captured,
disabled or missing graphs, and a due address check is driven through both.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from conftest import make_config

from fd_cudagraph_plugin.core.dispatch import Dispatcher
from fd_cudagraph_plugin.core.graphs import DECODE, RUNNING, GraphTable
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.settings import Settings

SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}


class Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1

    def release(self) -> None:
        pass


def prepared(config, captured: set[int], disabled: set[int], guard_every=0, general=None):
    settings = Settings.from_fd_config(config, PluginOptions.from_env({}))
    table = GraphTable(settings.mode)
    dispatcher = Dispatcher(settings.mode, table, guard_every, general)
    for size, entry in table.decode.items():
        if size in captured:
            entry.graph = Graph()
            entry.replay = entry.graph.replay
            entry.result = f"graph {size}"
            entry.registered = True
            if size in disabled:
                table.disable(entry)
            dispatcher.publish(entry)
    return settings, table, dispatcher


def meta(tokens: int, prefill: bool, running: int):
    return SimpleNamespace(
        ids_remove_padding=SimpleNamespace(shape=[tokens]),
        exist_prefill=prefill,
        real_bsz=running,
        seq_lens_this_time=None,
    )


@pytest.mark.parametrize("speculative", [None, SPECULATIVE], ids=["by tokens", "by running"])
@pytest.mark.parametrize("guard_every", [0, 1, 3])
def test_the_fast_path_serves_exactly_what_route_gives_a_published_graph(speculative, guard_every):
    config = make_config(8, speculative=speculative, cudagraph_capture_sizes=[16, 8, 4, 2])
    sizes = (16, 8, 4, 2)
    # Every subset of captured sizes would be slow; these cover none, some, all, and disabled.
    for captured, disabled in [((), ()), ((16, 4), ()), (sizes, ()), (sizes, (8,))]:
        deferred = []

        def general(kwargs, meta_, tokens, deferred=deferred):
            deferred.append(tokens)
            return "general"

        settings, entries, dispatcher = prepared(
            config, set(captured), set(disabled), guard_every, general
        )
        serve = dispatcher.serve
        ticks = 0
        for tokens, prefill, running in itertools.product(
            range(0, 20), (False, True), range(0, 12)
        ):
            step_meta = meta(tokens, prefill, running)
            step = dispatcher.route(step_meta, tokens)
            entry = entries.entry(step.key) if step.key is not None else None
            servable = (
                entry is not None
                and step.key.phase == DECODE
                and entry.captured
                and not entry.disabled
                and not prefill
                and (not settings.mode.keyed_by_running or (step.by == RUNNING and running > 0))
            )
            guard_due = False
            if servable and guard_every:
                ticks += 1
                guard_due = ticks >= guard_every
                if guard_due:
                    ticks = 0
            deferred.clear()
            result = serve({"forward_meta": step_meta})
            case = (captured, disabled, tokens, prefill, running)
            if servable and not guard_due:
                assert result == f"graph {step.key.size}", case
            else:
                assert result == "general" and deferred == [tokens], (case, step)


def test_a_stale_running_count_is_padded_by_tokens_on_both_paths():
    config = make_config(8, speculative=SPECULATIVE, cudagraph_capture_sizes=[16, 8, 4, 2])
    served = []
    _, _, dispatcher = prepared(
        config, {16, 8, 4, 2}, set(), 0, lambda kwargs, m, t: served.append(t) or "general"
    )
    step = dispatcher.route(meta(6, False, 1), 6)  # one request, six tokens: real_bsz is stale
    assert step.by != RUNNING and step.key.size == 8 and step.observed == 1
    assert dispatcher.serve({"forward_meta": meta(6, False, 1)}) == "general" and served == [6]
