"""The replay hot path: token count -> graph replay, served from three precomputed tables.

``FastDispatch`` is the C implementation (``_fastpath.c``) when the extension was built at install
time, else the pure-Python ``PyDispatch`` below; both behave identically and the tests run both.
A step the tables cannot serve (prefill, no graph yet, speculative keys, 0 tokens) goes to
``self._dispatch(kwargs, meta)``, which the backend defines.
"""

from __future__ import annotations

from typing import Any


class PyDispatch:
    """Pure-Python twin of the C ``FastDispatch``."""

    _fast_every = 0  # see _fast_period
    _fast_ticks = 0

    def _fast_init(self, length: int) -> None:
        self._fast_replays: list = [None] * length
        self._fast_results: list = [None] * length
        self._fast_counts = [0] * length
        self._fast_length = length

    def _fast_period(self, period: int) -> None:
        if period < 0:
            raise ValueError("period must be >= 0")
        self._fast_every = period
        self._fast_ticks = 0

    def _fast_set(self, tokens: int, replay: Any, result: Any) -> None:
        if not 0 <= tokens < self._fast_length:
            raise IndexError("token count outside the fast table")
        self._fast_replays[tokens] = replay
        self._fast_results[tokens] = result

    def _fast_hits(self) -> list[int]:
        return list(self._fast_counts)

    def __call__(self, **kwargs: Any) -> Any:
        meta = kwargs["forward_meta"]
        tokens = meta.ids_remove_padding.shape[0]
        if tokens < self._fast_length:
            replay = self._fast_replays[tokens]
            if (
                replay is not None
                and not meta.exist_prefill
                and not (self._fast_every and self._sampled())
            ):
                result, counts = self._fast_results[tokens], self._fast_counts
                replay()
                if counts is self._fast_counts:  # unless the replay itself reset the tables
                    counts[tokens] += 1
                return result
        return self._dispatch(kwargs, meta)

    def _sampled(self) -> bool:
        """True on every ``period``-th servable call: it goes to ``_dispatch`` for checks."""
        self._fast_ticks += 1
        if self._fast_ticks < self._fast_every:
            return False
        self._fast_ticks = 0
        return True

    def _dispatch(self, kwargs: dict, meta: Any) -> Any:
        raise NotImplementedError


try:
    from fd_cudagraph_plugin._fastpath import FastDispatch
except ImportError:  # built without a C compiler: same behaviour, about 0.3 us slower a call
    FastDispatch = PyDispatch

#: True when the C hot path is in use.
NATIVE_FASTPATH = FastDispatch is not PyDispatch
