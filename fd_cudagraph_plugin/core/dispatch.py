"""Which graph serves a step: decided here, in one place, and trusted everywhere else.

The backend's hot path serves a decode step whose key has a published graph straight from
``Entries.served``; every other step comes here. ``Dispatcher.route`` returns a ``Step``: the graph
key that serves it (phase, static or dynamic, size) or why it runs eagerly, and what it is counted
under. It reads the step's ``ForwardMeta`` and the mode; it does not capture, replay or count.
"""

from __future__ import annotations

from typing import Any

from fd_cudagraph_plugin.core.entries import Entries
from fd_cudagraph_plugin.core.key import RUNNING, TOKENS, GraphKey, Step
from fd_cudagraph_plugin.core.settings import Settings


class Dispatcher:
    def __init__(self, settings: Settings, entries: Entries) -> None:
        self.settings = settings
        decode = entries.decode
        # Empty in cudagraph_only_prefill mode, where decode steps never reach the lookup.
        self._decode_keys = (
            [decode[s].key if s else None for s in settings.decode_table] if decode else []
        )
        self._prefill_keys = [entries.prefill[s].key if s else None for s in settings.prefill_table]
        self._by_size = {size: entry.key for size, entry in entries.decode.items()}

    def route(self, meta: Any, tokens: int) -> Step:
        settings = self.settings
        # FastDeploy 2.4 routes to the backend, in cudagraph_only_prefill mode, only the steps
        # its runner flagged as prefill-only; its ForwardMeta has no exist_prefill to say so.
        prefill = meta.exist_prefill or (settings.only_prefill and settings.fastdeploy_2_4)
        if prefill:
            return self._prefill(tokens)
        if settings.only_prefill:
            # Graphs of this mode hold prefill kernels; a decode step must not replay them.
            return Step(None, "decode_in_prefill_only_mode")
        if tokens == 0:
            # Nothing to compute, and a graph would re-run its kernels on the last step's
            # metadata (FastDeploy #3888).
            return Step(None, "zero_tokens")
        if settings.keyed_by_running:
            running = self._running(meta)
            table = settings.bsz_table
            size = table[running] if 0 < running < len(table) else 0
            # The running-request count names a token size; a step with more tokens than that
            # (an under-predicted real_bsz) must not replay a graph with fewer rows: it is
            # padded by token count instead, and counted under its running requests.
            if size and tokens <= size:
                return Step(self._by_size[size], observed=running, by=RUNNING)
            observed = running
        else:
            observed = tokens
        if tokens > settings.max_size:
            return Step(None, "oversized_decode", observed)
        return Step(self._decode_keys[tokens], observed=observed)

    def _prefill(self, tokens: int) -> Step:
        settings = self.settings
        keys = self._prefill_keys
        if 0 < tokens < len(keys):
            return Step(keys[tokens])
        if tokens == 0:
            return Step(None, "zero_tokens")
        if settings.static_split:
            # No prefill graphs at all (max_capture_shape_prefill: 0) is not oversized.
            return Step(None, "oversized_prefill" if settings.prefill_sizes else "prefill")
        if settings.only_prefill:
            return Step(None, "oversized_prefill")
        return Step(None, "prefill")

    @staticmethod
    def _running(meta: Any) -> int:
        """Running requests: ``real_bsz`` where the runner sets it, else (FastDeploy 2.5, and
        the dummy runs that pass 0) the sequences with tokens this step, as 2.5's backend does."""
        running = meta.real_bsz
        if running:
            return int(running)
        seq_lens = meta.seq_lens_this_time
        if seq_lens is None:
            return 0
        return int((seq_lens.flatten() > 0).sum())


__all__ = ["Dispatcher", "GraphKey", "Step", "TOKENS", "RUNNING"]
