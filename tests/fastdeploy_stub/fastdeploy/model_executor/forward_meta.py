"""Per-step metadata passed to decorated layers as the ``forward_meta`` keyword."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import paddle


@dataclass
class ForwardMeta:
    ids_remove_padding: paddle.Tensor
    step_use_cudagraph: bool = False
    exist_prefill: bool = False
    real_bsz: int = 0
    seq_lens_this_time: paddle.Tensor | None = None
    is_zero_size: bool = False
    is_dummy_or_profile_run: bool = False

    def __getattr__(self, name: str) -> Any:
        # Unknown fields read as None (and are then set), like upstream. Dunders still raise.
        if name.startswith("__"):
            raise AttributeError(name)
        self.__dict__[name] = None
        return None
