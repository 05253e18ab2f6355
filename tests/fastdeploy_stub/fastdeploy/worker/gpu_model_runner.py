"""A small ``GPUModelRunner``: persistent input buffers, dummy runs, capture loops, steps, and
the lifecycle that moves what a CUDA graph reads.

Like upstream, every model input is a view of a fixed buffer filled in place, the model is
called with keyword arguments only, and outputs are sliced to the real token count. The capture
loops, ``ForwardMeta`` fields and error texts follow the release chosen in ``_stub_version``.
With a ``draft_model`` (speculative method ``mtp``), an ``MTPProposer`` runs after each step.

Each step builds a new ``ForwardMeta`` (``initialize_forward_meta``) whose ``rotary_embs`` is
``share_inputs["rope_emb"]`` and ``caches`` is ``share_inputs["caches"]``, the list of KV-cache
tensors ``initialize_kv_cache`` makes (two per layer, real but small: ``kv_cache_shape``; the
simulated device is charged ``block_bytes`` per block). The lifecycle methods follow
``gpu_model_runner.py`` of 2.4 (``2.4_r3``), 2.5 (``r3_ban_cpucache_2.5``), 2.6 (``r3_eos_2.6``) and
develop (``r3_mm_dev``), with what each frees, re-creates and recaptures:

===================================  =======================================================
``clear_parameters(pid)``            clear the target's graphs (2.6+: the draft's too when
                                     ``draft_model_use_cudagraph``); free the weights (2.4:
                                     target; 2.5+: target and draft); 2.5+ free the draft's
                                     KV cache; free the KV cache. No capture.
``update_parameters(pid)``           new weights (new addresses); 2.5+ ``reset_share_inputs``
                                     (new ``rope_emb``), the draft's ``reset_model_inputs`` and
                                     a new draft KV cache; a new KV cache; ``capture_model()``.
``sleep(tags)`` (2.5+)               "weight": clear the target's graphs (never the draft's),
                                     free the weights; "kv_cache": free the draft's and the
                                     target's KV caches. Each returns early when already asleep.
``wakeup(tags)`` (2.5+)              refuses ``"weight"`` alone while the KV cache sleeps; always
                                     resets the draft's and the target's inputs (new
                                     ``rope_emb``s, new draft inputs) first; "kv_cache": new
                                     draft and target KV caches, **no capture**; "weight": reload
                                     (new addresses), then ``capture_model()``.
``update_weights(version)`` (2.5+)   rsync: ``set_value`` in place, no clear, no capture.
===================================  =======================================================

The weights go through a ``DynamicWeightManager`` (``rl/``), built only with
``load_config.dynamic_load_weight`` as upstream; without it those methods raise AttributeError.
A freed tensor is filled with NaN first (``_stub_memory``). Stand-in liberties: a runner whose KV
cache was never made passes ``caches=None`` (upstream would raise; many tests skip the start-up),
and there are no communication groups, DeepEP buffers, block tables or routing replay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fastdeploy.model_executor.models  # noqa: F401  (loads model-register plugins, as upstream)
import paddle
from fastdeploy import _stub_memory, _stub_version
from fastdeploy.model_executor import forward_meta as _forward_meta
from fastdeploy.model_executor.graph_optimization.utils import profile_run_guard, sot_warmup_guard
from fastdeploy.utils import get_logger
from fastdeploy.worker.input_batch import InputBatch, plain_share_inputs

logger = get_logger("gpu_model_runner", "worker_process.log")

#: The stand-in's KV-cache tensors hold at most this many blocks of this many slots.
KV_TENSOR_BLOCKS = 4
KV_TENSOR_BLOCK_SIZE = 16


def kv_cache_shape(num_blocks: int, head_dim: int) -> list[int]:
    """``[blocks, kv_heads, block_size, head_dim]``, upstream's layout, kept small."""
    return [max(1, min(num_blocks, KV_TENSOR_BLOCKS)), 1, KV_TENSOR_BLOCK_SIZE, head_dim]


def _only_from(version: str, name: str, owner: str = "GPUModelRunner") -> None:
    """Raise what upstream raises for a method that ``version`` added, before it."""
    if not _stub_version.at_least(version):
        raise AttributeError(
            f"'{owner}' object has no attribute '{name}' (FastDeploy {_stub_version.current()})"
        )


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
        self.head_dim = getattr(model, "hidden_size", 8)
        self.num_hidden_layers = getattr(model, "num_hidden_layers", 1)
        if _stub_version.at_least("2.5"):
            self.share_inputs = InputBatch(ids_len, self.max_num_seqs, self.head_dim)
            self.is_weight_sleeping = False
            self.is_kvcache_sleeping = False
        else:
            self.share_inputs = plain_share_inputs(ids_len, self.max_num_seqs, self.head_dim)
        self.forward_meta = None
        self.proposer = None
        if draft_model is not None:
            from fastdeploy.spec_decode.mtp import MTPProposer

            hidden, vocab = draft_model.hidden_size, draft_model.vocab_size
            self.proposer = MTPProposer(fd_config, draft_model, hidden, vocab)
            self.proposer.fd_config_ids = self.share_inputs["ids"]
        if fd_config.load_config.dynamic_load_weight:
            from fastdeploy.rl.dynamic_weight_manager import DynamicWeightManager

            models = [model]
            if self.proposer is not None and _stub_version.at_least("2.5"):
                models.append(self.proposer.model)  # 2.4 leaves the draft out
            self.dynamic_weight_manager = DynamicWeightManager(fd_config, models)

    @property
    def is_sleeping(self) -> bool:
        _only_from("2.5", "is_sleeping")
        return self.is_weight_sleeping or self.is_kvcache_sleeping

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
        view = self.share_inputs["ids_remove_padding"] = buf[:num_tokens]
        return view

    def initialize_forward_meta(self, is_dummy_or_profile_run: bool = False) -> None:
        """A new ``ForwardMeta`` for this step, pointing at the runner's buffers."""
        self.forward_meta = _forward_meta.ForwardMeta(
            ids_remove_padding=self.share_inputs["ids_remove_padding"],
            rotary_embs=self.share_inputs["rope_emb"],
            seq_lens_this_time=self.share_inputs["seq_lens_this_time"],
            caches=self.share_inputs["caches"] if "caches" in self.share_inputs else None,  # noqa: SIM401 (2.5: no get)
            is_dummy_or_profile_run=is_dummy_or_profile_run,
        )

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
        self.initialize_forward_meta(is_dummy_or_profile_run=dummy)
        meta = self.forward_meta
        meta.step_use_cudagraph = use_graph
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
        """As upstream: temporary KV caches (the draft's too) of ``total_block_num`` blocks, one
        dummy run, and the caches cleared again (2.5+ the draft's first, with ``profile=True``;
        2.4 the target's first)."""
        self.num_gpu_blocks = self.fd_config.cache_config.total_block_num
        self.initialize_kv_cache(profile=True)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(
                main_model_num_blocks=self.num_gpu_blocks, profile=True
            )
        self._dummy_run(
            num_tokens=self.fd_config.get_max_chunk_tokens(), batch_size=self.max_num_seqs
        )
        if _stub_version.at_least("2.5"):
            if self.proposer is not None:
                self.proposer.clear_mtp_cache(profile=True)
            self.clear_cache(profile=True)
        else:
            self.clear_cache()
            if self.proposer is not None:
                self.proposer.clear_mtp_cache()

    # -- KV cache: device memory on the simulated runtime's device, when one is installed ------
    #: Bytes of one KV block (upstream: cal_theortical_kvcache, from the model's shapes).
    block_bytes = 1 << 20
    num_gpu_blocks = 0
    _kv_bytes = 0

    def initialize_kv_cache(self, profile: bool = False) -> None:
        """New cache tensors in a new ``share_inputs["caches"]`` list (the old ones, if any, are
        dropped: freed)."""
        self._drop_caches()
        nbytes = self.num_gpu_blocks * self.block_bytes
        device = _simulated_device()
        if device is not None:
            device.allocate(nbytes)
        self._kv_bytes = nbytes
        shape = kv_cache_shape(self.num_gpu_blocks, self.head_dim)
        self.share_inputs["caches"] = [
            paddle.zeros(shape, dtype="float32") for _ in range(2 * self.num_hidden_layers)
        ]

    def clear_cache(self, profile: bool = False) -> None:
        """Free the KV cache: ``share_inputs["caches"]`` popped, ``forward_meta.caches`` deleted."""
        self._drop_caches()
        if self.forward_meta is not None:
            self.forward_meta.clear_caches()

    def update_share_input_block_num(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.initialize_kv_cache()
        if self.proposer is not None:
            self.proposer.update_mtp_block_num(num_gpu_blocks)

    def _drop_caches(self) -> None:
        for tensor in self.share_inputs.pop("caches", None) or []:
            _stub_memory.release(tensor)
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

    # -- RL weight updates, sleep and wake-up (gpu_model_runner.py per release) ------------
    def _clear_graphs(self, model: Any) -> None:
        """``model.clear_gr*_opt_backend()``, spelt as the release spells it."""
        from fastdeploy.model_executor.graph_optimization.decorator import clear_method_name

        getattr(model, clear_method_name(_stub_version.current()))(fd_config=self.fd_config)

    def clear_requests(self) -> None:
        self.share_inputs["stop_flags"][:] = True

    def clear_parameters(self, pid: int = 0) -> None:
        """Legacy RL path, before new weights: graphs cleared, weights and KV caches freed."""
        if self.use_cudagraph:
            self._clear_graphs(self.model)
            if (
                _stub_version.at_least("2.6")
                and self.speculative_decoding
                and self.proposer is not None
                and self.fd_config.graph_opt_config.draft_model_use_cudagraph
            ):
                self._clear_graphs(self.proposer.model)
        self.dynamic_weight_manager.clear_parameters(pid)
        if _stub_version.at_least("2.5") and self.proposer is not None:
            self.proposer.clear_mtp_cache()  # 2.4 keeps the draft's cache
        self.clear_cache()

    def update_parameters(self, pid: int = 0) -> None:
        """Legacy RL path: new weights, inputs reset (2.5+), new KV caches, capture again."""
        self.dynamic_weight_manager.update_parameters(pid)
        if _stub_version.at_least("2.5"):
            self.share_inputs.reset_share_inputs()
            if self.proposer is not None:
                self.proposer.model_inputs.reset_model_inputs()
                self.proposer.initialize_kv_cache(main_model_num_blocks=self.num_gpu_blocks)
        self.initialize_kv_cache()
        if self.use_cudagraph:
            self.capture_model()
        self.dynamic_weight_manager.finalize_update(pid)

    def update_weights(self, version: str | None = None, verify_checksum: bool = False) -> Any:
        """``/v1/update_weights`` (2.5+): rsync, values written in place; nothing recaptured."""
        _only_from("2.5", "update_weights")
        return self.dynamic_weight_manager.update_weights_by_rdma(version, verify_checksum)

    def sleep(self, tags: str) -> None:
        """``/v1/sleep`` (2.5+). "weight" clears the target's graphs, never the draft's."""
        _only_from("2.5", "sleep")
        if "weight" in tags.split(","):
            if self.is_weight_sleeping:
                return  # upstream returns from the whole method here, skipping "kv_cache"
            if self.use_cudagraph:
                self._clear_graphs(self.model)
            self.dynamic_weight_manager.clear_model_weight()
            self.is_weight_sleeping = True
        if "kv_cache" in tags.split(","):
            if self.is_kvcache_sleeping:
                return
            if self.proposer is not None:
                self.proposer.clear_mtp_cache()
            self.clear_cache()
            self.is_kvcache_sleeping = True

    def wakeup(self, tags: str) -> None:
        """``/v1/wakeup`` (2.5+). Only the "weight" part captures again; "kv_cache" alone makes
        new caches (and every call a new ``rope_emb`` and new draft inputs) and captures nothing:
        graphs captured before keep reading the old tensors."""
        _only_from("2.5", "wakeup")
        if tags == "weight" and self.use_cudagraph and self.is_kvcache_sleeping:
            raise RuntimeError(
                "Waking up [weight] alone is not supported when CUDA Graph is enabled, "
                "as recapturing the graph requires the KV cache to be rebuilt first. "
                "Please wake up [kv_cache] first."
            )
        if self.proposer is not None:
            self.proposer.model_inputs.reset_model_inputs()
        self.share_inputs.reset_share_inputs()
        if "kv_cache" in tags.split(","):
            if not self.is_kvcache_sleeping:
                return  # before the "weight" part: weights asleep stay asleep
            if self.proposer is not None:
                self.proposer.initialize_kv_cache(main_model_num_blocks=self.num_gpu_blocks)
            self.initialize_kv_cache()
            self.is_kvcache_sleeping = False
        if "weight" in tags.split(","):
            if not self.is_weight_sleeping:
                return
            self.dynamic_weight_manager.reload_model_weights()
            if self.use_cudagraph:
                self.capture_model()
            self.is_weight_sleeping = False
