"""``InputBatch`` and ``ProposerInputBatch`` (2.5+): the runner's and the draft's input buffers.

On 2.4 both are plain dicts (``share_inputs = {}``, ``model_inputs = {}``) with no reset. From 2.5
they are objects read like dicts; the stand-in makes them dict subclasses, without ``get()`` on
2.5 (``InputBatch`` has ``__getitem__``, ``__contains__``, ``update`` and ``pop`` there, and
``get`` from 2.6: ``r3_ban_cpucache_2.5`` and ``r3_eos_2.6`` IB:26-60). Their resets, written
from ``worker/input_batch.py`` of each release, keep most buffers (filled in place, same address)
and re-create a few (new address):

* ``InputBatch.reset_share_inputs()`` (called by every ``wakeup`` and by ``update_parameters``):
  ``ids``, ``seq_lens_this_time``, ``stop_flags`` filled in place; **``rope_emb`` new**
  (upstream ``self.rope_emb = get_rope(...)``, r3_eos_2.6 IB:684); the caches are not touched.
* ``ProposerInputBatch.reset_model_inputs()``: the draft's ``ids`` and **``rope_emb`` new**;
  ``target_hidden_states`` new on 2.6 (``paddle.full``, IB:1002) and filled in place on 2.5 and
  develop; ``seq_lens_this_time_buffer`` kept (upstream leaves its reset commented out).

A tensor these resets drop is released (``_stub_memory``), as freed device memory.
"""

from __future__ import annotations

from typing import Any

import paddle
from fastdeploy import _stub_memory, _stub_version
from fastdeploy.model_executor.layers.rotary_embedding import get_rope


def new_rope(length: int, head_dim: int) -> paddle.Tensor:
    return get_rope(rotary_dim=head_dim, position_ids=paddle.arange(length).reshape([1, -1]))


def _renew_rope(inputs: Any, length: int, head_dim: int) -> None:
    old = inputs["rope_emb"] if "rope_emb" in inputs else None  # noqa: SIM401 (2.5: no get)
    inputs["rope_emb"] = new_rope(length, head_dim)
    _stub_memory.release(old)


class _Batch(dict):
    def get(self, key: str, default: Any = None) -> Any:
        if _stub_version.current() == "2.5":
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'get'")
        return super().get(key, default)


class InputBatch(_Batch):
    """The target's ``share_inputs`` (2.5+)."""

    def __init__(self, length: int, max_num_seqs: int, head_dim: int) -> None:
        super().__init__()
        self._length, self._head_dim = length, head_dim
        self["ids"] = paddle.zeros([length], dtype="int64")
        self["seq_lens_this_time"] = paddle.zeros([max_num_seqs], dtype="int32")
        self["stop_flags"] = paddle.ones([max_num_seqs], dtype="bool")
        self["rope_emb"] = new_rope(length, head_dim)

    def reset_share_inputs(self) -> None:
        self["ids"].zero_()
        self["seq_lens_this_time"].zero_()
        self["stop_flags"][:] = True
        _renew_rope(self, self._length, self._head_dim)


def plain_share_inputs(length: int, max_num_seqs: int, head_dim: int) -> dict:
    """2.4's ``share_inputs``: the same buffers in a dict, without a reset."""
    return dict(InputBatch(length, max_num_seqs, head_dim))


class ProposerInputBatch(_Batch):
    """The MTP draft's ``model_inputs`` (2.5+)."""

    def __init__(self, length: int, max_num_seqs: int, hidden: int) -> None:
        super().__init__()
        self._length, self._hidden = length, hidden
        self["ids"] = paddle.zeros([length], dtype="int64")
        self["target_hidden_states"] = paddle.zeros([length, hidden], dtype="float32")
        self["seq_lens_this_time_buffer"] = paddle.zeros([max_num_seqs], dtype="int32")
        self["rope_emb"] = new_rope(length, hidden)

    def reset_model_inputs(self) -> None:
        self["ids"] = paddle.zeros([self._length], dtype="int64")
        if _stub_version.current() == "2.6":
            old = self["target_hidden_states"]
            self["target_hidden_states"] = paddle.zeros([self._length, self._hidden])
            _stub_memory.release(old)
        else:
            self["target_hidden_states"].zero_()
        _renew_rope(self, self._length, self._hidden)


def plain_model_inputs(length: int, max_num_seqs: int, hidden: int) -> dict:
    """2.4's ``model_inputs``: a dict, no ``reset_model_inputs``."""
    return dict(ProposerInputBatch(length, max_num_seqs, hidden))
