"""A small ``GPUModelRunner``: persistent input buffers, dummy runs, capture loops, steps.

Like upstream, every model input is a view of a fixed buffer filled in place, the model is
called with keyword arguments only, and outputs are sliced to the real token count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fastdeploy.model_executor.models  # noqa: F401  (loads model-register plugins, as upstream)
import paddle
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.graph_optimization.utils import profile_run_guard, sot_warmup_guard
from fastdeploy.utils import get_logger

logger = get_logger("gpu_model_runner", "worker_process.log")


class GPUModelRunner:
    def __init__(self, fd_config: Any, model: Any) -> None:
        self.fd_config = fd_config
        self.model = model
        goc = fd_config.graph_opt_config
        self.use_cudagraph = goc.use_cudagraph
        self.max_num_seqs = fd_config.scheduler_config.max_num_seqs
        self.num_speculative_tokens = fd_config.num_speculative_tokens_for_graphs()
        self.speculative_decoding = self.num_speculative_tokens > 0
        self.cudagraph_capture_sizes = list(reversed(goc.cudagraph_capture_sizes))  # ascending
        self.id_modulus = 16  # execute_step writes ids in [0, id_modulus)
        ids_len = max(
            fd_config.get_max_chunk_tokens(),
            self.max_num_seqs * (self.num_speculative_tokens + 1),
            *goc.cudagraph_capture_sizes,
            *goc.cudagraph_capture_sizes_prefill,
            1,
        )
        self.share_inputs = {
            "ids": paddle.zeros([ids_len], dtype="int64"),
            "seq_lens_this_time": paddle.zeros([self.max_num_seqs], dtype="int32"),
        }

    # -- inputs -----------------------------------------------------------------------------
    def _step_use_cudagraph(self, exist_prefill: bool, num_tokens: int) -> bool:
        goc = self.fd_config.graph_opt_config
        if not self.use_cudagraph:
            return False
        if goc.graph_opt_level > 0 and not goc.full_cuda_graph:
            return True  # static split mode forces the flag every step
        if goc.cudagraph_only_prefill:
            return exist_prefill
        return not exist_prefill and num_tokens > 0

    def _prepare(self, num_tokens: int, seq_lens: list[int], ids: Any = None) -> paddle.Tensor:
        """Fill the persistent buffers in place; return the ``ids[:num_tokens]`` view."""
        buf = self.share_inputs["ids"]
        if num_tokens > 0:
            if ids is None:
                ids = paddle.arange(num_tokens, dtype="int64") % self.id_modulus
            buf[:num_tokens] = paddle.to_tensor(ids, dtype="int64").reshape([num_tokens])
        lens = self.share_inputs["seq_lens_this_time"]
        lens[:] = 0
        seq_lens = seq_lens[: self.max_num_seqs]
        if seq_lens:
            lens[: len(seq_lens)] = paddle.to_tensor(seq_lens, dtype="int32")
        return buf[:num_tokens]

    def _run(
        self,
        num_tokens: int,
        seq_lens: list[int],
        exist_prefill: bool,
        use_graph: bool,
        real_bsz: int,
        dummy: bool,
        ids: Any = None,
    ) -> paddle.Tensor:
        view = self._prepare(num_tokens, seq_lens, ids)
        meta = ForwardMeta(
            ids_remove_padding=view,
            step_use_cudagraph=use_graph,
            exist_prefill=exist_prefill,
            real_bsz=real_bsz,
            seq_lens_this_time=self.share_inputs["seq_lens_this_time"],
            is_zero_size=num_tokens == 0,
            is_dummy_or_profile_run=dummy,
        )
        out = self.model(ids_remove_padding=view, forward_meta=meta)
        return out[:num_tokens]

    # -- dummy runs and capture -------------------------------------------------------------
    def _dummy_run(
        self,
        num_tokens: int,
        batch_size: int,
        expected_decode_len: int = 1,
        in_capturing: bool = False,
        capture_prefill: bool = False,
        accept_all_drafts: bool = False,
    ) -> paddle.Tensor:
        """One prefill step, then decode steps over ``batch_size`` requests."""
        goc = self.fd_config.graph_opt_config
        k = self.num_speculative_tokens
        bsz = max(1, min(batch_size, num_tokens, self.max_num_seqs))
        prompt = [1] * (bsz - 1) + [num_tokens - (bsz - 1)]  # [1, ..., 1, rest], as upstream
        flag = in_capturing and self._step_use_cudagraph(True, num_tokens)
        out = self._run(num_tokens, prompt, True, flag, bsz, dummy=True)
        if capture_prefill and goc.graph_opt_level > 0:
            return out
        per_step = k + 1 if accept_all_drafts else 1
        n = batch_size * (k + 1)
        for _ in range(max(1, -(-expected_decode_len // per_step))):
            flag = in_capturing and self._step_use_cudagraph(False, n)
            out = self._run(n, [k + 1] * batch_size, False, flag, batch_size, dummy=True)
        return out

    @profile_run_guard(True)
    def profile_run(self) -> None:
        self._dummy_run(
            num_tokens=self.fd_config.get_max_chunk_tokens(), batch_size=self.max_num_seqs
        )

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        """Time a capture loop and turn known CUDA failures into advice, as upstream."""
        start = time.perf_counter()
        try:
            yield
        except RuntimeError as exc:
            if "out of memory" in str(exc):
                raise RuntimeError(
                    "CUDA graph capture ran out of memory: lower max_num_seqs or "
                    f"gpu_memory_utilization. ({exc})"
                ) from exc
            if "CUDA error(700)" in str(exc):
                raise RuntimeError(
                    "CUDA graph capture failed; try --graph-optimization-config "
                    f"'{{\"use_cudagraph\": false}}'. ({exc})"
                ) from exc
            raise
        logger.info("Cuda Graph capturing took %s seconds", time.perf_counter() - start)

    @sot_warmup_guard(True)
    def capture_model(self) -> None:
        """Capture every decode size, largest first (three loop variants, as upstream)."""
        if not self.use_cudagraph:
            logger.info("Skipping CUDA graph capture: use_cudagraph is off.")
            return
        only_prefill = self.fd_config.graph_opt_config.cudagraph_only_prefill
        chunk, k = self.fd_config.get_max_chunk_tokens(), self.num_speculative_tokens
        with self._capturing():
            for c in sorted(self.cudagraph_capture_sizes, reverse=True):
                if only_prefill:
                    self._dummy_run(c, self.max_num_seqs, in_capturing=True, capture_prefill=True)
                elif self.speculative_decoding:
                    self._dummy_run(
                        chunk,
                        int(c / (k + 1)),
                        expected_decode_len=2 * (k + 1),
                        in_capturing=True,
                        accept_all_drafts=True,
                    )
                else:
                    self._dummy_run(chunk, c, in_capturing=True)

    @sot_warmup_guard(True)
    def capture_model_prefill_and_mixed(self) -> None:
        """Static split mode: capture each prefill size, largest first."""
        goc = self.fd_config.graph_opt_config
        with self._capturing():
            for c in sorted(goc.cudagraph_capture_sizes_prefill, reverse=True):
                self._dummy_run(c, 1, in_capturing=True, capture_prefill=True)

    # -- runtime ----------------------------------------------------------------------------
    def execute_step(
        self, token_count: int, exist_prefill: bool = False, ids: Any = None
    ) -> paddle.Tensor:
        """Run one real step over ``token_count`` tokens; decode uses the CUDA-graph path."""
        per_req = 1 if exist_prefill else self.num_speculative_tokens + 1
        bsz = max(1, min(self.max_num_seqs, token_count // per_req)) if token_count else 0
        seq_lens = [per_req] * bsz
        if exist_prefill and bsz:
            seq_lens[-1] = token_count - per_req * (bsz - 1)
        flag = self._step_use_cudagraph(exist_prefill, token_count)
        return self._run(token_count, seq_lens, exist_prefill, flag, bsz, dummy=False, ids=ids)

    def clear_graph_opt_backend(self) -> None:
        self.model.clear_graph_opt_backend(fd_config=self.fd_config)
