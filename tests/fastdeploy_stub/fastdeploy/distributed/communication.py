"""Tensor-parallel communication helpers around the custom all-reduce (``_TP_AR``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

_TP_AR: Any = None  # a CustomAllreduce once TP > 1 enables it; tests may install a recorder

_DEFAULT_MAX_BYTES = 8 * 1024 * 1024


@contextmanager
def capture_custom_allreduce() -> Iterator[None]:
    """Wrap a CUDA-graph capture: ``_TP_AR.capture()`` when set, else nothing (TP=1)."""
    ctx = _TP_AR.capture() if _TP_AR is not None else nullcontext()
    with ctx:
        yield


def custom_ar_clear_ipc_handles() -> None:
    if _TP_AR is not None:
        _TP_AR.clear_ipc_handles()


def use_custom_allreduce(
    tp_group: Any = None, custom_all_reduce_max_bytes: int | None = None
) -> None:
    global _TP_AR
    from fastdeploy.distributed.custom_all_reduce import CustomAllreduce

    max_bytes = custom_all_reduce_max_bytes or _DEFAULT_MAX_BYTES
    _TP_AR = CustomAllreduce(tp_group, max_bytes)
