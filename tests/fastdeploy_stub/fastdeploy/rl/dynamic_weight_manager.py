"""``DynamicWeightManager``: how FastDeploy's RL paths free, re-make and overwrite the weights.

Written from ``rl/dynamic_weight_manager.py`` (2.4 ``2.4_r3``, 2.5 ``r3_ban_cpucache_2.5``, 2.6
``r3_eos_2.6``, develop ``r3_mm_dev``). What a CUDA graph cares about is the address each path
leaves a parameter at:

* ``clear_parameters`` / ``clear_model_weight``: ``param._clear_data()`` on every parameter of
  every model in the list (the memory is freed; the stand-in fills it with NaN first, see
  ``_stub_memory``);
* ``update_parameters`` / ``reload_model_weights``: a new tensor per parameter, handed over with
  ``new._share_buffer_to(param)``: the same ``Parameter`` object at a **new address**;
* ``update_weights_by_rdma`` (rsync, 2.5+): ``param.set_value(new)``, the **same address**; only a
  parameter that is not initialised (after ``clear_model_weight``) on a bootstrap load (no
  ``version``) takes the new tensor's buffer instead.

The runner builds it only with ``load_config.dynamic_load_weight``; its model list is the target
alone on 2.4 and the target and the MTP draft from 2.5. Not modelled: communication groups, DeepEP,
the IPC / snapshot / rsync transports and the weight-status signals. What a "load" reads is
``checkpoint`` (a test hook: name -> tensor, the values found at construction until a test puts a
trainer's new values there). Names are prefixed with the model's place in the list, because the
stand-in's target and draft share parameter names.
"""

from __future__ import annotations

from typing import Any

import paddle
from fastdeploy import _stub_memory


class DynamicWeightManager:
    def __init__(self, fd_config: Any, models: Any, local_rank: int = 0) -> None:
        self.fd_config = fd_config
        self.load_config = fd_config.load_config
        self.local_rank = local_rank
        self.model_list = models if isinstance(models, list) else [models]
        self.state_dict: dict[str, paddle.Tensor] = {}
        for index, model in enumerate(self.model_list):
            for name, param in model.state_dict().items():
                self.state_dict[f"{index}.{name}"] = param
        #: Test hook: what the next load reads (a trainer's snapshot or rsync stream).
        self.checkpoint = {name: p.detach().clone() for name, p in self.state_dict.items()}
        self.first_load = False  # the stand-in's models were built with their weights

    # -- legacy RL path (clear_load_weight / update_model_weight) --------------------------------
    def clear_parameters(self, pid: int = 0, shutdown_process_group: bool = False) -> None:
        self.clear_model_weight()

    def update_parameters(self, pid: int = 0, restart_process_group: bool = False) -> None:
        self._load_new_tensors()

    def finalize_update(self, pid: int = 0) -> None:
        return None

    def _log_memory(self, message: str) -> None:
        return None

    # -- sleep / wakeup("weight") (2.5+) ---------------------------------------------------------
    def clear_model_weight(self) -> None:
        for param in self.state_dict.values():
            _stub_memory.release(param)
            param._clear_data()

    def reload_model_weights(self) -> None:
        if self.load_config.load_strategy not in ("ipc_snapshot", "ipc"):
            raise ValueError(f"Unsupported strategy: {self.load_config.load_strategy}")
        self._load_new_tensors()

    def _load_new_tensors(self) -> None:
        with paddle.no_grad():
            for name, param in self.state_dict.items():
                new = self.checkpoint[name].clone()
                new._share_buffer_to(param)

    # -- /v1/update_weights (rsync, 2.5+) --------------------------------------------------------
    def update_weights_by_rdma(self, version: str | None = None, verify_checksum: bool = False):
        bootstrap_load = version is None or version == ""
        with paddle.no_grad():
            for name, param in self.state_dict.items():
                new = self.checkpoint[name]
                if bootstrap_load and not param._is_initialized():
                    new.clone()._share_buffer_to(param)
                else:
                    param.set_value(new)
        return {"version": version, "rank": self.local_rank}
