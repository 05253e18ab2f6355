"""``GpuWorker``: the memory profile that sizes the KV cache, as upstream's (2.4 through develop).

``determine_available_memory()`` runs the profile run and answers
``total * gpu_memory_utilization - used after the profile run - the profile's peak increase +
the profile KV cache's bytes`` (gpu_worker.py); the device is the plugin's simulated runtime's,
whose ``device_memory()`` plays NVML. The profile's peak increase is its KV cache alone here:
the stand-in's dummy runs allocate no activations on that device. ``initialize_kv_cache`` is what
``worker_process.initialize_kv_cache`` does with the answer: blocks of the runner's
``block_bytes``, reduced with MIN over the job's ranks as upstream does (an ``all_reduce`` over the
default group, 2.4 through develop), then ``initialize_cache`` (with ``num_gpu_blocks_override``, no
profile run).

The lifecycle calls go through it as upstream's control path does (``run_control_method`` ->
``GpuWorker.sleep/wakeup/update_weights``, 2.5+; one-line delegations to the runner), and
``graph_optimize_and_warm_up_model`` is upstream's: prefill graphs first in static split mode
(2.5+), then ``capture_model()``, then on 2.6 and develop with ``FD_DETERMINISTIC_MODE=1`` a
``reset_share_inputs()`` that makes a new ``rope_emb`` after the graphs were captured.
"""

from __future__ import annotations

from typing import Any

from fastdeploy import _stub_version, envs
from fastdeploy.worker.gpu_model_runner import GPUModelRunner, _only_from, _simulated_device


class GpuWorker:
    def __init__(self, fd_config: Any, model_runner: GPUModelRunner) -> None:
        self.fd_config = fd_config
        self.cache_config = fd_config.cache_config
        self.model_runner = model_runner

    def cal_theortical_kvcache(self) -> int:
        return self.model_runner.block_bytes

    def determine_available_memory(self) -> int:
        device = _simulated_device()
        before = device.other_used
        self.model_runner.profile_run()
        # Upstream: the peak of max_memory_allocated during the profile run, which holds the
        # profile's KV cache, and then adds that cache back. Here the peak is that cache alone.
        profile_kv = self.cal_theortical_kvcache() * self.cache_config.total_block_num
        peak_increase = max(device.other_used - before, 0) + profile_kv
        free, total = device.device_memory()
        used = total - free
        available = total * self.cache_config.gpu_memory_utilization - used - peak_increase
        available += profile_kv
        return int(available)

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.model_runner.update_share_input_block_num(num_gpu_blocks=num_gpu_blocks)

    def update_weights(self, version: str | None = None, verify_checksum: bool = False) -> Any:
        _only_from("2.5", "update_weights", "GpuWorker")
        return self.model_runner.update_weights(version, verify_checksum)

    def sleep(self, **kwargs: Any) -> None:
        _only_from("2.5", "sleep", "GpuWorker")
        return self.model_runner.sleep(**kwargs)

    def wakeup(self, **kwargs: Any) -> None:
        _only_from("2.5", "wakeup", "GpuWorker")
        return self.model_runner.wakeup(**kwargs)

    def graph_optimize_and_warm_up_model(self) -> None:
        goc = self.fd_config.graph_opt_config
        if _stub_version.at_least("2.5") and goc.graph_opt_level >= 1 and not goc.full_cuda_graph:
            self.model_runner.capture_model_prefill_and_mixed()
        self.model_runner.capture_model()
        if _stub_version.at_least("2.6") and envs.FD_DETERMINISTIC_MODE:
            self.model_runner.share_inputs.reset_share_inputs()


def initialize_kv_cache(worker: GpuWorker) -> int:
    """``PaddleDisWorkerProc.initialize_kv_cache`` on one rank; returns the blocks allocated."""
    override = worker.cache_config.num_gpu_blocks_override
    if override is None:
        blocks = int(worker.determine_available_memory() // worker.cal_theortical_kvcache())
        if blocks <= 0:
            raise ValueError(f"Not enough memory for the KV cache: {blocks} blocks")
        import paddle
        import paddle.distributed as dist

        if dist.get_world_size() > 1:  # a collective every rank must reach
            local = paddle.full(shape=[1], fill_value=blocks, dtype="int32")
            dist.all_reduce(local, op=dist.ReduceOp.MIN)
            blocks = int(local.item())
    else:
        blocks = override
    worker.initialize_cache(num_gpu_blocks=blocks)
    return blocks
