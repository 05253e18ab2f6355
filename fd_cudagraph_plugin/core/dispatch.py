"""Which graph serves a step: the replay hot path, and the general path for everything else.

The hot path (``__call__``) serves a decode step whose key has a published graph: a few attribute
reads, one list index, ``replay()`` and a counter bump. Any other step goes to ``_dispatch``:
prefill, 0 tokens, an oversized step, a size not captured yet (captured now if a capture session
is running, else run eagerly), or a step due for an address check.

The backend class inherits this and supplies ``_capture_and_run`` (see ``backend.py``); this module
knows nothing about capturing.
"""

from __future__ import annotations

import logging
from typing import Any

from fd_cudagraph_plugin.core.entries import PREFILL, Counts, GraphEntry, Tables
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.static import StaticGraphDriver

logger = logging.getLogger("fd_cudagraph_plugin")


class Dispatch:
    settings: Settings
    tables: Tables
    counts: Counts
    dy_runnable: Any
    runnable: Any
    _static: StaticGraphDriver | None
    #: ``FD_CUDAGRAPH_CHECK_ADDRESSES`` as a period: 0 off, 1 always, N every Nth replay.
    _guard_every: int = 0
    _guard_ticks: int = 0
    #: True when the hot path's key is ``forward_meta.real_bsz`` (speculative decoding).
    _by_running: bool = False
    # The hot path's copies of tables.served and counts.steps/tokens (see _set_tables).
    _served: list[GraphEntry | None]
    _keys: int
    #: ``_keys`` where the key is the token count, else 0: the first test of the hot path.
    _token_keys: int
    _steps: list[int]
    _tokens: list[int]
    # Set by the backend: shapes already warned about, and whether cudagraph_only_prefill saw a
    # prefill-only step.
    _warned: set[tuple[str, int]]
    _saw_only_prefill_step: bool

    def __call__(self, **kwargs: Any) -> Any:
        meta = kwargs["forward_meta"]
        tokens = meta.ids_remove_padding.shape[0]
        if tokens < self._token_keys:  # 0 under speculative decoding: keyed by running requests
            entry = self._served[tokens]
            if (
                entry is not None
                and not meta.exist_prefill
                and not (self._guard_every and self._guard_due())
            ):
                result = entry.result
                entry.replay()
                self._steps[tokens] += 1
                return result
        elif self._by_running:
            return self._call_by_running(kwargs, meta, tokens)
        return self._dispatch(kwargs, meta, tokens)

    def _call_by_running(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        """The hot path under speculative decoding: keyed by running requests, and a step with
        more tokens than its graph's size goes to the general path."""
        running = meta.real_bsz
        if 0 < running < self._keys:
            entry = self._served[running]
            if (
                entry is not None
                and 0 < tokens <= entry.size  # real_bsz can be stale (overlap scheduling)
                and not meta.exist_prefill
                and not (self._guard_every and self._guard_due())
            ):
                result = entry.result
                entry.replay()
                self._steps[running] += 1
                self._tokens[running] += tokens
                return result
        return self._dispatch(kwargs, meta, tokens)

    def _set_tables(self, tables: Tables, counts: Counts) -> None:
        """Point the hot path at ``tables`` and ``counts`` (at construction and on clear)."""
        self.tables, self.counts = tables, counts
        self._served, self._keys = tables.served, len(tables.served)
        self._token_keys = 0 if self._by_running else self._keys
        self._steps, self._tokens = counts.steps, counts.tokens

    def _guard_due(self) -> bool:
        """True on every Nth servable call: it goes to ``_dispatch`` for the address check."""
        self._guard_ticks += 1
        if self._guard_ticks < self._guard_every:
            return False
        self._guard_ticks = 0
        return True

    # ------------------------------------------------------------------ the general path

    def _dispatch(self, kwargs: dict, meta: Any, tokens: int) -> Any:
        settings = self.settings
        tables = self.tables
        if meta.exist_prefill:
            if settings.static_split:
                if 0 < tokens < len(tables.prefill_for_tokens):
                    return self._serve(tables.prefill_for_tokens[tokens], None, tokens, kwargs)
                # No prefill graphs at all (max_capture_shape_prefill: 0) is not oversized.
                reason = "oversized_prefill" if settings.prefill_sizes else "prefill"
                return self._eager(reason, tokens, kwargs)
            if not settings.only_prefill:
                return self._eager("prefill", tokens, kwargs)
            # cudagraph_only_prefill (PD prefill nodes): prefill-only steps are keyed by token
            # count through the decode-size list, as FastDeploy's own backend does.
            self._saw_only_prefill_step = True
        elif settings.only_prefill:
            # Graphs of this mode hold prefill kernels; a decode step must not replay them.
            return self._eager("decode_in_prefill_only_mode", tokens, kwargs)
        if tokens == 0:
            # Nothing to compute, and a graph would re-run its kernels on the last step's
            # metadata (FastDeploy #3888).
            return self._eager("zero_tokens", tokens, kwargs)
        key = self._running(meta) if self._by_running else tokens
        entry = None
        if self._by_running and 0 < key < len(tables.served):
            size = settings.key_table[key]
            # The running-request count names a token size; a step with more tokens than that
            # (an under-predicted real_bsz) must not replay a graph with fewer rows.
            if size and tokens <= size:
                entry = tables.decode[size]
        if entry is None:
            if tokens > settings.max_size:
                self.counts.other_keys[key] += 1
                return self._eager("oversized_decode", tokens, kwargs)
            entry = tables.decode_for_tokens[tokens]
            if self._by_running:
                self.counts.other_keys[key] += 1
                key = None  # served by token count, and counted so
        return self._serve(entry, key, tokens, kwargs)

    def _running(self, meta: Any) -> int:
        """Running requests: ``real_bsz`` where the runner sets it, else (FastDeploy 2.5, and
        the dummy runs that pass 0) the sequences with tokens this step, as 2.5's backend does."""
        running = meta.real_bsz
        if running:
            return int(running)
        seq_lens = meta.seq_lens_this_time
        if seq_lens is None:
            return 0
        return int((seq_lens.flatten() > 0).sum())

    def _serve(self, entry: GraphEntry, key: int | None, tokens: int, kwargs: dict) -> Any:
        """``key``: the decode key to count the step under; None to count it by token count."""
        if entry.disabled:
            return self._eager("self_check_failed", tokens, kwargs, key)
        if entry.captured:
            return self._run_graph(entry, key, tokens, kwargs)
        if entry.size != tokens:
            # Graphs are captured at exact sizes only: FastDeploy's capture loop supplies them.
            return self._eager("not_captured", tokens, kwargs, key)
        return self._capture_and_run(entry, key, tokens, kwargs)

    def _run_graph(self, entry: GraphEntry, key: int | None, tokens: int, kwargs: dict) -> Any:
        """Replay ``entry`` for a step of ``tokens`` tokens, counted under ``key``."""
        if entry.addresses and self._guard_every:
            from fd_cudagraph_plugin.core import guards

            guards.check_addresses(entry.addresses, kwargs, entry.size)
        counts = self.counts
        if entry.phase == PREFILL:
            counts.prefill_steps[tokens] += 1
        elif key is None:
            counts.by_tokens[tokens] += 1
        else:
            counts.steps[key] += 1
            if self._by_running:
                counts.tokens[key] += tokens
        if entry.graph is None:
            return self._static.replay(self.runnable, kwargs, entry.size)
        entry.replay()
        return entry.result

    def _eager(self, reason: str, tokens: int, kwargs: dict, key: int | None = None) -> Any:
        """Run the step without a graph through ``dy_runnable``, as FastDeploy runs every step it
        does not graph. ``key``: a decode step's key, counted as observed."""
        counts = self.counts
        counts.fallbacks[reason] += 1
        if key is not None:
            counts.other_keys[key] += 1
        if reason != "prefill" and (reason, tokens) not in self._warned:
            self._warned.add((reason, tokens))
            if reason == "oversized_prefill":
                limit = self.settings.prefill_sizes[0]
            else:
                limit = self.settings.max_size
            logger.warning(
                "CUDA graph backend %#x: %d tokens ran without a graph (%s); the largest "
                "captured %s size is %d. Further steps of this shape are counted in stats() "
                "without another warning.",
                id(self),
                tokens,
                reason.replace("_", " "),
                "prefill" if reason == "oversized_prefill" else "decode",
                limit,
            )
        return self.dy_runnable(**kwargs)

    def _capture_and_run(
        self, entry: GraphEntry, key: int | None, tokens: int, kwargs: dict
    ) -> Any:
        raise NotImplementedError
