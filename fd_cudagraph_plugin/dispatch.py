"""The replay hot path: a decode step -> graph replay, served from precomputed tables.

Two tables: by token count (plain decode) and by running requests, ``forward_meta.real_bsz``
(speculative decode, where each entry also holds its graph's size: a step with more tokens than
that must not replay it). ``FastDispatch`` is the C implementation (``_fastpath.c``) when the
extension was built at install time, else the pure-Python ``PyDispatch`` below; both behave
identically and the tests run both. A step the tables cannot serve (prefill, no graph yet, a
running count the runner did not set, 0 tokens) goes to ``self._dispatch(kwargs, meta)``.
"""

from __future__ import annotations

from typing import Any


class PyDispatch:
    """Pure-Python twin of the C ``FastDispatch``."""

    _fast_every = 0  # see _fast_period
    _fast_ticks = 0

    def _fast_init(self, length: int, spec_length: int = 0) -> None:
        self._fast_replays: list = [None] * length
        self._fast_results: list = [None] * length
        self._fast_counts = [0] * length
        self._fast_length = length
        self._spec_replays: list = [None] * spec_length
        self._spec_results: list = [None] * spec_length
        self._spec_sizes = [0] * spec_length
        self._spec_hits = [0] * spec_length
        self._spec_tokens = [0] * spec_length
        self._spec_token_hits = [0] * length
        self._spec_length = spec_length

    def _fast_set(self, tokens: int, replay: Any, result: Any) -> None:
        if not 0 <= tokens < self._fast_length:
            raise IndexError("token count outside the fast table")
        self._fast_replays[tokens] = replay
        self._fast_results[tokens] = result

    def _spec_set(self, running: int, replay: Any, result: Any, size: int) -> None:
        if not 0 <= running < self._spec_length:
            raise IndexError("running-request count outside the fast table")
        self._spec_replays[running] = replay
        self._spec_results[running] = result
        self._spec_sizes[running] = size

    def _fast_period(self, period: int) -> None:
        if period < 0:
            raise ValueError("period must be >= 0")
        self._fast_every = period
        self._fast_ticks = 0

    def _fast_hits(self) -> list[int]:
        return list(self._fast_counts)

    def _spec_counts(self) -> tuple[list[int], list[int], list[int]]:
        return list(self._spec_hits), list(self._spec_tokens), list(self._spec_token_hits)

    def __call__(self, **kwargs: Any) -> Any:
        meta = kwargs["forward_meta"]
        tokens = meta.ids_remove_padding.shape[0]
        if tokens < self._fast_length:
            replay = self._fast_replays[tokens]
            if replay is not None:
                if not meta.exist_prefill and not (self._fast_every and self._sampled()):
                    result, counts = self._fast_results[tokens], self._fast_counts
                    replay()
                    if counts is self._fast_counts:  # unless the replay itself reset the tables
                        counts[tokens] += 1
                    return result
            elif self._spec_length:
                running = meta.real_bsz
                if (
                    type(running) is int
                    and 0 < running < self._spec_length
                    and self._spec_replays[running] is not None
                    and tokens <= self._spec_sizes[running]
                    and not meta.exist_prefill
                    and not (self._fast_every and self._sampled())
                ):
                    hits = self._spec_hits
                    result = self._spec_results[running]
                    self._spec_replays[running]()
                    if hits is self._spec_hits:
                        hits[running] += 1
                        self._spec_tokens[running] += tokens
                        self._spec_token_hits[tokens] += 1
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
