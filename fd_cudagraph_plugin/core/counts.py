"""Counters of the steps a backend ran, served traffic apart from capture-time runs, and the
figures ``stats()`` reports (``BackendStats``).

A backend keeps two ``Counts``: one for served traffic, one for the steps that run while a capture
session is open (FastDeploy's dummy-run steps in ``capture_model()``, the capture runs, replays
inside the capture loop). The backend points the hot path at the session's one when a session
opens and back when it closes, so the hot path never asks which is which, and ``tune`` fits sizes
to served steps only.

``steps[key]`` counts decode replays by the key the hot path uses (token count, or running
requests under speculative decoding), and under speculative decoding ``tokens[key]`` their tokens
(elsewhere a key's tokens are the key). ``other_keys`` counts the decode steps of a key that its
graph did not serve: run eagerly, or (speculative) replayed by token count, which ``by_tokens``
counts. ``prefill_steps`` counts prefill replays by token count. Lists never change size, so
another thread may read them while serving goes on; the Counters are read through ``dict()``
copies, which CPython makes in one C call under the GIL.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fd_cudagraph_plugin.core.settings import Settings


class Counts:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.steps = [0] * len(settings.key_table)
        self.tokens = [0] * len(settings.key_table)
        self.by_tokens = [0] * len(settings.decode_table)
        self.prefill_steps = [0] * len(settings.prefill_table)
        self.fallbacks: Counter[str] = Counter()
        self.other_keys: Counter[int] = Counter()

    def observed(self) -> dict[int, int]:
        """Decode steps per key, however they were served: what ``fd-cudagraph tune`` reads."""
        seen = Counter(dict(self.other_keys))
        seen.update({key: n for key, n in enumerate(list(self.steps)) if n})
        return dict(seen)

    def per_size(self) -> tuple[Counter[int], Counter[int], Counter[int], Counter[int]]:
        """Decode replays and padded tokens per size, then the same for prefill."""
        settings = self.settings
        replays: Counter[int] = Counter()
        padded: Counter[int] = Counter()
        tokens = list(self.tokens) if settings.keyed_by_running else None
        for key, n in enumerate(list(self.steps)):
            if n:
                size = settings.key_table[key]
                replays[size] += n
                padded[size] += n * size - (tokens[key] if tokens else n * key)
        _add_by_tokens(self.by_tokens, settings.decode_table, replays, padded)
        prefill: Counter[int] = Counter()
        prefill_padded: Counter[int] = Counter()
        _add_by_tokens(self.prefill_steps, settings.prefill_table, prefill, prefill_padded)
        return replays, padded, prefill, prefill_padded

    def summary(self) -> dict:
        """Replays, padding and eager steps as plain data (``stats()``)."""
        replays, padded, prefill, _ = self.per_size()
        return {
            "replays": dict(sorted(replays.items())),
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


class BackendStats:
    """What a backend reports (``CudaGraphBackend.stats()``): its served and capture-time
    counters, and the figures of its graphs and of its last capture session. Counters survive
    ``clear_graph``; the backend points its hot path at ``served`` or ``during_capture``."""

    def __init__(self, settings: Settings) -> None:
        self.served = Counts(settings)
        #: Steps run while a capture session is open: not served traffic.
        self.during_capture = Counts(settings)
        #: The report of the last capture session this backend took part in.
        self.last_report: Any = None

    def summary(
        self,
        entries: list[Any],
        captures: int,
        pool_policy: str,
        static_decode: str | None,
        kv_reserve_bytes: int | None,
    ) -> dict[str, Any]:
        captured = [e for e in entries if e.captured]
        decode = [e for e in captured if e.phase == "decode"]
        capture_time = self.during_capture.summary()
        return {
            "captures": captures,
            **self.served.summary(),
            "capture_time": {
                "replays": capture_time["replays"],
                "prefill_replays": capture_time["prefill_replays"],
                "eager_steps": capture_time["eager_fallbacks"],
            },
            "capture_seconds": {e.size: e.capture_seconds for e in decode},
            "graph_bytes": {e.size: e.graph_bytes for e in decode},
            "graph_bytes_total": sum(e.graph_bytes for e in captured),
            "largest_graph_bytes": max((e.graph_bytes for e in captured), default=0),
            "pool_policy": pool_policy,
            "memory": self._memory(kv_reserve_bytes),
            "static_full_decode": static_decode,
        }

    def _memory(self, kv_reserve_bytes: int | None) -> dict[str, Any]:
        """This rank's device memory after the last capture session, and the reserve taken."""
        from fd_cudagraph_plugin.core import budget

        figures: dict[str, Any] = {"kv_reserve_bytes": kv_reserve_bytes}
        mine = self.last_report.mine() if self.last_report is not None else None
        if mine is not None and mine.total:
            figures["free_after_capture_bytes"] = mine.free
            if mine.utilization is not None:
                figures["fit_gpu_memory_utilization"] = budget.fit_utilization(
                    mine.utilization, mine.free, mine.total
                )
        return figures
