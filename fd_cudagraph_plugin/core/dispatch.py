"""Which graph serves a step: decided here, in one place, and trusted everywhere else.

The dispatcher owns the routing rule in two forms, kept equal by ``tests/test_dispatch.py``:

* ``route(meta, tokens)``: every step's ``Step``, the graph key that serves it (phase, static or
  dynamic, size) or why it runs eagerly, and what it is counted under;
* ``fast_path(...)``: the same rule for the one common case, a decode step whose graph is
  captured, as a closure over the table ``served`` (key -> entry) that ``publish`` keeps. The
  backend's ``__call__`` is this closure: a few local reads, one list index and ``replay()``.
  Every step it does not serve goes to ``route`` through the backend's general path.

It reads the step's ``ForwardMeta`` and the mode; it never captures or counts anything itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core.entries import Entries, GraphEntry
from fd_cudagraph_plugin.core.key import DECODE, RUNNING, TOKENS, GraphKey, Step
from fd_cudagraph_plugin.core.settings import Settings

General = Callable[[dict, Any, int], Any]


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
        #: ``served[key]``: the entry the fast path replays for a decode key (token count, or
        #: running requests under speculative decoding), or None.
        self.served: list[GraphEntry | None] = [None] * len(settings.key_table)
        #: For each decode size, the hot path's keys that pad to it.
        self._keys_of: dict[int, list[int]] = {}
        for key, size in enumerate(settings.key_table):
            if key and size:
                self._keys_of.setdefault(size, []).append(key)

    def publish(self, entry: GraphEntry) -> None:
        """Let the fast path serve every decode key whose graph ``entry`` is (or stop, once
        disabled or released). Prefill graphs and Paddle-managed (static) graphs, which replay
        through Paddle's partial programs, are served by the general path only."""
        if entry.phase != DECODE or entry.key.static or self.settings.only_prefill:
            return
        served = entry if entry.captured and not entry.disabled else None
        for key in self._keys_of.get(entry.size, ()):
            self.served[key] = served

    def fast_path(
        self, steps: list[int], tokens_by_key: list[int], guard_every: int, general: General
    ) -> Callable[[dict], Any]:
        """The backend's ``__call__``: serve a step from ``served`` or hand it to ``general``.
        ``steps`` and ``tokens_by_key`` are the counters it bumps (served traffic, or a
        session's); ``guard_every``: every Nth servable step goes to ``general`` instead, which
        checks the graph's input addresses (FD_CUDAGRAPH_CHECK_ADDRESSES)."""
        served, keys = self.served, len(self.served)
        ticks = [0]

        def guard_due() -> bool:
            ticks[0] += 1
            if ticks[0] < guard_every:
                return False
            ticks[0] = 0
            return True

        if self.settings.keyed_by_running:

            def serve_by_running(kwargs: dict) -> Any:
                meta = kwargs["forward_meta"]
                tokens = meta.ids_remove_padding.shape[0]
                running = meta.real_bsz
                if 0 < running < keys:
                    entry = served[running]
                    if (
                        entry is not None
                        # real_bsz can be stale (overlap scheduling): never fewer rows than tokens
                        and 0 < tokens <= entry.size
                        and not meta.exist_prefill
                        and not (guard_every and guard_due())
                    ):
                        result = entry.result
                        entry.replay()
                        steps[running] += 1
                        tokens_by_key[running] += tokens
                        return result
                return general(kwargs, meta, tokens)

            return serve_by_running

        def serve_by_tokens(kwargs: dict) -> Any:
            meta = kwargs["forward_meta"]
            tokens = meta.ids_remove_padding.shape[0]
            if tokens < keys:
                entry = served[tokens]
                if (
                    entry is not None
                    and not meta.exist_prefill
                    and not (guard_every and guard_due())
                ):
                    result = entry.result
                    entry.replay()
                    steps[tokens] += 1
                    return result
            return general(kwargs, meta, tokens)

        return serve_by_tokens

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
