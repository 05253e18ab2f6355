"""Process-wide mode flags, usable as context managers or decorators."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def create_guard(
    default: Any,
) -> tuple[Callable[[Any], contextlib.AbstractContextManager], Callable]:
    """Return ``(guard, getter)``: ``with guard(value):`` sets the state, ``getter()`` reads it."""
    state = default

    @contextlib.contextmanager
    def guard(value: Any):
        nonlocal state
        previous, state = state, value
        try:
            yield
        finally:
            state = previous

    def getter() -> Any:
        return state

    return guard, getter


sot_warmup_guard, in_sot_warmup_mode = create_guard(False)
profile_run_guard, in_profile_run_mode = create_guard(False)
