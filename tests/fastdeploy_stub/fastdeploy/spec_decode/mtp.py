"""``MTPProposer``: runs the MTP draft model after each target step, with upstream's call pattern.

Modelled from ``spec_decode/mtp.py`` (2.4-2.6) and ``mtp_cuda.py`` (develop):

* the draft flag is ``step_use_cudagraph and draft_model_use_cudagraph and not (substep > 0 and
  is_dummy_run)`` (2.4: without the last term), so at capture only substep 0 is graph-routed while
  serving every substep is;
* substep 0 carries the target's tokens (bsz * (k + 1) in a capture decode step), later substeps
  one token per running request;
* dummy runs pass no ``real_bsz``, so the draft's ``forward_meta.real_bsz`` is 0 there (2.6+;
  2.4/2.5 have no such field); the draft never sets ``exist_prefill``;
* with the flag on, ``forward_meta.seq_lens_this_time`` is swapped for the full
  ``seq_lens_this_time_buffer`` and the output is sliced to the real token count;
* each substep builds a new ``ForwardMeta`` (``self.forward_meta``) whose ``rotary_embs`` and
  ``caches`` are ``model_inputs["rope_emb"]`` and ``model_inputs["caches"]``;
* the draft's KV cache: ``initialize_kv_cache(main_model_num_blocks, profile=False)`` makes new
  tensors and a new ``model_inputs["caches"]`` list, ``clear_mtp_cache()`` deletes them (and
  ``forward_meta.caches``), ``update_mtp_block_num(n)`` makes them for the final block count;
* ``model_inputs``: a dict on 2.4 (no reset), a ``ProposerInputBatch`` with
  ``reset_model_inputs()`` from 2.5 (``worker/input_batch.py`` says which tensors it re-creates).

Simplified: the draft's ids and ``previous_hidden_states`` are copied into the proposer's own
fixed buffers (upstream's kernels produce them), and later substeps feed on substep 0's ids + s.
``steps`` keeps, per substep of the last run, the inputs and the output, so a test can compare
with an eager call of the draft. The draft's cache tensors are as small as the target's
(``GPUModelRunner.kv_cache_shape``) and are not charged to the simulated device.
"""

from __future__ import annotations

from typing import Any

import paddle
from fastdeploy import _stub_memory, _stub_version
from fastdeploy.model_executor import forward_meta as _forward_meta
from fastdeploy.worker.input_batch import ProposerInputBatch, plain_model_inputs


class MTPProposer:
    def __init__(self, fd_config: Any, model: Any, hidden: int, vocab: int) -> None:
        self.fd_config = fd_config
        self.model = model
        self.vocab = vocab
        spec = fd_config.speculative_config
        self.num_model_steps = spec.num_model_steps
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.draft_model_use_cudagraph = fd_config.graph_opt_config.draft_model_use_cudagraph
        self._max_num_seqs = fd_config.scheduler_config.max_num_seqs
        self._length = max(
            fd_config.get_max_chunk_tokens(),
            self._max_num_seqs * (spec.num_speculative_tokens + 1),
        )
        self._hidden = hidden
        self._num_layers = getattr(model, "num_hidden_layers", 1)
        if _stub_version.at_least("2.5"):
            self.model_inputs = ProposerInputBatch(self._length, self._max_num_seqs, hidden)
        else:
            self.model_inputs = plain_model_inputs(self._length, self._max_num_seqs, hidden)
        self.forward_meta = None
        self.num_gpu_blocks = 0
        self.steps: list[dict[str, Any]] = []

    # -- KV cache ----------------------------------------------------------------------------
    def initialize_kv_cache(self, main_model_num_blocks: int, profile: bool = False) -> None:
        from fastdeploy.worker.gpu_model_runner import kv_cache_shape

        self.num_gpu_blocks = main_model_num_blocks
        shape = kv_cache_shape(main_model_num_blocks, self._hidden)
        self.model_inputs["caches"] = [
            paddle.zeros(shape, dtype="float32") for _ in range(2 * self._num_layers)
        ]

    def clear_mtp_cache(self, profile: bool = False) -> None:
        for tensor in self.model_inputs["caches"]:
            _stub_memory.release(tensor)
        del self.model_inputs["caches"]
        if self.forward_meta is not None:
            del self.forward_meta.caches

    def update_mtp_block_num(self, num_gpu_blocks: int) -> None:
        self.initialize_kv_cache(main_model_num_blocks=num_gpu_blocks)

    # -- steps -------------------------------------------------------------------------------
    def _flag(self, step_use_cudagraph: bool, substep: int, is_dummy_run: bool) -> bool:
        flag = step_use_cudagraph and self.draft_model_use_cudagraph
        if _stub_version.at_least("2.5"):
            # "In multi-step execution, only the first step should be captured."
            flag = flag and not (substep > 0 and is_dummy_run)
        return flag

    def run(
        self,
        full_hidden_states: paddle.Tensor,
        step_use_cudagraph: bool,
        seq_lens: list[int],
        is_dummy_run: bool = False,
        real_bsz: int = 0,
    ) -> None:
        inputs = self.model_inputs
        bsz = sum(1 for n in seq_lens if n > 0)
        self.steps = []
        previous = full_hidden_states
        for substep in range(self.num_model_steps):
            lens = list(seq_lens) if substep == 0 else [1 if n > 0 else 0 for n in seq_lens]
            token_num = sum(lens)
            if token_num <= 0:
                continue
            ids = inputs["ids"]
            source = self.fd_config_ids if substep == 0 else self._next_ids(bsz, substep)
            ids[:token_num] = source[:token_num]
            inputs["target_hidden_states"][:token_num] = previous[:token_num]
            lens_buffer = inputs["seq_lens_this_time_buffer"]
            lens_buffer[:] = 0
            lens_buffer[: len(lens)] = paddle.to_tensor(lens, dtype="int32")
            flag = self._flag(step_use_cudagraph, substep, is_dummy_run)
            meta = _forward_meta.ForwardMeta(
                ids_remove_padding=ids[:token_num],
                step_use_cudagraph=flag,
                seq_lens_this_time=lens_buffer[: max(len(lens), 1)],
                is_dummy_or_profile_run=is_dummy_run,
                rotary_embs=inputs["rope_emb"],
                caches=inputs["caches"] if "caches" in inputs else None,  # noqa: SIM401 (2.5: no get)
            )
            self.forward_meta = meta
            if _stub_version.at_least("2.6"):
                meta.real_bsz = real_bsz
            if flag:
                meta.seq_lens_this_time = (
                    lens_buffer  # the full buffer, as padding_cudagraph_inputs
                )
            view_ids = ids[:token_num]
            view_hidden = inputs["target_hidden_states"][:token_num]
            out = self.model(
                ids_remove_padding=view_ids, previous_hidden_states=view_hidden, forward_meta=meta
            )
            out = out[:token_num]
            self.steps.append(
                {
                    "ids": view_ids.clone(),
                    "previous_hidden_states": view_hidden.clone(),
                    "output": out.clone(),
                    "forward_meta": meta,
                    "step_use_cudagraph": flag,
                    "tokens": token_num,
                }
            )
            previous = out[:bsz] if substep == 0 else out

    def _next_ids(self, bsz: int, substep: int) -> paddle.Tensor:
        return (self.fd_config_ids[:bsz] + substep) % self.vocab

    fd_config_ids: paddle.Tensor  # set by the runner: its ids buffer
