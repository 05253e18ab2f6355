"""Test hook (not in FastDeploy): what freed device memory shows a reader that still holds it.

FastDeploy frees a tensor by dropping its last reference (``share_inputs.pop("caches")``, a new
``rope_emb`` in place of the old one) or with ``param._clear_data()``. The caching allocator may
hand that memory to the next allocation, so a CUDA graph that still reads the old address reads
whatever is there now. The stand-in fills a floating-point tensor with NaN just before it lets it
go, so a test model that still reads it (as a graph replay does; ``tests/kv_models.py``) shows
the stale read instead of plausible old numbers. Integer tensors keep their last values.
"""

from __future__ import annotations

import numpy as np
import paddle


def release(tensor: paddle.Tensor | None) -> None:
    """Fill ``tensor`` with NaN in place (same address), if it holds floating-point data."""
    if tensor is None or not tensor._is_initialized() or not tensor.is_floating_point():
        return
    with paddle.no_grad():
        tensor.set_value(np.full(tensor.shape, np.nan, dtype=np.float32).astype(_numpy(tensor)))


def _numpy(tensor: paddle.Tensor) -> str:
    return {paddle.float16: "float16", paddle.float64: "float64"}.get(tensor.dtype, "float32")
