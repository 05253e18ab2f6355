"""Graph memory pools, handed out by policy (``FD_CUDAGRAPH_POOL``).

* ``instance`` (default): one pool per backend, FastDeploy's ``use_unique_memory_pool=true``.
* ``device``: every backend of the process captures into one pool. A graph's outputs stay valid
  only until the next replay of *any* graph in that pool: graphs captured earlier reuse, as
  scratch, memory that later captures' outputs occupy. So sharing is safe only while each
  backend's outputs are consumed before another backend replays. With a draft model (MTP) that
  rule rests on FastDeploy's call order, and ``/v1/sleep`` clears the target only, so the draft
  would keep the shared pool alive: ``device`` is refused with a draft model.
* ``graph``: Paddle's private pool per graph; every graph pays for its own scratch memory. This is
  what FastDeploy's ``use_unique_memory_pool=false`` does.

A shared pool stays until its last user clears its graphs.
"""

from __future__ import annotations

import logging
import weakref

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.runtime import GraphRuntime
from fd_cudagraph_plugin.core.settings import Settings

logger = logging.getLogger("fd_cudagraph_plugin")


class PoolManager:
    def __init__(self, runtime: GraphRuntime) -> None:
        self._runtime = runtime
        self._device_pool: object | None = None
        self._device_users: set[int] = set()

    @property
    def device_users(self) -> frozenset[int]:
        return frozenset(self._device_users)

    def acquire(self, policy: str, user: int) -> object | None:
        """The pool backend ``user`` (its id) captures into; None: a private pool per graph."""
        if policy == "graph":
            return None
        if policy == "instance":
            return self._runtime.new_pool()
        if self._device_pool is None:
            self._device_pool = self._runtime.new_pool()
        self._device_users.add(user)
        return self._device_pool

    def release(self, policy: str, pool: object | None, user: int) -> None:
        """The backend released its graphs; drop the pool if nobody else captures into it."""
        if pool is None:
            return
        if policy == "device":
            self._device_users.discard(user)
            if self._device_users or pool is not self._device_pool:
                logger.info(
                    "CUDA graph pool kept: %d other backend(s) still capture into it, so its "
                    "memory returns when they clear too (FD_CUDAGRAPH_POOL=device).",
                    len(self._device_users),
                )
                return
            self._device_pool = None
        self._runtime.release_pool(pool)


_MANAGERS: weakref.WeakKeyDictionary[object, PoolManager] = weakref.WeakKeyDictionary()


def pools_for(runtime: GraphRuntime) -> PoolManager:
    manager = _MANAGERS.get(runtime)
    if manager is None:
        manager = _MANAGERS[runtime] = PoolManager(runtime)
    return manager


#: Speculative methods without a draft model (FastDeploy's SpecMethod): one backend per process.
_NO_DRAFT_MODEL = (None, "naive", "ngram", "suffix")


def pool_policy(settings: Settings) -> str:
    """The policy for one backend: ``FD_CUDAGRAPH_POOL``, else FastDeploy's setting."""
    options = settings.options
    if options.pool == "device" and settings.speculative_method not in _NO_DRAFT_MODEL:
        raise ConfigError(
            f"FD_CUDAGRAPH_POOL=device cannot be used with speculative method "
            f"{settings.speculative_method!r}: the draft model's graphs would share the target's "
            f"pool, so a draft replay may overwrite target outputs still in use, and /v1/sleep, "
            f"which clears the target only, would free nothing. Unset FD_CUDAGRAPH_POOL (one pool "
            f"per backend)."
        )
    if options.pool_set or settings.use_unique_memory_pool:
        return options.pool
    logger.warning(
        "use_unique_memory_pool=false: every CUDA graph gets a private memory pool, so each "
        "pays for its own scratch memory (36 sizes of a 16-layer toy decoder took 892 MiB this "
        "way against 112 MiB in one pool, on an H200 through a torch stand-in for Paddle). Unset "
        "it, or set FD_CUDAGRAPH_POOL=instance, to share one pool per backend."
    )
    return "graph"
