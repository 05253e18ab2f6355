"""Per-step metadata passed to decorated layers as the ``forward_meta`` keyword.

The fields differ by release (``_stub_version.use`` rebinds ``ForwardMeta``):

* 2.4: no ``exist_prefill``, ``is_zero_size`` or ``real_bsz``; unknown names raise AttributeError;
* 2.5: adds ``is_zero_size`` and ``exist_prefill``; still no ``real_bsz``, no ``__getattr__``;
* 2.6 / develop: adds ``real_bsz`` and a ``__getattr__`` that reads unknown names as None.

Every release has ``rotary_embs`` (the runner's ``rope_emb``) and ``caches`` (the runner's list of
KV-cache tensors), both set by ``initialize_forward_meta`` each step, and ``clear_caches()``,
which deletes the instance's ``caches`` (it then reads as the class default, None).

Code that must run on every release has to read the newer fields with ``getattr(meta, name,
default)``; plain attribute access raises on 2.4 and 2.5 as it does upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import paddle


@dataclass
class _ForwardMeta24:
    ids_remove_padding: paddle.Tensor  # required, as upstream
    step_use_cudagraph: bool = False
    seq_lens_this_time: paddle.Tensor | None = None
    is_dummy_or_profile_run: bool = False
    rotary_embs: paddle.Tensor | None = None
    caches: list[paddle.Tensor] | None = None

    def clear_caches(self) -> None:
        if self.caches:
            del self.caches


@dataclass
class _ForwardMeta25(_ForwardMeta24):
    is_zero_size: bool = False
    exist_prefill: bool = False


@dataclass
class _ForwardMeta26(_ForwardMeta25):
    real_bsz: int = 0

    def __getattr__(self, name: str) -> Any:
        # Unknown fields read as None (and are then set), like upstream. Dunders still raise
        # here (upstream sets those too; copy/pickle probing would otherwise break).
        if name.startswith("__"):
            raise AttributeError(name)
        self.__dict__[name] = None
        return None


for _cls in (_ForwardMeta24, _ForwardMeta25, _ForwardMeta26):
    _cls.__name__ = _cls.__qualname__ = "ForwardMeta"

FORWARD_META = {
    "2.4": _ForwardMeta24,
    "2.5": _ForwardMeta25,
    "2.6": _ForwardMeta26,
    "develop": _ForwardMeta26,
}

#: Rebound by ``fastdeploy._stub_version.use``; read it as ``forward_meta.ForwardMeta`` at call
#: time, not through ``from ... import ForwardMeta``, so a version switch reaches the caller.
ForwardMeta = _ForwardMeta26
