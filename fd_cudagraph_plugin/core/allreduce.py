"""FastDeploy's custom all-reduce capture context, and nothing when FastDeploy is absent.

Leaving ``capture_custom_allreduce()`` registers the just-captured graph's buffers on every
tensor-parallel rank through an ``all_gather_object`` over the TP group: a collective. So only the
capture itself goes inside it (warm-ups inside it would all-reduce into placeholder memory), and
every rank must enter it the same number of times, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def _communication():
    try:
        from fastdeploy.distributed import communication
    except ImportError:
        return None
    return communication


@contextlib.contextmanager
def capture_context() -> Iterator[None]:
    communication = _communication()
    if communication is None:
        yield
        return
    with communication.capture_custom_allreduce():
        yield


def clear_ipc_handles() -> None:
    """Forget registered graph buffers so a recapture registers fresh ones (FastDeploy #4305)."""
    communication = _communication()
    if communication is not None:
        communication.custom_ar_clear_ipc_handles()
