"""Configuration classes: the graph-optimization part of ``fastdeploy.config``.

Every ``*Config(args)`` applies only keys that already exist as attributes; others are dropped.
"""

from __future__ import annotations

import json
from typing import Any

from fastdeploy import _stub_version
from fastdeploy.utils import get_logger

logger = get_logger("config")

SPEC_METHODS = ("naive", "mtp", "ngram", "suffix")  # upstream's SpecMethod values
#: Speculative methods whose draft tokens scale the decode capture sizes, per release. 2.5 scales
#: the automatic sizes for any method but builds the bsz map only for these; 2.4 scales the max
#: shape for mtp only.
SCALING_SPEC_METHODS = {
    "2.4": ("mtp",),
    "2.5": ("mtp", "suffix"),
    "2.6": ("mtp", "suffix"),
    "develop": ("mtp", "suffix", "ngram"),
}


def scaling_spec_methods() -> tuple[str, ...]:
    return SCALING_SPEC_METHODS[_stub_version.current()]


def _apply_known(obj: object, args: dict | None) -> None:
    for key, value in (args or {}).items():
        if hasattr(obj, key):
            setattr(obj, key, value)


def _padding_map(sizes_desc: list[int]) -> dict[int, int]:
    """Map each shape up to the largest size onto the smallest size that holds it."""
    mapping: dict[int, int] = {0: 0}
    for end, start in zip(sizes_desc, [*sizes_desc[1:], 0][: len(sizes_desc)], strict=True):
        mapping[start] = start
        for shape in range(start + 1, end):
            mapping[shape] = end
    if sizes_desc:
        mapping[sizes_desc[0]] = sizes_desc[0]
    return mapping


class GraphOptimizationConfig:
    def __init__(self, args: dict | None = None) -> None:
        import paddle

        self.graph_opt_level: int = 0
        self.sot_warmup_sizes: list[int] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128]
        v = _stub_version
        self.use_cudagraph: bool = not paddle.is_compiled_with_xpu() if v.at_least("2.5") else True
        self.cudagraph_capture_sizes: list[int] | None = None
        if v.at_least("2.6"):
            self.flag_cudagraph_capture_sizes_initlized: bool = False
        if v.at_least("2.5"):
            self.cudagraph_capture_sizes_prefill: list[int] = [1, 2, 4, 8]
        self.cudagraph_num_of_warmups: int = 2
        self.cudagraph_copy_inputs: bool = False
        self.cudagraph_splitting_ops: list[str] = []
        self.cudagraph_only_prefill: bool = False
        self.full_cuda_graph: bool = True
        self.max_capture_size: int | None = None
        self.real_shape_to_captured_size: dict[int, int] | None = None
        if v.at_least("2.5"):
            self.real_bsz_to_captured_size: dict[int, int] = {}
        self.use_unique_memory_pool: bool = True
        # False up to 2.6; develop turned it on.
        self.draft_model_use_cudagraph: bool = v.current() == "develop"
        if v.at_least("2.5"):
            self.max_capture_shape_prefill: int = 512
        _apply_known(self, args)
        self.check_legality_parameters()

    def _set_cudagraph_sizes(
        self,
        max_capture_size: int = 0,
        max_capture_shape_prefill: int = 0,
        dec_token_per_query_per_step: int = 1,
    ):
        """Build the automatic candidate lists (ascending, with the caps appended). Only 2.5
        multiplies the candidates by ``dec_token_per_query_per_step``; 2.4 has no prefill list."""
        t = dec_token_per_query_per_step
        candidates = [t * c for c in [1, 2, 4] + [8 * i for i in range(1, 17)]]
        candidates += [t * 16 * i for i in range(9, 17)] + [t * 32 * i for i in range(9, 33)]
        self.cudagraph_capture_sizes = sorted([*candidates, max_capture_size])
        if _stub_version.at_least("2.5"):
            self.cudagraph_capture_sizes_prefill = sorted([*candidates, max_capture_shape_prefill])

    def init_with_cudagrpah_size(
        self,
        max_capture_size: int = 0,
        max_capture_shape_prefill: int = 0,
        num_speculative_tokens: int = 0,
    ) -> None:
        """Trim, scale and sort the capture lists, then precompute the padding maps."""
        k = num_speculative_tokens  # only 2.6/develop pass it; 2.4/2.5 scale in FDConfig
        sizes = list(self.cudagraph_capture_sizes)
        if k != 0:
            max_capture_size *= k + 1
            if not self.flag_cudagraph_capture_sizes_initlized:
                sizes = [s * (k + 1) for s in sizes]  # given sizes count requests, not tokens
        sizes = sorted({s for s in sizes if s <= max_capture_size}, reverse=True)
        self.cudagraph_capture_sizes = sizes
        self.max_capture_size = sizes[0] if sizes else 0
        self.real_shape_to_captured_size = _padding_map(sizes)
        if not _stub_version.at_least("2.5"):
            return
        prefill = [
            s for s in self.cudagraph_capture_sizes_prefill if s <= max_capture_shape_prefill
        ]
        prefill.sort(reverse=True)  # not deduplicated, as upstream
        self.cudagraph_capture_sizes_prefill = prefill
        self.max_capture_size_prefill = prefill[0] if prefill else 0
        self.real_shape_to_captured_size_prefill = _padding_map(prefill)
        if not _stub_version.at_least("2.6"):
            return  # 2.5 built real_bsz_to_captured_size in FDConfig already

        bsz_map: dict[int, int] = {}
        if k != 0:
            for size in sizes:  # descending, so the smallest size per request count wins
                bsz_map[int(size / (k + 1))] = size
            larger = None
            for bsz in range(max(bsz_map, default=0), 0, -1):  # fill gaps from above
                larger = bsz_map.setdefault(bsz, larger)
        self.real_bsz_to_captured_size = dict(sorted(bsz_map.items()))
        self.flag_cudagraph_capture_sizes_initlized = True

    def filter_capture_size(self, tp_size: int = 1) -> None:
        """Keep sizes divisible by ``tp_size``. Like upstream, the padding maps are NOT rebuilt."""
        self.cudagraph_capture_sizes = [s for s in self.cudagraph_capture_sizes if s % tp_size == 0]
        if hasattr(self, "cudagraph_capture_sizes_prefill"):
            self.cudagraph_capture_sizes_prefill = [
                s for s in self.cudagraph_capture_sizes_prefill if s % tp_size == 0
            ]

    def check_legality_parameters(self) -> None:
        assert self.graph_opt_level in [0, 1, 2], (
            "In graph optimization config, graph_opt_level can only take the values of 0, 1 and 2."
        )
        assert type(self.use_cudagraph) is bool, (
            "In graph optimization config, type of use_cudagraph must is bool."
        )
        if self.cudagraph_capture_sizes is not None:
            assert type(self.cudagraph_capture_sizes) is list, (
                "In graph optimization config, type of cudagraph_capture_sizes must is list."
            )
            assert len(self.cudagraph_capture_sizes) > 0, (
                "In graph optimization config, When opening the CUDA graph, it is forbidden to "
                "set the capture sizes to an empty list."
            )

    def to_json_string(self) -> str:
        return json.dumps(self.__dict__)

    def __str__(self) -> str:
        return self.to_json_string()


class SpeculativeConfig:
    def __init__(self, args: dict | None = None) -> None:
        self.method: str | None = None
        self.mtp_strategy: str = "default"
        self.num_speculative_tokens: int = 1
        self.num_model_steps: int = 1
        self.model: str | None = None
        self.model_type: str = "main"
        _apply_known(self, args)
        if self.method is not None:
            assert self.method in SPEC_METHODS, (
                f"speculative method only support {list(SPEC_METHODS)} now, but get {self.method}."
            )
            if self.method == "naive" and _stub_version.at_least("2.6"):
                self.num_speculative_tokens = 0
            elif self.method != "naive":
                k, steps = self.num_speculative_tokens, self.num_model_steps
                assert 1 <= k <= 5, (
                    f"num_speculative_tokens only support in range[1, 5], but get {k}."
                )
                assert 1 <= steps <= 5, (
                    f"num_model_steps only support in range[1, 5], but get {steps}."
                )
        if self.method == "mtp" and self.num_speculative_tokens < self.num_model_steps:
            self.num_speculative_tokens = self.num_model_steps

    def enabled_speculative_decoding(self) -> bool:
        return self.method is not None


class SchedulerConfig:
    def __init__(self, args: dict | None = None) -> None:
        self.max_num_seqs: int = 34
        self.max_num_batched_tokens: int | None = 2048
        self.splitwise_role: str = "mixed"
        self.enable_overlap_schedule: bool = False
        _apply_known(self, args)


class ParallelConfig:
    def __init__(self, args: dict | None = None) -> None:
        self.tensor_parallel_size: int = 1
        self.tensor_parallel_rank: int = 0
        self.data_parallel_size: int = 1
        self.data_parallel_rank: int = 0
        self.disable_custom_all_reduce: bool = False
        self.use_sequence_parallel_moe: bool = False
        self.tp_group: Any = None
        _apply_known(self, args)


class CacheConfig:
    def __init__(self, args: dict | None = None) -> None:
        self.block_size: int = 64
        self.gpu_memory_utilization: float = 0.9
        self.num_cpu_blocks: int | None = None
        self.num_gpu_blocks_override: int | None = None
        #: Blocks the profile run's temporary KV cache holds (upstream: from max tokens and seqs).
        self.total_block_num: int = 4
        _apply_known(self, args)


class LoadConfig:
    def __init__(self, args: dict | None = None) -> None:
        self.dynamic_load_weight: bool = False
        #: How a reload reads weights: "ipc_snapshot" / "ipc" (``reload_model_weights`` takes
        #: those) or "rsync" (``update_weights`` only; a reload then raises, as upstream).
        self.load_strategy: str = "ipc_snapshot"
        _apply_known(self, args)


class FDConfig:
    """Holds the sub-configs and computes the CUDA-graph capture lists (upstream §2.2 logic)."""

    def __init__(
        self,
        model_config: Any = None,
        cache_config: CacheConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        load_config: LoadConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        graph_opt_config: GraphOptimizationConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        test_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config or CacheConfig({})
        self.parallel_config = parallel_config or ParallelConfig({})
        self.load_config = load_config or LoadConfig({})
        self.scheduler_config = scheduler_config or SchedulerConfig({})
        self.graph_opt_config = graph_opt_config or GraphOptimizationConfig({})
        self.speculative_config = speculative_config  # may stay None, as upstream allows
        self.test_mode = test_mode
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._init_capture_sizes()
        self.postprocess()
        if not test_mode:
            self.check()

    def num_speculative_tokens_for_graphs(self) -> int:
        """k as 2.6/develop pass it to ``init_with_cudagrpah_size`` (0 for non-scaling methods)."""
        spec = self.speculative_config
        if spec is None or spec.method not in scaling_spec_methods():
            return 0
        return spec.num_speculative_tokens

    def _init_capture_sizes(self) -> None:
        version = _stub_version.current()
        if version == "2.4":
            self._init_capture_sizes_2_4()
        elif version == "2.5":
            self._init_capture_sizes_2_5()
        else:
            self._init_capture_sizes_2_6()

    def _init_capture_sizes_2_6(self) -> None:
        goc = self.graph_opt_config
        if goc.cudagraph_only_prefill:
            max_shape = 512
        else:
            max_shape = min(512, self.scheduler_config.max_num_seqs)
        if goc.cudagraph_capture_sizes is None:
            goc._set_cudagraph_sizes(max_shape, goc.max_capture_shape_prefill)
        goc.init_with_cudagrpah_size(
            max_capture_size=max_shape,
            max_capture_shape_prefill=goc.max_capture_shape_prefill,
            num_speculative_tokens=self.num_speculative_tokens_for_graphs(),
        )

    def _init_capture_sizes_2_5(self) -> None:
        goc, spec = self.graph_opt_config, self.speculative_config
        max_shape = self.scheduler_config.max_num_seqs
        scaled = spec is not None and spec.method in scaling_spec_methods()
        if scaled:
            max_shape = self.scheduler_config.max_num_seqs * (spec.num_speculative_tokens + 1)
            assert max_shape % 2 == 0, (
                "CUDAGraph only supports capturing even token nums in MTP scenarios."
            )
        if goc.cudagraph_only_prefill:
            max_shape = 512
        elif spec is None:
            max_shape = min(512, max_shape)
        if goc.cudagraph_capture_sizes is None:
            per_step = spec.num_speculative_tokens + 1 if spec is not None and spec.method else 1
            goc._set_cudagraph_sizes(max_shape, goc.max_capture_shape_prefill, per_step)
        if scaled:
            # From the untrimmed list, each request count onto the first size that holds it.
            sparse = {
                int(size / (spec.num_speculative_tokens + 1)): size
                for size in goc.cudagraph_capture_sizes
            }
            dense, previous = {}, 0
            for bsz, size in sorted(sparse.items()):
                for b in range(previous + 1, bsz + 1):
                    dense[b] = size
                previous = bsz
            goc.real_bsz_to_captured_size = dense
        goc.init_with_cudagrpah_size(max_shape, goc.max_capture_shape_prefill)

    def _init_capture_sizes_2_4(self) -> None:
        goc, spec = self.graph_opt_config, self.speculative_config
        max_shape = self.scheduler_config.max_num_seqs
        if spec is not None and spec.method == "mtp":
            max_shape = self.scheduler_config.max_num_seqs * (spec.num_speculative_tokens + 1)
            assert max_shape % 2 == 0, (
                "CUDAGraph only supports capturing even token nums in MTP scenarios."
            )
        max_shape = 512 if goc.cudagraph_only_prefill else min(512, max_shape)
        if goc.cudagraph_capture_sizes is None:
            goc._set_cudagraph_sizes(max_shape)
        goc.init_with_cudagrpah_size(max_capture_size=max_shape)
        # Not modelled: with expert parallelism 2.4 prepends size 0 here.

    def _disable_sequence_parallel_moe_if_needed(self, role: str) -> None:
        pc = self.parallel_config
        if pc.use_sequence_parallel_moe and self.graph_opt_config.use_cudagraph:
            logger.warning(
                "Sequence parallel MoE is disabled in the %s role with CUDA graphs on.", role
            )
            pc.use_sequence_parallel_moe = False

    def postprocess(self) -> None:
        goc, sc = self.graph_opt_config, self.scheduler_config
        if sc.splitwise_role == "prefill":
            goc.use_cudagraph = goc.cudagraph_only_prefill
        if self.load_config.dynamic_load_weight:
            goc.graph_opt_level = 0
        if self.cache_config.num_cpu_blocks and _stub_version.current() == "develop":
            # r3_mm_dev only: "Layer-by-layer swap-in is incompatible with CUDA Graph prefill
            # capture"; 2.4 to 2.6 keep cudagraph_only_prefill with a host cache.
            goc.cudagraph_only_prefill = False
        if not _stub_version.at_least("2.5"):
            # 2.4: filter first, then the mixed and decode roles turn SP-MoE off.
            self._filter_for_sequence_parallel_moe()
            if sc.splitwise_role == "mixed":
                self._disable_sequence_parallel_moe_if_needed("Mixed")
            elif sc.splitwise_role == "decode":
                self._disable_sequence_parallel_moe_if_needed("PD's decode node")
            return
        # 2.5+: the mixed role turns it off first, so only prefill/decode roles filter.
        if sc.splitwise_role == "mixed":
            self._disable_sequence_parallel_moe_if_needed("Mixed")
        self._filter_for_sequence_parallel_moe()

    def _filter_for_sequence_parallel_moe(self) -> None:
        goc, pc, sc = self.graph_opt_config, self.parallel_config, self.scheduler_config
        if pc.use_sequence_parallel_moe and goc.use_cudagraph:
            if sc.max_num_seqs < pc.tensor_parallel_size:
                pc.use_sequence_parallel_moe = False
            else:  # "it will hang when real batch_size < tp_size"; maps stay stale (upstream bug)
                goc.filter_capture_size(tp_size=pc.tensor_parallel_size)

    def get_max_chunk_tokens(self, mm_max_tokens_per_item: Any = None) -> int:
        del mm_max_tokens_per_item
        return self.scheduler_config.max_num_batched_tokens or self.scheduler_config.max_num_seqs

    def check(self) -> None:
        cap = 512 if _stub_version.at_least("2.6") else 256
        assert self.scheduler_config.max_num_seqs <= cap, (
            f"The parameter `max_num_seqs` is not allowed to exceed {cap}, "
            f"but now it's {self.scheduler_config.max_num_seqs}."
        )
        assert self.scheduler_config.splitwise_role in ("mixed", "prefill", "decode")
        assert not (self.load_config.dynamic_load_weight and self.graph_opt_config.graph_opt_level)
