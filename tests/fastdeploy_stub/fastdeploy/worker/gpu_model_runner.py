"""A small ``GPUModelRunner``: persistent input buffers, dummy runs, capture loops, steps.

Like upstream, every model input is a view of a fixed buffer filled in place, the model is
called with keyword arguments only, and outputs are sliced to the real token count. The capture
loops, ``ForwardMeta`` fields and error texts follow the release chosen in ``_stub_version``.
With a ``draft_model`` (speculative method ``mtp``), an ``MTPProposer`` runs after each step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fastdeploy.model_executor.models  # noqa: F401  (loads model-register plugins, as upstream)
import paddle
from fastdeploy import _stub_version
from fastdeploy.model_executor import forward_meta as _forward_meta
from fastdeploy.model_executor.graph_optimization.utils import profile_run_guard, sot_warmup_guard
from fastdeploy.utils import get_logger

logger = get_logger("gpu_model_runner", "worker_process.log")


def _simulated_device() -> Any:
    """The plugin's simulated runtime, whose device memory stands for the GPU's, if installed."""
    try:
        from fd_cudagraph_plugin.core import runtime
    except ImportError:
        return None
    device = runtime._RUNTIMES.get("simulated")
    return device if hasattr(device, "allocate") else None  # a benchmark's no-op runtime has none


class GPUModelRunner:
    def __init__(self, fd_config: Any, model: Any, draft_model: Any = None) -> None:
        self.fd_config = fd_config
        self.model = model
        goc = fd_config.graph_opt_config
        self.use_cudagraph = goc.use_cudagraph
        self.max_num_seqs = fd_config.scheduler_config.max_num_seqs
        spec = fd_config.speculative_config
        self.spec_method = spec.method if spec is not None else None
        # Tokens per request beyond the first in a decode step (0 for methods whose sizes
        # FastDeploy does not scale).
        self.num_speculative_tokens = fd_config.num_speculative_tokens_for_graphs()
        self.speculative_decoding = self.num_speculative_tokens > 0
        self.cudagraph_capture_sizes = list(reversed(goc.cudagraph_capture_sizes))  # ascending
        self.id_modulus = 16  # execute_step writes ids in [0, id_modulus)
        ids_len = max(
            fd_config.get_max_chunk_tokens(),
            self.max_num_seqs * (self.num_speculative_tokens + 1),
            *goc.cudagraph_capture_sizes,
            *getattr(goc, "cudagraph_capture_sizes_prefill", []),  # none on 2.4
            1,
        )
        self.share_inputs = {
            "ids": paddle.zeros([ids_len], dtype="int64"),
            "seq_lens_this_time": paddle.zeros([self.max_num_seqs], dtype="int32"),
        }
        self.proposer = None
        if draft_model is not None:
            from fastdeploy.spec_decode.mtp import MTPProposer

            hidden, vocab = draft_model.hidden_size, draft_model.vocab_size
            self.proposer = MTPProposer(fd_config, draft_model, hidden, vocab)
            self.proposer.fd_config_ids = self.share_inputs["ids"]

    # -- inputs -----------------------------------------------------------------------------
    def _step_use_cudagraph(self, exist_prefill: bool, num_tokens: int) -> bool:
        goc = self.fd_config.graph_opt_config
        if not self.use_cudagraph:
            return False
        if _stub_version.at_least("2.5") and goc.graph_opt_level > 0 and not goc.full_cuda_graph:
            return True  # static split mode forces the flag every step (2.5+)
        if goc.cudagraph_only_prefill:
            return exist_prefill
        if not _stub_version.at_least("2.5"):
            return not exist_prefill  # 2.4 has no "> 0 tokens" test
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
        meta = _forward_meta.ForwardMeta(
            ids_remove_padding=view,
            step_use_cudagraph=use_graph,
            seq_lens_this_time=self.share_inputs["seq_lens_this_time"],
            is_dummy_or_profile_run=dummy,
        )
        if _stub_version.at_least("2.5"):
            meta.exist_prefill = exist_prefill
            meta.is_zero_size = num_tokens == 0
        if _stub_version.at_least("2.6"):
            meta.real_bsz = real_bsz
        out = self.model(ids_remove_padding=view, forward_meta=meta)[:num_tokens]
        if self.proposer is not None:
            # Dummy runs pass no real_bsz (0); serving passes the running requests (2.6+).
            self.proposer.run(
                full_hidden_states=out,
                step_use_cudagraph=use_graph,
                seq_lens=seq_lens,
                is_dummy_run=dummy,
                real_bsz=0 if dummy else real_bsz,
            )
        return out

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
        """As upstream: a temporary KV cache of ``total_block_num`` blocks, one dummy run, and
        the cache cleared again (2.5+ ``clear_cache(profile=True)``, 2.4 ``clear_cache()``)."""
        self.num_gpu_blocks = self.fd_config.cache_config.total_block_num
        self.initialize_kv_cache(profile=True)
        self._dummy_run(
            num_tokens=self.fd_config.get_max_chunk_tokens(), batch_size=self.max_num_seqs
        )
        if _stub_version.at_least("2.5"):
            self.clear_cache(profile=True)
        else:
            self.clear_cache()

    # -- KV cache: device memory on the simulated runtime's device, when one is installed ------
    #: Bytes of one KV block (upstream: cal_theortical_kvcache, from the model's shapes).
    block_bytes = 1 << 20
    num_gpu_blocks = 0
    _kv_bytes = 0

    def initialize_kv_cache(self, profile: bool = False) -> None:
        self._free_kv()
        nbytes = self.num_gpu_blocks * self.block_bytes
        device = _simulated_device()
        if device is not None:
            device.allocate(nbytes)
        self._kv_bytes = nbytes

    def clear_cache(self, profile: bool = False) -> None:
        self._free_kv()

    def update_share_input_block_num(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.initialize_kv_cache()

    def _free_kv(self) -> None:
        device = _simulated_device()
        if device is not None and self._kv_bytes:
            device.free(self._kv_bytes)
        self._kv_bytes = 0

    @contextmanager
    def _capturing(self, capture_sizes: list[int]) -> Iterator[None]:
        """Time a capture loop and rewrap known CUDA failures, with upstream's texts."""
        start = time.perf_counter()
        try:
            yield
        except RuntimeError as e:
            if "out of memory" in str(e):
                raise RuntimeError(
                    "CUDA out of memory occurred when warming up CUDAGraph "
                    f"with the capture sizes {capture_sizes}. Please try "
                    "lowering `max_num_seqs` or `gpu_memory_utilization` when "
                    "initializing the engine."
                ) from e
            if "CUDA error(700)" in str(e):
                raise RuntimeError(
                    "CUDA error(700), an illegal memory access was encountered, "
                    "when warming up CUDAGraph. Please try to set the startup parameter: "
                    "--graph-optimization-config '{\"use_cudagraph\": false}' to close CUDAGraph"
                ) from e
            raise e
        logger.info(f"Cuda Graph capturing took {time.perf_counter() - start} seconds")

    def _spec_capture_branch(self) -> bool:
        """Which speculative methods take the MTP-style capture loop, per release."""
        version = _stub_version.current()
        if self.spec_method is None:
            return False
        if version == "2.4":
            return self.spec_method == "mtp"
        if version == "2.5":
            return True
        if version == "2.6":
            return self.spec_method in ("mtp", "suffix")  # ngram takes the plain loop
        return self.spec_method in ("mtp", "suffix", "ngram")

    def _decode_num_tokens(self) -> int:
        if _stub_version.at_least("2.5"):
            return self.fd_config.get_max_chunk_tokens()
        sc = self.fd_config.scheduler_config
        return self.max_num_seqs if sc.splitwise_role == "decode" else sc.max_num_batched_tokens

    @sot_warmup_guard(True)
    def capture_model(self) -> None:
        """Capture every decode size, largest first, with the release's loop variant."""
        if not self.use_cudagraph:
            logger.info("Skipping CUDA graph capture. Please check GraphOptimizationConfig")
            return
        only_prefill = self.fd_config.graph_opt_config.cudagraph_only_prefill
        chunk, k = self._decode_num_tokens(), self.num_speculative_tokens
        capture_sizes = self.cudagraph_capture_sizes.copy()
        version = _stub_version.current()
        with self._capturing(capture_sizes):
            if only_prefill:
                for c in sorted(capture_sizes, reverse=True):
                    self._dummy_run(c, self.max_num_seqs, in_capturing=True, capture_prefill=True)
            elif self._spec_capture_branch() and version == "2.4":
                self._capture_2_4_mtp(capture_sizes, chunk)
            elif self._spec_capture_branch():
                decode_len = k * 2 + 1 if version == "2.5" else (k + 1) * 2
                for c in sorted(capture_sizes, reverse=True):
                    self._dummy_run(
                        chunk,
                        int(c / (k + 1)),
                        expected_decode_len=decode_len,
                        in_capturing=True,
                        accept_all_drafts=True,
                    )
            else:
                for c in sorted(capture_sizes, reverse=True):
                    self._dummy_run(chunk, c, in_capturing=True)

    def _capture_2_4_mtp(self, capture_sizes: list[int], chunk: int) -> None:
        # 2.4: sizes are tokens of two per request; the draft gets its own loop when enabled.
        sizes = sorted(capture_sizes, reverse=True)
        for c in sizes:
            if c == 1:
                continue
            assert c % 2 == 0
            self._dummy_run(chunk, int(c / 2), in_capturing=True)
        if self.proposer is not None and self.proposer.draft_model_use_cudagraph:
            for c in sizes:
                if c != 1:
                    self._dummy_run(
                        chunk,
                        int(c / 2),
                        expected_decode_len=3,
                        in_capturing=True,
                        accept_all_drafts=True,
                    )
            if 1 in sizes:
                self._dummy_run(chunk, 1, expected_decode_len=3, in_capturing=True)

    @sot_warmup_guard(True)
    def capture_model_prefill_and_mixed(self) -> None:
        """Static split mode (2.5+): capture each prefill size, largest first. No try/except."""
        if not _stub_version.at_least("2.5"):
            raise AttributeError(
                "'GPUModelRunner' object has no attribute "
                "'capture_model_prefill_and_mixed' (FastDeploy 2.4)"
            )
        if not self.use_cudagraph:
            logger.info("Skipping CUDA graph capture. Please check GraphOptimizationConfig")
            return
        goc = self.fd_config.graph_opt_config
        start = time.perf_counter()
        for c in sorted(goc.cudagraph_capture_sizes_prefill, reverse=True):
            self._dummy_run(c, 1, in_capturing=True, capture_prefill=True)
        logger.info(
            f"Cuda Graph capturing (Prefill and Mixed) took {time.perf_counter() - start} seconds"
        )

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
        """The target's graphs, and the draft's when it is graphed (2.6+ ``clear_parameters``)."""
        self._clear_target_graphs()
        if self.proposer is not None and self.proposer.draft_model_use_cudagraph:
            self.proposer.clear_graph_opt_backend()

    def _clear_target_graphs(self) -> None:
        from fastdeploy.model_executor.graph_optimization.decorator import clear_method_name

        getattr(self.model, clear_method_name(_stub_version.current()))(fd_config=self.fd_config)

    # -- RL weight updates, sleep and wake-up (gpu_model_runner.py per release) ------------
    def clear_parameters(self, pid: int = 0) -> None:
        """Drop graphs before new weights: the draft's too from 2.6 (when it is graphed); 2.4
        and 2.5 clear the target's only."""
        if _stub_version.at_least("2.6"):
            self.clear_graph_opt_backend()
        else:
            self._clear_target_graphs()

    def update_parameters(self, pid: int = 0) -> None:
        """New weights are in: reset the inputs (2.5+), then capture again."""
        if _stub_version.at_least("2.5"):
            self._reset_inputs()
        self.capture_model()

    def sleep(self, tags: str = "weight,kv_cache") -> None:
        """``/v1/sleep`` (2.5+): "weight" clears the target's graphs only, not the draft's."""
        if not _stub_version.at_least("2.5"):
            raise AttributeError(
                "'GPUModelRunner' object has no attribute 'sleep' (FastDeploy 2.4)"
            )
        if "weight" in tags.split(","):
            self._clear_target_graphs()

    def wakeup(self, tags: str = "weight,kv_cache") -> None:
        """``/v1/wakeup`` (2.5+): reset the inputs (the proposer's are made anew), capture again."""
        if not _stub_version.at_least("2.5"):
            raise AttributeError(
                "'GPUModelRunner' object has no attribute 'wakeup' (FastDeploy 2.4)"
            )
        if "weight" in tags.split(","):
            self._reset_inputs()
            self.capture_model()

    def _reset_inputs(self) -> None:
        # The target's share_inputs are filled in place (reset_share_inputs); the proposer's
        # reset_model_inputs builds new tensors (paddle.full / paddle.clone): new addresses.
        self.share_inputs["ids"][:] = 0
        self.share_inputs["seq_lens_this_time"][:] = 0
        if self.proposer is not None:
            self.proposer.reset_model_inputs()
