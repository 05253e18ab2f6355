"""Which graph serves a step, and what every step is counted under: decided here, in one place,
and trusted everywhere else.

The dispatcher owns the routing rule in two forms, kept equal by ``tests/test_dispatch.py``:

* ``route(meta, tokens)``: every step's graph key (phase, static or dynamic, size) or why it runs
  eagerly, and what it is counted under; ``decide`` adds what the backend does with it
  (``Step.action``), and the backend reports what it did once (``count``);
* ``serve``: the same rule for the one common case, a decode step whose graph is captured, as a
  closure over the table ``served`` that ``publish`` keeps: the backend's ``__call__``.

Every counter is here, for both paths and for the steps FastDeploy runs without the backend
(``skipped``): served traffic and capture-time runs apart (``tune`` fits sizes
to served steps only). ``steps[key]`` counts decode replays by the hot path's key (token count,
or running requests under speculative decoding, where ``tokens[key]`` counts their tokens);
``other_keys`` the decode steps of a key its graph did not serve, ``by_tokens`` those replayed by
token count under speculative decoding, ``prefill_steps`` prefill replays. Lists never change
size, so another thread may read them while serving goes on; the Counters are read through
``dict()`` copies, made in one C call under the GIL.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from fd_cudagraph_plugin.core.graphs import (
    CAPTURE,
    DECODE,
    EAGER,
    PREFILL,
    REPLAY,
    RUNNING,
    TOKENS,
    VERIFY,
    GraphEntry,
    GraphKey,
    GraphTable,
    Step,
)
from fd_cudagraph_plugin.core.mode import Mode

General = Callable[[dict, Any, int], Any]


class Counts:
    """The steps of one kind (served traffic, or a capture session's runs), as counted."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.steps = [0] * len(mode.key_table)
        self.tokens = [0] * len(mode.key_table)
        self.by_tokens = [0] * len(mode.decode_table)
        self.prefill_steps = [0] * len(mode.prefill_table)
        self.fallbacks: Counter[str] = Counter()
        self.other_keys: Counter[int] = Counter()
        #: Decode steps above the largest graph, by key: eager for their size, whoever ran them.
        self.above: Counter[int] = Counter()
        #: What earlier modes' tables counted (``remode``): per-size sums, and steps per key.
        self._folded: tuple[Counter[int], ...] = tuple(Counter() for _ in range(5))
        self._keys_before: Counter[int] = Counter()
        #: A reader on another thread (the stats reporter) never sees steps both folded and
        #: still in the lists; serving itself takes no lock (it runs on the thread that remodes).
        self._folding = threading.Lock()

    def remode(self, mode: Mode) -> None:
        """Count under ``mode`` from now on: a fit to traffic pads keys to other sizes, so the
        steps counted so far are summed per size under the tables they were served by."""
        if mode.key_table == self.mode.key_table and mode.decode_table == self.mode.decode_table:
            self.mode = mode
            return
        with self._folding:
            for total, part in zip(self._folded, self._per_size(), strict=True):
                total.update(part)
            self._keys_before.update({key: n for key, n in enumerate(list(self.steps)) if n})
            for counts in (self.steps, self.tokens, self.by_tokens, self.prefill_steps):
                counts[:] = [0] * len(counts)
            self.mode = mode

    def observed(self) -> dict[int, int]:
        """Decode steps per key, however they were served, those above the largest graph
        (``above``) included: what ``fd-cudagraph tune`` reads."""
        with self._folding:
            seen = Counter(dict(self.other_keys)) + Counter(dict(self.above)) + self._keys_before
            seen.update({key: n for key, n in enumerate(list(self.steps)) if n})
        return dict(seen)

    def per_size(self) -> tuple[Counter[int], ...]:
        """Decode replays and padded tokens per size, the same for prefill, and the decode steps
        a fit to traffic padded past the size FastDeploy's list has for them, by that size."""
        with self._folding:
            return tuple(
                total + part for total, part in zip(self._folded, self._per_size(), strict=True)
            )

    def _per_size(self) -> tuple[Counter[int], ...]:
        mode = self.mode
        replays: Counter[int] = Counter()
        padded: Counter[int] = Counter()
        tokens = list(self.tokens) if mode.keyed_by_running else None
        for key, n in enumerate(list(self.steps)):
            if n:
                size = mode.key_table[key]
                replays[size] += n
                padded[size] += n * size - (tokens[key] if tokens else n * key)
        _add_by_tokens(self.by_tokens, mode.decode_table, replays, padded)
        prefill: Counter[int] = Counter()
        prefill_padded: Counter[int] = Counter()
        _add_by_tokens(self.prefill_steps, mode.prefill_table, prefill, prefill_padded)
        past: Counter[int] = Counter()
        for key, unfitted in enumerate(mode.unfitted_key_table):
            if unfitted and unfitted != mode.key_table[key] and self.steps[key]:
                past[unfitted] += self.steps[key]
        return replays, padded, prefill, prefill_padded, past

    def summary(self) -> dict:
        """Replays, padding and eager steps as plain data (``stats()``)."""
        replays, padded, prefill, _, past = self.per_size()
        return {
            "replays": dict(sorted(replays.items())),
            "padded_past_fastdeploy": {s: n for s, n in sorted(past.items()) if n},
            "prefill_replays": dict(sorted(prefill.items())),
            "eager_fallbacks": dict(self.fallbacks),
            "padded_tokens": sum(padded.values()),
            "padded_tokens_per_size": {s: n for s, n in sorted(padded.items()) if n},
        }


def _add_by_tokens(steps: list[int], table: tuple[int, ...], replays: Counter, padded: Counter):
    for tokens, n in enumerate(list(steps)):
        if n:
            replays[table[tokens]] += n
            padded[table[tokens]] += n * (table[tokens] - tokens)


class Dispatcher:
    """The routing rule, the served table and the counters of one backend. The counters outlive
    the table: ``rebuild`` takes a new table (after a clear, or the static probe's verdict)."""

    def __init__(self, mode: Mode, table: GraphTable, guard_every: int, general: General) -> None:
        self.served_counts = Counts(mode)
        #: Steps run while a capture session is open: not served traffic.
        self.capture_counts = Counts(mode)
        self.counts = self.served_counts
        #: A prefill step reached the backend in only-prefill mode (from 2.5 only static split
        #: routes them): what ``check_capture_successful`` then requires.
        self.saw_prefill_step = False
        #: The graphs were released for memory that moved (``mark_stale``): until a capture
        #: session opens, a step whose graph is not captured runs eagerly as ``memory_moved``.
        self.stale = False
        #: Graphs whose inputs are checked at their next replay (``suspect``).
        self._unverified: set[GraphKey] = set()
        self._guard_every = guard_every
        self._general = general
        self.rebuild(mode, table)

    def rebuild(self, mode: Mode, table: GraphTable) -> None:
        """Serve from ``table`` under ``mode``; nothing is published in it yet."""
        self.served_counts.remode(mode)
        self.capture_counts.remode(mode)
        self.mode = mode
        self.table = table
        self._unverified = set()
        decode = table.decode
        # Empty in cudagraph_only_prefill mode, where decode steps never reach the lookup.
        self._decode_keys = (
            [decode[s].key if s else None for s in mode.decode_table] if decode else []
        )
        self._prefill_keys = [table.prefill[s].key if s else None for s in mode.prefill_table]
        self._by_size = {size: entry.key for size, entry in decode.items()}
        #: ``served[key]``: the entry the fast path replays for a decode key (token count, or
        #: running requests under speculative decoding), or None.
        self.served: list[GraphEntry | None] = [None] * len(mode.key_table)
        #: For each decode size, the hot path's keys that pad to it.
        self._keys_of: dict[int, list[int]] = {}
        for key, size in enumerate(mode.key_table):
            if key and size:
                self._keys_of.setdefault(size, []).append(key)
        self.serve = self._fast_path()

    def in_session(self, open_: bool) -> None:
        """A capture session opened (True) or closed: count its steps apart from served ones."""
        if open_:
            self.stale = False
        self.counts = self.capture_counts if open_ else self.served_counts
        self.serve = self._fast_path()

    def publish(self, entry: GraphEntry) -> None:
        """Let the fast path serve every decode key whose graph ``entry`` is (or stop, once
        disabled or released). Prefill graphs and Paddle-managed (static) graphs, which replay
        through Paddle's partial programs, are served by the general path only."""
        if entry.phase != DECODE or entry.key.static or self.mode.only_prefill:
            return
        servable = entry.captured and entry.registered and not entry.disabled
        served = entry if servable and entry.key not in self._unverified else None
        for key in self._keys_of.get(entry.size, ()):
            self.served[key] = served

    def suspect(self) -> None:
        """A lifecycle call may have moved what the graphs read: the fast path serves nothing
        until the general path has checked each graph at its first step (``VERIFY``)."""
        self._unverified = {entry.key for entry in self.table.all()}
        self.served[:] = [None] * len(self.served)

    def verified(self, entry: GraphEntry) -> None:
        """``entry``'s inputs are where its capture saw them: it serves again."""
        self._unverified.discard(entry.key)
        self.publish(entry)

    def mark_stale(self) -> None:
        """The graphs were released for memory that moved: until a capture session, a step
        whose graph is not captured runs eagerly as ``memory_moved``."""
        self.stale = True

    def _fast_path(self) -> Callable[[dict], Any]:
        """The backend's ``__call__``: serve a step from ``served`` or hand it to the general
        path. Every Nth servable step (``FD_CUDAGRAPH_CHECK_ADDRESSES``) goes to the general path
        instead, which checks the graph's input addresses."""
        served, keys, general = self.served, len(self.served), self._general
        steps, tokens_by_key, guard_every = self.counts.steps, self.counts.tokens, self._guard_every
        ticks = [0]

        def guard_due() -> bool:
            ticks[0] += 1
            if ticks[0] < guard_every:
                return False
            ticks[0] = 0
            return True

        if self.mode.keyed_by_running:

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

    # ------------------------------------------------------------------ the general path

    def decide(self, meta: Any, tokens: int) -> tuple[Step, GraphEntry | None]:
        """What to do with a step the hot path did not serve (``Step.action``), and its entry:
        ``REPLAY`` it, ``VERIFY`` and then replay it, ``CAPTURE`` it, or run it ``EAGER``
        (``Step.reason`` says why). Nothing is counted here: the backend reports what it did
        (``count``)."""
        step = self.route(meta, tokens)
        if step.key is None:
            return step, None
        if step.key.phase == PREFILL and self.mode.only_prefill:
            self.saw_prefill_step = True
        entry = self.table.entry(step.key)
        if entry.disabled:
            return step.eager("self_check_failed"), None
        if entry.captured:
            if not entry.registered:
                # Captured in the session open now; its all-reduce buffers are registered at the
                # session's end, and until then it must not replay.
                return step.eager("unregistered"), None
            action = VERIFY if entry.key in self._unverified else REPLAY
            return Step(step.key, "", step.observed, step.by, action), entry
        if self.stale:
            return step.eager("memory_moved"), None
        if entry.size != tokens:
            # Graphs are captured at exact sizes only: FastDeploy's capture loop supplies them.
            return step.eager("not_captured"), None
        return Step(step.key, "", step.observed, step.by, CAPTURE), entry

    def count(self, step: Step, tokens: int) -> None:
        """Count a step the general path served, once, as it was served: replayed, or run
        eagerly for ``step.reason``."""
        counts = self.counts
        if step.action != REPLAY:
            counts.fallbacks[step.reason] += 1
            if step.observed is not None:
                keys = counts.above if step.reason == "oversized_decode" else counts.other_keys
                keys[step.observed] += 1
        elif step.key.phase == PREFILL:
            counts.prefill_steps[tokens] += 1
        elif step.by == RUNNING:
            counts.steps[step.observed] += 1
            counts.tokens[step.observed] += tokens
        elif self.mode.keyed_by_running:
            # Speculative decoding, served by token count: counted apart, under its requests.
            counts.by_tokens[tokens] += 1
            counts.other_keys[step.observed] += 1
        else:
            counts.steps[tokens] += 1

    def skipped(self, meta: Any) -> None:
        """A step FastDeploy ran without this backend (``seam.count_steps_run_without``): counted
        when it is a decode step above the largest graph, eager for lack of one. Prefill outside
        static split mode, and steps the runner did not flag for graphs (2.4's prefill: its
        ``ForwardMeta`` has no ``exist_prefill``), are FastDeploy's own choice."""
        if meta is not None and meta.step_use_cudagraph:
            step = self.route(meta, meta.ids_remove_padding.shape[0])
            if step.reason == "oversized_decode":
                self.count(step, meta.ids_remove_padding.shape[0])

    def route(self, meta: Any, tokens: int) -> Step:
        mode = self.mode
        if meta.exist_prefill or mode.flagged_prefill:
            return self._prefill(tokens)
        if mode.only_prefill:
            # Graphs of this mode hold prefill kernels; a decode step must not replay them.
            return Step(None, "decode_in_prefill_only_mode")
        if tokens == 0:
            # Nothing to compute, and a graph would re-run its kernels on the last step's
            # metadata (FastDeploy #3888).
            return Step(None, "zero_tokens")
        if mode.keyed_by_running:
            running = self._running(meta)
            table = mode.key_table
            size = table[running] if 0 < running < len(table) else 0
            # The running-request count names a token size; a step with more tokens than that
            # (an under-predicted real_bsz) must not replay a graph with fewer rows: it is
            # padded by token count instead, and counted under its running requests.
            if size and tokens <= size:
                return Step(self._by_size[size], observed=running, by=RUNNING)
            observed = running
        else:
            observed = tokens
        if tokens >= len(mode.decode_table):
            return Step(None, "oversized_decode", observed)
        return Step(self._decode_keys[tokens], observed=observed)

    def _prefill(self, tokens: int) -> Step:
        keys = self._prefill_keys
        if 0 < tokens < len(keys):
            return Step(keys[tokens])
        if tokens == 0:
            return Step(None, "zero_tokens")
        return Step(None, self.mode.oversized_prefill_reason())

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


__all__ = [
    "CAPTURE",
    "EAGER",
    "REPLAY",
    "VERIFY",
    "Counts",
    "Dispatcher",
    "GraphKey",
    "Step",
    "TOKENS",
]
