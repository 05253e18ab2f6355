"""Tensor-parallel communication helpers around the custom all-reduce (``_TP_AR``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

_TP_AR: Any = None  # a CustomAllreduce once TP > 1 enables it; tests may install a recorder


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
    tp_group: Any = None, custom_all_reduce_max_bytes: int = 8192 * 1024
) -> None:
    global _TP_AR
    from fastdeploy.distributed.custom_all_reduce import CustomAllreduce

    _TP_AR = CustomAllreduce(tp_group, custom_all_reduce_max_bytes)


def tensor_model_parallel_all_reduce(input_: Any, group_: Any = None) -> Any:
    """Sum over the TP group: the custom all-reduce when it takes the tensor, else an in-place
    ``paddle.distributed.all_reduce`` (not run here: the stand-in has one rank, so it is the
    identity)."""
    if input_.shape[0] == 0:
        return input_
    if _TP_AR is not None and _TP_AR.should_custom_ar(input_):
        return _TP_AR.custom_all_reduce(input_)
    return input_
