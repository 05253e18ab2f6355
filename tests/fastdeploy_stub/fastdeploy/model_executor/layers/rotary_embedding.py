"""``get_rope``: the rotary-embedding table a runner keeps as ``rope_emb``.

Upstream builds it per architecture (shape ``[2, 1, max_len, 1, dim // 2]`` and others); the
stand-in's is ``[max_len, rotary_dim]`` of cosines, the same numbers every call. What matters to a
CUDA graph is that each call returns a new tensor: a new address.
"""

from __future__ import annotations

import paddle


def get_rope(rotary_dim: int, position_ids: paddle.Tensor, base: float = 10000.0) -> paddle.Tensor:
    positions = position_ids.reshape([-1, 1]).astype("float32")
    exponents = paddle.arange(rotary_dim, dtype="float32") / max(rotary_dim, 1)
    return paddle.cos(positions * paddle.pow(paddle.to_tensor(base), -exponents))
